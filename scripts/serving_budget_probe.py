"""The serving budget in the real loop: the same requests served with the trainer beside the server,
its duty fixed against its duty capped by the budget (trainer/slack.py), and with no trainer.

Each setting is one `bench.session` run over the same trace lines (the server embedded, the trainer
daemon in its child process, the capture stream and the control endpoint real), interleaved
`--repeats` times, each repeat's order rotated by one (a machine whose speed drifts favours no setting):

    no-trainer      no trainer (the server alone, capture off)
    FLAGS           the trainer with these `online-spec train` flags, e.g. "--max-duty 0.5" against
                    "--max-duty 0.5 --serving-budget 0.03"

Reported per setting: the server's tokens/s (median and each repeat), its ratio to the first
setting within each repeat (median), the trainer's steps, and what its governor measured (the
slowdown of the server's rounds while the trainer stepped, the duty cap, the reads).

    PYTHONPATH=$PWD python scripts/serving_budget_probe.py --trace T.jsonl --requests 48 --repeats 2 \
        --settings "no-trainer;--max-duty 0.5;--max-duty 0.5 --serving-budget 0.03" --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="trace JSONL; its first --requests lines are served")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--head", default="shipped")
    ap.add_argument("--num-steps", type=int, default=3, help="static K of the server")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="no-trainer;--max-duty 0.5;--max-duty 0.5 --serving-budget 0.03")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    import torch

    from bench.common import machine_info
    from bench.heads import resolve_head
    from bench.report import session_figures
    from bench.session import SessionConfig, run_session
    from bench.trace import load_trace
    from online_spec.target import load_target

    target = load_target(device=args.device)
    head = resolve_head(args.head, target, 0)
    items = load_trace(args.trace)[:args.requests]
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    work = Path(tempfile.mkdtemp(prefix="budget-"))
    rows: dict[str, list[dict]] = {s: [] for s in settings}
    try:
        for rep in range(args.repeats):
            for s in settings[rep % len(settings):] + settings[:rep % len(settings)]:  # each repeat's order rotated
                online = s != "no-trainer"
                result = run_session(target, SessionConfig(
                    name=s, run_dir=str(work / f"r{rep}"), head=head, num_steps=args.num_steps, device=args.device,
                    concurrency=args.concurrency, max_tokens=args.max_tokens, online=online, bank=False,
                    trainer_args=s.split() if online else [], progress_every_s=0), items)
                figs = session_figures(result)
                trainer = result.trainer or {}
                row = {"tokens_per_s": figs["overall"]["tokens_per_s"], "accept_len": figs["overall"]["accept_len"],
                       "trainer_steps": trainer.get("step"), "swaps": trainer.get("swaps"),
                       "serving_budget": trainer.get("serving_budget"), "rested_s": trainer.get("rested_s")}
                rows[s].append(row)
                print(f"rep {rep} {s!r}: {row['tokens_per_s']:.1f} tok/s, accept_len {row['accept_len']}, "
                      f"trainer {row['trainer_steps']} steps, {row['swaps']} swaps, budget {row['serving_budget']}",
                      flush=True)
                shutil.rmtree(work / f"r{rep}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = rows[settings[0]]
    out = {"probe": "serving_budget", "machine": machine_info(), "torch": torch.__version__, "args": vars(args),
           "settings": {}}
    for s, rs in rows.items():
        out["settings"][s] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "vs_first_median": statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base)),
            "trainer_steps_median": statistics.median(r["trainer_steps"] or 0 for r in rs), "repeats": rs}
    Path(args.json).write_text(json.dumps(out, indent=1))
    for s, e in out["settings"].items():
        print(f"{s!r}: {e['tokens_per_s_median']:.1f} tok/s, vs {settings[0]!r} {e['vs_first_median']:.3f}, "
              f"trainer {e['trainer_steps_median']} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
