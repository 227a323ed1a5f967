"""Tune and check the drift monitor on real requests at any batch size, many times over.

One run of `online-spec bench drift-alerts` is one sample: one stationary phase, one switch. This
script cuts a recorded rounds trace (the bench's NAME.rounds.jsonl) into its requests — each
request's accepted drafts, round by round, as the real server produced them — and replays
synthetic runs built from them: `batch` closed-loop lanes, each serving requests drawn at random
(with replacement) from the first phase's requests for `stationary` rounds, then every lane
switching to the second phase's requests. A request's acceptance, easy or hard for its whole
life, is kept exactly; what is synthetic is which requests overlap in a round (greedy decoding
makes a request's accepts the same at any batch size, up to bf16 batching noise).

`--tags chat,code` tags the two phases differently (the switch is then a change of the mix of
tags, the demo's case); `--swap-every N` makes a new head version go live every N rounds from a
random offset (a trainer's swaps, each re-warming the detector's streams; the recorded accepts
stay those of the recorded head).

Per batch size and seed: the alerts in the stationary part (each a false alert) and the rounds
from the switch to the first drop alert. Prints a table and writes JSON.

    python scripts/drift_bootstrap.py results/bench_drift.rounds.jsonl --batches 1,4,8,16 --seeds 20 \\
        --json results/drift_bootstrap.json [--drift-threshold 13 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from online_spec.config import add_config_args, config_from_args, config_to_dict
from online_spec.drift import DriftConfig, DriftDetector
from online_spec.drift_replay import read_rounds, replay_rounds
from online_spec.jsonl import open_text


def requests_by_phase(path: Path) -> tuple[dict[str, list[list[int]]], int]:
    """Phase -> the completed requests' accepted counts in round order (a request still running
    in a phase's last round is cut off and left out); and K (the trace's, which must be fixed)."""
    seqs: dict[str, dict[str, list[int]]] = {}
    last: dict[str, set] = {}
    ks = set()
    with open_text(path) as f:
        for row in read_rounds(f, str(path)):
            ks.add(row["num_steps"])
            per = seqs.setdefault(row["phase"], {})
            for rid, a in zip(row["request_ids"], row["accepted"]):
                per.setdefault(rid, []).append(a)
            last[row["phase"]] = set(row["request_ids"])
    if len(ks) != 1:
        raise SystemExit(f"{path}: K must be fixed for this bootstrap, found {sorted(ks)}")
    return {p: [v for rid, v in per.items() if rid not in last[p]] for p, per in seqs.items()}, ks.pop()


def synthetic_rounds(rng: random.Random, pools: list[list[list[int]]], lengths: list[int], batch: int,
                     num_steps: int, tags: list[str] | None = None, swap_every: int = 0):
    """Rows for replay_rounds: `lengths[i]` rounds served from `pools[i]` under traffic tag `tags[i]`
    (default untagged), phases named p0, p1, ...; with `swap_every`, a new head version every that
    many rounds from a random offset (a trainer's swaps: each re-warms the detector's streams).
    A request's accepts stay the recorded ones across a swap (a stand-in: a new head changes them)."""
    serial, index = 0, 0
    offset = rng.randrange(swap_every) if swap_every else 0
    for phase, (pool, n) in enumerate(zip(pools, lengths)):
        tag = tags[phase] if tags else ""
        lanes = []
        for _ in range(batch):
            serial += 1
            lanes.append([f"r{serial}", rng.choice(pool), 0])
        for _ in range(n):
            yield {"batch_size": batch, "accepted": [seq[i] for _, seq, i in lanes], "num_steps": num_steps,
                   "request_ids": [rid for rid, _, _ in lanes], "tags": [tag] * batch,
                   "head_version": (index + offset) // swap_every if swap_every else 0, "phase": f"p{phase}"}
            index += 1
            for lane in lanes:
                lane[2] += 1
                if lane[2] >= len(lane[1]):
                    serial += 1
                    lane[0], lane[1], lane[2] = f"r{serial}", rng.choice(pool), 0


def one_run(cfg: DriftConfig, pools, lengths, batch, num_steps, seed, tags=None, swap_every: int = 0) -> dict:
    rng = random.Random(seed)
    alerts = list(replay_rounds(DriftDetector(cfg), synthetic_rounds(rng, pools, lengths, batch, num_steps, tags,
                                                                     swap_every)))
    false = [a for a in alerts if a["phase"] == "p0"]
    drop = next((a for a in alerts if a["phase"] == "p1" and a["kind"] == "drop"), None)
    return {"false_alerts": len(false), "false_kinds": [a["kind"] for a in false],
            "rounds_to_drop": None if drop is None else drop["round_index"] - lengths[0] + 1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--stationary", type=int, default=2000, help="stationary rounds per synthetic run")
    p.add_argument("--switched", type=int, default=2000, help="most rounds after the switch")
    p.add_argument("--phases", default="", help="first,second phase names in the trace (default: its first two)")
    p.add_argument("--tags", default="", help="traffic tags of the two phases, e.g. chat,code (default: untagged: "
                   "one stream; tagged differently, the switch is a change of the mix)")
    p.add_argument("--swap-every", type=int, default=0, help="a new head version every N rounds (0 = none)")
    p.add_argument("--json", type=Path, default=None)
    add_config_args(p, DriftConfig, prefix="drift_")
    args = p.parse_args()
    cfg = config_from_args(DriftConfig, args, prefix="drift_")
    by_phase, k = requests_by_phase(args.trace)
    names = args.phases.split(",") if args.phases else list(by_phase)[:2]
    pools = [by_phase[n] for n in names]
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "command": "python scripts/drift_bootstrap.py " + " ".join(sys.argv[1:]), "trace": str(args.trace), "phases": names, "requests": [len(x) for x in pools], "num_steps": k,
           "mean_accept_len": [statistics.fmean(a for s in pool for a in s) for pool in pools],
           "stationary_rounds": args.stationary, "max_switched_rounds": args.switched, "tags": args.tags,
           "swap_every": args.swap_every,
           "drift_config": config_to_dict(cfg), "batches": {}}
    print(f"{args.trace}: {names[0]} {len(pools[0])} requests (accept {out['mean_accept_len'][0]:.2f}), "
          f"{names[1]} {len(pools[1])} requests (accept {out['mean_accept_len'][1]:.2f}), K={k}")
    tags = args.tags.split(",") if args.tags else None
    for b in (int(x) for x in args.batches.split(",")):
        runs = [one_run(cfg, pools, [args.stationary, args.switched], b, k, seed, tags, args.swap_every)
                for seed in range(args.seeds)]
        delays = sorted(r["rounds_to_drop"] for r in runs if r["rounds_to_drop"] is not None)
        row = {"runs": runs, "false_alerts_total": sum(r["false_alerts"] for r in runs),
               "runs_with_false_alerts": sum(r["false_alerts"] > 0 for r in runs),
               "missed": sum(r["rounds_to_drop"] is None for r in runs),
               "rounds_to_drop_median": statistics.median(delays) if delays else None,
               "rounds_to_drop_max": max(delays) if delays else None,
               "within_200": sum(d <= 200 for d in delays)}
        out["batches"][str(b)] = row
        print(f"B={b:3d}: false alerts {row['false_alerts_total']:3d} in {args.seeds} runs "
              f"({row['runs_with_false_alerts']} runs), drop found {len(delays)}/{args.seeds}, "
              f"median {row['rounds_to_drop_median']} max {row['rounds_to_drop_max']} rounds, "
              f"<=200: {row['within_200']}/{args.seeds}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
