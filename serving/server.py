"""The server behind `online-spec serve`: engine, engine thread, metrics, drift monitor, control.

In: a `ServerConfig` (flags derived from it and from `EngineConfig`), a target (SmolLM2 by
default) and a draft head (`--draft`: the shipped chat head by default, `code`, `day0` for a random
head, or a directory; online_spec/heads.py). Out: a `SpecServer`; one
background thread (`EngineLoop`) runs the engine's rounds for every client (continuous
batching). Its HTTP face (routes, uvicorn, the `serve` command) is serving/server_app.py, which
builds on this module; this module knows nothing of HTTP beyond the `ApiError` it raises.

Hooks for the rest of the system (a control plane, the trainer daemon, the drift monitor):
  - `server.engine`                      the live `Engine` (publisher, policy, head_version)
  - `server.swap(head, version)`         install a validated head between rounds (any thread);
                                         `rollback=True` counts it as a rollback
  - `server.info()`                      the `/server_info` dict
  - `server.round_observers`             callables `(RoundStats, outputs, tags)` run per round
                                         on the engine thread (failures logged, never raised)
  - `server.drift.sinks`                 where drift alerts go; append e.g.
                                         `CallbackAlertSink(daemon.on_drift)` (serving/server_drift.py)
  - `server.bank`                        the head bank (serving/head_bank.py; with the control
                                         endpoint): a returning tag's best head swapped back in

Faults it survives: a round that fails fails only its culprit request (serving/server_loop.py);
a live head whose drafts turn non-finite (found when a round fails, and every `head_check_s` on
the newest committed rows of live traffic) is rolled back to the previous head, or to plain
decoding, and alerted (`head_fault`). Traffic tags are bounded: the first `max_tags` distinct
tags keep their name, later ones are served as `other` (metrics, drift streams, capture).

    server = build_server(cfg); server.start(); ...; server.close()
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from collector.endpoint import prepare_run_dir
from collector.process_publisher import open_publisher
from collector.publisher import PublisherConfig
from online_spec.capture import MAX_ID_CHARS
from online_spec.config import check, config_to_dict, doc
from online_spec.controller import EmaTierPolicy, adaptive_config_path, load_adaptive_config
from online_spec.drift import MIX_TAG, MIX_TAG_RESERVED, DriftAlert, DriftConfig
from online_spec.head import EagleHead
from online_spec.heads import describe_head, load_draft
from online_spec.sampling import SamplingParams
from online_spec.target import load_target
from serving.api import ApiError
from serving.calibrate import engine_cost_policy
from serving.policy_planner import plan_ahead
from serving.control import ControlConfig, ControlServer
from serving.engine import Engine, EngineConfig
from serving.head_bank import BankConfig, HeadBank
from serving.head_probe import HeadProbe
from serving.requests import EngineFull, PromptTooLong, Request, RequestOutput, RoundStats
from serving.metrics import ServerMetrics, TagLabels
from serving.server_drift import ServerDrift
from serving.server_loop import EngineLoop, RequestStream
from serving.swap import check_version

HEAD_CHECK_ROWS = 8  # newest committed rows of a running request the live head is checked on

log = logging.getLogger(__name__)

RoundObserver = Callable[[RoundStats, list[RequestOutput], list[str]], None]


@dataclass
class ServerConfig:
    host: str = doc("address to listen on (loopback by default)", "127.0.0.1")
    port: int = doc("TCP port", 30000)
    draft: str = doc("draft head: shipped (online_spec/pretrained/sharegpt-chat-h100), code "
                     "(online_spec/pretrained/code-h100), day0 (a random head) or a head directory", "shipped")
    target: str = doc("Hugging Face model directory of the target; empty = SmolLM2-135M-Instruct", "")
    dtype: str = doc("target and head dtype: auto (bf16 on a GPU or a CPU with native bf16, else "
                     "float32), bfloat16 or float32", "auto")
    model_name: str = doc("model name reported by the API; empty = the target's directory name", "")
    default_max_tokens: int = doc("max_tokens of a chat request that gives none", 256)
    adaptive: str = doc("adaptive K: an SGLang adaptive-steps JSON file or a preset name in configs/adaptive "
                        "(e.g. sglang_default); empty = fixed K = --num-steps", "")
    policy: str = doc("K policy: auto (ema with --adaptive, else static), static (K = --num-steps), ema (SGLang's "
                      "EMA tiers over --adaptive), cost (the cost-model policy over --adaptive's tiers, or every K "
                      "up to --max-steps; its round-time model is calibrated on this engine at start and stored "
                      "as RUN_DIR/cost_model.json, reused while target, dtype, device, CPU and threads match)",
                      "auto")
    plan_ahead: bool = doc("the cost policy learns from each round on a worker thread and decides one round "
                           "behind, the engine thread only reading its plan (serving/policy_planner.py). Off by "
                           "default: it cuts the policy's time on the engine thread 2-3x on a CPU without a "
                           "measured gain in tokens/s, and on an H100 the worker's Python, under the same "
                           "interpreter lock, slowed batch-1 rounds (docs/controller.md)", False)
    threads: int = doc("torch CPU threads (0 = torch's default)", 0)
    switch_interval_ms: float = doc("the interpreter's thread switch interval while the server runs "
                                    "(sys.setswitchinterval; the previous one is restored at close); 0 = "
                                    "Python's (5 ms). The engine thread retakes the interpreter lock after "
                                    "every torch call, and while the HTTP side's Python holds it the engine "
                                    "waits up to this long each time (docs/engine.md)", 0.0)
    metrics_window: int = doc("verify rounds in the recent acceptance window of /server_info", 256)
    max_tags: int = doc("distinct traffic tags served under their own name (in /metrics, drift streams and capture "
                        "records); later new tags are served as 'other'", 32)
    max_body_bytes: int = doc("largest HTTP request body accepted; larger ones get 413", 2 << 20)
    head_check_s: float = doc("seconds between checks of the live head on live traffic (a draft step on the newest "
                              "committed rows must give finite logits, else the head is rolled back); 0 = off", 5.0)
    log_level: str = doc("uvicorn and server log level", "info")
    capture: bool = doc("stream capture records to the trainer (collector publisher, --capture-* flags)", False)
    drift_monitor: bool = doc("feed the drift detector per round and raise alerts (log, Prometheus, W&B)", True)
    wandb_mode: str = doc("W&B run for drift alerts: off, offline or online", "off")
    wandb_project: str = doc("W&B project of that run", "online-spec")
    wandb_dir: str = doc("directory of the W&B run files", "runs/serve")
    engine: EngineConfig = field(default_factory=EngineConfig,
                                 metadata={"help": "engine settings (flags of EngineConfig)", "cli": False})
    publisher: PublisherConfig = field(default_factory=PublisherConfig,
                                       metadata={"help": "capture publisher settings (--capture-* flags)", "cli": False})
    drift: DriftConfig = field(default_factory=DriftConfig,
                               metadata={"help": "drift detector settings (--drift-* flags)", "cli": False})
    control: ControlConfig = field(default_factory=ControlConfig,
                                   metadata={"help": "control endpoint (--run-dir, --control-endpoint, "
                                             "--allowed-roots)", "cli": False})
    bank: BankConfig = field(default_factory=BankConfig,
                             metadata={"help": "head bank settings (--bank-* flags)", "cli": False})

    def __post_init__(self):
        check(0 <= self.port <= 65535, "port", "must be in 0..65535")
        check(self.dtype in ("auto", "bfloat16", "float32"), "dtype",
              f"must be auto, bfloat16 or float32, got {self.dtype!r}")
        check(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")
        check(self.threads >= 0, "threads", "must be >= 0")
        check(0 <= self.switch_interval_ms <= 100, "switch_interval_ms", "must be in [0, 100] ms")
        check(self.policy in ("auto", "static", "ema", "cost"), "policy",
              f"must be auto, static, ema or cost, got {self.policy!r}")
        check(self.policy != "ema" or bool(self.adaptive), "policy", "ema needs --adaptive (a JSON file or preset)")
        check(self.metrics_window >= 1, "metrics_window", "must be >= 1")
        check(self.max_tags >= 0, "max_tags", "must be >= 0")
        check(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
        check(self.head_check_s >= 0, "head_check_s", "must be >= 0")
        check(self.wandb_mode in ("off", "offline", "online"), "wandb_mode",
              f"must be off, offline or online, got {self.wandb_mode!r}")


class SpecServer:
    """Engine + engine thread + metrics + the FastAPI app, with the hooks a control plane calls."""

    def __init__(self, cfg: ServerConfig, target, head: EagleHead | None, head_version: int = 0,
                 policy=None, publisher=None, wandb_run=None):
        self.cfg = cfg
        self.engine = Engine(target, head, cfg.engine, policy=policy, publisher=publisher, head_version=head_version)
        self.tokenizer = target.tokenizer
        if self.tokenizer is None:
            raise ValueError("the target has no tokenizer: the HTTP server needs one")
        self.model_name = cfg.model_name or target.name or "online-spec"
        self.tags = TagLabels(cfg.max_tags)
        self.metrics = ServerMetrics(cfg.engine.max_steps, cfg.metrics_window,
                                     publisher_stats=publisher.stats if hasattr(publisher, "stats") else None)
        self.metrics.head_version.set(head_version)
        self.head_probe = HeadProbe(target)
        self._recovery: threading.Thread | None = None  # a rollback of a broken head, under way
        self._switch_before: float | None = None  # the interpreter's switch interval before start()
        self.graph_warmup: dict | None = None  # start()'s capture of the CUDA graphs (Engine.warm_graphs)
        self._last_head_check = time.monotonic()
        self.head_faults: list[dict] = []
        self.trainer_alerts: list[dict] = []  # what the trainer said of itself (control `trainer_alert`)
        self.round_observers: list[RoundObserver] = []
        self.loop = EngineLoop(self.engine, on_step=self._on_step, on_failure=self._on_round_failure)
        self.engine.on_round.append(self._on_round)
        self.drift: ServerDrift | None = None
        if cfg.drift_monitor:
            self.drift = ServerDrift(cfg.drift, registry=self.metrics.registry, wandb_run=wandb_run,
                                     plain_round_s=self._plain_round_s)
            self.round_observers.append(self.drift.observe)
        self.started_at = time.time()
        self.control = ControlServer(self, cfg.control) if cfg.control.enabled else None
        self.bank: HeadBank | None = None
        if cfg.bank.enabled and self.control is not None:  # it swaps through the control's swapper
            self.bank = HeadBank(cfg.bank, self.control.swapper)
            self.control.swapper.holds = self.bank.holds
            self.round_observers.append(self.bank.observe)

    def _plain_round_s(self, batch_size: int, ctx_len: int) -> float | None:
        """A plain decode round's seconds at this batch and context, from the cost-model policy's
        round-time model (calibrated on this engine, refined from its rounds); None under a
        policy without one, where the drift monitor's "losing" rule has nothing to compare."""
        return self.engine.policy.predict_round_s(batch_size, 0, ctx_len)  # per round: set_policy may change it

    # -- the hooks ------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, tag: str, request_id: str) -> RequestStream:
        """Queue one request (event loop thread); refusals become ApiError with a status."""
        if tag == MIX_TAG:  # here, not in the HTTP layer: one check for HTTP and Python callers alike
            raise ApiError(400, MIX_TAG_RESERVED, param="tag")
        for name, value in (("tag", tag), ("rid", request_id)):
            if len(value) > MAX_ID_CHARS:
                raise ApiError(400, f"{name}: at most {MAX_ID_CHARS} characters, got {len(value)}", param=name)
        label = self.tags.label(tag)
        try:
            stream = self.loop.submit(Request(prompt_ids, params, request_id, label))
        except EngineFull as e:
            self.metrics.on_rejected("queue_full")
            raise ApiError(503, f"server busy: {e}; retry later", "server_busy") from None
        except PromptTooLong as e:
            raise ApiError(400, str(e), param="prompt") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "server_unavailable") from None
        if self.bank is not None:
            self.bank.admitted(label)
        return stream

    def swap(self, head: EagleHead | None, version: int, rollback: bool = False) -> None:
        """Install `head` (already validated) before the next round; None = plain decode."""
        check_version(version)
        self.engine.swap_head(head, version)
        if rollback:
            self.metrics.on_rollback()
        self.loop.wake()

    def info(self) -> dict:
        e = self.engine
        summary = self.metrics.summary()
        policy_info = None
        try:
            policy_info = e.policy.info()
        except Exception:  # a read racing the engine thread: report nothing rather than fail
            log.exception("policy.info() failed")
        publisher = None
        if e.publisher is not None and hasattr(e.publisher, "stats"):
            publisher = e.publisher.stats()
        per_slot = None
        if isinstance(policy_info, dict) and isinstance(policy_info.get("slots"), dict):
            per_slot = {k: v.get("steps") for k, v in policy_info["slots"].items()}
        summary["speculative_num_steps_per_slot"] = per_slot
        return {
            "model_path": self.model_name, "served_model_name": self.model_name,
            "speculative_algorithm": "EAGLE3" if e.head is not None else None,
            "speculative_num_steps": e.cfg.num_steps, "speculative_max_steps": e.cfg.max_steps,
            "speculative_eagle_topk": e.cfg.speculative_eagle_topk,
            "speculative_num_draft_tokens": e.cfg.speculative_num_draft_tokens or e.cfg.num_steps + 1,
            "head_version": e.head_version,
            "internal_states": [{**summary, "head_version": e.head_version, "policy": policy_info}],
            "running_requests": len(e.running), "waiting_requests": len(e.waiting),
            "engine": config_to_dict(e.cfg), "uptime_s": time.time() - self.started_at,
            "rounds_failed": self.loop.rounds_failed, "requests_failed": self.loop.requests_failed,
            "head_faults": self.head_faults[-10:], "tags": self.tags.info(), "capture_publisher": publisher,
            "drift": None if self.drift is None else self.drift.info(),
            "trainer_alerts": self.trainer_alerts[-10:],
            "head_bank": None if self.bank is None else self.bank.info(),
            "cpu_reserve": None if e.cpus is None else e.cpus.stats(),
            "cuda_graphs": None if e.graphs is None else {"captured": e.graphs.captures,
                                                          "capture_failures": e.graphs.capture_failures,
                                                          "warmup": self.graph_warmup},
        }

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.switch_interval_ms > 0 and self._switch_before is None:
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(self.cfg.switch_interval_ms / 1e3)
        if self.cfg.engine.graph_warmup and self.graph_warmup is None:
            self.graph_warmup = self.engine.warm_graphs()
            if self.graph_warmup:
                log.info("CUDA graphs: %d captured in %.1f s before serving", self.graph_warmup["graphs"],
                         self.graph_warmup["seconds"])
        self.loop.start()
        if self.control is not None:
            self.control.start()
        if self.bank is not None:
            self.bank.start()

    def close(self) -> None:
        """Stop the engine thread, then close what the server was given: publisher, W&B run."""
        if self.bank is not None:
            self.bank.close()
        if self.control is not None:
            self.control.close()
        self.loop.close()
        if self.engine.cpus is not None:  # the engine thread's core back to every thread
            self.engine.cpus.close()
        if self.engine.publisher is not None and hasattr(self.engine.publisher, "close"):
            self.engine.publisher.close()
        if self.drift is not None:
            self.drift.close()
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None

    def _on_step(self, outs: list[RequestOutput], elapsed_s: float) -> None:
        self.metrics.on_step(outs, elapsed_s)
        self.metrics.running.set(sum(r.finish_reason is None for r in self.engine.running))
        self.metrics.waiting.set(len(self.engine.waiting))
        if self.cfg.head_check_s and time.monotonic() - self._last_head_check >= self.cfg.head_check_s:
            self._last_head_check = time.monotonic()
            self._check_live_head(live_rows=True)

    # -- a live head that drafts non-finite values ----------------------------------------------
    def _on_round_failure(self, exc: Exception) -> bool:
        """Engine thread, a round failed with no culprit request: a fault of the live head?
        True while a rollback of a broken head is under way (the loop retries the round)."""
        if self._recovery is not None and self._recovery.is_alive():
            return True
        return self._check_live_head(live_rows=False)

    def _check_live_head(self, live_rows: bool) -> bool:
        """Engine thread, between rounds: run the live head on the newest committed rows of a
        running request (or the fixed probe); if its drafts are not finite, roll it back in the
        background and alert. Returns whether it found the head broken."""
        head = self.engine.head
        if head is None:
            return False
        try:
            problem = self.head_probe.check(head, self._live_rows() if live_rows else None)
        except Exception as e:  # noqa: BLE001 - a probe that cannot run says nothing about the head
            log.warning("live head check could not run: %s", e)
            return False
        if problem is None:
            return False
        self._head_fault(problem)
        return True

    def _live_rows(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(token ids, features, first position) of the newest committed rows of slot 0."""
        e = self.engine
        if not e.running:
            return None
        n = e.tcache.lengths[0]
        start = max(0, n - HEAD_CHECK_ROWS)
        if n - start < 1:
            return None
        return e.tok_buf[0, start:n + 1].clone(), e.feat_buf[0, start:n].clone(), start

    def on_trainer_alert(self, alert: DriftAlert) -> None:
        """An alert the trainer raised about itself (starved, capture dropped: online_spec/starvation.py),
        over the control endpoint: kept for /server_info and given to the alert sinks (log,
        Prometheus, W&B) like the server's own."""
        self.trainer_alerts.append(alert.to_dict())
        del self.trainer_alerts[:-100]
        if self.drift is not None:
            self.drift.emit(alert)
        else:
            log.warning("%s: %s", alert.title, alert.text)

    def _head_fault(self, problem: str) -> None:
        if self._recovery is not None and self._recovery.is_alive():
            return
        version = self.engine.head_version
        fault = {"version": version, "reason": problem, "time": time.time()}
        self.head_faults.append(fault)
        del self.head_faults[:-100]
        self.metrics.on_head_fault()
        text = (f"Head v{version} drafts non-finite values ({problem}); rolled back to the previous head "
                "(plain decoding if there is none). Output stays the target's; acceptance was lost meanwhile.")
        alert = DriftAlert(kind="head_fault", level="error", slot=0, tag="", before=math.nan, after=math.nan,
                           head_version=version, round=self.metrics.rounds_run(), time=fault["time"],
                           title=f"online-spec: head v{version} drafts non-finite values", text=text)
        if self.drift is not None:
            self.drift.emit(alert)
        else:
            log.error(text)
        recover = (partial(self.control.swapper.rollback_broken, problem) if self.control is not None
                   else partial(self.swap, None, version, rollback=True))
        self._recovery = threading.Thread(target=_logged(recover), name="head-rollback", daemon=True)
        self._recovery.start()

    def _on_round(self, stats: RoundStats, outs: list[RequestOutput]) -> None:
        tags = [self.loop.tag_of(o.request_id) for o in outs]
        try:
            self.metrics.on_round(stats, outs, tags)
        except Exception:
            log.exception("metrics round hook failed (ignored)")
        for obs in self.round_observers:
            try:
                obs(stats, outs, tags)
            except Exception:
                log.exception("round observer %r failed (ignored)", obs)


def _logged(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a background thread logs and ends
            log.exception("automatic rollback failed")
    return run


def build_policy(cfg: ServerConfig, target=None, head=None):
    """The step policy the config names: SGLang's EMA tier policy over an adaptive JSON, the
    cost-model policy (calibrated on `target` and `head`, stored in the run directory), or None
    (the engine's fixed K)."""
    policy = cfg.policy if cfg.policy != "auto" else ("ema" if cfg.adaptive else "static")
    if policy == "static":
        return None
    adaptive = None
    if cfg.adaptive:
        path = Path(cfg.adaptive) if Path(cfg.adaptive).exists() else adaptive_config_path(cfg.adaptive)
        adaptive = load_adaptive_config(path)
    if policy == "ema":
        return EmaTierPolicy(adaptive, initial_steps=cfg.engine.num_steps or None)
    check(target is not None and head is not None, "policy", "cost needs the target and head to calibrate on")
    cost_policy, report = engine_cost_policy(target, head, cfg.engine.max_batch, cfg.engine.max_steps,
                                             store=Path(cfg.control.run_dir) / "cost_model.json", adaptive=adaptive,
                                             max_len=cfg.engine.max_len)
    log.info("cost-model policy: tiers %s, round-time model from %s%s", cost_policy.candidate_steps, report["source"],
             ", learning on a worker thread" if cfg.plan_ahead else "")
    return plan_ahead(cost_policy) if cfg.plan_ahead else cost_policy


def build_server(cfg: ServerConfig) -> SpecServer:
    """Load the target and head the config names and build the server (not started)."""
    prepare_run_dir(cfg.control.run_dir)  # 0700 before anything (token, sockets, cost model) goes in
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target or None, dtype=cfg.dtype)
    dtype = target.dtype
    head, meta, draft = load_draft(cfg.draft, target, dtype=dtype)
    version = check_version(meta.get("version", 0))
    log.info("draft head: %s", describe_head(draft, meta))
    run = None
    if cfg.drift_monitor and cfg.wandb_mode != "off":
        from online_spec.wandb_run import init_wandb
        run = init_wandb(cfg.wandb_project, None, cfg.wandb_dir, mode=cfg.wandb_mode, config=config_to_dict(cfg))
    publisher = None
    if cfg.capture:  # default socket: in the server's own (0700) run directory
        pcfg = cfg.publisher if cfg.publisher.endpoint or cfg.publisher.run_dir else \
            replace(cfg.publisher, run_dir=cfg.control.run_dir)
        publisher = open_publisher(pcfg, cfg.engine.capture_sender)
    return SpecServer(cfg, target, head, head_version=version, policy=build_policy(cfg, target, head),
                      publisher=publisher, wandb_run=run)
