"""What a neighbour process on the other core costs the target's decoding, by the kind of work it does.

The trainer beside a server on a CPU runs at niceness 19 and often on a core of its own, yet the
server slows while it steps. This probe separates the scheduler from the shared hardware: the
target decodes (prefill of `--prompt` tokens, then `--new` tokens at batch `--batch`, one torch
thread) alone and beside a neighbour process started with `nice -n 19`, in turn:

    none     nothing beside it
    spin     a Python loop (the CPU busy, no memory traffic)
    matmul   a torch 2048x2048 matmul loop on one thread (what a training step's kernels do)
    lm_head  a torch matmul against a 49,152 x 576 matrix (the trainer's vocabulary projection)

Each setting is timed `--runs` times (median) per round, `--rounds` rounds in turn; reported:
the median seconds per setting and its ratio to `none` in each round, and the median ratio.

    PYTHONPATH=$PWD python scripts/neighbour_probe.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

NEIGHBOURS = {
    "none": None,
    "spin": "while True: pass",
    "matmul": "import torch\ntorch.set_num_threads(1)\na = torch.randn(2048, 2048)\nwhile True: a @ a",
    "lm_head": "import torch\ntorch.set_num_threads(1)\nw = torch.randn(49152, 576)\nx = torch.randn(256, 576)\n"
               "while True: x @ w.T",
}


def decode_seconds(model, ids: torch.Tensor, new: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, ids[:, -1:]
        for _ in range(new):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=2.0, help="seconds a neighbour runs before the timing")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from online_spec.target import load_target

    torch.set_num_threads(1)
    target = load_target()
    ids = torch.randint(0, 1000, (args.batch, args.prompt))
    decode_seconds(target.hf, ids, 4)  # warm-up
    seconds: dict[str, list[float]] = {n: [] for n in NEIGHBOURS}
    for _ in range(args.rounds):
        for name, code in NEIGHBOURS.items():
            proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", code]) if code else None
            try:
                if proc:
                    time.sleep(args.settle_s)
                seconds[name].append(statistics.median(decode_seconds(target.hf, ids, args.new)
                                                       for _ in range(args.runs)))
            finally:
                if proc:
                    proc.kill()
                    proc.wait()
    ratios = {n: [s / b for s, b in zip(v, seconds["none"])] for n, v in seconds.items()}
    out = {"probe": "neighbour", "config": vars(args), "cpu": platform.processor() or platform.machine(),
           "torch": torch.__version__, "dtype": str(target.dtype), "seconds": seconds, "ratio_to_none": ratios,
           "median_ratio": {n: statistics.median(r) for n, r in ratios.items()}}
    print(json.dumps(out["median_ratio"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
