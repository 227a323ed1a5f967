"""Head checkpoint codec: SGLang layout round trip, and every kind of invalid checkpoint refused
with a reason that names it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from online_spec.checkpoint import CheckpointError, WEIGHTS, load_head, save_head
from online_spec.head import new_head


@pytest.fixture()
def saved(tiny, tmp_path):
    head = new_head(tiny, draft_vocab_size=64, seed=1)
    d = tmp_path / "head"
    save_head(head, d, version=7)
    return head, d


def _rewrite(d, mutate):
    t = load_file(str(d / WEIGHTS))
    mutate(t)
    save_file(t, str(d / WEIGHTS))
    meta = json.loads((d / "online_spec.json").read_text())
    meta.pop("digest")
    (d / "online_spec.json").write_text(json.dumps(meta))


def test_round_trip_is_exact_and_sglang_shaped(tiny, saved):
    head, d = saved
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 64
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(tiny.info.aux_layer_ids)
    assert cfg["target_hidden_size"] == tiny.info.hidden_size
    assert cfg["rope_theta"] == tiny.info.rope_theta
    names = set(load_file(str(d / WEIGHTS)))
    assert not any("embed" in n for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    loaded, meta = load_head(d, tiny.info)
    assert meta["version"] == 7
    for (n, a), (m, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: t.pop("norm.weight"), "missing tensors"),
    (lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(4, 4)), "unexpected tensors"),
    (lambda t: t.__setitem__("fc.weight", torch.zeros(3, 3)), "fc.weight has shape"),
    (lambda t: t.__setitem__("norm.weight", t["norm.weight"].to(torch.int32)), "norm.weight has dtype"),
    (lambda t: t["lm_head.weight"].__setitem__((0, 0), float("nan")), "non-finite"),
    (lambda t: t.__setitem__("t2d", torch.zeros_like(t["t2d"])), "t2d does not mark"),
    (lambda t: t["d2t"].__setitem__(0, 10_000), "outside the target vocabulary"),
])
def test_invalid_tensors_are_refused_with_reason(tiny, saved, mutate, reason):
    _, d = saved
    _rewrite(d, mutate)
    with pytest.raises(CheckpointError, match=reason):
        load_head(d, tiny.info)


def test_pickle_digest_config_and_target_mismatch_refused(tiny, saved, tmp_path):
    head, d = saved
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="pickle"):
        load_head(d)
    (d / "pytorch_model.bin").unlink()
    raw = bytearray((d / WEIGHTS).read_bytes())
    raw[-1] ^= 1
    (d / WEIGHTS).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        load_head(d)
    save_head(head, d, version=1)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_head(d)
    save_head(head, d, version=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1.0
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_theta"):
        load_head(d, tiny.info)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_head(tmp_path / "nowhere")


def test_vocab_map_must_match_the_live_head(tiny, saved):
    head, d = saved
    other = new_head(tiny, draft_vocab_size=64, token_counts=torch.arange(tiny.info.vocab_size).float())
    with pytest.raises(CheckpointError, match="vocabulary map differs"):
        load_head(d, tiny.info, expect_vocab=(other.d2t, other.t2d))
    load_head(d, tiny.info, expect_vocab=(head.d2t, head.t2d))
