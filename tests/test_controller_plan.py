"""`BatchPlan`'s in-round rules (online_spec/controller/plan.py) against the policy's own.

A plan answers the engine's in-round calls from what it precomputed: the padded verify cut
divides by the plan's round seconds per K and length (`plan_seconds`) on Python floats, and the
early stop bins the engine's list of per-request probabilities inline (`continue_on`). Each is
checked over a grid of batches, draft counts, confidences (edge values included) and round-time
coefficients against the general paths they shortcut: `verify_cut` on numpy, the policy's own
`verify_lengths` / `should_continue`, and the rule written out naively. A batch of one has
its own shortcuts: the early stop reads a verdict per confidence bin (`BatchPlan.go1`) and the
cut runs one row in one frame (`BatchPlan.padded_lengths`).
"""

import random

import numpy as np
import pytest

import online_spec.controller.plan as plan_mod
from online_spec.controller import AdaptiveConfig, CostModel, CostModelPolicy, CostPolicyConfig
from online_spec.controller.acceptance import CalibrationTable
from online_spec.controller.plan import continue_on, verify_cut

EDGES = [0.0, 1.0, -0.5, 1.5, float("nan"), 0.99999994, 0.05, 0.1, 0.95]


def learnt_policy(rng: random.Random, depth: int = 7) -> CostModelPolicy:
    """A cost policy with random round-time coefficients that has learnt a few random rounds."""
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": list(range(depth + 1))}})
    draft = (rng.uniform(0.0005, 0.02), rng.uniform(0, 0.001), 0.0, rng.uniform(0, 0.01), 0.0)
    verify = (rng.uniform(0.01, 0.2), rng.uniform(0, 0.004), rng.uniform(0.0002, 0.03), 0.0, rng.uniform(0, 0.002))
    p = CostModelPolicy(adaptive, CostPolicyConfig(prior_accept=rng.uniform(0.3, 0.9)),
                        CostModel.with_coefficients(draft, verify))
    for _ in range(rng.randint(0, 6)):
        b, k = rng.randint(1, 8), rng.randint(1, depth)
        conf = np.array([[rng.random() ** rng.choice([0.2, 1.0, 3.0]) for _ in range(k)] for _ in range(b)],
                        dtype=np.float32)
        p.update(b, [rng.randint(0, k) for _ in range(b)], num_steps=k, confidences=conf)
    return p


