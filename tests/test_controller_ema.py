"""EmaTierPolicy: SGLang's rules case by case, then decision-by-decision parity with SGLang.

Named cases drive the policy with ema_alpha = 1 where an exact EMA is needed (the EMA is then
the last batch mean), so each threshold can be hit exactly. Parity replays seeded random
configs and traces through both this policy and SGLang's `AdaptiveSpeculativeParams`
(version in sglang_adaptive_ref.SGLANG_VERSION_COMPARED).
"""

from __future__ import annotations

import json
import random

import pytest

from online_spec.config import ConfigError
from online_spec.controller import AdaptiveConfig, EmaTierPolicy, StepPolicy, adaptive_config_path, \
    load_adaptive_config, measure_decision_cost_us
from online_spec.controller.ema import next_steps
from sglang_adaptive_ref import SGLANG_VERSION_COMPARED, load_sglang_adaptive


def one_slot(steps, initial, **knobs) -> EmaTierPolicy:
    cfg = AdaptiveConfig.from_dict({"1": {"candidate_steps": steps, **knobs}})
    return EmaTierPolicy(cfg, initial_steps=initial)


EXACT = dict(ema_alpha=1.0, warmup_batches=0, update_interval=1)  # EMA = last batch mean, decide every round


def ema_of(policy, key="1"):
    return policy.info()["slots"][key]["ema"]


# -- warmup and interval ---------------------------------------------------------------------

def test_no_decision_during_warmup_then_first_at_warmup_plus_interval():
    p = one_slot([1, 3, 7], 1, warmup_batches=10, update_interval=5)
    ks = [p.update(1, [7]) for _ in range(15)]
    assert ks[:14] == [1] * 14  # rounds 1..14: warmup (10) then 4 rounds into the first interval
    assert ks[14] == 7
    assert p.info()["slots"]["1"]["decisions"] == 1


def test_decisions_every_interval_after_warmup():
    p = one_slot([1, 3, 7], 1, warmup_batches=2, update_interval=3)
    for _ in range(2 + 3 * 4):
        p.update(1, [0])
    assert p.info()["slots"]["1"]["decisions"] == 4


def test_warmup_zero_interval_one_decides_every_round():
    p = one_slot([1, 3], 1, **EXACT)
    assert p.update(1, [3]) == 3
    assert p.update(1, [0]) == 1


def test_empty_round_changes_nothing():
    p = one_slot([1, 3], 1, **EXACT)
    assert p.update(1, []) == 1
    assert p.info()["slots"]["1"]["batches"] == 0


def test_ema_follows_alpha():
    p = one_slot([3], 3, ema_alpha=0.5)
    p.update(1, [4, 2])  # start at K - 1 = 2; mean 3
    assert ema_of(p) == pytest.approx(2.5)


# -- hysteresis thresholds -------------------------------------------------------------------

@pytest.mark.parametrize("accepted, expected", [
    ([1, 0, 0, 0], 1),  # EMA 0.25 == 1 - 0.5 - 0.25: at the threshold, steps down
    ([1, 1, 0, 0], 3),  # EMA 0.50 above it: holds
])
def test_down_threshold_with_hysteresis(accepted, expected):
    p = one_slot([1, 3], 3, down_hysteresis=-0.25, **EXACT)
    assert p.update(1, accepted) == expected


@pytest.mark.parametrize("accepted, expected", [
    ([1, 0], 0),  # EMA 0.5: the threshold to reach K = 0 is 0.5 (not -0.5), inclusive
    ([1, 1, 1, 0], 2),  # EMA 0.75: holds
])
def test_down_threshold_to_zero_tier(accepted, expected):
    p = one_slot([0, 2], 2, down_hysteresis=0.0, **EXACT)
    assert p.update(1, accepted) == expected


