"""Offline ceiling of `bench adapt`: how far can a head get on HumanEval from its first N served tokens?

`bench adapt` (issue 5) asks the online loop to bring the shipped chat head to 90 % of a code
head's accept length within 3,000 served HumanEval tokens. The daemon is limited by its one CPU
core (tens of optimizer steps in that time) *and* by the data (3,000 tokens of ~25 tasks). This
probe removes the first limit: it trains the starting head, as the daemon would (its distillation
step, whole spans, AdamW, constant lr after a warmup), on the target's own greedy replies to the
first HumanEval held-out tasks until `--train-tokens` generated tokens, for as many steps as
asked, and measures simulated accept length (K = `--num-steps`, generated positions only) on the
*following* tasks — new tasks, as bench adapt serves each task once — next to the starting head
and the code reference on the same tasks. If no setting gets past 90 % of the reference here,
no trainer speed will in that many tokens.

    PYTHONPATH=$PWD python scripts/adapt_ceiling.py --train-tokens 1500 3000 --lr 3e-4 1e-3 \\
        --steps 30 100 --json bench/results/adapt_ceiling_2026-11-24.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="shipped", help="starting head (bench.heads)")
    ap.add_argument("--reference", default="code", help="in-domain reference head")
    ap.add_argument("--train-tokens", type=int, nargs="+", default=[1500, 3000])
    ap.add_argument("--eval-tasks", type=int, default=16, help="held-out tasks after the training ones")
    ap.add_argument("--max-new", type=int, default=128, help="tokens per reply (bench adapt: 128)")
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-4, 1e-3])
    ap.add_argument("--steps", type=int, nargs="+", default=[30, 100], help="evaluate after these steps")
    ap.add_argument("--batch-tokens", type=int, default=512, help="rows per step (bench adapt's daemon: 512)")
    ap.add_argument("--ttt", type=int, default=3, help="draft steps the loss unrolls (bench adapt: 3)")
    ap.add_argument("--num-steps", type=int, default=5, help="K of the simulated acceptance (bench adapt: 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))

    from online_spec.checkpoint import load_head
    from online_spec.data import humaneval_conversations
    from bench.heads import resolve_head
    from online_spec.target import load_target
    from trainer.batch import collate
    from trainer.data import generate_records
    from trainer.distill import DistillConfig, Distiller
    from trainer.evaluate import simulate_acceptance
    from trainer.loss import LossConfig
    from trainer.pretrain import plan_batches

    t0 = time.time()
    target = load_target(dtype=torch.bfloat16)
    # bench adapt's order of the held-out tasks (bench/adapt.py build_trace)
    tasks = humaneval_conversations(split="heldout", seed=a.seed)
    prompts = [target.encode_chat(c[:1]) for c in tasks]
    spans = list(generate_records(target, prompts, a.max_new, tag="code", id_prefix="he", max_batch=8))
    spans.sort(key=lambda s: int(str(s.request_id).rsplit("-", 1)[-1]))  # "he-<task index>": serving order
    gen = [s.num_rows - int(s.is_prefill.sum()) for s in spans]  # generated rows: what serving drafts
    print(f"generated {len(spans)} replies, {sum(gen)} generated rows, {time.time() - t0:.0f}s", flush=True)

    def simulate(head, records) -> float:  # on a bf16 copy (Module.to is in place), as serving drafts
        sim = simulate_acceptance(copy.deepcopy(head).to(torch.bfloat16).eval(), target, records,
                                  generated_only=True, ks=[a.num_steps])
        return float(sim["accept_length"][str(a.num_steps)])

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "args": vars(a), "runs": []}
    for n_tokens in a.train_tokens:
        cum, cut = 0, len(spans)
        for i, g in enumerate(gen):
            cum += g
            if cum >= n_tokens:
                cut = i + 1
                break
        train, evals = spans[:cut], spans[cut:cut + a.eval_tasks]
        if not evals:
            raise SystemExit(f"--train-tokens {n_tokens} leaves no task to evaluate on")
        start_head, _ = load_head(resolve_head(a.head, target, 16000), target.info)
        ref_head, _ = load_head(resolve_head(a.reference, target, 16000), target.info)
        base = {"train_tokens": sum(gen[:cut]), "train_tasks": cut, "eval_tasks": len(evals),
                "eval_rows": sum(gen[cut:cut + a.eval_tasks]),
                "start_accept": simulate(start_head, evals), "reference_accept": simulate(ref_head, evals)}
        print(json.dumps(base), flush=True)
        for lr in a.lr:
            head, _ = load_head(resolve_head(a.head, target, 16000), target.info)
            d = Distiller(target, head.float(), DistillConfig(lr=lr, schedule="constant", warmup_steps=10,
                                                               total_steps=max(a.steps), seed=a.seed),
                          LossConfig(ttt_steps=a.ttt))
            rows = sum(s.num_rows for s in train)
            batches = plan_batches(train, a.batch_tokens, math.ceil(max(a.steps) * a.batch_tokens / rows) + 1,
                                   a.seed)[:max(a.steps)]
            curve = []
            c0 = time.time()
            for i, idx in enumerate(batches, 1):
                d.train_step(collate([train[j] for j in idx]))
                if i in a.steps:
                    acc = simulate(d.head, evals)
                    curve.append({"steps": i, "accept": acc, "train_s": time.time() - c0})
                    print(json.dumps({"train_tokens": base["train_tokens"], "lr": lr, **curve[-1]}), flush=True)
            out["runs"].append({**base, "lr": lr, "curve": curve,
                                "ratio_to_reference": {c["steps"]: c["accept"] / base["reference_accept"] for c in curve}})
    out["wall_s"] = time.time() - t0
    with open(a.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {a.json}", flush=True)


if __name__ == "__main__":
    main()
