"""Replay the gate's decisions of a `bench e2e` run against what its heads then served.

For each version the run's daemon published (`OUT/online_spec/trainer/state.json`), as of the
moment it was published, score it against the head published before it (v0: the starting head)
(or, `--against initial`, against v0) two ways, on the held-out spans the buffer held then (`OUT/online_spec/trainer/replay`):

- `whole_rows`: the gate before 2026-11-23 (late): the newest `--old-rows` rows of whole held-out
  spans, every row an anchor (prompt rows included);
- `generated`: the gate now: the newest held-out requests with their prompts as context, at
  most `--max-generated` generated rows each, `--new-rows` rows in all, anchors on generated
  rows only;

and the truth it was publishing into: the same simulation over the generated rows of every
held-out request that arrived in the next `--horizon-s` seconds (traffic neither head trained
on). Simulated accept length at K = `--num-steps`; a gate publishes when the candidate beats
its predecessor by 2 % and 0.02 drafts (the daemon's defaults).

    PYTHONPATH=$PWD python scripts/gate_replay.py --out /tmp/runs/e2e_lr2 --json /tmp/gate_replay.json
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the bench's --out directory")
    ap.add_argument("--init-head", default="shipped", help="the run's starting head (v0)")
    ap.add_argument("--old-rows", type=int, default=512)
    ap.add_argument("--new-rows", type=int, default=1024)
    ap.add_argument("--max-generated", type=int, default=128)
    ap.add_argument("--horizon-s", type=float, default=60.0)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--against", choices=("previous", "initial"), default="previous",
                    help="the live head of each comparison: the version published before it, or v0")
    ap.add_argument("--heldout-every", type=int, default=4, help="the daemon's --replay-heldout-every")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from collector.replay import ReplayBuffer, ReplayConfig, fill_rows, is_heldout
    from online_spec.checkpoint import load_head
    from bench.heads import resolve_head
    from online_spec.target import load_target
    from trainer.evaluate import simulate_acceptance

    run = f"{args.out}/online_spec/trainer"
    published = json.load(open(f"{run}/state.json"))["published"]
    buf = ReplayBuffer(ReplayConfig(root=f"{run}/replay", heldout_every=args.heldout_every))
    held = sorted((sp for _, sp in buf.stored_spans() if is_heldout(sp.request_id, args.heldout_every)),
                  key=lambda sp: float(sp.timestamp.max()))
    target = load_target()
    heads = {0: load_head(resolve_head(args.init_head, target), target.info, dtype=target.dtype)[0]}
    for p in published:
        heads[p["version"]] = load_head(f"{run}/ckpt/v{p['version']}", target.info, dtype=target.dtype)[0]
    K = args.num_steps

    def score(head, spans, generated: bool) -> float:
        if not spans:
            return float("nan")
        return simulate_acceptance(head, target, spans, K, ks=(K,), generated_only=generated)["accept_length"][str(K)]

    def whole_rows(before: list) -> list:  # the gate's sample before 2026-11-23 (late)
        return fill_rows(reversed(before), args.old_rows)

    def generated(before: list) -> list:  # the gate's sample now
        return fill_rows(reversed(before), args.new_rows, generated=True, max_generated=args.max_generated)

    def wins(c: float, lv: float) -> bool:
        return c > lv * 1.02 and c > lv + 0.02

    rows, prev = [], 0
    for p in published:
        v, t = p["version"], p["time"]
        before = [sp for sp in held if float(sp.timestamp.max()) <= t]
        after = [sp for sp in held if t < float(sp.timestamp.min()) <= t + args.horizon_s]
        row = {"version": v, "against": prev, "step": p["step"], "heldout_before": len(before),
               "heldout_after": len(after)}
        for name, sample, gen in (("whole_rows", whole_rows(before), False), ("generated", generated(before), True),
                                  ("truth", after, True)):
            c, lv = score(heads[v], sample, gen), score(heads[prev], sample, gen)
            row[name] = {"candidate": round(c, 4), "live": round(lv, 4), "requests": len(sample),
                         "publish": wins(c, lv) if name != "truth" else c > lv}
        print(row, flush=True)
        rows.append(row)
        prev = v if args.against == "previous" else 0
    judged = [r for r in rows if r["truth"]["requests"] >= 10]  # the last versions have little traffic after them
    agree = {name: sum(r[name]["publish"] == r["truth"]["publish"] for r in judged) for name in ("whole_rows", "generated")}
    # how far each gate's gain estimate (candidate - live) is from the gain on the traffic that came
    error = {name: round(sum(abs((r[name]["candidate"] - r[name]["live"]) - (r["truth"]["candidate"] - r["truth"]["live"]))
                             for r in judged) / max(len(judged), 1), 4) for name in ("whole_rows", "generated")}
    out = {"args": vars(args), "versions": rows, "judged": len(judged), "agrees_with_truth": agree,
           "mean_abs_gain_error": error}
    print(f"agree with the truth on {len(judged)} versions with >= 10 requests after them:",
          json.dumps(out["agrees_with_truth"]), "mean |gain error|:", json.dumps(error), flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
