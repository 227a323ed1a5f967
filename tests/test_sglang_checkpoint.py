"""A head written by `online_spec.checkpoint.save_head` is accepted by SGLang's
`LlamaForCausalLMEagle3.load_weights` name handling: that method, executed unchanged from the
installed `models/llama_eagle3.py`, on a stand-in module (the real one needs CUDA layers) whose
parameters are the SGLang names (`model.fc.weight`, `model.layers.0...qkv_proj`, ...) and whose
weight loaders record what they get. Shapes of the fused projections are checked by stacking."""

import ast
from typing import Iterable, Tuple

import torch

from online_spec.checkpoint import head_tensors
from online_spec.head import new_head
from serving.sglang_client import SKIPPED_TENSORS
from sglang_source import class_def


class _Param:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def weight_loader(self, param, w, shard=None):
        self.log.append((self.name, shard, tuple(w.shape)))


def _sglang_param_names(tensors):
    out = set()
    for n in tensors:
        n = n.replace("midlayer", "layers.0")
        for a, b in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                     (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            n = n.replace(a, b)
        out.add(n if n == "lm_head.weight" else f"model.{n}")
    return out


def test_saved_head_names_land_on_sglang_params(tiny):
    head = new_head(tiny, draft_vocab_size=64, seed=2)
    tensors = head_tensors(head)
    log = []
    params = {n: _Param(n, log) for n in _sglang_param_names(tensors)}
    src = class_def("srt/models/llama_eagle3.py", "LlamaForCausalLMEagle3")
    load = next(f for f in src.body if getattr(f, "name", "") == "load_weights")
    ns = {"torch": torch, "Iterable": Iterable, "Tuple": Tuple, "default_weight_loader": None}
    exec(compile(ast.Module(body=[load], type_ignores=[]), "llama_eagle3.py", "exec"), ns)
    stand_in = type("Eagle3StandIn", (), {"named_parameters": lambda self: params.items()})()
    ns["load_weights"](stand_in, list(tensors.items()))
    loaded = {name for name, _, _ in log}
    assert loaded == set(params) - {"model.d2t", "model.t2d"}  # every weight tensor reached a parameter
    shards = sorted(s for n, s, _ in log if n.endswith("qkv_proj.weight"))
    assert shards == ["k", "q", "v"]
    assert sorted(s for n, s, _ in log if n.endswith("gate_up_proj.weight")) == [0, 1]
    # d2t becomes SGLang's hot_token_id (the swap client never sends it); t2d is ignored
    assert torch.equal(stand_in.hot_token_id, tensors["d2t"] + torch.arange(tensors["d2t"].shape[0]))
    assert set(SKIPPED_TENSORS) == {"d2t", "t2d"}
