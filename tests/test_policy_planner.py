"""The cost policy learning on a worker thread (serving/policy_planner.py).

Its contract, checked against a naive reference: round n + 1 decides (K, early stops, verify
lengths) exactly as the bare policy decides after learning rounds 1..n - 1, or every round so
far when the batch size had no plan; the worker thread decides the same as learning on the
engine thread; rewarm reaches the policy in order; a failing update is counted and never stops
the rounds; the engine's greedy output stays the target's own (a tiny random Llama: the model
does not matter to the decisions' plumbing).
"""

import copy
import gc
import random
import threading

import numpy as np
import pytest

from online_spec.controller import (AdaptiveConfig, CostModel, CostModelPolicy, CostPolicyConfig, TimedPolicy,
                                    measure_decision_cost_us)
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig
from serving.policy_planner import PlannedPolicy, plan_ahead


def bare_policy() -> CostModelPolicy:
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3, 5]},
                                         "4": {"candidate_steps": [0, 1, 3]}})
    # a short acceptance window: K answers within a round or two, so a decision one round late shows
    return CostModelPolicy(adaptive, CostPolicyConfig(accept_window=3.0, probe_interval=8),
                           CostModel.with_coefficients((0.01, 0.001, 0, 0.002, 0), (0.1, 0.004, 0.02, 0.02, 0.001)))


