"""`online-spec drift replay` end to end through `online_spec.cli.main`: recorded rounds through
the drift monitor offline, the same alerts as the detector fed live, clear errors on bad traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from online_spec.cli import main
from online_spec.controller.replay import TraceRecorder
from online_spec.drift import DriftConfig, DriftDetector, RoundObservation

K = 5


def write_trace(path, seed=0, before=0.75, after=0.35, rounds=(900, 400), batch=4, life=30):
    """Rounds of `batch` requests that live `life` rounds each, acceptance alpha = before then after,
    as the drift bench records them; returns the rows."""
    rng = np.random.default_rng(seed)
    rows, serial = [], 0
    ids = [f"r{i}" for i in range(batch)]
    for phase, (alpha, n) in enumerate(zip((before, after), rounds)):
        for i in range(n):
            acc = np.cumprod(rng.random((batch, K)) < alpha, axis=1).sum(axis=1)
            rows.append({"batch_size": batch, "accepted": [int(a) for a in acc], "num_steps": K,
                         "request_ids": list(ids), "head_version": 0, "phase": ("stationary", "switched")[phase]})
            for j in range(batch):
                if (i + j * life // batch) % life == life - 1:
                    serial += 1
                    ids[j] = f"s{serial}"
    with TraceRecorder.open(path) as rec:
        for r in rows:
            rec.record(r["batch_size"], r["accepted"], **{k: v for k, v in r.items() if k not in ("batch_size", "accepted")})
    return rows


def live_alerts(rows, cfg):
    det, out, index = DriftDetector(cfg), [], 0
    for r in rows:
        obs = RoundObservation(slot=r["batch_size"], tag="", accept_len=sum(r["accepted"]) / len(r["accepted"]),
                               num_steps=K, head_version=0, timestamp=float(index), num_requests=len(r["accepted"]),
                               request_ids=tuple(r["request_ids"]), accepted=tuple(r["accepted"]))
        out += [(index, a.kind) for a in det.update(obs)]
        index += 1
    return out


def test_replay_raises_the_alerts_of_the_live_detector(tmp_path, capsys):
    trace, out, summary = tmp_path / "rounds.jsonl", tmp_path / "alerts.jsonl", tmp_path / "summary.json"
    rows = write_trace(trace)
    cfg = DriftConfig()
    assert main(["drift", "replay", "--trace", str(trace), "--out", str(out), "--json", str(summary)]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    expected = live_alerts(rows, cfg)
    assert [(a["round_index"], a["kind"]) for a in got] == expected
    assert any(kind == "drop" for _, kind in expected)  # the trace has a change to find
    s = json.loads(summary.read_text())
    first_drop = next(i for i, kind in expected if kind == "drop")
    assert s["phases"]["stationary"] == {"rounds": 900, "alerts": sum(i < 900 for i, _ in expected),
                                         "alerts_by_kind": s["phases"]["stationary"]["alerts_by_kind"],
                                         "rounds_to_drop": None}
    assert s["phases"]["switched"]["rounds_to_drop"] == first_drop - 900 + 1
    assert s["rounds"] == 1300 and s["drift_config"]["threshold"] == cfg.threshold
    assert "1300 rounds" in capsys.readouterr().err


def test_replay_settings_change_the_verdict(tmp_path, capsys):
    """The point of the tool: a higher threshold finds the same drop later (or not at all)."""
    trace = tmp_path / "rounds.jsonl"
    write_trace(trace)

    def first_drop(*opts):
        assert main(["drift", "replay", "--trace", str(trace), *opts]) == 0
        alerts = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        return next((a["round_index"] for a in alerts if a["kind"] == "drop"), 10**9)

    assert first_drop() < first_drop("--drift-threshold", "40")


@pytest.mark.parametrize("line, message", [
    ('{"batch_size": 2, "accepted": [1, 2]}', "num_steps"),
    ('{"batch_size": 2, "accepted": [1, 7], "num_steps": 5}', "more than num_steps"),
    ('{"batch_size": 2, "accepted": [1, 2], "num_steps": 5, "request_ids": ["a"]}', "request_ids"),
    ('{"batch_size": 2, "accepted": [1, 2], "num_steps": 5, "tags": [1, 2]}', "tags"),
    ('{"batch_size": 2, "accepted": [1, 2], "num_steps": 5, "tags": ["chat", "*"]}', "all-traffic stream"),
    ('{"batch_size": 2, "accepted": [1, 2], "num_steps": 5, "phase": 3}', "phase"),
    ('{"batch_size": 0, "accepted": [], "num_steps": 5}', "batch_size"),
    ('not json', "not valid JSON"),
])
def test_bad_trace_line_is_named(tmp_path, capsys, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [1], "num_steps": 5}\n' + line + "\n")
    assert main(["drift", "replay", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2" in err and message in err


def test_missing_trace_and_bad_settings_are_clear(tmp_path, capsys):
    assert main(["drift", "replay", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [1], "num_steps": 5}\n')
    assert main(["drift", "replay", "--trace", str(trace), "--drift-threshold", "0"]) == 2
    assert "threshold" in capsys.readouterr().err
    fake = tmp_path / "t.jsonl.gz"
    fake.write_text('{"batch_size": 1}\n')  # not gzip
    assert main(["drift", "replay", "--trace", str(fake)]) == 2
    assert "gzip" in capsys.readouterr().err.lower()
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    assert main(["drift", "replay", "--trace", str(binary)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
