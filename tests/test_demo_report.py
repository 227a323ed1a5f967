"""The demo's report and console tell the truth about a run (no model: sessions built by hand).

Serving time apart from start-up, no adaptation claim without a swap or a rise, timelines and
plots from the first request, K labelled by batch size alike on the console and the plot, the
trainer's verdicts (read from its own log) in the summary and the picture, skipped trace lines
explained.
"""

import pytest

from bench.session import SessionResult, progress_line
from bench.trainer_watch import TrainerWatch
from bench.traffic import RequestResult

T0, STARTUP = 1000.0, 93.0
TS = T0 + STARTUP  # traffic begins


def _session(accepts: dict[str, list[int]], swaps: list[tuple[float, int, int]] = (), serve_s: float = 60.0):
    """Phases in order, each `len(accepts[phase])` rounds of one request, 1 s apart from TS; one
    request per phase; `swaps` (t from TS, from, to)."""
    res = SessionResult("online-spec", T0, t1=TS + serve_s, t_serve=TS, trace_lines=10)
    t, idx = TS, 0
    for phase, accs in accepts.items():
        rid = f"r{idx}"
        req = RequestResult(idx, phase, phase, rid, t_submit=t, t_first=t + 0.5)
        for a in accs:
            t += 1.0
            res.rounds.append({"t": t, "batch_size": 1 + idx % 2, "num_steps": 3, "accepted": [a],
                               "committed": a + 1, "total_s": 0.1, "head_version": 0, "request_ids": [rid],
                               "tags": [phase]})
            req.completion_tokens += a + 1
        req.t_last = t
        res.requests.append(req)
        idx += 1
    res.swaps = [{"t": TS + ts, "from": a, "to": b, "rollback": b < a} for ts, a, b in swaps]
    return res


def test_serving_time_is_apart_from_start_up_and_times_count_from_the_first_request():
    from bench.report import session_figures

    figs = session_figures(_session({"chat": [1] * 20, "code": [2] * 20}, swaps=[(30, 0, 1)]))
    assert figs["startup_s"] == pytest.approx(STARTUP) and figs["serving_s"] == pytest.approx(60.0)
    assert figs["duration_s"] == pytest.approx(STARTUP + 60.0)
    assert figs["swaps"][0]["t_s"] == pytest.approx(30.0)
    tl = figs["timeline"]
    assert len(tl["t_s"]) == 6 and tl["tokens_per_s"][0] > 0  # no bins of start-up zeros
    assert figs["adaptation"][0]["t_shift_s"] == pytest.approx(20.0)
    assert figs["skipped_lines"] == 8 and figs["trace_lines"] == 10


def test_no_adaptation_claim_without_a_swap_or_when_acceptance_falls():
    from bench.report import adaptation

    no_swap = adaptation(_session({"chat": [2] * 20, "code": [0] * 10 + [1] * 30}))[0]
    assert no_swap["time_to_adapt_s"] is None and no_swap["tokens_to_adapt"] is None
    assert no_swap["time_to_first_swap_s"] is None and no_swap["note"] == "no head was swapped in this phase"
    fell = adaptation(_session({"chat": [2] * 20, "code": [3] * 16 + [1] * 24}, swaps=[(25, 0, 1)]))[0]
    assert fell["time_to_first_swap_s"] == pytest.approx(5.0)
    assert fell["time_to_adapt_s"] is None and fell["note"].startswith("acceptance did not rise")
    # acceptance reaches 90 % of its final level 61 s into the phase, with the head unchanged; the
    # head is swapped at 90 s: the claim counts from the swap, never before it
    rose = adaptation(_session({"chat": [2] * 20, "code": [0] * 32 + [3] * 80}, swaps=[(110, 0, 1)],
                               serve_s=150))[0]
    assert rose["note"] == "" and rose["first_accept_len"] == 0 and rose["final_accept_len"] == 3
    assert rose["time_to_first_swap_s"] == pytest.approx(90.0) and rose["time_to_adapt_s"] == pytest.approx(90.0)


