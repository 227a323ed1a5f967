"""The trainer's CPU share while it is starved: its niceness lowered from `--nice` to `--nice-starved`.

At niceness 19 the trainer takes what the server leaves, which on an idle core is everything and
beside other busy work almost nothing: next to one niceness-0 busy process on 2 cores, the demo's
trainer made 2 optimizer steps in 10 minutes and swapped nothing (docs/trainer.md, "Starvation"). While
the starvation watch holds `trainer_starved` (trainer/starvation_watch.py), `StarvedShare` runs
every thread of the trainer process and of its children at `starved` (a niceness, above the one
the process started with, as `--nice` is) instead: a share the kernel's scheduler keeps for it
against niceness-0 work (CFS weights: 1024 at 0, 335 at 5, 110 at 10, 15 at 19). The share holds
until `hold_s` (`HOLD_S`, 300 s for `train --nice-starved`) after the condition ended, then the
trainer goes back to `base`: a trainer that steps again at the lower niceness is no longer
starved, and returning at once would starve it again a window later.

Lowering a niceness needs CAP_SYS_NICE or a high enough RLIMIT_NICE (`ulimit -e`): without it the
share says so once in the log and in `info()`, and the alert stands alone.

    share = StarvedShare(base=19, starved=5, hold_s=300.0)
    share.update(time.monotonic(), starved=True)     # each starvation check
"""

from __future__ import annotations

import logging
import os

from online_spec.cpu_reserve import threads

log = logging.getLogger("trainer.daemon")

HOLD_S = 300.0  # seconds the lower niceness holds after the starvation ended


def set_niceness(pid: int, value: int) -> int:
    """Every thread of `pid` and of the processes below it (`cpu_reserve.threads`) at niceness
    `value`; the threads set. PermissionError where lowering is not allowed (the first thread
    refused stops it)."""
    done = 0
    for tid in threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            continue  # gone meanwhile
        done += 1
    return done


class StarvedShare:
    """See the module docstring. `base`, `starved`: niceness above the process's own at start."""

    def __init__(self, base: int, starved: int, hold_s: float = HOLD_S, pid: int | None = None):
        if not (0 <= starved <= 19 and 0 <= base <= 19):
            raise ValueError(f"niceness must be in 0..19, got base {base}, starved {starved}")
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.pid = os.getpid() if pid is None else pid
        self.origin = os.getpriority(os.PRIO_PROCESS, self.pid) - base  # the niceness before --nice
        self.base, self.starved, self.hold_s = base, starved, hold_s
        self.lowered = False
        self.times_lowered = 0
        self.refused: str | None = None
        self._ended: float | None = None  # when the condition last ended while lowered

    def update(self, now: float, starved: bool) -> None:
        """One starvation check: lower the niceness when starved, restore it `hold_s` after not."""
        if starved:
            self._ended = None
            if not self.lowered and self.refused is None and self.starved < self.base:
                self._set(self.starved)
        elif self.lowered:
            if self._ended is None:
                self._ended = now
            elif now - self._ended >= self.hold_s:
                self._set(self.base)

    def _niceness(self, nice: int) -> int:
        return min(19, self.origin + nice)

    def _set(self, nice: int) -> None:
        value = self._niceness(nice)
        try:
            done = set_niceness(self.pid, value)
        except PermissionError as e:
            self.refused = f"{e.strerror or e} (lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE, `ulimit -e`)"
            log.warning("starved, but the trainer could not lower its niceness to %d: %s", value, self.refused)
            return
        self.lowered = nice == self.starved
        self._ended = None
        if self.lowered:
            self.times_lowered += 1
            log.warning("starved: the trainer runs at niceness %d (%d threads) until %.0f s after it is not",
                        value, done, self.hold_s)
        else:
            log.info("no longer starved for %.0f s: the trainer is back at niceness %d (%d threads)",
                     self.hold_s, value, done)

    def info(self) -> dict:
        return {"niceness": self._niceness(self.starved if self.lowered else self.base),
                "lowered": self.lowered, "times_lowered": self.times_lowered, "refused": self.refused}
