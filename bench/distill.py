"""`online-spec bench distill`: distillation throughput, held-out and real accept lengths, speedup.

    online-spec bench distill --json out/bench_distill.json [--quick] [--head shipped|code|sharegpt|day0|DIR]

Writes: `train_tokens_per_s` (Distiller steps on real ShareGPT records on this CPU: bf16 autocast where it computes bf16 natively, else fp32),
`heldout_accept_length` {"sharegpt"|"humaneval": {"1","3","5","7": simulated accept length}} of
the head (`--head`, resolved by bench.heads like every bench's; default: the shipped chat head), `engine` (real accept
length and tokens/s per K at batch 1 on held-out ShareGPT prompts, median of repeats, plain
decoding in the same run), `engine_speedup_vs_plain` (best K over plain), `trained_tokens`, and
(`bench.common.write_report`) the date, command and machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import write_report
from bench.heads import HEAD_CHOICES, resolve_head
from online_spec.data import humaneval_conversations, sharegpt_conversations
from online_spec.target import load_target
from trainer.batch import collate
from trainer.data import capture_conversations
from trainer.evaluate import engine_accept_length, simulate_acceptance
from trainer.loss import LossConfig

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="fewer records, prompts and repeats")
    parser.add_argument("--head", default="shipped", help=f"head: {HEAD_CHOICES} (default: shipped)")
    parser.add_argument("--ks", type=json.loads, default=None, help="JSON list of K to run (0 = plain); "
                        "default [0,1,3,5,7] ([0,3,5] with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per K (median); default 3 (1 quick)")
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts; default 8 (3 quick)")
    parser.add_argument("--records", type=int, default=None,
                        help="held-out teacher-forced rows per source for the simulation; default 8000 (2000 quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 on a shared CPU; see PretrainConfig.threads)")


def heldout_records(target, source: str, tokens: int):
    convs = sharegpt_conversations(split="heldout") if source == "sharegpt" else humaneval_conversations(split="heldout")
    return list(capture_conversations(target, convs, 1024, tag=source, max_tokens=tokens))


def train_throughput(target, records, steps: int) -> float:
    # transformers comes with these two: `online-spec bench distill --help` imports this module
    from online_spec.head import new_head
    from trainer.distill import DistillConfig, Distiller, init_from_target

    head = init_from_target(new_head(target, 8192).float(), target)
    d = Distiller(target, head, DistillConfig(), LossConfig())
    d.train_step(collate(records[:1]))  # warm-up
    batches = [collate(records[i % len(records):i % len(records) + 1]) for i in range(1, steps + 1)]
    t0 = time.perf_counter()
    for b in batches:
        d.train_step(b)
    return sum(b.num_rows for b in batches) / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> int:
    from online_spec.checkpoint import load_head  # transformers: see train_throughput
    from online_spec.head import new_head

    torch.set_num_threads(args.threads)
    q = args.quick
    target = load_target()
    head_dir = resolve_head(args.head, target)
    head, meta = load_head(head_dir, target.info) if head_dir else (new_head(target), {})
    out: dict = {"head": head_dir or "day0", "trained_tokens": meta.get("trained_tokens")}
    recs = {s: heldout_records(target, s, args.records or (2000 if q else 8000)) for s in ("sharegpt", "humaneval")}
    out["train_tokens_per_s"] = train_throughput(target, recs["sharegpt"], 2 if q else 6)
    out["heldout_accept_length"] = {s: simulate_acceptance(head, target, r)["accept_length"] for s, r in recs.items()}
    convs = sharegpt_conversations(limit=args.prompts or (3 if q else 8), split="heldout", max_prompt_tokens=200,
                                   tokenizer=target.tokenizer)
    prompts = [target.encode_chat(c[:1]) for c in convs]
    max_tokens, repeats = (48, 1) if q else (96, 3)
    repeats = args.repeats or repeats
    engine = {}
    ks = args.ks or ((0, 3, 5) if q else (0, 1, 3, 5, 7))
    # repeats outside, K inside: on a shared CPU the load drifts, and a K measured only in one
    # stretch of time would carry that stretch's load (another job finishing while plain decoding
    # runs can make it look half as fast as K = 1 with accept length 0.3)
    runs: dict[int, list] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            runs[k].append(engine_accept_length(target, head, prompts, k, max_tokens))
    for k in ks:
        engine[str(k)] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[k]),
                          "accept_length": statistics.median(r["accept_length"] for r in runs[k])}
    best = max((k for k in engine if k != "0"), key=lambda k: engine[k]["tokens_per_s"])
    out["engine"] = engine
    out["engine_best_k"] = int(best)
    out["engine_speedup_vs_plain"] = engine[best]["tokens_per_s"] / engine["0"]["tokens_per_s"]
    write_report(args.json, out)
    return 0
