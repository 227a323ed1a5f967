"""One recipe probe: train a head on saved spans for a fixed number of passes, then measure held-out
simulated acceptance (generated positions only). Prints one JSON line (config, CPU seconds, result).

    PYTHONPATH=. python scripts/recipe_probe.py --train /tmp/probe/gen-train --heldout /tmp/probe/gen-heldout \\
        --tokens 30000 --batch-tokens 256 --lr 3e-3 --schedule wsd --ttt 3 --early-ttt 1 --early-frac 0.7
"""
import argparse, json, sys, time
from pathlib import Path
import torch

from collector.shards import load_spans
from online_spec.head import new_head
from online_spec.target import load_target
from trainer.batch import collate
from trainer.distill import DistillConfig, Distiller, init_from_target
from trainer.evaluate import simulate_acceptance
from trainer.loss import LossConfig
from trainer.pretrain import draft_vocab_counts, plan_batches


def spans_under(d, limit=None):
    out = []
    for p in sorted(Path(d).glob("part-*")):
        out += load_spans(p)
        if limit and sum(s.num_rows for s in out) >= limit:
            break
    return out


ap = argparse.ArgumentParser()
ap.add_argument("--train", nargs="+", required=True); ap.add_argument("--heldout", required=True)
ap.add_argument("--tokens", type=int, default=30000, help="unique training rows used")
ap.add_argument("--epochs", type=float, default=1.0)
ap.add_argument("--batch-tokens", type=int, default=256); ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--schedule", default="wsd"); ap.add_argument("--warmup", type=int, default=10)
ap.add_argument("--ttt", type=int, default=3); ap.add_argument("--early-ttt", type=int, default=0)
ap.add_argument("--early-frac", type=float, default=0.0); ap.add_argument("--vocab", type=int, default=8192)
ap.add_argument("--norm", default="one"); ap.add_argument("--fc", default="random")
ap.add_argument("--name", default=""); ap.add_argument("--log", default="/tmp/probe/probes.jsonl")
a = ap.parse_args()
torch.set_num_threads(int(__import__("os").environ.get("THREADS", "1")))
t = load_target(dtype=torch.bfloat16)
train = []
for d in a.train:
    train += spans_under(d, a.tokens - sum(s.num_rows for s in train))
heldout = spans_under(a.heldout)
steps = plan_batches(train, a.batch_tokens, a.epochs, 0)
dcfg = DistillConfig(lr=a.lr, schedule=a.schedule, warmup_steps=a.warmup, total_steps=len(steps), min_lr_ratio=0.1)
lcfg = LossConfig(ttt_steps=a.ttt, early_ttt_steps=a.early_ttt, early_fraction=a.early_frac)
counts = draft_vocab_counts(train, t.info.vocab_size)
head = init_from_target(new_head(t, a.vocab, counts).float(), t, norm=a.norm, fc=a.fc)
cov = float(counts[head.t2d].sum()) / int(counts.sum())
d = Distiller(t, head, dcfg, lcfg)
c0, w0 = time.process_time(), time.time()
for i, idx in enumerate(steps):
    m = d.train_step(collate([train[j] for j in idx]))
    if i % 20 == 0 or i == len(steps) - 1:
        print(f"step {i+1}/{len(steps)} loss {m['loss']:.3f} acc0 {m['acc_0']:.3f} cpu {time.process_time()-c0:.0f}s",
              file=sys.stderr, flush=True)
cpu, wall = time.process_time() - c0, time.time() - w0
sim = simulate_acceptance(d.head.to(torch.bfloat16).eval(), t, heldout, generated_only=True)
res = {"name": a.name, "args": vars(a), "steps": len(steps), "rows_trained": d.tokens, "unique_rows": sum(s.num_rows for s in train),
       "coverage": cov, "train_cpu_s": cpu, "train_wall_s": wall, "alpha": sim["alpha"], "accept_length": sim["accept_length"],
       "anchors": sim["anchors"], "date": time.strftime("%Y-%m-%d %H:%M")}
print(json.dumps(res), flush=True)
with open(a.log, "a") as f:
    f.write(json.dumps(res) + "\n")
