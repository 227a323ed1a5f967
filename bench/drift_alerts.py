"""`online-spec bench drift-alerts`: is the drift monitor quiet on stationary traffic, and quick
to alert when the traffic changes? Real traffic, the real server, over HTTP (issue 7).

Starts the real server (SmolLM2 bf16, the ShareGPT chat head, fixed K, the drift monitor
writing alerts into an offline W&B run) on a loopback port, then:

1. stationary: `clients` closed-loop chat clients (fixed concurrency keeps the batch size
   steady) send ShareGPT held-out chat first turns until `stationary_rounds` verify rounds have run;
   then they stop sending and the running requests drain (so no ShareGPT request is left);
2. switch: the same clients send HumanEval tasks. The first verify round after the drain is the
   switch round; phase 2 runs until a drop alert has been raised and `min_switch_rounds` rounds
   have run, or `max_switch_rounds` rounds, or the time limit.

Both phases carry the same (empty) traffic tag: drift is traffic changing under one label — a
`code` tag would give HumanEval its own detector stream, with its own reference.

Rounds are counted by a round observer on the server (`server.round_observers`, first in the
list), exactly the rounds the detector sees (K > 0). Alerts are caught by a callback sink, and
after the server has closed the W&B run they are read back from its offline files
(`online_spec.alerts.read_alerts_from_offline_run`). Reported:

    false_alerts                 alerts raised during the stationary phase (drain included)
    rounds_to_alert              rounds after the switch up to and including the one that raised
                                 the first drop alert (null: none within the phase)
    alert_in_wandb_offline_run   that drop alert found in the offline run, with its fields
    accept_len_before / _after   mean drafts accepted per request-round (bonus excluded), per phase
    tokens_per_s_before / _after completion tokens / wall time of each phase
    per phase: rounds (by batch size), requests, failures, wall time; the machine

    online-spec bench drift-alerts --json results/bench_drift.json            # >= 2,000 rounds
    online-spec bench drift-alerts --quick --json results/bench_drift_quick.json
    online-spec bench drift-alerts --drift-threshold 16 ...                    # detector tuning
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import torch

from bench.common import quick_overrides, write_report
from bench.heads import HEAD_CHOICES, resolve_head
from online_spec.alerts import read_alerts_from_offline_run
from online_spec.checkpoint import load_head
from online_spec.config import add_config_args, check, config_from_args, config_to_dict, doc
from online_spec.controller.replay import TraceRecorder
from online_spec.data import humaneval_conversations, sharegpt_conversations
from online_spec.drift import DriftAlert, DriftConfig, accept_len_moments
from online_spec.drift_replay import replay_file
from online_spec.target import load_target
from online_spec.wandb_run import init_wandb
from serving.engine import EngineConfig
from serving.requests import RequestOutput, RoundStats
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread
from serving.server_drift import CallbackAlertSink

log = logging.getLogger(__name__)

SHIFTS = ("sharegpt-humaneval", "humaneval-sharegpt")
REQUIRED_STATIONARY_ROUNDS = 2000  # issue 7: the stationary phase must be at least this long


@dataclass
class DriftBenchConfig:
    draft: str = doc("head: " + HEAD_CHOICES + " (default: shipped, pretrained on ShareGPT's chat)", "")
    clients: int = doc("concurrent closed-loop chat clients (keeps the batch size steady): 8, a serving load; "
                       "1 = batch-1 rounds, where a round is one request's and a ~35 % drop needs ~1,000 "
                       "rounds to tell from a hard prompt (docs/server.md)", 8)
    num_steps: int = doc("K, fixed for the whole run", 5)
    shift: str = doc("which traffic comes first: sharegpt-humaneval (issue 7's shift) or humaneval-sharegpt "
                     "(for a head trained on code, e.g. --draft code)",
                     "sharegpt-humaneval")
    stationary_rounds: int = doc("verify rounds of ShareGPT traffic before the switch", 2000)
    min_switch_rounds: int = doc("verify rounds of HumanEval traffic to run at least (accept length after)", 200)
    max_switch_rounds: int = doc("stop the HumanEval phase after this many rounds even without a drop alert "
                                  "(as long as the stationary phase, so both accept lengths rest on as many rounds)", 2000)
    max_tokens: int = doc("max_tokens per request (greedy requests also stop at EOS)", 96)
    max_prompt_tokens: int = doc("longest first turn used as a prompt, in tokens", 256)
    prompts: int = doc("prompts per source (ShareGPT held-out, HumanEval), used in turn", 500)
    temperature: float = doc("sampling temperature of the requests (0 = greedy)", 0.0)
    max_len: int = doc("engine max_len (prompt template + prompt + max_tokens + K must fit)", 1024)
    time_limit_s: float = doc("wall-clock limit per phase", 1800.0)
    work_dir: str = doc("directory under which a fresh directory holds the offline W&B run; "
                        "empty = the system's temp dir", "")
    threads: int = doc("torch CPU threads (0 = torch's default)", 0)
    rounds_out: str = doc("where to write every round the detector sees as a trace line (batch_size, "
                          "accepted, num_steps, request_ids, phase; `online-spec drift replay` and "
                          "`controller replay` read it); default: next to --json as NAME.rounds.jsonl, "
                          "none without --json", "")

    def __post_init__(self):
        check(self.clients >= 1, "clients", "must be >= 1")
        check(self.shift in SHIFTS, "shift", f"must be one of {SHIFTS}, got {self.shift!r}")
        check(self.num_steps >= 1, "num_steps", "must be >= 1 (the detector needs drafts)")
        check(self.stationary_rounds >= 1, "stationary_rounds", "must be >= 1")
        check(1 <= self.min_switch_rounds <= self.max_switch_rounds, "min_switch_rounds",
              f"must be in 1..max_switch_rounds={self.max_switch_rounds}")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.prompts >= 1, "prompts", "must be >= 1")
        check(self.time_limit_s > 0, "time_limit_s", "must be > 0")


QUICK = dict(stationary_rounds=300, min_switch_rounds=100, max_switch_rounds=400, max_tokens=64,
             time_limit_s=900.0)

PHASES = ("stationary", "switched")


# -- the round log: a round observer and an alert sink -----------------------------------------

def _finite_or_none(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v  # NaN is not JSON


class RoundLog:
    """Counts the verify rounds the drift detector sees, per phase, and the alerts they raise.

    `observe` runs on the engine thread (insert it first in `server.round_observers`, so a
    round is counted before the detector's sinks fire for it); `on_alert` is a sink callback;
    `switch` is called by the driver between the phases, while no request is running. With a
    `recorder` (a `TraceRecorder`) every counted round is also written as a trace line.
    """

    def __init__(self, recorder=None):
        self._lock = threading.Lock()
        self.recorder = recorder
        self.phase = PHASES[0]
        self.total = 0  # rounds seen, both phases
        self.switch_round: int | None = None  # index of the first round after the switch
        self.rounds = {p: 0 for p in PHASES}
        self.request_rounds = {p: 0 for p in PHASES}
        self.accepted = {p: 0 for p in PHASES}
        self.committed = {p: 0 for p in PHASES}
        self.by_batch = {p: Counter() for p in PHASES}
        self.alerts: list[dict] = []

    def observe(self, stats: RoundStats, outs: list[RequestOutput], tags: list[str]) -> None:
        if stats.num_steps == 0 or not stats.accepted:  # what ServerDrift skips
            return
        with self._lock:
            p = self.phase
            self.total += 1
            self.rounds[p] += 1
            self.request_rounds[p] += len(stats.accepted)
            self.accepted[p] += sum(stats.accepted)
            self.committed[p] += stats.committed
            self.by_batch[p][stats.batch_size] += 1
            if self.recorder is not None:
                self.recorder.record(stats.batch_size, stats.accepted, num_steps=stats.num_steps,
                                     request_ids=[str(o.request_id) for o in outs],
                                     tags=list(tags) if any(tags) else None,
                                     head_version=stats.head_version, phase=p)

    def on_alert(self, alert: DriftAlert) -> None:
        with self._lock:
            index = self.total - 1  # the round being observed raised it
            after = None if self.switch_round is None else index - self.switch_round + 1
            self.alerts.append({"phase": self.phase, "round_index": index, "rounds_after_switch": after,
                                **{k: _finite_or_none(v) for k, v in alert.to_dict().items()}})

    def switch(self) -> None:
        with self._lock:
            self.phase, self.switch_round = PHASES[1], self.total

    def count(self, phase: str) -> int:
        with self._lock:
            return self.rounds[phase]

    def first_drop(self) -> dict | None:
        with self._lock:
            return next((a for a in self.alerts if a["phase"] == PHASES[1] and a["kind"] == "drop"), None)

    def summary(self, phase: str) -> dict:
        with self._lock:
            n = self.request_rounds[phase]
            return {"rounds": self.rounds[phase],
                    "rounds_by_batch_size": {str(b): c for b, c in sorted(self.by_batch[phase].items())},
                    "request_rounds": n,
                    "accept_len": self.accepted[phase] / n if n else None,
                    "spec_accept_length": (self.accepted[phase] + n) / n if n else None,
                    "committed_tokens": self.committed[phase],
                    "alerts": [a for a in self.alerts if a["phase"] == phase]}


def detector_references(drift, cfg: DriftConfig, num_steps: int) -> dict:
    """What the detector learned per (slot, tag) stream: its reference accept length at K, the
    dispersion of the traffic around the model, and the smallest drop it is tuned to see."""
    with drift._lock:
        streams = drift.detector.state_dict()["streams"]
    out = {}
    for slot, tag, st in streams:
        alpha = st["alpha"] if st["alpha"] is not None else st["prev_alpha"]
        if alpha is None:
            continue
        mu, sd = accept_len_moments(alpha, num_steps)
        out[f"{slot}/{tag}"] = {"rounds": st["rounds"], "reference_accept_len": mu, "per_request_sd": sd,
                               "dispersion": st["dispersion"],
                               "min_effect_drafts": max(cfg.min_effect * mu, cfg.min_effect_abs)}
    return out


# -- traffic -------------------------------------------------------------------------------------

def load_prompts(cfg: DriftBenchConfig, tokenizer) -> tuple[list[list[dict]], list[list[dict]]]:
    """(ShareGPT held-out chat first turns (`topic="chat"`), HumanEval tasks) as chat messages, each
    <= max_prompt_tokens."""
    chat = sharegpt_conversations(limit=cfg.prompts, seed=0, split="heldout", topic="chat",
                                  max_prompt_tokens=cfg.max_prompt_tokens, tokenizer=tokenizer)
    code = [c for c in humaneval_conversations(seed=0, split="all")
            if len(tokenizer(c[0]["content"])["input_ids"]) <= cfg.max_prompt_tokens][:cfg.prompts]
    if not chat or not code:
        raise RuntimeError(f"no prompts within max_prompt_tokens={cfg.max_prompt_tokens} "
                           f"(ShareGPT {len(chat)}, HumanEval {len(code)})")
    return [c[:1] for c in chat], [c[:1] for c in code]


async def _client(client: httpx.AsyncClient, prompts: list[list[dict]], order: itertools.count,
                  cfg: DriftBenchConfig, stop: asyncio.Event, results: list[dict]) -> None:
    while not stop.is_set():
        body = {"model": "bench", "messages": prompts[next(order) % len(prompts)],
                "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
        try:
            r = await client.post("/v1/chat/completions", json=body)
            ok = r.status_code == 200
            results.append({"ok": ok, "tokens": r.json()["usage"]["completion_tokens"] if ok else 0,
                            "error": None if ok else f"HTTP {r.status_code}: {r.text[:200]}"})
        except Exception as e:  # counted as a failure, never hidden
            results.append({"ok": False, "tokens": 0, "error": f"{type(e).__name__}: {e}"})
        if not results[-1]["ok"]:
            await asyncio.sleep(0.5)  # a failing server must not become a busy loop


async def _drive_phase(url: str, prompts: list[list[dict]], cfg: DriftBenchConfig,
                       done: Callable[[], bool]) -> dict:
    """Clients send until `done()` or the time limit, then stop sending; returns when every
    request they sent has been answered (the server is drained)."""
    stop, results, order = asyncio.Event(), [], itertools.count()
    limits = httpx.Limits(max_connections=cfg.clients + 4, max_keepalive_connections=cfg.clients + 4)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        tasks = [asyncio.create_task(_client(client, prompts, order, cfg, stop, results))
                 for _ in range(cfg.clients)]
        while not done() and time.perf_counter() - t0 < cfg.time_limit_s:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "failed_requests": sum(not r["ok"] for r in results),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
            "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
            "timed_out": not done()}


# -- the measurement ---------------------------------------------------------------------------

def measure(cfg: DriftBenchConfig, drift: DriftConfig, target, head, head_version: int = 0,
            rounds_out: Path | None = None) -> dict:
    """Run both phases against a real server with `head`; returns the figures (see the module doc).
    With `rounds_out`, every round the detector sees is written there as a trace line."""
    chat, code = load_prompts(cfg, target.tokenizer)
    names = {"chat": f"ShareGPT held-out first turns ({len(chat)})", "code": f"HumanEval tasks ({len(code)})"}
    src_a, src_b = ("chat", "code") if cfg.shift == "sharegpt-humaneval" else ("code", "chat")
    traffic = {"chat": chat, "code": code}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-drift-", dir=cfg.work_dir or None))
    engine = EngineConfig(max_batch=max(cfg.clients, 1), max_len=cfg.max_len, max_steps=cfg.num_steps,
                          num_steps=cfg.num_steps, max_queue=max(64, 2 * cfg.clients))
    server_cfg = ServerConfig(engine=engine, drift=drift, wandb_mode="offline", wandb_dir=str(run_dir),
                              log_level="warning")
    run = init_wandb("online-spec-bench", None, run_dir, mode="offline", name="bench-drift-alerts",
                     config={"bench": config_to_dict(cfg), "drift": config_to_dict(drift)})
    if run is None:
        raise RuntimeError("could not start an offline W&B run (see the warning above); the bench reads alerts back from it")
    recorder = TraceRecorder.open(rounds_out) if rounds_out is not None else None
    rounds = RoundLog(recorder)
    server = SpecServer(server_cfg, target, head, head_version=head_version, wandb_run=run)
    server.round_observers.insert(0, rounds.observe)
    server.drift.sinks.append(CallbackAlertSink(rounds.on_alert))
    phases: dict[str, dict] = {}
    server.start()
    http = None
    try:
        http = HttpThread(server).start()
        phases["stationary"] = asyncio.run(_drive_phase(
            http.url, traffic[src_a], cfg, lambda: rounds.count("stationary") >= cfg.stationary_rounds))
        left = [r.request_id for r in server.engine.running if r.finish_reason is None] + \
            [r.request_id for r in server.engine.waiting]
        if left:
            raise RuntimeError(f"server not drained at the switch: {left}")
        references = detector_references(server.drift, drift, cfg.num_steps)
        rounds.switch()

        def switched_done() -> bool:
            n = rounds.count("switched")
            return n >= cfg.max_switch_rounds or (n >= cfg.min_switch_rounds and rounds.first_drop() is not None)

        phases["switched"] = asyncio.run(_drive_phase(http.url, traffic[src_b], cfg, switched_done))
    finally:
        if http is not None:
            http.stop()
        server.close()  # finishes the W&B run
        if recorder is not None:
            recorder.close()
    rows = read_alerts_from_offline_run(run_dir, wait_s=60)

    before, after = rounds.summary("stationary"), rounds.summary("switched")
    for name, s in (("stationary", before), ("switched", after)):
        phases[name].update(s)
    first = rounds.first_drop()
    wandb_row = None if first is None else next(
        (r for r in rows if r.get("kind") == "drop" and r.get("round") == first["round"]), None)
    kinds = Counter(a["kind"] for a in before["alerts"])
    replay = None
    if rounds_out is not None:  # the recorded rounds replay offline to the alerts raised live
        replayed, _ = replay_file(rounds_out, drift)
        key = ("round_index", "kind", "slot", "tag")
        replay = {"alerts": len(replayed),
                  "matches_live": [tuple(a[k] for k in key) for a in replayed] ==
                                  [tuple(a[k] for k in key) for a in rounds.alerts]}
    return {
        "bench": "drift-alerts",
        "stationary_rounds": before["rounds"],
        "meets_stationary_round_requirement": before["rounds"] >= REQUIRED_STATIONARY_ROUNDS,
        "false_alerts": len(before["alerts"]),
        "false_alerts_by_kind": dict(kinds),
        "switch_round": rounds.switch_round,
        "switched_rounds": after["rounds"],
        "rounds_to_alert": None if first is None else first["rounds_after_switch"],
        "first_drop_alert": first,
        # any kind: a collapse alert (accept length near zero) is the monitor's answer to an
        # extreme drop, faster than the change test whose noise model is request-level
        "first_alert_after_switch": next(iter(after["alerts"]), None),
        "alert_in_wandb_offline_run": wandb_row is not None,
        "wandb_alert": wandb_row,
        "wandb_alerts_read_back": len(rows),
        "wandb_run_dir": str(run_dir),
        "detector_references_at_switch": references,
        "rounds_trace": None if rounds_out is None else str(rounds_out),
        "rounds_trace_replay": replay,
        "accept_len_before": before["accept_len"],
        "accept_len_after": after["accept_len"],
        "tokens_per_s_before": phases["stationary"]["tokens_per_s"],
        "tokens_per_s_after": phases["switched"]["tokens_per_s"],
        "failed_requests": phases["stationary"]["failed_requests"] + phases["switched"]["failed_requests"],
        "phases": phases,
        "shift": cfg.shift,
        "prompts": {"stationary": names[src_a], "switched": names[src_b]},
        "config": config_to_dict(cfg),
        "drift_config": config_to_dict(drift),
        "model": target.name,
        "head_version": head_version,
    }


REPORT_KEYS = ("bench", "stationary_rounds", "meets_stationary_round_requirement", "false_alerts",
               "false_alerts_by_kind", "switch_round", "switched_rounds", "rounds_to_alert", "first_drop_alert", "first_alert_after_switch", "shift",
               "alert_in_wandb_offline_run", "wandb_alert", "wandb_run_dir", "detector_references_at_switch", "rounds_trace", "rounds_trace_replay",
               "accept_len_before",
               "accept_len_after", "tokens_per_s_before", "tokens_per_s_after", "failed_requests", "phases",
               "config", "drift_config", "model", "head", "quick", "note", "date", "command", "machine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, DriftBenchConfig)
    add_config_args(parser, DriftConfig, prefix="drift_")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run ({QUICK}); does not meet the {REQUIRED_STATIONARY_ROUNDS}-round requirement")


def run(args: argparse.Namespace) -> int:
    overrides = quick_overrides(args, QUICK)
    cfg = config_from_args(DriftBenchConfig, args, **overrides)
    drift = config_from_args(DriftConfig, args, prefix="drift_")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    load_at_start = os.getloadavg()
    draft = Path(resolve_head(cfg.draft or "shipped"))
    target = load_target()
    head, meta = load_head(draft, target.info, dtype=target.dtype)
    rounds_out = Path(cfg.rounds_out) if cfg.rounds_out else (
        args.json.with_suffix(".rounds.jsonl") if args.json is not None else None)
    if rounds_out is not None:
        rounds_out.parent.mkdir(parents=True, exist_ok=True)
    figures = measure(cfg, drift, target, head, head_version=int(meta.get("version", 0)), rounds_out=rounds_out)
    figures["head"] = {"dir": str(draft), **meta}
    figures["quick"] = bool(args.quick)
    figures["load_avg_at_bench_start"] = load_at_start  # machine.load_avg_at_start is read at the end
    figures["note"] = (f"quick run: {figures['stationary_rounds']} stationary rounds, below the "
                       f"{REQUIRED_STATIONARY_ROUNDS} the measurement requires" if args.quick else
                       "full run" if figures["meets_stationary_round_requirement"] else
                       f"stationary phase stopped at {figures['stationary_rounds']} rounds (time limit), below "
                       f"the {REQUIRED_STATIONARY_ROUNDS} the measurement requires")
    write_report(args.json, figures)
    return 0 if figures["failed_requests"] == 0 else 1
