"""Configurations served side by side: the trace in chunks, every configuration serving each chunk in turn.

On a shared 2-core VM the machine's speed drifts 15-40 % over the minutes one configuration after
another takes (`bench e2e`'s machine pulses), so a ratio between two configurations measured
minutes apart holds the machine's state as much as theirs. Here every
configuration's session (server, and trainer where it has one) is up at once; the trace is cut into
chunks of `chunk` requests; each chunk is served by every configuration in turn, the order
reversed every other chunk, while the others are paused (their trainer children stopped with
SIGSTOP, their servers idle without requests). A drift of the machine then weighs on every
configuration alike at the scale of one chunk's turn.

Each session keeps its state across chunks (the trainer's head and buffer, the policies' estimates,
the drift monitor), so online-spec learns from the trace in order as it would alone. Its figures use
a clock that leaves the other configurations' turns out (`ActiveClock`: wall time counted only
inside the session's own active periods), so tokens/s, time to the first swap and the timeline read
as if it had run alone. What differs from a session alone: the clients drain at the end of each
chunk (every configuration alike), and the trainer's own wall clock jumps over its pauses (its
rests and duty cycle see a long idle spell; its starvation watch starts a new window after each
pause, trainer/starvation_watch.py).

    results = serve_interleaved({name: SessionConfig(...)}, target, items, chunk=16, order=[...])
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

from bench.session import Session, SessionConfig, SessionResult
from bench.trace import TraceItem


class ActiveClock:
    """Wall time -> the session's own time: the seconds it spent in active periods before `t`,
    counted from its first period's start (a time before it is kept as it is: the start-up)."""

    def __init__(self, periods: list[list[float]]):
        self.periods = sorted((a, b) for a, b in periods if b >= a)
        self.starts = [a for a, _ in self.periods]
        self.before: list[float] = []  # active seconds before each period
        total = 0.0
        for a, b in self.periods:
            self.before.append(total)
            total += b - a

    def __call__(self, t: float) -> float:
        if not self.periods or t <= self.starts[0]:
            return t
        i = bisect.bisect_right(self.starts, t) - 1  # the last period starting at or before t
        a, b = self.periods[i]
        return self.starts[0] + self.before[i] + min(t - a, b - a)  # inside a pause: that period's end


def rebase(result: SessionResult, clock: Callable[[float], float]) -> SessionResult:
    """Every wall time of `result` through `clock`, in place (requests, rounds, swaps, alerts, the
    trainer watch's events, the policy log, the session's start, serving start and end)."""
    t_serve_wall = result.t_serve
    result.t_serve, result.t1 = clock(result.t_serve), clock(result.t1)
    for r in result.requests:
        r.t_submit = clock(r.t_submit)
        r.t_first = None if r.t_first is None else clock(r.t_first)
        r.t_last = None if r.t_last is None else clock(r.t_last)
    for seq in (result.rounds, result.swaps, result.alerts):
        for e in seq:
            e["t"] = clock(e["t"])
    for e in result.policy_log:
        e["t_s"] = clock(t_serve_wall + e["t_s"]) - result.t_serve
    watch = (result.trainer or {}).get("watch") or {}
    for e in watch.get("events", []):
        e["t_s"] = clock(t_serve_wall + e["t_s"]) - result.t_serve
    return result


def chunks(items: list[TraceItem], size: int) -> list[list[TraceItem]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def serve_interleaved(configs: dict[str, SessionConfig], target, items: list[TraceItem], chunk: int,
                      order: list[str] | None = None, deadline_s: float = 0.0,
                      on_chunk: Callable[[int, int, str, Session, float], None] | None = None,
                      ) -> dict[str, SessionResult]:
    """Serve `items` with every configuration, chunk by chunk (module docstring); returns each
    configuration's result on its own clock. `order`: the first chunk's order (reversed every
    other chunk); `deadline_s` > 0: no chunk starts after this long, so every configuration serves
    the same chunks; `on_chunk(index, of, name, session, seconds)` after each turn (the session paused)."""
    names = list(order or configs)
    parts = chunks(items, max(1, chunk))
    sessions: dict[str, Session] = {}
    try:
        for name in names:  # every session up (the trainers subscribed) before the first chunk
            sessions[name] = Session(target, configs[name], len(items)).start()
            sessions[name].pause()
        t0 = time.monotonic()
        for i, part in enumerate(parts):
            if deadline_s > 0 and i > 0 and time.monotonic() - t0 > deadline_s:
                break
            for name in names if i % 2 == 0 else reversed(names):
                s = sessions[name]
                s.resume()
                ts = time.monotonic()
                try:
                    s.serve(part)
                finally:
                    s.pause()
                if on_chunk is not None:
                    on_chunk(i, len(parts), name, s, time.monotonic() - ts)
    finally:
        for s in sessions.values():
            s.close()
    return {name: rebase(s.result, ActiveClock(s.active)) for name, s in sessions.items()}
