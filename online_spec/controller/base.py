"""The `StepPolicy` protocol every step controller implements, and its decision-cost probe.

The engine holds one policy and, per round, calls `steps_for(batch_size, ctx_len)` before
drafting and `update(batch_size, accepted, num_steps=..., ...)` after verify; on a head swap
it calls `rewarm()`. `info()` feeds logs and the control endpoint; `state_dict()` is stored with
the run. `measure_decision_cost_us` times one round of those calls for the benchmarks.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class StepPolicy(Protocol):
    """Chooses K (draft steps) per round from what past rounds showed. No I/O, no torch."""

    def steps_for(self, batch_size: int, ctx_len: int = 0) -> int:
        """K for the next round of a batch of `batch_size` requests of mean context `ctx_len`."""

    def update(self, batch_size: int, accepted: Sequence[int], *,
               num_steps: int | Sequence[int] | None = None, ctx_len: int = 0,
               draft_s: float | None = None, verify_s: float | None = None,
               confidences: Sequence[Sequence[float]] | None = None) -> int:
        """Feed one verify round (accepted drafts per request, bonus excluded); returns the next K."""

    def rewarm(self) -> None:
        """A new head went live: relearn its acceptance from scratch."""

    def info(self) -> dict:
        """A JSON-safe summary per batch-size slot."""

    def state_dict(self) -> dict:
        """JSON-safe state to store with the run."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


def measure_decision_cost_us(policy: StepPolicy, n: int = 2000, batch_size: int = 8,
                             ctx_len: int = 512) -> float:
    """Median microseconds of one round's policy work (steps_for + update), on a copy of `policy`.

    Acceptance follows a fixed pattern (request r accepts r mod (K+1) drafts) so runs compare.
    """
    policy = copy.deepcopy(policy)
    patterns: dict[int, list[int]] = {}
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        k = policy.steps_for(batch_size, ctx_len)
        accepted = patterns.get(k)
        if accepted is None:
            accepted = patterns[k] = [r % (k + 1) for r in range(batch_size)]
        policy.update(batch_size, accepted, num_steps=k, ctx_len=ctx_len)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000.0
