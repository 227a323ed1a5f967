"""`online-spec bench cuts`: do the cost policy's in-round cuts pay on this device?

The cost policy can stop drafting early (`should_continue` after each draft step) and verify
fewer drafts than it drafted (`verify_lengths`); the engine asks for them where
`EngineConfig.in_round_cuts` is on. Each costs Python on the engine's thread inside every round
(and the early stop keeps a greedy batch off the fused draft chain, which reads back once for
all K steps), so they serve only where they earn more than they cost. This bench serves the same
prompts with the cost policy as `serve --policy cost --plan-ahead` runs it (calibrated on this
device, planned ahead on its worker thread), cuts on and cuts off, interleaved within each repeat
(on/off, then off/on), and reports per batch size:

    tokens_per_s            each arm's median over the repeats
    on_over_off             median of the repeats' paired ratios (cuts on / cuts off), and
    on_over_off_range       their lowest and highest: the cuts measurably pay where even the
                            lowest is above 1 (`verdict` "pay"), measurably cost where even the
                            highest is below 1 ("cost"), else "within noise" (three repeats at
                            least)
    decision_us             each arm's median over the repeats of its rounds' median
                            `RoundStats.policy_s` (the policy's calls on the engine thread)
    drafted, verified, accepted   mean drafts made, drafts verified and drafts accepted per
                            request-round
    same_tokens             every arm of the batch size produced the same tokens (greedy; fp32
                            must, bf16 may part at near-ties)

    online-spec bench cuts --json bench/results/bench_cuts.json [--quick]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import add_bench_args, quick_overrides, write_report
from bench.heads import resolve_head
from online_spec.checkpoint import load_head
from online_spec.config import ConfigError, check, config_from_args, config_to_dict, doc
from online_spec.data import sharegpt_conversations
from online_spec.sampling import SamplingParams
from online_spec.target import load_target
from serving.calibrate import engine_cost_policy
from serving.engine import Engine, EngineConfig
from serving.policy_planner import PlannedPolicy

log = logging.getLogger(__name__)


@dataclass
class CutsBenchConfig:
    draft: str = doc("head: shipped | code | sharegpt | a head checkpoint directory", "shipped")
    batch_sizes: list[int] = doc("batch sizes served", lambda: [1, 4, 16])
    repeats: int = doc("paired repeats per batch size (each runs both arms, the order alternating)", 3)
    new_tokens: int = doc("tokens generated per request", 64)
    requests_per_run: int = doc("requests per timed run (at least 2 x the batch size are served)", 8)
    max_steps: int = doc("the policy's largest K (its candidates: 0..max_steps)", 7)
    dtype: str = doc("target dtype: auto (bf16 on a CPU with native bf16, else fp32) | float32 | bfloat16", "auto")
    device: str = doc("torch device of the target and head", "cpu")
    threads: int = doc("torch CPU threads (0 = torch's default)", 2)

    def __post_init__(self):
        check(bool(self.batch_sizes) and all(isinstance(b, int) and b >= 1 for b in self.batch_sizes),
              "batch_sizes", "must be ints >= 1")
        check(self.repeats >= 1, "repeats", "must be >= 1")
        check(self.new_tokens >= 1 and self.requests_per_run >= 1, "new_tokens",
              "new_tokens and requests_per_run must be >= 1")
        check(self.max_steps >= 1, "max_steps", "must be >= 1")
        check(self.threads >= 0, "threads", "must be >= 0")


QUICK = dict(batch_sizes=[1, 4], repeats=2, new_tokens=24, requests_per_run=4)


def served_run(target, head, base, prompts: list[list[int]], batch: int, cfg: CutsBenchConfig, cuts: str) -> dict:
    """One arm of one repeat: a fresh planned copy of the calibrated policy, an untimed run of
    `batch` prompts (the policy learns this batch size), then the timed run of all `prompts`."""
    policy = PlannedPolicy(copy.deepcopy(base))
    try:
        eng = Engine(target, head, EngineConfig(max_batch=batch, max_len=1024, max_steps=cfg.max_steps,
                                                in_round_cuts=cuts), policy=policy)
        sp = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True)
        eng.generate(prompts[:batch], sp)
        rounds = []
        eng.on_round.append(lambda stats, outs: rounds.append(stats))
        t0 = time.perf_counter()
        outs = eng.generate(list(prompts), sp)
        seconds = time.perf_counter() - t0
    finally:
        policy.close()
    drafted = [s for s in rounds if s.drafted_steps]
    per_request = sum(s.batch_size for s in rounds)
    return {"tokens_per_s": sum(len(o) for o in outs) / seconds,
            "decision_us": statistics.median(s.policy_s * 1e6 for s in rounds),
            "drafted": sum(s.drafted_steps * s.batch_size for s in drafted) / per_request,
            "verified": sum(s.num_steps * s.batch_size for s in rounds) / per_request,
            "accepted": sum(sum(s.accepted) for s in rounds) / per_request,
            "rounds": len(rounds), "outputs": outs}


def verdict(ratios: list[float]) -> str:
    """"pay" where every paired ratio is above 1, "cost" where every one is below, else "within
    noise"; "too few repeats" under three (one way by chance: 1 in 4 or more)."""
    if len(ratios) < 3:
        return "too few repeats"
    if min(ratios) > 1.0:
        return "pay"
    return "cost" if max(ratios) < 1.0 else "within noise"


