"""`online-spec bench e2e`: plain vs static head vs SGLang adaptive vs online-spec, one drifting trace.

Same trace (built-in chat -> code -> mix, or `--trace FILE`), same machine, one process, one
after the other (`bench.session.run_session`, streaming HTTP clients on loopback):
  1. plain        K = 0, no head
  2. static       the ShareGPT head at the best static K; calibration: each K of
                  `--calib-steps` serves the first `--calib-requests` requests of the trace's
                  first phase (what a static deployment is tuned on) and the best tokens/s wins
  3. adaptive     the same head with SGLang's default adaptive policy (EMA tiers, sglang_default)
     tree         the same head as a static tree (`--tree`, SGLang's default 5,4,8 for Llama
                  targets): `sglang_default_tree`, `speedup_vs_sglang_default_tree`
  4. online-spec  the same head, the trainer daemon beside the server (capture, gated swaps over
                  the control endpoint, drift alerts) and the project's cost-model controller,
                  which runs, round by round, the chain or one of `--policy-trees` (per
                  batch-size bucket, a tree's measured tokens/s against the chain's measured
                  ones; every cost-policy configuration below takes the same trees)
then two batch-1 measurements on the last phase's first `--bs1-requests` requests (plain, and
the online-spec head the trainer left live with the controller): `speedup_vs_plain_bs1_adapted`;
and online-spec from a random day-0 head: `tokens_to_beat_plain_from_day0`, the tokens the
server committed up to the end of the first 10 s window whose tokens/s beat plain decoding's
overall tokens/s (None if none did). Every cost-policy configuration, repeats included, starts
from one round-time calibration, `--out`/cost_model.json: measured by the first, reused while
the machine matches (`serving.calibrate.engine_cost_model`).

Per phase, online-spec's ratios to static + SGLang adaptive, static and plain (`per_phase_ratios`,
beside the overall ones). Per configuration and per phase: tokens/s, accept_len (bonus excluded) and accept_length
(bonus included), TPOT p50/p99; for online-spec also the time and tokens to adapt after each
shift (`report.adaptation`). Timings are never asserted; a shared machine moves them 20-40 %.
Before each configuration on a CPU a machine pulse (bench/pulse.py: the target alone decoding a
fixed batch, a few seconds) measures the machine's speed then: `machine_pulse` lists them and
their `spread`, the part of any ratio between two configurations that was the machine's. Each
configuration's rounds go to `--out`/NAME/rounds.jsonl.gz (shape, context and times per round).

`--trace-shape return` builds chat -> code -> chat again: `returns` then gives, per
configuration, the return phase's first-draft acceptance over its first 500 served tokens
against the first chat phase's (`report.returns`); `returns.ratio_online_spec` is the figure whose target is
0.95 (whatever the head learnt of code must not cost the chat acceptance it had);
`ratio_online_spec_over_static` divides it by the static head's own ratio (a head that cannot
forget: what the two phases' prompts alone make of acceptance).

`--repeats N` runs the configurations and the batch-1 sessions N times, counterbalanced: an
even repeat runs the whole-trace configurations in the order above (the ceiling heads right after
online-spec), an odd one in reverse, the batch-1 sessions after them (each online-spec repeat
starts from the same head in a fresh run directory). Every headline figure is then the median
over the repeats of that repeat's ratio, `per_phase` / `overall` the medians of their figures,
and `repeats` lists each repeat's order, ratios and tokens/s. `pooled` takes the repeats
together: each configuration's tokens over its seconds in all repeats, overall and per phase,
and online-spec's ratio, `ceiling` (`ceiling_capture`) and `overhead_split` from those; with
the order reversed every other repeat, a machine whose speed drifts steadily through the run (on the 2-core VM
configurations minutes apart moved 15-30 %, `machine_pulse`) slows every configuration's pooled
figure alike. One ~25 s run per configuration moves ~10 % on a quiet 2-core machine.
`--interleave N` serves the whole-trace configurations side by side instead (bench/interleave.py):
every one is up at once, the trace goes in chunks of N requests, each chunk served by every
configuration in turn (the order reversed every other chunk) while the others are paused, their
trainers stopped; each configuration's times count only its own turns. A drift of the machine's
speed then weighs on all alike within a chunk's turn, where one after another it lands on
whichever configuration ran then. No machine pulses (the interleaving is the control); the
deadline stops the chunks for all alike.
`--baseline-threads T` gives the server of the trainer-free configurations (plain,
static, adaptive, bs1 plain) T torch threads: a deployment without a trainer has the whole
machine, where online-spec splits it between server and trainer.

`--overhead-split` adds two configurations between static and online-spec, each with the
online-spec server's threads, so the ratio of online-spec to static falls into three factors
(`overhead_split`, overall tokens/s ratios whose product is online_spec / static):
  cost_policy         the same head with the cost-model controller; no capture, no trainer
                      -> `controller` = cost_policy / static
  online_no_training  cost controller, capture on, the trainer daemon subscribed and filling
                      its replay buffer but never training (--min-buffer-tokens above any run)
                      -> `capture` = online_no_training / cost_policy
  online_spec         -> `training` = online_spec / online_no_training (the trainer's CPU and
                      memory traffic beside the server, and whatever its swapped heads gained)

`--ceiling-heads code,...` measures what online adaptation could reach at best with heads of
the pretrained kind: each named head (`bench.heads`) serves the whole trace with the
cost-model controller and no trainer (`ceiling_<label>`, a path labelled by its last part;
beside `cost_policy`: the static head the same way), and the last phase's batch-1 requests
(`bs1_ceiling_<label>`). `ceiling` then
takes, phase by phase, the fastest of these heads, as a system that had the in-domain head
live from each phase's first token and paid nothing to train would:
  tokens/s   sum_p tokens_p / sum_p (tokens_p / max_h tokens/s_{h,p})   (tokens_p: the
             adaptive configuration's; the same weighting gives the reference its own figure)
  ceiling_vs_static_sglang_adaptive   that over static + SGLang adaptive weighted alike
  ceiling_capture     (online-spec - static + SGLang adaptive) / (ceiling - static + SGLang
                      adaptive), tokens/s weighted alike; per phase in `best_per_phase` (target 0.8)
  ceiling_speedup_vs_plain_bs1        the best head's batch-1 tokens/s over plain's
A head better than these (one trained on the very replies the trace repeats) is not bounded.
`verify_speed` (where cost_policy runs: each repeat's in `repeats`): how fast the machine ran each
configuration, read off the target's verify forward of the same (batch, K), which no head
changes, against cost_policy's; its `spread` above ~1.1 says tokens/s differ by the machine's
state as much as by the configurations (bench/e2e_figures.py).

    online-spec bench e2e --quick --json results/bench_e2e.json
    online-spec bench e2e --json results/bench_e2e.json --head runs/sharegpt-100k
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import SourceGuard, add_bench_args, quick_overrides, write_report
from bench.demo import DEMO_TRAINER_ARGS
from bench.e2e_figures import (RATIOS, TARGETS, ceiling_figures, median_headline, overhead_split, pooled_figures,
                               ratio as _ratio, return_figures, verify_speed)
from bench.heads import HEAD_CHOICES, resolve_head
from bench.interleave import serve_interleaved
from bench.pulse import machine_pulse, pulse_figures
from bench.report import session_figures, write_rounds
from bench.session import SessionConfig, run_session
from bench.trace import SHAPES, build_drift_trace, load_trace, phases
from online_spec.config import ConfigError, check, config_from_args, config_to_dict, doc
from online_spec.target import load_target
from online_spec.tree import TreeShape
from serving.engine_config import CAPTURE_SENDERS

QUICK = dict(requests_per_phase=3, max_tokens=24, calib_steps="1,3", calib_requests=2, bs1_requests=2,
             deadline_s=300.0)


@dataclass
class E2EConfig:
    trace: str = doc("JSONL trace; empty = the built-in drifting trace", "")
    head: str = doc("static head: " + HEAD_CHOICES + " (bench.heads)", "shipped")
    head_tokens: int = doc("training tokens of the ShareGPT head if it must be built", 16_000)
    requests_per_phase: int = doc("built-in trace: requests per phase", 16)
    trace_shape: str = doc("built-in trace: 'drift' (chat -> code -> mix) or 'return' (chat -> code -> chat "
                           "again: the `returns` figures, acceptance early in the return against the first "
                           "chat phase)", "drift")
    max_tokens: int = doc("max_tokens of trace lines that give none", 64)
    concurrency: int = doc("streaming clients in flight", 4)
    calib_steps: str = doc("static K candidates, comma-separated", "1,2,3,4,5")
    calib_requests: int = doc("requests of the first phase served per calibration K", 6)
    bs1_requests: int = doc("last-phase requests of the batch-1 measurement", 4)
    deadline_s: float = doc("the first configuration (plain) starts no request after this long; every other "
                            "configuration then serves exactly the requests plain served, so all do the same work "
                            "(each with 3x this long as a safety stop; `same_work` in the report says whether "
                            "every one served them all)", 900.0)
    day0: bool = doc("also run online-spec from a random day-0 head (tokens_to_beat_plain_from_day0)", True)
    out: str = doc("run directory of the sessions (trainer state, logs)", "runs/bench_e2e")
    server_threads: int = doc("torch threads of the server process", 1)
    trainer_threads: int = doc("torch threads of the trainer process", 1)
    seed: int = doc("seed of the built-in trace", 0)
    device: str = doc("torch device of the server and the trainer ('cuda': both on one GPU, CUDA graphs)", "cpu")
    trainer_device: str = doc("the trainer's device when not the server's: e.g. cuda:1 puts it on a second GPU "
                              "(disaggregated; checkpoints cross GPUs through the control endpoint); empty = "
                              "--device", "")
    trainer_args: str = doc("extra daemon flags appended to the demo's (space-separated)", "")
    repeats: int = doc("times every configuration and the batch-1 sessions run, odd repeats in reverse order; "
                       "figures are medians over the repeats, `pooled` takes them together", 1)
    baseline_threads: int = doc("torch threads of the server in the trainer-free configurations (0 = "
                                "--server-threads)", 0)
    overhead_split: bool = doc("also run cost_policy and online_no_training (see the module doc): where "
                               "online-spec's tokens/s go against static", False)
    tree: str = doc("a static tree 'num_steps,topk,num_draft_tokens' served by the static head "
                    "(`sglang_default_tree`; SGLang's default for Llama targets: 5,4,8); empty = none", "5,4,8")
    policy_trees: str = doc("trees the cost policy may choose per round in every cost-policy configuration "
                            "(online-spec included), 'steps,topk,tokens' separated by spaces; empty = chains "
                            "only", "3,4,10 5,4,8")
    bank: bool = doc("online-spec's server keeps a head bank (a returning tag's best head swapped back in; "
                     "serving/head_bank.py)", True)
    plan_ahead: bool = doc("the cost-policy configurations learn on a worker thread, one round behind "
                           "(serve --plan-ahead)", False)
    switch_interval_ms: float = doc("every configuration's server runs with this interpreter switch interval "
                                    "(serve --switch-interval-ms); 0 = Python's (5 ms)", 0.0)
    capture_sender: str = doc("where the capturing configurations' engines send their capture (serve "
                              "--capture-sender): thread (the publisher's sender thread), engine (the engine's "
                              "own thread, before each verify read-back) or process (a child process)", "thread")
    reserve_cpu: str = doc("every configuration's server keeps a CPU core for its engine thread, the trainer and "
                           "clients off it (serve --reserve-cpu: off, auto or a CPU)", "off")
    clients_process: bool = doc("the streaming clients run in a process of their own, as a deployment's do "
                                "(off: in the server's process, sharing its interpreter lock with the engine "
                                "thread, as before 2026-11-27)", True)
    interleave: int = doc("serve the whole-trace configurations side by side: the trace in chunks of this many "
                          "requests, every configuration serving each chunk in turn while the others are paused "
                          "(their trainers stopped), the order reversed every other chunk (bench/interleave.py); "
                          "0 = one configuration after another", 0)
    ceiling_heads: str = doc("heads (comma-separated --head values) each serving the trace with the cost "
                             "controller and no trainer, for the per-phase ceiling (see the module doc); "
                             "empty = none", "")

    def __post_init__(self):
        check(self.requests_per_phase >= 1, "requests_per_phase", "must be >= 1")
        check(self.trace_shape in SHAPES, "trace_shape",
              f"must be one of {', '.join(SHAPES)}, got {self.trace_shape!r}")
        ks = [s for s in self.calib_steps.split(",") if s.strip()]
        check(bool(ks) and all(s.strip().isdigit() and int(s) >= 1 for s in ks), "calib_steps",
              f"must be comma-separated integers >= 1, got {self.calib_steps!r}")
        check(self.calib_requests >= 1 and self.bs1_requests >= 1, "calib_requests", "must be >= 1")
        check(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")
        check(self.interleave >= 0, "interleave", f"must be >= 0 (0 = off), got {self.interleave}")
        check(self.baseline_threads >= 0, "baseline_threads", f"must be >= 0, got {self.baseline_threads}")
        check(self.capture_sender in CAPTURE_SENDERS, "capture_sender",
              f"must be one of {CAPTURE_SENDERS}, got {self.capture_sender!r}")
        check(self.reserve_cpu in ("off", "auto") or self.reserve_cpu.isdigit(), "reserve_cpu",
              f"must be off, auto or a CPU number, got {self.reserve_cpu!r}")
        if self.tree:
            self.tree_shape()  # raises naming the field
        self.policy_tree_list()
        names = [s.strip() for s in self.ceiling_heads.split(",") if s.strip()]
        check(len(self.ceiling_labels) == len(names) and "day0" not in names, "ceiling_heads",
              f"must be head names or paths with distinct last parts (not day0), got {self.ceiling_heads!r}")

    def tree_shape(self) -> TreeShape:
        return TreeShape.parse(self.tree, "tree")

    def policy_tree_list(self) -> list[list[int]]:
        out = []
        for s in self.policy_trees.split():
            try:
                t = TreeShape.parse(s, "policy_trees")
            except ConfigError as e:
                raise ConfigError(f"policy_trees: {s!r}: {e}") from None
            out.append([t.num_steps, t.topk, t.num_draft_tokens])
        return out

    @property
    def ceiling_labels(self) -> dict[str, str]:
        """label -> --head value of each ceiling head; the label (a path's last part) names its
        configurations, `ceiling_<label>`."""
        return {Path(s.strip()).name: s.strip() for s in self.ceiling_heads.split(",") if s.strip()}


def run_bench(cfg: E2EConfig, target=None, trainer_args: list | None = None) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = target or load_target(device=cfg.device)
    head = resolve_head(cfg.head, target, cfg.head_tokens)
    if cfg.trace:
        items = load_trace(cfg.trace)
    else:
        n = cfg.requests_per_phase
        items = load_trace(build_drift_trace(out / "trace.jsonl", n, n, n, cfg.seed, shape=cfg.trace_shape))
    runs = phases(items)
    targs = (DEMO_TRAINER_ARGS if trainer_args is None else trainer_args) + cfg.trainer_args.split()

    deadline_s = cfg.deadline_s  # after the first configuration: the safety stop of the others
    # one round-time calibration for every cost-policy session: it measures the machine, not the
    # configuration, so each configuration starts from the same model (and ~30 s on 2 cores once)
    cost_store = str((out / "cost_model.json").resolve())
    guard = SourceGuard()  # the configurations compared must all run the code the bench started with
    pulses: dict[str, float | None] = {}  # configuration -> the machine pulse before it

    def session_config(name, **kw) -> SessionConfig:
        base = dict(name=name, run_dir=str(out / name), head=head, concurrency=cfg.concurrency,
                    tree_candidates=cfg.policy_tree_list(),
                    max_tokens=cfg.max_tokens, deadline_s=deadline_s, server_threads=cfg.server_threads,
                    trainer_threads=cfg.trainer_threads, trainer_args=targs, device=cfg.device,
                    trainer_device=cfg.trainer_device, cost_model_store=cost_store, plan_ahead=cfg.plan_ahead,
                    switch_interval_ms=cfg.switch_interval_ms, clients_process=cfg.clients_process,
                    capture_sender=cfg.capture_sender, reserve_cpu=cfg.reserve_cpu)
        return SessionConfig(**{**base, **kw})

    def figures(result, sc: SessionConfig, t0: float) -> dict:
        write_rounds(result, Path(sc.run_dir) / "rounds.jsonl.gz")  # every round, shape and times
        figs = session_figures(result)
        figs["wall_s"] = time.time() - t0
        return figs

    def session(name, items_, what: str = "", **kw):
        guard.check(f"configuration {name!r}")
        t0 = time.time()
        print(f"== {name}" + (f": {what}" if what else ""), flush=True)
        sc = session_config(name, **kw)
        pulses[name] = pulse = machine_pulse(target, sc.server_threads)  # the machine's speed now (bench/pulse.py)
        if pulse:
            print(f"   machine pulse: {pulse:.1f} tok/s (a fixed plain-decode workload on {sc.server_threads} "
                  f"thread{'s' if sc.server_threads > 1 else ''})", flush=True)
        return figures(run_session(target, sc, items_), sc, t0)

    def side_by_side(specs: dict, pre: str, rep: int) -> dict:
        """Every configuration of `specs` serving the trace chunk by chunk in turn (bench/interleave.py)."""
        order = repeat_order(list(specs), rep)
        guard.check(f"configurations {', '.join(order)}")
        print(f"== side by side, {cfg.interleave} requests a turn: {', '.join(order)} (reversed every other "
              f"chunk; the others paused)", flush=True)
        # each session's safety stop spans every configuration's turns; the chunks stop at deadline_s x N
        scs = {n: session_config(f"{pre}{n}", progress_every_s=0, deadline_s=3 * cfg.deadline_s * len(specs),
                                 **specs[n]) for n in specs}
        t0 = time.time()
        tally: dict[str, float] = {}

        def on_chunk(i, of, name, _session, seconds):
            tally[name] = seconds
            if len(tally) == len(specs):
                phase = items[min(len(items) - 1, i * cfg.interleave)].phase
                print(f"   chunk {i + 1}/{of} ({phase}): " + "  ".join(f"{n} {s:.1f}s" for n, s in tally.items()),
                      flush=True)
                tally.clear()

        results = serve_interleaved(scs, target, items, cfg.interleave, order, cfg.deadline_s * len(specs), on_chunk)
        return {n: figures(results[n], scs[n], t0) for n in specs}

    res: dict = {"bench": "e2e", "config": config_to_dict(cfg), "model": target.name, "head": head or "day0 (random)",
                 "trace": {"requests": len(items), "phases": [[p, len(r)] for p, r in runs]}}
    alone = {"server_threads": cfg.baseline_threads or cfg.server_threads}  # trainer-free: the whole machine

    calib_items = runs[0][1][:cfg.calib_requests]
    calib = {}
    ks = [int(s) for s in cfg.calib_steps.split(",") if s.strip()]
    warmup = len(ks) > 1 and cfg.device.startswith("cuda")
    if warmup:
        # the process's first CUDA session pays its one-off start (context, libraries' handles, kernel
        # loads): on an H100 the first candidate served at ~45 tok/s against ~110-145 for the next, and
        # was never picked for it (2026-11-27). One untimed session takes that cost first.
        session("calib-warmup", calib_items, num_steps=ks[0], progress_every_s=0, **alone,
                what="untimed: the first CUDA session's one-off start, before the timed candidates")
    for k in ks if len(ks) > 1 else []:
        calib[k] = session(f"calib-k{k}", calib_items, num_steps=k, progress_every_s=0, **alone,
                           what=f"calibrating the static K: K = {k} serves the first {len(calib_items)} requests of "
                                f"phase {runs[0][0]!r} (candidates {cfg.calib_steps}; best tokens/s wins)")["overall"]["tokens_per_s"]
    best_k = max(calib, key=lambda k: calib[k] or 0) if calib else ks[0]
    res["static_k"] = {"best": best_k, "tokens_per_s_by_k": calib, "warmup_session": warmup,
                       "how": f"each K served the first {len(calib_items)} requests of phase {runs[0][0]!r}; "
                              "best tokens/s wins"}

    last = runs[-1][1][:cfg.bs1_requests]
    ceiling = {label: resolve_head(name, target, cfg.head_tokens) for label, name in cfg.ceiling_labels.items()}
    repeats = []
    for rep in range(cfg.repeats):
        pre = f"rep{rep}/" if cfg.repeats > 1 else ""
        # the configurations serving the whole trace, in the order of an even repeat; an odd
        # repeat runs them reversed (`repeat_order`), so a machine drifting over the repeats
        # weighs on each configuration alike in the pooled figures
        specs = {"plain": dict(head="none", num_steps=0, **alone), "static": dict(num_steps=best_k, **alone),
                 "sglang_adaptive": dict(policy="sglang_default", num_steps=best_k, **alone)}
        if cfg.tree:
            t = cfg.tree_shape()
            specs["sglang_default_tree"] = dict(num_steps=t.num_steps, eagle_topk=t.topk,
                                                num_draft_tokens=t.num_draft_tokens, **alone)
        if cfg.overhead_split or ceiling:
            specs["cost_policy"] = dict(policy="cost", num_steps=best_k)
        if cfg.overhead_split:
            specs["online_no_training"] = dict(policy="cost", num_steps=best_k, online=True,
                                               trainer_args=targs + ["--min-buffer-tokens", str(NEVER_TRAIN_TOKENS)])
        specs["online_spec"] = dict(policy="cost", num_steps=best_k, online=True, bank=cfg.bank)
        for name, path in ceiling.items():  # beside online-spec: the figures of ceiling_capture run close
            specs[f"ceiling_{name}"] = dict(head=path, policy="cost", num_steps=best_k)
        ran = {}
        if cfg.interleave:
            ran = side_by_side(specs, pre, rep)
            if rep == 0:  # every configuration served the same chunks: the deadline cut all alike
                items = same_work(items, ran["plain"], res)
        for name in [] if cfg.interleave else repeat_order(list(specs), rep):
            ran[name] = session(f"{pre}{name}", items, **specs[name])
            if name == "plain" and rep == 0:  # the deadline shortens the trace for every configuration alike
                items = same_work(items, ran["plain"], res)
                deadline_s = 3 * cfg.deadline_s
        configs = {name: ran[name] for name in specs}
        # batch 1 on the last phase, with the head the trainer left live
        live = (configs["online_spec"].get("trainer") or {}).get("live_version") or 0
        adapted = out / f"{pre}online_spec" / "trainer" / "ckpt" / f"v{live}"
        adapted_head = str(adapted) if live and adapted.exists() else head
        bs1_plain = session(f"{pre}bs1_plain", last, head="none", num_steps=0, concurrency=1, **alone)
        bs1_online = session(f"{pre}bs1_adapted", last, head=adapted_head, policy="cost", num_steps=best_k,
                             concurrency=1)
        bs1 = {"phase": runs[-1][0], "requests": len(last), "adapted_head": adapted_head or "day0 (random)",
               "adapted_version": live, "plain": bs1_plain["overall"], "online_spec": bs1_online["overall"]}
        for name, path in ceiling.items():
            bs1[f"ceiling_{name}"] = session(f"{pre}bs1_ceiling_{name}", last, head=path, policy="cost",
                                             num_steps=best_k, concurrency=1)["overall"]
        repeats.append((configs, bs1))

    configs, res["bs1"] = repeats[0]
    res["configs"] = configs
    res["machine_pulse"] = pulse_figures(pulses)
    cut = sorted(f"rep{i}/{n}" if cfg.repeats > 1 else n for i, (conf, _) in enumerate(repeats)
                 for n, figs in conf.items() if served(figs) < len(items))
    res["same_work"].update(all_served=not cut, short=cut)
    heads = [headline(res["trace"], c, b) for c, b in repeats]
    res.update(heads[0] if len(heads) == 1 else median_headline(heads))
    if len(heads) > 1:
        res["repeats"] = [{**{k: h[k] for k in RATIOS}, "tokens_per_s": {n: c["overall"]["tokens_per_s"]
                                                                          for n, c in conf.items()},
                           "order": repeat_order(list(conf), i), "swaps_online_spec": h["swaps_online_spec"],
                           "ceiling_capture": (h.get("ceiling") or {}).get("ceiling_capture"),
                           "verify_speed": h["verify_speed"]}
                          for i, (h, (conf, _)) in enumerate(zip(heads, repeats))]
        res["pooled"] = pooled_figures([conf for conf, _ in repeats], [p for p, _ in runs])
    if cfg.day0:  # once, after the repeats: it answers "how soon", not "how fast"
        day0 = configs["online_spec_day0"] = session("online_spec_day0", items, head="", policy="cost",
                                                     num_steps=best_k, online=True)
        res["overall"]["online_spec_day0"] = overall_figures(day0)
        for p, figs in res["per_phase"].items():
            figs["online_spec_day0"] = phase_figures(day0, p)
        res["tokens_to_beat_plain_from_day0"] = tokens_to_beat(day0, res["overall"]["plain"]["tokens_per_s"])
    return res


def repeat_order(names: list[str], rep: int) -> list[str]:
    """The configurations of repeat `rep` in the order they run: an even repeat's as given, an
    odd one's reversed (counterbalanced: over two repeats a steady drift of the machine's speed
    adds as much to each configuration's pooled seconds as to any other's)."""
    return list(names) if rep % 2 == 0 else list(reversed(names))


def served(figs: dict) -> int:
    """Requests a session started (the others were cancelled at its deadline, never begun)."""
    return figs["overall"]["requests"] - figs["overall"]["cancelled_at_deadline"]


def same_work(items: list, first: dict, res: dict) -> list:
    """The trace every configuration serves after `first`: the requests `first` served (a prefix:
    requests start in trace order); recorded in `res["same_work"]`."""
    n = max(served(first), 1)
    res["same_work"] = {"requests": n, "of": len(items), "set_by": first["name"]}
    if n < len(items):
        print(f"== the deadline cut the trace to its first {n} of {len(items)} requests: every configuration "
              f"serves those", flush=True)
    return items[:n]


NEVER_TRAIN_TOKENS = 10**12  # a replay buffer never holds this many rows: the daemon ingests, never trains
def tokens_to_beat(day0: dict, plain_tps: float | None) -> int | None:
    """Tokens committed until the end of the first timeline window faster than plain decoding."""
    tl = day0["timeline"]
    total = 0.0
    for tps, acc in zip(tl["tokens_per_s"], tl["accept_len"]):
        total += tps * tl["bin_s"]
        if plain_tps and acc is not None and tps > plain_tps:
            return int(total)
    return None


def phase_figures(c: dict, phase: str) -> dict:
    return {k: (c["phases"].get(phase) or {}).get(k)
            for k in ("tokens_per_s", "accept_len", "accept_length", "tpot_p50_s", "tpot_p99_s")}


def overall_figures(c: dict) -> dict:
    return {k: c["overall"].get(k) for k in ("tokens_per_s", "accept_len", "accept_length", "tpot_p50_s",
                                              "tpot_p99_s", "failed")}


def headline(trace: dict, configs: dict, bs1: dict) -> dict:
    def tps(name, phase=None):
        c = configs.get(name)
        if c is None:
            return None
        return (c["phases"].get(phase) or {}).get("tokens_per_s") if phase else c["overall"]["tokens_per_s"]

    phases = [p for p, _ in trace["phases"]]
    out = {"speedup_vs_static_sglang_adaptive": _ratio(tps("online_spec"), tps("sglang_adaptive")),
           "speedup_vs_static": _ratio(tps("online_spec"), tps("static")),
           "speedup_vs_plain": _ratio(tps("online_spec"), tps("plain")),
           "speedup_vs_plain_bs1_adapted": _ratio(bs1["online_spec"]["tokens_per_s"], bs1["plain"]["tokens_per_s"]),
           "speedup_vs_sglang_default_tree": _ratio(tps("online_spec"), tps("sglang_default_tree")),
           "tree_vs_static": _ratio(tps("sglang_default_tree"), tps("static")),
           "per_phase": {p: {name: phase_figures(c, p) for name, c in configs.items()} for p in phases},
           "per_phase_ratios": {p: {"speedup_vs_static_sglang_adaptive": _ratio(tps("online_spec", p),
                                                                                tps("sglang_adaptive", p)),
                                    "speedup_vs_static": _ratio(tps("online_spec", p), tps("static", p)),
                                    "speedup_vs_plain": _ratio(tps("online_spec", p), tps("plain", p))}
                                for p in phases},
           "overall": {name: overall_figures(c) for name, c in configs.items()},
           "adaptation_online_spec": configs["online_spec"]["adaptation"],
           "swaps_online_spec": len(configs["online_spec"]["swaps"]),
           "alerts_online_spec": len(configs["online_spec"]["alerts"])}
    if configs["online_spec"].get("returns"):
        out["returns"] = return_figures(configs)
    if any(name.startswith("ceiling_") for name in configs):
        out["ceiling"] = ceiling_figures(configs, bs1, phases)
    out["verify_speed"] = verify_speed(configs)  # the machine's speed per configuration (a diagnostic)
    split = overhead_split(tps)
    if split is not None:
        out["overhead_split"] = split
    out["tokens_to_beat_plain_from_day0"] = None  # set by run_bench when the day-0 run is on
    out["targets"] = dict(TARGETS)
    out["met"] = {k: (out[k] is not None and out[k] >= v) for k, v in TARGETS.items()}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, E2EConfig, QUICK, "a short run")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # --quick shortens what the command line did not set (unset flags are absent from args)
    overrides = quick_overrides(args, QUICK)
    cfg = config_from_args(E2EConfig, args, **overrides)
    res = run_bench(cfg)
    write_report(args.json, {"quick": bool(args.quick), **res},
                 show=("speedup_vs_static_sglang_adaptive", "speedup_vs_plain_bs1_adapted",
                       "tokens_to_beat_plain_from_day0", "static_k", "overall", "overhead_split", "ceiling", "met"))
    return 0
