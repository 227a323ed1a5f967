"""`online-spec bench adapt`: how many served tokens the online loop needs to adapt to a traffic shift.

Three sessions on one trace, one after the other, in one process (`bench.session`):

  online     the server with the starting head (`--head`, default the shipped ShareGPT chat head) and
             the trainer daemon beside it (capture, replay, distillation, gate, swaps over the
             control endpoint; settings `ADAPT_TRAINER_ARGS`); traffic: a short ShareGPT phase,
             then HumanEval
  control    the same trace and head, daemon off (a static ShareGPT head)
  reference  the HumanEval part of the trace served by a head pretrained on code
             (`--reference`, default the packaged code head: ShareGPT's code conversations and
             HumanEval's train tasks, online_spec/pretrained/code-h100)

All three at the same static K (`--num-steps`), greedy, same concurrency. The traffic is
HumanEval's held-out tasks (the reference never trained on them) and held-out ShareGPT chats.

What is measured, on HumanEval tokens only ("served tokens after the shift" counts the tokens
of HumanEval requests, the first of each included; the ShareGPT requests still in flight at the
shift are not counted). Every served token is labelled from the round log: an accepted draft
(1), the token that closed a drafted round (0: the target's correction or the bonus), or no draft.
accept_len over a set of tokens = accepted / drafted rounds (drafts per round, bonus excluded).

  accept_len_per_500_tokens    consecutive blocks of `window_tokens` served HumanEval tokens, per
                               session; `reference_on_online_tokens` is the reference's accept_len on
                               the very tokens (request, position) of each online block
  tokens_to_90pct_of_indomain  served tokens until the online accept_len over the last
                               `window_tokens` first reaches `fraction` x the reference's accept_len
                               on the same tokens (the earliest possible value is one window);
                               `thresholds` also gives it against the reference's mean over the whole
                               phase, the point from which it stays there (`sustained`), and the
                               same figures for the control (a control that gets there too means the
                               head needed no adaptation to pass)
  swaps                        head versions that went live, with the served tokens at that moment

    online-spec bench adapt --json results/bench_adapt.json         # ~5 min on 2 cores
    online-spec bench adapt --quick --json /tmp/adapt_quick.json     # ~2 min
"""

from __future__ import annotations

import argparse
import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from bench.common import add_bench_args, quick_overrides, write_report
from bench.heads import HEAD_CHOICES, resolve_head
from bench.report import session_figures
from bench.session import SessionConfig, run_session
from bench.trace import load_trace
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.data import humaneval_conversations, sharegpt_conversations
from online_spec.jsonl import write_json_lines
from online_spec.target import load_target

PHASES = ("sharegpt", "humaneval")

# The daemon's settings for fast adaptation on a 2-core CPU (one thread for the trainer, one for
# the server), chosen offline: the shipped head fine-tuned on the traffic of 12 held-out HumanEval
# tasks, simulated accept length (K = 5) on 20 others. lr 3e-3 (the pretraining rate) wrecks the
# head within 10 steps (1.20 -> 0.59); 1e-3 loses 25 % and has not recovered after 30 steps; 1e-4
# barely moves; 2e-4 .. 5e-4 dip 3-10 % over the first 10-25 steps (a fresh AdamW state on a
# small, narrow sample) and then climb past the start (3e-4 with 512-row steps: +4.5 % after 40
# steps; a 10-step warmup makes the dip shallowest). The gate keeps the dip off the server.
# Recent-biased sampling (90 % from the newest ~2,500 rows) trains on the new traffic rather than
# the whole history; an evaluation every 3 steps / 8 s on the newest 384 held-out rows (1 request
# in 5 is held out) at K = the serving K, with a 0.5 % margin, lets a better head through within
# seconds of its existence; the loss unrolls 3 draft steps. Drift alerts add nothing here
# (evaluation is already frequent): the boost is off. Rollback: a version is judged after 150
# rounds and only a 20 % drop rolls it back: HumanEval tasks differ so much that 40 rounds and
# 10 % roll good swaps back on noise.
ADAPT_TRAINER_ARGS = [
    "--min-buffer-tokens", "128", "--batch-tokens", "512", "--eval-every-steps", "3", "--eval-every-s", "8",
    "--eval-tokens", "384", "--save-every-steps", "1000", "--drift-boost-s", "0",
    "--gate-min-anchors", "128", "--gate-margin-rel", "0.005", "--gate-margin-abs", "0.005",
    "--gate-rollback-min-rounds", "150", "--gate-rollback-threshold", "0.2",
    "--replay-heldout-every", "5", "--replay-recent-fraction", "0.9", "--replay-memory-bytes", str(12 << 20),
    "--replay-flush-interval-s", "120",
    "--distill-lr", "3e-4", "--distill-warmup-steps", "10", "--loss-ttt-steps", "3"]