def run_bench(cfg: CutsBenchConfig, target, head, prompts: list[list[int]]) -> dict:
    base, model_report = engine_cost_policy(target, head, max(cfg.batch_sizes), cfg.max_steps, max_len=1024)
    out = {}
    for b in cfg.batch_sizes:
        ps = prompts[:max(cfg.requests_per_run, 2 * b)]
        arms: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(cfg.repeats):
            for cuts in ("on", "off") if r % 2 == 0 else ("off", "on"):
                run = served_run(target, head, base, ps, b, cfg, cuts)
                arms[cuts].append(run)
                log.info("cuts b=%d repeat %d %s: %.1f tok/s, decisions %.1f us a round, drafted %.2f verified "
                         "%.2f accepted %.2f", b, r + 1, cuts, run["tokens_per_s"], run["decision_us"],
                         run["drafted"], run["verified"], run["accepted"])
        ratios = [a["tokens_per_s"] / o["tokens_per_s"] for a, o in zip(arms["on"], arms["off"])]
        first = arms["on"][0]["outputs"]
        row = {"on_over_off": statistics.median(ratios), "on_over_off_range": [min(ratios), max(ratios)],
               "verdict": verdict(ratios), "paired_ratios": ratios,
               "same_tokens": all(run["outputs"] == first for runs in arms.values() for run in runs)}
        for cuts, runs in arms.items():
            row[cuts] = {k: statistics.median(run[k] for run in runs)
                         for k in ("tokens_per_s", "decision_us", "drafted", "verified", "accepted")}
            row[cuts]["tokens_per_s_repeats"] = [run["tokens_per_s"] for run in runs]
        out[str(b)] = row
        log.info("cuts b=%d: on / off %.3f (%.3f-%.3f, %s); decisions %.1f / %.1f us a round", b,
                 row["on_over_off"], *row["on_over_off_range"], row["verdict"], row["on"]["decision_us"],
                 row["off"]["decision_us"])
    return {"config": config_to_dict(cfg), "cost_model": model_report, "by_batch": out}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, CutsBenchConfig, QUICK, "a few-minute version")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        cfg = config_from_args(CutsBenchConfig, args, **quick_overrides(args, QUICK))
        draft = Path(resolve_head(cfg.draft))
    except ConfigError as e:
        print(f"online-spec bench cuts: error: {e}")
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(dtype=cfg.dtype, device=cfg.device)
    head, _ = load_head(draft, target.info, dtype=target.dtype, device=target.device)
    n = max([cfg.requests_per_run] + [2 * b for b in cfg.batch_sizes])
    convs = sharegpt_conversations(limit=n, seed=5, split="heldout", max_prompt_tokens=160,
                                   tokenizer=target.tokenizer)
    prompts = [target.encode_chat(c[:1]) for c in convs]
    figures = run_bench(cfg, target, head, prompts)
    write_report(args.json, {"quick": bool(args.quick), "head": str(draft),
                             "dtype": str(target.dtype).removeprefix("torch."), **figures},
                 show=["by_batch"])
    return 0
