"""The serving budget: the trainer's duty capped by what its steps cost the server it shares a device with.

A trainer beside the server slows the server's rounds while it steps. How much depends on the
device and the load, and a fixed `--max-duty` cannot know it: on an H200 at 4 clients a colocated
trainer at `--max-duty 0.25` cost the server 5-16 % of its tokens/s (2026-12-04, four runs), at 1
client nothing. Two processes' CUDA contexts time-slice the GPU, so a low-priority stream in the
trainer's process would not reach the server's kernels; what the trainer controls is when it runs.

`SlackGovernor` measures the cost and sets the duty from it. The server counts its steady rounds
per shape (batch size, tokens verified per request, tree branching) and their seconds (control
`round_clock`, cumulative, `ServerMetrics.round_clock`). The governor reads that clock when the
trainer's busy spell begins and when it ends (`begin`, `end`), so every interval between two reads
is either busy (the trainer stepping or evaluating) or at rest. Per shape, the rounds' mean
seconds in the last `window` busy intervals against the last `window` rest intervals give the
slowdown s (a mean over the shapes the busy rounds ran, weighted by their count; shapes with
fewer than `min_rounds` rounds on either side are left out). A round in a busy spell takes 1 + s
times its rest time, so a duty d costs the server about d * s / (1 + s) of its tokens/s, and the
governor keeps that within `budget`: the duty cap is budget * (1 + s) / s, at least `min_duty`
(the trainer is never shut out; the starvation alert says when that is too few steps) and at
most `max_duty` (0.75) however little the trainer costs: rests must go on and be long enough
that the round straddling a spell's end (counted in the rest after it) is a small part of them,
or the comparison drifts to "no cost" and holds there (on 2 CPU cores a governor that had capped
at 1.0 let the trainer cost the server 14 % unseen, its rests a round or two long, 2026-12-04).
Until it has an estimate it caps the duty at `probe_duty`, so that rests exist to compare with; a
server that idles gives no rounds and no estimate (the daemon's idle duty applies then anyway).

A server without the command (an older one) turns the governor off, said once in the log; a read
that fails drops the interval it would have closed.

    gov = SlackGovernor(client.round_clock, budget=0.03)
    gov.begin(); ...a step...; gov.end(trained=True)
    cap = gov.cap()        # None: off (no budget, or no clock); probe_duty before an estimate
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger("trainer.daemon")  # the daemon's log: where an operator reads its rests

Cell = tuple[int, int, int]


def clock_cells(answer) -> dict[Cell, tuple[int, float]]:
    """A `round_clock` answer -> {shape: (rounds, seconds)}; ValueError on anything malformed."""
    cells = answer.get("cells") if isinstance(answer, dict) else None
    if not isinstance(cells, list):
        raise ValueError(f"round_clock: no list of cells in {answer!r:.200}")
    out: dict[Cell, tuple[int, float]] = {}
    for c in cells:
        if not (isinstance(c, list) and len(c) == 5 and all(type(x) is int for x in c[:4])
                and isinstance(c[4], (int, float)) and c[3] >= 0 and c[4] >= 0):
            raise ValueError(f"round_clock: malformed cell {c!r:.200}")
        out[(c[0], c[1], c[2])] = (c[3], float(c[4]))
    return out


def slowdown(busy: dict[Cell, list], rest: dict[Cell, list], min_rounds: int) -> tuple[float, int] | None:
    """(s, busy rounds weighed) from per-shape [rounds, seconds] totals of busy and rest
    intervals: the busy rounds' mean seconds over the rest rounds' of the same shape, minus one,
    weighted by the busy rounds; None where no shape has `min_rounds` rounds on both sides."""
    total = weight = 0
    for key, (n_b, s_b) in busy.items():
        r = rest.get(key)
        if r is None or n_b < min_rounds or r[0] < min_rounds or r[1] <= 0:
            continue
        total += n_b * (s_b / n_b) / (r[1] / r[0])
        weight += n_b
    return None if weight == 0 else (total / weight - 1.0, weight)


class SlackGovernor:
    def __init__(self, read_clock: Callable[[], dict] | None, budget: float, min_duty: float = 0.02,
                 probe_duty: float = 0.5, max_duty: float = 0.75, window: int = 16, min_rounds: int = 8,
                 idle_read_s: float = 1.0):
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"serving budget: must be in [0, 1), got {budget!r}")
        self.read_clock = read_clock if budget > 0 else None
        self.budget, self.min_duty, self.probe_duty, self.max_duty = budget, min_duty, probe_duty, max_duty
        self.min_rounds, self.idle_read_s = min_rounds, idle_read_s
        self._idle = self._skipped = False  # the last spell trained nothing; this spell's start was not read
        self._read_t = 0.0  # time.monotonic() of the last read
        self._busy: deque[dict[Cell, tuple[int, float]]] = deque(maxlen=window)  # per interval: shape deltas
        self._rest: deque[dict[Cell, tuple[int, float]]] = deque(maxlen=window)
        self._last: dict[Cell, tuple[int, float]] | None = None  # the last reading
        self.reads = self.failed_reads = 0
        # why the governor does nothing ("" = on)
        self.off = "no budget" if budget <= 0 else "no round clock to read" if read_clock is None else ""
        self._estimate: tuple[float, int] | None = None
        self._lock = threading.Lock()  # the daemon's thread marks; a status thread may read

    @property
    def on(self) -> bool:
        return not self.off

    def begin(self) -> None:
        """The trainer's busy spell begins: the interval since the last reading was rest. After a
        spell that trained nothing (no traffic to train on), spells within `idle_read_s` of the
        last reading read nothing (a trainer waiting for traffic would ask every --idle-sleep-s)."""
        self._skipped = self._idle and time.monotonic() - self._read_t < self.idle_read_s
        if not self._skipped:
            self._mark(busy_was=False)

    def end(self, trained: bool) -> None:
        """The busy spell ends; `trained`: it stepped (else the interval counts as rest). A spell
        whose start was not read and that trained starts a new baseline (its interval mixes rest
        and busy rounds, so it is dropped)."""
        self._idle = not trained
        if self._skipped:
            if trained:
                self._last = None
                self._mark(busy_was=True)
            return
        self._mark(busy_was=trained)

    def _mark(self, busy_was: bool) -> None:
        if not self.on:
            return
        self._read_t = time.monotonic()
        try:
            now = clock_cells(self.read_clock())
        except Exception as e:  # noqa: BLE001 - the server's answer decides; serving goes on either way
            self.failed_reads += 1
            if "unknown command" in str(e):
                self.off = "the server has no round_clock"
                log.warning("serving budget off: the server does not report its round times (%s)", e)
            else:
                log.debug("round_clock read failed: %s", e)
            self._last = None  # the interval it would close is dropped
            return
        self.reads += 1
        last, self._last = self._last, now
        if last is None:
            return
        delta = {}
        for key, (n, s) in now.items():
            n0, s0 = last.get(key, (0, 0.0))
            if n > n0:
                delta[key] = (n - n0, max(0.0, s - s0))
        if delta:
            with self._lock:
                (self._busy if busy_was else self._rest).append(delta)
                self._estimate = None

    def estimate(self) -> tuple[float, int] | None:
        """(slowdown s, busy rounds it rests on), or None with too few rounds on either side."""
        with self._lock:
            return self._estimated()

    def _estimated(self) -> tuple[float, int] | None:
        if self._estimate is None and self._busy and self._rest:
            busy: dict[Cell, list] = {}
            rest: dict[Cell, list] = {}
            for intervals, into in ((self._busy, busy), (self._rest, rest)):
                for d in intervals:
                    for key, (n, s) in d.items():
                        acc = into.setdefault(key, [0, 0.0])
                        acc[0] += n
                        acc[1] += s
            self._estimate = slowdown(busy, rest, self.min_rounds)
        return self._estimate

    def cap(self) -> float | None:
        """The duty the budget allows now: budget * (1 + s) / s (at least min_duty, at most
        max_duty, where the trainer costs nothing measurable), probe_duty before an estimate;
        None when off."""
        if not self.on:
            return None
        est = self.estimate()
        if est is None:
            return self.probe_duty
        s = est[0]
        return self.max_duty if s <= 0 else max(self.min_duty, min(self.max_duty, self.budget * (1.0 + s) / s))

    def summary(self) -> dict:
        est = self.estimate() if self.on else None
        return {"budget": self.budget, "off": self.off or None,
                "slowdown": None if est is None else round(est[0], 4),
                "busy_rounds": None if est is None else est[1],
                "duty_cap": None if not self.on else round(self.cap(), 4),
                "reads": self.reads, "failed_reads": self.failed_reads}