@dataclass
class AdaptBenchConfig:
    head: str = doc("starting head: " + HEAD_CHOICES + " (bench.heads)", "shipped")
    reference: str = doc("in-domain head for the HumanEval part: " + HEAD_CHOICES + " (default: code, the "
                         "packaged head pretrained on ShareGPT's code conversations and HumanEval's train tasks)",
                         "code")
    sharegpt_requests: int = doc("requests of the ShareGPT phase before the shift", 6)
    humaneval_requests: int = doc("requests of the HumanEval phase (held-out tasks; 44 exist, more repeat)", 44)
    max_tokens: int = doc("max_tokens per request", 128)
    num_steps: int = doc("K of every session (static; 5 = the shipped head's best static K at batch 1, "
                         "docs/results.md: deeper drafts are where domain knowledge shows)", 5)
    concurrency: int = doc("streaming clients in flight", 4)
    window_tokens: int = doc("served tokens per window (sliding) and per block of the curve", 500)
    fraction: float = doc("the headline threshold: this fraction of the reference's accept_len", 0.9)
    aim_tokens: int = doc("the aim for tokens_to_90pct_of_indomain", 3000)
    deadline_s: float = doc("per session: stop starting requests after this long", 900.0)
    out: str = doc("run directory of the sessions (trainer state, logs)", "runs/bench_adapt")
    server_threads: int = doc("torch threads of the server process", 1)
    trainer_threads: int = doc("torch threads of the trainer process", 1)
    trainer_args: str = doc("extra `online-spec train` flags for the daemon, space-separated (after "
                            "ADAPT_TRAINER_ARGS, so they override)", "")
    control: bool = doc("also run the control session (daemon off)", True)
    seed: int = doc("seed of the trace", 0)

    def __post_init__(self):
        check(self.sharegpt_requests >= 0, "sharegpt_requests", "must be >= 0")
        check(self.humaneval_requests >= 1, "humaneval_requests", "must be >= 1")
        check(self.max_tokens >= 2, "max_tokens", "must be >= 2")
        check(1 <= self.num_steps <= 7, "num_steps", "must be in 1..7 (the engine's max_steps)")
        check(self.window_tokens >= 1, "window_tokens", "must be >= 1")
        check(0 < self.fraction <= 2, "fraction", "must be in (0, 2]")


QUICK = dict(sharegpt_requests=2, humaneval_requests=8, max_tokens=48, window_tokens=100, aim_tokens=300,
             deadline_s=240.0)


# -- the trace ---------------------------------------------------------------------------------
def build_trace(path: Path, cfg: AdaptBenchConfig, tokenizer) -> list:
    """ShareGPT held-out chat conversations (no programming: `is_code_conversation`; phase sharegpt,
    tag chat), then HumanEval held-out tasks (phase humaneval, tag code), as a JSONL trace; returns
    its items."""
    chat = sharegpt_conversations(limit=cfg.sharegpt_requests, seed=cfg.seed, split="heldout", topic="chat",
                                  max_prompt_tokens=200, tokenizer=tokenizer) if cfg.sharegpt_requests else []
    code = humaneval_conversations(split="heldout", seed=cfg.seed)
    code = [code[i % len(code)] for i in range(cfg.humaneval_requests)]
    lines = [{"messages": c[:1], "tag": "chat", "phase": PHASES[0], "max_tokens": cfg.max_tokens} for c in chat]
    lines += [{"messages": c[:1], "tag": "code", "phase": PHASES[1], "max_tokens": cfg.max_tokens} for c in code]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_lines(path, lines)
    return load_trace(path)


