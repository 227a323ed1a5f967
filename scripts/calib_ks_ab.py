"""Does calibrating the cost model at every K pay? The same engine rounds, measured once at every
K from 0 to --max-steps, fitted twice: to the K subset the engine calibrated with (0, 1, 3, 7) and
to every K; each cost policy (chains only, and with --trees) serves the same prompts at one batch
size beside static K, interleaved within each repeat (the order rotating), in one process.

On CPU-ICX (fp32) a verify of 3 tokens a request at batch 4 took 225-236 ms against 173 ms for 4
(the 2026-12-07 interleaved e2e), so a model that interpolates K = 2 between K = 1 and K = 3 prices
it cheap; this measures what that costs the policy.

    PYTHONPATH=$PWD python scripts/calib_ks_ab.py --batch 4 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.heads import resolve_head  # noqa: E402
from online_spec.checkpoint import load_head  # noqa: E402
from online_spec.controller.config import AdaptiveConfig  # noqa: E402
from online_spec.controller.cost import CostModelPolicy  # noqa: E402
from online_spec.controller.round_time import CostModel  # noqa: E402
from online_spec.controller.static import StaticSteps  # noqa: E402
from online_spec.data import sharegpt_conversations  # noqa: E402
from online_spec.target import load_target  # noqa: E402
from serving.calibrate import calibration_points, measure_round_timings  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402
from online_spec.sampling import SamplingParams  # noqa: E402

SUBSET = (0, 1, 3, 7)


def served(target, head, prompts, batch, policy, new_tokens, max_steps):
    """An untimed run of `batch` prompts (the policy learns this batch size), then all `prompts`,
    timed; the policy as `serve --policy cost` runs it by default (on the engine's thread)."""
    eng = Engine(target, head, EngineConfig(max_batch=batch, max_len=1024, max_steps=max_steps), policy=policy)
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eng.generate(prompts[:batch], sp)
    t0 = time.perf_counter()
    outs = eng.generate(list(prompts), sp)
    return {"tokens_per_s": sum(len(o) for o in outs) / (time.perf_counter() - t0), "outputs": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--trees", default="3,4,10 5,4,8", help="tree candidates of the tree arms ('' = none)")
    ap.add_argument("--static", default="3", help="static K arms, comma-separated")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target()
    head, _ = load_head(resolve_head("shipped", target, 0), target.info, dtype=target.dtype)
    convs = sharegpt_conversations(limit=max(args.requests, 2 * args.batch), seed=5, split="heldout",
                                   max_prompt_tokens=160, tokenizer=target.tokenizer)
    prompts = [target.encode_chat(c[:1]) for c in convs]
    ks = list(range(args.max_steps + 1))
    timings = measure_round_timings(target, head, [1, 4, 16], ks, [256], rounds=2)
    points = calibration_points(timings)
    models = {"subset": CostModel().fit([p for p in points if p.num_steps in SUBSET]), "every_k": CostModel().fit(points)}
    trees = [[int(x) for x in t.split(",")] for t in args.trees.split()]
    bases = {}
    for name, model in models.items():
        for tr in ([], trees) if trees else ([],):
            adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": ks, "tree_candidates": tr}})
            bases[f"{name}{'+trees' if tr else ''}"] = CostModelPolicy(adaptive, cost_model=model)
    point_ms = {f"{p.batch_size},{p.num_steps}": round(1e3 * (p.draft_s + p.verify_s), 1) for p in points}
    print("calibrated round ms (b,K):", point_ms, flush=True)
    arms = list(bases) + [f"static{k}" for k in args.static.split(",") if k]
    runs: dict[str, list[float]] = {a: [] for a in arms}
    same = True
    first = None
    for r in range(args.repeats):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for a in order:
            policy = StaticSteps(int(a[6:])) if a.startswith("static") else copy.deepcopy(bases[a])
            run = served(target, head, prompts, args.batch, policy, args.new_tokens, args.max_steps)
            first = first or run["outputs"]
            same = same and run["outputs"] == first
            runs[a].append(run["tokens_per_s"])
            print(f"repeat {r + 1} {a}: {run['tokens_per_s']:.1f} tok/s", flush=True)
    ref = arms[0]
    out = {"batch": args.batch, "repeats": args.repeats, "dtype": str(target.dtype), "calibrated_round_ms": point_ms,
           "tokens_per_s": {a: statistics.median(v) for a, v in runs.items()}, "runs": runs,
           "over_subset": {a: statistics.median(x / y for x, y in zip(v, runs[ref])) for a, v in runs.items()},
           "same_tokens": same}
    print(json.dumps({k: out[k] for k in ("tokens_per_s", "over_subset", "same_tokens")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