def test_return_figure_compares_the_returns_first_tokens_with_the_earlier_phase():
    from bench.report import returns

    def with_tags(res, tags):
        for r in res.requests:
            r.tag = tags[r.phase]
        return res

    tags = {"chat": "chat", "code": "code", "back": "chat"}
    # chat: 16 of 20 rounds with the first draft accepted (2 drafts), code, then chat again: 150
    # rounds of 2 tokens alternating 1 and 0 accepted (the first draft half the time, 0.5 a round),
    # then 40 of 5 tokens (4 accepted); only the rounds of the first 500 served tokens count
    back = [1, 0] * 75 + [4] * 40
    res = with_tags(_session({"chat": [2] * 16 + [0] * 4, "code": [0] * 10, "back": back}, serve_s=400), tags)
    (ret,) = returns(res)
    assert ret["phase"] == "back" and ret["earlier"] == "chat" and ret["earlier_first_draft"] == pytest.approx(0.8)
    assert ret["earlier_accept_len"] == pytest.approx(1.6)
    # 500 tokens: 75 rounds of 2 and 75 of 1 (225), then 55 rounds of 5 (the round crossing 500 counts)
    assert ret["request_rounds"] == 150 + 40  # the phase has only 40 rounds of 5
    assert ret["first_draft_first_tokens"] == pytest.approx((75 + 40) / 190)
    assert ret["accept_len_first_tokens"] == pytest.approx((75 + 160) / 190)
    assert ret["ratio"] == pytest.approx((75 + 40) / 190 / 0.8)
    # 100 tokens: the code phase's last round (1 token, at the return's start) is served after it
    # began too, then 66 of the return's rounds (33 of 2 tokens, 33 of 1)
    first = returns(res, tokens=100)[0]
    assert first["request_rounds"] == 66 and first["ratio"] == pytest.approx(0.5 / 0.8)
    # no return: a new tag, or a phase right after one of the same traffic
    assert returns(with_tags(_session({"chat": [1] * 5, "code": [1] * 5, "mix": [1] * 5}),
                             {"chat": "chat", "code": "code", "mix": "mixed"})) == []
    assert returns(with_tags(_session({"chat": [1] * 5, "more": [1] * 5}), {"chat": "chat", "more": "chat"})) == []


def test_console_labels_k_by_batch_size_as_the_plot_does():
    res = _session({"chat": [1, 2], "code": [3, 0]})
    line = progress_line("online-spec", res, res.rounds, 5.0, head_version=2, total=10, trainer_step=None)
    # batch sizes 1 (chat) and 2 (code): K per batch size, as "b1"/"b2" label the plot's lines
    assert "K b1:3 b2:3" in line and "accept_len b1:1.50 b2:1.50" in line
    assert "trainer step -" in line and "head v2" in line and "K/slot" not in line
    assert "trainer" not in progress_line("x", res, res.rounds, 5.0, 0, 10)
    res.phase = "code"  # the phase of the request that finished last
    assert progress_line("x", res, res.rounds, 5.0, 0, 10).startswith("[x ") and "s code] rounds" in \
        progress_line("x", res, res.rounds, 5.0, 0, 10)


TRAINER_LOG = """\
2026-11-25 03:51:34,175 trainer INFO niceness 19
Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]\rLoading weights: 100%|##| 272/272 [00:00<00:00, 14855.79it/s]
2026-11-25 03:51:34,176 trainer INFO starting: target model, replay buffer, then the distiller (DeepSpeed op and process group)
2026-11-25 03:51:35,001 trainer INFO building DeepSpeed op deepspeed_shm_comm (first start on this machine)
2026-11-25 03:51:36,688 trainer INFO ready in 2 s: subscribed to the capture stream; training starts at 128 buffered rows
2026-11-25 03:51:41,000 trainer INFO status: step 0, buffer 0 rows, 0 evaluations, 0 swaps, live v0
2026-11-25 03:51:46,000 trainer INFO status: step 7, buffer 900 rows, 0 evaluations, 0 swaps, live v0
2026-11-25 03:51:47,000 trainer INFO step 9 gate: candidate 0.730 < 0.744 needed over live 0.721
2026-11-25 03:51:48,000 trainer INFO status: step 10, buffer 990 rows, 1 evaluations, 0 swaps, live v0
"""


