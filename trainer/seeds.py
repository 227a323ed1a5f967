"""Seed heads: pretrained heads the trainer starts over from when today's traffic is theirs.

Training a head toward new traffic takes thousands of tokens of it (issue 30: the first useful
swap after chat -> code came 1,400-4,200 tokens in, and the gain stayed far below a head trained
for code). A deployment often has such heads already: the packaged code head, a head per
product. With `--seed-heads code,/path/to/head` the daemon keeps them beside its own line and,
every `--seed-check-s` (every `--seed-boost-check-s` after a drift alert, and at once on one),
scores each of them and the live head on the traffic that arrived since the live head went live,
or since the change the last drift alert estimates when that came later (the traffic of after the
shift alone, from the detector's change estimate on: `change_start`): the newest
`--seed-rows` generated rows of every captured span (held-out or not: no seed and not the live
head has trained on them; spans from before the live head's publication are left out, since a
published candidate may have trained on those). A seed whose simulated accept length at
K = `--seed-steps` beats the live head's by `--seed-margin` (relative) on at least `--seed-min-anchors`
drafted positions is adopted: the distiller takes its weights and vocabulary map (training goes
on from it, the anchor re-aimed at it), and it is published through the usual path (a new
version, swapped in over the control endpoint, watched by the rollback monitor); the next check
comes after `--seed-dwell-rows` more generated rows of traffic and `--seed-min-dwell-s` seconds
(on mixed traffic the newest rows lean one way, then the other), as it does after any other
change of the live head (the server's head bank swapping on its own, a rollback): a seed check
never answers the bank's swap at once. The window and the rows' dwell are counted in traffic:
they mean the same on a CPU serving 25 tokens a second and a GPU serving 1,000, and through a
trainer paused beside its server (bench e2e's interleaved turns), where seconds alone pass
without traffic; the seconds' dwell keeps a fast GPU from changing heads every few seconds.

Only the traffic of now decides, not the gate's per-tag check on stored traffic: a seed is a
specialist, and earlier traffic gets its own head back when it returns (from the server's head
bank, or from this same check, which scores every seed, the starting head included if it is
listed). Every span is scored once per head (`LiveCounts` caches per span, the live head's anew
for each live head), so a check costs the spans that arrived since the last one (`seconds`, in
the daemon's summary); few draft steps and a short window keep it cheap beside a server on the
same cores.

    seeds = SeedWatch(SeedConfig(heads="code"), target)
    seeds.observe(span, now)                          # subscriber thread, every stored span
    if seeds.due(now, boosted):
        pick = seeds.check(since, live_head)          # since: the live head's start or the last alert's change
                                                      # -> SeedPick or None
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from online_spec.config import check, doc
from online_spec.head import EagleHead
from trainer.evaluate import LiveCounts, acceptance_from_counts

log = logging.getLogger(__name__)

RECENT_SPANS = 256  # most spans the window keeps (a span of 64 rows of SmolLM2 features: ~0.2 MB)
MAX_CHANGE_AGE_S = 900.0  # an alert's change estimate is taken at most this far back (clock skew, a stale alert)


def change_start(alert: dict, now: float, wall_now: float) -> float:
    """When a drift alert's change began, on the monotonic clock whose time now is `now`: its
    `since` (the detector's change estimate, on the server's wall clock, which `wall_now` reads
    here), at most `MAX_CHANGE_AGE_S` back; `now` for an alert without one. The rows that came
    between the change and the alert (the detector's delay, the alert's way here) are the new
    traffic's too, so a window that starts at the alert would wait for rows it already had."""
    since = alert.get("since")
    if isinstance(since, bool) or not isinstance(since, (int, float)) or not math.isfinite(since):
        return now
    return now - min(max(0.0, wall_now - since), MAX_CHANGE_AGE_S)


@dataclass
class SeedConfig:
    heads: str = doc("pretrained heads the trainer may start over from (comma-separated: shipped, code, or "
                     "checkpoint directories) when one drafts today's traffic better than the live head; "
                     "empty = none", "")
    check_s: float = doc("seconds between checks of the seed heads against the live head", 5.0)
    boost_check_s: float = doc("... while a drift alert's boost lasts (--drift-boost-s)", 5.0)
    rows: int = doc("newest generated rows (of spans since the live head went live, or since the change the "
                    "last drift alert estimates when later) a check scores", 256)
    steps: int = doc("draft steps simulated: a head's score is its simulated accept length at K = steps", 3)
    min_anchors: int = doc("drafted positions a check needs before it decides", 128)
    margin: float = doc("a seed must beat the live head's simulated accept length by this fraction", 0.10)
    dwell_rows: int = doc("generated rows served after a head went live before the next check (a seed's "
                          "adoption, the server's own swap, a rollback): on mixed traffic the newest rows lean "
                          "one way, then the other, each change restarts the controller's acceptance estimates, "
                          "and the server's head bank would swap back; counted in traffic, so it means the same "
                          "on a CPU and a GPU and through a paused trainer", 1024)
    min_dwell_s: float = doc("... and seconds after it (both must pass)", 60.0)

    def __post_init__(self):
        check(self.check_s > 0, "check_s", "must be > 0")
        check(self.boost_check_s > 0, "boost_check_s", "must be > 0")
        check(self.rows >= 1, "rows", "must be >= 1")
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.min_anchors >= 1, "min_anchors", "must be >= 1")
        check(self.margin >= 0, "margin", "must be >= 0")
        check(self.dwell_rows >= 0, "dwell_rows", "must be >= 0")
        check(self.min_dwell_s >= 0, "min_dwell_s", "must be >= 0")

    @property
    def names(self) -> list[str]:
        return [s.strip() for s in self.heads.split(",") if s.strip()]


