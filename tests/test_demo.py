"""`online-spec demo` and `online-spec bench e2e`: traces, the demo end to end, the bench's keys.

The end-to-end cases run the real SmolLM2 server in this process and the real trainer daemon in
a child process, on a six-request trace with max_tokens 4 and a day-0 head: they check the
plumbing (reports, plots, keys), not the speed-ups.
"""

import contextlib
import io
import json
import shutil

import pytest

from bench.trace import TraceError, build_drift_trace, load_trace, parse_line, phases

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = [{"messages": [{"role": "user", "content": "Tell me about cats."}], "tag": "chat"},
        {"messages": [{"role": "user", "content": "Name a colour."}], "tag": "chat"},
        {"prompt": "def fib(n):", "tag": "code", "max_tokens": 3},
        {"prompt": "def add(a, b):", "tag": "code"},
        {"messages": [{"role": "user", "content": "Hello!"}], "tag": "chat", "phase": "mix"},
        {"prompt": "import os\n", "tag": "code", "phase": "mix"}]


def write_trace(path, lines):
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def test_trace_parses_in_file_order_with_phases(tmp_path):
    items = load_trace(write_trace(tmp_path / "t.jsonl", TINY[:2] + [""] + TINY[2:]))  # blank lines skipped
    assert [it.index for it in items] == list(range(6))
    assert [(name, len(run)) for name, run in phases(items)] == [("chat", 2), ("code", 2), ("mix", 2)]
    assert items[2].prompt == "def fib(n):" and items[2].messages is None and items[2].max_tokens == 3
    assert items[4].tag == "chat" and items[4].phase == "mix"
    assert parse_line('{"prompt": "x"}', 0).phase == ""


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "exactly one of"),
    ('{"tag": "chat"}', "exactly one of"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0]"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "x", "tag": 3}', "'tag'"),
    ('{"prompt": "x", "tag": "*"}', "reserved"),
    ('{"prompt": "x", "temperature": 0.5}', "unknown key"),
])
def test_trace_errors_name_the_line(tmp_path, line, needle):
    path = write_trace(tmp_path / "bad.jsonl", [TINY[0], TINY[1], line])
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert f"bad.jsonl:3:" in str(e.value) and needle in str(e.value)


def test_trace_missing_or_empty(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_trace(tmp_path / "empty.jsonl", ["", "  "]))


def test_built_in_drift_trace_is_chat_then_code_then_mix(tmp_path):
    items = load_trace(build_drift_trace(tmp_path / "d.jsonl", 3, 2, 4, seed=0, max_tokens=7))
    assert [(n, len(r)) for n, r in phases(items)] == [("chat", 3), ("code", 2), ("mix", 4)]
    assert {it.tag for it in items[:3]} == {"chat"} and {it.tag for it in items[3:5]} == {"code"}
    assert sorted(it.tag for it in items[5:]) == ["chat", "chat", "code", "code"]
    assert all(it.max_tokens == 7 and it.messages[0]["role"] == "user" for it in items)
    assert "Complete the following Python function" in items[3].messages[0]["content"]
    chat_texts = [it.messages[0]["content"] for it in items if it.tag == "chat"]
    assert len(set(chat_texts)) == len(chat_texts)  # the mix brings new conversations, not repeats


def test_built_in_return_trace_goes_back_to_new_chat(tmp_path):
    items = load_trace(build_drift_trace(tmp_path / "r.jsonl", 3, 2, 4, seed=0, shape="return"))
    assert [(n, len(r)) for n, r in phases(items)] == [("chat", 3), ("code", 2), ("chat-return", 4)]
    assert {it.tag for it in items[5:]} == {"chat"}
    chat_texts = [it.messages[0]["content"] for it in items if it.tag == "chat"]
    assert len(set(chat_texts)) == 7  # the return serves conversations the first phase did not
    with pytest.raises(ValueError, match="shape: must be one of drift, return"):
        build_drift_trace(tmp_path / "x.jsonl", 1, 1, 1, shape="loop")