def test_trainer_watch_reads_start_up_steps_and_verdicts(tmp_path, capsys):
    path = tmp_path / "trainer.log"
    path.write_text(TRAINER_LOG[:200])  # a partial line waits for the rest
    watch = TrainerWatch(path)
    watch.poll()
    path.write_text(TRAINER_LOG)
    watch.poll()
    out = capsys.readouterr().out
    # start-up stages echoed as they come; status lines and progress bars not
    assert "  trainer: building DeepSpeed op deepspeed_shm_comm" in out and "  trainer: ready in 2 s" in out
    assert "Loading weights" not in out and "status:" not in out
    assert "  trainer: step 9 gate: candidate 0.730 < 0.744 needed over live 0.721" in out
    assert watch.step == 10 and watch.gates == 1 and watch.last_gate.startswith("candidate 0.730 < 0.744")
    figs = watch.figures(0.0)
    assert [e["kind"] for e in figs["events"]] == ["gate"]


def test_summary_and_plot_say_why_no_head_was_swapped(tmp_path):
    from PIL import Image

    from bench.demo import summary_md
    from bench.report import plot_session, session_figures

    res = _session({"chat": [1] * 30, "code": [0] * 30})
    watch = TrainerWatch(tmp_path / "trainer.log", echo=False)
    (tmp_path / "trainer.log").write_text(TRAINER_LOG)
    watch.poll()
    res.trainer = {"step": 10, "swaps": 0, "live_version": 0, "rolled_back": [], "refused_swaps": 0,
                   "watch": watch.figures(TS)}
    figs = session_figures(res)
    figs.update(head="shipped", config={"trace": ""}, plots=["accept_len_tokens_per_s.png"])
    text = summary_md(figs)
    assert "60 s of serving, after 93 s of start-up" in text
    assert "no swap: the gate refused all 1 candidates (last: candidate 0.730 < 0.744 needed" in text
    assert "2 of 10 lines served. The other 8 were skipped by design" in text
    assert "90 % of" not in text and "no head was swapped in this phase" in text
    pngs = plot_session(res, figs, tmp_path)
    for p in pngs:
        with Image.open(p) as im:
            assert im.size[0] <= 800 and p.stat().st_size < 200_000


