"""The SGLang plugin against the installed SGLang 0.5.23 (no GPU: SGLang's workers need CUDA).

Checked here: every hooked target exists with the signature the hooks assume (parsed from the
installed files with ast: those modules import CUDA kernels); registration runs through
SGLang's real `load_plugins()` with this package's entry point (a dist-info built from
pyproject.toml, found by importlib.metadata as an installed one would be); off by default; an
unknown version disables it with one warning; records built from SGLang-shaped rows pass the
real wire codec. Not checked (needs a GPU server): that SGLang's result tensors hold the rows
the capture hooks slice (docs/sglang.md lists this).
"""

import logging
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from collector.wire import decode, encode
from serving import sglang_plugin
from serving.sglang_capture import CaptureHooks, prefill_record, verify_record
from serving.sglang_plugin import TARGETS, SglangPluginConfig
from sglang_source import arg_names, function_def, import_srt, sglang_root

ROOT = Path(__file__).resolve().parents[1]
_FILES = {
    "decode": ("srt/managers/scheduler_components/batch_result_processor.py",
               "SchedulerBatchResultProcessor.process_batch_result_decode", ["self", "batch", "result"]),
    "prefill": ("srt/managers/scheduler_components/batch_result_processor.py",
                "SchedulerBatchResultProcessor.process_batch_result_prefill", ["self", "batch", "result"]),
    "final_hidden": ("srt/layers/logits_processor.py", "LogitsProcessor._get_last_hidden_states_to_store",
                     ["self", "hidden_states", "aux_hidden_states", "logits_metadata"]),
    "weights": ("srt/managers/scheduler_components/weight_updater.py",
                "SchedulerWeightUpdaterManager.update_weights_from_tensor", ["self", "recv_req"]),
    "scheduler_init": ("srt/managers/scheduler.py", "Scheduler.__init__", ["self", "server_args", "port_args"]),
}


@pytest.mark.parametrize("key", sorted(_FILES))
def test_hooked_methods_exist_with_the_assumed_signature(key):
    rel, qual, args = _FILES[key]
    assert TARGETS[key] == "sglang." + rel[:-3].replace("/", ".") + "." + qual
    assert arg_names(function_def(rel, qual)) == args


def test_replaced_policy_class_has_the_interface_the_adapter_offers():
    rel = "srt/speculative/adaptive_spec_params.py"
    assert TARGETS["policy"].endswith("adaptive_spec_params.AdaptiveSpeculativeParams")
    assert arg_names(function_def(rel, "AdaptiveSpeculativeParams.__init__")) == ["self", "initial_steps", "cfg_path"]
    from serving.sglang_adaptive import OnlineSpecAdaptiveParams
    for name in ("set_cuda_graph_bs", "get_steps_for_batch", "on_verify_complete", "cuda_graph_bs_for_step",
                 "candidate_steps"):
        function_def(rel, f"AdaptiveSpeculativeParams.{name}")
        assert hasattr(OnlineSpecAdaptiveParams, name)
    # the worker builds it with these keywords and the controller calls these methods
    worker = (sglang_root() / "srt/speculative/eagle_worker_v2.py").read_text()
    assert "AdaptiveSpeculativeParams(\n                    initial_steps=" in worker
    runtime = (sglang_root() / "srt/speculative/adaptive_runtime_state.py").read_text()
    for call in ("params.get_steps_for_batch(", "params.on_verify_complete(", "params.set_cuda_graph_bs(",
                 "params.cuda_graph_bs_for_step("):
        assert call in runtime


def test_request_and_result_fields_the_capture_reads_exist():
    sb = (sglang_root() / "srt/managers/schedule_batch.py").read_text()
    for attr in ("self.prefix_len: int", "self.origin_input_ids = ", "self.output_ids = ", "self.rid = ",
                 "self.is_retracted"):
        assert attr in sb, attr
    utils = (sglang_root() / "srt/managers/utils.py").read_text()
    for field in ("speculative_output_stride:", "speculative_num_draft_tokens:", "extend_input_len_per_req"):
        assert field in utils, field
    lp = (sglang_root() / "srt/layers/logits_processor.py").read_text()
    assert "last_hidden_states: Optional[torch.Tensor] = None" in lp


