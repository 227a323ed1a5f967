"""CostModelPolicy: the round-time fit, acceptance estimates, and the choose / early-stop /
verify-length rules on named boundary cases, each checked against a naive reference."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import statistics
from collections import Counter

import numpy as np
import pytest

from online_spec.config import ConfigError
from online_spec.controller import (AdaptiveConfig, CostModel, CostModelConfig, CostModelPolicy, CostPolicyConfig,
                                    StepPolicy, measure_decision_cost_us)
from online_spec.controller.acceptance import AcceptanceEstimate, ConfidenceCalibrator, small_rows
from online_spec.controller.round_time import _RidgeLeastSquares, draft_row, verify_features
from online_spec.controller.plan import continue_on

# Synthetic costs of the model's own form (seconds): draft phase and verify.
TRUE_DRAFT = (0.002, 0.0001, 0.00005, 0.0015, 0.00002)  # per step: 1, b, b*ctx/1000; once if K > 0: 1, b
TRUE_VERIFY = (0.010, 0.0002, 0.00003, 0.0001, 0.0003)  # 1, b, b*n, b*ctx/1000, b*[n > 1]


def true_times(b, k, ctx, draft=TRUE_DRAFT, verify=TRUE_VERIFY):
    step = draft[0] + draft[1] * b + draft[2] * b * ctx / 1000
    v = verify[0] + verify[1] * b + verify[2] * b * (k + 1) + verify[3] * b * ctx / 1000
    if k == 0:
        return 0.0, v
    return k * step + draft[3] + draft[4] * b, v + verify[4] * b


def grid(noise=0.0, seed=0):
    rng = random.Random(seed)
    for b, k, ctx in itertools.product([1, 2, 4, 8, 16, 32], [0, 1, 3, 5, 7], [128, 1024, 4096]):
        d, v = true_times(b, k, ctx)
        yield b, k, ctx, d * (1 + rng.uniform(-noise, noise)), v * (1 + rng.uniform(-noise, noise))


HELD_OUT = [(12, 4, 2000), (3, 2, 300), (24, 6, 3500)]


# -- cost model ------------------------------------------------------------------------------

def test_fit_recovers_exact_timings():
    model = CostModel().fit(grid())
    for b, k, ctx in HELD_OUT:
        assert model.predict_round_s(b, k, ctx) == pytest.approx(sum(true_times(b, k, ctx)), rel=1e-6)


def test_fit_with_noise_predicts_within_3_percent():
    model = CostModel().fit(grid(noise=0.05, seed=1))  # +-5% noise per measurement
    for b, k, ctx in HELD_OUT:
        assert model.predict_round_s(b, k, ctx) == pytest.approx(sum(true_times(b, k, ctx)), rel=0.03)


def test_online_observe_tracks_a_cost_change():
    model = CostModel(CostModelConfig(decay=0.98, refit_interval=8))
    rows = list(grid(noise=0.02, seed=2))
    for row in rows:
        model.observe(*row)
    assert model.predict_round_s(12, 4, 2000) == pytest.approx(sum(true_times(12, 4, 2000)), rel=0.05)
    for b, k, ctx, d, v in rows * 2:  # everything becomes twice as slow
        model.observe(b, k, ctx, 2 * d, 2 * v)
    assert model.predict_round_s(12, 4, 2000) == pytest.approx(2 * sum(true_times(12, 4, 2000)), rel=0.05)


def test_calibration_anchors_the_costs_of_k_no_longer_run():
    """Online rounds at one (b, K) for a long while (the policy settled) leave the calibrated
    costs of the other K's in place: the calibration never decays. Coefficients given without
    their points (`with_coefficients`) are replaced by the first refit on those rounds alone."""
    anchored = CostModel().fit(grid(noise=0.02, seed=6))
    bare = CostModel.with_coefficients(anchored.draft_coef, anchored.verify_coef)
    d, v = true_times(4, 1, 256)
    for _ in range(5000):  # decay 0.999: an online-only weight would be e^-5 by now
        anchored.observe(4, 1, 256, d, v)
        bare.observe(4, 1, 256, d, v)
    assert anchored.predict_round_s(4, 1, 256) == pytest.approx(d + v, rel=0.02)
    for b, k, ctx in HELD_OUT + [(4, 5, 256), (32, 7, 1024)]:
        assert anchored.predict_round_s(b, k, ctx) == pytest.approx(sum(true_times(b, k, ctx)), rel=0.05)
    worst = max(abs(bare.predict_round_s(b, k, ctx) / sum(true_times(b, k, ctx)) - 1) for b, k, ctx in HELD_OUT)
    assert worst > 0.2  # one (b, K) cannot pin four coefficients


def test_prior_before_any_observation():
    model = CostModel(CostModelConfig(prior_draft_step_s=0.25, prior_verify_s=0.5))
    assert model.predict_round_s(8, 3, 100) == 3 * 0.25 + 0.5


def test_refit_waits_for_the_interval():
    model = CostModel(CostModelConfig(refit_interval=3))
    rows = list(grid())
    for row in rows[:2]:
        model.observe(*row)
    assert model.verify_coef == [0.02, 0.0, 0.0, 0.0, 0.0]
    model.observe(*rows[2])
    assert model.verify_coef != [0.02, 0.0, 0.0, 0.0, 0.0]


def test_round_terms_follow_the_coefficients():
    """The per-round memo of (draft step, verify base, verify per token, draft extra, verify
    extra) is dropped when the coefficients change: a refit, a loaded state, or coefficients set
    directly."""
    def terms(model, b, ctx):
        return (model.draft_step_s(b, ctx), *model.verify_terms(b, ctx), model.draft_extra_s(b), model.verify_extra_s(b))

    model = CostModel(CostModelConfig(refit_interval=1))
    before = model.round_terms(4, 300)
    assert before == terms(model, 4, 300)
    model.observe(4, 3, 300, draft_s=0.03, verify_s=0.2)  # refits
    after = model.round_terms(4, 300)
    assert after != before and after == terms(model, 4, 300)
    model.verify_coef = [1.0, 0.0, 0.0, 0.0, 0.0]
    assert model.round_terms(4, 300)[1] == 1.0
    state = CostModel().state_dict()
    model.load_state_dict(state)
    assert model.round_terms(4, 300) == before
    assert model.round_terms(8, 300) == terms(model, 8, 300)


def test_entering_speculation_is_priced_apart_from_each_step():
    """An H100 at batch 1 (2026-11-24): catch-up + first draft 0.72 ms, each later step 0.35 ms,
    a plain decode step 3.2 ms, a verify of drafts 3.9 ms + 0.05 ms a token. Calibrated at K
    0/1/3/7 and one batch size, as a server of max_batch 1 does, the model predicts the K it
    did not measure within 2 %, and the K it picks is the best by the true costs."""
    draft, verify = (0.00035, 0.0, 0.0, 0.00037, 0.0), (0.00315, 0.0, 0.00005, 0.0, 0.00065)
    model = CostModel().fit([(1, k, 300, *true_times(1, k, 300, draft, verify)) for k in (0, 1, 3, 7)])
    for k in (2, 4, 5, 6):
        assert model.predict_round_s(1, k, 300) == pytest.approx(sum(true_times(1, k, 300, draft, verify)), rel=0.02)
    a = [0.62, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35]
    p = CostModelPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": list(range(8))}}),
                        CostPolicyConfig(prior_accept=0.6), model)
    rate = {k: p.expected_tokens(1, k, a) / sum(true_times(1, k, 300, draft, verify)) for k in range(8)}
    best = max(rate, key=rate.get)
    p._accept[0].rates, p._accept[0].seen, p._accept[0]._filled = a[:], [100] * 7, None  # the estimates as given
    assert p.choose_steps(1, 300) == best and best >= 2


def test_cost_model_state_round_trip():
    a = CostModel().fit(grid(noise=0.05))
    b = CostModel()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for row in list(grid(seed=4))[:40]:
        a.observe(*row)
        b.observe(*row)
    assert b.predict_round_s(5, 3, 900) == a.predict_round_s(5, 3, 900)


def bent_times(b, k, ctx):
    """Costs the line cannot fit: a draft phase that grows as b ** 0.5 (a CPU running small
    matmuls below its peak), and a verify that costs 30 % less per request above batch 8."""
    d, v = true_times(b, k, ctx)
    return d * b ** -0.5 if k else 0.0, v * (0.7 if b > 8 else 1.0)


def test_time_factors_correct_the_line_where_rounds_were_measured():
    """Each (batch bucket, K) measured takes measured / predicted seconds of its rounds, the
    prediction as the line now makes it: sums checked against a naive reference, the corrected
    predictions of measured points near their times where the line alone misses by > 10 %."""
    rows = [(b, k, 256, *bent_times(b, k, 256)) for b in (1, 4, 16, 64) for k in (0, 1, 3, 7)]
    model = CostModel().fit(rows)
    line = [model.predict_round_s(b, k, ctx, factors=False) for b, k, ctx, _, _ in rows]
    assert max(abs(p / (d + v) - 1) for p, (_, _, _, d, v) in zip(line, rows)) > 0.1
    for (b, k, ctx, d, v), pred in zip(rows, line):
        assert model.predict_round_s(b, k, ctx) == pytest.approx(d + v, rel=1e-9)
        assert model.time_factors(b, 7)[k] == pytest.approx((d + v) / pred, rel=1e-9)
    # online rounds at batch 16, K = 1 and a context of their own: the factor becomes their
    # decayed measured seconds over the same rounds as the line now predicts them
    online = [(16, 1, 300 + 10 * i, *bent_times(16, 1, 300 + 10 * i)) for i in range(48)]
    for row in online:
        model.observe(*row)
    decay, n = model.config.decay, len(online)
    weights = [4.0 * decay ** n] + [decay ** (n - 1 - i) for i in range(n)]  # the calibration row, then the rounds
    pts = [rows[9]] + online
    assert pts[0][:2] == (16, 1)
    measured = sum(w * (d + v) for w, (_, _, _, d, v) in zip(weights, pts))
    predicted = sum(w * model.predict_round_s(b, k, ctx, factors=False) for w, (b, k, ctx, _, _) in zip(weights, pts))
    assert model.time_factors(16, 7)[1] == pytest.approx(measured / predicted, rel=1e-9)
    def error(factors_):
        return statistics.mean(abs(model.predict_round_s(b, k, ctx, factors=factors_) / (d + v) - 1)
                               for b, k, ctx, d, v in online)
    assert error(True) < error(False)


def test_time_factors_of_k_without_rounds():
    """K = 0 has only its own factor; a K > 0 without rounds is interpolated between the nearest
    measured K's, or takes the nearest one beyond them; a bucket without rounds has factor 1."""
    model = CostModel(CostModelConfig(refit_interval=1))
    model.observe(4, 0, 100, 0.0, 0.03)
    model.observe(4, 2, 100, 0.01, 0.03)
    model.observe(4, 6, 100, 0.03, 0.06)
    f = model.time_factors(4, 8)
    measured = {k: f[k] for k in (0, 2, 6)}
    assert len(set(measured.values())) == 3
    assert f[1] == f[2] and f[7] == f[8] == f[6]
    for k in (3, 4, 5):
        assert f[k] == pytest.approx(f[2] + (f[6] - f[2]) * (k - 2) / 4)
    assert model.time_factors(5, 8) is f  # one bucket: 4-7
    assert model.time_factors(8, 8) == [1.0] * 9
    only_plain = CostModel(CostModelConfig(refit_interval=1))
    only_plain.observe(2, 0, 100, 0.0, 0.05)
    g = only_plain.time_factors(2, 3)
    assert g[0] != 1.0 and g[1:] == [1.0] * 3
    off = CostModel(CostModelConfig(refit_interval=1, time_factors=False))
    off.observe(4, 2, 100, 0.01, 0.03)
    assert off.time_factors(4, 3) == [1.0] * 4 and off.predict_round_s(4, 2, 100) == off.predict_round_s(
        4, 2, 100, factors=False)


