"""Two versions of the cost policy's code side by side on one engine at batch 1: the current one
and another `cost.py` (e.g. an earlier commit's), interleaved with the static K's of
`scripts/gpu_round_costs.py`, every cost-policy variant timed inside the engine (`TimedPolicy`),
then a cProfile of static K = 2 and of both versions. Per policy the report has tokens/s (median
of the repeats), the K histogram and, per K, the draft / verify / between-round medians: where a
round of the cost policy spends more than a static round of the same K.

    git show REV:online_spec/controller/cost.py > cost_old.py
    python scripts/gpu_policy_ab.py --other cost_old.py --trace trace.jsonl --device cuda \\
        --repeats 3 --prompts 12 --json policy_ab.json

Written for the H100 run of 2026-11-24 (docs/controller.md, "The decision cost inside the
engine"); runs on CPU too (slowly) with --device cpu.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_round_costs as rc  # noqa: E402


def load_module(path: str, name: str = "cost_other"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other cost.py (its CostModelPolicy is compared)")
    ap.add_argument("--trace", required=True, help="JSONL trace ({'messages': ...} or {'prompt': ...} lines)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=4, help="static K baselines 0..max-k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    from online_spec.checkpoint import load_head
    from online_spec.controller.base import TimedPolicy
    from serving.calibrate import engine_cost_policy
    from online_spec.controller.static import StaticSteps
    from bench.heads import SHIPPED_HEAD
    from online_spec.target import load_target

    other = load_module(args.other)
    t0 = time.time()
    target = load_target(device=args.device)
    head, _ = load_head(SHIPPED_HEAD, target.info, dtype=target.dtype, device=args.device)
    prompts = rc.load_prompts(args.trace, args.prompts, target)
    engine = rc.warm_engine(target, head, prompts)
    calibrated, cal = engine_cost_policy(target, head, max_batch=1, max_steps=rc.MAX_STEPS, max_len=rc.MAX_LEN)

    def other_policy():  # the same tiers and calibrated round-time model, the other code
        return other.CostModelPolicy(calibrated.adaptive, cost_model=copy.deepcopy(calibrated.cost))

    args.extra_policies = {"cost_policy_other": lambda: TimedPolicy(other_policy())}
    out = {"device": args.device, "other": args.other, "calibration": cal, "prompts": len(prompts)}
    out.update(rc.compare_policies(engine, calibrated, prompts, args))
    best = out["policies"][out["best_static"]]["tokens_per_s"]
    out["cost_policy_other_vs_best_static"] = out["policies"]["cost_policy_other"]["tokens_per_s"] / best
    out["profile"] = rc.profile_policies(engine, {"static_2": lambda: StaticSteps(2),
                                                  "cost_policy": lambda: copy.deepcopy(calibrated),
                                                  "cost_policy_other": other_policy}, prompts[:6], args.new_tokens)
    out["wall_s"] = time.time() - t0
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"cost policy {out['cost_policy_vs_best_static']:.3f}x, other {out['cost_policy_other_vs_best_static']:.3f}x "
          f"of {out['best_static']}", flush=True)


if __name__ == "__main__":
    main()
