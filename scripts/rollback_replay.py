"""Replay a `bench e2e` run's captured stream through the daemon's rollback monitor.

Reads the online-spec configuration's replay buffer (`OUT/online_spec/trainer/replay`, every span
the trainer received) in arrival order (by each span's last row timestamp) and the run's swaps
(`--json`: the bench's JSON), feeds the spans to a fresh `LiveAcceptance`, starts a
`RollbackMonitor` (the current rules, `GateConfig` defaults plus `--min-rounds`) at the first span
drafted by each published version, and prints each decision. What the live daemon decided is in
the run's trainer.log; this shows what the current rules decide on the same traffic.

    PYTHONPATH=$PWD python scripts/rollback_replay.py --out /tmp/runs/e2e_lr2 \
        --json bench/results/bench_e2e_lr3e-4_guard15_2026-11-23.json
"""

from __future__ import annotations

import argparse
import json

from collector.replay import ReplayBuffer, ReplayConfig
from trainer.gate import GateConfig, LiveAcceptance, RollbackMonitor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the bench's --out directory")
    ap.add_argument("--json", required=True, help="the bench's JSON")
    ap.add_argument("--min-rounds", type=int, default=30, help="rollback_min_rounds (the demo's: 30)")
    args = ap.parse_args()
    swaps = [s for s in json.load(open(args.json))["configs"]["online_spec"]["swaps"] if not s["rollback"]]
    buf = ReplayBuffer(ReplayConfig(root=f"{args.out}/online_spec/trainer/replay"))
    spans = [span for _, span in buf.stored_spans()]
    spans.sort(key=lambda sp: float(sp.timestamp.max()))
    live, mon = LiveAcceptance(), RollbackMonitor(GateConfig(rollback_min_rounds=args.min_rounds))
    for sp in spans:
        versions = set(sp.draft_version.tolist())
        while swaps and swaps[0]["to"] in versions:
            s = swaps.pop(0)
            if mon.watching:
                print(f"v{mon.watching[0]}: still waiting when v{s['to']} went live")
            mon.start_from(live, s["to"], s["from"])
        live.observe_rows(sp.accepted.tolist(), sp.num_steps.tolist(), sp.draft_version.tolist(),
                          sp.batch_size.tolist(), sp.tag)
        if mon.watching:
            new = mon.watching[0]
            decision = mon.update(live)
            if decision.action != "wait":
                print(f"{decision.action}: {decision.reason}; from {live.spans(new)} requests")


if __name__ == "__main__":
    main()