def test_time_factors_wait_for_the_refit_and_survive_a_state_round_trip():
    model = CostModel(CostModelConfig(refit_interval=4))
    assert model.time_factors(16, 3) == [1.0] * 4
    for _ in range(3):
        model.observe(16, 1, 200, *bent_times(16, 1, 200))
    assert model.time_factors(16, 3) == [1.0] * 4  # the rounds wait for the next refit, as the line does
    model.observe(16, 1, 200, *bent_times(16, 1, 200))
    assert model.time_factors(16, 3)[1] != 1.0
    copy_ = CostModel()
    copy_.load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert copy_.time_factors(16, 3) == model.time_factors(16, 3)
    state = model.state_dict()
    del state["tally"]  # a state written before the factors
    old = CostModel()
    old.load_state_dict(state)
    assert old.time_factors(16, 3) == [1.0] * 4
    state["tally"] = {"5:1": [1.0] * 3}
    with pytest.raises(ConfigError, match=r"state.tally\['5:1'\]"):
        CostModel().load_state_dict(state)


def test_policy_runs_the_k_its_measured_rounds_favour():
    """A line fitted across batch sizes 1-64 to costs it cannot fit (draft steps cheaper per
    request above batch 4, verifies of drafts 40 % cheaper above batch 8) misprices batch 16's
    rounds, and with 0.55 acceptance the policy runs K = 1 where K = 3 is best by the true costs.
    With the factors (the calibration's own batch-16 points, then the rounds served) it runs K = 3."""
    def truth(b, k, ctx):
        d, v = true_times(b, k, ctx)
        return (d * (4 / b) if b > 4 else d) if k else 0.0, v * (0.6 if b > 8 and k else 1.0)

    tiers, accept = [0, 1, 3], 0.55
    rows = [(b, k, 200, *truth(b, k, 200)) for b in (1, 4, 16, 64) for k in (0, 1, 3, 7)]
    rate = {k: (1 + sum(accept ** (i + 1) for i in range(k))) / sum(truth(16, k, 200)) for k in tiers}
    assert max(rate, key=rate.get) == 3
    ks = {}
    for on in (True, False):
        p = CostModelPolicy(AdaptiveConfig.from_dict({"16": {"candidate_steps": tiers}}),
                            CostPolicyConfig(prior_accept=accept, probe_interval=8),
                            CostModel(CostModelConfig(time_factors=on)).fit(rows))
        rng, ks[on] = random.Random(0), []
        for _ in range(400):
            k = p.steps_for(16, 200)
            ks[on].append(k)
            accepted = [sum(1 for _ in itertools.takewhile(lambda _: rng.random() < accept, range(k)))
                        for _ in range(16)]
            p.update(16, accepted, num_steps=k, ctx_len=200, draft_s=truth(16, k, 200)[0],
                     verify_s=truth(16, k, 200)[1])
    assert Counter(ks[True][-100:])[3] >= 90
    assert Counter(ks[False][-100:])[1] >= 50


