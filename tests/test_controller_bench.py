"""`bench controller` on a tiny configuration, the engine-calibrated cost model, and recorded
traces replayed through `online-spec controller replay` to the live EMA policy's K sequence.

A tiny randomly initialised Llama (8 layers) and a random head stand in for SmolLM2 and the
pretrained head: the figures mean nothing here, only the plumbing and the model fit are tested.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from online_spec.checkpoint import save_head
from online_spec.cli import BENCHES, main
from online_spec.config import ConfigError
from online_spec.controller import EmaTierPolicy, StepPolicyBase, adaptive_config_path, load_adaptive_config
from bench.controller import ControllerBenchConfig, Phase, Traffic, run_bench
from serving.calibrate import (calibrate_cost_model, engine_cost_model, measure_round_timings,
                                              median_per_point, prediction_errors)
from online_spec.controller.replay import attach_trace_recorder
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig
from serving.requests import Request


@pytest.fixture(scope="module")
def tiny8():
    target = tiny_target(num_layers=8)
    return target, new_head(target, draft_vocab_size=256, seed=1)


def random_prompts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (length,), generator=g).tolist() for _ in range(n)]


def test_bench_runs_end_to_end_and_writes_every_key(tiny8, tmp_path):
    target, head = tiny8
    traffic = Traffic(random_prompts(6, 16, 0), random_prompts(6, 24, 1))
    cfg = ControllerBenchConfig(static_steps=[0, 1, 3], batch_sizes=[1, 4], new_tokens=6, repeats=1, warm_runs=1,
                                calib_batch_sizes=[1, 4], calib_steps=[0, 1, 3], calib_ctx_lens=[24], calib_rounds=2,
                                phases=["sharegpt:1:1", "humaneval:8:8", "mixed:2:2"], phase_new_tokens=8,
                                phase_repeats=1, max_prompt_tokens=24)
    trace = tmp_path / "ema_trace.jsonl"
    out = run_bench(cfg, target, head, traffic, trace)
    json.dumps(out)  # JSON-safe, as write_report stores it

    cal = out["calibration"]
    assert len(cal["draft_coef"]) == 5 and len(cal["verify_coef"]) == 5 and cal["calibration_points"] > 0
    assert cal["median_rel_error_on_calibration"] >= 0 and cal["median_rel_error_on_stationary_rounds"] >= 0
    names = {"K=0", "K=1", "K=3", "ema", "cost_model", "cost_model_planned"}
    for b in ("1", "4"):
        row = out["stationary"][b]
        assert set(row["tokens_per_s"]) == names and all(v > 0 for v in row["tokens_per_s"].values())
        assert row["best_static"] in {"K=0", "K=1", "K=3"}
        assert row["best_static_tokens_per_s"] == max(row["tokens_per_s"][n] for n in ("K=0", "K=1", "K=3"))
        for name in ("ema", "cost_model", "cost_model_planned"):
            assert row[f"{name}_vs_best_static"] == pytest.approx(row["tokens_per_s"][name] / row["best_static_tokens_per_s"])
            assert sum(row["k_histogram"][name].values()) == pytest.approx(1.0)
            assert row["decision_cost_in_engine_us"][name] > 0  # timed in the engine's rounds
            assert row["decision_cost_in_engine_mean_us"][name] > 0
    # EMA at b=4 runs the sglang_default slot "1" tiers; the cost policy its own tiers
    assert set(out["stationary"]["4"]["k_histogram"]["ema"]) <= {"1", "3", "5", "7"}
    assert set(out["stationary"]["4"]["k_histogram"]["cost_model"]) <= {"0", "1", "3", "5", "7"}

    pc = out["phase_change"]
    labels = [Phase.parse(p).label() for p in cfg.phases]
    assert set(pc["tokens_per_s"]) == names and pc["best_static"] in {"K=0", "K=1", "K=3"}
    assert all(set(pc["phase_tokens_per_s"][n]) == set(labels) for n in names)
    assert set(pc["best_static_per_phase"]) == set(labels)
    assert pc["per_phase_oracle_tokens_per_s"] >= pc["best_static_tokens_per_s"] * 0.999
    assert pc["ema_vs_best_static"] > 0 and pc["cost_model_vs_best_static"] > 0

    rep = out["trace_replay"]
    assert rep["matches_live"] is True and rep["rounds"] == len(trace.read_text().splitlines()) > 10
    assert set(out["decision_cost_us"]) == {"1", "16", "64"}
    assert set(out["decision_cost_us"]["1"]) == {"ema", "cost_model", "cost_model_planned", "static",
                                                 "cost_model_at_k3"}
    assert all(v > 0 for v in out["decision_cost_us"]["16"].values())
    assert any(n.startswith("decision cost") for n in out["notes"])
    assert "no device synchronization" in out["no_device_sync"]
    assert any(n.startswith("decision cost in the engine") for n in out["notes"])
    assert len(out["notes"]) == 2 * 3 + 5 or len(out["notes"]) == 2 * 3 + 6  # per b and policy, per policy, 2


def test_calibrated_cost_model_predicts_engine_rounds(tiny8):
    """Fit on a grid, predict the rounds of batch sizes and K the fit never saw — all measured in
    one interleaved run (`measure_round_timings` steps every engine at every K each cycle), so a
    busy spell of the shared CPU lands on fitted and held-out points alike; comparing against a
    later run instead made this test fail whenever the load changed between the two runs.

    Tolerances and why:
    - median relative error <= 35% over the 4 held-out points, each the median of its 5 rounds:
      a tiny model's round is a few ms of mostly Python and launch overhead, so single rounds
      jitter by tens of percent and a preempted one by several times; the medians absorb that;
    - the fit beats the best constant (the median round of the fitted points) on the held-out
      points, grows with batch size and with K, and orders them as measured where the measurements
      differ by 2x or more: a model missing the per-request or per-token term fails these.
    """
    target, head = tiny8
    failures = []
    for attempt in range(3):  # a busy spell of another job can swamp one run; a wrong model fails all three
        try:
            _check_calibration(target, head, seed=3 + attempt)
            return
        except AssertionError as e:
            failures.append(str(e)[:300])
    raise AssertionError(f"all 3 calibration runs failed: {failures}")


def _check_calibration(target, head, seed: int) -> None:
    fit_b, fit_k, held_b, held_k = [1, 4, 12], [0, 1, 3, 6], [2, 8], [2, 5]
    timings = measure_round_timings(target, head, batch_sizes=sorted(fit_b + held_b),
                                    ks=sorted(fit_k + held_k), ctx_lens=[64], rounds=5, seed=seed)
    fit = [t for t in timings if t.batch_size in fit_b and t.num_steps in fit_k]
    held_out = median_per_point([t for t in timings if t.batch_size in held_b and t.num_steps in held_k])
    model = calibrate_cost_model(target, head, timings=fit)
    errs = prediction_errors(model, held_out)
    assert len(errs) == 2 * 2
    assert statistics.median(errs) <= 0.35, (statistics.median(errs), model.draft_coef, model.verify_coef)

    const = statistics.median(t.draft_s + t.verify_s for t in median_per_point(fit))
    const_errs = [abs(const - (t.draft_s + t.verify_s)) / (t.draft_s + t.verify_s) for t in held_out]
    assert statistics.median(errs) < statistics.median(const_errs), (errs, const_errs)
    measured = {(t.batch_size, t.num_steps): t.draft_s + t.verify_s for t in held_out}
    predicted = {(t.batch_size, t.num_steps): model.predict_round_s(t.batch_size, t.num_steps, t.ctx_len)
                 for t in held_out}
    # more requests and more draft steps cost more: a model missing either term fails this
    assert predicted[(8, 2)] > predicted[(2, 2)] and predicted[(8, 5)] > predicted[(2, 5)], predicted
    assert predicted[(2, 5)] > predicted[(2, 2)] and predicted[(8, 5)] > predicted[(8, 2)], predicted
    # and where the measurements differ by 2x or more (b=8 K=5 vs b=2 K=2 is ~2.5x on a quiet
    # machine), in the measured order; 1.5x failed when another job shared the 2 cores
    pairs = [(p, q) for p in measured for q in measured if measured[p] >= 2.0 * measured[q]]
    assert all(predicted[p] > predicted[q] for p, q in pairs), (measured, predicted)
    # the fit is not the prior: the measured rounds moved it
    assert model.calibration_points > 0 and model.verify_coef[0] != 0.02


def test_engine_cost_model_is_stored_and_reused(tiny8, tmp_path, caplog):
    """Calibrated once, stored with the run, reused while the machine matches; a store of
    another machine, a malformed one or one with non-finite numbers is measured over."""
    target, head = tiny8
    store = tmp_path / "run" / "cost_model.json"

    def model(**kw):
        return engine_cost_model(target, head, max_batch=4, max_steps=3, store=store, rounds=1, ctx_len=24, **kw)

    first, rep = model()
    assert rep["source"] == "calibrated" and rep["batch_sizes"] == [1, 4] and rep["ks"] == [0, 1, 3]
    assert store.exists() and first.verify_s(4, 3) > 0
    again, rep = model()
    assert rep["source"] == "store"
    assert (again.draft_coef, again.verify_coef) == (first.draft_coef, first.verify_coef)
    assert again.calibration_points == first.calibration_points > 0  # the calibration is the reused model's anchor

    saved = json.loads(store.read_text())
    nan_point = [list(saved["points"][0][:3]) + [float("nan"), 0.1]] + saved["points"][1:]
    bad_stores = {"another machine": {**saved, "key": {**saved["key"], "threads": saved["key"]["threads"] + 1}},
                  "non-finite": {**saved, "points": nan_point},
                  "coefficients not of its points": {**saved, "verify_coef": [c * 1.5 for c in saved["verify_coef"]]},
                  "malformed": {**saved, "draft_coef": [1.0]},
                  "old version, no points": {k: v for k, v in saved.items() if k != "points"}}
    for why, content in bad_stores.items():
        store.write_text(json.dumps(content))
        caplog.clear()
        _, rep = model()
        assert rep["source"] == "calibrated", why
        assert "not used" in caplog.text, why
        assert json.loads(store.read_text())["key"] == saved["key"]  # rewritten for this machine
    store.write_text("{not json")
    _, rep = model()
    assert rep["source"] == "calibrated"


def test_recorded_trace_replays_to_the_live_ema_decisions(tiny8, tmp_path):
    """An engine serving batches of 1 and 9 (two slots of sglang_default) records its rounds;
    `online-spec controller replay` of that file gives, slot by slot, the K the live policy ran."""
    target, head = tiny8
    cfg_path = adaptive_config_path("sglang_default")
    adaptive = load_adaptive_config(cfg_path)
    engine = Engine(target, head, EngineConfig(max_batch=9, max_len=256, max_steps=7),
                    policy=EmaTierPolicy(adaptive, initial_steps=3))
    trace = tmp_path / "rounds.jsonl"
    recorder = attach_trace_recorder(engine, trace)
    live = []
    engine.on_round.append(lambda stats, outs: live.append((stats.batch_size, stats.num_steps)))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for batch, seed in ((1, 0), (9, 1), (1, 2)):
        engine.generate(random_prompts(batch, 12, seed), params)
    recorder.close()

    out = tmp_path / "steps.jsonl"
    assert main(["controller", "replay", "--config", str(cfg_path), "--initial-steps", "3",
                 "--trace", str(trace), "--out", str(out)]) == 0
    after = [json.loads(line)["steps"] for line in out.read_text().splitlines()]
    assert len(after) == len(live)
    # replay prints each round's slot K after the round; the K a round ran is the one its slot
    # held after that slot's previous round (or the initial K)
    last = {i: (3 if 3 in s.candidate_steps else s.candidate_steps[len(s.candidate_steps) // 2])
            for i, s in enumerate(adaptive.slots)}
    expected = []
    for (b, _), k_after in zip(live, after):
        slot = adaptive.slot_index(b)
        expected.append(last[slot])
        last[slot] = k_after
    assert [k for _, k in live] == expected
    assert len({k for _, k in live}) >= 2  # K moved, so the comparison can fail
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {r["batch_size"] for r in rows} >= {1, 9} and all("draft_s" in r and "num_steps" in r for r in rows)


def test_bench_is_registered():
    assert BENCHES["controller"][0] == "bench.controller"
    with pytest.raises(SystemExit) as e:
        main(["bench", "controller", "--help"])
    assert e.value.code == 0


class _RecordingPolicy(StepPolicyBase):
    """Runs a fixed K schedule and keeps what the engine feeds `update` (a step policy)."""

    def __init__(self, schedule):
        self.schedule, self.fed = list(schedule), []

    def steps_for(self, batch_size, ctx_len=0):
        return self.schedule[min(len(self.fed), len(self.schedule) - 1)]

    def update(self, batch_size, accepted, **kw):
        self.fed.append(kw)
        return self.steps_for(batch_size)

    def rewarm(self):
        pass

    def info(self):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_policy_learns_steady_round_times_without_one_off_catch_ups(tiny8, monkeypatch):
    """A round that catches the draft cache up on many rows (the prompt, or the rows served at
    K = 0 before a probe) reports that work as `catchup_s`, and the policy is fed the draft time
    without it: on the GPU the probes after K = 0 streaks, each paying a long catch-up, made the
    cost policy read drafting as 3x dearer than it was and hold K at 0 (e2e run of 2026-11-24).
    The catch-up is slowed by 30 ms here so that it dominates its round's draft phase."""
    target, head = tiny8
    schedule = [2, 2, 0, 0, 0, 0, 0, 0, 2, 2, 2]
    policy = _RecordingPolicy(schedule)
    engine = Engine(target, head, EngineConfig(max_batch=1, max_len=128, max_steps=3), policy=policy)
    fill = engine._fill_rows

    def slow_fill(*args):
        time.sleep(0.03)
        return fill(*args)

    monkeypatch.setattr(engine, "_fill_rows", slow_fill)
    rounds = []
    engine.on_round.append(lambda stats, outs: rounds.append(stats))
    engine.add_request(Request(random_prompts(1, 12, seed=5)[0], SamplingParams(max_tokens=60, ignore_eos=True)))
    while len(rounds) < len(schedule):
        engine.step()
    assert [s.num_steps for s in rounds] == schedule
    for i, (s, fed) in enumerate(zip(rounds, policy.fed)):
        assert fed["draft_s"] == pytest.approx(s.draft_s - s.catchup_s, abs=1e-9), i
        assert fed["verify_s"] == s.verify_s
    long_catch_ups = [0, 8]  # the prompt's 12 rows, then 7 rows served at K = 0 (> max_steps + 1)
    for i in long_catch_ups:
        assert rounds[i].catchup_s >= 0.03 and policy.fed[i]["draft_s"] < rounds[i].draft_s - 0.029, i
    for i in (1, 9, 10):  # per-round catch-ups of <= K + 1 rows: all of the draft phase counts
        assert rounds[i].catchup_s == 0.0 and policy.fed[i]["draft_s"] == rounds[i].draft_s, i


