"""Probe: serve part of an e2e trace in one configuration and write every round (JSONL).

`bench e2e` keeps per-round records only long enough to summarise them. This runs one session
the way `bench e2e` runs a configuration (bench.session.run_session: server, streaming clients
in their own process) and writes each round `RoundLog` recorded, plus the K policy's log, so
where a configuration's rounds went can be read round by round.

    python scripts/session_rounds.py TRACE OUT.jsonl [--policy cost] [--head DIR] [--per-phase 30]
        [--trees '3,4,10 5,4,8'] [--num-steps 3] [--cost-store runs/X/cost_model.json]
"""
import argparse, json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.session import SessionConfig, run_session
from bench.trace import load_trace, phases
from online_spec.target import load_target
from online_spec.tree import TreeShape

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("out")
ap.add_argument("--policy", default="cost")
ap.add_argument("--head", default="/tmp/heads/sharegpt-chat-h100")
ap.add_argument("--per-phase", type=int, default=30)
ap.add_argument("--trees", default="3,4,10 5,4,8")
ap.add_argument("--num-steps", type=int, default=3)
ap.add_argument("--cost-store", default="")
ap.add_argument("--concurrency", type=int, default=4)
a = ap.parse_args()

target = load_target(dtype="bfloat16")
items = [it for _, run in phases(load_trace(a.trace)) for it in run[:a.per_phase]]
trees = [[s.num_steps, s.topk, s.num_draft_tokens] for s in map(TreeShape.parse, a.trees.split())] if a.trees else []
cfg = SessionConfig(name=f"probe-{a.policy}", run_dir=f"/tmp/session_rounds/{a.policy}", head=a.head,
                    policy=a.policy, num_steps=a.num_steps, tree_candidates=trees, concurrency=a.concurrency,
                    max_tokens=64, deadline_s=900, cost_model_store=str(Path(a.cost_store).resolve()) if a.cost_store
                    else "", progress_every_s=5)
t0 = time.time()
res = run_session(target, cfg, items)
with open(a.out, "w") as f:
    for r in res.rounds:
        f.write(json.dumps(r) + "\n")
    f.write(json.dumps({"policy_log": res.policy_log}) + "\n")
served = sum(r.completion_tokens for r in res.requests)
print(f"{len(res.rounds)} rounds, {served} tokens in {time.time() - t0:.0f} s -> {a.out}")
