"""Decisions of the trainer daemon, apart from its mechanisms: pure objects, no I/O, no torch.

`SwapGate.decide(candidate, live) -> GateDecision`: publish a candidate only when its simulated
accept length (at the live K mix) beats the live head's by a margin (relative and absolute),
on enough held-out anchors.

`LiveAcceptance`: per head version (and per batch-size slot and traffic tag), accepted drafts
and verify rounds, from the per-row information of captured spans (a row with accepted == 1 is
one accepted draft; each drafted round ends in exactly one row with accepted != 1).

`RollbackMonitor.update(live) -> RollbackDecision`: after a swap to version v from p, once v has
drafted `min_rounds` rounds, roll back if its live accept length is below p's by more than the
threshold; otherwise confirm v. Before enough rounds (and requests), wait. Both are compared on
the same traffic: per traffic tag, p's accept length weighted by v's rounds of each tag (tags p served;
v's accept length on those tags), so a shift in the traffic mix at the swap (chat before, code
after) is not mistaken for a worse head. Without such tags, the overall accept lengths. And at
the same K: drafts accepted per round grow with K, and the step controller re-warms at a swap
(it starts over from its acceptance prior, often at a lower K for a while), so p's figure is
its per-position acceptance on the tag (hits / trials of draft position i) evaluated at v's
K of each round, not p's accept length at p's own K mix. A drop beyond the threshold must also
be significant: at least `rollback_z` standard errors of v's mean accept length (per-round
accepted drafts vary from 0 to K: over 30 rounds the standard error is ~20 % of the mean, as
large as the drops being judged; and rounds of one request are alike, so the standard error is
also taken over requests, the larger of the two counting; p's figure on a tag, from the requests
p served there, has its own standard error, added in quadrature); a drop that is not yet
significant waits for more rounds, up to `rollback_max_rounds`, after which v is kept.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from online_spec.config import check, doc
from online_spec.controller.acceptance import expected_accepted, fill_untried


@dataclass
class GateConfig:
    margin_rel: float = doc("a candidate must beat the live head's simulated accept length by this fraction", 0.02)
    margin_abs: float = doc("... and by at least this many tokens", 0.02)
    min_anchors: int = doc("held-out anchors needed before any decision", 200)
    tag_regress: float = doc("refuse a candidate that is worse than the live head by more than this fraction "
                             "on any traffic tag with held-out traffic in the buffer (min_anchors of it), even "
                             "when it wins on the current mix: a head that learns today's code must not forget "
                             "yesterday's chat; a backstop against forgetting, not a veto on trade-offs (at 5 % "
                             "it refused heads 10-30 % better on code for 4-9 % on chat); 1 = off", 0.15)
    rollback_threshold: float = doc("roll back when the new version's live accept length is below the "
                                    "previous version's by more than this fraction", 0.10)
    rollback_min_rounds: int = doc("live verify rounds of the new version before judging it", 40)
    rollback_min_requests: int = doc("captured spans (requests, or parts of long ones) the new version's rounds must "
                                     "come from before it is judged: an easy or a hard task accepts alike round "
                                     "after round, so 40 rounds of 2 requests decide nothing (a replayed e2e stream "
                                     "rolled back a better head on 47 rounds of 2 requests)", 8)
    rollback_z: float = doc("a drop must also exceed this many standard errors of the new version's mean "
                            "accept length (0 = the threshold alone)", 2.0)
    rollback_max_rounds: int = doc("keep the new version once it has this many rounds without a significant "
                                   "drop (at or below rollback_min_rounds: decide at rollback_min_rounds)", 2000)

    def __post_init__(self):
        check(self.margin_rel >= 0, "margin_rel", "must be >= 0")
        check(self.margin_abs >= 0, "margin_abs", "must be >= 0")
        check(self.min_anchors >= 1, "min_anchors", "must be >= 1")
        check(0 <= self.tag_regress <= 1, "tag_regress", "must be in [0, 1]")
        check(0 < self.rollback_threshold < 1, "rollback_threshold", "must be in (0, 1)")
        check(self.rollback_min_rounds >= 1, "rollback_min_rounds", "must be >= 1")
        check(self.rollback_min_requests >= 1, "rollback_min_requests", "must be >= 1")
        check(self.rollback_z >= 0, "rollback_z", "must be >= 0")
        check(self.rollback_max_rounds >= 1, "rollback_max_rounds", "must be >= 1")


@dataclass
class GateDecision:
    publish: bool
    reason: str
    candidate: float
    live: float


class SwapGate:
    def __init__(self, cfg: GateConfig):
        self.cfg = cfg

    def decide(self, candidate: float, live: float, anchors: int,
               per_tag: dict[str, tuple[float, float, int]] | None = None) -> GateDecision:
        """`candidate` / `live`: scores on the current traffic mix over `anchors` held-out anchors;
        `per_tag`: tag -> (candidate, live, anchors) on each tag's own held-out traffic."""
        c = self.cfg
        if anchors < c.min_anchors:
            return GateDecision(False, f"only {anchors} held-out anchors (< {c.min_anchors})", candidate, live)
        need = max(live * (1 + c.margin_rel), live + c.margin_abs)
        if candidate < need:
            return GateDecision(False, f"candidate {candidate:.3f} < {need:.3f} needed over live {live:.3f}",
                                candidate, live)
        for tag, (ct, lt, n) in sorted((per_tag or {}).items()):
            if n >= c.min_anchors and ct < lt * (1 - c.tag_regress):
                return GateDecision(False, f"candidate {candidate:.3f} wins on the mix over live {live:.3f} but "
                                           f"regresses on tag {tag!r}: {ct:.3f} < {lt * (1 - c.tag_regress):.3f} "
                                           f"(live {lt:.3f} - {c.tag_regress:.0%})", candidate, live)
        return GateDecision(True, f"candidate {candidate:.3f} >= {need:.3f} needed over live {live:.3f}",
                            candidate, live)


