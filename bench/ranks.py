"""`online-spec bench ranks`: the trainer's throughput from 1 to N data-parallel ranks.

One replay buffer of real traffic (ShareGPT conversations teacher-forced through the target, or
the token lists of `--tokens-file` for a machine without the dataset), then, for every N of
`--ranks`, `online-spec train --ranks N` (the real launcher, DeepSpeed with `--deepspeed-config`,
NCCL on GPUs, gloo on CPU; `trainer/ranks.py`) on a fresh copy of that buffer: no capture stream,
no evaluation, no publishing, `--steps` optimizer steps. N = 1 runs the same rank loop as a world
of one (`--rank-journal` makes a single rank journal too). From rank 0's journal, after
`--warmup-steps`: steps/s, and rows/s over all ranks. Two ways to grow:

  strong  the step's rows (`--batch-tokens`) are split across the N ranks: the same optimizer
          steps, done faster (`steps_per_s` scaling)
  weak    each rank trains `--batch-tokens` rows a step (the step N x as large): `rows_per_s`
          scaling, the throughput a bigger trainer buys

scaling_N = figure_N / figure_1 and efficiency_N = scaling_N / N, per mode. Each N runs
`--repeats` times, interleaved (1, 2, ..., 1, 2, ...); figures are medians. Within a repeat, a
command already run is not run again: N = 1 trains `--batch-tokens` rows a step in either mode,
so the weak 1-rank entry is the strong one's run (`same_run_as` names its directory).

    online-spec bench ranks --device cuda --ranks 1,2 --json out/bench_ranks.json
    online-spec bench ranks --quick            (CPU, gloo, a tiny run that checks the path)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import add_bench_args, quick_overrides, write_report
from collector.replay import ReplayBuffer, ReplayConfig
from collector.span import CaptureSpan
from online_spec.config import ConfigError, check, config_from_args, config_to_dict, doc
from online_spec.target import load_target
from trainer.data import capture_tokens, encode_conversation
from trainer.launch import NVLS_OFF, RANK_VARS

MODES = ("strong", "weak")


@dataclass
class RanksBenchConfig:
    device: str = doc("torch device of the ranks ('cuda': rank i on GPU i, or as --trainer-devices says)", "cpu")
    ranks: str = doc("numbers of ranks to run, comma-separated (the first is the baseline of the scaling)", "1,2")
    trainer_devices: str = doc("with --device cuda: GPU indices for ranks 0..N-1, comma-separated (N = the "
                               "largest of --ranks; a run of n ranks takes the first n); empty = rank i on GPU i", "")
    modes: str = doc("strong (the step's rows split across ranks), weak (each rank a full step's rows), or both",
                     "strong,weak")
    steps: int = doc("optimizer steps of each run", 60)
    warmup_steps: int = doc("steps left out of the timing (start-up, kernel selection, allocator growth)", 10)
    batch_tokens: int = doc("rows of one optimizer step (strong), of one rank's step (weak)", 4096)
    rows: int = doc("teacher-forced rows of traffic in the replay buffer", 60_000)
    max_len: int = doc("tokens of one conversation at most", 1024)
    target: str = doc("the target: a Hugging Face model directory; empty = the packaged SmolLM2", "")
    tokens_file: str = doc("JSON list of token-id lists to capture instead of ShareGPT (a machine without the "
                           "dataset); empty = ShareGPT's train split", "")
    deepspeed_config: str = doc("DeepSpeed JSON of the ranks (ZeRO stage, clipping)", "configs/deepspeed/zero1.json")
    repeats: int = doc("runs of each (mode, N), interleaved; figures are medians", 1)
    threads: int = doc("torch CPU threads of each rank", 1)
    timeout_s: float = doc("seconds one run may take before it is stopped (counted as failed)", 900.0)
    out: str = doc("run directory (the buffer, one directory per run, logs)", "runs/bench_ranks")

    def __post_init__(self):
        try:
            counts = [int(x) for x in self.ranks.split(",")]
        except ValueError:
            raise ConfigError(f"ranks: must be integers separated by commas, got {self.ranks!r}") from None
        check(counts and all(n >= 1 for n in counts), "ranks", f"must be >= 1 each, got {self.ranks!r}")
        check(all(m in MODES for m in self.mode_list), "modes", f"must be among {MODES}, got {self.modes!r}")
        check(self.steps > self.warmup_steps >= 1, "steps", "must exceed warmup_steps, which must be >= 1")
        check(self.batch_tokens >= 1 and self.rows >= self.batch_tokens, "rows", "must be >= batch_tokens >= 1")
        check(self.repeats >= 1 and self.threads >= 1, "repeats", "repeats and threads must be >= 1")
        if self.trainer_devices:
            devs = self.trainer_devices.split(",")
            check(all(d.strip().isdigit() for d in devs) and len(devs) >= max(counts), "trainer_devices",
                  f"must name at least {max(counts)} GPU indices, got {self.trainer_devices!r}")

    @property
    def rank_counts(self) -> list[int]:
        return [int(x) for x in self.ranks.split(",")]

    @property
    def mode_list(self) -> list[str]:
        return [m.strip() for m in self.modes.split(",") if m.strip()]


QUICK = {"steps": 8, "warmup_steps": 2, "batch_tokens": 256, "rows": 3000, "max_len": 256, "modes": "strong"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, RanksBenchConfig, QUICK)


def token_lists(cfg: RanksBenchConfig, tokenizer) -> list[list[int]]:
    """Conversations as token ids, until `cfg.rows` rows (each list gives len - 1 rows)."""
    if cfg.tokens_file:
        lists = json.loads(Path(cfg.tokens_file).read_text())
        if not (isinstance(lists, list) and all(isinstance(t, list) and len(t) >= 2 for t in lists)):
            raise ConfigError(f"tokens_file: {cfg.tokens_file} must hold a JSON list of token-id lists")
        source = (t[:cfg.max_len] for t in lists)
    else:
        from online_spec.data import sharegpt_conversations

        source = (encode_conversation(tokenizer, c, cfg.max_len) for c in sharegpt_conversations(split="train"))
    out, rows = [], 0
    for ids in source:
        if len(ids) >= 3:
            out.append(ids)
            rows += len(ids) - 1
        if rows >= cfg.rows:
            return out
    raise ConfigError(f"rows: the traffic holds {rows} rows, fewer than the {cfg.rows} asked for")


def build_buffer(cfg: RanksBenchConfig, root: Path) -> dict:
    """Capture the traffic through the target into a replay buffer at `root`; its stats."""
    target = load_target(cfg.target or None, device=cfg.device)
    lists = token_lists(cfg, target.tokenizer)
    shutil.rmtree(root, ignore_errors=True)
    buf = ReplayBuffer(ReplayConfig(root=str(root), heldout_every=0))
    batch: list[list[int]] = []
    for i, ids in enumerate(lists):
        batch.append(ids)
        if sum(len(t) for t in batch) >= 8192 or i == len(lists) - 1:
            first = i - len(batch) + 1
            for rec in capture_tokens(target, batch, [f"bench-ranks-{first + j}" for j in range(len(batch))]):
                buf.add(CaptureSpan.from_records([rec]))
            batch = []
    buf.flush()
    stats = {"spans": len(buf), "rows": buf.num_tokens, "bytes": buf.nbytes}
    buf.close()
    del target
    _free_device_memory()
    return stats


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def train_command(cfg: RanksBenchConfig, n: int, batch_tokens: int, run_dir: Path) -> list[str]:
    never = str(10 ** 9)
    cmd = [sys.executable, "-m", "online_spec.cli", "train", "--ranks", str(n), "--device", cfg.device,
           "--run-dir", str(run_dir), "--capture-endpoint", f"ipc://{run_dir}/no-server.sock",
           "--batch-tokens", str(batch_tokens), "--min-buffer-tokens", "1", "--max-steps", str(cfg.steps),
           "--eval-every-steps", never, "--eval-every-s", never, "--save-every-steps", never,
           "--rank-journal", "--rank-check-every", "0", "--distill-deepspeed-config", cfg.deepspeed_config,
           "--replay-heldout-every", "0", "--wandb-mode", "disabled", "--threads", str(cfg.threads)]
    if cfg.target:
        cmd += ["--target", cfg.target]
    if cfg.trainer_devices:
        cmd += ["--trainer-devices", ",".join(cfg.trainer_devices.split(",")[:n])]
    return cmd


def journal_figures(run_dir: Path, n: int, warmup: int) -> dict:
    """steps/s and rows/s after `warmup` steps, from the ranks' journals (`trainer/ranks.py`)."""
    lines = [[json.loads(x) for x in (run_dir / "ranks" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(n)]
    steps = [x["step"] for x in lines[0]]
    if len(steps) <= warmup + 1:
        raise RuntimeError(f"{run_dir}: rank 0 journaled {len(steps)} steps, too few past the warm-up")
    t = [x["time"] for x in lines[0]]
    timed = len(steps) - 1 - warmup  # steps between the warm-up's last and the run's last
    seconds = t[-1] - t[warmup]
    rows = sum(x["rows"] for rank in lines for x in rank if x["step"] > steps[warmup])
    per_rank = [statistics.median(x["rows"] for x in rank[warmup + 1:]) for rank in lines]

    timed_lines = [rank[warmup + 1:] for rank in lines]
    parts = ("wait_s", "train_s", "agree_s", "after_s")

    def med(key: str) -> list:
        return [round(1e3 * statistics.median(x.get(key, 0.0) for x in rank), 2) for rank in timed_lines]
    means = [{k: statistics.fmean(x.get(k, 0.0) for x in rank) for k in parts} for rank in timed_lines]
    cycle_s = seconds / timed
    return {"steps": len(steps), "timed_steps": timed, "seconds": round(seconds, 3),
            "steps_per_s": round(timed / seconds, 3), "rows_per_s": round(rows / seconds, 1),
            "rows_per_rank_step_median": per_rank,
            # per rank, median ms a step waited for its micro-batch (data-bound when large) and trained
            "wait_ms_median": med("wait_s"), "train_ms_median": med("train_s"),
            "agree_ms_median": med("agree_s"), "after_ms_median": med("after_s"),
            # means, and what a step took in all (journal line to journal line) beyond the parts:
            # the loop around the steps, and stalls a median hides
            "ms_mean": {k.removesuffix("_s"): [round(1e3 * m[k], 2) for m in means] for k in parts},
            "cycle_ms_mean": round(1e3 * cycle_s, 2),
            "unaccounted_ms_mean": [round(1e3 * (cycle_s - sum(m.values())), 2) for m in means],
            # the data pipe's parts per rank (`trainer/rank_data.py`), built while the step before
            # trained: rank 0 draw / read / pack / send / own, a receiver recv (its wait for rank 0
            # included) / read / build
            "pipe_ms_median": [{k: round(statistics.median(x["pipe"][k] for x in rank if k in x.get("pipe", {})), 2)
                                for k in sorted({k for x in rank for k in x.get("pipe", {})})} for rank in timed_lines],
            # per rank > 0, the share of its spans that went by name (read from the buffer's directory)
            "named_share": [round(sum(x.get("named", 0) for x in rank)
                                  / max(1, sum(len(x.get("spans", ())) for x in rank)), 3) for rank in timed_lines[1:]],
            # padding: the rows a step computes (batch rows x its longest) over those it trains on
            "padded_over_rows_median": [round(statistics.median(x.get("padded", x["rows"]) / x["rows"]
                                                                for x in rank), 3) for rank in timed_lines]}


def step_rows(cfg: RanksBenchConfig, mode: str, n: int) -> int:
    """`--batch-tokens` of the run of `n` ranks: the step's rows (strong), n x a rank's (weak)."""
    return cfg.batch_tokens if mode == "strong" else cfg.batch_tokens * n


def run_once(cfg: RanksBenchConfig, buffer: Path, mode: str, n: int, rep: int) -> dict:
    run_dir = Path(cfg.out) / f"{mode}_r{n}_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shutil.copytree(buffer, run_dir / "replay")
    batch_tokens = step_rows(cfg, mode, n)
    cmd = train_command(cfg, n, batch_tokens, run_dir)
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS} | NVLS_OFF | {
        "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(run_dir / "train.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=cfg.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"mode": mode, "ranks": n, "repeat": rep, "batch_tokens": batch_tokens, "rc": rc,
           "wall_s": round(time.monotonic() - t0, 1)}
    if rc != 0:
        tail = (run_dir / "train.log").read_text(errors="replace").splitlines()[-15:]
        return {**out, "error": "\n".join(tail)}
    return {**out, **journal_figures(run_dir, n, cfg.warmup_steps)}


def scaling(runs: list[dict], counts: list[int], mode: str) -> dict:
    """Per N: median steps/s and rows/s, their scaling over the first N and efficiency."""
    med = {}
    for n in counts:
        ok = [r for r in runs if r["mode"] == mode and r["ranks"] == n and "steps_per_s" in r]
        if ok:
            med[n] = {k: statistics.median(r[k] for r in ok) for k in ("steps_per_s", "rows_per_s")}
    base = med.get(counts[0])
    out = {}
    for n, m in med.items():
        row = {**m}
        if base:
            for k in ("steps_per_s", "rows_per_s"):
                row[f"{k}_scaling"] = round(m[k] / base[k], 3)
                row[f"{k}_efficiency"] = round(m[k] / base[k] / (n / counts[0]), 3)
        out[str(n)] = row
    return out


def run_bench(cfg: RanksBenchConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    buffer = out / "buffer"
    t0 = time.monotonic()
    stats = build_buffer(cfg, buffer)
    print(f"buffer: {stats['rows']} rows in {stats['spans']} spans ({time.monotonic() - t0:.0f} s)", flush=True)
    runs = []
    for rep in range(cfg.repeats):
        done: dict[tuple[int, int], dict] = {}  # (N, --batch-tokens): this repeat's run of that command
        for mode in cfg.mode_list:
            for n in cfg.rank_counts:
                same = done.get((n, step_rows(cfg, mode, n)))
                if same is None:
                    r = done[n, step_rows(cfg, mode, n)] = run_once(cfg, buffer, mode, n, rep)
                else:
                    r = {**same, "mode": mode, "same_run_as": f"{same['mode']}_r{n}_{rep}"}
                print(f"{mode} {n} rank(s), repeat {rep}: " + (f"{r['steps_per_s']} steps/s, {r['rows_per_s']} "
                      f"rows/s" if "steps_per_s" in r else f"failed ({r['rc']})")
                      + (f" (the run of {r['same_run_as']})" if same else ""), flush=True)
                runs.append(r)
    figures = {mode: scaling(runs, cfg.rank_counts, mode) for mode in cfg.mode_list}
    return {"config": config_to_dict(cfg), "buffer": stats, "scaling": figures, "runs": runs,
            "note": "steps_per_s_scaling: strong mode (one step's rows split across the ranks); rows_per_s_"
                    "scaling: weak mode (each rank a full step); efficiency = scaling / (N / N_first)"}


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(RanksBenchConfig, args, **quick_overrides(args, QUICK))
    report = run_bench(cfg)
    write_report(args.json, report, show=["scaling"])
    return 0 if all("steps_per_s" in r for r in report["runs"]) else 1