def lstsq_of_the_decayed_system(rows, anchors, prior, ridge, decay, anchor_weight):
    """Naive reference of the online fit: numpy's lstsq of every row scaled by the square root of
    its weight (online row i of n: decay^(n-1-i); anchor rows: anchor_weight; one ridge row per
    coefficient pulling it toward the prior)."""
    n, d = len(rows), len(prior)
    x = np.array([r for r, _ in rows] + [r for r, _ in anchors] + np.eye(d).tolist())
    y = np.array([t for _, t in rows] + [t for _, t in anchors] + list(prior))
    w = np.concatenate([decay ** np.arange(n - 1, -1, -1.0), np.full(len(anchors), anchor_weight), np.full(d, ridge)])
    return np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]


@pytest.mark.parametrize("features", ["draft", "verify"])
def test_online_fit_equals_the_lstsq_of_the_decayed_system(features):
    """The online rows wait and are folded into the Gram matrix at the next solve (one numpy
    product, not a decay of every entry per row): folds of 1 to 5000 rows, over 12 000 rows in
    all (decay^12000 ~ 6e-6: the first rows' weight), agree with the reference to 1e-9."""
    rng = random.Random(7 if features == "draft" else 8)
    prior, ridge, decay, anchor_weight = (0.02, 0.0, 0.0, 0.0, 0.0), 1e-6, 0.999, 4.0

    def row(b, k, ctx):  # K = 0 rounds have no draft phase; their verify is a plain decode step
        if features == "draft":
            return draft_row(b, k, ctx), true_times(b, k, ctx)[0] * (1 + rng.uniform(-0.05, 0.05))
        return list(verify_features(b, k + 1, ctx)), true_times(b, k, ctx)[1] * (1 + rng.uniform(-0.05, 0.05))

    fit = _RidgeLeastSquares(prior, ridge, decay)
    ks = [1, 3, 5, 7] if features == "draft" else [0, 1, 3, 5, 7]
    anchors = [row(b, k, 256) for b in (1, 4, 16) for k in ks]
    for x, y in anchors:
        fit.add_anchor(x, y, anchor_weight)
    rows = []
    for gap in (1, 1, 2, 16, 16, 100, 3000, 5000, 7, 16, 16, 3825):
        for _ in range(gap):
            rows.append(row(rng.choice([1, 2, 4, 8, 16, 32, 64]), rng.choice(ks), rng.uniform(100, 4000)))
            fit.add(*rows[-1])
        ref = lstsq_of_the_decayed_system(rows, anchors, prior, ridge, decay, anchor_weight)
        assert np.max(np.abs(np.array(fit.solve()) - ref)) <= 1e-9 * np.max(np.abs(ref)), len(rows)
    assert fit.count == len(rows) == 12000


def test_cost_model_state_between_refits_resumes_bit_for_bit():
    """Rows not folded yet travel in the state as rows: a resumed model folds them with the same
    grouping as one that never stopped. States stored before the rows existed load as folded."""
    a = CostModel().fit(grid(noise=0.05))
    rows = list(grid(noise=0.05, seed=9))
    for row in rows[:21]:  # refit_interval 16: five rows pending
        a.observe(*row)
    b = CostModel()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert len(a.state_dict()["verify"]["rows"]) == 5
    for row in rows[21:60]:
        a.observe(*row)
        b.observe(*row)
    assert b.state_dict() == a.state_dict()
    a.refit()  # folds the pending rows: the state now holds none
    old = json.loads(json.dumps(a.state_dict()))
    del old["draft"]["rows"], old["verify"]["rows"]
    c = CostModel()
    c.load_state_dict(old)
    assert c.state_dict() == a.state_dict()


@pytest.mark.parametrize("field, kw", [("prior_verify_s", {"prior_verify_s": 0}), ("decay", {"decay": 1.5}),
                                       ("refit_interval", {"refit_interval": 0}), ("ridge", {"ridge": -1})])
def test_cost_config_errors_name_the_field(field, kw):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        CostModelConfig(**kw)


# -- acceptance estimates --------------------------------------------------------------------

def test_acceptance_counts_trials_up_to_the_first_rejection():
    acc = AcceptanceEstimate(depth=5, prior=0.5, window=1)
    acc.observe([0, 1, 3, 3], 3)  # trials per position 4, 3, 2; hits 3, 2, 2
    assert acc.estimates() == [0.75, 2 / 3, 1.0, 1.0, 1.0]  # positions 4-5 never tried: borrow position 3


def test_acceptance_per_request_lengths_match_the_uniform_case():
    a, b = AcceptanceEstimate(4, 0.5, 0.3), AcceptanceEstimate(4, 0.5, 0.3)
    a.observe([0, 1, 3, 2], 3)
    b.observe([0, 1, 3, 2], [3, 3, 3, 3])
    assert a.estimates() == b.estimates()
    c = AcceptanceEstimate(4, 0.5, 1.0)
    c.observe([1, 2], [1, 3])  # request 0 verified 1 draft: it says nothing about position 2
    assert c.estimates()[:3] == [1.0, 1.0, 0.0]


