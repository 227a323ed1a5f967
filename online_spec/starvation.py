"""Trainer starvation: a pure detector of a trainer that cannot keep up with its traffic.

In, per check (`update`): the time, the trainer's optimizer steps so far, whether it had traffic
waiting to be trained on (its buffer at the minimum it trains from), and the capture records
dropped so far on the way to it (the server's publisher: send HWM, full queue). Out: alerts, as
`DriftAlert`s so that every alert sink takes them (log, W&B, Prometheus, the server's
`/server_info`), of two kinds of their own:

  trainer_starved   fewer than `min_steps_per_min` optimizer steps a minute over the last
                    `window_s`, in which it had traffic to train on at every check
  capture_dropping  at least `min_dropped` capture records dropped within the last `window_s`

Each is raised when its condition starts and again every `repeat_s` while it lasts; a window
without the condition ends it. No verdict before `window_s` of checks (start-up).

    det = StarvationDetector(StarvationConfig())
    for alert in det.update(time.monotonic(), steps, trainable, dropped, wall_time=time.time()): ...
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from online_spec.config import check, doc
from online_spec.drift import DriftAlert

STARVED, DROPPING = "trainer_starved", "capture_dropping"
KINDS = (STARVED, DROPPING)


@dataclass
class StarvationConfig:
    window_s: float = doc("seconds over which steps and dropped records are counted", 60.0)
    min_steps_per_min: float = doc("fewer optimizer steps a minute than this, while traffic waits to be trained on, "
                                   "is starvation", 6.0)
    min_dropped: int = doc("capture records dropped within the window that raise capture_dropping", 1)
    repeat_s: float = doc("seconds between the alerts of a condition that lasts", 600.0)

    def __post_init__(self):
        check(self.window_s > 0, "window_s", f"must be > 0, got {self.window_s}")
        check(self.min_steps_per_min >= 0, "min_steps_per_min", f"must be >= 0, got {self.min_steps_per_min}")
        check(self.min_dropped >= 1, "min_dropped", f"must be >= 1, got {self.min_dropped}")
        check(self.repeat_s > 0, "repeat_s", f"must be > 0, got {self.repeat_s}")


class StarvationDetector:
    """See the module docstring. `update` takes monotonic time `t` (seconds) and cumulative counts."""

    def __init__(self, cfg: StarvationConfig):
        self.cfg = cfg
        self._checks: deque[tuple[float, int, bool, int]] = deque()  # (t, steps, trainable, dropped)
        self._raised: dict[str, float] = {}  # kind -> t of its last alert, while the condition lasts
        self.checks = 0

    def update(self, t: float, steps: int, trainable: bool, dropped: int, head_version: int = 0,
               wall_time: float = 0.0) -> list[DriftAlert]:
        self.checks += 1
        self._checks.append((t, int(steps), bool(trainable), int(dropped)))
        # keep the newest check at or before the window's start: the base the window is counted from
        while len(self._checks) > 1 and self._checks[1][0] <= t - self.cfg.window_s:
            self._checks.popleft()
        base = self._checks[0]
        if t - base[0] < self.cfg.window_s:
            return []  # less than a window of checks so far
        span = t - base[0]
        rate = (steps - base[1]) * 60.0 / span
        dropped_now = dropped - base[3]
        starved = all(c[2] for c in self._checks) and rate < self.cfg.min_steps_per_min
        out = []
        for kind, on, before, after, title, text in (
                (STARVED, starved, self.cfg.min_steps_per_min, rate,
                 "online-spec: the trainer is starved",
                 f"the trainer made {steps - base[1]} optimizer steps in the last {span:.0f} s ({rate:.1f} a minute, "
                 f"fewer than {self.cfg.min_steps_per_min:g}) while traffic waited to be trained on: heads adapt "
                 f"late or not at all. Give it a CPU core or GPU time of its own (train --threads, --device, "
                 f"--max-duty; serve --threads), or let it run at a lower niceness (train --nice, --nice-starved)"),
                (DROPPING, dropped_now >= self.cfg.min_dropped, float(self.cfg.min_dropped), float(dropped_now),
                 "online-spec: capture records are dropped",
                 f"{dropped_now} capture records were dropped in the last {span:.0f} s before the trainer read "
                 f"them: it learns from less traffic than serving sees. Give the trainer more CPU/GPU, or capture "
                 f"less (serve --capture-sample-fraction)")):
            if not on:
                self._raised.pop(kind, None)
                continue
            last = self._raised.get(kind)
            if last is not None and t - last < self.cfg.repeat_s:
                continue
            self._raised[kind] = t
            out.append(DriftAlert(kind=kind, level="warn", slot=0, tag="", before=float(before), after=float(after),
                                  head_version=int(head_version), round=self.checks, time=wall_time,
                                  title=title, text=text))
        return out

    def restart(self) -> None:
        """A new window from the next check (the process was stopped: no steps could be made);
        the conditions raised stay until a whole window says otherwise."""
        self._checks.clear()

    @property
    def active(self) -> list[str]:
        """The conditions that hold now (raised, not yet ended)."""
        return sorted(self._raised)
