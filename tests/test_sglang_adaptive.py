"""`OnlineSpecAdaptiveParams` (the plugin's replacement) decides like SGLang's own
`AdaptiveSpeculativeParams`, run as shipped on CPU (tests/sglang_adaptive_ref.py), on recorded
random traces, with and without CUDA-graph batch-size padding; and re-warms on a new head."""

import json
import random

import pytest

from serving.sglang_adaptive import LIVE_POLICIES, OnlineSpecAdaptiveParams
from sglang_adaptive_ref import load_sglang_adaptive

CFG = {"ema_alpha": 0.3, "warmup_batches": 2, "update_interval": 3,
       "1": {"candidate_steps": [0, 1, 3, 5], "up_hysteresis": 0.1, "down_hysteresis": -0.2},
       "8": {"candidate_steps": [1, 2, 4], "ceiling_coeff": 1.5},
       "32": {"candidate_steps": [0, 1, 2], "up_hysteresis": 0.0, "down_hysteresis": 0.0}}


@pytest.fixture(scope="module")
def ref():
    module, version = load_sglang_adaptive()
    assert module is not None, version
    return module


def _trace(seed, n=400):
    rng = random.Random(seed)
    return [(rng.choice([1, 3, 7, 8, 13, 31, 32, 64]), rng.random()) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("graph_bs", [None, [1, 2, 4, 8, 16, 32, 48]])
def test_same_decisions_as_sglang(ref, tmp_path, seed, graph_bs):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(CFG))
    ours, theirs = OnlineSpecAdaptiveParams(3, str(path)), ref.AdaptiveSpeculativeParams(3, str(path))
    ours.set_cuda_graph_bs(graph_bs)
    theirs.set_cuda_graph_bs(graph_bs)
    assert ours.candidate_steps == theirs.candidate_steps
    for k in ours.candidate_steps:
        assert ours.cuda_graph_bs_for_step(k) == theirs.cuda_graph_bs_for_step(k)
    rng, changes = random.Random(seed), 0
    for bs, level in _trace(seed):
        k = theirs.get_steps_for_batch(bs)
        assert ours.get_steps_for_batch(bs) == k
        accepted = [min(k, int(rng.random() * (k + 1) * level * 2)) for _ in range(bs)]
        a, b = ours.on_verify_complete(accepted, bs), theirs.on_verify_complete(accepted, bs)
        assert a == b
        changes += a is not None
    assert changes > 0  # the trace moved K, so the comparison covered decisions


def test_default_config_comes_from_sglang_and_rewarm_resets_ema(ref):
    OnlineSpecAdaptiveParams.default_config = staticmethod(lambda: ref.DEFAULT_ADAPTIVE_CONFIG)
    try:
        p = OnlineSpecAdaptiveParams(3)
        assert p.candidate_steps == ref.AdaptiveSpeculativeParams(3).candidate_steps
        assert p in set(LIVE_POLICIES)
        k = p.get_steps_for_batch(1)
        for _ in range(3):
            p.on_verify_complete([0], 1)
        state = p.policy.info()["slots"]
        assert any(s["ema"] != k - 1 or s["batches"] for s in state.values())
        p.rewarm()
        assert all(s["batches"] == 0 and s["ema"] == s["steps"] - 1 for s in p.policy.info()["slots"].values())
    finally:
        OnlineSpecAdaptiveParams.default_config = None
