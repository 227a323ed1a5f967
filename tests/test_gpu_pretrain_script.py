"""scripts/gpu_pretrain.py's CPU-side parts (its training runs on a lent GPU): the --heads spec and
the held-out spans whose generated rows the simulation anchors on."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_pretrain  # noqa: E402

from online_spec.head import new_head  # noqa: E402
from tests.distill_helpers import greedy_records, tiny8  # noqa: E402
from trainer.evaluate import simulate_acceptance  # noqa: E402


def test_heads_spec():
    assert gpu_pretrain.parse_heads("chat=sharegpt_chat:6:sharegpt,code=sharegpt_code+humaneval:4.5") == [
        ("chat", ["sharegpt_chat"], 6.0, ["sharegpt"]),
        ("code", ["sharegpt_code", "humaneval"], 4.5, ["sharegpt_code", "humaneval"])]
    with pytest.raises(SystemExit, match="poetry"):
        gpu_pretrain.parse_heads("x=poetry:1")
    with pytest.raises(SystemExit, match="poetry"):
        gpu_pretrain.parse_heads("x=sharegpt:1:poetry")


def test_heldout_spans_anchor_on_generated_rows():
    target = tiny8()
    _, seqs = greedy_records(target, num=3, new_tokens=12, seed=2)
    prompt_lens = [8, 5, 10]
    spans = gpu_pretrain.records_of(target, seqs, "h", prompt_lens=prompt_lens)
    for span, p, s in zip(spans, prompt_lens, seqs):
        assert span.num_rows == len(s) - 1
        assert span.is_prefill[:p].all() and not span.is_prefill[p:].any()
    head = new_head(target, 256, seed=0).float()
    sim = simulate_acceptance(head, target, spans, max_steps=2, ks=(2,), generated_only=True)
    # anchors from the last prompt row (the engine's first draft, row p - 1) to row n - 3 of n tokens
    # (the draft from row n - 2 would be checked against the target's choice after the last row)
    assert sim["anchors"] == sum(len(s) - p - 1 for s, p in zip(seqs, prompt_lens))
