"""`online-spec demo`: server + trainer + drifting traffic, live, ending with a report.

Starts the embedded server (SmolLM2) with a head, the capture publisher, the control endpoint,
and the trainer daemon in a child process (`bench.session`); replays a drifting trace
(ShareGPT chat -> HumanEval code -> a mix, or `--trace FILE`) over HTTP with streaming clients;
echoes the trainer's start-up and gate verdicts from its own log (bench/trainer_watch.py) and prints
a progress line every few seconds (rounds, tokens/s, accept_len and K per batch size, head
version, swaps, the trainer's step, alerts); writes OUT/summary.md, OUT/figures.json, two PNGs
and OUT/rounds.jsonl.gz (every verify round, for `online-spec drift replay --trace`). Times in
the report count from the first request; the start-up before it is reported apart.

    online-spec demo                                  # ~15 min on 2 cores the first time, ~10 after
    online-spec demo --minutes 3 --head day0          # quick look, random day-0 head
    online-spec demo --trace my.jsonl --concurrency 8 --out runs/demo-mine

Head (`--head`, resolved by bench.heads): `shipped` (default) is the ShareGPT head that
ships with the package (online_spec/pretrained/sharegpt-chat-h100, trained on an H100 with the
project's own loss); `code` the packaged code head (online_spec/pretrained/code-h100); `sharegpt` is a head
pretrained on this machine by `trainer.pretrain` with `--head-tokens` training tokens, built on
first use into ~/.cache/online-spec/heads/sharegpt-demo-N and reused; `day0` is a random head; a
directory is a head checkpoint or a pretrain run directory (its `head/`).
CPU sharing: the server process uses `--server-threads` (1) torch threads, the trainer
`--trainer-threads` (1), so on 2 cores each has one.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from bench.heads import HEAD_CHOICES, resolve_head
from bench.trace import build_drift_trace, load_trace, phases
from online_spec.config import add_config_args, check, config_from_args, doc
from online_spec.drift import MIX_TAG
from online_spec.starvation import KINDS as STARVATION_KINDS

log = logging.getLogger(__name__)

# the daemon's settings for a demo: small batches, frequent evaluation, a small gate sample (1,024
# rows: ~5 held-out requests' prompts and generated rows; the live head's counts are cached, so an
# evaluation is one pass of the candidate: 1.9 s on one core).
# lr 3e-4, not 1e-3: on the replayed stream of a bench e2e run (chat -> code -> mix, 190 steps from
# the shipped head; scripts/forgetting_probe.py, docs/results.md) both learn code alike (HumanEval
# 1.41 -> 2.28 / 2.26 drafts a round at K = 3), but on held-out chat no head trained on, 1e-3
# forgets the stream's chat by 33 %, 3e-4 by 13 %. Anchor 30 (a pull toward the starting head
# after each step, DistillConfig.anchor): the stream's held-out chat -7 % instead of -13 %, its
# recurring code +24 % instead of +28 % (anchor 100: -4 % / +16 %). Drift boost off: an alert
# still reaches the daemon (its log says so), but evaluating after every step for 120 s from the
# shift alert halves the trainer's steps (~2 s a step, ~1.7 s an evaluation on one core) right
# when adaptation counts; the demo evaluates every 5 steps / 20 s anyway.
# Whole spans (--replay-whole-spans, 400-row budget: ~500 rows a step): a span cut to a window that
# starts after its prompt trains the head without the context serving gives it; on the same replay
# (anchor 30, 190 steps) whole spans give held-out chat 1.31 / code 1.87 with 9 % fewer rows, cut
# windows 1.28 / 1.73 (docs/results.md).
# Niceness 19: the server process (engine, HTTP, the replaying clients) sometimes wants both cores;
# at equal priority the trainer takes them and costs the server ~10 % of its tokens/s, at nice 19
# ~2 % with the same optimizer steps per second (scripts/colocate_probe.py, docs/results.md).
# Beside other busy work nice 19 starves it (2 steps in 10 minutes next to one busy process): while
# starved it runs at nice 5 (--nice-starved, trainer/starved_share.py).
DEMO_TRAINER_ARGS = ["--nice", "19", "--nice-starved", "5", "--min-buffer-tokens", "128", "--batch-tokens", "400", "--replay-whole-spans",
                     "--eval-every-steps", "5",
                     "--eval-every-s", "20", "--eval-tokens", "1024", "--save-every-steps", "20",
                     "--gate-min-anchors", "64", "--gate-rollback-min-rounds", "30",
                     "--replay-heldout-every", "4", "--replay-flush-interval-s", "30", "--distill-lr", "3e-4",
                     "--distill-anchor", "30", "--drift-boost-s", "0"]


@dataclass
class DemoConfig:
    minutes: float = doc("serving time budget (the first-time head build comes on top)", 10.0)
    trace: str = doc("JSONL trace to replay; empty = the built-in drifting trace sized to --minutes", "")
    concurrency: int = doc("streaming clients in flight", 4)
    head: str = doc(HEAD_CHOICES + " (bench.heads)", "shipped")
    head_tokens: int = doc("training tokens of the default ShareGPT head (first-time build)", 16_000)
    out: str = doc("report directory", "runs/demo")
    max_tokens: int = doc("max_tokens of trace lines that give none", 64)
    requests_per_minute: float = doc("built-in trace: requests per phase per serving minute (each phase gets a "
                                     "third of --minutes; lines left when it is up are skipped, so the trace "
                                     "must hold more than the machine serves: a 2-core CPU serves ~100 a "
                                     "minute at 4 clients, where 30 run out before the phases' time is up)", 60.0)
    policy: str = doc("K policy of the server: cost (the project's controller), sglang_default, static", "cost")
    num_steps: int = doc("initial / static K", 3)
    server_threads: int = doc("torch threads of the server process", 1)
    trainer_threads: int = doc("torch threads of the trainer process", 1)
    seed: int = doc("seed of the built-in trace", 0)

    def __post_init__(self):
        check(self.minutes > 0, "minutes", "must be > 0")
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check(self.head_tokens >= 1000, "head_tokens", "must be >= 1000")
        check(self.requests_per_minute > 0, "requests_per_minute", "must be > 0")


def trace_items(cfg: DemoConfig, out: Path):
    if cfg.trace:
        return load_trace(cfg.trace)
    n = max(2, round(cfg.minutes * cfg.requests_per_minute))
    path = build_drift_trace(out / "trace.jsonl", n, n, n, cfg.seed)
    return load_trace(path)


def run_demo(cfg: DemoConfig, target=None, trainer_args: list | None = None) -> dict:
    """The whole demo; returns figures.json's content."""
    # torch comes with these: `online-spec demo --help` imports this module and stays fast
    import torch

    from bench.common import write_report
    from bench.report import plot_session, session_figures, why_no_swap, write_rounds
    from bench.session import SessionConfig, run_session
    from online_spec.target import load_target

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(cfg.server_threads, cfg.trainer_threads))  # the head build uses both cores
    target = target or load_target()
    head = resolve_head(cfg.head, target, cfg.head_tokens)
    items = trace_items(cfg, out)
    print(f"trace: {len(items)} requests, phases {[(n, len(r)) for n, r in phases(items)]}", flush=True)
    scfg = SessionConfig(name="online-spec", run_dir=str(out / "session"), head=head, policy=cfg.policy,
                         num_steps=cfg.num_steps, online=True, concurrency=cfg.concurrency,
                         max_tokens=cfg.max_tokens, deadline_s=cfg.minutes * 60, server_threads=cfg.server_threads,
                         trainer_threads=cfg.trainer_threads,
                         phase_budget_s=0.0 if cfg.trace else cfg.minutes * 60 / 3,
                         trainer_args=DEMO_TRAINER_ARGS if trainer_args is None else trainer_args)
    result = run_session(target, scfg, items)
    figs = session_figures(result)
    figs["config"] = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    figs["head"] = head or "day0 (random)"
    figs["requests"] = [r.to_dict() for r in result.requests]
    pngs = plot_session(result, figs, out)
    write_rounds(result, out / "rounds.jsonl.gz")
    figs["plots"] = [p.name for p in pngs]
    figs = write_report(out / "figures.json", figs, show=())
    (out / "summary.md").write_text(summary_md(figs))
    print(f"served {figs['overall']['requests']} of {figs['trace_lines']} trace lines in {figs['serving_s']:.0f} s "
          f"(start-up {figs['startup_s']:.0f} s before). {skipped_note(figs)}", flush=True)
    if why_no_swap(figs):
        print(why_no_swap(figs), flush=True)
    print(f"report: {out / 'summary.md'}", flush=True)
    return figs