def test_acceptance_counts_equal_a_per_position_tally():
    """Verify lengths ragged or uniform (one K for the batch, given as an int or a list: the
    counting fast path), random: rates (window 1: hits / trials of this round) equal a
    position-by-position tally of who was judged and who passed."""
    rng = random.Random(3)
    for trial in range(600):
        depth = rng.randint(1, 7)
        size = rng.randint(1, 9) if trial % 2 else rng.randint(1, 70)
        k = rng.randint(0, depth + 1)
        lens = [rng.randint(0, depth + 1) for _ in range(size)] if trial % 3 == 0 else [k] * size
        accepted = [rng.randint(0, n) for n in lens]
        acc = AcceptanceEstimate(depth, 0.5, 1.0)
        acc.observe(accepted, k if trial % 3 == 1 else lens)
        for i in range(min(max(lens), depth)):
            judged = [a for a, n in zip(accepted, lens) if n > i and a >= i]
            if judged:
                assert acc.rates[i] == pytest.approx(sum(a > i for a in judged) / len(judged))
            else:
                assert acc.seen[i] == 0


def test_acceptance_forgets_per_trial_not_per_round():
    """Sixteen rounds of one request move the estimate as far as one round of sixteen."""
    one, many = AcceptanceEstimate(2, 0.5, 64), AcceptanceEstimate(2, 0.5, 64)
    for _ in range(64):  # a long history at 0.75
        one.observe([1, 1, 1, 0], 1)
        many.observe([1, 1, 1, 0], 1)
    for _ in range(16):
        one.observe([0], 1)
    many.observe([0] * 16, 1)
    assert one.estimates()[0] == pytest.approx(many.estimates()[0], rel=0.05)  # a per-round EMA: 0.02 vs 0.6
    # 16 of a 64-trial window at 0 pull 0.75 about a quarter of the way down, not to 0
    assert 0.5 < one.estimates()[0] < 0.65


def test_k0_round_teaches_nothing():
    acc = AcceptanceEstimate(3, 0.6, 1.0)
    acc.observe([0, 0], 0)
    assert acc.estimates() == [0.6, 0.6, 0.6]


def test_calibrator_starts_at_identity_and_learns():
    cal = ConfidenceCalibrator(bins=10, prior_weight=4.0)
    assert cal(0.93) == pytest.approx(0.95) and cal(1.0) == pytest.approx(0.95) and cal(0.0) == pytest.approx(0.05)
    cal.observe([[0.95, 0.95]] * 20, [0] * 20)  # first draft always rejected, second never judged
    assert cal(0.95) == pytest.approx(4 * 0.95 / 24)


def test_calibrator_counts_judged_drafts_only():
    """Per request: drafts before the first rejection are hits, the rejected one a miss, the
    rest unjudged; rows of a ragged batch end at their own length (per-draft tally as reference)."""
    rng = random.Random(3)
    for ragged in (False, True):
        rows = [[rng.random() for _ in range(rng.randint(0, 5) if ragged else 5)] for _ in range(12)]
        accepted = [rng.randint(0, len(r)) for r in rows]
        cal = ConfidenceCalibrator(bins=10, prior_weight=4.0)
        cal.observe(rows, accepted)
        hits, trials = [0] * 10, [0] * 10
        for r, a in zip(rows, accepted):
            for i, c in enumerate(r[: a + 1]):
                trials[min(9, int(c * 10))] += 1
                hits[min(9, int(c * 10))] += i < a
        assert cal.hits == hits and cal.trials == trials


def test_calibrator_engine_arrays_match_a_per_draft_tally():
    """The engine's case, every row K drafts in one float32 array: counted in one bincount of
    verdict-offset bins (more than SMALL_BATCH confidences) or per draft in Python (up to it),
    it equals a per-draft tally of floor(c * bins) on the float64 value of each float32
    confidence, with confidences at and beyond the ends of [0, 1] and accepted counts above K."""
    rng = np.random.default_rng(4)
    paths = set()
    for trial in range(40):
        k = 1 + trial % 7
        b = int(rng.integers(1, 65 if trial % 2 else 5))
        conf = rng.random((b, k)).astype(np.float32)
        ends = rng.random((b, k)) < 0.3  # 0.7 * 10 is 7.0 in float32, 6.99... in float64
        conf[ends] = rng.choice(np.array([0.0, 0.7, 1.0, -0.3, 1.7], dtype=np.float32), size=int(ends.sum()))
        accepted = rng.integers(0, k + 2, size=b).tolist()  # k + 1: more than drafted, all accepted
        cal = ConfidenceCalibrator(bins=10, prior_weight=4.0)
        cal.load(None, [0.37] * 10)  # fractional counts, as soften leaves them
        cal.observe(conf, accepted)
        paths.add(small_rows(conf) is None)
        hits, trials = [0] * 10, [0] * 10
        for row, a in zip(conf.tolist(), accepted):
            for i, c in enumerate(row[: a + 1]):
                j = min(9, max(0, int(c * 10)))
                trials[j] += 1
                hits[j] += i < a
        assert cal.hits == hits and cal.trials == [0.37 + t for t in trials]
        assert cal.bin_of(conf).tolist() == [[cal.bin(c) for c in r] for r in conf.tolist()]
        assert cal.calibrated(conf).tolist() == [[cal(c) for c in r] for r in conf.tolist()]
        col = conf[:, 0]
        assert cal.mean(col) == pytest.approx(sum(cal(c) for c in col.tolist()) / b, rel=1e-12)
    assert paths == {True, False}  # both the numpy and the Python path ran


def test_small_batches_decide_as_the_numpy_path(monkeypatch):
    """Up to SMALL_BATCH confidences the in-round calls run on Python floats; every decision and
    count equals the numpy path's (forced by SMALL_BATCH = 0) on the same rounds."""
    import online_spec.controller.acceptance as cost_mod

    rng = random.Random(11)
    for _ in range(60):
        b, k = rng.randint(1, 4), rng.randint(1, 4)
        rows = [[rng.random() ** 0.3 for _ in range(k)] for _ in range(b)]
        arr = np.array(rows, dtype=np.float32)
        accepted = [rng.randint(0, k) for _ in range(b)]
        out = []
        for small in (cost_mod.SMALL_BATCH, 0):
            monkeypatch.setattr(cost_mod, "SMALL_BATCH", small)
            p = policy([k], 0.5, draft=(0.01, 0, 0), verify=(0.1, 0, 0.02, 0))
            for _ in range(3):
                p.update(b, accepted, num_steps=k, confidences=arr)
            out.append((p.verify_lengths(arr, padded=True), p.should_continue(1, arr[:, 0], b),
                         p._calib.hits[:], p._calib.trials[:],
                         round(p._calib.mean(arr[:, 0]), 12)))
        assert out[0] == out[1]


