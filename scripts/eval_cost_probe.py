"""What the trainer's simulated evaluations cost on real traffic: the gate's and a seed check's.

The daemon scores heads on captured spans (trainer/evaluate.record_counts): the gate the
candidate on the newest held-out requests (`--eval-tokens` rows, each request's prompt and up to
`--eval-generated-rows` generated rows, `--eval-max-steps` steps), a seed check each seed on the
newest generated rows (`--seed-rows`, `--seed-steps`). This probe times both on a finished run's
replay buffer, with a head of your choice, on one thread, so two checkouts of the code can be
compared on the same spans (run it with each on PYTHONPATH; the counts it prints must agree).

    PYTHONPATH=$PWD python scripts/eval_cost_probe.py --replay RUN/online_spec/trainer/replay \
        --head /tmp/heads/sharegpt-chat-h100 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replay", required=True, help="a run's replay buffer directory")
    p.add_argument("--head", required=True)
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--eval-generated-rows", type=int, default=128)
    p.add_argument("--eval-steps", default="7,3", help="gate simulation depths to time, comma-separated")
    p.add_argument("--seed-rows", type=int, default=1024)
    p.add_argument("--seed-steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from collector.replay import ReplayBuffer, ReplayConfig
    from online_spec.heads import load_draft
    from online_spec.target import load_target
    from trainer.evaluate import record_counts

    torch.set_num_threads(1)
    target = load_target()
    head, _, _ = load_draft(args.head, target, dtype=target.dtype)
    head = head.to(target.dtype).eval()
    buf = ReplayBuffer(ReplayConfig(root=args.replay))
    gate = buf.heldout(args.eval_tokens, newest=True, generated=True, max_generated=args.eval_generated_rows)
    # a seed check's window: whole spans, newest first, up to seed_rows generated rows (as
    # SeedWatch.window takes them; held-out spans here, for a sample both checkouts read alike)
    window, rows = [], 0
    for span in buf.heldout(16 * args.seed_rows, newest=True):
        if rows >= args.seed_rows:
            break
        window.append(span)
        rows += int((~span.is_prefill).sum())

    def timed(spans, steps):
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hits, eligible = record_counts(head, target, spans, steps, generated_only=True)
            out.append(time.perf_counter() - t0)
        return statistics.median(out), hits.sum(0).tolist(), eligible.sum(0).tolist()

    res = {"probe": "eval_cost", "config": vars(args),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=False, cwd=Path(__file__).resolve().parent).stdout.strip(),
           "gate": {"spans": len(gate), "rows": sum(s.num_rows for s in gate)},
           "seed": {"spans": len(window), "rows": sum(s.num_rows for s in window), "generated_rows": rows}}
    for steps in (int(s) for s in args.eval_steps.split(",")):
        sec, hits, eligible = timed(gate, steps)
        res["gate"][f"seconds_k{steps}"], res["gate"][f"hits_k{steps}"], res["gate"][f"eligible_k{steps}"] = \
            sec, hits, eligible
    sec, hits, eligible = timed(window, args.seed_steps)
    res["seed"].update(seconds=sec, hits=hits, eligible=eligible)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