@dataclass
class Seed:
    label: str
    master: EagleHead  # fp32 on the CPU: what the distiller takes on adoption
    counts: LiveCounts  # its per-span simulated counts (an eval copy in the target's dtype and device)


@dataclass
class SeedPick:
    seed: Seed
    score: float
    live: float
    anchors: int
    scores: dict  # label -> score, every seed's


def eval_copy(head: EagleHead, target) -> EagleHead:
    """`head` as the gate scores it: a copy in the target's dtype and device, eval mode."""
    copy = EagleHead(head.cfg)
    copy.load_state_dict(head.state_dict())
    copy.set_vocab_map(head.d2t.cpu(), head.t2d.cpu())
    return copy.to(dtype=target.dtype, device=target.device).eval()


def load_seeds(cfg: SeedConfig, target) -> list[Seed]:
    """Each seed of `cfg.heads`, loaded and fitted to `target` (ConfigError naming --seed-heads
    when one does not fit or does not exist)."""
    from online_spec.heads import load_draft

    seeds = []
    for name in cfg.names:
        head, _, path = load_draft(name, target, dtype=torch.float32, field="seed-heads")
        check(bool(path), "seed-heads", "day0 is no seed (a random head drafts nothing)")
        label = name if "/" not in name else Path(path).name
        check(label not in {s.label for s in seeds}, "seed-heads", f"two seeds are called {label!r}")
        seeds.append(Seed(label, head.float().cpu(), LiveCounts(eval_copy(head, target), target, cfg.steps)))
    return seeds


def same_weights(a, b) -> bool:
    """Whether two heads (eval copies: the same dtype and device) hold the same weights and map."""
    if not isinstance(a, EagleHead) or not isinstance(b, EagleHead) or a.fc.weight.shape != b.fc.weight.shape:
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class SeedWatch:
    """The recent spans and the seed heads scored on them; see the module docstring."""

    def __init__(self, cfg: SeedConfig, target, seeds: list[Seed] | None = None):
        self.cfg, self.target = cfg, target
        self.seeds = seeds if seeds is not None else load_seeds(cfg, target)
        self._live: LiveCounts | None = None  # the live head's counts at cfg.steps
        self._recent: deque = deque(maxlen=RECENT_SPANS)  # (arrival time, span), oldest first
        self._lock = threading.Lock()
        self._next = 0.0
        self._rows = 0  # generated rows observed so far
        self._dwell_until = 0  # ... before which no check (a head went live)
        self.checks = 0
        self.seconds = 0.0  # spent scoring, all checks
        self.last: dict = {}  # the last check's scores (summary, W&B)

    def __bool__(self) -> bool:
        return bool(self.seeds)

    def observe(self, span, now: float) -> None:
        if self.seeds:
            with self._lock:
                self._recent.append((now, span))
                self._rows += int((~span.is_prefill).sum())

    def due(self, now: float, boosted: bool) -> bool:
        if not self.seeds or now < self._next or self._rows < self._dwell_until:
            return False
        self._next = now + (self.cfg.boost_check_s if boosted else self.cfg.check_s)
        return True

    def wake(self) -> None:
        """A drift alert: the next check is due at once (a head change's dwell still holds)."""
        self._next = 0.0

    def head_changed(self, now: float) -> None:
        """A head went live (a seed adopted, the server's own swap, a rollback): the next check
        comes after `dwell_rows` more generated rows and `min_dwell_s` seconds at the earliest."""
        self._next = max(self._next, now + self.cfg.min_dwell_s)
        with self._lock:
            self._dwell_until = self._rows + self.cfg.dwell_rows

    def window(self, since: float) -> list:
        """The newest spans that arrived at or after `since`, newest first, up to `cfg.rows`
        generated rows (the span that crosses the limit included)."""
        with self._lock:
            recent = list(self._recent)
        out, rows = [], 0
        for t, span in reversed(recent):
            if t < since or rows >= self.cfg.rows:
                break
            out.append(span)
            rows += int((~span.is_prefill).sum())
        return out

    def live_counts(self, live_head) -> LiveCounts:
        """The live head's counts, afresh when the live head is another module."""
        if self._live is None or self._live.head is not live_head:
            self._live = LiveCounts(live_head, self.target, self.cfg.steps)
        return self._live

    def check(self, since: float, live_head) -> SeedPick | None:
        """Score the live head and every seed on `window(since)`; the best seed if it beats the
        live head by the margin on enough anchors, else None."""
        t0 = time.perf_counter()
        try:
            return self._check(self.window(since), live_head)
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self, spans: list, live_head) -> SeedPick | None:
        if not spans:
            return None
        t0 = time.perf_counter()
        k = self.cfg.steps

        def score(counts) -> tuple[float, int]:
            hits, eligible = counts.counts(spans)
            acc = acceptance_from_counts(hits.sum(0), eligible.sum(0), [k])
            return acc["accept_length"][str(k)], acc["anchors"]

        live_score, anchors = score(self.live_counts(live_head))
        if anchors < self.cfg.min_anchors:
            return None
        self.checks += 1
        # a seed that is the live head (the starting head, listed among the seeds) scores as it
        scores = {s.label: live_score if same_weights(s.counts.head, live_head) else score(s.counts)[0]
                  for s in self.seeds}
        self.last = {"live": live_score, "anchors": anchors, "spans": len(spans), **scores,
                     "seconds": time.perf_counter() - t0}
        best = max(self.seeds, key=lambda s: scores[s.label])
        if scores[best.label] < live_score * (1 + self.cfg.margin) or scores[best.label] <= live_score:
            return None
        return SeedPick(best, scores[best.label], live_score, anchors, scores)