@pytest.mark.parametrize("up, accepted, expected", [
    (0.0, [1, 0], 1),  # EMA 0.5 == 1 - 0.5: not strictly above, holds
    (0.0, [1, 1, 1, 0], 3),  # EMA 0.75: steps up
    (0.5, [1, 1, 1, 0], 1),  # up_hysteresis 0.5 raises the bar to 1.0
    (0.5, [2, 1, 1, 1], 3),  # EMA 1.25 clears it
])
def test_up_threshold_with_hysteresis(up, accepted, expected):
    p = one_slot([1, 3], 1, up_hysteresis=up, down_hysteresis=-0.25, **EXACT)
    assert p.update(1, accepted) == expected


# -- multi-tier moves ------------------------------------------------------------------------

def test_climbs_several_tiers_in_one_decision():
    p = one_slot([1, 3, 5, 7], 1, **EXACT)
    assert p.update(1, [7]) == 7


def test_descends_several_tiers_in_one_decision():
    p = one_slot([1, 3, 5, 7], 7, **EXACT)
    assert p.update(1, [0]) == 1


def test_stops_at_the_tier_the_ema_supports():
    p = one_slot([1, 3, 5, 7], 7, down_hysteresis=-0.25, **EXACT)
    # EMA 3 <= 5 - 0.5 - 0.25 drops 7 -> 5; 3 > 3 - 0.5 - 0.25 stops it there.
    assert p.update(1, [3]) == 5


def test_down_wins_when_both_thresholds_pass():
    # At K = 5 with EMA 5: down test 5 <= 3 - 0.5 + 3 passes, up test 5 > 5 - 0.5 would too.
    p = one_slot([1, 3, 5, 7], 5, down_hysteresis=3.0, **EXACT)
    assert p.update(1, [5]) == 3


# -- K = 0 -----------------------------------------------------------------------------------

def test_k0_rounds_do_not_move_the_ema():
    p = one_slot([0, 1], 0, warmup_batches=100)
    for _ in range(5):
        p.update(1, [3, 3])
    assert ema_of(p) == -1.0  # the neutral start K - 1, untouched while K = 0


def test_k0_always_probes_one_tier_up_and_starts_from_neutral_ema():
    p = one_slot([0, 1, 3], 0, **EXACT)
    assert p.update(1, [0, 0]) == 1
    assert ema_of(p) == 0.0  # target - 1, as nothing was learned at K = 0


def test_k0_probe_after_dropping_keeps_the_learned_ema():
    p = one_slot([0, 1, 3], 1, **EXACT)
    assert p.update(1, [0]) == 0
    assert p.update(1, [0]) == 1  # probes again regardless of acceptance
    assert ema_of(p) == 0.0  # the learned (non-negative) EMA is kept


def test_single_zero_tier_stays_at_zero():
    p = one_slot([0], 0, **EXACT)
    assert [p.update(1, [5]) for _ in range(3)] == [0, 0, 0]


# -- ceiling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("coeff, expected", [
    (0, 7),  # off: EMA 2.6 > 3 - 0.5 - 0.25 holds K = 7
    (1.0, 3),  # ceiling ceil(2.6) = 3 caps the hold down to 3
    (3.0, 7),  # ceiling ceil(7.8) = 8 lets 7 stand
])
def test_ceiling_caps_a_hold(coeff, expected):
    p = one_slot([1, 3, 7], 7, ceiling_coeff=coeff, **EXACT)
    assert p.update(1, [3, 3, 3, 2, 2]) == expected


def test_ceiling_never_blocks_an_up_move():
    p = one_slot([1, 3, 7], 1, ceiling_coeff=1.0, **EXACT)
    assert p.update(1, [3, 3, 3, 2, 2]) == 7  # ceiling 3, but 7 > old K so it stands


def test_ceiling_is_at_least_one():
    # down_hysteresis -1 makes EMA 0 hold K = 3; the ceiling max(1, ceil(0)) = 1 caps it to 1.
    p = one_slot([1, 3], 3, down_hysteresis=-1.0, ceiling_coeff=2.0, **EXACT)
    assert p.update(1, [0]) == 1


def test_next_steps_is_pure():
    slot = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3]}}).slots[0]
    assert next_steps(slot, 1, 2.0) == (3, 2.0)
    assert next_steps(slot, 1, 2.0) == (3, 2.0)


# -- routing and initial steps ---------------------------------------------------------------

