"""online_spec.advice: warnings say what they cost and what to do, once per interval, and are counted."""

import logging

from prometheus_client import CollectorRegistry, generate_latest

from online_spec import advice

log = logging.getLogger("tests.advice")


def test_warn_says_cost_and_fix_rate_limited_and_counted(caplog, monkeypatch):
    advice.reset()
    clock = [100.0]
    monkeypatch.setattr(advice.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="tests.advice"):
        assert advice.warn(log, "slow", "the trainer is slow", cost="fewer rows", fix="capture less", every_s=60)
        for _ in range(4):  # within the interval: counted, not logged
            clock[0] += 10
            assert not advice.warn(log, "slow", "the trainer is slow", cost="fewer rows", fix="capture less",
                                   every_s=60)
        clock[0] += 30  # 70 s after the first line
        assert advice.warn(log, "slow", "the trainer is slow", cost="fewer rows", fix="capture less", every_s=60)
        assert advice.warn(log, "other", "something else", cost="c", fix="f", every_s=60)  # its own limit
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "the trainer is slow. Cost: fewer rows. To do: capture less."
    assert lines[1] == "the trainer is slow. Cost: fewer rows. To do: capture less. (4 more since the last such " \
                       "warning, 6 in all)"
    assert len(lines) == 3 and advice.counts() == {"slow": 6, "other": 1}


def test_counts_reach_a_prometheus_registry():
    advice.reset()
    advice.warn(log, "trace_chat_short", "x", cost="y", fix="z")
    advice.warn(log, "trace_chat_short", "x", cost="y", fix="z")
    registry = CollectorRegistry()
    registry.register(advice.WarningsCollector())
    text = generate_latest(registry).decode()
    assert 'online_spec_warnings_total{kind="trace_chat_short"} 2.0' in text


def test_the_servers_metrics_count_the_warnings():
    """`/metrics` (ServerMetrics' registry) carries online_spec_warnings_total{kind}."""
    from serving.metrics import ServerMetrics

    advice.reset()
    metrics = ServerMetrics(max_steps=3)
    advice.warn(log, "capture_hwm", "dropping records", cost="fewer rows", fix="capture less")
    text = metrics.render()
    text = text.decode() if isinstance(text, bytes) else text
    assert 'online_spec_warnings_total{kind="capture_hwm"} 1.0' in text