def test_policy_reads_the_engines_array_like_lists():
    """The engine passes its float32 [B, K] draft probabilities (and column views) as numpy
    arrays; every decision equals the one taken on the same values as lists."""
    rng = random.Random(9)
    for _ in range(20):
        b, k = rng.randint(1, 16), rng.randint(1, 7)
        arr = np.array([[rng.random() ** 0.3 for _ in range(k)] for _ in range(b)], dtype=np.float32)
        as_list = arr.tolist()
        p, q = (policy([k], 0.5, draft=(0.01, 0, 0), verify=(0.1, 0, 0.02, 0)) for _ in range(2))
        assert p.verify_lengths(arr, padded=True) == q.verify_lengths(as_list, padded=True)
        assert p.verify_lengths(arr) == q.verify_lengths(as_list)
        if k > 1:
            assert p.should_continue(1, arr[:, 0], b) == q.should_continue(1, [r[0] for r in as_list], b)
        acc = [rng.randint(0, k) for _ in range(b)]
        p.update(b, acc, num_steps=k, confidences=arr)
        q.update(b, acc, num_steps=k, confidences=as_list)
        assert p.state_dict() == q.state_dict()


# -- choose_steps ----------------------------------------------------------------------------

def policy(steps, accept, draft=(0.25, 0, 0), verify=(0.5, 0, 0, 0), **cfg) -> CostModelPolicy:
    """A cost policy with given per-step draft and verify-line coefficients (no [K > 0] extras
    unless given as the 4th/5th values)."""
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": steps}})
    draft, verify = tuple(draft) + (0.0,) * (5 - len(draft)), tuple(verify) + (0.0,) * (5 - len(verify))
    return CostModelPolicy(adaptive, CostPolicyConfig(prior_accept=accept, **cfg),
                           CostModel.with_coefficients(draft, verify))


def naive_best(steps, a, step_s, verify_s):
    rates = {k: (1 + sum(math.prod(a[: i + 1]) for i in range(k))) / (k * step_s + verify_s) for k in steps}
    return max(sorted(steps), key=lambda k: rates[k])


@pytest.mark.parametrize("accept", [0.3, 0.6, 0.8, 0.95])
def test_choose_matches_naive_argmax(accept):
    p = policy(list(range(8)), accept, draft=(0.1, 0, 0), verify=(1.0, 0, 0, 0))
    assert p.choose_steps(1) == naive_best(range(8), [accept] * 7, 0.1, 1.0)


def test_perfect_acceptance_and_free_drafts_take_the_deepest_tier():
    assert policy([0, 1, 3, 7], 1.0, draft=(0, 0, 0)).choose_steps(4) == 7


def test_zero_acceptance_takes_the_smallest_tier():
    assert policy([0, 1, 3], 0.0).choose_steps(4) == 0
    assert policy([2, 5], 0.0).choose_steps(4) == 2


def test_exact_tie_goes_to_the_smaller_k():
    # E(1)/t(1) = 1.5 / 0.75 = 2 = E(0)/t(0) = 1 / 0.5
    assert policy([0, 1], 0.5).choose_steps(1) == 0
    assert policy([0, 1], 0.51).choose_steps(1) == 1


@pytest.mark.parametrize("slo, expected", [
    (None, 7),
    (0.5 + 3 * 0.25, 3),  # exactly K = 3's round time: allowed
    (0.5 + 3 * 0.25 - 1e-9, 1),
    (0.1, 0),  # nothing fits: the smallest tier
])
def test_tpot_slo(slo, expected):
    assert policy([0, 1, 3, 7], 1.0, tpot_slo_s=slo).choose_steps(1) == expected


def test_learns_from_rounds_and_moves_k():
    p = policy([1, 3, 7], 0.6, draft=(0.05, 0, 0), verify=(0.5, 0, 0, 0))
    for _ in range(40):
        k = p.steps_for(4)
        p.update(4, [k] * 4)
    assert p.steps_for(4) == 7
    for _ in range(40):
        k = p.steps_for(4)
        p.update(4, [0] * 4)
    assert p.steps_for(4) == 1


@pytest.mark.parametrize("probe_interval", [0, 32])
def test_plain_decoding_is_not_absorbing(probe_interval):
    """A run of rejections drives the slot to K = 0, where nothing is observed; the probe (one
    round at the next tier up every `probe_interval` decisions) finds the acceptance back."""
    p = policy([0, 1, 3, 7], 0.6, draft=(0.05, 0, 0), verify=(0.5, 0, 0, 0), probe_interval=probe_interval)
    for _ in range(20):
        p.update(1, [0], num_steps=p.steps_for(1))
    assert p.steps_for(1) == 0
    ks = []
    for _ in range(200):  # the traffic turns easy: every draft accepted
        ks.append(p.steps_for(1))
        p.update(1, [ks[-1]], num_steps=ks[-1])
    if probe_interval:
        assert ks[-1] == 7 and ks.index(1) < probe_interval  # found back at the first probe
        # once there, it stays: nothing is probed at the deepest tier
        assert set(ks[-50:]) == {7}
    else:
        assert set(ks) == {0}


def engine_round(p, batch_size: int, accept: float, conf: float, rng: random.Random) -> tuple[int, int]:
    """One round as serving.engine runs it: steps_for, drafting with the in-round early stop,
    the padded verify-length cut, then update with what a truncated-geometric acceptance gives.
    -> (K chosen, drafts verified)."""
    k = p.steps_for(batch_size)
    drafted = k
    for j in range(1, k):
        if not p.should_continue(j, np.full(batch_size, conf), batch_size):
            drafted = j
            break
    n = max(p.verify_lengths(np.full((batch_size, drafted), conf), padded=True), default=0) if drafted else 0
    accepted = []
    for _ in range(batch_size):
        a = 0
        while a < n and rng.random() < accept:
            a += 1
        accepted.append(a)
    p.update(batch_size, accepted, num_steps=n, confidences=[[conf] * n] * batch_size if n else None)
    return k, n


