"""Where a speculative round's time goes on this device, per policy: the engine alone (no HTTP
server), batch 1, the shipped head, real chat/code prompts from a trace file.

For static K = 0..--max-k and the cost-model policy (calibrated here, as the server does), serve
the same prompts and report per policy: tokens/s, tokens per round, the K histogram, and the
medians of the round's phases as the engine measures them (draft_s, verify_s, total_s = the
engine's step) and of the wall time between steps outside it. For the cost policy also its
predicted round seconds at each K against the measured median of its rounds at that K: the
controller can only choose well if these agree. Per K (verified), `drafted` counts the rounds by
the drafts made before the verify-length cut: drafts made and not verified are drafting time
spent for nothing. `cost_policy_choice_only` is the same calibrated policy without its in-round
decisions (no early stop, no verify cut): K per round only. Both run wrapped in `TimedPolicy`:
`policy_in_engine_us_p50` is the median time of the policy's own calls per round inside the
engine's rounds (host time the GPU waits through at batch 1). Every policy serves on one engine
(`set_policy`), warmed up at every K first, so no CUDA graph is captured inside a timed run
(`graph_captures` says so; a fresh engine per run, as before, timed each run's captures, the
more of them the more K a policy tried). The policies run interleaved,
--repeats times, the order rotated each repeat; tokens/s are medians (a single pass of each, minutes
apart, read static K = 2 at 310 and 247 tok/s on two lent H100s the same day).

    python scripts/gpu_round_costs.py --trace trace.jsonl --device cuda --repeats 3 --json round_costs.json

Written for the GPU e2e run of 2026-11-24 (docs/engine.md), where the cost policy chose K = 1 and
served slower than static K = 2; runs on CPU too (slowly) with --device cpu.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections import Counter
from pathlib import Path


def load_prompts(path: str, n: int, target) -> list[list[int]]:
    from bench.trace import load_trace

    out = [target.encode_chat(it.messages) if it.messages else target.tokenizer(it.prompt)["input_ids"]
           for it in load_trace(path)]
    step = max(1, len(out) // n)
    return out[::step][:n]  # spread over the trace's phases


def serve(engine, policy, prompts, new_tokens: int) -> dict:
    """Serve `prompts` one at a time with `policy` on the long-lived `engine` (its CUDA graphs
    captured by the warm-up: a fresh engine per run would capture them inside the timed run)."""
    from bench.controller import RoundLog
    from online_spec.sampling import SamplingParams
    from serving.requests import Request

    engine.set_policy(policy)
    log, outside = RoundLog(), []
    engine.on_round.append(log)
    rounds = log.rounds
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t_start = time.perf_counter()
    try:
        for p in prompts:
            engine.add_request(Request(p, params))
            last = None
            while engine.has_work():
                n = len(rounds)
                engine.step()
                t1 = time.perf_counter()
                if last is not None and len(rounds) > n:
                    outside.append(t1 - last - rounds[-1].total_s)
                last = t1
    finally:
        engine.on_round.remove(log)
    wall = time.perf_counter() - t_start
    tokens = sum(s.committed for s in rounds)
    by_k: dict[int, list] = {}
    for s in rounds:
        by_k.setdefault(s.num_steps, []).append(s)

    def med(xs):
        return round(statistics.median(xs) * 1e3, 3) if xs else None

    return {"tokens_per_s": tokens / wall, "tokens_per_round": tokens / max(1, len(rounds)), "rounds": len(rounds),
            "graph_captures": sum(s.draft_captures + s.verify_captures for s in rounds),
            "k_histogram": {k: len(v) for k, v in sorted(by_k.items())},
            "outside_ms_p50": med(outside),
            "per_k": {k: {"rounds": len(v), "total_ms_p50": med([s.total_s for s in v]),
                          "draft_ms_p50": med([s.draft_s for s in v]),
                          "steady_draft_ms_p50": med([s.steady_draft_s for s in v if s.steady_draft_s is not None]),
                          "verify_ms_p50": med([s.verify_s for s in v]),
                          "drafted": dict(sorted(Counter(s.drafted_steps for s in v).items())),
                          "tokens_per_round": sum(s.committed for s in v) / len(v)} for k, v in sorted(by_k.items())}}


class ChoiceOnly:
    """A policy's K per round without its in-round calls (`should_continue`, `verify_lengths`):
    its capabilities declared off (the engine calls those only where declared), everything else
    delegated."""

    early_stop = False
    truncates = False

    def __init__(self, policy):
        self._policy = policy

    def __getattr__(self, name):
        if name == "_policy":  # before __init__ (copies)
            raise AttributeError(name)
        return getattr(self._policy, name)


MAX_LEN, MAX_STEPS = 1024, 7  # the engine every part serves on (batch 1)


def warm_engine(target, head, prompts):
    """The one engine every part serves on, warmed at every K: its CUDA graphs (verify, draft
    step, catch-ups) captured and the allocator grown before anything is timed."""
    from bench.controller import new_engine
    from online_spec.controller.static import StaticSteps

    engine = new_engine(target, head, StaticSteps(0), max_batch=1, max_len=MAX_LEN, max_steps=MAX_STEPS)
    for k in range(MAX_STEPS + 1):
        serve(engine, StaticSteps(k), prompts[:2], 24)
    return engine


def compare_policies(engine, calibrated, prompts, args) -> dict:
    """Static K = 0..max_k, the calibrated cost policy and its choice-only variant, interleaved."""
    from online_spec.controller.base import TimedPolicy
    from online_spec.controller.static import StaticSteps

    policies = {f"static_{k}": lambda k=k: StaticSteps(k) for k in range(args.max_k + 1)}
    # each repeat starts from the calibration; TimedPolicy: the policy's own calls per round, in the engine
    policies["cost_policy"] = lambda: TimedPolicy(copy.deepcopy(calibrated))
    policies["cost_policy_choice_only"] = lambda: TimedPolicy(ChoiceOnly(copy.deepcopy(calibrated)))
    policies.update(getattr(args, "extra_policies", {}))  # more variants, name -> factory (scripts/gpu_policy_ab.py)
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    names = list(policies)
    for rep in range(args.repeats):  # interleaved, the order rotated each repeat: runs compared are seconds apart
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            policy = policies[name]()
            r = serve(engine, policy, prompts, args.new_tokens)
            if isinstance(policy, TimedPolicy):
                inner = policy.policy
                r["policy"] = (inner._policy if isinstance(inner, ChoiceOnly) else inner).info()
                r["policy_in_engine_us_p50"] = policy.median_us()
            runs[name].append(r)
            print(f"repeat {rep} {name}: {r['tokens_per_s']:.1f} tok/s, K {r['k_histogram']}", flush=True)
    out = {"policies": {}}
    for name, rs in runs.items():
        med = statistics.median(r["tokens_per_s"] for r in rs)
        out["policies"][name] = {"tokens_per_s": med, "repeat_tokens_per_s": [r["tokens_per_s"] for r in rs],
                                 "last_repeat": rs[-1]}
        if rs[0].get("policy_in_engine_us_p50") is not None:
            out["policies"][name]["policy_in_engine_us_p50"] = statistics.median(r["policy_in_engine_us_p50"] for r in rs)
    best = max((n for n in runs if n.startswith("static")), key=lambda n: out["policies"][n]["tokens_per_s"])
    out["best_static"] = best
    for name in ("cost_policy", "cost_policy_choice_only"):
        out[f"{name}_vs_best_static"] = out["policies"][name]["tokens_per_s"] / out["policies"][best]["tokens_per_s"]
    model = calibrated.cost
    out["predicted_round_ms"] = {k: round(model.predict_round_s(1, k, 0.3 * 1000) * 1e3, 3) for k in range(MAX_STEPS + 1)}
    print(json.dumps({n: round(v["tokens_per_s"], 1) for n, v in out["policies"].items()}, indent=1))
    print(f"best static {best}; cost policy {out['cost_policy_vs_best_static']:.3f}x, choice only "
          f"{out['cost_policy_choice_only_vs_best_static']:.3f}x", flush=True)
    return out


def verify_probe(engine, tokens=(1, 2, 3, 4, 6), ctx: int = 300, reps: int = 50) -> dict:
    """The graphed target forward alone per T tokens (CUDA events: GPU time; wall with a sync) and
    the argmax read-back: where a verify of drafts costs more than a decode step. Writes K/V at
    positions ctx.. of slot 0, which the next request's prefill rewrites. Needs the engine's CUDA
    graphs, captured for every T by `warm_engine`."""
    import torch

    engine.tcache.lengths[0] = ctx
    out = {}
    for T in tokens:
        tok = torch.randint(1, 1000, (1, T))
        gpu, wall, readback = [], [], []
        for i in range(reps + 10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            logits, _, _ = engine.graphs.target_forward(tok, [ctx], engine.tcache)
            end.record()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            logits.argmax(-1).cpu()
            if i >= 10:
                gpu.append(start.elapsed_time(end) / 1e3)
                wall.append(t1 - t0)
                readback.append(time.perf_counter() - t1)
        out[T] = {name: round(statistics.median(v) * 1e3, 3) for name, v in
                  (("forward_gpu_ms", gpu), ("forward_wall_ms", wall), ("argmax_readback_ms", readback))}
        print(f"T={T}: {out[T]}", flush=True)
    return out


def profile_policies(engine, policies: dict, prompts, new_tokens: int, top: int = 22) -> dict:
    """cProfile of serving `prompts` under each policy: the functions with the most own time."""
    import cProfile
    import io
    import pstats

    out = {}
    for name, make in policies.items():
        prof = cProfile.Profile()
        prof.enable()
        r = serve(engine, make(), prompts, new_tokens)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out[name] = {"rounds": r["rounds"], "tokens_per_s": r["tokens_per_s"], "top": text.getvalue()}
        print(f"=== {name}: {r['rounds']} rounds\n{text.getvalue()}", flush=True)
    return out


def main() -> None:
    from bench.capture_sinks import SINKS
    from serving.engine_config import CAPTURE_SENDERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="JSONL trace ({'messages': ...} or {'prompt': ...} lines)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--prompts", type=int, default=12, help="prompts served per policy")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--max-k", type=int, default=4, help="static K baselines 0..max-k")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians reported)")
    ap.add_argument("--capture-overhead", action="store_true",
                    help="also the capture stream's serving overhead on this device (bench.collector's engine run: "
                         "random head, K = 3, capture at 100 %% to a live subscriber process vs off, batch 1 and 16)")
    ap.add_argument("--capture-head", default="random",
                    help="head of --capture-overhead: random (one token a round: the worst case) or a bench.heads "
                         "--head value (shipped: a trained head's tokens a round)")
    ap.add_argument("--capture-batches", default="1,16", help="batch sizes of --capture-overhead")
    ap.add_argument("--capture-reader", default="subscriber", choices=("subscriber", "socket"),
                    help="the reader of --capture-overhead: the trainer's subscriber (decoding), or a bare socket "
                         "(the serving process's side of the cost alone)")
    ap.add_argument("--capture-sender", default="thread", choices=CAPTURE_SENDERS,
                    help="where --capture-overhead's engine sends its capture (EngineConfig.capture_sender)")
    ap.add_argument("--capture-sink", default="publisher", choices=SINKS,
                    help="what --capture-overhead's 'on' arm adds (bench.collector serving_sink): capture to a "
                         "reader, the rows staged and dropped (null), a thread waiting on each round (wait) or "
                         "encoding it too (encode), or a busy process beside the engine (busy)")
    ap.add_argument("--capture-reserve", default="off", choices=("off", "apart", "shared"),
                    help="--capture-overhead's CPU placement (bench.collector serving_reserve): the OS's, the "
                         "engine's thread on a core of its own (apart), or every other thread on its core (shared)")
    ap.add_argument("--no-policies", action="store_true", help="skip the policies (with --capture-overhead: only that)")
    ap.add_argument("--verify-probe", action="store_true",
                    help="also time the graphed target forward alone per tokens verified (CUDA only)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile 6 prompts under static K = 2 and the calibrated cost policy")
    ap.add_argument("--switch-interval-ms", type=float, default=0.0,
                    help="the interpreter's thread switch interval (sys.setswitchinterval) for this run; 0 = "
                         "Python's default (5 ms): how long the engine's thread may wait for the interpreter "
                         "lock while the capture sender runs Python")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    if args.switch_interval_ms > 0:
        import sys
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    from online_spec.checkpoint import load_head
    from serving.calibrate import engine_cost_policy
    from online_spec.controller.static import StaticSteps
    from bench.heads import SHIPPED_HEAD
    from online_spec.target import load_target

    target = load_target(device=args.device)
    head, _ = load_head(SHIPPED_HEAD, target.info, dtype=target.dtype, device=args.device)
    prompts = load_prompts(args.trace, args.prompts, target)
    out = {"device": args.device, "prompts": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats,
           "switch_interval_ms": args.switch_interval_ms or None}
    if not args.no_policies or args.verify_probe or args.profile:
        engine = warm_engine(target, head, prompts)
        calibrated, out["calibration"] = engine_cost_policy(target, head, max_batch=1, max_steps=MAX_STEPS,
                                                            max_len=MAX_LEN)
        if not args.no_policies:
            out.update(compare_policies(engine, calibrated, prompts, args))
        if args.verify_probe and engine.graphs is None:
            print("verify probe skipped: it times the CUDA graphs, and this engine has none", flush=True)
        elif args.verify_probe:
            out["verify_probe"] = verify_probe(engine)
        if args.profile:
            out["profile"] = profile_policies(engine, {"static_2": lambda: StaticSteps(2),
                                                       "cost_policy": lambda: copy.deepcopy(calibrated)},
                                              prompts[:6], args.new_tokens)
    if args.json:  # written now and again after the capture run: a failure there keeps these
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if args.capture_overhead:
        import tempfile

        from bench.collector import CollectorBenchConfig, measure_engine_overhead

        with tempfile.TemporaryDirectory() as tmp:
            cap = measure_engine_overhead(CollectorBenchConfig(
                serving_device=args.device, serving_repeats=5, serving_head=args.capture_head,
                serving_reader=args.capture_reader, serving_sender=args.capture_sender, serving_sink=args.capture_sink,
                serving_reserve=args.capture_reserve,
                serving_batches=[int(b) for b in args.capture_batches.split(",")]),
                f"ipc://{tmp}/serve.sock", prompts=prompts)
        out["capture_overhead"] = cap
        print("capture overhead %:", {b: round(r["overhead_pct"], 1) for b, r in cap.items()},
              "tok/s off:", {b: round(r["tokens_per_s_capture_off"], 1) for b, r in cap.items()}, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