def test_round_costs_split_inside_the_engine_step_from_the_gaps_between_rounds():
    """Plain rounds of 5 ms every 7 ms, K = 2 rounds of 10 ms (draft 3, verify 5) every 25 ms:
    the figures say the K = 2 rounds lose 15 ms a round outside the engine's step; prefills and
    graph captures are counted apart."""
    from bench.report import round_costs

    res = SessionResult("static", T0, t1=TS + 10, t_serve=TS, trace_lines=1)
    t = TS
    for k, total, draft, verify, every in [(0, 0.005, 0.0, 0.004, 0.007)] * 10 + [(2, 0.010, 0.003, 0.005, 0.025)] * 10:
        t += every
        res.rounds.append({"t": t, "batch_size": 4, "num_steps": k, "accepted": [0] * 4, "committed": 4,
                           "total_s": total, "draft_s": draft, "verify_s": verify, "catchup_s": 0.0,
                           "head_version": 0, "request_ids": ["r"] * 4, "tags": ["chat"] * 4})
    # two plain rounds admitted a request (2 ms of prefill each, in the step's rest), one K = 2
    # round captured a graph
    for r in res.rounds[4:6]:
        r.update(admit_s=0.002, admitted=1)
    res.rounds[15]["captures"] = 1
    for r in res.rounds[10:]:  # the K = 2 rounds' policy calls (a round log without them: 0)
        r["policy_s"] = 0.0002
    costs = round_costs(res)
    plain, spec = costs["by_k"]["0"], costs["by_k"]["2"]
    assert plain["admit_ms_mean"] == round(1e3 * 2 * 0.002 / 9, 3) and plain["admit_ms_p50"] == 0.0
    assert plain["other_ms_mean"] == round(1e3 * (0.001 - 2 * 0.002 / 9), 3)
    assert costs["one_off"] == {"rounds_s": 0.15, "prefill_s": 0.004, "prefills": 2, "catchup_s": 0.0,
                                "capture_rounds": 1, "capture_rounds_s": 0.01}
    assert plain["rounds"] == 9 and spec["rounds"] == 10  # consecutive pairs: the first round has no gap
    assert plain["round_ms_p50"] == 5.0 and plain["gap_ms_p50"] == 2.0 and plain["other_ms_p50"] == 1.0
    assert spec["round_ms_p50"] == 10.0 and spec["draft_ms_p50"] == 3.0 and spec["verify_ms_p50"] == 5.0
    assert spec["gap_ms_p50"] == 15.0 and spec["gap_ms_mean"] == 15.0 and spec["catchup_ms_mean"] == 0.0
    assert spec["policy_ms_p50"] == 0.2 and plain["policy_ms_mean"] == 0.0
    # by batch and K: the K = 2 rounds at batch 4 apart from those at batch 2 (a second test log)
    assert costs["by_batch_k"] == {
        "4,0": {"rounds": 9, "round_ms_mean": 5.0, "draft_ms_mean": 0.0, "verify_ms_mean": 4.0, "committed_mean": 4.0,
                "tokens_per_s": 800.0, "steady_tokens_per_s": 1000.0},  # 7 rounds without a prefill, 4 ms each
        "4,2": {"rounds": 10, "round_ms_mean": 10.0, "draft_ms_mean": 3.0, "verify_ms_mean": 5.0,
                "committed_mean": 4.0, "tokens_per_s": 400.0, "steady_tokens_per_s": 500.0}}
    for r in res.rounds[12:]:
        r.update(batch_size=2, committed=5, total_s=0.02)
    for r in res.rounds[18:]:  # tree rounds of depth 2 (a round log names their shape), apart from the chain
        r.update(topk=4, num_draft_tokens=10)
    split = round_costs(res)["by_batch_k"]
    assert split["4,2"]["rounds"] == 2 and split["2,2"] == {
        "rounds": 6, "round_ms_mean": 20.0, "draft_ms_mean": 3.0, "verify_ms_mean": 5.0, "committed_mean": 5.0,
        "tokens_per_s": 250.0, "steady_tokens_per_s": 625.0}
    assert split["2,2,4,10"]["rounds"] == 2 and sorted(split) == ["2,2", "2,2,4,10", "4,0", "4,2"]
    for r in res.rounds[18:]:
        r.update(topk=1)
    for r in res.rounds[12:]:
        r.update(batch_size=4, committed=4, total_s=0.010)
    busy = (10 * 0.005 + 10 * 0.010) / (9 * 0.007 + 10 * 0.025 + 0.005)
    assert abs(costs["busy_share"] - busy) < 1e-3
    res.rounds = [{k: v for k, v in r.items() if k != "draft_s"} for r in res.rounds]  # older round logs
    assert round_costs(res) == {}


def test_machine_pulse_times_a_fixed_workload_and_gives_the_threads_back():
    import torch
    from bench.pulse import machine_pulse, pulse_figures
    from online_spec.target import tiny_target

    before = torch.get_num_threads()
    tps = machine_pulse(tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=3).float(), 1,
                        batch=2, prompt_tokens=8, steps=4)
    assert tps > 0 and torch.get_num_threads() == before
    figs = pulse_figures({"plain": 50.0, "static": 40.0, "gpu": None})
    assert figs["tokens_per_s"] == {"plain": 50.0, "static": 40.0} and figs["spread"] == 1.25
    assert pulse_figures({})["spread"] is None