def test_probe_drafts_and_verifies_its_whole_k_so_a_stuck_estimate_recovers():
    """Position 2's estimate pushed down by a few misses (as after a swap) makes K = 1 best; K = 1
    never observes position 2, the probe must. It did not while the early stop and the verify cut,
    reading that same estimate, cut each probe back to one draft: K stayed at 1 for good."""
    rng = random.Random(0)
    p = policy([1, 2, 3, 4], 0.8, draft=(0.05, 0, 0), verify=(0.5, 0, 0, 0.0005), probe_interval=8)
    for _ in range(3):  # position 1 hit, position 2 missed by every request
        p.update(4, [1] * 4, num_steps=2, confidences=[[0.8, 0.8]] * 4)
    assert p.info()["slots"]["1"]["accept"][1] < 0.5 and p.steps_for(4) == 1
    rounds = [engine_round(p, 4, 0.8, 0.8, rng) for _ in range(200)]  # the traffic: 0.8 at every position
    probes = [(k, n) for k, n in rounds if k == 2]
    assert probes and probes[0] == (2, 2)  # the first probe drafted and verified both drafts
    assert p.info()["slots"]["1"]["accept"][1] > 0.6
    assert [k for k, _ in rounds[-20:]].count(4) >= 15  # back at the deepest tier, as the traffic warrants


def test_remembered_choice_is_the_choice_asked_anew():
    """steps_for after update asks choose_steps the same question, and gets update's answer back
    while the slot's cached estimates and the round terms are the same objects; a batch size of
    the same slot, another context, new estimates or a refit ask anew. Every answer equals that
    of a copy that remembers nothing."""
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 3, 7]}, "16": {"candidate_steps": [0, 1, 3]}})
    p = CostModelPolicy(adaptive, cost_model=CostModel(CostModelConfig(refit_interval=4)).fit(grid(noise=0.05)))
    rng = random.Random(12)
    seen = set()
    for r in range(400):
        b, ctx = rng.choice([(1, 128), (3, 4096), (16, 128), (32, 4096)])
        other = (b * 2 + 1, 4224 - ctx)  # same slot, the other context
        for question in ((b, ctx), other, (b, ctx)):
            fresh = copy.deepcopy(p)
            fresh._choice = None
            k = p.choose_steps(*question)
            assert k == fresh.choose_steps(*question), (r, question)
            seen.add(k)
        k = p.steps_for(b, ctx)
        good = r // 30 % 2  # acceptance flips every 30 rounds, the draft cost every 70
        accepted = [k if good else rng.randint(0, min(k, 1)) for _ in range(b)]
        d, v = true_times(b, k, ctx)
        p.update(b, accepted, num_steps=k, ctx_len=ctx, draft_s=d * (1 + 4 * (r // 70 % 2)), verify_s=v)
    assert seen == {0, 1, 3, 7}


def test_probe_runs_the_next_tier_once_per_interval():
    p = policy([1, 3, 7], 0.0, probe_interval=10)  # acceptance 0: K = 1 is best
    ks = [p.steps_for(4) for _ in range(30)]
    assert ks == ([1] * 9 + [3]) * 3


def test_update_without_num_steps_uses_the_last_choice():
    p = policy([1, 3], 0.6)
    with pytest.raises(ConfigError, match="num_steps"):
        p.update(1, [1])
    k = p.steps_for(1)
    p.update(1, [k])
    assert p.info()["slots"]["1"]["accept"][0] > 0.6


def test_info_reads_fresh_estimates_and_leaves_the_engines_cache_alone():
    """info() runs on other threads (status, progress lines): it must not fill the estimates
    cache that the engine thread's observe() clears (a fill racing an observe would keep the
    previous round's values until the next one)."""
    p = policy([1, 3], 0.6)
    k = p.steps_for(1)
    p.update(1, [k], num_steps=k)  # its choose_steps fills the cache
    acc = p._accept[0]
    acc.observe([0], 1)  # as the engine thread's next round does: the cache is cleared
    assert acc._filled is None
    info = p.info()["slots"]["1"]
    assert acc._filled is None
    assert info["accept"] == acc.estimates() == acc.fresh_estimates()
    assert info["expected_tokens"]["3"] == pytest.approx(p.expected_tokens(1, 3))


def test_update_feeds_measured_times_to_the_cost_model():
    p = CostModelPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3]}}),
                        cost_model=CostModel(CostModelConfig(refit_interval=1)))
    for b, k, ctx, d, v in grid():
        p.update(b, [0] * b, num_steps=k, ctx_len=ctx, draft_s=d, verify_s=v)
    assert p.cost.predict_round_s(12, 4, 2000) == pytest.approx(sum(true_times(12, 4, 2000)), rel=1e-3)


# -- should_continue -------------------------------------------------------------------------

def test_stops_at_the_deepest_tier():
    assert policy([1, 3], 1.0, draft=(0, 0, 0)).should_continue(3, 0.99, 1) is False


def test_confident_draft_continues():
    assert policy([1, 3, 7], 0.9, draft=(0.05, 0, 0)).should_continue(1, 0.95, 1) is True


def test_hopeless_draft_stops():
    # p = 0.05: the next draft adds 0.045 tokens for a tenth of the round's time.
    assert policy([1, 3, 7], 0.9, draft=(0.05, 0, 0)).should_continue(1, 0.01, 1) is False


def test_hopeless_draft_continues_when_steps_are_nearly_free():
    assert policy([1, 3, 7], 0.9, draft=(0.001, 0, 0)).should_continue(1, 0.01, 1) is True


@pytest.mark.parametrize("step_s, expected", [
    (0.75, False),  # gain * t_now == E * dt: 0.75 * 1.75 == 1.75 * 0.75, no gain, stop
    (0.5, True),
])
def test_continue_boundary_is_strict(step_s, expected):
    # After draft 1 (confidence 0.75 -> 0.75), a_2 = 1: gain 0.75, E 1.75; verify 1 s.
    assert policy([1, 2, 3], 1.0, draft=(step_s, 0, 0), verify=(1.0, 0, 0, 0)).should_continue(1, 0.75, 1) is expected


def test_continue_respects_the_slo():
    p = policy([1, 3, 7], 1.0, draft=(0.1, 0, 0), verify=(0.5, 0, 0, 0), tpot_slo_s=0.75)
    assert p.should_continue(1, 0.95, 1) is True  # 2 drafts: 0.7 s
    assert p.should_continue(2, 0.95, 1) is False  # 3 drafts: 0.8 s > SLO


def test_continue_takes_one_confidence_per_request():
    p = policy([1, 3, 7], 0.9, draft=(0.3, 0, 0))  # the batch's mean calibrated confidence decides
    assert p.should_continue(1, [0.95, 0.95], 2) is True
    assert p.should_continue(1, [0.95, 0.01], 2) is False


def test_continue_refuses_step_zero():
    with pytest.raises(ConfigError, match="step_index"):
        policy([1, 3], 0.5).should_continue(0, 0.9, 1)


