"""The server's head bank: traffic that comes back finds the head that drafted best for it.

One head is live at a time, and the trainer moves it toward whatever traffic it sees now: after
chat -> code, the live head is a code head, and chat traffic that returns meets it. The bank
remembers, per traffic tag, the head version that drafted best on that tag while it was live,
and swaps it back in when that tag's traffic returns.

- Measure (engine thread, a round observer): per head version and tag, the request-rounds with
  K >= 1 and how many had their first draft accepted. The first position's acceptance does not
  depend on the K the controller chose, so versions live at different K compare.
- Keep (the bank's thread): per tag, the version with the best first-draft acceptance over at
  least `min_rounds` request-rounds, its module held while it is best for some tag (at most
  `max_heads` modules; the swapper never reuses a banked module as its spare).
- Route (the bank's thread, every `poll_s`): the tags of the last `window` admitted requests.
  When the tag holding at least `dominance` of them changes from another such tag (traffic
  moved) and that tag's banked head is not live, the bank waits until the live head has drafted
  `min_rounds` request-rounds of it (the trainer's newest head may draft it as well), then swaps
  the banked head in through the swapper, as a control swap would be, if its first-draft
  acceptance there beats the live one's by more than `margin`; at most one such swap every
  `min_dwell_s` and every `dwell_requests` admitted requests (seconds alone count an idle spell
  as dwelt). Only a change of traffic moves the head: the trainer's later versions for the same
  traffic are the gate's business, never undone here. Mixed traffic moves it only where a window
  of it shows a dominant tag and the banked head is measurably better on that tag, once per
  dwell at most.

The trainer follows: it reads the server's live version (control `info`) and continues training
from that head (trainer/server_head.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from online_spec.config import check, doc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BankConfig:
    """When the server swaps a remembered head back in for the traffic it serves now."""

    enabled: bool = doc("keep, per traffic tag, the head version that drafted best on it and swap it back in "
                        "when that tag's traffic returns (needs the control endpoint; untagged traffic is one tag)",
                        True)
    window: int = doc("admitted requests whose tags say which traffic the server serves now (short: a return is "
                      "seen after a few admissions; mixed traffic then often shows a dominant tag, which "
                      "min_dwell_s and margin keep from moving the head back and forth)", 4)
    dominance: float = doc("share of that window one tag must hold before the bank acts for it", 0.75)
    min_rounds: int = doc("request-rounds a version must have drafted on a tag before its acceptance there counts "
                          "(banked, and compared when that traffic returns)", 48)
    margin: float = doc("first-draft acceptance by which the banked head must beat the live one on the tag", 0.05)
    min_z: float = doc("... and by this many standard errors of the difference (binomial, both heads' request-rounds "
                       "on the tag): until then the bank waits for more of the live head's rounds, up to 4 x "
                       "min_rounds, then keeps it; 0 = the margin alone (48 request-rounds, what one client drafts "
                       "in under a second on a GPU, measure a rate to +-7 %)", 2.0)
    min_dwell_s: float = doc("seconds between two swaps the bank makes", 30.0)
    dwell_requests: int = doc("requests admitted between two swaps the bank makes, as well: mixed traffic moves "
                              "the head at most once per so many of its requests, on a CPU or a GPU and through "
                              "idle spells (which min_dwell_s alone counts as dwelt)", 32)
    max_heads: int = doc("head modules the bank holds in memory at most (one per tag it remembers)", 4)
    poll_s: float = doc("seconds between the bank's looks at the admitted tags", 0.1)

    def __post_init__(self):
        check(self.window >= 1, "window", f"must be >= 1, got {self.window}")
        check(0.5 < self.dominance <= 1.0, "dominance", f"must be in (0.5, 1], got {self.dominance}")
        check(self.min_rounds >= 1, "min_rounds", f"must be >= 1, got {self.min_rounds}")
        check(0.0 <= self.margin < 1.0, "margin", f"must be in [0, 1), got {self.margin}")
        check(self.min_z >= 0.0, "min_z", f"must be >= 0, got {self.min_z}")
        check(self.min_dwell_s >= 0.0, "min_dwell_s", f"must be >= 0, got {self.min_dwell_s}")
        check(self.dwell_requests >= 0, "dwell_requests", f"must be >= 0, got {self.dwell_requests}")
        check(self.max_heads >= 1, "max_heads", f"must be >= 1, got {self.max_heads}")
        check(self.poll_s > 0.0, "poll_s", f"must be > 0, got {self.poll_s}")


class Swapper(Protocol):
    """What the bank needs of `serving.swap.HeadSwapper`."""

    live: object  # a HeadVersion: .head, .version, .digest, .source

    def swap_banked(self, banked) -> dict: ...


class HeadBank:
    def __init__(self, cfg: BankConfig, swapper: Swapper):
        self.cfg, self.swapper = cfg, swapper
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str], list[int]] = {}  # (version, tag) -> [request-rounds, first-draft hits]
        self._kept: dict[int, object] = {}  # version -> HeadVersion held for some tag
        self._best: dict[str, int] = {}  # tag -> version
        self._admitted: deque[str] = deque(maxlen=cfg.window)
        self._serving: str | None = None  # the last dominant tag the bank has acted on
        self._last_swap_t = -float("inf")
        # requests admitted; their count at the bank's last swap (as if a dwell ago: the first swap waits for none)
        self._admissions, self._last_swap_n = 0, -cfg.dwell_requests
        self.swaps: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- inputs (other threads) -------------------------------------------------------------
    def admitted(self, tag: str) -> None:
        """A request of traffic `tag` was admitted (event-loop thread)."""
        self._admitted.append(tag)
        self._admissions += 1

    def observe(self, stats, outs, tags: list[str]) -> None:
        """One round (engine thread, `SpecServer.round_observers`)."""
        if stats.num_steps <= 0 or not stats.accepted:
            return
        with self._lock:
            for a, tag in zip(stats.accepted, tags):
                c = self._counts.get((stats.head_version, tag))
                if c is None:
                    c = self._counts[(stats.head_version, tag)] = [0, 0]
                c[0] += 1
                c[1] += a > 0

    def holds(self, head) -> bool:
        """Whether `head` (a module) is banked: the swapper must not reuse it as its spare."""
        with self._lock:
            return any(hv.head is head for hv in self._kept.values())

    # -- the bank's thread ------------------------------------------------------------------
    def start(self) -> "HeadBank":
        self._thread = threading.Thread(target=self._run, name="head-bank", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            try:
                self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - serving goes on with the head it has
                log.exception("head bank: step failed; serving keeps its live head")

    def rate(self, version: int, tag: str) -> float | None:
        """First-draft acceptance of `version` on `tag`, None below `min_rounds` request-rounds."""
        with self._lock:
            c = self._counts.get((version, tag))
        return c[1] / c[0] if c is not None and c[0] >= self.cfg.min_rounds else None

    def rounds(self, version: int, tag: str) -> int:
        with self._lock:
            c = self._counts.get((version, tag))
        return 0 if c is None else c[0]

    def z(self, a: int, b: int, tag: str) -> float:
        """Standard errors by which version a's first-draft acceptance on `tag` exceeds b's
        (each rate's variance from (hits + 1) / (rounds + 2), never zero)."""
        with self._lock:
            (na, ha), (nb, hb) = self._counts.get((a, tag), (0, 0)), self._counts.get((b, tag), (0, 0))
        if not na or not nb:
            return 0.0
        pa, pb = (ha + 1) / (na + 2), (hb + 1) / (nb + 2)
        se = (pa * (1 - pa) / na + pb * (1 - pb) / nb) ** 0.5
        return (ha / na - hb / nb) / se

    def dominant(self) -> str | None:
        """The tag holding at least `dominance` of a full window of admitted requests, or None."""
        tags = list(self._admitted)
        if len(tags) < self.cfg.window:
            return None
        top = max(set(tags), key=tags.count)
        return top if tags.count(top) >= self.cfg.dominance * len(tags) else None

    def step(self, now: float) -> dict | None:
        """Bank the live head where it is best, then swap in the dominant tag's head if it pays;
        returns the swap made, if any."""
        live = self.swapper.live
        self._remember(live)
        tag = self.dominant()
        if tag is None or tag == self._serving or now - self._last_swap_t < self.cfg.min_dwell_s or \
                self._admissions - self._last_swap_n < self.cfg.dwell_requests:
            return None  # no change of traffic (or too soon after the last swap: decided later)
        if self._serving is None:
            self._serving = tag  # the traffic the server started with: nothing moved the head away from it
            return None
        best = self._best.get(tag)
        best_rate = None if best is None else self.rate(best, tag)
        if best_rate is None or best == live.version or live.head is None:
            self._serving = tag  # nothing banked for this traffic: the live head (the trainer's) serves it
            return None
        live_rate = self.rate(live.version, tag)
        if live_rate is None:
            return None  # decided once the live head has drafted enough of it: its newest head may do as well
        if best_rate > live_rate + self.cfg.margin and self.z(best, live.version, tag) < self.cfg.min_z \
                and self.rounds(live.version, tag) < 4 * self.cfg.min_rounds:
            return None  # better by the margin but not yet significantly: more of the live head's rounds
        self._serving = tag
        if best_rate <= live_rate + self.cfg.margin or self.z(best, live.version, tag) < self.cfg.min_z:
            return None
        with self._lock:
            banked = self._kept[best]
        record = {"tag": tag, "from": live.version, "to": best, "rate_banked": best_rate, "rate_live": live_rate,
                  "time": time.time()}
        self.swaps.append(record)  # before the swap lands: a round observer that sees it can tell it is ours
        try:
            out = self.swapper.swap_banked(banked)
        except Exception:
            self.swaps.remove(record)
            raise
        self._last_swap_t, self._last_swap_n = now, self._admissions
        log.info("head bank: %s traffic is back: v%d (first-draft acceptance %.3f there) replaces v%d (%s)", tag,
                 best, best_rate, live.version, "never measured there" if live_rate is None else f"{live_rate:.3f}")
        return {**record, **out}

    def _remember(self, live) -> None:
        """Make the live version the banked one of every tag it now drafts best on."""
        if live.head is None:
            return
        with self._lock:
            tags = {t for (v, t) in self._counts if v == live.version}
        for tag in tags:
            rate = self.rate(live.version, tag)
            best = self._best.get(tag)
            if rate is None or best == live.version:
                continue
            best_rate = None if best is None else self.rate(best, tag)
            if best_rate is not None and rate <= best_rate:
                continue
            with self._lock:
                self._best[tag] = live.version
                self._kept[live.version] = live
        with self._lock:
            self._prune(live.version)

    def _prune(self, live_version: int) -> None:
        """Drop modules no tag points at (beyond `max_heads`, the oldest banked version goes
        first), and the counts of versions that can no longer be banked: neither banked, nor
        live, nor newer than the live one (still to come)."""
        wanted = set(self._best.values())
        while len(wanted) > self.cfg.max_heads:
            oldest = min(wanted)
            self._best = {t: v for t, v in self._best.items() if v != oldest}
            wanted.discard(oldest)
        self._kept = {v: hv for v, hv in self._kept.items() if v in wanted}
        self._counts = {(v, t): c for (v, t), c in self._counts.items()
                        if v in wanted or v >= live_version}

    def info(self) -> dict:
        with self._lock:
            best = dict(self._best)
            counts = {f"v{v}/{t or 'untagged'}": c[:] for (v, t), c in self._counts.items() if v in best.values()}
        return {"enabled": True, "dominant_tag": self.dominant(), "serving_tag": self._serving,
                "banked": {t: {"version": v, "first_draft_acceptance": self.rate(v, t)} for t, v in best.items()},
                "counts": counts, "swaps": len(self.swaps), "last_swap": self.swaps[-1] if self.swaps else None}