def test_a_round_with_a_graph_capture_teaches_no_time():
    """A CUDA graph captured inside a phase (a new shape, a new head's first round) makes that
    phase's time a one-off: neither the policy nor a calibration learns from it."""
    from serving.calibrate import RoundTiming
    from serving.requests import RoundStats

    base = dict(batch_size=1, num_steps=3, accepted=[1], committed=2, draft_s=0.012, verify_s=0.004, total_s=0.017,
                head_version=1, ctx_len=100)
    clean = RoundStats(**base, catchup_s=0.002)
    assert (clean.steady_draft_s, clean.steady_verify_s) == (pytest.approx(0.010), 0.004)
    assert RoundTiming.of_round(clean) == RoundTiming(1, 3, 100, pytest.approx(0.010), 0.004)
    drafted = RoundStats(**base, draft_captures=2)
    assert drafted.steady_draft_s is None and drafted.steady_verify_s == 0.004
    verified = RoundStats(**base, verify_captures=1)
    assert verified.steady_verify_s is None and verified.steady_draft_s == pytest.approx(0.012)
    assert RoundTiming.of_round(drafted) is None and RoundTiming.of_round(verified) is None


class _SlowPolicy(_RecordingPolicy):
    """`_RecordingPolicy` with an early stop and a verify cut, each call sleeping `pause` seconds
    and counted."""

    early_stop = truncates = True

    def __init__(self, schedule, pause):
        super().__init__(schedule)
        self.pause, self.calls = pause, []

    def _call(self, name):
        self.calls[-1] += 1
        time.sleep(self.pause)

    def steps_for(self, batch_size, ctx_len=0):
        self.calls.append(0)
        self._call("steps_for")
        return super().steps_for(batch_size, ctx_len)

    def should_continue(self, step_index, draft_confidence, batch_size, ctx_len=0):
        self._call("should_continue")
        return True

    def verify_lengths(self, confidences, ctx_len=0, *, padded=False):
        self._call("verify_lengths")
        return [len(row) for row in confidences]

    def update(self, batch_size, accepted, **kw):
        self._call("update")
        self.fed.append(kw)
        return 0