# -- served tokens and their labels -----------------------------------------------------------------
ACCEPTED, CLOSED, UNDRAFTED = 1, 0, None


def token_stream(result, phase: str = PHASES[1]) -> list[tuple[int, int, int | None, float, int]]:
    """Served tokens of `phase`'s requests in serving order: (trace index, position in the output,
    label, round time, head version). Each request's first token (from its prefill) is emitted
    with its first round, unlabelled; a drafted round with a accepted drafts emits a tokens labelled
    ACCEPTED and one CLOSED; an undrafted round one UNDRAFTED. Positions past the request's
    completion tokens (a round cut by max_tokens or a stop) are dropped."""
    index = {r.request_id: r for r in result.requests if r.phase == phase and r.request_id}
    pos: dict[str, int] = {}
    out = []
    for rd in result.rounds:
        drafted = rd["num_steps"] > 0
        for rid, a in zip(rd["request_ids"], rd["accepted"]):
            req = index.get(rid)
            if req is None:
                continue
            labels = ([ACCEPTED] * a + [CLOSED]) if drafted else [UNDRAFTED]
            if rid not in pos:
                pos[rid] = 0
                labels = [UNDRAFTED] + labels
            for lab in labels:
                p = pos[rid]
                pos[rid] += 1
                if req.completion_tokens and p >= req.completion_tokens:
                    continue
                out.append((req.index, p, lab, rd["t"], rd["head_version"]))
    return out


def accept_len(labels) -> float | None:
    labels = list(labels)
    rounds = sum(1 for x in labels if x == CLOSED)
    return sum(1 for x in labels if x == ACCEPTED) / rounds if rounds else None


