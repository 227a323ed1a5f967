"""The loop's cost split on a CPU: the cost policy, the cost policy with capture (a trainer that
ingests and never trains) and online-spec served side by side (bench/interleave.py, 10 requests
a turn) on the built-in drifting trace, with `bench e2e`'s session settings and trainer flags.
Prints and writes per-phase tokens/s, the trainer's CPU ledger and the rounds' costs per batch
size and shape (`round_costs.by_batch_k`): equal shapes compare the round speed of the three.

    PYTHONPATH=$PWD python scripts/loop_split_probe.py OUT REQUESTS_PER_PHASE HEAD [SEED_HEADS [ARGS]]

ARGS (one string of trainer flags) adds a fourth arm, `online_spec_args`: online-spec with those
flags after the others (e.g. a lower duty: whether the trainer's slowdown of the rounds follows
how much it works).
"""

import json
import sys
from pathlib import Path

from bench.demo import DEMO_TRAINER_ARGS
from bench.e2e import NEVER_TRAIN_TOKENS
from bench.heads import resolve_head
from bench.interleave import serve_interleaved
from bench.report import session_figures
from bench.session import SessionConfig
from bench.trace import build_drift_trace, load_trace
from online_spec.target import load_target

out, n, head_name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
seeds = sys.argv[4] if len(sys.argv) > 4 else ""
extra = sys.argv[5].split() if len(sys.argv) > 5 else []
out.mkdir(parents=True, exist_ok=True)
target = load_target()
head = resolve_head(head_name, target, 16000)
items = load_trace(build_drift_trace(out / "trace.jsonl", n, n, n, 0))
targs = DEMO_TRAINER_ARGS + (["--seed-heads", seeds] if seeds else [])
base = dict(head=head, concurrency=4, tree_candidates=[[3, 4, 10], [5, 4, 8]], max_tokens=64, deadline_s=3000,
            server_threads=1, trainer_threads=1, trainer_args=targs,
            cost_model_store=str((out / "cost_model.json").resolve()), clients_process=True, progress_every_s=0)
specs = {"cost_policy": dict(policy="cost", num_steps=3),
         "online_no_training": dict(policy="cost", num_steps=3, online=True,
                                    trainer_args=targs + ["--min-buffer-tokens", str(NEVER_TRAIN_TOKENS)]),
         "online_spec": dict(policy="cost", num_steps=3, online=True, bank=True)}
if extra:
    specs["online_spec_args"] = dict(policy="cost", num_steps=3, online=True, bank=True, trainer_args=targs + extra)
scs = {k: SessionConfig(name=k, run_dir=str(out / k), **{**base, **v}) for k, v in specs.items()}
res = serve_interleaved(scs, target, items, 10, list(specs), 3000,
                        lambda i, of, name, _s, sec: print(f"chunk {i + 1}/{of} {name} {sec:.1f}s", flush=True))
figs = {k: session_figures(r) for k, r in res.items()}
rep = {k: {"overall": f["overall"]["tokens_per_s"],
           "phases": {p: (v["tokens_per_s"], v.get("accept_len")) for p, v in f["phases"].items()},
           "round_costs_by_batch_k": f["round_costs"]["by_batch_k"]} for k, f in figs.items()}
rep["trainer_cpu"] = {k: (figs[k].get("trainer") or {}).get("cpu") for k in specs if k.startswith("online_spec")}
print(json.dumps({k: v for k, v in rep.items() if k != "round_costs_by_batch_k"}, indent=1, default=str))
(out / "loop_split.json").write_text(json.dumps(rep, indent=1, default=str))
