"""The daemon's decisions on fixed inputs: the swap gate, live acceptance tallies from span rows,
the K-mix score, the rollback monitor. Named boundary cases."""

import pytest

from online_spec.config import ConfigError
from trainer.gate import (GateConfig, LiveAcceptance, RollbackMonitor, SwapGate, expected_accept_length,
                          k_mix_depth, k_mix_score)

def per_round(live: LiveAcceptance, accepted, steps, versions, batches, tag) -> None:
    """Feed rows as one span per verify round: rounds of different requests (independent)."""
    start = 0
    for i, (a, k) in enumerate(zip(accepted, steps)):
        if k > 0 and a != 1:  # the row that closes a round
            live.observe_rows(accepted[start:i + 1], steps[start:i + 1], versions[start:i + 1],
                              batches[start:i + 1], tag)
            start = i + 1
    if start < len(accepted):
        live.observe_rows(accepted[start:], steps[start:], versions[start:], batches[start:], tag)


CFG = GateConfig(margin_rel=0.05, margin_abs=0.1, min_anchors=100, rollback_threshold=0.2, rollback_min_requests=1, rollback_min_rounds=3)


def test_gate_needs_the_larger_of_both_margins_and_enough_anchors():
    gate = SwapGate(CFG)
    assert not gate.decide(2.0, 1.0, anchors=99).publish  # too few anchors
    assert gate.decide(1.1, 1.0, anchors=100).publish  # +0.1 = abs margin, exactly met
    assert not gate.decide(1.09, 1.0, anchors=100).publish
    assert gate.decide(3.151, 3.0, anchors=100).publish  # rel margin 0.15 > abs 0.1
    d = gate.decide(3.14, 3.0, anchors=100)
    assert not d.publish and "3.150" in d.reason


def test_live_acceptance_counts_rounds_by_their_closing_row():
    live = LiveAcceptance()
    # version 1, K=3: round A accepts 2 (rows 1,1,0), round B accepts all 3 (1,1,1,-1);
    # a prefill row (K=0) and a plain-decode row are ignored
    per_round(live, [-1, 1, 1, 0, 1, 1, 1, -1, -1], [0, 3, 3, 3, 3, 3, 3, 3, 0], [1] * 9, [4] * 9, "chat")
    acc, rounds = live.accept_length(1)
    assert rounds == 2 and acc == pytest.approx(2.5)
    assert live.summary()["slot"]["1/4"] == pytest.approx(2.5)
    assert live.summary()["tag"]["1/chat"] == pytest.approx(2.5)
    assert dict(live.k_counts) == {3: 2}
    assert live.accept_length(2) == (0.0, 0)


def test_the_gate_scores_as_deep_as_the_server_drafts():
    assert k_mix_depth({}, 7) == 7 and k_mix_depth({0: 50}, 7) == 7  # nothing drafted yet: every step
    assert k_mix_depth({0: 10, 3: 90, 5: 10}, 7) == 5
    assert k_mix_depth({3: 1000, 6: 5}, 7) == 3  # K = 6 in 0.5 % of the rounds: not worth its steps
    assert k_mix_depth({9: 4}, 7) == 7  # never deeper than the gate's most


def test_k_mix_score_weights_by_live_rounds():
    acc = {"1": 0.8, "3": 1.8, "5": 2.4}
    assert k_mix_score(acc, {3: 3, 5: 1}) == pytest.approx((3 * 1.8 + 2.4) / 4)
    assert k_mix_score(acc, {0: 10}) == pytest.approx((0.8 + 1.8 + 2.4) / 3)  # nothing drafted yet


def test_rollback_waits_then_rolls_back_a_worse_version_and_keeps_a_good_one():
    mon = RollbackMonitor(CFG)
    live = LiveAcceptance()
    mon.start(new_version=2, previous_version=1, previous_accept=2.0, previous_rounds=50)
    per_round(live, [1, 0, 0], [3, 3, 3], [2, 2, 2], [1, 1, 1], "")  # 2 rounds of v2
    assert mon.update(live).action == "wait"
    per_round(live, [0], [3], [2], [1], "")  # 3 rounds, accept 1/3 < 2.0 * 0.8
    assert mon.update(live).action == "rollback"
    assert mon.update(live).action == "keep"  # nothing watched any more

    mon.start(3, 1, previous_accept=2.0, previous_rounds=50)
    per_round(live, [1, 1, 0] * 3, [3] * 9, [3] * 9, [1] * 9, "")  # accept 2.0 per round
    assert mon.update(live).action == "keep"
    state = mon.state_dict()
    mon2 = RollbackMonitor(CFG)
    mon2.load_state_dict(state)
    assert mon2.watching == mon.watching


