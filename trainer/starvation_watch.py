"""The daemon's side of starvation alerts: when to ask, what it reads, where alerts go.

`StarvationWatch.check` runs the pure detector (`online_spec/starvation.py`) every
`STARVATION_CHECK_S` with the trainer's steps, whether traffic waits in its buffer, and the
capture records dropped on the way (the server publisher's drops via control `info`; without a
server, the gaps the subscriber saw). Each alert goes to the log (with what to do), the trainer's
W&B run and the server (control `trainer_alert`: its /server_info, Prometheus and W&B).

`beside(check)` runs the checks on a thread of their own, every `STARVATION_CHECK_S`: a
starved trainer's own loop may take minutes for one step (at niceness 19 beside a busy process),
and a check between steps would come as late as the steps do.

While it is starved, a `StarvedShare` (`train --nice-starved`, trainer/starved_share.py) given as
`share` lowers the trainer's niceness, and restores it some minutes after.

A trainer stopped by a signal (job control's SIGSTOP, `bench e2e --interleave` pausing it while
other configurations serve) is not starved: the first check after the process is continued starts
a new window (the detector's `restart`), so the stopped time counts neither as steps missed nor as
a verdict. Two signs of a stop, either enough: the SIGCONT handler `follow_stops` installs (Python
runs it in the main thread, which a long torch step holds for seconds to minutes: in an
interleaved e2e run the check came first and raised `trainer_starved` over a 169 s window that
spanned a pause), and the watch thread waking `STOPPED_GAP_CHECKS` periods late (no thread of a
stopped process runs; beside a busy process at niceness 19 the trainer's threads still woke on
time).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from online_spec.alerts import LogAlertSink, WandbAlertSink, fan_out
from online_spec.starvation import STARVED, StarvationConfig, StarvationDetector

log = logging.getLogger("trainer.daemon")

STARVATION_CHECK_S = 5.0  # how often the daemon asks whether it is starved (a control `info` call)
STOPPED_GAP_CHECKS = 4  # a watch thread woken this many periods late was stopped with its process


class StarvationWatch:
    def __init__(self, cfg: StarvationConfig | None, wandb_run=None):
        self.detector = StarvationDetector(cfg or StarvationConfig())
        self.alerts = 0
        self._checked = 0.0
        self.continued = 0  # SIGCONTs seen (`follow_stops`); each restarts the detector's window
        self._restarted = 0
        self._sinks: list = [LogAlertSink(log)] + ([WandbAlertSink(wandb_run)] if wandb_run is not None else [])
        self.share = None  # a `StarvedShare` (train --nice-starved): the niceness it runs at while starved

    def check(self, now: float, steps: int, trainable: bool, publisher, subscriber, head_version: int) -> list:
        """The alerts raised by this check ([] between checks); `publisher`: the daemon's control
        client (or None)."""
        if now - self._checked < STARVATION_CHECK_S:
            return []
        self._checked = now
        if self._restarted != self.continued:
            self._restarted = self.continued
            self.detector.restart()
        alerts = self.detector.update(now, steps, trainable, self.dropped(publisher, subscriber), head_version, time.time())
        if self.share is not None:
            self.share.update(now, STARVED in self.detector.active)
        for alert in alerts:
            self.alerts += 1
            fan_out(alert, self._sinks)
            report = getattr(publisher, "request", None)
            if report is not None:
                try:
                    report("trainer_alert", alert.to_dict())
                except Exception as e:  # noqa: BLE001 - the server may be busy or older; the log has it
                    log.warning("could not report the %s alert to the server: %s", alert.kind, e)
        return alerts

    def report(self) -> dict:
        """The trainer summary's part: alerts raised, the conditions that hold, the starved share's state."""
        return {"starvation_alerts": self.alerts, "starved": self.detector.active,
                "starved_share": self.share.info() if self.share is not None else None}

    def beside(self, check) -> threading.Event:
        """Start a thread calling `check()` every STARVATION_CHECK_S until the returned event is
        set (a failed check is logged; the next one goes on)."""
        stop = threading.Event()

        def run():
            last = time.monotonic()
            while not stop.wait(STARVATION_CHECK_S):
                if time.monotonic() - last > STOPPED_GAP_CHECKS * STARVATION_CHECK_S:
                    self.continued += 1  # its process was stopped meanwhile: as a SIGCONT
                try:
                    check()
                except Exception:  # noqa: BLE001 - a failed check must not end the watch
                    log.exception("starvation check failed")
                last = time.monotonic()
        threading.Thread(target=run, daemon=True, name="starvation-watch").start()
        return stop

    def follow_stops(self) -> bool:
        """Install the SIGCONT handler (the main thread only, where Python runs signal handlers);
        False elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGCONT, self.on_continued)
        return True

    def on_continued(self, signum=None, frame=None) -> None:
        self.continued += 1  # read by the next `check` (a handler does no more than count)

    def dropped(self, publisher, subscriber) -> int:
        """Capture records lost before the trainer stored them: the server publisher's drops
        (control `info`), else the gaps the subscriber saw."""
        info = getattr(publisher, "info", None)
        if info is not None:
            try:
                pub = info().get("capture_publisher") or {}
                return int(pub.get("dropped_hwm", 0)) + int(pub.get("dropped_queue_full", 0))
            except Exception:  # noqa: BLE001 - unreachable now: the stream's own count
                pass
        return int(subscriber.assembler.gaps) if subscriber is not None else 0
