"""Offline probe: how the daemon's learning rate and replay sampling trade learning new traffic
against forgetting old traffic, on a real run's captured stream.

Replays the spans a trainer daemon stored (its `replay/` directory, in arrival order) into a fresh
`ReplayBuffer` with the daemon's sampling, interleaving optimizer steps with arrivals as the daemon
would (`--steps` spread evenly over the spans), from the shipped head, for each `--lr`; then
measures each resulting head two ways, neither on anything it trained on:

- `stream_heldout`: simulated accept length at K = `--num-steps` over the generated rows of the
  stream's held-out requests, per traffic tag (`trainer.evaluate.simulate_acceptance`,
  generated_only; one request in 4, by the buffer's hash, never enters training). The built-in
  trace repeats its ~40 HumanEval tasks, so "code" here is new requests of tasks trained on:
  what serving that trace sees, not new code;
- `unseen`: drafts accepted per round on the engine (batch 1, greedy) for ShareGPT held-out
  prompts and HumanEval tasks that are not in the stream at all (a prompt is in the stream when
  a stored span starts with its tokens). Before 2026-11-23 (late) this probe drew the first held-out
  prompts, which the built-in trace contains: every one of them had been trained on.

    PYTHONPATH=$PWD python scripts/forgetting_probe.py --replay RUN/online_spec/trainer/replay \
        --gens 0-6 --steps 130 --lr 1e-3 3e-4 --json /tmp/forgetting.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", required=True, help="a daemon's replay/ directory (read only)")
    ap.add_argument("--gens", default="0-6", help="generations to replay, inclusive range")
    ap.add_argument("--steps", type=int, default=130)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-4])
    ap.add_argument("--anchor", type=float, default=0.0, help="DistillConfig.anchor (pull toward the shipped head)")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--recent-fraction", type=float, default=0.5)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--whole-spans", action="store_true", help="ReplayConfig.whole_spans (no cut windows)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--num-steps", type=int, default=3, help="K of the engine measurement")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)

    from collector.replay import ReplayBuffer, ReplayConfig
    from online_spec.checkpoint import load_head
    from bench.heads import resolve_head
    from online_spec.target import load_target
    from trainer.batch import collate
    from trainer.distill import DistillConfig, Distiller
    from trainer.evaluate import engine_accept_length
    from trainer.loss import LossConfig
    from collector.replay import is_heldout
    from online_spec.data import humaneval_conversations, sharegpt_conversations
    from trainer.evaluate import simulate_acceptance

    lo, hi = (int(x) for x in args.gens.split("-"))
    src = ReplayBuffer(ReplayConfig(root=args.replay))
    spans = [span for gen, span in src.stored_spans() if lo <= gen <= hi]
    heldout = [s for s in spans if is_heldout(s.request_id, 4)]
    tags = sorted({s.tag for s in heldout})
    target = load_target()
    in_stream = {tuple(s.tokens[:int(s.is_prefill.sum())].tolist()) for s in spans if s.first_pos == 0}
    pools = {"humaneval": humaneval_conversations(split="all"),
             "sharegpt": sharegpt_conversations(limit=len(in_stream) + 20 * args.prompts, split="heldout",
                                                max_prompt_tokens=200, tokenizer=target.tokenizer)}
    prompts = {name: [p for p in (target.encode_chat(c[:1]) for c in convs)
                      if tuple(p) not in in_stream][:args.prompts] for name, convs in pools.items()}
    shipped = resolve_head("shipped", target)

    def measure(head) -> dict:
        sim = {tag: simulate_acceptance(head, target, [s for s in heldout if s.tag == tag], args.num_steps,
                                        ks=(args.num_steps,), generated_only=True)["accept_length"][str(args.num_steps)]
               for tag in tags}
        return {"stream_heldout": sim,
                "unseen": {name: engine_accept_length(target, head, p, args.num_steps,
                                                      max_tokens=args.max_tokens)["accept_length"]
                           for name, p in prompts.items()}}

    out = {"args": vars(args), "spans": len(spans), "heldout_spans": len(heldout),
           "unseen_prompts": {name: len(p) for name, p in prompts.items()}, "shipped": measure(load_head(shipped, target.info,
                                                                              dtype=target.dtype)[0])}
    print("shipped", out["shipped"], flush=True)
    out["runs"] = []
    for lr in args.lr:
        head, _ = load_head(shipped, target.info, dtype=torch.float32)
        dist = Distiller(target, head, DistillConfig(lr=lr, schedule="constant", warmup_steps=args.warmup_steps,
                                                       anchor=args.anchor),
                         LossConfig())
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as root:
            cfg = dict(root=root, shard_bytes=8 << 30, budget_bytes=16 << 30, memory_bytes=256 << 20,
                       flush_interval_s=1e9, heldout_every=4, recent_fraction=args.recent_fraction,
                       whole_spans=args.whole_spans)
            buf = ReplayBuffer(ReplayConfig(**cfg))
            for i, span in enumerate(spans):
                buf.add(span)
                while dist.step < round(args.steps * (i + 1) / len(spans)):
                    dist.train_step(collate(buf.sample_train(args.batch_tokens)))
        train_s = time.monotonic() - t0
        res = {"lr": lr, "anchor": args.anchor, "whole_spans": args.whole_spans, "rows": dist.tokens,
               "steps": dist.step, "train_s": round(train_s, 1),
               **measure(dist.head.to(dtype=target.dtype).eval())}
        print(res, flush=True)
        out["runs"].append(res)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