def test_the_demo_default_trace_builds(tmp_path, caplog):
    """The default demo (10 minutes x 60 lines per phase per minute) asks for 600 chat + 300 mix chat
    conversations; 639 held-out chat conversations fit (the chat-only filter of 2026-11-24 made the
    default demo fail here with "only 639 ... fit"). The mix keeps its own, the chat phase is cut."""
    from bench.demo import DemoConfig, trace_items
    from online_spec import advice

    advice.reset()
    items = trace_items(DemoConfig(), tmp_path)
    runs = dict((n, r) for n, r in phases(items))
    assert len(runs["code"]) == 600 and len(runs["mix"]) == 600
    assert 300 <= len(runs["chat"]) < 600 and "chat phase gets" in caplog.text
    # the warning says what it costs and what to do, and is counted (online_spec_warnings_total)
    assert "Cost: none while the machine serves fewer chat lines" in caplog.text and "To do: " in caplog.text
    assert advice.counts()["trace_chat_short"] == 1
    chat_texts = [it.messages[0]["content"] for it in items if it.tag == "chat"]
    # each conversation once: only ShareGPT's own repeated first turns repeat (10 of these 639)
    assert len(chat_texts) == 639 and len(set(chat_texts)) >= 625


@pytest.fixture(scope="module")
def demo_run(smol, tmp_path_factory):
    """`online-spec demo` on TINY, run once: (report directory, figures, console). Its session's
    round-time calibration (out/session/cost_model.json) is also the store the e2e test's sessions
    start from: a calibration is keyed by the machine (model, dtype, device, CPU, threads), not by
    the configuration, and one takes ~30 s on 2 cores."""
    from bench.demo import DemoConfig, run_demo

    tmp = tmp_path_factory.mktemp("demo")
    trace = write_trace(tmp / "t.jsonl", TINY)
    out = tmp / "demo"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        figs = run_demo(DemoConfig(minutes=1.0, trace=str(trace), head="day0", max_tokens=4, concurrency=2,
                                   out=str(out)), target=smol)
    return out, figs, console.getvalue()