def routed_policy():
    cfg = AdaptiveConfig.from_dict({k: {"candidate_steps": [1, 3, 7], **EXACT} for k in ("1", "8", "32")})
    return EmaTierPolicy(cfg, initial_steps=3)


@pytest.mark.parametrize("batch_size, slot", [(0, "1"), (1, "1"), (7, "1"), (8, "8"), (31, "8"), (32, "32"), (999, "32")])
def test_routing_to_largest_key_at_or_below(batch_size, slot):
    p = routed_policy()
    p.update(batch_size, [7])
    moved = [k for k, s in p.info()["slots"].items() if s["steps"] == 7]
    assert moved == [slot]


def test_initial_steps_per_slot_follow_sglang():
    cfg = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [0, 1]},
                                    "64": {"candidate_steps": [0]}})
    p = EmaTierPolicy(cfg, initial_steps=3)
    assert [p.steps_for(b) for b in (1, 8, 64)] == [3, 1, 0]  # 3; not a tier -> middle [0,1][1]; [0]
    assert EmaTierPolicy(cfg).initial_steps == 3  # default: middle of all tiers [0,1,3,5,7]


def test_initial_steps_outside_every_tier_is_refused():
    with pytest.raises(ConfigError, match="initial_steps"):
        one_slot([1, 3], 2)


# -- rewarm, state, info ---------------------------------------------------------------------

def test_rewarm_resets_ema_and_warmup_but_keeps_k():
    p = one_slot([1, 3, 7], 1, warmup_batches=3, update_interval=2, ema_alpha=0.5)
    for _ in range(5):
        p.update(1, [7])
    assert p.steps_for(1) == 7
    p.rewarm()
    assert p.steps_for(1) == 7
    assert ema_of(p) == 6.0 and p.info()["slots"]["1"]["batches"] == 0
    ks = [p.update(1, [0]) for _ in range(5)]
    assert ks == [7, 7, 7, 7, 1]  # warmup repeats: no decision until round 3 + 2


def test_state_dict_round_trip_continues_identically():
    cfg = load_adaptive_config(adaptive_config_path("aggressive"))
    rng = random.Random(3)
    trace = [(rng.choice([1, 4, 9, 70, 200]), [rng.randint(0, 4) for _ in range(3)]) for _ in range(120)]
    a = EmaTierPolicy(cfg, initial_steps=3)
    for b, acc in trace[:60]:
        a.update(b, acc)
    state = json.loads(json.dumps(a.state_dict()))
    b_ = EmaTierPolicy(cfg, initial_steps=1)
    b_.load_state_dict(state)
    assert b_.info() == a.info()
    assert [a.update(b, acc) for b, acc in trace[60:]] == [b_.update(b, acc) for b, acc in trace[60:]]


def test_load_state_dict_names_the_bad_field():
    p = one_slot([1, 3], 1)
    state = p.state_dict()
    state["slots"]["1"]["steps"] = 5
    with pytest.raises(ConfigError, match=r'state\.slots\["1"\]\.steps'):
        p.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"state\.slots"):
        p.load_state_dict({"policy": "ema_tier", "slots": {"2": {}}})


def test_info_counts_decisions_and_changes():
    p = one_slot([1, 3], 1, **EXACT)
    for acc in ([3], [3], [0]):
        p.update(1, acc)
    assert p.info()["slots"]["1"] == {"steps": 1, "ema": 0.0, "batches": 3, "decisions": 3, "changes": 2}


def test_is_a_step_policy_and_cheap():
    p = EmaTierPolicy(load_adaptive_config(adaptive_config_path()), initial_steps=3)
    assert isinstance(p, StepPolicy)
    assert 0 < measure_decision_cost_us(p, n=300) < 500  # a few µs on a quiet core; loose for CI


# -- parity with SGLang ----------------------------------------------------------------------

SGL, SGL_VERSION = load_sglang_adaptive()


def test_sglang_reference_is_installed():
    assert SGL is not None, SGL_VERSION


