"""`bench cuts` on a tiny configuration: a tiny randomly initialised Llama (8 layers) and a random
head stand in for SmolLM2 and a trained head (the bench's arithmetic and the engine's in-round
cuts are the same code; only its figures need the real model)."""

import pytest
import torch

from bench.cuts import CutsBenchConfig, run_bench, verdict
from online_spec.config import ConfigError
from online_spec.head import new_head
from online_spec.target import tiny_target


def test_verdict_needs_every_repeat_on_one_side_of_one():
    assert verdict([1.02, 1.05, 1.01]) == "pay"
    assert verdict([0.97, 0.99, 0.98, 0.90]) == "cost"
    assert verdict([1.05, 0.99, 1.02]) == "within noise"
    assert verdict([1.2, 1.3]) == "too few repeats"


def test_config_refuses_bad_values():
    with pytest.raises(ConfigError, match="batch_sizes"):
        CutsBenchConfig(batch_sizes=[0])
    with pytest.raises(ConfigError, match="repeats"):
        CutsBenchConfig(repeats=0)


def test_bench_serves_both_arms_alike_and_the_off_arm_verifies_every_draft():
    torch.manual_seed(0)
    target = tiny_target(num_layers=8)
    head = new_head(target, draft_vocab_size=256, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (12,), generator=g).tolist() for _ in range(6)]
    cfg = CutsBenchConfig(batch_sizes=[1, 3], repeats=3, new_tokens=10, requests_per_run=4, max_steps=4)
    out = run_bench(cfg, target, head, prompts)
    assert set(out["by_batch"]) == {"1", "3"} and out["config"]["repeats"] == 3
    for row in out["by_batch"].values():
        assert row["same_tokens"]  # greedy fp32: the cuts never change the output
        assert len(row["paired_ratios"]) == 3 and row["verdict"] == verdict(row["paired_ratios"])
        assert row["on_over_off_range"] == [min(row["paired_ratios"]), max(row["paired_ratios"])]
        off, on = row["off"], row["on"]
        assert off["verified"] == pytest.approx(off["drafted"])  # no cut: every draft made is verified
        assert on["verified"] <= on["drafted"] + 1e-9
        assert all(arm["tokens_per_s"] > 0 and arm["decision_us"] > 0 for arm in (on, off))
        assert len(on["tokens_per_s_repeats"]) == 3