def test_gate_refuses_a_mix_winner_that_forgets_a_tag():
    """A candidate better on today's code but >5 % worse on the buffer's chat is refused, with the
    tag named; a regression within the tolerance, or on a tag with too few anchors, is not."""
    gate = SwapGate(GateConfig(min_anchors=100, tag_regress=0.05))
    code_win = {"code": (2.0, 1.4, 500)}
    assert gate.decide(2.0, 1.4, 500, {**code_win, "chat": (0.96, 1.0, 300)}).publish  # -4 %: kept
    d = gate.decide(2.0, 1.4, 500, {**code_win, "chat": (0.94, 1.0, 300)})  # -6 %: refused
    assert not d.publish and "'chat'" in d.reason and "0.940" in d.reason
    assert gate.decide(2.0, 1.4, 500, {**code_win, "chat": (0.5, 1.0, 99)}).publish  # too few anchors to judge
    assert SwapGate(GateConfig(min_anchors=100, tag_regress=1.0)).decide(
        2.0, 1.4, 500, {"chat": (0.0, 1.0, 300)}).publish  # 1 = off
    assert not gate.decide(1.0, 1.4, 500, {"chat": (2.0, 1.0, 300)}).publish  # the mix still decides first


def test_gate_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="tag_regress"):
        GateConfig(tag_regress=1.5)
    with pytest.raises(ConfigError, match="rollback_threshold"):
        GateConfig(rollback_threshold=1.5)
    with pytest.raises(ConfigError, match="min_anchors"):
        GateConfig(min_anchors=0)


def test_rollback_compares_versions_on_the_same_traffic_tags():
    # v1 served chat (accept 2.0) and code (accept 1.0); after the swap v2 serves code only at 1.0:
    # overall that is half of v1's 1.5 (a rollback by the overall figure), on code it is equal
    live = LiveAcceptance()
    per_round(live, [1, 1, 0] * 10, [3] * 30, [1] * 30, [1] * 30, "chat")  # v1 chat: 10 rounds, 2.0
    per_round(live, [1, 0] * 10, [3] * 20, [1] * 20, [1] * 20, "code")  # v1 code: 10 rounds, 1.0
    acc, rounds = live.accept_length(1)
    assert acc == pytest.approx(1.5) and live.by_tags(1) == {"chat": (20, 10), "code": (10, 10)}
    mon = RollbackMonitor(CFG)
    mon.start(2, 1, acc, rounds, live.by_tags(1))
    per_round(live, [1, 0] * 3, [3] * 6, [2] * 6, [1] * 6, "code")  # v2 code: 3 rounds, 1.0
    d = mon.update(live)
    assert d.action == "keep" and "code" in d.reason
    # a v3 worse on code than v2 (0.33 < 1.0 * 0.8) is rolled back
    mon.start(3, 2, *live.accept_length(2), live.by_tags(2))
    per_round(live, [1, 0, 0, 0], [3] * 4, [3] * 4, [1] * 4, "code")
    assert mon.update(live).action == "rollback"
    # no tag in common with the previous version: the overall figures decide (as before)
    mon.start(4, 1, acc, rounds, {"other": (5, 5)})
    per_round(live, [1, 0] * 3, [3] * 6, [4] * 6, [1] * 6, "code")
    d = mon.update(live)
    assert d.action == "rollback" and "overall" in d.reason
    mon2 = RollbackMonitor(CFG)
    mon2.load_state_dict(__import__("json").loads(__import__("json").dumps(mon.state_dict())))
    assert mon2.baseline == mon.baseline


def test_positions_are_counted_per_round_from_the_rows():
    live = LiveAcceptance()
    # K=3: accepts 2 (1,1,0), accepts 3 (1,1,1,-1), accepts 0 (0); K=1: accepts 1 (1,-1)
    per_round(live, [-1, 1, 1, 0, 1, 1, 1, -1, 0, 1, -1], [0, 3, 3, 3, 3, 3, 3, 3, 3, 1, 1], [1] * 11, [2] * 11,
                      "chat")
    pos = live.position_tallies(1)["chat"]
    assert pos["trials"] == [4, 2, 2] and pos["hits"] == [3, 2, 1]
    assert pos["rounds_by_k"] == {3: 3, 1: 1}
    assert live.position_tallies(2) == {}
    # a0 = 3/4, a1 = 1, a2 = 1/2: K=1 -> 0.75, K=3 -> 0.75 + 0.75 + 0.375; position 4 extends a2
    assert expected_accept_length(pos["hits"], pos["trials"], 1) == pytest.approx(0.75)
    assert expected_accept_length(pos["hits"], pos["trials"], 3) == pytest.approx(1.875)
    assert expected_accept_length(pos["hits"], pos["trials"], 4) == pytest.approx(1.875 + 0.1875)
    assert expected_accept_length([], [], 2) is None