def traffic(seed: int, rounds: int = 160):
    """Rounds of a fixed random stream: batch size, per-draft confidences, a rewarm now and then.
    Acceptance follows the confidences, which swing between high and low every few rounds, so the
    estimates move and K changes often."""
    rng = random.Random(seed)
    out = []
    for n in range(rounds):
        b = rng.choice([1, 1, 2, 4, 5, 6])
        conf = np.array([[rng.random() ** (0.2 if (n // 3) % 2 else 3.0) for _ in range(5)] for _ in range(b)],
                        dtype=np.float32)
        out.append((b, conf, n % 53 == 52))
    return out


def leading(row, n):
    """Drafts accepted: the leading confidences above 0.5, of the n verified."""
    a = 0
    while a < n and row[a] > 0.5:
        a += 1
    return a


def drive(policy, stream, lists: bool = False, last: bool = False):
    """Run the stream through `policy` as the engine does; returns each round's decisions.
    lists: every step's confidences as the engine passes them (a list: the planner's early stop
    then tallies every step for the verify cut); else a numpy column every other step. last: ask
    after the round's last step too, its answer unused (the engine does when the policy also
    cuts the verify: the planner's cut then reads its tally alone)."""
    decisions = []
    for b, drafts, rewarm in stream:
        ctx = 100 * b  # one context per batch size: a plan is built at its batch size's last context
        k = policy.steps_for(b, ctx)
        stops, kept = [], k
        for i in range(1, k + 1 if last else k):
            column = drafts[:, i - 1]  # the engine passes a list of floats; a numpy column every other step
            go = policy.should_continue(i, column.tolist() if i % 2 or lists else column, b, ctx)
            stops.append(go)
            if not go and i < k:
                kept = i
                break
        conf = drafts[:, :kept]
        lens = policy.verify_lengths(conf, ctx, padded=True) if kept else [0] * b
        accepted = [leading(row, n) for row, n in zip(conf.tolist(), lens)]
        policy.update(b, accepted, num_steps=lens, ctx_len=ctx, draft_s=0.01 * kept + 0.002,
                      verify_s=0.1 + 0.02 * b * (max(lens, default=0) + 1), confidences=conf[:, :max(lens, default=0)])
        if rewarm:
            policy.rewarm()
        decisions.append((k, stops, list(lens)))
    return decisions


class LaggedReference:
    """The planner's contract written out naively over the bare policy. Before round m (1-based)
    the rounds 1..n = m - 2 are learnt (n = 0: none); the plans then are those of the batch sizes
    served in rounds n - keep + 1..n, each at its last context (n = 0: each slot's smallest size
    at context 0). A batch size with a plan decides as the bare policy at that context; one
    without decides by the plan of the nearest size of its slot (the smaller on a tie); a slot
    without plans learns every round so far and decides at the round's own size and context.
    Rewarms are learnt after their round."""

    def __init__(self, policy, keep: int):
        self.policy, self.keep, self.queue, self.learnt, self.rounds = policy, keep, [], 0, []
        self.plan = self.probing = self.k = None

    def steps_for(self, b, ctx):
        p = self.policy
        n = max(0, len(self.rounds) - 1)
        while self.learnt < n:
            for fn in self.queue[self.learnt]:
                fn()
            self.learnt += 1
        if n == 0:
            planned = {max(1, s.min_batch_size): 0 for s in p.adaptive.slots}
        else:
            planned = {size: c for size, c in self.rounds[max(0, n - self.keep):n]}  # the last context wins
        slot = p.adaptive.slot_index
        near = sorted((abs(s - b), s) for s in planned if slot(s) == slot(b))
        if b in planned or not near:
            if not near:
                while self.learnt < len(self.rounds):
                    for fn in self.queue[self.learnt]:
                        fn()
                    self.learnt += 1
            self.plan, c = None, planned.get(b, ctx)
            self.ctx = c
            return p.steps_for(b, c)
        size = near[0][1]
        self.plan = p.plan(size, planned[size])
        self.k, self.probing = p.schedule(b, self.plan.steps)
        return self.k

    def should_continue(self, i, conf, b, ctx):
        if self.plan is None:
            return self.policy.should_continue(i, conf, b, self.ctx)
        return i < self.k if self.probing else self.plan.should_continue(i, conf)

    def verify_lengths(self, conf, ctx, padded=False):
        if self.plan is None:
            return self.policy.verify_lengths(conf, self.ctx, padded=padded)
        return self.plan.verify_lengths(conf, padded=padded, keep_all=self.probing)

    def update(self, b, accepted, **kw):
        self.rounds.append((b, kw["ctx_len"]))
        self.queue.append([lambda: self.policy.update(b, accepted, **kw)])

    def rewarm(self):
        self.queue[-1].append(self.policy.rewarm)


@pytest.mark.parametrize("keep,lists,last", [(64, False, False), (3, False, False), (64, True, False),
                                             (64, True, True), (3, True, True)])
def test_decisions_are_the_bare_policy_one_round_behind(keep, lists, last):
    stream = traffic(seed=keep)
    planned = drive(PlannedPolicy(bare_policy(), threaded=False, keep_rounds=keep), stream, lists, last)
    reference = drive(LaggedReference(bare_policy(), keep), stream, lists, last)
    assert planned == reference
    ks = {d[0] for d in planned}
    assert len(ks) >= 3 and any(False in d[1] for d in planned)  # K moves and the early stop fires
    # without the lag the bare policy decides otherwise somewhere: the reference is not the bare policy
    assert drive(bare_policy(), stream) != reference


def test_a_new_batch_size_runs_the_nearest_plan_of_its_slot():
    """Named cases of the plans a batch size without its own reads (slots 1-3 and 4+)."""
    planned = PlannedPolicy(bare_policy(), threaded=False)
    bare = bare_policy()
    # before any round: each slot's smallest size at context 0, whatever the round's context
    assert planned.steps_for(2, 5000) == bare.schedule(2, bare.plan(1, 0).steps)[0]
    assert (planned._plan.batch_size, planned._plan.ctx_len) == (1, 0)
    planned.update(2, [1, 0], num_steps=1, ctx_len=5000)
    assert planned.steps_for(7, 300) and (planned._plan.batch_size, planned._plan.ctx_len) == (4, 0)
    planned.update(7, [0] * 7, num_steps=1, ctx_len=300)
    planned.steps_for(6, 50)  # plans through round 1: size 2 at its context; slot 4+ has none: inline
    assert (planned._plan.batch_size, planned._plan.ctx_len) == (6, 50)
    for b, ctx in ((6, 50), (4, 80), (4, 80), (4, 80)):
        planned.update(b, [0] * b, num_steps=1, ctx_len=ctx)
        planned.steps_for(b, ctx)
    planned.steps_for(5, 10)  # 4 and 6 planned: the tie goes to the smaller
    assert (planned._plan.batch_size, planned._plan.ctx_len) == (4, 80)
    planned.steps_for(3, 10)  # slot 1-3: size 2, at its last context
    assert (planned._plan.batch_size, planned._plan.ctx_len) == (2, 5000)


def test_the_worker_thread_decides_as_the_engine_thread_does():
    stream = traffic(seed=7, rounds=240)
    threaded = PlannedPolicy(bare_policy(), threaded=True)
    assert drive(threaded, stream) == drive(PlannedPolicy(bare_policy(), threaded=False), stream)
    threaded._learner.wait_idle(threaded._queued, threaded._thread)
    info = threaded.info()
    assert info["planner"]["threaded"] and info["planner"]["failures"] == 0
    assert info["planner"]["rounds_queued"] == 240 and info["planner"]["rounds_learnt"] == 240
    # state after every queued round is learnt equals the bare policy's after the same rounds
    copy_ = copy.deepcopy(threaded)
    assert copy_.state_dict() == threaded.state_dict()
    threaded.close()


def test_a_parked_worker_is_woken_by_the_next_round():
    """park_after_s 0: the worker parks whenever it has learnt everything, so each round's
    `update` finds it parked and must wake it (a round that did not would leave the next
    `steps_for` waiting for good); it decides as learning on the engine thread does."""
    stream = traffic(seed=11, rounds=80)
    planned = PlannedPolicy(bare_policy(), threaded=True, park_after_s=0.0)
    out = []
    driver = threading.Thread(target=lambda: out.append(drive(planned, stream)), daemon=True)
    driver.start()
    driver.join(timeout=60)
    assert not driver.is_alive(), "a round did not wake the parked worker"
    assert out[0] == drive(PlannedPolicy(bare_policy(), threaded=False), stream)
    for _ in range(200):  # idle again: it learns the last rounds and parks (parked alone may still be the
        if planned._learner.parked and planned._learner.learnt == 80:  # park the last rounds woke it from)
            break
        threading.Event().wait(0.01)
    assert planned._learner.parked and planned.info()["planner"]["rounds_learnt"] == 80
    planned.close()
    assert not planned._thread.is_alive()


def test_a_worker_following_a_host_window_parks_at_once():
    """On a GPU (a host window) the worker does not poll: it parks after each round, well within
    the default `park_after_s` (2 s) that a CPU worker polls for."""
    from online_spec.host_window import HostWindow
    planned = PlannedPolicy(bare_policy())
    planned.follow_window(HostWindow(wait_s=0.001))
    stream = traffic(seed=2, rounds=6)
    assert drive(planned, stream) == drive(PlannedPolicy(bare_policy(), threaded=False), stream)
    for _ in range(50):
        if planned._learner.parked:
            break
        threading.Event().wait(0.01)
    assert planned._learner.parked
    planned.close()


class FailingOnce(CostModelPolicy):
    def update(self, batch_size, accepted, **kw):
        if getattr(self, "fail_next", False):
            self.fail_next = False
            raise ValueError("broken round")
        return super().update(batch_size, accepted, **kw)


def test_a_failed_update_is_counted_and_the_rounds_go_on():
    inner = FailingOnce(bare_policy().adaptive, cost_model=bare_policy().cost)
    planned = PlannedPolicy(inner, threaded=True)
    stream = traffic(seed=3, rounds=30)
    drive(planned, stream[:10])
    inner.fail_next = True
    drive(planned, stream[10:])  # would hang or raise if the worker died
    planned._learner.wait_idle(planned._queued, planned._thread)
    info = planned.info()["planner"]
    assert info["failures"] == 1 and "broken round" in info["last_error"] and info["rounds_learnt"] == 30


def test_load_state_restores_and_copies_and_probes_work():
    stream = traffic(seed=5, rounds=60)
    planned = PlannedPolicy(bare_policy())
    drive(planned, stream)
    planned._learner.wait_idle(planned._queued, planned._thread)  # state_dict: what is learnt so far
    fresh = PlannedPolicy(bare_policy())
    fresh.load_state_dict(planned.state_dict())
    assert fresh.state_dict() == planned.state_dict()
    assert measure_decision_cost_us(planned, n=50, batch_size=4) > 0  # a deep copy with its own worker
    timed = TimedPolicy(PlannedPolicy(bare_policy()))
    drive(timed, stream[:20])
    assert len(timed.round_ns) == 20 and timed.early_stop and timed.truncates


def test_an_unused_policy_stops_its_worker():
    before = {t for t in threading.enumerate() if t.name == "policy-planner"}
    planned = PlannedPolicy(bare_policy())
    (thread,) = {t for t in threading.enumerate() if t.name == "policy-planner"} - before
    drive(planned, traffic(seed=1, rounds=5))
    del planned
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_plan_ahead_wraps_only_the_cost_policy_without_trees():
    from online_spec.controller import StaticSteps
    assert isinstance(plan_ahead(bare_policy()), PlannedPolicy)
    static = StaticSteps(3)
    assert plan_ahead(static) is static and plan_ahead(None) is None


def test_engine_output_stays_the_targets_with_the_planner():
    target = tiny_target(num_layers=4)
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=3, max_len=256, num_steps=0)).generate(prompts, params)
    planned = PlannedPolicy(bare_policy())
    eng = Engine(target, new_head(target, seed=4), EngineConfig(max_batch=3, max_len=256, max_steps=5),
                 policy=planned)
    assert eng.generate(prompts, params) == plain
    assert planned.info()["planner"]["rounds_queued"] > 10 and planned.info()["planner"]["failures"] == 0


class AskLog(PlannedPolicy):
    """The planner, logging what the engine asks in each round: the early stop's step indices and
    the verify cut's array shape."""

    def __init__(self, policy):
        super().__init__(policy, threaded=False)
        self.rounds = []

    def steps_for(self, batch_size, ctx_len=0):
        k = super().steps_for(batch_size, ctx_len)
        self.rounds.append({"asked": [], "cut": None, "k": k})
        return k

    def should_continue(self, step_index, draft_confidence, batch_size, ctx_len=0):
        go = super().should_continue(step_index, draft_confidence, batch_size, ctx_len)
        self.rounds[-1]["asked"].append((step_index, type(draft_confidence) is list, go))
        return go

    def update(self, batch_size, accepted, **round_):
        # round seconds of a fixed line, not the measured ones: the decisions, and so the rounds' kinds, repeat
        drafted = round_["confidences"].shape[1]
        round_.update(draft_s=0.01 * drafted + 0.002, verify_s=0.1 + 0.02 * batch_size * (drafted + 1))
        return super().update(batch_size, accepted, **round_)

    def verify_lengths(self, confidences, ctx_len=0, *, padded=False):
        plan, probing = self._plan, self._probing
        out = super().verify_lengths(confidences, ctx_len, padded=padded)
        # the plan's own cut of the same array, by `BatchPlan.verify_lengths` (no tally)
        self.rounds[-1]["cut"] = (confidences.shape, out, plan.verify_lengths(confidences, padded=padded,
                                                                              keep_all=probing))
        return out


def test_the_engine_asks_after_every_step_it_drafted_so_the_cut_reads_the_tally():
    """With the in-round cuts on, a round asks the early stop after steps 1, 2, ... in order, as
    lists, through the step that answered no or through its last step (its answer then unused),
    and its verify cut gets exactly those steps' confidences; the planner's cut from its tally
    equals the plan's own cut of the array (`BatchPlan.verify_lengths`)."""
    target = tiny_target(num_layers=2)
    prompts = [list(range(3 + i, 30 + 4 * i)) for i in range(6)]
    # a confident prior learnt away slowly: K stays above the random head's worth, so early stops fire
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3, 5]},
                                         "4": {"candidate_steps": [0, 1, 3, 5]}})
    policy = AskLog(CostModelPolicy(adaptive, CostPolicyConfig(accept_window=50.0, prior_accept=0.9, probe_interval=8),
                                    bare_policy().cost))
    eng = Engine(target, new_head(target, seed=4), EngineConfig(max_batch=4, max_len=256, max_steps=5,
                                                                 in_round_cuts="on"), policy=policy)
    eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    drafted = [r for r in policy.rounds if r["cut"] is not None]
    assert len(drafted) > 10
    for r in drafted:
        steps = [s for s, _, _ in r["asked"]]
        assert steps == list(range(1, len(steps) + 1)) and all(as_list for _, as_list, _ in r["asked"])
        shape, cut, reference = r["cut"]
        assert shape[1] == len(steps)  # every drafted step was asked about, the last included
        assert all(go for _, _, go in r["asked"][:-1])  # a no ends the drafting
        assert cut == reference
    # rounds stopped early (a no before K) and rounds through K (asked after step K too)
    assert any(len(r["asked"]) < r["k"] for r in drafted)
    assert any(len(r["asked"]) == r["k"] > 1 for r in drafted)
