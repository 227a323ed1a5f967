"""Cost-model step policy (AdaSpec-style): pick K to maximize committed tokens per second.

In: per verify round, the batch size, accepted drafts per request (bonus excluded), the K used,
the mean context length and, when the engine measured them, the round's draft and verify
seconds and the head's confidence in each draft. Out: K for the next round, an early-stop
verdict inside a round, and per-request verify lengths. Pure arithmetic: no torch, no I/O.

It joins two models: the round-time model (`CostModel`, online_spec/controller/round_time.py:
predicted seconds of a round at batch b and K) and the acceptance estimates (online_spec/
controller/acceptance.py: expected committed tokens of K per batch-size slot, and the draft
confidences calibrated to acceptance). K maximizes expected committed tokens per predicted
second over the slot's candidate tiers.

    policy = CostModelPolicy(load_adaptive_config(path))
    k = policy.steps_for(b, ctx_len)                                   # before drafting
    while i < k and policy.should_continue(i, conf_i, b, ctx_len): ...  # optional early stop
    lens = policy.verify_lengths(confidences, ctx_len)                 # optional truncation
    policy.update(b, accepted, num_steps=lens or k, ctx_len=ctx_len, draft_s=.., verify_s=..)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from online_spec.config import ConfigError, check, doc
from online_spec.controller.acceptance import PRIOR_TRIALS, AcceptanceEstimate, ConfidenceCalibrator, expected_accepted
from online_spec.controller.base import StepPolicyBase
from online_spec.controller.config import AdaptiveConfig
from online_spec.controller.plan import BatchPlan, continue_on, continue_table, plan_seconds, verify_cut
from online_spec.controller.round_time import CostModel
from online_spec.controller.tree_choice import TreeChoiceConfig, TreeChooser
from online_spec.tree import TreeShape

@dataclass(frozen=True)
class CostPolicyConfig:
    """Knobs of the cost-model policy (its K tiers come from the adaptive config's slots)."""

    accept_window: float = doc("request-drafts each per-position acceptance estimate averages over "
                               "(exponential forgetting per trial)", 64.0)
    prior_accept: float = doc("per-position acceptance assumed before any round", 0.6)
    tpot_slo_s: float | None = doc("never pick a K whose predicted round seconds exceed this (None = off)", None)
    calib_bins: int = doc("confidence bins of the calibrator", 10)
    calib_prior_weight: float = doc("pseudo-observations holding each bin at its midpoint", 4.0)
    rewarm_keep_trials: float = doc("when a new head goes live, the old head's acceptance estimates and confidence "
                                    "calibration stay as a prior worth this many trials per position and bin (the "
                                    "new head is usually its fine-tuned successor: the live position-1 acceptance of 9 "
                                    "successive versions of an e2e run stayed within 0.60-0.63; at 4 trials, three "
                                    "misses after a swap put a 0.6 estimate at 0.35); 0 = start over from prior_accept "
                                    "and the identity calibration", 16.0)
    probe_interval: int = doc("decisions a slot makes below its deepest tier before it runs one round at the "
                              "next tier up, re-measuring positions it no longer drafts (0 = never)", 32)

    def __post_init__(self) -> None:
        check(math.isfinite(self.accept_window) and self.accept_window >= 1, "accept_window",
              f"must be >= 1, got {self.accept_window!r}")
        check(0 <= self.prior_accept <= 1, "prior_accept", f"must be in [0, 1], got {self.prior_accept!r}")
        check(self.tpot_slo_s is None or (math.isfinite(self.tpot_slo_s) and self.tpot_slo_s > 0), "tpot_slo_s",
              f"must be > 0 seconds or None, got {self.tpot_slo_s!r}")
        check(isinstance(self.calib_bins, int) and self.calib_bins >= 1, "calib_bins",
              f"must be an int >= 1, got {self.calib_bins!r}")
        check(self.calib_prior_weight > 0, "calib_prior_weight", f"must be > 0, got {self.calib_prior_weight!r}")
        check(math.isfinite(self.rewarm_keep_trials) and self.rewarm_keep_trials >= 0, "rewarm_keep_trials",
              f"must be >= 0, got {self.rewarm_keep_trials!r}")
        check(isinstance(self.probe_interval, int) and self.probe_interval >= 0, "probe_interval",
              f"must be an int >= 0, got {self.probe_interval!r}")


class CostModelPolicy(StepPolicyBase):
    """K maximizing expected committed tokens per predicted second, per batch-size slot; a
    `StepPolicy` with both in-round capabilities and a round-time model."""

    name = "cost_model"
    early_stop = True
    truncates = True

    def __init__(self, adaptive: AdaptiveConfig, config: CostPolicyConfig | None = None,
                 cost_model: CostModel | None = None, tree_config: TreeChoiceConfig | None = None):
        self.adaptive = adaptive
        self.config = cfg = config or CostPolicyConfig()
        self.cost = cost_model or CostModel()
        self._slots = adaptive.slots
        self._accept = [AcceptanceEstimate(max(s.candidate_steps), cfg.prior_accept, cfg.accept_window)
                        for s in self._slots]
        self._calib = ConfidenceCalibrator(cfg.calib_bins, cfg.calib_prior_weight)
        self._last: list[int | None] = [None] * len(self._slots)
        self._decisions = [0] * len(self._slots)
        self._below = [0] * len(self._slots)  # decisions since the slot last drafted its next tier up
        self._probing = [False] * len(self._slots)  # the slot's current round is a probe: draft and verify all of it
        self._choice: tuple | None = None  # (estimates, round terms, K) of the last choose_steps
        self._stops: tuple | None = None  # (estimates, round terms, {step: terms}) of should_continue
        self._slot_of: dict[int, int] = {}  # batch size -> slot index, filled as batch sizes come
        self._trees = TreeChooser([s.trees for s in self._slots], tree_config)  # the slots' tree_candidates
        self._any_trees = self._trees.any

    def _slot(self, batch_size: int) -> int:
        """`adaptive.slot_index`, remembered per batch size (the engine asks it several times a round)."""
        i = self._slot_of.get(batch_size)
        if i is None:
            i = self._slot_of[batch_size] = self.adaptive.slot_index(batch_size)
        return i

    @property
    def chooses_trees(self) -> bool:
        """Some slot lists tree candidates: each round's tree (or chain) is then chosen by value."""
        return self._any_trees

    def tree_for(self, batch_size: int, ctx_len: float = 0) -> TreeShape | None:
        """A tree instead of the chain `steps_for` chose, where a candidate's measured committed
        tokens per second beat the chain's, measured at this batch-size bucket (predicted until
        the chain has rounds there; online_spec/controller/tree_choice.py)."""
        i = self._slot(batch_size)
        k = self._last[i] or 0

        def chain() -> float:  # the chain's predicted value, worked out only in the rounds that read it
            return self.expected_tokens(batch_size, k) / self.cost.predict_round_s(batch_size, k, ctx_len)

        return self._trees.choose(i, chain, self.cost.reference_round_s(batch_size, ctx_len), batch_size)

    def tree_shapes(self) -> list[TreeShape]:
        """Every slot's tree candidates, each once, in the order the slots list them."""
        return list(dict.fromkeys(s for shapes in self._trees.candidates for s in shapes))

    @property
    def candidate_steps(self) -> list[int]:
        return self.adaptive.candidate_steps

    def predict_round_s(self, batch_size: int, k: int, ctx_len: float = 0) -> float | None:
        """The round-time model's seconds of a round at this batch, K and context."""
        return self.cost.predict_round_s(batch_size, k, ctx_len)

    # -- before drafting ---------------------------------------------------------------------

    def expected_tokens(self, batch_size: int, k: int, estimates: Sequence[float] | None = None) -> float:
        """E(K): committed tokens per request (bonus included) with K drafts, from the estimates
        (the slot's, or the given a_1..a_depth)."""
        a = self._accept[self._slot(batch_size)].estimates() if estimates is None else estimates
        return 1.0 + expected_accepted(a, k)

    def choose_steps(self, batch_size: int, ctx_len: float = 0) -> int:
        """The slot's tier maximizing E(K) / round seconds; ties go to the smaller K. Under a
        TPOT SLO, tiers predicted slower than it are skipped; if none fits, the smallest tier."""
        i = self._slot(batch_size)
        a = self._accept[i].estimates()
        terms = self.cost.round_terms(batch_size, ctx_len)
        tiers = self._slots[i].candidate_steps
        factor = self.cost.time_factors(batch_size, tiers[-1])
        memo = self._choice
        if memo is not None and memo[0] is a and memo[1] is terms and memo[3] is factor:
            return memo[2]  # the same cached estimates, round terms and factors: update's choice, asked again
        slo = self.config.tpot_slo_s
        step_s, base, per_token, d_extra, v_extra = terms
        best_k, best_rate = None, -1.0
        expected, surv, pos = 1.0, 1.0, 0
        for k in tiers:
            while pos < k:
                surv *= a[pos]
                expected += surv
                pos += 1
            if k:
                v = base + per_token * (k + 1) + v_extra
                t = (max(0.0, k * step_s + d_extra) + (v if v > 0.0 else 0.0)) * factor[k]
            else:
                v = base + per_token
                t = (v if v > 0.0 else 0.0) * factor[0]
            if slo is not None and t > slo:
                continue
            rate = expected / max(t, 1e-12)
            if rate > best_rate:
                best_k, best_rate = k, rate
        best_k = tiers[0] if best_k is None else best_k
        self._choice = (a, terms, best_k, factor)  # holds the objects, so `is` cannot match a recycled id
        return best_k

    def steps_for(self, batch_size: int, ctx_len: float = 0) -> int:
        """`choose_steps`, remembered as this slot's K for an `update` that omits num_steps.

        Every `probe_interval` decisions below the slot's deepest tier, one round runs the next
        tier up instead. Positions beyond the chosen K are never observed, so without the probe
        an estimate that a run of bad rounds pushed down would stay down for good (at K = 0
        nothing is observed at all: plain decoding would be absorbing, as SGLang's policy also
        knows, which probes up from K = 0). A probe round drafts and verifies all its K drafts: the
        in-round early stop (`should_continue`) and the verify-length cut (`verify_lengths`) read the
        same low estimate the probe is there to re-measure, and would cut every probe back to one
        draft (measured in an e2e run: a position-2 estimate that three misses after a swap had put
        at 0.35, true ~0.6, held K at 1 for the last 60 s; docs/controller.md)."""
        return self.schedule(batch_size, self.choose_steps(batch_size, ctx_len))[0]

    def schedule(self, batch_size: int, k: int) -> tuple[int, bool]:
        """(the K a round runs when the estimates chose `k`, whether that round is a probe): the
        probe schedule of `steps_for`, which counts the slot's decisions (so call it once per round)."""
        i = self._slot_of.get(batch_size)  # `_slot`, one call fewer: once a round, on the engine's thread
        if i is None:
            i = self._slot(batch_size)
        tiers = self._slots[i].candidate_steps
        self._probing[i] = False
        if self.config.probe_interval and k < tiers[-1]:
            self._below[i] += 1
            if self._below[i] >= self.config.probe_interval:
                self._below[i] = 0
                k = tiers[tiers.index(k) + 1]
                self._probing[i] = True
        else:
            self._below[i] = 0
        self._last[i] = k
        self._decisions[i] += 1
        return k, self._probing[i]

    def probing(self, batch_size: int) -> bool:
        """The slot's current round (the last `schedule`d) is a probe: drafted and verified whole."""
        return self._probing[self._slot(batch_size)]

    # -- inside a round ----------------------------------------------------------------------

    def should_continue(self, step_index: int, draft_confidence: float | Sequence[float],
                        batch_size: int, ctx_len: float = 0) -> bool:
        """After `step_index` drafts (the last with `draft_confidence`, a value or one per
        request), is drafting one more predicted to raise tokens per second? The next draft
        adds P(drafts 1..step_index accepted) * a_{step_index+1} tokens per request and costs
        one draft step plus one verified token per request, as the round-time line prices them
        (the per-K time factors set K before the round and the SLO, not this margin)."""
        if not (isinstance(step_index, int) and step_index >= 1):  # no check(): its message is built every call
            raise ConfigError(f"step_index: must be an int >= 1, got {step_index!r}")
        i = self._slot(batch_size)
        if self._probing[i]:  # a probe measures the positions the estimates doubt: no early stop
            return step_index < (self._last[i] or 0)
        return continue_on(self._continue_terms(i, step_index, batch_size, ctx_len), draft_confidence,
                           self._calib.snapshot())

    def _continue_terms(self, i: int, step_index: int, batch_size: int, ctx_len: float) -> tuple | None:
        """What `should_continue` needs besides the draft's confidence, after `step_index` drafts:
        (t_now, t_next - t_now, E and survival through the first step_index - 1 drafts, a_{step_index+1}),
        or None when one more draft never pays (beyond the estimates, over the SLO). Computed once
        per step for the slot's current estimates and round terms (the early stop is asked after
        every draft step, between the head's forwards, where each call runs on cold caches)."""
        a = self._accept[i].estimates()
        round_terms = self.cost.round_terms(batch_size, ctx_len)
        memo = self._stops
        if memo is None or memo[0] is not a or memo[1] is not round_terms:
            memo = self._stops = (a, round_terms, {})  # holds the objects, so `is` cannot match a recycled id
        known = memo[2]
        if step_index in known:
            return known[step_index]
        terms = None
        if step_index < len(a):
            step_s, base, per_token, d_extra, v_extra = round_terms
            # the line's seconds, without the per-K time factors: the verify cut prices a draft
            # by the line too, and a factor can only be refreshed by rounds of its own K, which
            # an early stop priced by it may never let run (docs/controller.md, "early stop")
            t_now = (max(0.0, step_index * step_s + d_extra)
                     + max(0.0, base + v_extra + per_token * (step_index + 1)))
            t_next = (max(0.0, (step_index + 1) * step_s + d_extra)
                      + max(0.0, base + v_extra + per_token * (step_index + 2)))
            slo = self.config.tpot_slo_s
            if slo is None or t_next * self.cost.time_factors(batch_size, step_index + 1)[step_index + 1] <= slo:
                expected, surv = 1.0, 1.0
                for j in range(step_index - 1):
                    surv *= a[j]
                    expected += surv
                terms = (t_now, t_next - t_now, expected, surv, a[step_index])
        known[step_index] = terms
        return terms

    def verify_lengths(self, confidences: Sequence[Sequence[float]], ctx_len: float = 0, *,
                       padded: bool = False) -> list[int]:
        """Drafts to verify per request (AdaSpec's confidence-prior verifier; `verify_cut`,
        online_spec/controller/plan.py): a draft is verified while its survival pays for its
        verify token at the round's throughput. padded: one common length for the batch (the
        embedded engine's verify is rectangular). A probe round verifies every draft."""
        b = len(confidences)
        probing = b > 0 and self._probing[self._slot(b)]
        return verify_cut(confidences, self._calib.snapshot(), self.cost.round_terms(b, ctx_len),
                          self.cost.verify_token_s(), padded=padded, keep_all=probing)

    def plan(self, batch_size: int, ctx_len: float = 0) -> BatchPlan:
        """This batch size's decisions from what the policy knows now, as an immutable snapshot:
        K (`choose_steps`, before the probe schedule), the early-stop terms of every draft step,
        the calibration and the round terms of the verify cut (serving/policy_planner.py builds
        one per batch size after each round, off the engine's thread)."""
        i = self._slot(batch_size)
        steps = self.choose_steps(batch_size, ctx_len)
        depth = len(self._accept[i].estimates())
        stops = tuple(self._continue_terms(i, s, batch_size, ctx_len) for s in range(1, depth))
        terms, calib = self.cost.round_terms(batch_size, ctx_len), self._calib.snapshot()
        return BatchPlan(batch_size, ctx_len, steps, stops, calib, terms, self.cost.verify_token_s(),
                         self.cost.predict_round_s(batch_size, 0, ctx_len), plan_seconds(terms, depth),
                         tuple(continue_table(t, calib) for t in stops) if batch_size == 1 else ())

    # -- after verify ------------------------------------------------------------------------

    def update(self, batch_size: int, accepted: Sequence[int], *, num_steps: int | Sequence[int] | None = None,
               ctx_len: float = 0, draft_s: float | None = None, verify_s: float | None = None,
               confidences: Sequence[Sequence[float]] | None = None, tree: TreeShape | None = None) -> int:
        """Learn from one verify round; returns `choose_steps` for the same batch size and context.

        num_steps: K drafted (or drafts verified per request, after `verify_lengths` or an early
        stop); defaults to the slot's last `steps_for`. draft_s / verify_s: measured seconds.
        confidences: the head's confidence per draft per request, to calibrate. tree: the shape a
        tree round ran; its figures go to the tree's own means, never to the chain's estimates
        (with tree candidates, a chain round's go to the chain's measured value beside them too).
        """
        i = self._slot(batch_size)
        if tree is not None or self._any_trees:
            round_s = None if draft_s is None or verify_s is None else draft_s + verify_s
            plain_s = self.cost.reference_round_s(batch_size, ctx_len)
            if tree is not None:
                self._trees.observe(i, tree, accepted, round_s, plain_s, batch_size)
                return self.choose_steps(batch_size, ctx_len)
            self._trees.chain_ran(i, accepted, round_s, plain_s, batch_size)
        if num_steps is None:
            num_steps = self._last[i]
            if num_steps is None:
                raise ConfigError("num_steps: required until steps_for has been called for this batch size")
        if accepted:
            self._accept[i].observe(accepted, num_steps)
            if confidences is not None:
                self._calib.observe(confidences, accepted)
        if draft_s is not None or verify_s is not None:
            if isinstance(num_steps, int):
                self.cost.observe(batch_size, num_steps, ctx_len, draft_s, verify_s)
            else:
                self.cost.observe(batch_size, max(num_steps, default=0), ctx_len, draft_s, verify_s,
                                  verify_tokens=sum(num_steps) + len(num_steps))
        return self.choose_steps(batch_size, ctx_len)

    def rewarm(self) -> None:
        """A new head went live: acceptance and calibration are cut to a weak prior (or start over,
        `rewarm_keep_trials` 0), so the new head's rounds decide within a few; round costs are kept.
        Starting over costs seconds at K = 1 after each swap: the 0.6 prior and the identity
        calibration of the head's confidences stop drafting early (docs/controller.md)."""
        for acc in self._accept:
            acc.soften(self.config.rewarm_keep_trials)
        self._calib.soften(self.config.rewarm_keep_trials)
        self._trees.rewarm()

    def info(self) -> dict:
        slots = {}  # read from other threads (status, progress lines): never through the engine's cache
        for i, (slot, acc, last, n) in enumerate(zip(self._slots, self._accept, self._last, self._decisions)):
            a = acc.fresh_estimates()
            slots[str(slot.min_batch_size)] = {
                "steps": last, "decisions": n, "accept": a,
                "expected_tokens": {str(k): self.expected_tokens(slot.min_batch_size, k, a)
                                    for k in slot.candidate_steps},
                **({"trees": self._trees.info(i)} if slot.trees else {})}
        return {"policy": self.name, "slots": slots,
                "cost": {"draft_coef": list(self.cost.draft_coef), "verify_coef": list(self.cost.verify_coef),
                         "observations": self.cost.observations, "time_factors": self.cost.factors_info()}}

    def state_dict(self) -> dict:
        return {"policy": self.name, "cost": self.cost.state_dict(), "trees": self._trees.state_dict(),
                "calibrator": {"hits": self._calib.hits[:], "trials": self._calib.trials[:]},
                "slots": {str(s.min_batch_size): {"rates": acc.rates[:], "seen": acc.seen[:],
                                                  "weight": acc.weight[:], "steps": last,
                                                  "decisions": n, "below": below}
                          for s, acc, last, n, below in zip(self._slots, self._accept, self._last, self._decisions,
                                                            self._below)}}

    def load_state_dict(self, state: dict) -> None:
        check(state.get("policy") == self.name, "state.policy", f"expected {self.name!r}, got {state.get('policy')!r}")
        saved = state.get("slots", {})
        want = [str(s.min_batch_size) for s in self._slots]
        check(sorted(saved) == sorted(want), "state.slots", f"has slots {sorted(saved)}, the config has {want}")
        for j, (key, acc) in enumerate(zip(want, self._accept)):
            entry = saved[key]
            check(len(entry["rates"]) == acc.depth, f'state.slots["{key}"].rates',
                  f"has {len(entry['rates'])} positions, the slot drafts up to {acc.depth}")
            acc.rates = [float(r) for r in entry["rates"]]
            acc.seen = [int(s) for s in entry["seen"]]
            acc.weight = [float(w) for w in entry.get("weight", [PRIOR_TRIALS] * acc.depth)]
            acc._filled = None
            self._last[j] = entry["steps"]
            self._decisions[j] = int(entry["decisions"])
            self._below[j] = int(entry.get("below", 0))  # states written before probing have none
        calib = state["calibrator"]
        check(len(calib["hits"]) == self._calib.bins, "state.calibrator.hits",
              f"has {len(calib['hits'])} bins, the config has {self._calib.bins}")
        self._calib.load(calib["hits"], calib["trials"])
        self.cost.load_state_dict(state["cost"])
        if "trees" in state:  # states of policies without tree candidates have none
            self._trees.load_state_dict(state["trees"])
