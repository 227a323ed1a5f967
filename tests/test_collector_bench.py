"""The collector bench end to end through the command line, on a tiny configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from online_spec.cli import main
from online_spec.config import ConfigError


def test_bench_collector_writes_its_figures(tmp_path: Path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "collector", "--quick", "--hidden-size", "16", "--batch-size", "8",
               "--burst-records", "64", "--stall-rounds", "4", "--round-ms", "0",
               "--serving-batches", "[2]", "--serving-tokens", "4", "--serving-repeats", "2", "--serving-waves", "1",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["config"]["burst_records"] == 64
    assert res["throughput_records_received"] == res["throughput_records_sent"] == 64
    assert res["throughput_malformed"] == 0
    assert res["records_per_s_max"] > 0 and res["mb_per_s_max"] > 0
    stalled = res["stalled_publisher_stats"]
    assert stalled["submitted"] == 4 * 8 == stalled["sent"] + res["dropped_when_subscriber_stalled"]
    assert res["decode_stall_ms_max_when_subscriber_stalled"] >= res["submit_ms_p50_when_subscriber_stalled"] > 0
    over = res["serving_overhead"]["2"]  # the real engine, capture on vs off
    assert over["tokens_per_s_capture_off"] > 0 and over["tokens_per_s_capture_on"] > 0
    # paired repeats: one ratio per repeat, the figure their median
    ratios = [on / off for off, on in zip(over["tokens_per_s_off_runs"], over["tokens_per_s_on_runs"])]
    assert len(ratios) == 2 and over["capture_ratios"] == [round(r, 4) for r in ratios]
    assert abs(over["capture_ratio"] - sum(ratios) / 2) < 1e-9
    assert abs(res["serving_overhead_pct"]["2"] - 100 * (1 - over["capture_ratio"])) < 1e-9
    assert over["publisher_stats"]["sent"] > 0 and over["subscriber_received"]["records"] > 0
    assert over["subscriber_received"]["malformed"] == 0
    # the reader's CPU while connected over each capture-on arm's wall, one share per repeat
    assert len(over["reader_cpu_shares"]) == 2 and over["subscriber_received"]["cpu_s"] > 0
    assert over["reader_cpu_share"] == sum(over["reader_cpu_shares"]) / 2 or \
        abs(over["reader_cpu_share"] - sum(over["reader_cpu_shares"]) / 2) < 1e-3


def test_the_serving_overhead_with_a_bare_socket_reader(tmp_path: Path):
    """--serving-reader socket: a reader that receives every frame and decodes nothing, so the
    overhead is the serving process's side alone; every message the publisher sent arrives."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "collector", "--quick", "--hidden-size", "16", "--batch-size", "8",
               "--burst-records", "64", "--stall-rounds", "4", "--round-ms", "0",
               "--serving-batches", "[2]", "--serving-tokens", "4", "--serving-repeats", "1", "--serving-waves", "1",
               "--serving-reader", "socket", "--serving-reader-nice", "19", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    over = res["serving_overhead"]["2"]
    # the reader ran at the niceness asked for (the trainer's deployed --nice 19)
    assert res["config"]["serving_reader_nice"] == 19 and over["subscriber_received"]["nice"] == 19
    assert over["subscriber_received"]["messages"] > 0
    # every message sent arrives (a round message carries a round's records: fewer messages than records)
    assert over["subscriber_received"]["messages"] >= over["publisher_stats"]["messages_sent"] > 0
    assert over["publisher_stats"]["messages_sent"] < over["publisher_stats"]["sent"]
    with pytest.raises(ConfigError, match="serving_reader"):
        main(["bench", "collector", "--serving-reader", "pickle", "--json", str(out)])
    with pytest.raises(ConfigError, match="serving_reader_nice"):
        main(["bench", "collector", "--serving-reader-nice", "20", "--json", str(out)])


@pytest.mark.parametrize("sink", ["null", "wait", "encode", "busy"])
def test_the_serving_overhead_split_by_its_sink(tmp_path: Path, sink):
    """--serving-sink null: the 'on' arm stages every round's rows and drops them (no publisher,
    no reader); wait / encode: a thread takes each round, waits on it / builds and encodes its
    messages, every round taken before the arm ends; busy: the 'on' arm captures nothing and runs
    beside a busy process. All pair the arms as the publisher's run does."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "collector", "--quick", "--hidden-size", "16", "--batch-size", "8",
               "--burst-records", "64", "--stall-rounds", "4", "--round-ms", "0",
               "--serving-batches", "[2]", "--serving-tokens", "4", "--serving-repeats", "2", "--serving-waves", "1",
               "--serving-sink", sink, "--json", str(out)])
    assert rc == 0
    over = json.loads(out.read_text())["serving_overhead"]["2"]
    assert len(over["tokens_per_s_on_runs"]) == len(over["tokens_per_s_off_runs"]) == len(over["capture_ratios"]) == 2
    assert over["publisher_stats"]["sink"] == sink and over["subscriber_received"] is None
    if sink in ("null", "wait", "encode"):
        assert over["publisher_stats"]["rounds"] > 0 and over["publisher_stats"]["records"] > 0
    if sink in ("wait", "encode"):
        assert over["publisher_stats"]["taken"] == over["publisher_stats"]["rounds"]
        assert (over["publisher_stats"]["bytes_encoded"] > 0) == (sink == "encode")
        assert over["publisher_stats"]["errors"] == 0
    if sink == "busy":
        assert over["publisher_stats"]["neighbours"] == 1
    with pytest.raises(ConfigError, match="serving_sink"):
        main(["bench", "collector", "--serving-sink", "nowhere", "--json", str(out)])