def test_rollback_compares_at_the_new_versions_k():
    # v1 ran K=3 with per-position acceptance 1, 1, 0 (2 drafts a round); after the swap the
    # controller re-warms and v2 runs K=1 with the same first position: 1 draft a round. By the
    # accept lengths that is half of v1's (a rollback); at the same K it is v1's own figure
    live = LiveAcceptance()
    per_round(live, [1, 1, 0] * 10, [3] * 30, [1] * 30, [1] * 30, "code")
    mon = RollbackMonitor(CFG)
    mon.start(2, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    per_round(live, [1, -1] * 4, [1] * 8, [2] * 8, [1] * 8, "code")
    d = mon.update(live)
    assert d.action == "keep" and "same K" in d.reason, d.reason
    # without the per-position tallies (a state saved before them) it is judged by accept lengths
    mon.start(3, 1, *live.accept_length(1), live.by_tags(1))
    per_round(live, [1, -1] * 4, [1] * 8, [3] * 8, [1] * 8, "code")
    d = mon.update(live)
    assert d.action == "rollback" and "same K" not in d.reason
    # a version worse at its own K is still rolled back: v4 at K=1 accepts 1 of 4 (v1 there: 4 of 4)
    mon.start(4, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    per_round(live, [1, -1, 0, 0, 0], [1] * 5, [4] * 5, [1] * 5, "code")
    d = mon.update(live)
    assert d.action == "rollback" and "same K" in d.reason, d.reason
    mon2 = RollbackMonitor(CFG)
    mon2.load_state_dict(__import__("json").loads(__import__("json").dumps(mon.state_dict())))
    assert mon2.baseline == mon.baseline


def test_rollback_waits_out_a_drop_that_is_not_significant():
    """Per-round acceptance is 0..K: a short run of hard rounds after a swap falls below the
    previous version's figure by more than the threshold without being evidence of a worse head.
    The monitor waits while the drop is under rollback_z standard errors, rolls back once it is
    over, and keeps the version after rollback_max_rounds rounds without a significant drop."""
    cfg = GateConfig(rollback_threshold=0.1, rollback_min_requests=1, rollback_min_rounds=4, rollback_z=2.0, rollback_max_rounds=40)
    live = LiveAcceptance()
    per_round(live, [1, 1, 0, 0] * 20, [3] * 80, [1] * 80, [1] * 80, "code")  # v1: rounds of 2 and 0: mean 1
    mon = RollbackMonitor(cfg)
    mon.start(2, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    # v2, same per-round spread, 4 rounds at 0.5: 50% below v1 but se = 0.5 (z = 1)
    per_round(live, [1, 1, 0, 0, 0, 0], [3] * 6, [2] * 6, [1] * 6, "code")
    assert live.accept_length(2) == (0.5, 4)
    assert live.standard_error(2, ["code"]) == pytest.approx(0.5)
    d = mon.update(live)
    assert d.action == "wait" and "standard errors" in d.reason, d.reason
    # more rounds: 2 and 0 alternating, then two of 3: 16 drafts in 14 rounds, not below v1 by 10 %
    per_round(live, [1, 1, 0, 0] * 4 + [1, 1, 1, -1] * 2, [3] * 24, [2] * 24, [1] * 24, "code")
    assert live.accept_length(2) == (pytest.approx(16 / 14), 14)
    assert mon.update(live).action == "keep"
    # v3 really worse: every round accepts 0 -> no spread, the drop is significant at min_rounds
    mon.start(3, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    per_round(live, [0] * 4, [3] * 4, [3] * 4, [1] * 4, "code")
    d = mon.update(live)
    assert d.action == "rollback" and "standard errors" in d.reason
    # v4 at 0.8 (20 % below) with a spread that keeps the drop at ~1.2 standard errors after
    # rollback_max_rounds = 40 rounds (2, 2, 0, 0, 0 repeated): kept
    mon.start(4, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    per_round(live, [1, 1, 0, 1, 1, 0, 0, 0, 0] * 7, [3] * 63, [4] * 63, [1] * 63, "code")  # 35 rounds
    assert live.accept_length(4) == (pytest.approx(0.8), 35)
    assert mon.update(live).action == "wait"
    per_round(live, [1, 1, 0, 1, 1, 0, 0, 0, 0], [3] * 9, [4] * 9, [1] * 9, "code")  # 40 rounds
    d = mon.update(live)
    assert d.action == "keep" and "no significant drop in 40 rounds" in d.reason, d.reason


def test_standard_error_counts_requests_not_rounds():
    """Rounds of one request are alike: 200 rounds from 10 requests, half of which accept 2 drafts
    every round and half 0, have a per-round standard error of 0.07 but are 10 samples: the
    standard error is taken over requests (0.33), and a drop from 1.5 to 1.0 that is 7 standard
    errors by rounds alone (a rollback before) is 1.5 by requests: the monitor waits. One request
    alone has no spread between requests to judge by: inf; and before rollback_min_requests
    requests nothing is judged."""
    live = LiveAcceptance()
    live.observe_rows([1, 0, 1, 0] * 200, [3] * 800, [1] * 800, [1] * 800, "code")  # v1: 1.0 a round
    early = RollbackMonitor(GateConfig(rollback_threshold=0.1, rollback_min_rounds=30, rollback_min_requests=8))
    early.start(2, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    for r in range(10):
        rows = [1, 1, 0] * 20 if r % 2 else [0] * 20
        live.observe_rows(rows, [3] * len(rows), [2] * len(rows), [1] * len(rows), "code")
        if r == 1:  # 40 rounds of 2 requests: not judged yet, whatever they show
            d = early.update(live)
            assert d.action == "wait" and "from 2 requests (< 8)" in d.reason, d.reason
    assert live.accept_length(2) == (1.0, 200)
    by_rounds = (200 / 199 / 200) ** 0.5  # 100 rounds of 2, 100 of 0
    by_requests = (10 / 9 * 10 * 20 ** 2 / 200 ** 2) ** 0.5  # each request 20 rounds off the mean by 20
    assert by_rounds == pytest.approx(0.0709, abs=1e-4) and by_requests == pytest.approx(0.333, abs=1e-3)
    assert live.standard_error(2, ["code"]) == pytest.approx(by_requests)
    one = LiveAcceptance()
    one.observe_rows([1, 1, 0] * 20, [3] * 60, [5] * 60, [1] * 60, "code")
    assert one.standard_error(5) == float("inf")
    live.observe_rows([1, 1, 0, 1, 0] * 200, [3] * 1000, [3] * 1000, [1] * 1000, "code")  # v3: 1.5 a round
    mon = RollbackMonitor(GateConfig(rollback_threshold=0.1, rollback_min_rounds=40, rollback_z=2.0))
    mon.start(2, 3, *live.accept_length(3), live.by_tags(3), live.position_tallies(3))
    d = mon.update(live)
    assert d.action == "wait" and "1.5 standard errors" in d.reason, d.reason


def test_the_previous_versions_own_standard_error_counts():
    """Right after a shift the previous version's figure on the new tag comes from a few requests:
    v1 accepted 3 drafts a round on one code request and 1 on another (mean 2, standard error 1);
    v2 accepts 1.2 on ten requests alike. 40 % below, and ~28 standard errors of v2's own mean,
    but 0.8 of the difference once v1's standard error adds in: wait (and with v1's figure taken
    as exact, as before, a rollback)."""
    live = LiveAcceptance()
    for a in (3, 1):
        rows = ([1] * a + [0]) * 20
        live.observe_rows(rows, [3] * len(rows), [1] * len(rows), [1] * len(rows), "code")
    for r in range(10):
        rows = ([1, 0] * 4 + [1, 1, 0]) * 4  # 1.2 drafts a round in every request
        live.observe_rows(rows, [3] * len(rows), [2] * len(rows), [1] * len(rows), "code")
    assert live.accept_length(1) == (2.0, 40) and live.standard_error(1, ["code"]) == pytest.approx(1.0)
    cfg = GateConfig(rollback_threshold=0.1, rollback_min_rounds=30, rollback_min_requests=8, rollback_z=2.0,
                     rollback_max_rounds=10_000)
    prev = (*live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    with_se = RollbackMonitor(cfg)
    with_se.start(2, 1, *prev, {"code": live.standard_error(1, ["code"])})
    d = with_se.update(live)
    assert d.action == "wait" and "standard errors" in d.reason, d.reason
    exact = RollbackMonitor(cfg)
    exact.start(2, 1, *prev)
    assert exact.update(live).action == "rollback"


def test_rollback_z_config_errors():
    with pytest.raises(ConfigError, match="rollback_z"):
        GateConfig(rollback_z=-1)
    with pytest.raises(ConfigError, match="rollback_max_rounds"):
        GateConfig(rollback_max_rounds=0)


def test_rollback_max_rounds_below_min_rounds_decides_at_min_rounds():
    cfg = GateConfig(rollback_threshold=0.1, rollback_min_requests=1, rollback_min_rounds=4, rollback_z=2.0, rollback_max_rounds=1)
    live = LiveAcceptance()
    per_round(live, [1, 1, 0, 0] * 20, [3] * 80, [1] * 80, [1] * 80, "code")
    mon = RollbackMonitor(cfg)
    mon.start(2, 1, *live.accept_length(1), live.by_tags(1), live.position_tallies(1))
    per_round(live, [1, 1, 0, 0, 0, 0], [3] * 6, [2] * 6, [1] * 6, "code")  # 50 % below, 1 standard error
    d = mon.update(live)
    assert d.action == "keep" and "no significant drop" in d.reason
