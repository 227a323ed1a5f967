"""Decisions of the trainer daemon, apart from its mechanisms: pure objects, no I/O, no torch.

`SwapGate.decide(candidate, live) -> GateDecision`: publish a candidate only when its simulated
accept length (at the live K mix) beats the live head's by a margin (relative and absolute),
on enough held-out anchors.

`LiveAcceptance`: per head version (and per batch-size slot and traffic tag), accepted drafts
and verify rounds, from the per-row information of captured spans (a row with accepted == 1 is
one accepted draft; each drafted round ends in exactly one row with accepted != 1).

`RollbackMonitor.update(live) -> RollbackDecision`: after a swap to version v from p, once v has
drafted `min_rounds` rounds, roll back if its live accept length is below p's by more than the
threshold; otherwise confirm v. Before enough rounds, wait. Both are compared on the same
traffic: per traffic tag, p's accept length weighted by v's rounds of each tag (tags p served;
v's accept length on those tags), so a shift in the traffic mix at the swap (chat before, code
after) is not mistaken for a worse head. Without such tags, the overall accept lengths.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from online_spec.config import check, doc


@dataclass
class GateConfig:
    margin_rel: float = doc("a candidate must beat the live head's simulated accept length by this fraction", 0.02)
    margin_abs: float = doc("... and by at least this many tokens", 0.02)
    min_anchors: int = doc("held-out anchors needed before any decision", 200)
    rollback_threshold: float = doc("roll back when the new version's live accept length is below the "
                                    "previous version's by more than this fraction", 0.10)
    rollback_min_rounds: int = doc("live verify rounds of the new version before judging it", 40)

    def __post_init__(self):
        check(self.margin_rel >= 0, "margin_rel", "must be >= 0")
        check(self.margin_abs >= 0, "margin_abs", "must be >= 0")
        check(self.min_anchors >= 1, "min_anchors", "must be >= 1")
        check(0 < self.rollback_threshold < 1, "rollback_threshold", "must be in (0, 1)")
        check(self.rollback_min_rounds >= 1, "rollback_min_rounds", "must be >= 1")


@dataclass
class GateDecision:
    publish: bool
    reason: str
    candidate: float
    live: float


class SwapGate:
    def __init__(self, cfg: GateConfig):
        self.cfg = cfg

    def decide(self, candidate: float, live: float, anchors: int) -> GateDecision:
        c = self.cfg
        if anchors < c.min_anchors:
            return GateDecision(False, f"only {anchors} held-out anchors (< {c.min_anchors})", candidate, live)
        need = max(live * (1 + c.margin_rel), live + c.margin_abs)
        if candidate >= need:
            return GateDecision(True, f"candidate {candidate:.3f} >= {need:.3f} needed over live {live:.3f}",
                                candidate, live)
        return GateDecision(False, f"candidate {candidate:.3f} < {need:.3f} needed over live {live:.3f}",
                            candidate, live)


def k_mix_score(accept_length: dict[str, float], k_counts: dict[int, int]) -> float:
    """Expected accept length at the live mix of K (rounds per K); K=0 rounds do not count.
    With no drafted rounds yet, the mean over the measured K."""
    drafted = {k: n for k, n in k_counts.items() if k > 0 and str(k) in accept_length}
    if not drafted:
        return sum(accept_length.values()) / max(1, len(accept_length))
    total = sum(drafted.values())
    return sum(accept_length[str(k)] * n / total for k, n in drafted.items())


@dataclass
class _Tally:
    accepted: int = 0
    rounds: int = 0

    @property
    def accept_length(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


class LiveAcceptance:
    """Live acceptance tallies from captured spans, per version, per (version, slot), per (version, tag)."""

    def __init__(self):
        self.by_version: dict[int, _Tally] = defaultdict(_Tally)
        self.by_slot: dict[tuple[int, int], _Tally] = defaultdict(_Tally)
        self.by_tag: dict[tuple[int, str], _Tally] = defaultdict(_Tally)
        self.k_counts: dict[int, int] = defaultdict(int)

    def observe_rows(self, accepted: list[int], num_steps: list[int], versions: list[int],
                     batch_sizes: list[int], tag: str) -> None:
        for a, k, v, b in zip(accepted, num_steps, versions, batch_sizes):
            if k <= 0:
                continue  # prefill or plain decode: nothing was drafted
            tallies = (self.by_version[v], self.by_slot[(v, b)], self.by_tag[(v, tag)])
            if a == 1:
                for t in tallies:
                    t.accepted += 1
            else:  # the row that ends a drafted round (rejection, or the bonus after all accepted)
                for t in tallies:
                    t.rounds += 1
                self.k_counts[k] += 1

    def accept_length(self, version: int) -> tuple[float, int]:
        t = self.by_version.get(version)
        return (t.accept_length, t.rounds) if t else (0.0, 0)

    def by_tags(self, version: int) -> dict[str, tuple[int, int]]:
        """{tag: (accepted drafts, rounds)} of one version."""
        return {g: (t.accepted, t.rounds) for (v, g), t in list(self.by_tag.items()) if v == version and t.rounds}

    def summary(self) -> dict:
        return {"version": {str(v): {"accept_length": t.accept_length, "rounds": t.rounds}
                            for v, t in self.by_version.items()},
                "slot": {f"{v}/{b}": t.accept_length for (v, b), t in self.by_slot.items()},
                "tag": {f"{v}/{g or '-'}": t.accept_length for (v, g), t in self.by_tag.items()},
                "k_counts": {str(k): n for k, n in self.k_counts.items()}}


@dataclass
class RollbackDecision:
    action: str  # "wait" | "keep" | "rollback"
    reason: str


@dataclass
class RollbackMonitor:
    cfg: GateConfig
    watching: tuple[int, int] | None = None  # (new version, previous version)
    baseline: dict = field(default_factory=dict)

    def start(self, new_version: int, previous_version: int, previous_accept: float, previous_rounds: int,
              previous_tags: dict[str, tuple[int, int]] | None = None) -> None:
        """previous_tags: the previous version's {tag: (accepted, rounds)} (`LiveAcceptance.by_tags`)."""
        self.watching = (new_version, previous_version)
        self.baseline = {"accept": previous_accept, "rounds": previous_rounds,
                         "tags": {g: list(ar) for g, ar in (previous_tags or {}).items()}}

    def _compare(self, live: LiveAcceptance, new: int) -> tuple[float, float, int, str]:
        """(new version's accept length, the previous one's on the same traffic, new's rounds, how)."""
        base_tags = self.baseline.get("tags") or {}
        new_tags = {g: ar for g, ar in live.by_tags(new).items() if g in base_tags and base_tags[g][1] > 0}
        rounds = sum(r for _, r in new_tags.values())
        if rounds >= self.cfg.rollback_min_rounds:
            acc = sum(a for a, _ in new_tags.values()) / rounds
            base = sum(r * base_tags[g][0] / base_tags[g][1] for g, (_, r) in new_tags.items()) / rounds
            return acc, base, rounds, f"on tags {sorted(new_tags)}"
        acc, rounds = live.accept_length(new)
        return acc, self.baseline["accept"], rounds, "overall"

    def update(self, live: LiveAcceptance) -> RollbackDecision:
        if self.watching is None:
            return RollbackDecision("keep", "nothing to watch")
        new, prev = self.watching
        acc, rounds = live.accept_length(new)
        if rounds < self.cfg.rollback_min_rounds:
            return RollbackDecision("wait", f"v{new}: {rounds} rounds (< {self.cfg.rollback_min_rounds})")
        acc, base, _, how = self._compare(live, new)
        if self.baseline["rounds"] > 0 and acc < base * (1 - self.cfg.rollback_threshold):
            self.watching = None
            return RollbackDecision("rollback", f"v{new} live accept length {acc:.3f} < v{prev}'s {base:.3f} "
                                                f"by more than {self.cfg.rollback_threshold:.0%} ({how})")
        self.watching = None
        return RollbackDecision("keep", f"v{new} live accept length {acc:.3f} vs v{prev}'s {base:.3f} ({how})")

    def state_dict(self) -> dict:
        return {"watching": list(self.watching) if self.watching else None, "baseline": self.baseline}

    def load_state_dict(self, state: dict) -> None:
        self.watching = tuple(state["watching"]) if state.get("watching") else None
        self.baseline = dict(state.get("baseline") or {})
