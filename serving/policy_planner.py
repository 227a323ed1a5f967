"""The cost policy's learning off the engine's thread: `PlannedPolicy`.

In a round the engine asks its policy for K before drafting, whether to draft once more after
each draft step, and how many drafts to verify; after the verify it hands the policy the round
(`update`). The cost policy's learning (acceptance estimates, confidence calibration, the
round-time fit) and its choice of K are most of its cost, and inside the engine each of those
Python calls runs on caches the target's forward has just swept: ~4x their cost in a hot loop,
~300 us a round at batch 1 on a 2-core CPU (docs/controller.md). `PlannedPolicy` leaves the
engine thread only reading a plan:

- `update` (round n) appends the round to a deque and returns; a worker thread learns from it
  and builds a `BatchPlan` (online_spec/controller/plan.py) for every batch size served in the
  last `keep_rounds` rounds. The worker polls the deque every `poll_s` while rounds come and
  parks after `park_after_s` without one (at once when it follows a host window, as on a GPU);
  only the round that finds it parked wakes it. Waking a blocked thread is a system call that,
  on a 2-core CPU VM inside an engine round, cost the engine's thread ~40 us (a
  `queue.SimpleQueue` hand-over, against ~2 us for the append).
- `steps_for` of round n + 1 takes the plans built through round n - 1, learnt while round n
  ran (on a GPU the host waits on the device then; on a CPU the worker's Python runs while the
  target's kernels hold no Python lock). The lag is exactly one round whichever thread is
  faster, so the decisions do not depend on timing: `threaded=False` learns on the engine
  thread at the same points and decides the same (the tests hold it to that).
- A batch size without a plan (its first two rounds: the worker plans it from the round after
  its first) runs the plan of the nearest batch size of its slot that has one (the smaller on a
  tie), the same lag, built at that size and its last context: those rounds' K, early stops and
  verify cut are the bare policy's at the neighbouring size. Before any round each slot's
  smallest batch size is planned at context 0 (when the policy is wrapped or its state loaded).
  Only a slot with no plan at all plans on the engine thread, after every queued round is
  learnt (planning inline on cold caches, and waiting for the worker, cost the engine's thread
  1-4 ms at each new batch size, as requests left a batch of 16 one by one).
- Given the engine's host window (`follow_window`), the worker starts each queued round when
  the engine's thread next waits on the verify forward, the round's longest wait (at most the
  window's `wait_s` later), so its Python
  does not take turns on the interpreter lock with the engine's; the engine's thread waiting
  for a plan opens the window itself.
- `should_continue` / `verify_lengths` run the plan's rules (`continue_on`, and `verify_cut`
  with the plan's round seconds precomputed); the probe schedule stays the policy's own
  (`CostModelPolicy.schedule`, engine thread). Above a batch of one the early stop bins each
  step's list once for both rules (`tally_step`): the padded verify cut then bins only the
  round's last column, not all B x K confidences again.

`rewarm` and `load_state_dict` reach the policy in order with the rounds. A failure while
learning is logged and counted (`info()["planner"]`); the last plans stay in use, the engine
never waits on a dead worker.

    policy = plan_ahead(CostModelPolicy(adaptive, cost_model=model))   # what `serve` runs
"""

from __future__ import annotations

import atexit
import collections
import copy
import logging
import threading
import time
import weakref
from contextlib import nullcontext
from typing import Sequence

import numpy as np

from online_spec.config import ConfigError
from online_spec.controller.base import StepPolicyBase, check_policy
from online_spec.controller.cost import CostModelPolicy
from online_spec.controller.acceptance import SMALL_BATCH
from online_spec.controller.plan import PADDED_PYTHON, BatchPlan, continue_p
from online_spec.host_window import HostWindow

log = logging.getLogger(__name__)