def test_demo_end_to_end_writes_the_report(demo_run):
    out, figs, console = demo_run
    for name in ("summary.md", "figures.json", "accept_len_tokens_per_s.png", "k_per_slot.png"):
        assert (out / name).exists(), name
    for png in ("accept_len_tokens_per_s.png", "k_per_slot.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((out / "figures.json").read_text())
    for key in ("overall", "phases", "timeline", "swaps", "alerts", "adaptation", "trainer", "requests", "plots",
                "policy_log"):
        assert key in saved, key
    assert all(e["policy"] == "cost_model" and e["slots"] and e["t_s"] >= 0 for e in saved["policy_log"])
    assert list(saved["phases"]) == ["chat", "code", "mix"]
    assert saved["overall"]["requests"] == 6 and saved["overall"]["failed"] == 0
    assert saved["overall"]["completion_tokens"] == figs["overall"]["completion_tokens"] > 0
    assert saved["trainer"]["returncode"] == 0  # the daemon stopped on SIGTERM, saved, exited cleanly
    # the console showed the trainer's start-up from its own log; serving time is apart from start-up
    assert "  trainer: starting: target model" in console and "  trainer: ready in " in console
    assert saved["startup_s"] > 0 and saved["serving_s"] + saved["startup_s"] == pytest.approx(saved["duration_s"])
    assert f"{saved['serving_s']:.0f} s of serving, after {saved['startup_s']:.0f} s of start-up" in \
        (out / "summary.md").read_text()
    assert [a["shift"] for a in saved["adaptation"]] == ["chat->code", "code->mix"]
    assert "| chat |" in (out / "summary.md").read_text()
    # every verify round, readable by `online-spec drift replay`, labelled with its phase
    from online_spec.drift_replay import read_rounds
    from online_spec.jsonl import open_text
    with open_text(out / "rounds.jsonl.gz") as f:
        rounds = list(read_rounds(f, source="rounds.jsonl.gz"))
    spec = [r for r in rounds if r["num_steps"] > 0]
    assert sum(len(r["accepted"]) for r in spec) == saved["overall"]["verify_request_rounds"] > 0
    assert {r["phase"] for r in rounds} <= {"chat", "code", "mix"} and {r["phase"] for r in rounds} >= {"chat"}
    assert all(set(r["tags"]) <= {"chat", "code"} for r in rounds)
    with open_text(out / "rounds.jsonl.gz") as f:  # each round's shape, context and times beside (replay ignores them)
        raw = [json.loads(line) for line in f]
    assert len(raw) == len(rounds) and all(r["topk"] >= 1 and r["ctx_len"] > 0 and r["total_s"] >= r["verify_s"] > 0
                                           and "admitted" in r for r in raw)


def test_a_deadline_shortens_the_trace_for_every_configuration_alike():
    from bench.e2e import same_work, served

    def figs(requests, cancelled):
        return {"name": "plain", "overall": {"requests": requests, "cancelled_at_deadline": cancelled}}
    items = list(range(10))
    res = {}
    # plain started 6 of 10 before its deadline: the others serve exactly those 6
    assert same_work(items, figs(10, 4), res) == items[:6] and served(figs(10, 4)) == 6
    assert res["same_work"] == {"requests": 6, "of": 10, "set_by": "plain"}
    assert same_work(items, figs(10, 0), res) == items and res["same_work"]["requests"] == 10


def test_bench_e2e_quick_writes_every_key(tmp_path, demo_run):
    from online_spec.cli import main

    trace = write_trace(tmp_path / "t.jsonl", [TINY[0], TINY[2], TINY[4]])  # one request per phase
    path = tmp_path / "e2e.json"
    # the shared store holds this machine's calibration (the demo's session measured it)
    store = tmp_path / "runs" / "cost_model.json"
    store.parent.mkdir()
    shutil.copy(demo_run[0] / "session" / "cost_model.json", store)
    calibration = store.read_text()
    # one calibration K (no calibration sessions) and no day-0 run keep this short
    assert main(["bench", "e2e", "--quick", "--head", "day0", "--trace", str(trace), "--max-tokens", "3",
                 "--calib-steps", "2", "--bs1-requests", "1", "--no-day0", "--overhead-split",
                 "--ceiling-heads", "code", "--out", str(tmp_path / "runs"), "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    # the six cost-policy sessions share one round-time calibration, beside their run directories:
    # none wrote a store of its own, and the shared one, of this machine, was reused as it was
    assert store.read_text() == calibration and not list((tmp_path / "runs").glob("*/cost_model.json"))
    for key in ("speedup_vs_static_sglang_adaptive", "speedup_vs_plain_bs1_adapted", "tokens_to_beat_plain_from_day0",
                "speedup_vs_static", "speedup_vs_plain", "static_k", "per_phase", "overall", "adaptation_online_spec",
                "bs1", "machine", "targets", "met"):
        assert key in rep, key
    assert set(rep["overall"]) == {"plain", "static", "sglang_adaptive", "sglang_default_tree", "cost_policy",
                                   "online_no_training", "online_spec", "ceiling_code"}
    assert rep["speedup_vs_sglang_default_tree"] > 0 and rep["tree_vs_static"] > 0
    assert rep["config"]["tree"] == "5,4,8" and rep["configs"]["sglang_default_tree"]["overall"]["accept_len"] is not None
    assert rep["bs1"]["ceiling_code"]["tokens_per_s"]
    assert rep["configs"]["ceiling_code"]["overall"]["accept_len"] is not None
    assert rep["ceiling"]["bs1_best"] == "ceiling_code" and rep["ceiling"]["ceiling_vs_static_sglang_adaptive"] > 0
    assert set(rep["ceiling"]["best_per_phase"]) == {"chat", "code", "mix"}
    # the split's factors multiply to online-spec over static; the no-training daemon never trained
    split, tps = rep["overhead_split"], {n: f["tokens_per_s"] for n, f in rep["overall"].items()}
    assert split["controller"] * split["capture"] * split["training"] == pytest.approx(tps["online_spec"] / tps["static"])
    assert split["capture"] == pytest.approx(tps["online_no_training"] / tps["cost_policy"])
    assert rep["configs"]["online_no_training"]["trainer"]["step"] == 0
    assert rep["configs"]["online_no_training"]["trainer"]["returncode"] == 0
    assert rep["static_k"]["best"] == 2 and rep["configs"]["static"]["timeline"]["num_steps_per_slot"]
    assert rep["static_k"]["warmup_session"] is False  # an untimed first session on CUDA devices only
    assert rep["tokens_to_beat_plain_from_day0"] is None  # --no-day0: reported, not invented
    assert set(rep["per_phase"]) == {"chat", "code", "mix"}
    # no deadline reached: every configuration served the whole trace
    assert rep["same_work"] == {"requests": 3, "of": 3, "set_by": "plain", "all_served": True, "short": []}
    for p, ratios in rep["per_phase_ratios"].items():  # beside the overall: online-spec over each reference
        figs = rep["per_phase"][p]
        assert ratios["speedup_vs_static"] == pytest.approx(figs["online_spec"]["tokens_per_s"]
                                                            / figs["static"]["tokens_per_s"])
        assert ratios["speedup_vs_plain"] == pytest.approx(figs["online_spec"]["tokens_per_s"]
                                                           / figs["plain"]["tokens_per_s"])
    assert rep["overall"]["plain"]["accept_len"] is None and rep["overall"]["static"]["accept_len"] is not None
    assert rep["speedup_vs_static_sglang_adaptive"] > 0 and rep["speedup_vs_plain_bs1_adapted"] > 0
    # a machine pulse before each configuration (bs1 and ceiling sessions too), and their spread
    pulse = rep["machine_pulse"]
    assert set(pulse["tokens_per_s"]) >= set(rep["overall"]) | {"bs1_plain", "bs1_adapted"}
    assert all(v > 0 for v in pulse["tokens_per_s"].values()) and pulse["spread"] >= 1.0
    assert (tmp_path / "runs" / "static" / "rounds.jsonl.gz").exists()


def test_e2e_ceiling_takes_the_fastest_head_per_phase():
    """The ceiling serves each phase with its fastest head (the static head under the cost
    controller, or a --ceiling-heads head), weighted by the adaptive configuration's tokens: a
    hand-computed case, and a phase without tokens/s somewhere gives no ceiling."""
    from bench.e2e_figures import ceiling_figures

    def conf(chat, code, chat_tokens=0, code_tokens=0):
        return {"phases": {"chat": {"tokens_per_s": chat, "completion_tokens": chat_tokens},
                           "code": {"tokens_per_s": code, "completion_tokens": code_tokens}}}

    configs = {"sglang_adaptive": conf(10.0, 5.0, 100, 200), "cost_policy": conf(12.0, 5.0),
               "ceiling_code": conf(8.0, 10.0), "online_spec": conf(11.0, 8.0)}  # online-spec is no ceiling head
    bs1 = {"plain": {"tokens_per_s": 10.0}, "online_spec": {"tokens_per_s": 30.0},
           "ceiling_code": {"tokens_per_s": 19.0}}
    out = ceiling_figures(configs, bs1, ["chat", "code"])
    assert out["best_per_phase"] == {"chat": {"head": "cost_policy", "tokens_per_s": 12.0, "ceiling_capture": 0.5},
                                     "code": {"head": "ceiling_code", "tokens_per_s": 10.0,
                                              "ceiling_capture": pytest.approx(0.6)}}
    # 300 tokens in 100/12 + 200/10 s against 100/10 + 200/5 s; online-spec's 100/11 + 200/8 s
    assert out["tokens_per_s"] == pytest.approx(300 / (100 / 12 + 20))
    assert out["static_sglang_adaptive_tokens_per_s"] == pytest.approx(300 / 50)
    ceiling, ref, online = 300 / (100 / 12 + 20), 300 / 50, 300 / (100 / 11 + 25)
    assert out["online_spec_tokens_per_s"] == pytest.approx(online)
    assert out["ceiling_capture"] == pytest.approx((online - ref) / (ceiling - ref))
    assert out["ceiling_vs_static_sglang_adaptive"] == pytest.approx(50 / (100 / 12 + 20))
    assert out["bs1_best"] == "ceiling_code" and out["ceiling_speedup_vs_plain_bs1"] == pytest.approx(1.9)
    configs["ceiling_code"]["phases"]["code"]["tokens_per_s"] = None
    assert "error" in ceiling_figures(configs, bs1, ["chat", "code"])
    configs["ceiling_code"]["phases"]["code"]["tokens_per_s"] = 4.0  # no head beats the reference on code
    assert ceiling_figures(configs, bs1, ["chat", "code"])["best_per_phase"]["code"]["ceiling_capture"] is None


def test_e2e_verify_speed_reads_the_machine_off_the_same_verify_shapes():
    """`verify_speed`: per configuration, cost_policy's mean verify time over its own on the
    (batch, K) cells both ran >= 20 rounds of (K = 0 cells and thin cells left out), a
    rounds-weighted geometric mean, and the spread of those; None without cost_policy's rounds."""
    import math

    from bench.e2e_figures import verify_speed

    def costs(cells):
        return {"round_costs": {"by_batch_k": {c: {"rounds": n, "verify_ms_mean": ms} for c, (n, ms) in cells.items()}}}

    configs = {"cost_policy": costs({"4,2": (100, 60.0), "4,1": (50, 50.0), "4,0": (80, 40.0), "3,2": (5, 1.0)}),
               "ceiling": costs({"4,2": (100, 45.0), "4,1": (200, 40.0), "3,2": (90, 90.0)}),
               "plain": costs({"4,0": (900, 30.0)}),
               "static": costs({"4,2": (10, 30.0)})}
    vs = verify_speed(configs)
    assert vs["ref"] == "cost_policy" and set(vs["by_config"]) == {"cost_policy", "ceiling"}  # no shared cell: out
    w = math.exp((100 * math.log(60 / 45) + 50 * math.log(50 / 40)) / 150)
    assert math.isclose(vs["by_config"]["ceiling"], round(w, 4)) and vs["cells"]["ceiling"] == 2
    assert vs["by_config"]["cost_policy"] == 1.0 and math.isclose(vs["spread"], round(w, 4), rel_tol=1e-3)
    assert verify_speed({"plain": configs["plain"]}) is None


@pytest.mark.parametrize("heads", ["code,code", "runs/a/head,runs/b/head", "day0"])
def test_e2e_ceiling_heads_must_be_distinct_real_heads(heads):
    from bench.e2e import E2EConfig
    from online_spec.config import ConfigError

    assert E2EConfig(ceiling_heads="code, runs/a/head").ceiling_labels == {"code": "code", "head": "runs/a/head"}
    with pytest.raises(ConfigError, match="ceiling_heads"):
        E2EConfig(ceiling_heads=heads)


def test_e2e_capture_sender_reaches_the_sessions_and_is_checked(tmp_path, monkeypatch):
    """`bench e2e --capture-sender` is validated, and a session builds its engine config with it
    (the capture placement itself: tests/test_host_window.py)."""
    import serving.engine
    from bench import session
    from bench.e2e import E2EConfig
    from online_spec.config import ConfigError

    with pytest.raises(ConfigError, match="capture_sender"):
        E2EConfig(capture_sender="child")
    assert E2EConfig(capture_sender="engine").capture_sender == "engine"
    assert E2EConfig(capture_sender="process").capture_sender == "process"

    class Built(Exception):
        pass

    def engine_config(**kw):  # the session stops here: what reached the engine's config is the point
        raise Built(kw)

    monkeypatch.setattr(serving.engine, "EngineConfig", engine_config)
    for sender in ("engine", "thread", "process"):
        cfg = session.SessionConfig(head="none", run_dir=str(tmp_path / sender), capture_sender=sender)
        with pytest.raises(Built) as built:
            session.run_session(None, cfg, [])
        assert built.value.args[0]["capture_sender"] == sender


def test_e2e_repeats_report_medians_of_per_repeat_ratios():
    """With --repeats, each ratio is the median of the repeats' own ratios (not a ratio of
    medians), per-phase and overall figures are element-wise medians, and a figure missing
    from any repeat is None rather than a median of the others."""
    from bench.e2e import median_headline

    def head(r_adapt, r_bs1, tps_online, acc):
        return {"speedup_vs_static_sglang_adaptive": r_adapt, "speedup_vs_static": 1.0, "speedup_vs_plain": 1.1,
                "speedup_vs_plain_bs1_adapted": r_bs1, "speedup_vs_sglang_default_tree": 1.2, "tree_vs_static": 1.0,
                "per_phase": {"chat": {"online_spec": {"tokens_per_s": tps_online, "accept_len": acc}}},
                "per_phase_ratios": {"chat": {"speedup_vs_static": r_adapt}},
                "overall": {"online_spec": {"tokens_per_s": tps_online, "accept_len": acc, "failed": 0}},
                "adaptation_online_spec": [], "swaps_online_spec": 0, "alerts_online_spec": 0,
                "targets": {}, "met": {}}

    out = median_headline([head(0.9, 1.4, 100.0, 1.0), head(1.4, 2.6, 90.0, None), head(1.0, 1.5, 120.0, 1.2)])
    assert out["speedup_vs_static_sglang_adaptive"] == 1.0 and out["speedup_vs_plain_bs1_adapted"] == 1.5
    assert out["overall"]["online_spec"]["tokens_per_s"] == 100.0
    assert out["per_phase"]["chat"]["online_spec"]["accept_len"] is None  # missing in one repeat
    assert out["per_phase_ratios"]["chat"]["speedup_vs_static"] == 1.0
    assert out["met"] == {"speedup_vs_static_sglang_adaptive": False, "speedup_vs_plain_bs1_adapted": False}
    assert median_headline([head(1.3, 2.5, 1.0, 1.0)] * 2)["met"] == {"speedup_vs_static_sglang_adaptive": True,
                                                                     "speedup_vs_plain_bs1_adapted": True}


def test_e2e_repeats_are_counterbalanced_and_pooled():
    """Odd repeats run the configurations in reverse; `pooled` takes each configuration's tokens
    over its seconds in all repeats, so a steady drift of the machine, which in one repeat's order
    favours the configurations that ran first, slows each pooled figure alike."""
    from bench.e2e import repeat_order
    from bench.e2e_figures import pooled_figures

    names = ["plain", "sglang_adaptive", "cost_policy", "online_spec", "ceiling_code"]
    assert repeat_order(names, 0) == names and repeat_order(names, 2) == names
    assert repeat_order(names, 1) == names[::-1]
    # the machine slows steadily: each configuration's seconds a token grow by 10 % of its own per
    # slot it runs in, one phase of 100 tokens, the slots in each repeat's order
    true = {"plain": 50.0, "sglang_adaptive": 60.0, "cost_policy": 62.0, "online_spec": 66.0, "ceiling_code": 70.0}
    runs = []
    for rep in range(2):
        conf = {}
        for slot, n in enumerate(repeat_order(names, rep)):
            block = {"completion_tokens": 100, "tokens_per_s": true[n] / (1 + 0.1 * slot)}
            conf[n] = {"overall": dict(block), "phases": {"chat": dict(block)}}
        runs.append(conf)
    out = pooled_figures(runs, ["chat"])
    assert out["repeats"] == 2
    for n, v in true.items():  # 200 tokens in (1 + 0.1 i + 1 + 0.1 (4 - i)) 100 / v seconds, whatever the slot i
        assert out["tokens_per_s"][n] == pytest.approx(v / 1.2)
        assert out["per_phase_tokens_per_s"]["chat"][n] == pytest.approx(v / 1.2)
    assert out["speedup_vs_static_sglang_adaptive"] == pytest.approx(66 / 60)
    assert out["speedup_vs_static"] is None  # no static configuration in these runs
    # pooled, the share of the ceiling's gain is the machine-free one; in the first repeat alone
    # the ceiling, run last, seemed slower than the reference (no gain: undefined), and in the
    # second, run first, it made the reference's gap look larger
    assert out["ceiling"]["ceiling_capture"] == pytest.approx((66 - 60) / (70 - 60))
    assert pooled_figures(runs[:1], ["chat"])["ceiling"]["ceiling_capture"] is None
    ref, online = 60 / 1.3, 66 / 1.1
    second = pooled_figures(runs[1:], ["chat"])["ceiling"]["ceiling_capture"]
    assert second == pytest.approx((online - ref) / (70 - ref))
    assert "bs1_best" not in out["ceiling"]  # the batch-1 sessions are not pooled
    assert "overhead_split" not in out  # the split's configurations did not run
    runs[1]["online_spec"]["phases"]["chat"]["tokens_per_s"] = None  # a phase without tokens/s in one repeat
    assert "error" in pooled_figures(runs, ["chat"])["ceiling"]


def test_e2e_overhead_split_is_pooled_over_the_repeats():
    """With `--overhead-split`, `pooled` gives the split's factors from the pooled tokens/s of
    static, cost_policy, online_no_training and online-spec, as one run's headline gives them from
    its own (one run's factors move +-10 % on an H200; the repeats' pooled figures move less)."""
    from bench.e2e import repeat_order
    from bench.e2e_figures import overhead_split, pooled_figures

    names = ["static", "sglang_adaptive", "cost_policy", "online_no_training", "online_spec"]
    true = {"static": 50.0, "sglang_adaptive": 52.0, "cost_policy": 60.0, "online_no_training": 57.0,
            "online_spec": 58.0}
    runs = []
    for rep in range(2):  # the machine slows by 10 % a slot; the odd repeat runs in reverse
        conf = {}
        for slot, n in enumerate(repeat_order(names, rep)):
            block = {"completion_tokens": 100, "tokens_per_s": true[n] / (1 + 0.1 * slot)}
            conf[n] = {"overall": dict(block), "phases": {"chat": dict(block)}}
        runs.append(conf)
    split = pooled_figures(runs, ["chat"])["overhead_split"]
    assert split["controller"] == pytest.approx(60 / 50)
    assert split["capture"] == pytest.approx(57 / 60)
    assert split["training"] == pytest.approx(58 / 57)
    # one repeat alone carries the drift between its slots: capture (slots 2 and 3) reads 57/1.3 over 60/1.2
    alone = pooled_figures(runs[:1], ["chat"])["overhead_split"]
    assert alone["capture"] == pytest.approx((57 / 1.3) / (60 / 1.2))
    assert overhead_split({"static": 50.0, "cost_policy": 60.0}.get) is None  # no online_no_training


def test_e2e_return_figure_is_online_specs_ratio_against_the_target():
    """`returns` in the headline: each configuration's figures of the trace's return phase,
    online-spec's ratio measured against 0.95, and the median over repeats."""
    from bench.e2e import median_headline
    from bench.e2e_figures import return_figures

    def conf(ratio):
        return {"returns": [{"phase": "chat-return", "earlier": "chat", "tokens": 500, "earlier_first_draft": 0.6,
                             "first_draft_first_tokens": 0.6 * ratio, "earlier_accept_len": 2.0,
                             "accept_len_first_tokens": 2.0 * ratio, "request_rounds": 40, "ratio": ratio}]}

    out = return_figures({"plain": {"returns": []}, "static": conf(1.2), "online_spec": conf(0.9)})
    assert out["phase"] == "chat-return" and out["earlier"] == "chat"
    assert set(out["configs"]) == {"static", "online_spec"}
    assert out["ratio_online_spec"] == 0.9 and out["target"] == 0.95 and out["met"] is False
    assert out["ratio_online_spec_over_static"] == pytest.approx(0.75)  # the prompts alone gave 1.2
    assert return_figures({"online_spec": conf(0.96)})["met"] is True
    base = {"speedup_vs_static_sglang_adaptive": 1.0, "speedup_vs_static": 1.0, "speedup_vs_plain": 1.0,
            "speedup_vs_plain_bs1_adapted": 1.0, "speedup_vs_sglang_default_tree": None, "tree_vs_static": None,
            "per_phase": {}, "per_phase_ratios": {}, "overall": {}}
    heads = [{**base, "returns": return_figures({"online_spec": conf(r)})} for r in (0.9, 0.97, 0.96)]
    med = median_headline(heads)["returns"]
    assert med["ratio_online_spec"] == 0.96 and med["met"] is True