def skipped_note(figs: dict) -> str:
    """Why trace lines went unserved: by design with the built-in trace, the deadline with a file."""
    n = figs["skipped_lines"]
    if not n:
        return "Every line was served."
    if not figs["config"]["trace"]:
        return (f"The other {n} were skipped by design: each phase gets a third of --minutes and the built-in "
                f"trace holds more lines than the machine serves, so chat, code and mix all show.")
    return f"The other {n} were not started before the --minutes deadline."


def _f(x, nd=2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def summary_md(figs: dict) -> str:
    from bench.report import why_no_swap

    o, tr = figs["overall"], figs.get("trainer") or {}
    watch = tr.get("watch") or {}
    verdicts = [e for e in watch.get("events", []) if e["kind"] == "gate"]
    starved = [a for a in figs["alerts"] if a.get("kind") in STARVATION_KINDS]  # the trainer's own alerts
    lines = [f"# online-spec demo ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"head at start: `{figs['head']}`; {figs['serving_s']:.0f} s of serving, after {figs['startup_s']:.0f} s "
             f"of start-up (model, K calibration, the trainer's start; times below count from the first request); "
             f"{o['requests']} requests ({o['failed']} failed, {o['cancelled_at_deadline']} cut at the deadline), "
             f"{o['completion_tokens']} tokens.", "",
             f"Trace: {o['requests']} of {figs['trace_lines']} lines served. {skipped_note(figs)}", "",
             f"Trainer: {tr.get('step')} steps, {len(verdicts)} gate evaluations, {tr.get('swaps')} swaps "
             f"(live v{tr.get('live_version')}), {len(tr.get('rolled_back') or [])} rollbacks, "
             f"{tr.get('refused_swaps')} refused by the server; {len(figs['alerts']) - len(starved)} drift alerts."
             + (f" {why_no_swap(figs)}." if why_no_swap(figs) else ""), ""]
    if starved:
        lines += [f"**The trainer said it was starved** ({len(starved)} alerts): "
                  + "; ".join(f"{a['t_s']:.0f} s: {a.get('text')}" for a in starved[-3:]), ""]
    if verdicts:
        lines += ["Gate verdicts (s from the first request): "
                  + "; ".join(f"{e['t_s']:.0f}: {e['text']}" for e in verdicts[-8:])
                  + (f" (last 8 of {len(verdicts)})" if len(verdicts) > 8 else ""), ""]
    lines += ["| phase | requests | tokens | tokens/s | accept_len (no bonus) | TPOT p50 / p99 (s) |",
              "|---|---|---|---|---|---|"]
    for name, p in list(figs["phases"].items()) + [("overall", o)]:
        lines.append(f"| {name} | {p['requests']} | {p['completion_tokens']} | {_f(p['tokens_per_s'], 1)} | "
                     f"{_f(p['accept_len'])} | {_f(p['tpot_p50_s'], 3)} / {_f(p['tpot_p99_s'], 3)} |")
    lines += ["", "Swaps (s from the first request): " + (", ".join(f"{s['t_s']:.0f} (v{s['to']}{', rollback' if s['rollback'] else ''})" for s in figs["swaps"]) or "none"),
              "Alerts: " + (", ".join(f"{a['t_s']:.0f} ({a.get('kind', '?')}, slot {a.get('slot')}, "
                                      + ("all traffic" if a.get("tag") == MIX_TAG else f"tag {a.get('tag')!r}") + ")"
                                      for a in figs["alerts"]) or "none"), "",
              "Adaptation after each shift:", ""]
    for a in figs["adaptation"]:
        if a["time_to_first_swap_s"] is None:
            lines.append(f"- {a['shift']} at {a['t_shift_s']:.0f} s: {a['note']}")
            continue
        adapt = (a["note"] if a["time_to_adapt_s"] is None else
                 f"accept_len {_f(a['first_accept_len'])} -> {_f(a['final_accept_len'])}, 90 % of the final level "
                 f"after {a['time_to_adapt_s']:.0f} s ({_f(a['tokens_to_adapt'])} tokens)")
        lines.append(f"- {a['shift']} at {a['t_shift_s']:.0f} s: first swap after {a['time_to_first_swap_s']:.0f} s "
                     f"({_f(a['tokens_to_first_swap'])} tokens); {adapt}")
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in figs.get("plots", [])), ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, DemoConfig)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_demo(config_from_args(DemoConfig, args))
    return 0
