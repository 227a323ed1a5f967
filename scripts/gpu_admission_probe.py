"""Where a served round's long tail goes on this device: the engine alone, continuous batching
(max_batch 4, every prompt queued up front, as `bench e2e --concurrency 4` keeps 4 requests in
flight), real prompts of a trace, the shipped head.

The GPU e2e of 2026-11-27 (clients out of process) measured a plain round at 4.9 ms median but
11.6 ms mean, a static K = 3 round at 8.3 ms median and 37.9 ms mean: most of the serving time
sits in rare long rounds. This probe times, per round, with the device synchronised around each
piece: the admissions (target prefill of each new prompt, its length), the draft stage's long
catch-ups (the head over a new prompt's rows), graph captures, draft, verify and the rest; for
plain decoding and static K = 3, after `Engine.warm_graphs` (a server's start-up; how many graphs
the serving warm-up still captured after it is reported) and a serving warm-up.

    python scripts/gpu_admission_probe.py --trace trace_d.jsonl --json admission.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def timed(engine, name: str, log: list, sync):
    """Wrap engine.<name> so each call's wall time (device synchronised after it) is appended to log."""
    fn = getattr(engine, name)

    def wrapper(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        log.append((name, time.perf_counter() - t0, a))
        return out
    setattr(engine, name, wrapper)


class GcClock:
    """Seconds the cyclic garbage collector ran (gc.callbacks), per generation, since the probe started."""

    def __init__(self):
        import gc
        self.total, self.by_gen, self._t0 = 0.0, [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t0
            self.total += dt
            self.by_gen[info["generation"]] += dt


GC = GcClock()


def serve(engine, prompts, new_tokens: int, sync) -> dict:
    from bench.controller import RoundLog
    from online_spec.sampling import SamplingParams
    from serving.requests import Request

    calls: list = []
    for name in ("_prefill", "_fill_rows", "_release_finished"):
        timed(engine, name, calls, sync)
    log = RoundLog()
    engine.on_round.append(log)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(Request(list(p), params))
    rounds = []
    t_start = time.perf_counter()
    while engine.has_work():
        calls.clear()
        gc0 = GC.total
        n = len(log.rounds)
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        wall = time.perf_counter() - t0
        if len(log.rounds) > n:
            s = log.rounds[-1]
            pre = [(c[1], len(c[2][0].prompt_ids)) for c in calls if c[0] == "_prefill"]
            fill = [(c[1], c[2][4]) for c in calls if c[0] == "_fill_rows"]
            rounds.append({"k": s.num_steps, "b": s.batch_size, "wall": wall, "draft": s.draft_s, "verify": s.verify_s,
                           "catchup": s.catchup_s, "captures": s.draft_captures + s.verify_captures,
                           "prefill": sum(x for x, _ in pre), "prefill_tokens": sum(p for _, p in pre),
                           "fill": sum(x for x, _ in fill), "fill_rows": sum(r for _, r in fill),
                           "release": sum(c[1] for c in calls if c[0] == "_release_finished"),
                           "gc": GC.total - gc0})
    total = time.perf_counter() - t_start
    engine.on_round.remove(log)
    for name in ("_prefill", "_fill_rows", "_release_finished"):
        delattr(engine, name)  # the instance attribute shadowed the method
    tokens = sum(s.committed for s in log.rounds)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3) if xs else None  # noqa: E731
    with_pre = [r for r in rounds if r["prefill_tokens"]]
    without = [r for r in rounds if not r["prefill_tokens"] and not r["captures"]]
    return {
        "tokens_per_s": tokens / total, "wall_s": total, "rounds": len(rounds),
        "sum_s": {k: round(sum(r[k] for r in rounds), 3) for k in ("wall", "draft", "verify", "catchup", "prefill",
                                                                     "fill", "release", "gc")},
        "captures": sum(r["captures"] for r in rounds),
        "rounds_with_prefill": len(with_pre),
        "round_ms_p50_no_prefill": ms([r["wall"] for r in without]),
        "round_ms_p50_with_prefill": ms([r["wall"] for r in with_pre]),
        "prefill_ms_per_prompt": [(round(1e3 * r["prefill"], 2), r["prefill_tokens"]) for r in with_pre][:40],
        "fill_ms_rows": [(round(1e3 * r["fill"], 2), r["fill_rows"]) for r in rounds if r["fill_rows"]][:40],
        "slowest": sorted(({k: (round(v * 1e3, 2) if isinstance(v, float) else v) for k, v in r.items()}
                           for r in rounds), key=lambda r: -r["wall"])[:12],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from bench.controller import new_engine
    from bench.heads import SHIPPED_HEAD
    from online_spec.checkpoint import load_head
    from online_spec.controller.static import StaticSteps
    from online_spec.target import load_target
    from scripts.gpu_round_costs import load_prompts

    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)
    target = load_target(device=args.device)
    head, _ = load_head(SHIPPED_HEAD, target.info, dtype=target.dtype, device=args.device)
    prompts = [p[-(args.max_len - args.new_tokens - 16):] for p in load_prompts(args.trace, 10_000, target)]
    step = max(1, len(prompts) // args.prompts)
    prompts = prompts[::step][:args.prompts]
    print("prompt tokens:", sorted(len(p) for p in prompts), flush=True)
    engine = new_engine(target, head, StaticSteps(0), max_batch=args.max_batch, max_len=args.max_len, max_steps=7)
    out = {"device": args.device, "prompts": len(prompts), "max_batch": args.max_batch,
           "prompt_tokens": sorted(len(p) for p in prompts)}
    out["warm_graphs"] = engine.warm_graphs()  # as a server's start-up does
    print("warm_graphs:", out["warm_graphs"], flush=True)
    captured = engine.graphs.captures if engine.graphs is not None else 0
    for k in (0, 3):  # warm-up: the allocator, and any graph the start-up missed (counted)
        engine.set_policy(StaticSteps(k))
        serve(engine, prompts[:8], 16, sync)
    out["captured_after_warm_graphs"] = (engine.graphs.captures if engine.graphs is not None else 0) - captured
    for rep in range(2):
        for k in (0, 3):
            engine.set_policy(StaticSteps(k))
            r = serve(engine, prompts, args.new_tokens, sync)
            out[f"static_{k}_rep{rep}"] = r
            print(f"K={k} rep {rep}: {r['tokens_per_s']:.1f} tok/s, sums {r['sum_s']}, captures {r['captures']}, "
                  f"p50 round {r['round_ms_p50_no_prefill']} ms (with prefill {r['round_ms_p50_with_prefill']})",
                  flush=True)
    print(json.dumps({k: out[k]["slowest"][:4] for k in out if k.startswith("static")}, indent=0)[:3000])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
