"""Which draft tree, if any, a round should run instead of the cost policy's chain: measured, per
batch-size slot. Pure arithmetic: no torch, no I/O.

In: per tree round, the slot, the shape (`TreeShape`), accepted drafts per request, the round's
seconds and what the round-time model predicts for a plain round at that batch and context.
Out, per decision: a tree (or None: the chain stays) given the chain's predicted committed
tokens per second.

A tree's value is measured, not modelled: its committed tokens per request-round (accepted + 1)
and its round time as a multiple of the predicted plain round (so a slot's batch sizes and
contexts compare), each an exponentially weighted mean over its rounds. Value = tokens /
(multiple x predicted plain round). A shape is tried `min_trials` times before its value counts,
and, so neither side's figure goes stale, the least recently measured option (the chain or a
tree) is run once every `probe_interval` decisions of the slot. A head swap (`rewarm`) keeps the
round times and weakens the token means to `rewarm_weight` rounds: the new head's acceptance
decides within a few rounds.

    chooser = TreeChooser([[TreeShape(5, 4, 8), TreeShape(3, 4, 10)]], TreeChoiceConfig())
    shape = chooser.choose(slot, chain_tokens_per_s, plain_round_s)
    chooser.observe(slot, shape, accepted, round_s, plain_round_s)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from online_spec.config import check, doc
from online_spec.tree import TreeShape


@dataclass(frozen=True)
class TreeChoiceConfig:
    window: float = doc("rounds in the exponentially weighted means of a tree's tokens and round time", 32.0)
    min_trials: int = doc("rounds of a tree before its measured value counts (tried in turn until then)", 3)
    probe_interval: int = doc("decisions of a slot between runs of its least recently measured option "
                              "(the chain or a tree); 0 = never", 48)
    rewarm_weight: float = doc("rounds a tree's token mean counts as after a head swap", 2.0)

    def __post_init__(self) -> None:
        check(math.isfinite(self.window) and self.window >= 1, "window", f"must be >= 1, got {self.window!r}")
        check(isinstance(self.min_trials, int) and self.min_trials >= 1, "min_trials",
              f"must be an int >= 1, got {self.min_trials!r}")
        check(isinstance(self.probe_interval, int) and self.probe_interval >= 0, "probe_interval",
              f"must be an int >= 0, got {self.probe_interval!r}")
        check(math.isfinite(self.rewarm_weight) and self.rewarm_weight >= 0, "rewarm_weight",
              f"must be >= 0, got {self.rewarm_weight!r}")


class _TreeStats:
    """One shape in one slot: weighted means of tokens per request-round and of round time over
    the predicted plain round."""

    def __init__(self):
        self.tokens = 0.0
        self.tokens_w = 0.0
        self.time = 0.0
        self.time_w = 0.0
        self.rounds = 0
        self.last = -1  # decision index of its last round

    def add(self, tokens: float, multiple: float, decay: float) -> None:
        self.tokens_w = self.tokens_w * decay + 1.0
        self.tokens += (tokens - self.tokens) / self.tokens_w
        self.time_w = self.time_w * decay + 1.0
        self.time += (multiple - self.time) / self.time_w
        self.rounds += 1

    def value(self, plain_round_s: float) -> float:
        return self.tokens / (self.time * plain_round_s) if self.time > 0 and plain_round_s > 0 else 0.0


class TreeChooser:
    """Per slot: its candidate trees, their measured values, and the choice against the chain."""

    def __init__(self, candidates: Sequence[Sequence[TreeShape]], config: TreeChoiceConfig | None = None):
        self.config = config or TreeChoiceConfig()
        self.candidates = [list(c) for c in candidates]
        self._stats = [{s: _TreeStats() for s in c} for c in self.candidates]
        self._decisions = [0] * len(self.candidates)
        self._chain_last = [0] * len(self.candidates)

    @property
    def any(self) -> bool:
        return any(self.candidates)

    def choose(self, slot: int, chain_tokens_per_s: float, plain_round_s: float) -> TreeShape | None:
        """The tree the slot's next round runs, or None for the chain."""
        shapes = self.candidates[slot]
        if not shapes:
            return None
        n = self._decisions[slot] = self._decisions[slot] + 1
        stats = self._stats[slot]
        untried = [s for s in shapes if stats[s].rounds < self.config.min_trials]
        if untried:
            return untried[0]
        every = self.config.probe_interval
        if every and n % every == 0:  # the least recently measured option, chain included
            oldest = min(shapes, key=lambda s: stats[s].last)
            if self._chain_last[slot] <= stats[oldest].last:
                self._chain_last[slot] = n
                return None
            return oldest
        best = max(shapes, key=lambda s: stats[s].value(plain_round_s))
        if stats[best].value(plain_round_s) > chain_tokens_per_s:
            return best
        self._chain_last[slot] = n
        return None

    def observe(self, slot: int, shape: TreeShape, accepted: Sequence[int], round_s: float | None,
                plain_round_s: float) -> None:
        """One tree round of the slot: accepted drafts per request (bonus excluded), its seconds."""
        st = self._stats[slot].get(shape)
        if st is None or not accepted or round_s is None or not plain_round_s > 0:
            return
        st.add(sum(accepted) / len(accepted) + 1.0, round_s / plain_round_s, 1.0 - 1.0 / self.config.window)
        st.last = self._decisions[slot]

    def chain_ran(self, slot: int) -> None:
        """A chain round ran in the slot (its figure is fresh)."""
        if self.candidates[slot]:
            self._chain_last[slot] = self._decisions[slot]

    def rewarm(self) -> None:
        for stats in self._stats:
            for st in stats.values():
                st.tokens_w = min(st.tokens_w, self.config.rewarm_weight)

    def info(self, slot: int, plain_round_s: float | None = None) -> dict:
        out = {}
        for s, st in self._stats[slot].items():
            out[f"{s.num_steps},{s.topk},{s.num_draft_tokens}"] = {
                "rounds": st.rounds, "tokens_per_round": st.tokens, "time_vs_plain": st.time,
                **({"tokens_per_s": st.value(plain_round_s)} if plain_round_s else {})}
        return out

    def state_dict(self) -> list[dict]:
        return [{f"{s.num_steps},{s.topk},{s.num_draft_tokens}": [st.tokens, st.tokens_w, st.time, st.time_w,
                                                                  st.rounds, st.last]
                 for s, st in stats.items()} for stats in self._stats]

    def load_state_dict(self, state: list[dict]) -> None:
        check(len(state) == len(self._stats), "state.trees", f"has {len(state)} slots, the config has {len(self._stats)}")
        for stats, saved in zip(self._stats, state):
            for s, st in stats.items():
                row = saved.get(f"{s.num_steps},{s.topk},{s.num_draft_tokens}")
                if row is not None:
                    st.tokens, st.tokens_w, st.time, st.time_w = (float(x) for x in row[:4])
                    st.rounds, st.last = int(row[4]), int(row[5])