def test_round_stats_time_the_policys_calls_on_the_engine_thread(tiny8):
    """`RoundStats.policy_s` sums every policy call of the round where the engine makes it
    (steps_for, each early-stop check, the verify cut, update): calls that each sleep 20 ms
    give at least 50 ms per call of that round and less than one call more (what else runs
    between them takes milliseconds on this target); a round with no head calls nothing."""
    target, head = tiny8
    pause = 0.05
    policy = _SlowPolicy([3, 2, 0, 3], pause)
    engine = Engine(target, head, EngineConfig(max_batch=2, max_len=128, max_steps=3, in_round_cuts="on"),
                    policy=policy)
    rounds = []
    engine.on_round.append(lambda stats, outs: rounds.append(stats))
    engine.generate(random_prompts(2, 10, seed=3), SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(rounds) == len(policy.calls) >= 4
    # K = 0: steps_for, update; K = 2 / 3: a check after every step (the last too: the policy cuts), the cut
    assert sorted(set(policy.calls[:4])) == [2, 5, 6]
    for stats, calls in zip(rounds, policy.calls):
        assert calls * pause <= stats.policy_s < (calls + 1) * pause, (stats.num_steps, calls)
        assert stats.policy_s < stats.total_s + 2 * pause  # update runs after the round's clock stops
    plain = Engine(target, None, EngineConfig(max_batch=2, max_len=128, num_steps=0))
    plain.on_round.append(lambda stats, outs: rounds.append(stats))
    plain.generate(random_prompts(1, 10, seed=4), SamplingParams(max_tokens=4, ignore_eos=True))
    assert rounds[-1].policy_s < pause