def blocks(stream, size: int, labels_of=None) -> list[float | None]:
    """accept_len per consecutive block of `size` served tokens (the last, partial block only if
    it holds at least half a block). `labels_of(token) -> label` reads labels from elsewhere (the
    reference's labels of the same tokens)."""
    get = labels_of or (lambda tok: tok[2])
    out = []
    for i in range(0, len(stream), size):
        chunk = stream[i:i + size]
        if len(chunk) < size and (i > 0 and len(chunk) < size // 2):
            break
        out.append(_round(accept_len(get(tok) for tok in chunk)))
    return out


def _round(x, nd: int = 4):
    return None if x is None else round(x, nd)


class _Window:
    """Running counts of accepted drafts and drafted rounds over the last `size` tokens."""

    def __init__(self, size: int):
        self.size, self.items, self.acc, self.rounds = size, deque(), 0, 0

    def push(self, label) -> None:
        self.items.append(label)
        self._count(label, +1)
        if len(self.items) > self.size:
            self._count(self.items.popleft(), -1)

    def _count(self, label, sign: int) -> None:
        if label == ACCEPTED:
            self.acc += sign
        elif label == CLOSED:
            self.rounds += sign

    @property
    def full(self) -> bool:
        return len(self.items) >= self.size

    @property
    def value(self) -> float | None:
        return self.acc / self.rounds if self.rounds else None


def window_ratios(stream, size: int, ref_labels: dict) -> list[tuple[int, float | None, float | None]]:
    """At every served token from the first full window on: (tokens served so far, the stream's
    accept_len over its last `size` tokens, the reference's accept_len on those same tokens)."""
    own, ref = _Window(size), _Window(size)
    out = []
    for n, (idx, p, lab, _, _) in enumerate(stream, 1):
        own.push(lab)
        ref.push(ref_labels.get((idx, p), UNDRAFTED))
        if own.full:
            out.append((n, own.value, ref.value))
    return out


def tokens_to(ratios, fraction: float, fixed_ref: float | None = None) -> dict:
    """First served-token count at which the window's accept_len >= fraction x the reference's
    (the same tokens' reference figure, or `fixed_ref`), and the count from which it stays there."""
    def ok(own, ref):
        ref = fixed_ref if fixed_ref is not None else ref
        return own is not None and ref is not None and own >= fraction * ref

    first = next((n for n, own, ref in ratios if ok(own, ref)), None)
    sustained = None
    for n, own, ref in reversed(ratios):
        if not ok(own, ref):
            break
        sustained = n
    return {"first": first, "sustained": sustained}


def swaps_in_tokens(result, stream) -> list[dict]:
    """Each head version that went live during the phase: served phase tokens at that moment."""
    t_tokens = [tok[3] for tok in stream]
    out = []
    for s in result.swaps:
        if stream and s["t"] >= stream[0][3]:
            out.append({"tokens": bisect.bisect_right(t_tokens, s["t"]), "t_after_shift_s": round(s["t"] - stream[0][3], 2),
                        "from": s["from"], "to": s["to"], "rollback": s["rollback"]})
    return out


def labels_by_token(stream) -> dict[tuple[int, int], int | None]:
    """{(trace index, position): label} of a session's served tokens."""
    return {(idx, p): lab for idx, p, lab, _, _ in stream}


def by_version(stream, **others: dict) -> dict[str, dict]:
    """Per head version that served the phase: its tokens, its accept_len, and that of each of
    `others` (label maps of other sessions, by name) on the same tokens."""
    out: dict[str, list] = {}
    for tok in stream:
        out.setdefault(str(tok[4]), []).append(tok)
    return {v: {"tokens": len(toks), "accept_len": _round(accept_len(t[2] for t in toks)),
                **{f"{name}_same_tokens": _round(accept_len(o.get((t[0], t[1])) for t in toks))
                   for name, o in others.items()}}
            for v, toks in out.items()}


# -- the bench ------------------------------------------------------------------------------------
def run_bench(cfg: AdaptBenchConfig, target=None) -> dict:
    t_start = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = target or load_target()
    head = resolve_head(cfg.head, target)
    reference = resolve_head(cfg.reference, target)
    items = build_trace(out / "trace.jsonl", cfg, target.tokenizer)
    code_items = [it for it in items if it.phase == PHASES[1]]
    trainer_args = ADAPT_TRAINER_ARGS + ["--eval-max-steps", str(cfg.num_steps)] + cfg.trainer_args.split()

    def session(name, items_, head_, online=False):
        print(f"== {name} ({len(items_)} requests)", flush=True)
        scfg = SessionConfig(name=name, run_dir=str(out / name), head=head_, policy="static",
                             num_steps=cfg.num_steps, online=online, concurrency=cfg.concurrency,
                             max_tokens=cfg.max_tokens, deadline_s=cfg.deadline_s,
                             server_threads=cfg.server_threads, trainer_threads=cfg.trainer_threads,
                             trainer_args=trainer_args if online else [], progress_every_s=10.0)
        t0 = time.time()
        res = run_session(target, scfg, items_)
        figs = session_figures(res)
        stream = token_stream(res)
        return res, stream, {"wall_s": round(time.time() - t0, 1), "requests": figs["overall"]["requests"],
                             "failed": figs["overall"]["failed"],
                             "cancelled_at_deadline": figs["overall"]["cancelled_at_deadline"],
                             "tokens_per_s": _round(figs["overall"]["tokens_per_s"], 2),
                             "humaneval_tokens": len(stream),
                             "humaneval_accept_len": _round(accept_len(t[2] for t in stream)),
                             "humaneval_tokens_per_s": _round((figs["phases"].get(PHASES[1]) or {}).get("tokens_per_s"), 2)}

    online_res, online, online_info = session("online", items, head, online=True)
    control = control_info = None
    if cfg.control:
        _, control, control_info = session("control", items, head)
    _, ref, ref_info = session("reference", code_items, reference)
    ref_labels = labels_by_token(ref)
    ctrl_labels = labels_by_token(control) if control is not None else {}
    ref_mean = accept_len(t[2] for t in ref)
    swaps = swaps_in_tokens(online_res, online)
    first_swap = next((s["tokens"] for s in swaps if not s["rollback"]), None)

    W = cfg.window_tokens
    fractions = sorted({cfg.fraction, 1.0})
    online_ratios = window_ratios(online, W, ref_labels)
    control_ratios = window_ratios(control, W, ref_labels) if control is not None else []
    thresholds = {}
    for f in fractions:
        thresholds[f"{f:g}"] = {
            "online": {"same_tokens": tokens_to(online_ratios, f), "phase_mean": tokens_to(online_ratios, f, ref_mean)},
            "control": None if control is None else {"same_tokens": tokens_to(control_ratios, f),
                                                     "phase_mean": tokens_to(control_ratios, f, ref_mean)}}
    headline = thresholds[f"{cfg.fraction:g}"]["online"]["same_tokens"]["first"]
    ctrl_first = (thresholds[f"{cfg.fraction:g}"]["control"] or {}).get("same_tokens", {}).get("first")
    ctrl_acc = control_info["humaneval_accept_len"] if control_info else None
    after = online[first_swap:] if first_swap is not None else []
    res = {
        "bench": "adapt", "config": config_to_dict(cfg), "model": target.name, "num_steps": cfg.num_steps,
        "head": head or "day0 (random)", "reference": {"name": cfg.reference, "path": reference},
        "trainer_args": trainer_args,
        "tokens_to_90pct_of_indomain": headline,
        "aim_tokens": cfg.aim_tokens, "met": headline is not None and headline <= cfg.aim_tokens,
        "control_tokens_to_90pct_of_indomain": ctrl_first,
        # the static head is already above the threshold on average: passing it says nothing
        # about adaptation against this reference
        "trivially_met": bool(ctrl_acc and ref_mean and ctrl_acc >= cfg.fraction * ref_mean),
        "thresholds": thresholds,
        "humaneval_accept_len": {"online": online_info["humaneval_accept_len"], "control": ctrl_acc,
                                 "reference": _round(ref_mean)},
        "control_over_reference": _round(ctrl_acc / ref_mean if ctrl_acc and ref_mean else None),
        "tokens_to_first_swap": first_swap,
        # after the first swap, on the very tokens the online run served: online, control, reference
        "after_first_swap_same_tokens": {
            "tokens": len(after), "online": _round(accept_len(t[2] for t in after)),
            "control": _round(accept_len(ctrl_labels.get((t[0], t[1])) for t in after)) if control else None,
            "reference": _round(accept_len(ref_labels.get((t[0], t[1])) for t in after))},
        "accept_len_per_500_tokens": {
            "block_tokens": W,
            "online": blocks(online, W),
            "control_on_online_tokens": blocks(online, W, lambda tok: ctrl_labels.get((tok[0], tok[1])))
            if control is not None else None,
            "reference_on_online_tokens": blocks(online, W, lambda tok: ref_labels.get((tok[0], tok[1]))),
            "control": blocks(control, W) if control is not None else None,
            "reference": blocks(ref, W)},
        "online_by_head_version": by_version(online, control=ctrl_labels, reference=ref_labels),
        "swaps": swaps,
        "trainer": online_res.trainer,
        "sessions": {"online": online_info, "control": control_info, "reference": ref_info},
        "wall_s": round(time.time() - t_start, 1),
    }
    return res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, AdaptBenchConfig, QUICK, "a short run")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(AdaptBenchConfig, args, **quick_overrides(args, QUICK))
    res = run_bench(cfg)
    write_report(args.json, {"quick": bool(args.quick), **res})
    return 0
