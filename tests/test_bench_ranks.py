"""`online-spec bench ranks`: the figures it computes from the ranks' journals, its config checks,
and one real run (the real launcher, DeepSpeed over gloo, 1 then 2 ranks) on the tiny target (a
stand-in for SmolLM2, which takes ~30 s a step on 2 cores; the bench on the real model is the
same code)."""

import json
import os

import pytest
import torch

from bench.ranks import RanksBenchConfig, journal_figures, run_bench, scaling, train_command
from online_spec.config import ConfigError
from tests.distill_helpers import tiny8
from tests.test_trainer_ranks import save_target_dir


def write_journal(run_dir, rank, times, rows):
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "ranks" / f"rank{rank}.jsonl", "w") as f:
        for i, (t, n) in enumerate(zip(times, rows)):
            pipe = {"draw": 5.0 + i, "send": 2.0} if rank == 0 else {"recv": 10.0 * i}
            f.write(json.dumps({"step": i + 1, "time": t, "rows": n, "wait_s": 0.001 * rank * (i + 1),
                                "train_s": 0.02, "padded": 2 * n, "pipe": pipe, "spans": [["r", 0, n]] * 4,
                                "named": i % 4}) + "\n")


def test_journal_figures_skip_the_warmup_and_count_every_rank(tmp_path):
    # steps 1..5 at t = 0, 10, 11, 12, 13; warm-up 1 step: steps 3..5 timed over t 10 -> 13
    write_journal(tmp_path, 0, [0, 10, 11, 12, 13], [100, 100, 100, 100, 100])
    write_journal(tmp_path, 1, [0, 10, 11, 12, 13], [90, 90, 90, 90, 90])
    f = journal_figures(tmp_path, 2, warmup=1)
    assert f["timed_steps"] == 3 and f["seconds"] == 3.0
    assert f["steps_per_s"] == 1.0
    assert f["rows_per_s"] == round(3 * 190 / 3.0, 1)
    assert f["rows_per_rank_step_median"] == [100, 90]
    # per rank, the median wait for its micro-batch and training time of the timed steps (3..5)
    assert f["wait_ms_median"] == [0.0, 4.0] and f["train_ms_median"] == [20.0, 20.0]
    assert f["padded_over_rows_median"] == [2.0, 2.0]
    # the data pipe's parts per rank: medians over the timed steps (i = 2..4)
    assert f["pipe_ms_median"] == [{"draw": 8.0, "send": 2.0}, {"recv": 30.0}]
    # rank 1's spans that went by name over the timed steps: 2 + 3 + 0 of 12
    assert f["named_share"] == [round(5 / 12, 3)]
    with pytest.raises(RuntimeError, match="too few"):
        journal_figures(tmp_path, 2, warmup=4)


def test_scaling_is_over_the_first_count_and_takes_medians():
    runs = [{"mode": "weak", "ranks": 1, "steps_per_s": 2.0, "rows_per_s": 100.0},
            {"mode": "weak", "ranks": 1, "steps_per_s": 4.0, "rows_per_s": 300.0},
            {"mode": "weak", "ranks": 2, "steps_per_s": 2.7, "rows_per_s": 320.0},
            {"mode": "weak", "ranks": 2, "rc": 1, "error": "x"},
            {"mode": "strong", "ranks": 2, "steps_per_s": 9.0, "rows_per_s": 9.0}]
    s = scaling(runs, [1, 2], "weak")
    assert s["1"]["steps_per_s"] == 3.0 and s["1"]["rows_per_s"] == 200.0
    assert s["2"]["rows_per_s_scaling"] == 1.6 and s["2"]["rows_per_s_efficiency"] == 0.8
    assert s["2"]["steps_per_s_scaling"] == 0.9


def test_config_errors_name_the_field():
    for kw, field in (({"ranks": "0"}, "ranks"), ({"ranks": "a"}, "ranks"), ({"modes": "both"}, "modes"),
                      ({"steps": 5, "warmup_steps": 5}, "steps"), ({"rows": 10, "batch_tokens": 64}, "rows"),
                      ({"ranks": "1,2", "trainer_devices": "1"}, "trainer_devices")):
        with pytest.raises(ConfigError, match=field):
            RanksBenchConfig(**kw)


