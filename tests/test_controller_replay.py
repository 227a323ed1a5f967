"""`online-spec controller replay` end to end through `online_spec.cli.main`, and TraceRecorder."""

from __future__ import annotations

import io
import json
import random
import re

import pytest

from online_spec.cli import main
from online_spec.controller import EmaTierPolicy, adaptive_config_path, load_adaptive_config
from online_spec.controller.replay import TraceRecorder, read_trace, replay_trace
from sglang_adaptive_ref import load_sglang_adaptive

SGL, SGL_VERSION = load_sglang_adaptive()


def make_trace(path, rounds=400, seed=5):
    """Batch sizes across the default config's slots; acceptance high, then low, then high."""
    rng = random.Random(seed)
    rows = []
    for n in range(rounds):
        p = 0.9 if n < 150 or n >= 300 else 0.1
        b = rng.choice([1, 2, 5, 9, 20, 40, 70])
        rows.append({"batch_size": b, "accepted": [sum(1 for _ in range(7) if rng.random() < p) for _ in range(b)]})
    with TraceRecorder.open(path) as rec:
        for row in rows:
            rec.record(row["batch_size"], row["accepted"], num_steps=None)
    return rows


def read_steps(text):
    return [json.loads(line)["steps"] for line in text.splitlines()]


def test_replay_to_file_matches_the_policy(tmp_path):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.jsonl"
    rows = make_trace(trace)
    cfg = adaptive_config_path("sglang_default")
    assert main(["controller", "replay", "--config", str(cfg), "--initial-steps", "3",
                 "--trace", str(trace), "--out", str(out)]) == 0
    got = read_steps(out.read_text())
    policy = EmaTierPolicy(load_adaptive_config(cfg), initial_steps=3)
    assert got == [policy.update(r["batch_size"], r["accepted"]) for r in rows]
    assert len(set(got)) >= 3  # the trace moved K around, so the comparison means something


@pytest.mark.parametrize("preset, initial", [("sglang_default", 3), ("aggressive", 7), ("aggressive", 1)])
def test_replay_matches_sglang(tmp_path, capsys, preset, initial):
    trace = tmp_path / "trace.jsonl"
    rows = make_trace(trace, seed=initial)
    cfg = adaptive_config_path(preset)
    assert main(["controller", "replay", "--config", str(cfg), "--initial-steps", str(initial),
                 "--trace", str(trace)]) == 0
    theirs = SGL.AdaptiveSpeculativeParams(initial_steps=initial, cfg_path=str(cfg))
    expected = []
    for r in rows:
        theirs.on_verify_complete(r["accepted"], r["batch_size"])
        expected.append(theirs.get_steps_for_batch(r["batch_size"]))
    assert read_steps(capsys.readouterr().out) == expected


def test_defaults_are_sglangs(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = make_trace(trace, rounds=100)
    assert main(["controller", "replay", "--trace", str(trace)]) == 0
    policy = EmaTierPolicy(load_adaptive_config(adaptive_config_path("sglang_default")), initial_steps=3)
    assert read_steps(capsys.readouterr().out) == [policy.update(r["batch_size"], r["accepted"]) for r in rows]


def test_blank_lines_and_extra_keys_are_skipped(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [1], "num_steps": 3}\n\n{"batch_size": 2, "accepted": [0, 0]}\n')
    assert main(["controller", "replay", "--trace", str(trace)]) == 0
    assert read_steps(capsys.readouterr().out) == [3, 3]


@pytest.mark.parametrize("line, message", [
    ('{"batch_size": 0, "accepted": [1]}', r"t\.jsonl:2: batch_size: must be an int >= 1"),
    ('{"batch_size": 2, "accepted": [1, -1]}', r"t\.jsonl:2: accepted: must be a list of non-negative ints"),
    ('{"batch_size": 2}', r"t\.jsonl:2: accepted"),
    ('[1, 2]', r"t\.jsonl:2: must be a JSON object"),
    ('{"batch_size": 2,', r"t\.jsonl:2: not valid JSON"),
])
def test_bad_trace_line_is_named(tmp_path, capsys, line, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [1]}\n' + line + "\n")
    assert main(["controller", "replay", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("online-spec controller replay: error:")
    assert re.search(message, err), err


@pytest.mark.parametrize("args, message", [
    ([], "trace: is required"),
    (["--initial-steps", "2"], "initial_steps: must be one of the adaptive config's candidate steps"),
    (["--config", "{bad}"], r'bad\.json: slots\["8"\]\.candidate_steps: is required'),
    (["--trace", "{missing}"], "missing.jsonl: No such file"),
])
def test_argument_errors_are_named(tmp_path, capsys, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": {"candidate_steps": [1]}, "8": {}}')
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [1]}\n')
    args = [a.format(bad=bad, missing=tmp_path / "missing.jsonl") for a in args]
    if "--trace" not in args and args != []:
        args += ["--trace", str(trace)]
    assert main(["controller", "replay", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_recorder_lines_read_back():
    buf = io.StringIO()
    rec = TraceRecorder(buf)
    rec.record(4, [1, 0, 2, 3], num_steps=3, ctx_len=None, draft_s=0.01)
    rec.record(1, [])
    rec.close()
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines[0] == {"batch_size": 4, "accepted": [1, 0, 2, 3], "num_steps": 3, "draft_s": 0.01}
    assert list(read_trace(buf.getvalue().splitlines())) == [(4, [1, 0, 2, 3]), (1, [])]
    assert rec.rounds == 2


def test_replay_trace_is_the_policy_update():
    cfg = load_adaptive_config(adaptive_config_path("aggressive"))
    rounds = [(1, [3]), (9, [1, 1]), (70, [0] * 3)] * 20
    a, b = EmaTierPolicy(cfg, 3), EmaTierPolicy(cfg, 3)
    assert list(replay_trace(a, rounds)) == [b.update(bs, acc) for bs, acc in rounds]