@pytest.fixture()
def loader(tmp_path, monkeypatch):
    """SGLang's real plugin loader, seeing this package's entry point from pyproject.toml."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    dist = tmp_path / "online_spec_under_test-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: online-spec-under-test\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", ",".join(eps))  # only ours, whatever else is installed
    plugins = import_srt("sglang.srt.plugins")
    registry = import_srt("sglang.srt.plugins.hook_registry").HookRegistry
    registry.reset()
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "apply_hooks", classmethod(lambda cls: None))  # targets need CUDA
    yield plugins, registry, eps
    registry.reset()


def test_entry_point_is_declared_for_sglangs_group(loader):
    plugins, _, eps = loader
    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert eps == {"online_spec": "serving.sglang_plugin:register"}


def test_loader_runs_register_and_hooks_are_registered_under_our_name(loader, monkeypatch):
    plugins, registry, _ = loader
    monkeypatch.setenv("ONLINE_SPEC_SGLANG", "1")
    monkeypatch.setenv("ONLINE_SPEC_SGLANG_POLICY", "1")
    plugins.load_plugins()
    assert set(registry._hooks) == set(TARGETS.values())
    for target, hooks in registry._hooks.items():
        assert [src.plugin_name for _, _, src in hooks] == ["online_spec"], target
    kinds = {t: [h[0].name for h in hs] for t, hs in registry._hooks.items()}
    assert kinds[TARGETS["policy"]] == ["REPLACE"] and kinds[TARGETS["decode"]] == ["AROUND"]
    assert kinds[TARGETS["weights"]] == ["AFTER"]


def test_loader_with_plugin_off_registers_nothing(loader, monkeypatch):
    plugins, registry, _ = loader
    monkeypatch.delenv("ONLINE_SPEC_SGLANG", raising=False)
    plugins.load_plugins()
    assert dict(registry._hooks) == {}


def test_unknown_version_disables_with_one_warning(loader, monkeypatch, caplog):
    _, registry, _ = loader
    monkeypatch.setenv("ONLINE_SPEC_SGLANG", "1")
    monkeypatch.setattr(sglang_plugin.importlib.metadata, "version", lambda name: "9.9.9")
    with caplog.at_level(logging.WARNING):
        assert sglang_plugin.register() == []
    assert dict(registry._hooks) == {}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "9.9.9" in warnings[0].getMessage()


def test_final_hidden_hook_keeps_post_norm_rows_only_in_full_aux_mode():
    full = SimpleNamespace(capture_hidden_mode=SimpleNamespace(is_full=lambda: True))
    last = SimpleNamespace(capture_hidden_mode=SimpleNamespace(is_full=lambda: False))
    h, aux = torch.randn(3, 4), torch.randn(3, 12)
    none = lambda self, *a: None  # noqa: E731 - SGLang's result when it keeps nothing
    assert sglang_plugin.around_last_hidden(none, None, h, aux, full) is h
    assert sglang_plugin.around_last_hidden(none, None, h, aux, last) is None
    assert sglang_plugin.around_last_hidden(none, None, h, None, full) is None


def test_records_from_sglang_rows_pass_the_wire_codec():
    H = 8
    rec = verify_record("r1", [5, 6, 7], [8, 9, 10], torch.randn(3, 3 * H), torch.randn(3, H), 4, 2)
    rec.validate()
    assert rec.first_pos == 2 and rec.tokens.tolist() == [7, 8, 9, 10] and rec.accept_len == 2
    back = decode(encode(rec, "float32"))
    assert back.tokens.tolist() == [7, 8, 9, 10] and torch.equal(back.features, rec.features)
    # prefix-cache hit: the first record starts at 3, not 0 (an explicit gap for the subscriber)
    pre = prefill_record("r1", [1, 2, 3, 4, 5, 6], 3, 11, torch.randn(3, 3 * H), torch.randn(3, H), 1, 0)
    pre.validate()
    assert pre.first_pos == 3 and pre.tokens.tolist() == [4, 5, 6, 11]
    chunk = prefill_record("r1", [1, 2, 3, 4, 5, 6], 0, None, torch.randn(2, 3 * H), torch.randn(2, H), 1, 0)
    assert chunk.tokens.tolist() == [1, 2, 3]  # a middle chunk: the next input token follows
    assert prefill_record("r1", [1, 2], 0, None, torch.randn(2, 3 * H), torch.randn(2, H), 1, 0) is None


def test_decode_hook_slices_committed_rows_per_request_by_stride():
    """Stand-ins shaped like SGLang's Req/ScheduleBatch/GenerationBatchResult (the real ones
    need CUDA); the original commit is simulated by extending output_ids."""
    H, stride = 4, 4
    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids=[1, 2], output_ids=[3], prefix_len=0,
                            is_retracted=False, finished=lambda: False) for i in range(2)]
    batch = SimpleNamespace(reqs=reqs, spec_algorithm=SimpleNamespace(is_none=lambda: False))
    feats = torch.arange(2 * stride, dtype=torch.float32)[:, None].repeat(1, 3 * H)
    result = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=feats, last_hidden_states=feats[:, :H]),
                             speculative_output_stride=stride, speculative_num_draft_tokens=stride)
    sent = []
    hooks = CaptureHooks(SglangPluginConfig(enabled=True))
    hooks._publisher = SimpleNamespace(should_capture=lambda rid: True, submit=sent.extend,
                                       end_request=lambda rid: None)

    def commit(processor, b, r):
        reqs[0].output_ids += [10, 11]  # one draft accepted + bonus
        reqs[1].output_ids += [20]      # nothing accepted, bonus only

    hooks.around_decode(commit, None, batch, result)
    assert [r.request_id for r in sent] == ["r0", "r1"]
    assert sent[0].features[:, 0].tolist() == [0.0, 1.0] and sent[1].features[:, 0].tolist() == [4.0]
    assert sent[0].first_pos == 2 and sent[0].tokens.tolist() == [3, 10, 11] and sent[1].accept_len == 0
    assert hooks.enabled


def test_capture_refuses_sglang_trees_at_start_up():
    """A tree's rows cannot be aligned at the decode hook: capture with topk > 1 fails the
    scheduler's start with a message saying what to change; chains (and SGLang's unset topk) pass."""
    for topk in (None, 1):
        assert sglang_plugin.refuse_tree_capture("built", None, SimpleNamespace(speculative_eagle_topk=topk)) == "built"
    with pytest.raises(sglang_plugin.TreeCaptureRefused, match="--speculative-eagle-topk 1.*ONLINE_SPEC_CAPTURE=0"):
        sglang_plugin.refuse_tree_capture(None, None, SimpleNamespace(speculative_eagle_topk=4))
