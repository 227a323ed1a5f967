"""Which draft tree, if any, a round should run instead of the cost policy's chain: measured, per
batch-size slot and batch-size bucket. Pure arithmetic: no torch, no I/O.

In: per round, the slot, the batch size, the shape (`TreeShape`, or the chain), accepted drafts
per request, the round's seconds and the round-time model's reference plain round at that batch
and context (`CostModel.reference_round_s`). Out, per decision: a tree, or None (the chain stays).

Both sides are measured, not modelled: an option's committed tokens per request-round
(accepted + 1) and its round time as a multiple of the reference plain round (so a bucket's
batch sizes and contexts compare), each an exponentially weighted mean over its rounds in the
bucket (1 | 2-3 | 4-7 | ..., `round_time.batch_bucket`). Value = tokens / (multiple x reference
plain round). The reference is the calibration's line, which the rounds never refit: against
the live prediction, which they do, an option measured minutes before another read a different
yardstick (H100, a trainer beside the server: the chain chosen over trees 17 % faster). The chain's value is its measured one once it has `min_trials` rounds in the
bucket, the policy's prediction (`chain_tokens_per_s`) until then. Against that prediction, a
CPU e2e run's chooser ran the tree 3,4,10 in most batch-4 rounds at 60 tokens a second of round
time where the chain's own rounds served 64-87 (2026-11-28, docs/controller.md): the chain's
acceptance estimates are unconditional, its early stop and verify cut are not in them. Buckets:
on a CPU a tree's verify costs its tokens times the batch, so one shape's multiple at batch 1 and
at batch 4 differ by far more than its value to either.

A shape is tried `min_trials` times in a bucket before its value counts, then the chain, and, so
no figure goes stale, the least recently measured option (the chain or a tree) is run once every
`probe_interval` decisions of the bucket. A head swap (`rewarm`) keeps the round times and
weakens the token means to `rewarm_weight` rounds: the new head's acceptance decides within a
few rounds.

    chooser = TreeChooser([[TreeShape(5, 4, 8), TreeShape(3, 4, 10)]], TreeChoiceConfig())
    shape = chooser.choose(slot, chain_tokens_per_s, plain_round_s, batch_size)
    chooser.observe(slot, shape, accepted, round_s, plain_round_s, batch_size)   # a tree round
    chooser.chain_ran(slot, accepted, round_s, plain_round_s, batch_size)        # a chain round
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from online_spec.config import check, doc
from online_spec.controller.round_time import batch_bucket
from online_spec.tree import TreeShape


@dataclass(frozen=True)
class TreeChoiceConfig:
    window: float = doc("rounds in the exponentially weighted means of an option's tokens and round time", 32.0)
    min_trials: int = doc("rounds of an option in a batch-size bucket before its measured value counts (the "
                          "trees tried in turn until then; the chain's predicted value stands in for its own)", 3)
    probe_interval: int = doc("decisions of a batch-size bucket between runs of its least recently measured "
                              "option (the chain or a tree); 0 = never", 48)
    rewarm_weight: float = doc("rounds an option's token mean counts as after a head swap", 2.0)
    margin: float = doc("a tree runs where its value beats the chain's by more than this share: a tree "
                        "round's deeper commit is caught up by the next round's draft, a cost its own "
                        "rounds do not carry", 0.05)

    def __post_init__(self) -> None:
        check(math.isfinite(self.window) and self.window >= 1, "window", f"must be >= 1, got {self.window!r}")
        check(isinstance(self.min_trials, int) and self.min_trials >= 1, "min_trials",
              f"must be an int >= 1, got {self.min_trials!r}")
        check(isinstance(self.probe_interval, int) and self.probe_interval >= 0, "probe_interval",
              f"must be an int >= 0, got {self.probe_interval!r}")
        check(math.isfinite(self.rewarm_weight) and self.rewarm_weight >= 0, "rewarm_weight",
              f"must be >= 0, got {self.rewarm_weight!r}")
        check(math.isfinite(self.margin) and self.margin >= 0, "margin", f"must be >= 0, got {self.margin!r}")


class _TreeStats:
    """One option (a shape, or the chain) in one slot and bucket: weighted means of tokens per
    request-round and of round time over the predicted plain round."""

    def __init__(self):
        self.tokens = 0.0
        self.tokens_w = 0.0
        self.time = 0.0
        self.time_w = 0.0
        self.rounds = 0  # measured rounds (with their seconds)
        self.trials = 0  # rounds run, measured or not
        self.last = -1  # decision index of its last round

    def add(self, tokens: float, multiple: float, decay: float) -> None:
        self.tokens_w = self.tokens_w * decay + 1.0
        self.tokens += (tokens - self.tokens) / self.tokens_w
        self.time_w = self.time_w * decay + 1.0
        self.time += (multiple - self.time) / self.time_w
        self.rounds += 1

    def value(self, plain_round_s: float) -> float:
        return self.tokens / (self.time * plain_round_s) if self.time > 0 and plain_round_s > 0 else 0.0


CHAIN = "chain"  # the chain's key beside the shapes


class TreeChooser:
    """Per slot and batch-size bucket: the candidate trees' and the chain's measured values, and
    the choice between them."""

    def __init__(self, candidates: Sequence[Sequence[TreeShape]], config: TreeChoiceConfig | None = None):
        self.config = config or TreeChoiceConfig()
        self.candidates = [list(c) for c in candidates]
        # slot -> bucket -> option (a shape, or CHAIN) -> stats; buckets appear as batch sizes come
        self._stats: list[dict[int, dict]] = [{} for _ in self.candidates]
        self._decisions: list[dict[int, int]] = [{} for _ in self.candidates]

    @property
    def any(self) -> bool:
        return any(self.candidates)

    def _bucket(self, slot: int, batch_size: int) -> tuple[int, dict]:
        b = batch_bucket(batch_size)
        stats = self._stats[slot].get(b)
        if stats is None:
            stats = self._stats[slot][b] = {s: _TreeStats() for s in [*self.candidates[slot], CHAIN]}
        return b, stats

    def choose(self, slot: int, chain_tokens_per_s: float | Callable[[], float], plain_round_s: float,
               batch_size: int = 1) -> TreeShape | None:
        """The tree the slot's next round at this batch size runs, or None for the chain
        (`chain_tokens_per_s`: the policy's predicted value of the chain it would run, or a
        function giving it, called only in the rounds that use it: before the chain has
        `min_trials` measured rounds in the bucket)."""
        shapes = self.candidates[slot]
        if not shapes:
            return None
        b, stats = self._bucket(slot, batch_size)
        n = self._decisions[slot][b] = self._decisions[slot].get(b, 0) + 1
        untried = [s for s in shapes if stats[s].rounds < self.config.min_trials]
        if untried:
            return untried[0]
        if stats[CHAIN].trials < self.config.min_trials:  # then the chain, measured as the trees were
            return None
        every = self.config.probe_interval
        if every and n % every == 0:  # the least recently measured option, chain included
            oldest = min([CHAIN, *shapes], key=lambda s: stats[s].last)
            return None if oldest == CHAIN else oldest
        chain = stats[CHAIN]
        if chain.rounds >= self.config.min_trials:
            chain_tokens_per_s = chain.value(plain_round_s)
        elif callable(chain_tokens_per_s):
            chain_tokens_per_s = chain_tokens_per_s()
        best = max(shapes, key=lambda s: stats[s].value(plain_round_s))
        return best if stats[best].value(plain_round_s) > chain_tokens_per_s * (1.0 + self.config.margin) else None

    def observe(self, slot: int, shape: TreeShape, accepted: Sequence[int], round_s: float | None,
                plain_round_s: float, batch_size: int = 1) -> None:
        """One tree round of the slot at this batch size: accepted drafts per request (bonus
        excluded), its seconds."""
        if shape in self.candidates[slot]:
            self._add(slot, shape, accepted, round_s, plain_round_s, batch_size)

    def chain_ran(self, slot: int, accepted: Sequence[int] = (), round_s: float | None = None,
                  plain_round_s: float = 0.0, batch_size: int = 1) -> None:
        """A chain round of the slot at this batch size (its figure is fresh; measured where the
        round's seconds and the plain round's are given)."""
        if self.candidates[slot]:
            self._add(slot, CHAIN, accepted, round_s, plain_round_s, batch_size)

    def _add(self, slot, option, accepted, round_s, plain_round_s, batch_size) -> None:
        b, stats = self._bucket(slot, batch_size)
        st = stats[option]
        st.last = self._decisions[slot].get(b, 0)
        st.trials += 1
        if accepted and round_s is not None and plain_round_s > 0:
            st.add(sum(accepted) / len(accepted) + 1.0, round_s / plain_round_s, 1.0 - 1.0 / self.config.window)

    def rewarm(self) -> None:
        for buckets in self._stats:
            for stats in buckets.values():
                for st in stats.values():
                    st.tokens_w = min(st.tokens_w, self.config.rewarm_weight)

    @staticmethod
    def _key(option) -> str:
        return option if option == CHAIN else f"{option.num_steps},{option.topk},{option.num_draft_tokens}"

    def info(self, slot: int, plain_round_s: float | None = None) -> dict:
        """Per bucket (keyed by its smallest batch size), per option ("steps,topk,tokens" or
        "chain"): rounds, tokens a request-round, round time over plain (and tokens/s given the
        plain round's seconds)."""
        return {str(1 << (b - 1)): {
            self._key(s): {"rounds": st.rounds, "tokens_per_round": st.tokens, "time_vs_plain": st.time,
                           **({"tokens_per_s": st.value(plain_round_s)} if plain_round_s else {})}
            for s, st in stats.items()} for b, stats in sorted(self._stats[slot].items())}

    def state_dict(self) -> list[dict]:
        return [{str(b): {self._key(s): [st.tokens, st.tokens_w, st.time, st.time_w, st.rounds, st.last, st.trials]
                          for s, st in stats.items()} for b, stats in buckets.items()}
                for buckets in self._stats]

    def load_state_dict(self, state: list[dict]) -> None:
        """A state of `state_dict`. One written before the buckets (shape keys at the top, no
        chain) loads into no bucket: each bucket then measures afresh, a few rounds an option."""
        check(len(state) == len(self._stats), "state.trees", f"has {len(state)} slots, the config has {len(self._stats)}")
        for slot, saved in enumerate(state):
            self._stats[slot], self._decisions[slot] = {}, {}
            for key, rows in saved.items():
                if not (isinstance(key, str) and key.isdigit() and isinstance(rows, dict)):
                    continue  # the bucket-less layout
                b = int(key)
                check(b >= 1, "state.trees", f"bucket {key!r} must be >= 1")
                _, stats = self._bucket(slot, 1 << (b - 1))
                for s, st in stats.items():
                    row = rows.get(self._key(s))
                    if row is not None:
                        st.tokens, st.tokens_w, st.time, st.time_w = (float(x) for x in row[:4])
                        st.rounds, st.last = int(row[4]), int(row[5])
                        st.trials = int(row[6]) if len(row) > 6 else st.rounds
                        self._decisions[slot][b] = max(self._decisions[slot].get(b, 0), st.last)
