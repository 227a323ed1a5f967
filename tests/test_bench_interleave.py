"""Configurations side by side (bench/interleave.py): the clock that leaves the others' turns out,
the rebasing of a session's times, and real sessions (the real model, a real trainer child)
serving a trace chunk by chunk in turn."""

import json

import pytest

from bench.interleave import ActiveClock, chunks, rebase, serve_interleaved
from bench.report import session_figures
from bench.session import SessionConfig, SessionResult
from bench.trace import load_trace
from bench.traffic import RequestResult

from tests.test_demo import TINY, write_trace


def test_active_clock_counts_only_the_sessions_own_periods():
    clock = ActiveClock([[20.0, 25.0], [10.0, 12.0], [30.0, 31.0]])  # in any order
    assert clock(5.0) == 5.0  # before the first period (start-up): as it is
    assert clock(10.0) == 10.0 and clock(11.0) == 11.0 and clock(12.0) == 12.0
    assert clock(15.0) == 12.0 and clock(20.0) == 12.0  # paused: the end of the period before
    assert clock(22.0) == 14.0 and clock(25.0) == 17.0
    assert clock(30.5) == pytest.approx(17.5) and clock(99.0) == 18.0  # after the last: its end
    assert ActiveClock([])(7.0) == 7.0


def test_rebase_moves_every_time_of_a_session():
    r = SessionResult("s", t0=0.0, t1=40.0, t_serve=10.0)
    r.requests = [RequestResult(0, "chat", "chat", "a", t_submit=10.5, t_first=11.0, t_last=21.0, completion_tokens=4),
                  RequestResult(1, "chat", "chat", "b", t_submit=21.0, t_first=None, t_last=None, error="x")]
    r.rounds = [{"t": 11.5}, {"t": 22.0}]
    r.swaps, r.alerts = [{"t": 23.0}], [{"t": 24.0}]
    r.policy_log = [{"t_s": 12.0}]  # wall 22.0
    r.trainer = {"watch": {"events": [{"t_s": 14.0}]}}  # wall 24.0
    rebase(r, ActiveClock([[10.0, 12.0], [20.0, 25.0]]))
    assert (r.t0, r.t_serve, r.t1) == (0.0, 10.0, 17.0)
    assert (r.requests[0].t_submit, r.requests[0].t_first, r.requests[0].t_last) == (10.5, 11.0, 13.0)
    assert r.requests[1].t_submit == 13.0 and r.requests[1].t_first is None
    assert [x["t"] for x in r.rounds] == [11.5, 14.0] and r.swaps[0]["t"] == 15.0 and r.alerts[0]["t"] == 16.0
    assert r.policy_log[0]["t_s"] == 4.0 and r.trainer["watch"]["events"][0]["t_s"] == 6.0


def test_chunks_cut_the_trace_in_order():
    assert chunks(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunks([], 3) == []


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_sessions_serve_the_trace_chunk_by_chunk_in_turn(smol, tmp_path):
    """Three real sessions (plain; the shipped head at K = 2; the same online, its trainer child
    beside it) serve a 6-line trace 2 lines a turn: the turns alternate their order, only one
    session serves at a time, the online session's trainer is stopped while the others serve and
    exits cleanly at the end, and each session's figures count only its own turns."""
    items = load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    common = dict(max_tokens=4, concurrency=2, progress_every_s=0, trainer_args=["--min-buffer-tokens", "10"])
    configs = {"plain": SessionConfig(name="plain", run_dir=str(tmp_path / "plain"), head="none", num_steps=0, **common),
               "static": SessionConfig(name="static", run_dir=str(tmp_path / "static"), num_steps=2, **common),
               "online": SessionConfig(name="online", run_dir=str(tmp_path / "online"), num_steps=2, online=True,
                                       **common)}
    from bench.heads import resolve_head
    head = resolve_head("shipped", smol, 0)
    for c in ("static", "online"):
        configs[c].head = head
    turns, trainer_states = [], []

    def on_chunk(i, of, name, session, seconds):
        turns.append((i, name))
        assert of == 3 and seconds > 0
        online = sessions_seen.get("online")
        if online is not None and online.trainer is not None:
            trainer_states.append((name, _state(online.trainer.pid)))
        sessions_seen[name] = session

    sessions_seen: dict = {}
    results = serve_interleaved(configs, smol, items, 2, order=["plain", "static", "online"], on_chunk=on_chunk)
    assert turns == [(0, "plain"), (0, "static"), (0, "online"), (1, "online"), (1, "static"), (1, "plain"),
                     (2, "plain"), (2, "static"), (2, "online")]
    # between turns (every session paused) the trainer is stopped ("T"), whoever served last
    assert trainer_states and all(state == "T" for _, state in trainer_states)
    # one session served at a time: no two sessions' periods overlap
    periods = sorted((a, b, n) for n, s in sessions_seen.items() for a, b in s.active)
    assert all(b1 <= a2 for (_, b1, _), (a2, _, _) in zip(periods, periods[1:]))
    assert sessions_seen["online"].result.trainer["returncode"] == 0  # continued, then stopped on SIGTERM
    for name, res in results.items():
        figs = session_figures(res)
        assert figs["overall"]["requests"] == 6 and figs["overall"]["failed"] == 0, name
        assert [r.index for r in res.requests] == list(range(6))
        own = sum(b - a for a, b in sessions_seen[name].active)
        # its serving time is its own turns' (the others' left out), well under the wall time of all three
        assert figs["serving_s"] == pytest.approx(own, rel=1e-6)
        wall = max(b for _, b, _ in periods) - min(a for a, _, _ in periods)
        assert own < 0.75 * wall, (name, own, wall)
        assert all(res.t_serve <= r.t_submit <= r.t_last <= res.t1 for r in res.requests)
    assert json.dumps(session_figures(results["online"])["trainer"])  # the trainer's figures came back


def test_e2e_interleave_is_checked():
    from bench.e2e import E2EConfig
    from online_spec.config import ConfigError

    with pytest.raises(ConfigError, match="interleave"):
        E2EConfig(interleave=-1)
    assert E2EConfig(interleave=16).interleave == 16 and E2EConfig().interleave == 0


def test_bench_e2e_interleaved_serves_the_same_chunks_in_turn(tmp_path, smol):
    """`bench e2e --interleave 2` on a 3-line trace: every configuration serves every line in
    chunks, no machine pulse is taken, the figures and ratios come out as one after another."""
    from bench.e2e import E2EConfig, run_bench

    trace = write_trace(tmp_path / "t.jsonl", [TINY[0], TINY[2], TINY[4]])
    cfg = E2EConfig(trace=str(trace), head="shipped", max_tokens=3, calib_steps="2", bs1_requests=1, day0=False,
                    tree="", policy_trees="", interleave=2, out=str(tmp_path / "runs"), deadline_s=300.0)
    rep = run_bench(cfg, target=smol)
    assert set(rep["overall"]) == {"plain", "static", "sglang_adaptive", "online_spec"}
    assert rep["same_work"] == {"requests": 3, "of": 3, "set_by": "plain", "all_served": True, "short": []}
    for name, c in rep["configs"].items():
        assert c["overall"]["requests"] == 3 and c["overall"]["failed"] == 0, name
        assert c["serving_s"] < c["wall_s"], name  # its own turns only, within the side-by-side wall time
    # the whole-trace configurations took no pulse (the batch-1 sessions, one after another, did)
    assert not set(rep["machine_pulse"]["tokens_per_s"]) & set(rep["overall"])
    assert rep["speedup_vs_static_sglang_adaptive"] > 0 and rep["configs"]["online_spec"]["trainer"]["returncode"] == 0