def test_weak_steps_are_n_times_larger_and_devices_are_cut_to_n(tmp_path):
    cfg = RanksBenchConfig(device="cuda", ranks="1,2", trainer_devices="3,5", batch_tokens=100)
    cmd = train_command(cfg, 1, 100, tmp_path)
    assert cmd[cmd.index("--trainer-devices") + 1] == "3"
    assert cmd[cmd.index("--ranks") + 1] == "1" and "--rank-journal" in cmd


def test_a_command_already_run_in_the_repeat_is_not_run_again(tmp_path, monkeypatch):
    """N = 1 trains --batch-tokens rows a step in both modes: one run per repeat, the weak entry
    naming it; every other (mode, N) runs in each repeat."""
    import bench.ranks as ranks

    calls = []

    def run_once(cfg, buffer, mode, n, rep):
        calls.append((mode, n, rep))
        return {"mode": mode, "ranks": n, "repeat": rep, "batch_tokens": ranks.step_rows(cfg, mode, n), "rc": 0,
                "steps_per_s": 1.0 + len(calls), "rows_per_s": 10.0 * len(calls)}
    monkeypatch.setattr(ranks, "build_buffer", lambda cfg, root: {"spans": 0, "rows": 0, "bytes": 0})
    monkeypatch.setattr(ranks, "run_once", run_once)
    report = run_bench(RanksBenchConfig(ranks="1,2", repeats=2, out=str(tmp_path)))
    assert calls == [("strong", 1, 0), ("strong", 2, 0), ("weak", 2, 0), ("strong", 1, 1), ("strong", 2, 1),
                     ("weak", 2, 1)]
    assert [(r["mode"], r["ranks"], r["repeat"]) for r in report["runs"]] == [
        (m, n, rep) for rep in (0, 1) for m in ("strong", "weak") for n in (1, 2)]
    weak1 = [r for r in report["runs"] if r["mode"] == "weak" and r["ranks"] == 1]
    assert [r["same_run_as"] for r in weak1] == ["strong_r1_0", "strong_r1_1"]
    assert [r["steps_per_s"] for r in weak1] == [2.0, 5.0]  # the strong runs' figures


def test_bench_runs_one_and_two_gloo_ranks_on_real_traffic_shapes(tmp_path, monkeypatch):
    target = tiny8()
    target_dir = save_target_dir(target, tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    lists = [torch.randint(0, target.info.vocab_size - 1, (60,), generator=g).tolist() for _ in range(12)]
    (tmp_path / "tokens.json").write_text(json.dumps(lists))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTHONPATH", str(os.getcwd()))
    cfg = RanksBenchConfig(ranks="1,2", modes="strong,weak", steps=5, warmup_steps=1, batch_tokens=64, rows=600,
                           target=str(target_dir), tokens_file=str(tmp_path / "tokens.json"),
                           out=str(tmp_path / "out"), timeout_s=300)
    report = run_bench(cfg)
    assert report["buffer"]["rows"] == sum(len(t) - 1 for t in lists[:11])  # 600 rows reached at list 11
    runs = {(r["mode"], r["ranks"]): r for r in report["runs"]}
    assert all(r["rc"] == 0 and r["steps"] == 5 for r in runs.values()), report["runs"]
    # strong: the step's 64 rows split in two; weak: each rank a full step's rows
    assert runs["strong", 1]["rows_per_rank_step_median"] == [64]
    assert runs["strong", 2]["rows_per_rank_step_median"] == [32, 32]
    assert runs["weak", 2]["batch_tokens"] == 128 and runs["weak", 2]["rows_per_rank_step_median"] == [64, 64]
    # one rank is the same command in both modes: run once, counted for both
    assert runs["weak", 1]["same_run_as"] == "strong_r1_0" and not (tmp_path / "out" / "weak_r1_0").exists()
    assert runs["weak", 1]["rows_per_rank_step_median"] == [64]
    for mode in ("strong", "weak"):
        s = report["scaling"][mode]
        assert s["1"]["steps_per_s_scaling"] == 1.0 and s["2"]["steps_per_s"] > 0