def random_config(rng: random.Random) -> dict:
    keys = sorted(rng.sample(range(1, 129), rng.randint(1, 4)))
    cfg: dict = {}
    if rng.random() < 0.5:
        cfg["ema_alpha"] = rng.choice([0.1, 0.2, 0.5, 1.0])
    if rng.random() < 0.5:
        cfg["warmup_batches"] = rng.randint(0, 12)
    if rng.random() < 0.5:
        cfg["update_interval"] = rng.randint(1, 6)
    for k in keys:
        slot = {"candidate_steps": rng.sample(range(0, 9), rng.randint(1, 4))}
        for name, choices in (("down_hysteresis", [-0.5, -0.25, 0.0, 0.25]), ("up_hysteresis", [-0.25, 0.0, 0.25, 0.5]),
                              ("ceiling_coeff", [0, 0, 1.0, 1.2, 1.67, 3.0]), ("ema_alpha", [0.2, 0.6]),
                              ("update_interval", [1, 3])):
            if rng.random() < 0.5:
                slot[name] = rng.choice(choices)
        cfg[str(k)] = slot
    return cfg


def random_trace(rng: random.Random, policy: EmaTierPolicy, keys: list[int], rounds: int):
    """Rounds whose acceptance follows the policy's own K and drifts between regimes."""
    p_accept = rng.random()
    for _ in range(rounds):
        if rng.random() < 0.03:
            p_accept = rng.random()
        b = max(1, rng.choice(keys) + rng.randint(-2, 20))
        k = policy.steps_for(b)
        acc = []
        for _ in range(rng.randint(0, 6)):  # 0: an empty round now and then
            n = 0
            while n < k and rng.random() < p_accept:
                n += 1
            acc.append(n)
        yield b, acc


def test_sglang_default_config_is_the_shipped_file():
    assert json.loads(adaptive_config_path("sglang_default").read_text()) == SGL.DEFAULT_ADAPTIVE_CONFIG


@pytest.mark.parametrize("preset", ["sglang_default", "aggressive", "conservative"])
def test_presets_load_the_same_in_sglang(preset):
    path = adaptive_config_path(preset)
    ours = load_adaptive_config(path)
    assert ours.candidate_steps == SGL.resolve_candidate_steps_from_config(str(path))


def test_random_traces_match_sglang_decision_by_decision(tmp_path):
    """Seeded random configs and traces: K before and after every round, and the EMA, agree.

    Written against SGLang SGLANG_VERSION_COMPARED (see sglang_adaptive_ref)."""
    rng = random.Random(20240601)
    moves = {"up": 0, "down": 0, "probe": 0, "decisions": 0}
    for trial in range(60):
        raw = random_config(rng)
        path = tmp_path / f"cfg{trial}.json"
        path.write_text(json.dumps(raw))
        cfg = load_adaptive_config(path)
        initial = rng.choice(cfg.candidate_steps)
        ours = EmaTierPolicy(cfg, initial_steps=initial)
        theirs = SGL.AdaptiveSpeculativeParams(initial_steps=initial, cfg_path=str(path))
        for n, (b, acc) in enumerate(random_trace(rng, ours, cfg.keys, 300)):
            before = ours.steps_for(b)
            assert before == theirs.get_steps_for_batch(b), (trial, n)
            after = ours.update(b, acc)
            theirs.on_verify_complete(acc, b)
            assert after == theirs.get_steps_for_batch(b), (trial, n, raw, initial)
            slot = theirs._route(b)
            assert ema_of(ours, str(cfg.slot_for(b).min_batch_size)) == slot.ema_accept_len, (trial, n)
            if after != before:
                moves["probe" if before == 0 else "up" if after > before else "down"] += 1
        moves["decisions"] += sum(s["decisions"] for s in ours.info()["slots"].values())
    # The traces must have exercised every kind of move, or the comparison proves little.
    assert min(moves.values()) >= 20, moves


def test_installed_sglang_is_the_version_compared():
    # Another SGLang may pass or fail parity; either way SGLANG_VERSION_COMPARED must be revisited.
    assert SGL_VERSION == SGLANG_VERSION_COMPARED, \
        f"installed sglang {SGL_VERSION}; parity was established against {SGLANG_VERSION_COMPARED}"
