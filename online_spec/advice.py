"""Operator warnings that say what happened, what it costs and what to do: rate-limited and counted.

A warning that repeats (a slow subscriber, every round) would bury the log; one that says only
what happened leaves the operator guessing. `warn` logs "WHAT. Cost: COST. To do: FIX" the first
time a kind fires and then at most once every `every_s` seconds per kind, with how many were held
back; every call is counted, whether logged or not. `counts()` gives the counts per kind;
`WarningsCollector` puts them on a Prometheus registry as `online_spec_warnings_total{kind}`
(the server's `/metrics` registers one).

    warn(log, "trace_chat_short", "only 639 held-out ShareGPT chat conversations fit",
         cost="the chat phase gets 339 lines instead of 600", fix="nothing at the default --minutes")
"""

from __future__ import annotations

import logging
import threading
import time

EVERY_S = 60.0  # the least time between two log lines of one kind

_lock = threading.Lock()
_counts: dict[str, int] = {}
_last_logged: dict[str, tuple[float, int]] = {}  # kind -> (when, count at that time)


def warn(log: logging.Logger, kind: str, what: str, cost: str, fix: str, every_s: float = EVERY_S) -> bool:
    """Count a warning of `kind`; log it (with what it costs and what to do) unless one of the
    same kind was logged less than `every_s` seconds ago. Returns whether it was logged."""
    now = time.monotonic()
    with _lock:
        n = _counts[kind] = _counts.get(kind, 0) + 1
        last = _last_logged.get(kind)
        if last is not None and now - last[0] < every_s:
            return False
        _last_logged[kind] = (now, n)
    held = n - last[1] - 1 if last is not None else 0
    more = f" ({held} more since the last such warning, {n} in all)" if held > 0 else ""
    log.warning("%s. Cost: %s. To do: %s.%s", what.rstrip("."), cost.rstrip("."), fix.rstrip("."), more)
    return True


def counts() -> dict[str, int]:
    """Warnings raised in this process, by kind (logged or held back)."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Forget counts and rate limits (tests)."""
    with _lock:
        _counts.clear()
        _last_logged.clear()


class WarningsCollector:
    """Prometheus collector of `counts()`: register on a registry, read at scrape time."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("online_spec_warnings", "operator warnings raised (logged or held back "
                                     "by the rate limit), by kind", labels=["kind"])
        for kind, n in sorted(counts().items()):
            family.add_metric([kind], float(n))
        yield family
