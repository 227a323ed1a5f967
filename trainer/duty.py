"""The trainer's duty cycle: how much of its wall time it spends training, given the server's load.

After a step of `busy` seconds the trainer rests `busy * (1 / duty - 1)`, so training and
evaluation take at most `duty` of its time and the rest of its core or GPU goes to the server
it shares the machine with. The duty is `idle_duty` while the server was last seen idle (no
running and no waiting request: `trainer/server_head.py` reads it), else `max_duty`.
"""

from __future__ import annotations

import threading


class DutyCycle:
    def __init__(self, max_duty: float, idle_duty: float, stop: threading.Event):
        self.max_duty, self.idle_duty, self._stop = max_duty, idle_duty, stop
        self.rested_s = 0.0  # seconds rested so far

    def duty(self, server_idle: bool) -> float:
        return self.idle_duty if server_idle else self.max_duty

    def rest_after(self, busy_s: float, server_idle: bool) -> float:
        """Rest after `busy_s` of training; returns the seconds rested (cut short by stop)."""
        duty = self.duty(server_idle)
        if duty >= 1.0:
            return 0.0
        rest = busy_s * (1.0 / duty - 1.0)
        self.rested_s += rest
        self._stop.wait(rest)
        return rest
