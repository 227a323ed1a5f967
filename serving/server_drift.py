"""Drift wiring for the server: per-round observations into `DriftDetector`, alerts out to sinks.

In: every verify round (`observe(stats, outputs, tags)`, a `SpecServer.round_observers` entry,
on the engine thread). Per round and per traffic tag present in it, one `RoundObservation`:
slot = the round's batch size, the tag, the mean accept_len (bonus excluded) of that tag's
requests, K, the head version that drafted, the time, the requests' ids and counts, the round's
decode tokens/s and — where `plain_round_s` predicts a plain decode round (the server passes the
cost-model policy's round-time model, calibrated on this engine and refined from its rounds) —
plain decoding's tokens/s at the same batch and context, which the "losing" rule compares.
Rounds with K = 0 carry no acceptance and are skipped. Out: each alert
goes to every sink through `online_spec.alerts.fan_out` (log, Prometheus on the server's
registry, W&B when a run is given, any callbacks) and into a short list `/server_info` shows.

    drift = ServerDrift(DriftConfig(), registry=server.metrics.registry, wandb_run=run)
    server.round_observers.append(drift.observe)
    drift.sinks.append(CallbackAlertSink(daemon.on_drift))
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable

from online_spec.alerts import AlertSink, CallbackAlertSink, LogAlertSink, PrometheusAlertSink, WandbAlertSink, fan_out
from online_spec.drift import DriftAlert, DriftConfig, DriftDetector, round_observations
from serving.requests import RequestOutput, RoundStats

__all__ = ["ServerDrift", "CallbackAlertSink"]

log = logging.getLogger(__name__)


def _json_safe(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


class ServerDrift:
    def __init__(self, cfg: DriftConfig, registry=None, wandb_run=None, keep_alerts: int = 50,
                 plain_round_s: Callable[[int, int], float | None] | None = None):
        self.detector = DriftDetector(cfg)
        self.plain_round_s = plain_round_s  # (batch, ctx) -> seconds of a plain decode round, or None
        self.sinks: list[AlertSink] = [LogAlertSink()]
        if registry is not None:
            self.sinks.append(PrometheusAlertSink(registry))
        if wandb_run is not None:
            self.sinks.append(WandbAlertSink(wandb_run))
        self.wandb_run = wandb_run
        self.recent: deque[dict] = deque(maxlen=keep_alerts)
        self.alerts_total = 0
        self._lock = threading.Lock()

    def observe(self, stats: RoundStats, outs: list[RequestOutput], tags: list[str]) -> list[DriftAlert]:
        """Feed one round (engine thread); returns the alerts it raised (already fanned out)."""
        spec, plain = self.speeds(stats)
        raised = []
        for obs in round_observations(stats.batch_size, stats.num_steps, stats.accepted, tags,
                                      [out.request_id for out in outs], stats.head_version, time.time(), spec, plain):
            with self._lock:
                alerts = self.detector.update(obs)
            for alert in alerts:
                fan_out(alert, self.sinks)
                self.recent.append(_json_safe(alert.to_dict()))
                self.alerts_total += 1
            raised.extend(alerts)
        return raised

    def emit(self, alert: DriftAlert) -> None:
        """An alert raised outside the detector (e.g. a head fault) to the same sinks and list."""
        fan_out(alert, self.sinks)
        with self._lock:
            self.recent.append(_json_safe(alert.to_dict()))
            self.alerts_total += 1

    def speeds(self, stats: RoundStats) -> tuple[float | None, float | None]:
        """(speculative, plain) decode tokens/s of the round: committed tokens over its draft and
        verify seconds (admission's prefill left out: plain decoding pays it too), and the batch
        over a plain decode round's predicted seconds (None where nothing predicts it)."""
        busy = stats.draft_s + stats.verify_s
        spec = stats.committed / busy if busy > 0 else None
        t = self.plain_round_s(stats.batch_size, stats.ctx_len) if self.plain_round_s is not None else None
        return spec, (stats.batch_size / t if t is not None and t > 0 else None)

    def info(self) -> dict:
        return {"alerts_total": self.alerts_total, "recent_alerts": list(self.recent)[-10:]}

    def close(self) -> None:
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception:  # noqa: BLE001 - closing must not fail the server's shutdown
                log.exception("wandb run.finish() failed")