_STOP = ("stop",)
POLL_S = 0.001  # how often a worker with rounds coming looks for the next one
PARK_AFTER_S = 2.0  # a worker that found no round for this long blocks until `update` wakes it
_WORKERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_LEARNERS: "weakref.WeakSet[_Learner]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    """Stop every worker before the interpreter ends: a daemon thread still running then is
    ended by a forced unwind, which a C++ frame under it turns into `terminate` (rc 134)."""
    for learner in list(_LEARNERS):
        learner.stop()
    for thread in list(_WORKERS):
        thread.join(timeout=2)


class _Learner:
    """The worker's side: applies queued rounds to the policy in order and publishes the plans
    learnt through each round. Holds no reference to its `PlannedPolicy`, so a policy nobody
    uses any more is collected and its worker told to stop."""

    def __init__(self, policy, keep_rounds: int, poll_s: float = POLL_S, park_after_s: float = PARK_AFTER_S):
        self.policy, self.keep_rounds = policy, keep_rounds
        self.poll_s, self.park_after_s = poll_s, park_after_s
        self.items: collections.deque = collections.deque()  # appended by the engine, popped by the worker
        self.parked = False  # the worker blocks on `wake` (the engine's thread then sets it)
        self.wake = threading.Event()
        self.cond = threading.Condition()
        self.learnt = 0  # rounds learnt from
        self.done = 0  # queued items (rounds and calls) applied
        self.seen: dict[int, tuple[float, int]] = {}  # batch size -> (its last context, the round it was seen)
        self.failures = 0
        self.last_error = ""
        self.plans: dict[int, dict[int, BatchPlan]] = {0: self.initial_plans()}  # rounds learnt -> size -> plan
        self.window: HostWindow | None = None  # start each item while the engine waits on the device

    def initial_plans(self) -> dict[int, BatchPlan]:
        """Each slot's smallest batch size planned at context 0: the plans before any round."""
        sizes = sorted({max(1, slot.min_batch_size) for slot in self.policy.adaptive.slots})
        return {b: plan for b in sizes if (plan := self._guarded(lambda: self.policy.plan(b, 0))) is not None}

    def put(self, item: tuple) -> None:
        """Hand the worker an item (engine thread): an append, and a wake only if it parked. The
        worker sets `parked` before it looks at the deque a last time, so either it sees the item
        or this sees `parked` (each step holds the interpreter lock)."""
        self.items.append(item)
        if self.parked:
            self.wake.set()

    def run(self) -> None:
        idle_since = None
        while True:
            try:
                item = self.items.popleft()
            except IndexError:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                # following a host window (a GPU engine) the worker parks at once: the poll's wake-ups
                # would take the interpreter lock from a host-bound engine thread (unmeasured there)
                if self.window is None and now - idle_since < self.park_after_s:
                    time.sleep(self.poll_s)
                    continue
                self.parked = True
                if not self.items:
                    self.wake.wait()
                self.wake.clear()
                self.parked = False
                idle_since = None
                continue
            idle_since = None
            if item is _STOP:
                return
            if self.window is not None:
                self.window.wait(long=True)
            self.apply(item)

    def apply(self, item: tuple) -> None:
        """One queued item: ("round", batch size, accepted, kwargs) or ("call", fn)."""
        if item[0] == "call":
            self._guarded(item[1])
            with self.cond:
                self.done += 1
                self.cond.notify_all()
            return
        _, b, accepted, kw = item
        self._guarded(lambda: self.policy.update(b, accepted, **kw))
        n = self.learnt + 1
        self.seen[b] = (kw.get("ctx_len", 0), n)
        for old in [s for s, (_, seen_at) in self.seen.items() if seen_at <= n - self.keep_rounds]:
            del self.seen[old]
        plans: dict[int, BatchPlan] = {}
        previous = self.plans[n - 1]
        for size, (ctx, _) in self.seen.items():
            plan = self._guarded(lambda: self.policy.plan(size, ctx))
            plan = plan if plan is not None else previous.get(size)
            if plan is not None:
                plans[size] = plan
        with self.cond:
            self.plans[n] = plans
            self.plans.pop(n - 3, None)  # the engine asks for n - 1 at the latest; n - 2 is a spare
            self.learnt = n
            self.done += 1
            self.cond.notify_all()

    def _guarded(self, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a failed update must not stop the rounds
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.failures <= 3 or self.failures % 1000 == 0:
                log.exception("policy planner: learning failed (%d so far); the last plans stay in use", self.failures)
            return None

    def wait_for(self, rounds: int, thread: threading.Thread | None, engine: bool = False) -> dict[int, BatchPlan]:
        """The plans learnt through `rounds` rounds, waiting for the worker (or, without one,
        learning the queued items here up to that point). `engine`: the engine's thread waits,
        and opens its host window meanwhile (the worker may be waiting for one)."""
        if self.learnt >= rounds:  # the usual case, without the lock: plans[n] is stored before learnt = n,
            return self.plans[rounds]  # and the caller asks for n >= learnt - 1, which stays stored
        self._wait(lambda: self.learnt >= rounds, thread, engine)
        return self.plans[rounds]

    def wait_idle(self, items: int, thread: threading.Thread | None, engine: bool = False) -> None:
        """Every one of the first `items` queued items (rounds, rewarms, ...) applied."""
        if self.done < items:
            self._wait(lambda: self.done >= items, thread, engine)

    def _wait(self, ready, thread: threading.Thread | None, engine: bool = False) -> None:
        if thread is None:
            while not ready():
                self.apply(self.items.popleft())
            return
        window = self.window.waiting(long=True) if engine and self.window is not None else nullcontext()
        with window, self.cond:
            while not ready():
                if not thread.is_alive():
                    raise RuntimeError("policy planner: its worker thread is gone")
                self.cond.wait(0.5)

    def stop(self) -> None:
        self.items.append(_STOP)
        self.wake.set()


class PlannedPolicy(StepPolicyBase):
    """A `CostModelPolicy` whose learning runs on a worker thread, one round behind; a `StepPolicy`."""

    def __init__(self, policy, *, threaded: bool = True, keep_rounds: int = 64, poll_s: float = POLL_S,
                 park_after_s: float = PARK_AFTER_S):
        check_policy(policy)
        if policy.chooses_trees:
            raise ConfigError(f"policy: {policy.name} chooses trees round by round; plan its tree "
                              "choice on the engine thread (use the policy unwrapped)")
        if not (isinstance(keep_rounds, int) and keep_rounds >= 1):
            raise ConfigError(f"keep_rounds: must be an int >= 1, got {keep_rounds!r}")
        self.policy = policy
        self.name, self.early_stop, self.truncates = policy.name, policy.early_stop, policy.truncates
        self.tree_rounds = policy.tree_rounds
        self.threaded, self.keep_rounds = threaded, keep_rounds
        if not (poll_s > 0 and park_after_s >= 0):
            raise ConfigError(f"poll_s, park_after_s: must be > 0 and >= 0 seconds, got {poll_s!r}, {park_after_s!r}")
        self._learner = _Learner(policy, keep_rounds, poll_s, park_after_s)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._learner.run, name="policy-planner", daemon=True)
            self._thread.start()
            _WORKERS.add(self._thread)
            _LEARNERS.add(self._learner)
            weakref.finalize(self, self._learner.stop)
        self._submitted = 0  # rounds queued (engine thread)
        self._queued = 0  # items queued: rounds and calls
        self._plan: BatchPlan | None = None  # the current round's
        self._slot_of: dict[int, int] = {}  # batch size -> slot index (`_nearest`)
        self._k = 0
        self._probing = False
        # this round's early stop, binned once for the verify cut too (`tally_step`): the rows'
        # survivals through the steps tallied, and each tallied step's gain
        self._sv: list[float] | None = None
        self._gain: list[float] = []
        self._go = True  # the last early-stop answer of the round (no: the round drafted no more)

    @property
    def candidate_steps(self) -> list[int]:
        return self.policy.candidate_steps

    # -- the engine thread ----------------------------------------------------------------------

    def steps_for(self, batch_size: int, ctx_len: float = 0) -> int:
        """K from the plan learnt through the round before the last (the probe schedule applied)."""
        learner, n = self._learner, max(0, self._submitted - 1)
        # `wait_for`'s lock-free case inline: plans[n] is stored before learnt = n
        plans = learner.plans[n] if learner.learnt >= n else learner.wait_for(n, self._thread, engine=True)
        plan = plans.get(batch_size)
        if plan is None:  # a new batch size: the nearest planned size of its slot
            plan = self._nearest(plans, batch_size)
        if plan is None:  # a slot without plans: learn everything queued, plan here
            learner.wait_idle(self._queued, self._thread, engine=True)
            plan = self.policy.plan(batch_size, ctx_len)  # the worker is idle: nothing is queued
        self._plan = plan
        self._k, self._probing = self.policy.schedule(batch_size, plan.steps)
        self._sv, self._gain, self._go = None, [], True
        return self._k

    def _nearest(self, plans: dict[int, BatchPlan], batch_size: int) -> BatchPlan | None:
        """The plan of the batch size nearest `batch_size` in its slot (the smaller on a tie), or None."""
        slot_of, slot_index = self._slot_of, self.policy.adaptive.slot_index
        slot = slot_of.get(batch_size)
        if slot is None:
            slot = slot_of[batch_size] = slot_index(batch_size)
        best, best_key = None, None
        for size, plan in plans.items():
            s = slot_of.get(size)
            if s is None:
                s = slot_of[size] = slot_index(size)
            key = (abs(size - batch_size), size)
            if s == slot and (best_key is None or key < best_key):
                best, best_key = plan, key
        return best

    def should_continue(self, step_index: int, draft_confidence, batch_size: int, ctx_len: float = 0) -> bool:
        """The plan's early stop after `step_index` drafts. The engine's calls (a list of the step's
        confidences, every step in order, its last included when it cuts the verify too) run in
        this one frame on local names, since inside a round each object first touched after the
        head's forward costs about a microsecond: each step is binned once, for this rule and
        for the verify cut (`tally_step`'s arithmetic, inline); a batch of one reads its bin's
        verdict (`BatchPlan.go1`)."""
        if self._probing:  # a probe measures the positions the estimates doubt: no early stop
            if not (type(step_index) is int and step_index >= 1):
                raise ConfigError(f"step_index: must be an int >= 1, got {step_index!r}")
            return step_index < self._k
        plan = self._plan
        if type(draft_confidence) is list and type(step_index) is int and step_index == len(self._gain) + 1 \
                and 0 < (n := len(draft_confidence)) <= SMALL_BATCH:
            stops, lookup = plan.stops, plan.calib.lookup
            terms = stops[step_index - 1] if step_index <= len(stops) else None
            bins, sv = len(lookup) - 1, self._sv
            if n == 1:
                c = draft_confidence[0]
                j = (int(c * bins) if c < 1.0 else bins - 1) if c > 0.0 else 0
                p = lookup[j]
                x = p if sv is None else sv[0] * p  # before the first step the row survives: 1.0 * p is p
                self._sv = [x]
                self._gain.append(x)
                go1 = plan.go1
                if go1:  # `BatchPlan.continue_one`: the verdict of bin j
                    go = step_index <= len(go1) and (row := go1[step_index - 1]) is not None and row[j]
                else:
                    go = continue_p(terms, p)
            else:
                total = g = 0.0
                i = 0
                if sv is None:
                    sv = self._sv = [1.0] * n
                for c in draft_confidence:  # `tally_step`
                    p = lookup[int(c * bins) if c < 1.0 else bins - 1] if c > 0.0 else lookup[0]
                    total += p
                    x = sv[i] * p
                    sv[i] = x
                    g += x
                    i += 1
                self._gain.append(g)
                if terms is None:
                    go = False
                else:  # `continue_p`, inline
                    t_now, t_more, expected, surv, a_next = terms
                    surv *= total / n
                    go = surv * a_next * t_now > (expected + surv) * t_more
            self._go = go
            return go
        if not (isinstance(step_index, int) and step_index >= 1):
            raise ConfigError(f"step_index: must be an int >= 1, got {step_index!r}")
        return plan.should_continue(step_index, draft_confidence)

    def verify_lengths(self, confidences, ctx_len: float = 0, *, padded: bool = False) -> list[int]:
        """The plan's verify cut. The engine's padded cut of a round whose early stop tallied every
        step it drafted (`should_continue` on the same confidences, in order, through the one that
        answered no or the round's K) reads only the tally, in this frame (`best_common_length`
        with every row at the round's drafts): no numpy call, each costing microseconds inside a
        round. One step short of that (a caller that does not ask after the last step), the last
        column is binned from the array (`BatchPlan.tallied_lengths`)."""
        gain, self._gain, sv, self._sv = self._gain, [], self._sv, None  # a tally serves one cut
        plan = self._plan
        if padded and not self._probing:
            k = len(gain)
            if k and (not self._go or k == self._k) and len(confidences) == len(sv) and k < len(plan.seconds) \
                    and len(sv) * k <= PADDED_PYTHON and plan.verify_token_s > 0:
                seconds = plan.seconds[k]
                best, best_rate, tokens = 0, -1.0, float(len(sv))
                for m in range(k + 1):
                    if m:
                        tokens += gain[m - 1]
                    rate = tokens / seconds[m]
                    if rate >= best_rate:
                        best, best_rate = m, rate
                return [best] * len(sv)
            if type(confidences) is np.ndarray and confidences.ndim == 2:
                cut = plan.tallied_lengths(confidences, sv, gain) if gain else plan.padded_lengths(confidences)
                if cut is not None:
                    return cut
        return plan.verify_lengths(confidences, padded=padded, keep_all=self._probing)

    def update(self, batch_size: int, accepted: Sequence[int], **round_) -> int:
        """Queue the round for the worker (the engine hands over its lists and arrays and never
        writes to them again); returns the K the round ran."""
        learner = self._learner  # `_Learner.put`, inline
        learner.items.append(("round", batch_size, accepted, round_))
        if learner.parked:
            learner.wake.set()
        self._submitted += 1
        self._queued += 1
        return self._k

    def predict_round_s(self, batch_size: int, k: int, ctx_len: float = 0) -> float | None:
        """The current plan's predicted seconds of a plain round (K = 0) at its batch size; None
        otherwise (the live round-time model belongs to the worker)."""
        plan = self._plan
        return plan.plain_round_s if k == 0 and plan is not None and plan.batch_size == batch_size else None

    def follow_window(self, window: HostWindow | None) -> None:
        """Start learning each round in the engine's host windows (online_spec/host_window.py)."""
        self._learner.window = window

    def rewarm(self) -> None:
        self._learner.put(("call", self.policy.rewarm))
        self._queued += 1

    # -- any thread -----------------------------------------------------------------------------

    def info(self) -> dict:
        out = self.policy.info()
        out["planner"] = {"threaded": self.threaded, "rounds_queued": self._submitted,
                          "rounds_learnt": self._learner.learnt, "failures": self._learner.failures,
                          "last_error": self._learner.last_error}
        return out

    def state_dict(self) -> dict:
        """The policy's state as learnt so far (rounds still queued are not in it)."""
        return self.policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the policy once every queued round is learnt (engine thread, between rounds)."""
        self._learner.wait_idle(self._queued, self._thread)
        self.policy.load_state_dict(state)
        with self._learner.cond:  # plans built from the state before are void
            self._learner.plans = {0: self._learner.initial_plans()}
            self._learner.learnt = self._learner.done = 0
            self._learner.seen = {}
        self._submitted = self._queued = 0

    def close(self) -> None:
        """Stop the worker (also done when the policy is collected)."""
        if self._thread is not None:
            self._learner.stop()
            self._thread.join(timeout=5)

    def __deepcopy__(self, memo):
        """A copy with its own worker, from the policy as learnt through every queued round."""
        self._learner.wait_idle(self._queued, self._thread)
        return PlannedPolicy(copy.deepcopy(self.policy, memo), threaded=self.threaded, keep_rounds=self.keep_rounds,
                             poll_s=self._learner.poll_s, park_after_s=self._learner.park_after_s)


def plan_ahead(policy, *, threaded: bool = True):
    """`policy` behind a `PlannedPolicy` where it can plan (the cost policy without round-by-round
    tree choice); any other policy (EMA tiers, static K, None) as it is."""
    if not isinstance(policy, CostModelPolicy) or policy.chooses_trees:
        return policy
    return PlannedPolicy(policy, threaded=threaded)
