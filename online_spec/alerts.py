"""Alert sinks: where a `DriftAlert` from `online_spec.drift` goes.

A sink is anything with `emit(alert) -> None` (the `AlertSink` protocol). `fan_out(alert, sinks)`
hands one alert to every sink; a sink that raises is logged and skipped, so a broken sink never
stops the others or the serving loop.

- `WandbAlertSink(run)`: `run.alert(title, text, level=wandb.AlertLevel...)` and, because an
  alert is not part of the run's history (offline, wandb 0.31 writes it as a separate `alert`
  record that only `wandb sync` replays; other versions may drop it), the same event logged
  into the history under `alert/*` (`alert/kind`, `alert/level`,
  `alert/slot`, `alert/tag`, `alert/before`, `alert/after`, `alert/head_version`,
  `alert/round`, `alert/time`, `alert/title`, `alert/text`, `alert/count`).
- `LogAlertSink(logger)`: Python logging, the level following the alert's.
- `PrometheusAlertSink(registry)`: counter `online_spec_drift_alerts_total{kind,slot,tag}`.
- `CallbackAlertSink(fn)`: calls `fn(alert)`, e.g. the trainer daemon's `on_drift`.

`read_alerts_from_offline_run(run_dir)` reads the `alert/*` rows back from an offline run's
files (see `online_spec.wandb_run.iter_run_records`), e.g. for tests and post-mortems.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Optional, Protocol

from online_spec.drift import DriftAlert
from online_spec.wandb_run import iter_run_records, wait_for_run_exit

log = logging.getLogger(__name__)

_LOG_LEVELS = {"info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


class AlertSink(Protocol):
    def emit(self, alert: DriftAlert) -> None: ...


def fan_out(alert: DriftAlert, sinks: Iterable[AlertSink]) -> int:
    """Give `alert` to every sink; returns how many took it without raising."""
    ok = 0
    for sink in sinks:
        try:
            sink.emit(alert)
            ok += 1
        except Exception:  # noqa: BLE001 - one broken sink must not silence the rest
            log.exception("alert sink %s failed on %s alert", type(sink).__name__, alert.kind)
    return ok


def _finite_or_none(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None  # NaN (no reference yet) is not valid JSON


class WandbAlertSink:
    """W&B alert plus an `alert/*` history row; W&B failures are logged, never raised."""

    def __init__(self, run: Any, wait_duration_s: float = 60.0):
        self.run = run
        self.wait_duration_s = wait_duration_s
        self.count = 0

    def emit(self, alert: DriftAlert) -> None:
        if self.run is None:
            return
        self.count += 1
        try:
            import wandb

            level = {"info": wandb.AlertLevel.INFO, "warn": wandb.AlertLevel.WARN,
                     "error": wandb.AlertLevel.ERROR}[alert.level]
            self.run.alert(title=alert.title, text=alert.text, level=level,
                           wait_duration=self.wait_duration_s)
        except Exception:  # noqa: BLE001 - serving goes on without W&B
            log.exception("wandb alert failed")
        try:
            row = {f"alert/{k}": v for k, v in alert.to_dict().items()}
            row["alert/before"] = _finite_or_none(alert.before)
            row["alert/after"] = _finite_or_none(alert.after)
            row["alert/count"] = self.count
            self.run.log(row)
        except Exception:  # noqa: BLE001
            log.exception("wandb log of alert failed")


class LogAlertSink:
    """One log line per alert, at the alert's level."""

    def __init__(self, logger: Optional[logging.Logger] = None):
        self.logger = logger or log

    def emit(self, alert: DriftAlert) -> None:
        self.logger.log(_LOG_LEVELS[alert.level], "[drift %s] %s", alert.kind, alert.text)


class PrometheusAlertSink:
    """Counter `online_spec_drift_alerts_total{kind,slot,tag}`; create one per registry."""

    def __init__(self, registry: Any = None):
        from prometheus_client import REGISTRY, Counter

        self.counter = Counter("online_spec_drift_alerts_total", "Drift alerts raised by the monitor.",
                               ["kind", "slot", "tag"], registry=REGISTRY if registry is None else registry)

    def emit(self, alert: DriftAlert) -> None:
        self.counter.labels(kind=alert.kind, slot=str(alert.slot), tag=alert.tag).inc()


class CallbackAlertSink:
    """Calls `fn(alert)`, e.g. `TrainerDaemon.on_drift`."""

    def __init__(self, fn: Callable[[DriftAlert], None]):
        self.fn = fn

    def emit(self, alert: DriftAlert) -> None:
        self.fn(alert)


def read_alerts_from_offline_run(run_dir: str | os.PathLike, wait_s: float = 0.0) -> list[dict]:
    """The `alert/*` history rows of an offline run, in order, keys without the prefix plus `_step`.

    `wait_s`: how long to wait for the run file to be complete (its exit record written); a run
    still going, or not complete in time, gives the rows written so far.
    """
    if wait_s > 0:
        wait_for_run_exit(run_dir, wait_s)
    alerts = []
    for record in iter_run_records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        step = None
        for item in record.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            if key == "_step":
                step = json.loads(item.value_json)
            elif key.startswith("alert/"):
                row[key[len("alert/"):]] = json.loads(item.value_json)
        if row:
            row["_step"] = step
            alerts.append(row)
    return alerts
