"""Probe: the cost policy's calls inside the engine against the very same calls replayed hot.

Runs the engine at batch B (env B, default 1) with the cost-model policy (round-time model
calibrated here on a small grid), records every policy call with its arguments, times each call
as the engine made it (between torch ops), then replays the recorded calls on a copy of the
policy in a tight loop, three times. The gap between the two is what the engine's cold caches
cost the policy's Python (issue 29's "decision cost in the engine <= 50 us" aim).

    python scripts/policy_in_engine_replay.py            # B=1 NT=2
    B=16 NT=1 python scripts/policy_in_engine_replay.py  # batch 16, one torch thread

Prints per-call medians in microseconds; nothing is written.
"""

import collections
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.controller as bc  # noqa: E402
from online_spec.controller.base import TimedPolicy  # noqa: E402


class Recorder(TimedPolicy):
    """The policy as the engine drives it, every call recorded and timed."""

    def __init__(self, policy):
        super().__init__(policy)
        self.calls, self.ns = [], collections.defaultdict(list)

    def _call(self, name, *a, **k):
        self.calls.append((name, copy.deepcopy(a), copy.deepcopy(k)))
        f = getattr(self.policy, name)
        t = time.perf_counter_ns()
        out = f(*a, **k)
        self.ns[name].append(time.perf_counter_ns() - t)
        return out

    def steps_for(self, *a):
        return self._call("steps_for", *a)

    def should_continue(self, *a):
        return self._call("should_continue", *a)

    def verify_lengths(self, *a, **k):
        return self._call("verify_lengths", *a, **k)

    def update(self, *a, **k):
        return self._call("update", *a, **k)


def medians(ns: dict) -> dict:
    return {k: round(statistics.median(v) / 1000, 1) for k, v in ns.items()}


def main() -> None:
    torch.set_num_threads(int(os.environ.get("NT", "2")))
    b = int(os.environ.get("B", "1"))
    cfg = bc.ControllerBenchConfig(batch_sizes=[b])
    target = bc.load_target()
    head, _ = bc.load_head(Path(bc.resolve_head("shipped")), target.info, dtype=target.dtype)
    traffic = bc.load_traffic(target, max(20, 2 * b), 160)
    max_len = bc.stationary_max_len(traffic, cfg)
    calib = bc.measure_round_timings(target, head, sorted({1, 4, b}), [0, 1, 3], [128], 2, max_len=max_len)
    policy = Recorder(bc.policy_factories(cfg, bc.calibrate_cost_model(target, head, timings=calib))["cost_model"]())
    start = copy.deepcopy(policy.policy)
    engine = bc.new_engine(target, head, policy, b, max_len, 7)
    bc.decode_tokens_per_s(engine, traffic.take("sharegpt", max(b, 4)), 48, None)
    rounds = len(policy.ns["update"])
    print(f"batch {b}, {rounds} rounds, calls per round:",
          {k: round(len(v) / rounds, 2) for k, v in policy.ns.items()})
    print("in the engine, us per call (median):", medians(policy.ns))
    for _ in range(3):
        p, ns = copy.deepcopy(start), collections.defaultdict(list)
        for name, a, k in policy.calls:
            f = getattr(p, name)
            t = time.perf_counter_ns()
            f(*a, **k)
            ns[name].append(time.perf_counter_ns() - t)
        print("the same calls replayed hot, us per call (median):", medians(ns))


if __name__ == "__main__":
    main()
