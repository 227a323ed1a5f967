"""The trainer's duty cycle: how much of its wall time it spends training, given the server's load.

After a step of `busy` seconds the trainer rests `busy * (1 / duty - 1)`, so training and
evaluation take at most `duty` of its time and the rest of its core or GPU goes to the server
it shares the machine with. The duty is `idle_duty` while the server was last seen idle (no
running and no waiting request: `trainer/server_head.py` reads it), else `max_duty`.

Futility: while the server was last seen serving and the gate refused the candidate at
`futile_evals` evaluations in a row (the live head is as good as what training makes of today's
traffic), the duty is `max_duty * futile_scale`: a trainer with nothing to win stops taking the
server's core or GPU time. It trains at the full duty again at the gate's next publish, or on a
wake (`wake`: a drift alert, a head the daemon adopted or rolled back, a seed). Steps taken at
the futile duty are chosen rest, not starvation (`resting`).

The serving budget (`trainer/slack.py`): while the server serves, the duty is at most what the
server's measured slowdown during the trainer's busy spells allows (`SlackGovernor.cap`); `spell`
runs a busy spell between the governor's two reads of the server's round clock.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from trainer.slack import SlackGovernor

log = logging.getLogger("trainer.daemon")  # the daemon's log: where an operator reads its rests


class ServerLoad(Protocol):
    """What the last read of the server's load found (`trainer.server_head.ServerHeadWatch`)."""

    idle: bool  # no running and no waiting request
    busy: bool  # requests running or waiting (neither: unknown)


class DutyCycle:
    def __init__(self, max_duty: float, idle_duty: float, stop: threading.Event, load: ServerLoad,
                 futile_evals: int = 0, futile_scale: float = 1.0, read_clock: Callable[[], dict] | None = None,
                 serving_budget: float = 0.0):
        self.max_duty, self.idle_duty, self._stop, self.load = max_duty, idle_duty, stop, load
        self.governor = SlackGovernor(read_clock, serving_budget)  # the serving budget (trainer/slack.py)
        self.futile_evals, self.futile_scale = futile_evals, futile_scale
        self.refused = 0  # gate evaluations in a row that refused the candidate (since a publish or a wake)
        self.rested_s = 0.0  # seconds rested so far
        self.futile_rested_s = 0.0  # ... of them at the futile duty
        self.futile_spells = 0  # times the futile duty began

    @property
    def futile(self) -> bool:
        return self.futile_evals > 0 and self.refused >= self.futile_evals

    def gate(self, published: bool) -> None:
        """The gate's verdict on the candidate at an evaluation."""
        self.refused = 0 if published else self.refused + 1
        if self.futile and self.refused == self.futile_evals:
            self.futile_spells += 1
            log.info("%d candidates refused in a row: futile, training at --futile-scale of the duty while the "
                     "server serves", self.refused)

    def wake(self) -> None:
        """Something changed what training can win (drift, a new live head): the full duty again."""
        self.refused = 0

    def resting(self) -> bool:
        """Whether the duty now is the futile one (the server serving): fewer steps by choice."""
        return not self.load.idle and self.load.busy and self.futile and self.futile_scale < 1.0

    def duty(self) -> float:
        if self.load.idle:
            return self.idle_duty
        duty = self.max_duty * self.futile_scale if self.resting() else self.max_duty
        cap = self.governor.cap()
        return duty if cap is None else min(duty, cap)

    def spell(self, work: Callable[[], bool]) -> bool:
        """Run one busy spell (`work` -> whether it trained) between the serving budget's reads."""
        self.governor.begin()
        trained = False
        try:
            trained = work()
        finally:
            self.governor.end(trained)
        return trained

    @staticmethod
    def rest_at(busy_s: float, duty: float) -> float:
        return 0.0 if duty >= 1.0 else busy_s * (1.0 / duty - 1.0)

    def rest_for(self, busy_s: float) -> float:
        """The rest due after `busy_s` of training (counted as rested)."""
        rest = self.rest_at(busy_s, self.duty())
        if rest <= 0:
            return 0.0
        self.rested_s += rest
        if self.resting():
            self.futile_rested_s += rest
        return rest

    def summary(self) -> dict:
        """Rests at the futile duty: seconds, spells begun, refused verdicts in a row now."""
        return {"rested_s": round(self.futile_rested_s, 3), "spells": self.futile_spells,
                "refused_in_a_row": self.refused}

    def report(self) -> dict:
        """What the daemon's summary and state.json say of its rests: all of them, the futile ones,
        the serving budget."""
        return {"rested_s": round(self.rested_s, 3), "futile": self.summary(), "serving_budget": self.governor.summary()}

    def rest_after(self, busy_s: float) -> float:
        """Rest after `busy_s` of training; returns the seconds rested (cut short by stop)."""
        rest = self.rest_for(busy_s)
        if rest > 0:
            self._stop.wait(rest)
        return rest