def confidences(rng: random.Random, b: int, k: int) -> np.ndarray:
    """The engine's float32 [B, K] draft probabilities, now and then an edge value."""
    return np.array([[rng.choice(EDGES) if rng.random() < 0.1 else rng.random() ** rng.choice([0.2, 1.0, 3.0])
                      for _ in range(k)] for _ in range(b)], dtype=np.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # NaN: bin 0, as documented
def test_the_plans_padded_cut_is_verify_cut_over_a_grid(monkeypatch):
    rng = random.Random(17)
    cuts = set()
    for case in range(40):
        p = learnt_policy(rng)
        for b in (1, 2, 3, 4, 7, 8, 12, 16, 20):
            ctx = rng.choice([0, 150, 900])
            plan = p.plan(b, ctx)
            for k in range(1, 8):
                conf = confidences(rng, b, k)
                with monkeypatch.context() as m:
                    if b * k <= plan_mod.PADDED_PYTHON and (k > 1 or b <= plan_mod.SMALL_BATCH):
                        m.setattr(plan_mod, "verify_cut", None)  # the plan's own path, or a TypeError
                    fast = plan.verify_lengths(conf, padded=True)
                with monkeypatch.context() as m:
                    m.setattr(plan_mod, "PADDED_PYTHON", 0)  # verify_cut on numpy
                    reference = verify_cut(conf, plan.calib, plan.terms, plan.verify_token_s, padded=True)
                assert fast == reference, (case, b, k)
                assert fast == p.verify_lengths(conf, ctx, padded=True)  # the live policy, same state
                assert plan.verify_lengths(conf, padded=True, keep_all=True) == [k] * b
                cuts.add(("none" if fast[0] == 0 else "all" if fast[0] == k else "inside", b == 1))
    # the grid reaches every kind of cut, at batch 1 (its own loop) and above
    assert cuts == {(kind, one) for kind in ("none", "all", "inside") for one in (True, False)}


def naive_continue(terms, probs, calib) -> bool:
    """One more draft pays: (E + S p a) / t_next > E / t_now with p the mean calibrated
    confidence, cross-multiplied, each step written out."""
    if terms is None:
        return False
    t_now, t_more, expected, surv, a_next = terms
    p = 0.0
    for c in probs:
        p += calib(c)
    p /= len(probs)
    return (surv * p) * a_next * t_now > (expected + surv * p) * t_more


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_the_early_stop_on_the_engines_lists_is_the_rule_over_a_grid():
    rng = random.Random(23)
    verdicts = set()
    for _ in range(60):
        p = learnt_policy(rng)
        for b in (1, 2, 4, 16, 17):
            ctx = rng.choice([0, 400])
            plan = p.plan(b, ctx)
            for step in range(1, 8):
                column = confidences(rng, b, 1)[:, 0]
                as_list = column.tolist()  # the engine's per-step probabilities
                terms = plan.stops[step - 1] if step <= len(plan.stops) else None
                got = plan.should_continue(step, as_list)
                assert got == naive_continue(terms, as_list, plan.calib)
                assert got == plan.should_continue(step, column)  # the numpy column
                assert got == continue_on(terms, column, plan.calib)
                assert got == p.should_continue(step, as_list, b, ctx)  # the live policy
                if b == 1:
                    assert got == plan.should_continue(step, as_list[0])
                    assert got == plan.continue_one(step, as_list[0])  # the plan's table by bin
                else:
                    assert plan.go1 == ()  # built for a batch of one only
                verdicts.add(got)
    assert verdicts == {True, False}


def test_plan_seconds_are_the_round_line():
    """seconds[k][L]: k drafted, L verified per request, from the round terms (floored at 0)."""
    terms = (0.01, 0.05, 0.002, 0.004, 0.001)  # step, verify base, per token, draft extra, verify extra
    seconds = plan_mod.plan_seconds(terms, 3)
    assert len(seconds) == 4 and [len(s) for s in seconds] == [1, 2, 3, 4]
    assert seconds[2][0] == pytest.approx(2 * 0.01 + 0.004 + 0.05 + 0.002)
    assert seconds[2][2] == pytest.approx(2 * 0.01 + 0.004 + 0.05 + 0.002 * 3 + 0.001)
    negative = plan_mod.plan_seconds((0.01, -1.0, 0.002, -0.5, 0.0), 1)  # a verify line below 0 costs nothing
    assert negative[1] == (1e-12, 1e-12)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_the_early_stop_bins_each_confidence_as_the_calibration_does():
    """Named boundaries: with terms (t_now 1, t_more x, E 1, S 1, a 1) one more draft pays
    exactly when the calibrated confidence exceeds x / (1 - x) = theta; theta between every two
    neighbouring bins' values tells the bin each confidence (edge values included) fell in."""
    p = learnt_policy(random.Random(3))
    calib = p.plan(1).calib
    values = sorted(set(calib.lookup))
    for theta in [(lo + hi) / 2 for lo, hi in zip(values, values[1:])]:
        terms = (1.0, theta / (1 + theta), 1.0, 1.0, 1.0)
        for c in EDGES + [j / 10 + 0.05 for j in range(10)]:
            want = calib(c) > theta
            assert continue_on(terms, [float(c)], calib) == want, (c, theta)
            assert continue_on(terms, [float(c)] * 3, calib) == want
            assert continue_on(terms, float(c), calib) == want


def test_a_one_draft_batch_over_small_batch_takes_numpy(monkeypatch):
    """numpy sums a single column in blocks of eight, so a [B > SMALL_BATCH, 1] cut stays on
    `verify_cut`'s numpy path (the plan's Python sum would add in another order)."""
    plan = learnt_policy(random.Random(4)).plan(20)
    calls = []
    monkeypatch.setattr(plan_mod, "verify_cut", lambda *a, **k: calls.append(a[0].shape) or [1] * 20)
    plan.verify_lengths(np.full((plan_mod.SMALL_BATCH, 1), 0.5, dtype=np.float32), padded=True)
    assert calls == []
    plan.verify_lengths(np.full((plan_mod.SMALL_BATCH + 1, 1), 0.5, dtype=np.float32), padded=True)
    assert calls == [(plan_mod.SMALL_BATCH + 1, 1)]


@pytest.mark.parametrize("b", [1, 2])
def test_a_tie_between_cuts_keeps_the_longer(b):
    """Every draft survives (calibrated 1.0) and one verified draft doubles the round's seconds:
    verifying it or not gives the same tokens a second, and the cut keeps it, at batch 1 (its own
    loop) as above, as `verify_cut` does."""
    calib = CalibrationTable([1.0] * 11, np.ones(10))
    terms = (0.0, 0.0, 1.0, 0.0, 0.0)  # step, verify base, per token, draft extra, verify extra
    plan = plan_mod.BatchPlan(b, 0.0, 1, (), calib, terms, 1.0, 1.0, plan_mod.plan_seconds(terms, 2))
    assert plan.seconds[1] == (1.0, 2.0)
    conf = np.full((b, 1), 0.5, dtype=np.float32)
    assert plan.verify_lengths(conf, padded=True) == [1] * b
    assert verify_cut(conf, calib, terms, 1.0, padded=True) == [1] * b


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_the_early_stops_tally_serves_the_padded_cut_over_a_grid():
    """`tally_step` bins a step's list once for both rules: its mean is the early stop's p_last,
    and the cut from its running survivals (`tallied_lengths`, the last column binned there or
    tallied too) is the plan's padded cut of the whole array."""
    rng = random.Random(29)
    tallied = 0
    for _ in range(30):
        p = learnt_policy(rng)
        for b in (2, 3, 4, 8, 16):
            plan = p.plan(b, rng.choice([0, 300]))
            lookup = plan.calib.lookup
            for k in range(1, 8):
                conf = confidences(rng, b, k)
                sv, gain = None, []
                for step in range(1, k + 1):
                    column = conf[:, step - 1].tolist()
                    sv, g, p_last = plan_mod.tally_step(sv, column, lookup, len(lookup) - 1)
                    gain.append(g)
                    assert p_last == plan.calib.mean(column)
                    terms = plan.stops[step - 1] if step <= len(plan.stops) else None
                    assert plan_mod.continue_p(terms, p_last) == continue_on(terms, column, plan.calib)
                    if step >= k - 1:  # the engine's early stop tallies K - 1 steps, or K when it stopped
                        cut = plan.tallied_lengths(conf, list(sv), list(gain))
                        assert cut == plan.padded_lengths(conf), (b, k, step)
                        tallied += cut is not None
                assert plan.tallied_lengths(conf, list(sv), gain[:k - 2]) is None  # too few steps tallied
                assert plan.tallied_lengths(conf, None, []) is None
    assert tallied > 500
