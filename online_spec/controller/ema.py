"""EMA tier policy: SGLang's adaptive step controller, decision for decision.

In: per verify round, the batch size and the drafts accepted per request (bonus excluded).
Out: K (`num_steps`) for the next round of that batch size. Pure: no I/O, no torch.

Each batch-size slot keeps an EMA of the batch-mean accepted drafts, fed only while its K > 0.
After `warmup_batches` rounds, every `update_interval`-th round it re-decides K among its
tiers:
  - at K = 0 it always probes one tier up (there is no acceptance to learn from at K = 0);
  - else it steps down while EMA <= lower - 0.5 + down_hysteresis (0.5 + down_hysteresis
    when the lower tier is 0), and only if it did not step down, up while
    EMA > current - 0.5 + up_hysteresis;
  - with ceiling_coeff > 0, a hold or a down-move is capped at max(1, ceil(EMA * coeff)); an
    up-move is never capped, so the EMA can catch up with a deeper tier.
Same arithmetic, in the same order, as `sglang.srt.speculative.adaptive_spec_params`
(tests/test_controller_ema.py replays random traces through both).

    policy = EmaTierPolicy(load_adaptive_config(path), initial_steps=3)
    k = policy.steps_for(batch_size)            # before drafting
    k_next = policy.update(batch_size, accepted) # after verify
    policy.rewarm()                             # a new head went live
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from online_spec.config import ConfigError, check
from online_spec.controller.base import StepPolicyBase
from online_spec.controller.config import AdaptiveConfig, SlotConfig


def next_steps(slot: SlotConfig, steps: int, ema: float) -> tuple[int, float]:
    """One decision for `slot` at K = `steps`: returns (new K, EMA to keep)."""
    tiers = slot.candidate_steps
    idx = tiers.index(steps)
    if steps == 0:
        target = tiers[min(idx + 1, len(tiers) - 1)]
        if target > 0 and ema < 0:
            # Started at K = 0, so nothing was ever learned: begin the probe from its neutral EMA.
            ema = float(target - 1)
        return target, ema
    while idx > 0:
        lower = tiers[idx - 1]
        # Reaching K = 0 needs the EMA at or below 0.5 (mostly nothing accepted), not -0.5.
        threshold = (0.5 if lower == 0 else lower - 0.5) + slot.down_hysteresis
        if ema > threshold:
            break
        idx -= 1
    if tiers[idx] == steps:
        while idx + 1 < len(tiers) and ema > tiers[idx] - 0.5 + slot.up_hysteresis:
            idx += 1
    if slot.ceiling_coeff > 0 and tiers[idx] <= steps:
        ceiling = max(1, math.ceil(ema * slot.ceiling_coeff))
        while idx > 0 and tiers[idx] > ceiling:
            idx -= 1
    return tiers[idx], ema


@dataclass
class SlotState:
    """What one slot has learned: its K, EMA, rounds seen since (re)warm-up, decisions made."""

    steps: int
    ema: float
    batches: int = 0
    decisions: int = 0
    changes: int = 0


def initial_slot_steps(slot: SlotConfig, initial_steps: int) -> int:
    """SGLang's start: `initial_steps` if it is one of the slot's tiers, else its middle tier."""
    tiers = slot.candidate_steps
    return initial_steps if initial_steps in tiers else tiers[len(tiers) // 2]


def resolve_initial_steps(config: AdaptiveConfig, initial_steps: int | None) -> int:
    """SGLang's server-level rule: default to the middle of all tiers; refuse one not in any slot."""
    union = config.candidate_steps
    if initial_steps is None:
        return union[len(union) // 2]
    check(isinstance(initial_steps, int) and initial_steps in union, "initial_steps",
          f"must be one of the adaptive config's candidate steps {union}, got {initial_steps!r}")
    return initial_steps


class EmaTierPolicy(StepPolicyBase):
    """Per-slot EMA of accepted drafts, stepping K through the slot's tiers (SGLang semantics);
    a `StepPolicy` with no in-round capabilities (SGLang's policy has none)."""

    name = "ema_tier"

    def __init__(self, config: AdaptiveConfig, initial_steps: int | None = None):
        self.config = config
        self.initial_steps = resolve_initial_steps(config, initial_steps)
        self._slots = config.slots
        self._states = []
        for slot in self._slots:
            k = initial_slot_steps(slot, self.initial_steps)
            self._states.append(SlotState(steps=k, ema=float(k - 1)))

    @property
    def candidate_steps(self) -> list[int]:
        """Every K this policy may return (the engine prepares one runtime tier per value)."""
        return self.config.candidate_steps

    def steps_for(self, batch_size: int, ctx_len: int = 0) -> int:
        """K for the next round of a batch of `batch_size` (ctx_len is not used by this policy)."""
        return self._states[self.config.slot_index(batch_size)].steps

    def update(self, batch_size: int, accepted: Sequence[int], *, num_steps=None, ctx_len: int = 0,
               draft_s: float | None = None, verify_s: float | None = None, confidences=None, tree=None) -> int:
        """Feed one verify round; returns the routed slot's K after it.

        `accepted` is drafts accepted per request, bonus excluded. Only the slot's own K decides
        whether the round teaches the EMA (as in SGLang); num_steps, timings and confidences
        are accepted for the `StepPolicy` protocol and ignored. An empty batch changes nothing.
        """
        i = self.config.slot_index(batch_size)
        slot, st = self._slots[i], self._states[i]
        if not accepted:
            return st.steps
        if st.steps > 0:
            st.ema = (1 - slot.ema_alpha) * st.ema + slot.ema_alpha * (sum(accepted) / len(accepted))
        st.batches += 1
        after_warmup = st.batches - slot.warmup_batches
        if after_warmup > 0 and after_warmup % slot.update_interval == 0:
            st.decisions += 1
            target, st.ema = next_steps(slot, st.steps, st.ema)
            if target != st.steps:
                st.changes += 1
                st.steps = target
        return st.steps

    def rewarm(self) -> None:
        """A new head went live: forget acceptance (EMA to K - 1, warm-up again), keep each K."""
        for st in self._states:
            st.ema = float(st.steps - 1)
            st.batches = 0

    def info(self) -> dict:
        """Per slot (by its JSON key): K, EMA, rounds since warm-up, decisions and changes."""
        return {"policy": self.name, "slots": {
            str(slot.min_batch_size): {"steps": st.steps, "ema": st.ema, "batches": st.batches,
                                       "decisions": st.decisions, "changes": st.changes}
            for slot, st in zip(self._slots, self._states)}}

    def state_dict(self) -> dict:
        return {"policy": self.name, "initial_steps": self.initial_steps,
                "slots": {str(slot.min_batch_size): vars(st).copy()
                          for slot, st in zip(self._slots, self._states)}}

    def load_state_dict(self, state: dict) -> None:
        check(state.get("policy") == self.name, "state.policy", f"expected {self.name!r}, got {state.get('policy')!r}")
        saved = state.get("slots", {})
        want = [str(s.min_batch_size) for s in self._slots]
        check(sorted(saved) == sorted(want), "state.slots", f"has slots {sorted(saved)}, the config has {want}")
        new_states = []
        for slot, key in zip(self._slots, want):
            entry = saved[key]
            try:
                st = SlotState(**entry)
            except TypeError as e:
                raise ConfigError(f'state.slots["{key}"]: {e}') from e
            check(st.steps in slot.candidate_steps, f'state.slots["{key}"].steps',
                  f"{st.steps!r} is not one of the slot's tiers {list(slot.candidate_steps)}")
            new_states.append(SlotState(steps=int(st.steps), ema=float(st.ema), batches=int(st.batches),
                                        decisions=int(st.decisions), changes=int(st.changes)))
        self._states = new_states
        self.initial_steps = int(state.get("initial_steps", self.initial_steps))
