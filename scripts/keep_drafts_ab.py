"""A/B in one process: a greedy chain's drafts read back before the verify, or kept on the device
until the verify's read-back (`ChainRounds.keep_drafts`, serving/chain_round.py).

For each batch size and static K, one engine (CUDA graphs where the device has them, the shipped
head) serves the same prompts with `keep_drafts` off and on, alternating which goes first, after
an untimed warm-up of each; plain decoding (K = 0) is timed in the same rotation. Reports each
arm's tokens/s (median of --reps), the median of the paired ratios kept / before, and whether
the two arms' outputs were identical in every repeat (they must be: only the read-back moves).

    python3 scripts/keep_drafts_ab.py --prompts-file engine_prompts.json --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.heads import resolve_head  # noqa: E402
from online_spec.checkpoint import load_head  # noqa: E402
from online_spec.sampling import SamplingParams  # noqa: E402
from online_spec.target import load_target  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402


def timed(eng: Engine, prompts: list, sp: SamplingParams, cuda: bool) -> tuple[float, list]:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate(list(prompts), sp)
    if cuda:
        torch.cuda.synchronize()
    return sum(len(o) for o in outs) / (time.perf_counter() - t0), outs


def add_common(ap: argparse.ArgumentParser, new_tokens: int) -> None:
    """The options every in-process engine A/B of these scripts takes."""
    ap.add_argument("--prompts-file", required=True, help="bench engine --save-prompts JSON (token ids per set)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="prompts served per run (at most the batch at a time)")
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", required=True)


def load(a: argparse.Namespace):
    """-> (target, whether it is on CUDA, the shipped head on its device, prompt sets, sampling)."""
    target = load_target(device=a.device, dtype=getattr(torch, a.dtype))
    head, _ = load_head(resolve_head("shipped", target), target.info, dtype=target.dtype)
    sets = json.loads(Path(a.prompts_file).read_text())
    return (target, target.device.type == "cuda", head.to(target.device), sets,
            SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(ap, 64)
    ap.add_argument("--data", default="chat")
    ap.add_argument("--steps", default="2,3,5")
    a = ap.parse_args(argv)
    target, cuda, head, sets, sp = load(a)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "dtype": a.dtype, "data": a.data, "requests": a.requests, "new_tokens": a.new_tokens,
                 "reps": a.reps, "cases": []}
    for B in [int(x) for x in a.batches.split(",")]:
        prompts = sets[a.data][:max(B, a.requests)]
        plain = Engine(target, None, EngineConfig(max_batch=B, max_len=1024, num_steps=0))
        engines = {K: Engine(target, head, EngineConfig(max_batch=B, max_len=1024, num_steps=K))
                   for K in [int(x) for x in a.steps.split(",")]}
        timed(plain, prompts, sp, cuda)  # graphs captured, caches warm
        for eng in engines.values():
            for keep in (False, True):
                eng.keep_drafts = keep
                timed(eng, prompts, sp, cuda)
        plain_tps = []
        arms = {K: {True: [], False: [], "same": True} for K in engines}
        for r in range(a.reps):
            plain_tps.append(timed(plain, prompts, sp, cuda)[0])
            for K, eng in engines.items():
                outs = {}
                for keep in ((False, True) if r % 2 == 0 else (True, False)):
                    eng.keep_drafts = keep
                    tps, outs[keep] = timed(eng, prompts, sp, cuda)
                    arms[K][keep].append(tps)
                arms[K]["same"] &= outs[True] == outs[False]
        p = statistics.median(plain_tps)
        for K, arm in arms.items():
            ratios = [k / b for k, b in zip(arm[True], arm[False])]
            case = {"batch": B, "k": K, "plain_tokens_per_s": round(p, 1),
                    "before_tokens_per_s": round(statistics.median(arm[False]), 1),
                    "kept_tokens_per_s": round(statistics.median(arm[True]), 1),
                    "kept_over_before": round(statistics.median(ratios), 4),
                    "kept_over_before_range": [round(min(ratios), 4), round(max(ratios), 4)],
                    "kept_over_plain": round(statistics.median(arm[True]) / p, 4),
                    "before_over_plain": round(statistics.median(arm[False]) / p, 4),
                    "identical_outputs": arm["same"]}
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if all(c["identical_outputs"] for c in out["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