# -- verify_lengths --------------------------------------------------------------------------

def best_ratio_brute(policy_, rows, ctx=0):
    """Max tokens/second over every choice of per-request prefix lengths (naive reference)."""
    cal, cost, b = policy_._calib, policy_.cost, len(rows)
    draft_s = cost.draft_s(b, max(len(r) for r in rows), ctx)
    best = 0.0
    for lengths in itertools.product(*[range(len(r) + 1) for r in rows]):
        tokens = sum(1 + sum(math.prod(cal(c) for c in r[: m + 1]) for m in range(n)) for r, n in zip(rows, lengths))
        best = max(best, tokens / (draft_s + cost.verify_s(b, sum(lengths) / b, ctx)))
    return best


def ratio_of(policy_, rows, lengths, ctx=0):
    cal, cost, b = policy_._calib, policy_.cost, len(rows)
    tokens = sum(1 + sum(math.prod(cal(c) for c in r[: m + 1]) for m in range(n)) for r, n in zip(rows, lengths))
    return tokens / (cost.draft_s(b, max(len(r) for r in rows), ctx) + cost.verify_s(b, sum(lengths) / b, ctx))


def test_free_verify_tokens_keep_every_draft():
    p = policy([3], 0.5, verify=(0.5, 0, 0.0, 0))
    assert p.verify_lengths([[0.01, 0.01, 0.01], [0.9]]) == [3, 1]


def test_a_weak_draft_cuts_the_rest_of_its_row():
    p = policy([3], 0.5, draft=(0.0, 0, 0), verify=(0.2, 0, 0.1, 0))
    assert p.verify_lengths([[0.95, 0.05, 0.95], [0.95, 0.95, 0.95]]) == [1, 3]


def test_worked_example():
    # S = 0.95, 0.5225, 0.078 per row; verify 0.2 + 0.1 per token. Lengths 0, 1, 2, 3 give
    # 5.0, 6.5, 6.18, 5.10 tokens/s: one draft each is best.
    p = policy([3], 0.5, draft=(0.0, 0, 0), verify=(0.2, 0, 0.1, 0))
    assert p.verify_lengths([[0.95, 0.55, 0.15]] * 2) == [1, 1]


def test_verify_lengths_reach_the_brute_force_optimum():
    rng = random.Random(7)
    for _ in range(40):
        p = policy([3], 0.5, draft=(rng.uniform(0, 0.1), 0, 0), verify=(rng.uniform(0.05, 0.5), 0, rng.uniform(0.01, 0.2), 0))
        rows = [[rng.random() for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(1, 3))]
        if max(len(r) for r in rows) == 0:
            continue
        lengths = p.verify_lengths(rows)
        assert all(0 <= n <= len(r) for n, r in zip(lengths, rows))
        assert ratio_of(p, rows, lengths) == pytest.approx(best_ratio_brute(p, rows), rel=1e-12)


def test_empty_batch():
    assert policy([3], 0.5).verify_lengths([]) == []
    assert policy([3], 0.5).verify_lengths([], padded=True) == []


def padded_rate(policy_, rows, n, ctx=0):
    """Tokens per second when every row is verified at min(n, its drafts), in a forward that
    runs every row at n (naive reference)."""
    cal, cost, b = policy_._calib, policy_.cost, len(rows)
    tokens = sum(1 + sum(math.prod(cal(c) for c in r[: m + 1]) for m in range(min(n, len(r)))) for r in rows)
    return tokens / (cost.draft_s(b, max(len(r) for r in rows), ctx) + cost.verify_s(b, n, ctx))


def test_padded_cut_is_the_best_common_length():
    rng = random.Random(5)
    checked = 0
    for _ in range(60):
        p = policy([7], 0.5, draft=(rng.uniform(0, 0.05), 0, 0),
                   verify=(rng.uniform(0.02, 0.3), 0, rng.uniform(0.002, 0.1), 0))
        k = rng.randint(1, 7)
        ragged = rng.random() < 0.3  # rows with fewer drafts (an engine that stops some early)
        rows = [[rng.random() ** 0.3 for _ in range(rng.randint(0, k) if ragged else k)]
                for _ in range(rng.randint(1, 16))]
        k = max(len(r) for r in rows)
        if k == 0:
            continue
        lengths = p.verify_lengths(rows, padded=True)
        assert len({n for n, r in zip(lengths, rows) if n < len(r)}) <= 1, "one cut for the batch"
        assert all(n == len(r) or n == max(lengths) for n, r in zip(lengths, rows))
        best = max(padded_rate(p, rows, n) for n in range(k + 1))
        assert padded_rate(p, rows, max(lengths)) == pytest.approx(best, rel=1e-12)
        checked += 0 < max(lengths) < k  # cuts strictly inside the rows happen
    assert checked >= 5


def test_padded_verify_does_not_cut_a_weak_row_alone():
    """Per request, the weak row is cut to nothing; padded, cutting it would save no verify
    work (the strong row sets the forward's length), so it keeps its drafts."""
    p = policy([3], 0.5, draft=(0.0, 0, 0), verify=(0.2, 0, 0.02, 0))
    rows = [[0.05, 0.05, 0.05], [0.95, 0.95, 0.95]]
    assert p.verify_lengths(rows) == [0, 3]
    assert p.verify_lengths(rows, padded=True) == [3, 3]


# -- lifecycle -------------------------------------------------------------------------------

def test_rewarm_forgets_acceptance_but_keeps_costs():
    p = policy([1, 3, 7], 0.6, rewarm_keep_trials=0)
    for _ in range(20):
        p.update(1, [7], num_steps=7, confidences=[[0.95] * 7])
    coefs = (list(p.cost.draft_coef), list(p.cost.verify_coef))
    assert p.info()["slots"]["1"]["accept"][0] > 0.9
    p.rewarm()
    assert p.info()["slots"]["1"]["accept"] == [0.6] * 7
    assert p._calib(0.95) == pytest.approx(0.95)
    assert (p.cost.draft_coef, p.cost.verify_coef) == coefs


