"""Alert sinks: a real offline W&B run read back from its files, Prometheus parsed back, logging,
callbacks, and failures that must not reach the serving loop."""

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from online_spec.alerts import (CallbackAlertSink, LogAlertSink, PrometheusAlertSink, WandbAlertSink,
                                fan_out, read_alerts_from_offline_run)
from online_spec.drift import DriftAlert
from online_spec.wandb_run import init_wandb, iter_run_records, wait_for_run_exit


def make_alert(kind="drop", level="warn", slot=4, tag="code", before=2.6, after=1.6, round_=700):
    return DriftAlert(kind=kind, level=level, slot=slot, tag=tag, before=before, after=after,
                      head_version=3, round=round_, time=1000.0 + round_, title=f"online-spec: {kind}",
                      text=f"{kind} on slot {slot}")


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_wandb_sink_alerts_are_read_back_from_the_offline_run(offline_env):
    run = init_wandb("online-spec-test", None, offline_env / "wandb-runs", config={"k": 5})
    assert run is not None
    sink = WandbAlertSink(run)
    run.log({"train/loss": 1.0})  # other history rows are not alerts
    assert fan_out(make_alert(), [sink]) == 1
    assert fan_out(make_alert(kind="collapse", level="error", slot=1, tag="", before=float("nan"),
                              after=0.0, round_=900), [sink]) == 1
    run_dir = run.settings.sync_dir
    run.finish()

    alerts = read_alerts_from_offline_run(run_dir, wait_s=30.0)  # finish() may return before the write
    assert [(a["kind"], a["level"], a["slot"], a["tag"], a["count"]) for a in alerts] == [
        ("drop", "warn", 4, "code", 1), ("collapse", "error", 1, "", 2)]
    assert alerts[0]["before"] == 2.6 and alerts[0]["after"] == 1.6 and alerts[0]["round"] == 700
    assert alerts[0]["head_version"] == 3 and alerts[0]["text"] == "drop on slot 4"
    assert alerts[1]["before"] is None  # NaN (no reference yet) is logged as null
    assert alerts[0]["_step"] < alerts[1]["_step"]
    # wandb 0.31 also keeps the alerts themselves, as records apart from the history
    titles = [r.alert.title for r in iter_run_records(run_dir) if r.WhichOneof("record_type") == "alert"]
    assert titles == ["online-spec: drop", "online-spec: collapse"]
    # the parent directory works too, when it holds a single run
    assert read_alerts_from_offline_run(offline_env / "wandb-runs") == alerts


def test_reader_reassembles_records_split_across_blocks(offline_env):
    run = init_wandb("online-spec-test", None, offline_env, config=None)
    long_text = "x" * 70_000  # > two 32 KiB blocks: first, middle and last chunks
    WandbAlertSink(run).emit(make_alert())
    run.log({"alert/kind": "drop", "alert/text": long_text})
    run_dir = run.settings.sync_dir
    run.finish()
    alerts = read_alerts_from_offline_run(run_dir, wait_s=30.0)
    assert [len(a["text"]) for a in alerts] == [len("drop on slot 4"), 70_000]
    kinds = {r.WhichOneof("record_type") for r in iter_run_records(run_dir)}
    assert {"run", "history", "exit"} <= kinds


def test_reader_refuses_a_corrupt_or_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_alerts_from_offline_run(tmp_path)
    assert wait_for_run_exit(tmp_path, timeout_s=0.1) is False
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"not a run file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        read_alerts_from_offline_run(tmp_path)


class BrokenRun:
    """A run whose every call fails, as when W&B's service has died."""

    def alert(self, **kw):
        raise RuntimeError("wandb service gone")

    def log(self, row):
        raise RuntimeError("wandb service gone")


def test_wandb_failure_is_logged_not_raised(caplog):
    sink = WandbAlertSink(BrokenRun())
    with caplog.at_level(logging.ERROR, logger="online_spec.alerts"):
        sink.emit(make_alert())
    messages = [r.getMessage() for r in caplog.records]
    assert "wandb alert failed" in messages and "wandb log of alert failed" in messages
    WandbAlertSink(None).emit(make_alert())  # no run (init_wandb returned None): a no-op


def test_init_wandb_returns_none_on_failure(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="online_spec.wandb_run"):
        run = init_wandb("p", None, tmp_path, mode="no-such-mode")
    assert run is None
    assert any("W&B logging is off" in r.getMessage() for r in caplog.records)


def test_prometheus_counter_parsed_back():
    registry = CollectorRegistry()
    sink = PrometheusAlertSink(registry)
    for alert in (make_alert(), make_alert(), make_alert(kind="collapse", level="error", slot=1, tag="")):
        sink.emit(alert)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    samples = {(s.labels["kind"], s.labels["slot"], s.labels["tag"]): s.value
               for s in families["online_spec_drift_alerts"].samples if s.name.endswith("_total")}
    assert samples == {("drop", "4", "code"): 2.0, ("collapse", "1", ""): 1.0}


def test_log_sink_uses_the_alert_level(caplog):
    logger = logging.getLogger("test.drift")
    with caplog.at_level(logging.INFO, logger="test.drift"):
        LogAlertSink(logger).emit(make_alert())
        LogAlertSink(logger).emit(make_alert(kind="rise", level="info"))
        LogAlertSink(logger).emit(make_alert(kind="collapse", level="error"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.ERROR]
    assert caplog.records[0].getMessage() == "[drift drop] drop on slot 4"


def test_fan_out_skips_a_failing_sink_and_reaches_the_rest(caplog):
    seen = []

    def boom(alert):
        raise RuntimeError("sink down")

    sinks = [CallbackAlertSink(boom), CallbackAlertSink(seen.append)]
    with caplog.at_level(logging.ERROR, logger="online_spec.alerts"):
        assert fan_out(make_alert(), sinks) == 1
    assert [a.kind for a in seen] == ["drop"]
    assert "CallbackAlertSink failed" in caplog.records[0].getMessage()