def k_mix_depth(k_counts: dict[int, int], max_steps: int, floor: float = 0.01) -> int:
    """Draft steps the gate needs to score the live K mix: the deepest K holding at least `floor`
    of the drafted rounds, at most `max_steps` (all of them before any round is drafted). A
    simulated step costs a head forward and vocabulary projections, so scoring K = 3 traffic at 7
    steps spent about half of an evaluation on steps the server never drafts."""
    drafted = {k: n for k, n in k_counts.items() if k > 0 and n > 0}
    total = sum(drafted.values())
    if not total:
        return max_steps
    return max(1, min(max_steps, max(k for k, n in drafted.items() if n >= floor * total)))


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
    squares: int = 0  # sum over rounds of (accepted drafts)^2: the spread of per-round acceptance
    # per span (one request, or the part of one the server sent at once): its accepted drafts A
    # and rounds R, as sums over spans of A^2, A R, R^2 (the spread between requests)
    spans: int = 0
    span_aa: int = 0
    span_ar: int = 0
    span_rr: int = 0

    def add_span(self, a: int, r: int) -> None:
        self.spans += 1
        self.span_aa += a * a
        self.span_ar += a * r
        self.span_rr += r * r

    @property
    def accept_length(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


@dataclass
class _Positions:
    """Per draft position i (0-based): rounds that verified it (trials) and accepted it (hits);
    and rounds per verified K."""
    hits: list = field(default_factory=list)
    trials: list = field(default_factory=list)
    rounds_by_k: dict = field(default_factory=lambda: defaultdict(int))

    def observe_round(self, accepted: int, k: int) -> None:
        if len(self.trials) < k:
            grow = k - len(self.trials)
            self.hits += [0] * grow
            self.trials += [0] * grow
        for i in range(min(accepted + 1, k)):  # positions 1..a accepted, a+1 rejected (if verified)
            self.trials[i] += 1
            self.hits[i] += i < accepted
        self.rounds_by_k[k] += 1


def expected_accept_length(hits: list, trials: list, k: int) -> float | None:
    """Drafts accepted per round at K = k from per-position hits / trials (the controller's
    `expected_accepted`); a position never verified takes the deepest verified rate to its left
    (`fill_untried`), past the last one too. None when position 1 never was verified."""
    if not trials or not trials[0]:
        return None
    rates = fill_untried([h / t if t else 0.0 for h, t in zip(hits, trials)], trials, 0.0)
    return expected_accepted(rates + [rates[-1]] * (k - len(rates)), k)


class LiveAcceptance:
    """Live acceptance tallies from captured spans, per version, per (version, slot), per (version, tag);
    per (version, tag) also per draft position (`_Positions`)."""

    def __init__(self):
        self.by_version: dict[int, _Tally] = defaultdict(_Tally)
        self.by_slot: dict[tuple[int, int], _Tally] = defaultdict(_Tally)
        self.by_tag: dict[tuple[int, str], _Tally] = defaultdict(_Tally)
        self.positions: dict[tuple[int, str], _Positions] = defaultdict(_Positions)
        self.k_counts: dict[int, int] = defaultdict(int)

    def observe_rows(self, accepted: list[int], num_steps: list[int], versions: list[int],
                     batch_sizes: list[int], tag: str) -> None:
        """One span's rows (one request, or part of one): accepted drafts and rounds per tally, and
        the span's own totals per tally (its rounds are one cluster: a request's rounds are alike)."""
        run = 0  # accepted rows of the round in progress (a span holds whole rounds, in order)
        in_span: dict[int, list] = {}  # id(tally) -> [tally, accepted, rounds] within this span
        for a, k, v, b in zip(accepted, num_steps, versions, batch_sizes):
            if k <= 0:
                run = 0
                continue  # prefill or plain decode: nothing was drafted
            tallies = (self.by_version[v], self.by_slot[(v, b)], self.by_tag[(v, tag)])
            if a == 1:
                run += 1
                for t in tallies:
                    t.accepted += 1
            else:  # the row that ends a drafted round (rejection, or the bonus after all accepted)
                a_round = min(run, k)
                for t in tallies:
                    t.rounds += 1
                    t.squares += a_round * a_round
                    own = in_span.setdefault(id(t), [t, 0, 0])
                    own[1] += a_round
                    own[2] += 1
                self.k_counts[k] += 1
                self.positions[(v, tag)].observe_round(a_round, k)
                run = 0
        for t, a_span, r_span in in_span.values():
            t.add_span(a_span, r_span)

    def accept_length(self, version: int) -> tuple[float, int]:
        t = self.by_version.get(version)
        return (t.accept_length, t.rounds) if t else (0.0, 0)

    def by_tags(self, version: int) -> dict[str, tuple[int, int]]:
        """{tag: (accepted drafts, rounds)} of one version."""
        return {g: (t.accepted, t.rounds) for (v, g), t in list(self.by_tag.items()) if v == version and t.rounds}

    def _tallies(self, version: int, tags: list[str] | None) -> list[_Tally]:
        if tags is None:
            return [self.by_version[version]] if version in self.by_version else []
        return [t for (v, g), t in list(self.by_tag.items()) if v == version and g in tags]

    def spans(self, version: int, tags: list[str] | None = None) -> int:
        """Captured spans (requests) the version's drafted rounds came from (on `tags`, or overall)."""
        return sum(t.spans for t in self._tallies(version, tags))

    def standard_error(self, version: int, tags: list[str] | None = None) -> float:
        """Standard error of the version's mean accepted drafts per round (on `tags`, or overall):
        the larger of the one from the spread of its rounds and the one from the spread of its
        spans (requests as clusters of rounds: an easy task accepts a lot round after round, so
        200 rounds of 15 requests are closer to 15 samples than to 200); inf with fewer than 2
        rounds or 2 spans."""
        ts = self._tallies(version, tags)
        n, total, sq, c, aa, ar, rr = (sum(getattr(t, f) for t in ts) for f in
                                       ("rounds", "accepted", "squares", "spans", "span_aa", "span_ar", "span_rr"))
        if n < 2 or c < 2:
            return float("inf")
        m = total / n
        per_round = max(0.0, (sq - total * total / n) / (n - 1)) / n
        # ratio estimator m = sum A / sum R over clusters: var = C/(C-1) sum (A - m R)^2 / (sum R)^2
        per_span = c / (c - 1) * max(0.0, aa - 2 * m * ar + m * m * rr) / (n * n)
        return max(per_round, per_span) ** 0.5

    def position_tallies(self, version: int) -> dict[str, dict]:
        """{tag: {"hits": [...], "trials": [...], "rounds_by_k": {K: rounds}}} of one version."""
        return {g: {"hits": list(p.hits), "trials": list(p.trials), "rounds_by_k": dict(p.rounds_by_k)}
                for (v, g), p in list(self.positions.items()) if v == version and p.rounds_by_k}

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
              previous_tags: dict[str, tuple[int, int]] | None = None,
              previous_positions: dict[str, dict] | None = None,
              previous_se: dict[str, float] | None = None) -> None:
        """previous_tags: the previous version's {tag: (accepted, rounds)} (`LiveAcceptance.by_tags`);
        previous_positions: its per-position tallies per tag (`LiveAcceptance.position_tallies`);
        previous_se: the standard error of its accept length per tag (`LiveAcceptance.standard_error`;
        none given: its figures are taken as exact)."""
        self.watching = (new_version, previous_version)
        self.baseline = {"accept": previous_accept, "rounds": previous_rounds,
                         "tags": {g: list(ar) for g, ar in (previous_tags or {}).items()},
                         "positions": {g: {"hits": list(p["hits"]), "trials": list(p["trials"])}
                                       for g, p in (previous_positions or {}).items()},
                         "se": {g: float(v) for g, v in (previous_se or {}).items()}}

    def start_from(self, live: LiveAcceptance, new_version: int, previous_version: int) -> None:
        """`start` with everything about the previous version read from the live tallies."""
        tags = live.by_tags(previous_version)
        self.start(new_version, previous_version, *live.accept_length(previous_version), tags,
                   live.position_tallies(previous_version),
                   {g: live.standard_error(previous_version, [g]) for g in tags})

    def _tag_baseline(self, tag: str, new_rounds_by_k: dict, rounds: int) -> tuple[float, bool]:
        """The previous version's accepted drafts on `tag` over the new version's rounds there:
        at the new version's K of each round when its per-position tallies allow (True), else
        its accept length at its own K mix times the rounds (False)."""
        pos = (self.baseline.get("positions") or {}).get(tag)
        if pos and new_rounds_by_k:
            by_k = {int(k): n for k, n in new_rounds_by_k.items()}
            exp = {k: expected_accept_length(pos["hits"], pos["trials"], k) for k in by_k}
            if all(e is not None for e in exp.values()):
                return sum(n * exp[k] for k, n in by_k.items()), True
        acc, n = self.baseline["tags"][tag]
        return rounds * acc / n, False

    def _compare(self, live: LiveAcceptance, new: int) -> tuple[float, float, float, str, int]:
        """(new version's accept length, the previous one's on the same traffic, the standard
        error of the first, how, the spans it comes from)."""
        base_tags = self.baseline.get("tags") or {}
        new_tags = {g: ar for g, ar in live.by_tags(new).items() if g in base_tags and base_tags[g][1] > 0}
        rounds = sum(r for _, r in new_tags.values())
        if rounds >= self.cfg.rollback_min_rounds:
            acc = sum(a for a, _ in new_tags.values()) / rounds
            new_pos = live.position_tallies(new)
            base_sum, matched = 0.0, True
            for g, (_, r) in new_tags.items():
                b, same_k = self._tag_baseline(g, (new_pos.get(g) or {}).get("rounds_by_k") or {}, r)
                base_sum += b
                matched = matched and same_k
            how = f"on tags {sorted(new_tags)}" + (", at the same K" if matched else "")
            # the previous version's figure is an estimate too (after a shift, from a few requests of
            # the new traffic): its standard error per tag, weighted as its figure is, adds in quadrature
            base_se = sum((r / rounds * (self.baseline.get("se") or {}).get(g, 0.0)) ** 2
                          for g, (_, r) in new_tags.items()) ** 0.5
            se = (live.standard_error(new, list(new_tags)) ** 2 + base_se ** 2) ** 0.5
            return acc, base_sum / rounds, se, how, live.spans(new, list(new_tags))
        acc, rounds = live.accept_length(new)
        return acc, self.baseline["accept"], live.standard_error(new), "overall", live.spans(new)

    def update(self, live: LiveAcceptance) -> RollbackDecision:
        if self.watching is None:
            return RollbackDecision("keep", "nothing to watch")
        new, prev = self.watching
        acc, rounds = live.accept_length(new)
        if rounds < self.cfg.rollback_min_rounds:
            return RollbackDecision("wait", f"v{new}: {rounds} rounds (< {self.cfg.rollback_min_rounds})")
        acc, base, se, how, spans = self._compare(live, new)
        if spans < self.cfg.rollback_min_requests and rounds < self.cfg.rollback_max_rounds:
            return RollbackDecision("wait", f"v{new}: {rounds} rounds from {spans} requests "
                                            f"(< {self.cfg.rollback_min_requests})")
        if self.baseline["rounds"] > 0 and acc < base * (1 - self.cfg.rollback_threshold):
            z = (base - acc) / se if se > 0 else float("inf")
            if z >= self.cfg.rollback_z:
                self.watching = None
                return RollbackDecision("rollback", f"v{new} live accept length {acc:.3f} < v{prev}'s {base:.3f} "
                                                    f"by more than {self.cfg.rollback_threshold:.0%}, {z:.1f} standard "
                                                    f"errors, {rounds} rounds ({how})")
            if rounds < self.cfg.rollback_max_rounds:
                return RollbackDecision("wait", f"v{new} live accept length {acc:.3f} < v{prev}'s {base:.3f} but "
                                                f"only {z:.1f} standard errors after {rounds} rounds ({how})")
            self.watching = None
            return RollbackDecision("keep", f"v{new} live accept length {acc:.3f} vs v{prev}'s {base:.3f}: no "
                                            f"significant drop in {rounds} rounds ({how})")
        self.watching = None
        return RollbackDecision("keep", f"v{new} live accept length {acc:.3f} vs v{prev}'s {base:.3f} ({how})")

    def state_dict(self) -> dict:
        return {"watching": list(self.watching) if self.watching else None, "baseline": self.baseline}

    def load_state_dict(self, state: dict) -> None:
        self.watching = tuple(state["watching"]) if state.get("watching") else None
        self.baseline = dict(state.get("baseline") or {})