def test_rewarm_keeps_the_old_heads_figures_as_a_weak_prior():
    """Default re-warm: right after a swap the estimates and the calibration are the old head's
    (not the 0.6 prior and the identity map, which made K dip after swaps), held by only
    `rewarm_keep_trials` (16) trials, so the new head's own rounds take over within a few dozen requests."""
    old = policy([1, 3, 7], 0.6)
    for _ in range(40):  # old head: every draft accepted, at confidence 0.3 (calibrated up to ~1)
        old.update(1, [7], num_steps=7, confidences=[[0.3] * 7])
    before = old.info()["slots"]["1"]["accept"]
    calib_before = old._calib(0.3)
    assert before[0] > 0.95 and calib_before > 0.95
    old.rewarm()
    assert old.info()["slots"]["1"]["accept"] == before
    assert 0.6 < old._calib(0.3) < calib_before  # the old map, at 16 observations against the 0.35 midpoint
    reset = policy([1, 3, 7], 0.6)  # the same new head seen from the 0.6 prior
    for p in (old, reset):
        for _ in range(16):  # the new head: every first draft rejected, 4 requests a round
            p.update(4, [0] * 4, num_steps=7, confidences=[[0.3] * 7] * 4)
    a_old, a_reset = old.info()["slots"]["1"]["accept"][0], reset.info()["slots"]["1"]["accept"][0]
    assert a_old < 0.2 and abs(a_old - a_reset) < 0.15  # 16 rounds (64 requests) of the new head decide in both
    with pytest.raises(ConfigError, match="rewarm_keep_trials"):
        CostPolicyConfig(rewarm_keep_trials=-1)


def test_policy_state_round_trip():
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 3, 7]}, "16": {"candidate_steps": [0, 1, 3]}})
    rng = random.Random(11)
    rounds = []
    for b, k, ctx, d, v in grid(noise=0.05, seed=3):
        acc = [rng.randint(0, k) for _ in range(b)]
        conf = [[rng.random() for _ in range(k)] for _ in range(b)]
        rounds.append((b, acc, k, ctx, d, v, conf))
    a = CostModelPolicy(adaptive)
    for b, acc, k, ctx, d, v, conf in rounds[:45]:
        a.steps_for(b, ctx)
        a.update(b, acc, num_steps=k, ctx_len=ctx, draft_s=d, verify_s=v, confidences=conf)
    b_ = CostModelPolicy(adaptive)
    b_.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b_.info() == a.info()
    for b, acc, k, ctx, d, v, conf in rounds[45:]:
        ka = a.update(b, acc, num_steps=k, ctx_len=ctx, draft_s=d, verify_s=v, confidences=conf)
        kb = b_.update(b, acc, num_steps=k, ctx_len=ctx, draft_s=d, verify_s=v, confidences=conf)
        assert ka == kb
    assert b_.state_dict() == a.state_dict()


def test_load_state_dict_names_the_bad_field():
    p = policy([1, 3], 0.5)
    state = p.state_dict()
    state["slots"]["1"]["rates"] = [0.5]
    with pytest.raises(ConfigError, match=r'state\.slots\["1"\]\.rates'):
        p.load_state_dict(state)


@pytest.mark.parametrize("field, kw", [("accept_window", {"accept_window": 0.5}), ("prior_accept", {"prior_accept": 1.5}),
                                       ("tpot_slo_s", {"tpot_slo_s": 0.0}), ("calib_bins", {"calib_bins": 0}),
                                         ("probe_interval", {"probe_interval": -1})])
def test_policy_config_errors_name_the_field(field, kw):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        CostPolicyConfig(**kw)


def test_is_a_step_policy_and_cheap():
    p = CostModelPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 3, 5, 7]}}))
    assert isinstance(p, StepPolicy)
    assert 0 < measure_decision_cost_us(p, n=300, batch_size=8) < 1000  # tens of µs at most; loose for CI


def test_timed_policy_decides_as_its_policy_and_times_each_round():
    """`TimedPolicy` (the bench's in-engine decision cost) changes no decision: driven like the
    engine drives a policy, the wrapped cost policy and a bare copy choose the same K, stop and
    cut the same drafts; one timing per round, steps_for to update; the wrapper declares the
    policy's in-round capabilities (the engine calls them only where declared)."""
    from online_spec.controller import EmaTierPolicy, TimedPolicy

    rng = random.Random(2)
    bare = policy([0, 1, 3, 5], 0.6, draft=(0.01, 0, 0), verify=(0.1, 0, 0.02, 0))
    timed = TimedPolicy(copy.deepcopy(bare))
    for _ in range(200):
        b = rng.choice([1, 2, 8])
        drafts = np.array([[rng.random() ** 0.3 for _ in range(5)] for _ in range(b)], dtype=np.float32)
        decisions = []
        for p in (bare, timed):
            k = p.steps_for(b, 300)
            conf = drafts[:, :k]
            stops = [p.should_continue(i, conf[:, i - 1], b, 300) for i in range(1, k)]
            lens = p.verify_lengths(conf, 300, padded=True) if k else [0] * b
            p.update(b, [min(n, 2) for n in lens], num_steps=lens, ctx_len=300, draft_s=0.01 * k, verify_s=0.1,
                     confidences=conf)
            decisions.append((k, stops, lens))
        assert decisions[0] == decisions[1]
    assert len(timed.round_ns) == 200 and all(ns > 0 for ns in timed.round_ns) and timed.median_us() > 0
    assert timed.info()["slots"] == bare.info()["slots"]
    ema = TimedPolicy(EmaTierPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3]}}), initial_steps=1))
    assert not ema.early_stop and not ema.truncates and ema.name == "ema_tier"
    assert timed.early_stop and timed.truncates and copy.deepcopy(ema).median_us() is None


def test_the_early_stop_prices_one_more_draft_by_the_line_not_a_stale_time_factor():
    """A CPU e2e run (2026-11-28): a few slow batch-4 rounds at K = 2 put that K's time factor at
    1.4; an early stop priced by the factors then stopped every batch-4 round after one draft, so
    no round at K = 2 ran again to bring the factor down (2,474 of ~2,600 batch-4 rounds at
    K = 1, where static K = 3 served 7 % more). The early stop prices the next draft by the line."""
    rows = [(b, k, 100, 0.004 * k + (0.003 if k else 0.0), 0.05 + 0.002 * b * (k + 1))
            for b in (1, 4, 16) for k in (0, 1, 3, 7)]
    model = CostModel(CostModelConfig(refit_interval=1)).fit(rows)
    policy = CostModelPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3, 5, 7]}}),
                             cost_model=model)
    confident = [0.9] * 4
    assert policy.should_continue(1, confident, 4, 100)
    for _ in range(32):  # batch-4 rounds at K = 2 measured 1.6x the calibration's line
        model.observe(4, 2, 100, 0.011 * 1.6, 0.074 * 1.6)
    assert model.time_factors(4, 3)[2] > 1.2
    assert policy.should_continue(1, confident, 4, 100)  # one more confident draft still pays
    assert not policy.should_continue(1, [0.02] * 4, 4, 100)  # an unlikely one still does not
    # the planned policy's early stop reads the same terms
    plan = policy.plan(4, 100)
    assert continue_on(plan.stops[0], confident, plan.calib)
