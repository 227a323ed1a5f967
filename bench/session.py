"""One serving session: the embedded server, optionally the trainer beside it, a trace replayed.

In: a loaded target, a `SessionConfig` (head, K policy, trainer on/off, concurrency, limits)
and the trace items. Out: a `SessionResult` — every request (`traffic.RequestResult`), every
verify round (time, batch size, K, accepted drafts per request, committed tokens, head
version), the drift alerts, the head versions that went live and the trainer's summary.

Process layout (2-core CPU): the server (engine thread + uvicorn + the replaying clients, all
on loopback) stays in this process with `server_threads` torch threads; the trainer daemon runs
in a child process (`python -m bench.demo_trainer`) with `trainer_threads` torch threads
and OMP_NUM_THREADS to match, so neither starves the other. They talk over ZMQ ipc sockets in
a private temporary directory: the capture stream (server -> trainer) and the server's own control
endpoint (trainer -> server swaps, `serving.control`; the head bank swaps through the same
swapper). Sessions without a trainer run no control endpoint. Drift alerts reach the daemon by its polling
`/server_info` (`drift.recent_alerts`) and calling `daemon.on_drift`.

Everything started here is stopped in `finally`: the trainer gets SIGTERM (it saves and
exits), then SIGKILL after a grace period; control, HTTP and engine threads are closed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.trace import TraceItem
from bench.trainer_watch import TrainerWatch
from bench.traffic import RequestResult, replay, replay_in_child
from collector.process_publisher import open_publisher
from collector.publisher import PublisherConfig
from online_spec.advice import warn
from online_spec.alerts import CallbackAlertSink
from online_spec.config import check, doc
from online_spec.controller import EmaTierPolicy, adaptive_config_path, load_adaptive_config
from online_spec.cpu_reserve import descendants

log = logging.getLogger(__name__)

POLICIES = ("static", "sglang_default", "cost")


@dataclass
class SessionConfig:
    name: str = doc("label of the session in reports", "session")
    run_dir: str = doc("where the session writes (trainer run directory, logs)", "runs/demo/session")
    head: str = doc("head checkpoint directory (SGLang layout); empty = random day-0 head; 'none' = plain", "")
    policy: str = doc("K policy: static (K = num_steps), sglang_default (SGLang's EMA tiers), "
                      "cost (the project's cost-model controller, every K from 0 to the engine's max_steps)",
                      "static")
    num_steps: int = doc("K of the static policy (0 = plain decoding); with eagle_topk > 1 the tree's depth", 3)
    plan_ahead: bool = doc("the cost policy learns on a worker thread, one round behind (serve --plan-ahead)", False)
    eagle_topk: int = doc("draft tree branching (SGLang's --speculative-eagle-topk; 1 = chains)", 1)
    num_draft_tokens: int = doc("tokens a tree round verifies, root included (0 = num_steps + 1)", 0)
    tree_candidates: list = doc("trees [num_steps, topk, num_draft_tokens] the cost policy may run instead of "
                                "a chain (empty: chains only)", list)
    online: bool = doc("run the trainer daemon beside the server (capture on, gated swaps)", False)
    bank: bool = doc("with the trainer: the server's head bank (a returning tag's best head swapped back in; "
                     "serving/head_bank.py)", True)
    concurrency: int = doc("streaming clients in flight", 4)
    max_tokens: int = doc("max_tokens of trace lines that give none", 64)
    max_batch: int = doc("engine max_batch", 16)
    deadline_s: float = doc("stop starting requests after this long", 600.0)
    server_threads: int = doc("torch threads of the server process", 1)
    switch_interval_ms: float = doc("the server's interpreter switch interval (serve --switch-interval-ms); "
                                    "0 = Python's", 0.0)
    capture_sender: str = doc("where the online server's engine sends its capture (serve --capture-sender): "
                              "thread, engine or process", "thread")
    reserve_cpu: str = doc("the server's engine thread on a CPU core of its own, every other thread and child "
                           "process (trainer, clients) off it (serve --reserve-cpu): off, auto or a CPU", "off")
    clients_process: bool = doc("the streaming clients run in a process of their own (bench.traffic."
                                "replay_in_child), as a deployment's do; off: in the server's process, whose "
                                "interpreter lock their Python then shares with the engine thread", True)
    trainer_threads: int = doc("torch threads of the trainer process", 1)
    trainer_args: list = doc("extra `online-spec train` flags for the daemon", list)
    device: str = doc("torch device of the trainer child (the server runs where the target given to run_session "
                      "lives; on CUDA its engine replays CUDA graphs)", "cpu")
    trainer_device: str = doc("the trainer's own device when it is not the server's (e.g. cuda:1: serving and "
                              "training on separate GPUs, swaps through the control endpoint); empty = `device`", "")
    progress_every_s: float = doc("console progress line period; 0 = quiet", 5.0)
    phase_budget_s: float = doc("skip a phase's remaining lines once it has run this long; 0 = serve all", 0.0)
    wait_trainer_s: float = doc("wait this long for the trainer to subscribe before sending traffic; 0 = don't", 300.0)
    cost_model_store: str = doc("the cost policy's round-time calibration (serving/calibrate.py), reused while "
                                "target, dtype, device, CPU and threads match; empty = RUN_DIR/cost_model.json", "")

    def __post_init__(self):
        check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.deadline_s > 0, "deadline_s", "must be > 0")
        check(self.server_threads >= 1 and self.trainer_threads >= 1, "server_threads", "threads must be >= 1")


@dataclass
class SessionResult:
    name: str
    t0: float  # the session's start: loading, calibration, the trainer's start-up, then serving
    t1: float = 0.0
    t_serve: float = 0.0  # when traffic began (0: it never did)
    requests: list[RequestResult] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    alerts: list[dict] = field(default_factory=list)
    swaps: list[dict] = field(default_factory=list)
    trainer: dict = field(default_factory=dict)
    done: int = 0
    phase: str = ""  # the phase of the request that finished last: the phase being served
    server_info: dict = field(default_factory=dict)
    policy_log: list[dict] = field(default_factory=list)  # the K policy's info() with each progress line
    trace_lines: int = 0  # lines of the trace given to the session (served or skipped)

    @property
    def serve_t0(self) -> float:
        """Time zero of the report: when traffic began (the session's start if it never did)."""
        return self.t_serve or self.t0


class RoundLog:
    """Round observer: one compact dict per engine round (engine thread), request ids kept so
    rounds can be attributed to phases afterwards."""

    def __init__(self, result: SessionResult, bank=None):
        self.result = result
        self.bank = bank  # the server's head bank (serving/head_bank.py), whose swaps go down in version too
        self.last_version = None

    def __call__(self, stats, outs, tags) -> None:
        now = time.time()
        self.result.rounds.append({
            "t": now, "batch_size": stats.batch_size, "num_steps": stats.num_steps, "topk": stats.topk,
            "num_draft_tokens": stats.num_draft_tokens, "ctx_len": stats.ctx_len,
            "accepted": list(stats.accepted), "committed": stats.committed, "total_s": stats.total_s,
            "draft_s": stats.draft_s, "verify_s": stats.verify_s, "catchup_s": stats.catchup_s,
            "admit_s": stats.admit_s, "admitted": stats.admitted, "policy_s": stats.policy_s,
            "captures": stats.draft_captures + stats.verify_captures,
            "head_version": stats.head_version, "request_ids": [o.request_id for o in outs], "tags": list(tags)})
        if self.last_version is not None and stats.head_version != self.last_version:
            # the daemon numbers versions upwards, so going down is a rollback, unless the bank
            # brought back an older head (it records its swap before the swap lands)
            bank = self.bank is not None and any(s["from"] == self.last_version and s["to"] == stats.head_version
                                                 for s in self.bank.swaps[-2:])
            self.result.swaps.append({"t": now, "from": self.last_version, "to": stats.head_version, "bank": bank,
                                      "rollback": not bank and stats.head_version < self.last_version})
        self.last_version = stats.head_version


def build_policy(cfg: SessionConfig, target, head, engine_cfg, run_dir: Path):
    """The session's K policy: SGLang's EMA tiers, or the cost-model policy as `serve --policy
    cost` builds it (every K from 0 to max_steps; round-time model calibrated on this engine,
    stored as `cost_model_store` or RUN_DIR/cost_model.json and reused while the machine matches)."""
    from serving.calibrate import engine_cost_policy  # transformers: see run_session
    from serving.policy_planner import plan_ahead

    if cfg.policy == "static":
        return None
    if cfg.policy == "sglang_default":
        adaptive = load_adaptive_config(adaptive_config_path("sglang_default"))
        tiers = {k for slot in adaptive.slots for k in slot.candidate_steps}
        return EmaTierPolicy(adaptive, initial_steps=cfg.num_steps if cfg.num_steps in tiers else None)
    policy = engine_cost_policy(target, head, engine_cfg.max_batch, engine_cfg.max_steps,
                                store=cfg.cost_model_store or run_dir / "cost_model.json", max_len=engine_cfg.max_len,
                                trees=cfg.tree_candidates)[0]
    return plan_ahead(policy) if cfg.plan_ahead else policy  # a policy choosing trees stays on the engine thread


def run_session(target, cfg: SessionConfig, items: list[TraceItem]) -> SessionResult:
    """Serve `items` with the configured head/policy (and trainer); always cleans up."""
    session = Session(target, cfg, len(items))
    try:
        session.start()
        session.serve(items)
    finally:
        session.close()
    return session.result


class Session:
    """One configuration's server (and trainer) kept up across several `serve` calls.

    `run_session` is start, serve, close. `bench e2e --interleave` keeps every configuration's
    session up at once and serves the trace in chunks, one configuration at a time: `pause`
    stops the trainer child (SIGSTOP, its children too) and marks the end of an active period,
    `resume` continues it and sets the session's torch threads again (a process-wide setting).
    `active` lists the (start, end) wall times the session served in, for bench/interleave.py's
    clock that leaves out the other configurations' turns."""

    def __init__(self, target, cfg: SessionConfig, trace_lines: int):
        self.target, self.cfg = target, cfg
        self.result = SessionResult(cfg.name, time.time(), trace_lines=trace_lines)
        self.server = self.http = self.trainer = self.watch = self.progress = None
        self.stop_progress = threading.Event()
        self.caller_threads = torch.get_num_threads()  # given back at close: the caller's own work keeps its threads
        self.run_dir = Path(cfg.run_dir).resolve()
        self.sock_dir: Path | None = None
        self.active: list[list[float]] = []  # [start, end] of each period served (end 0.0: still serving)

    def start(self) -> "Session":
        """Load the head, build and start the server (and the trainer, waiting for it to subscribe)."""
        # transformers comes with these: the benches that import this module keep their --help fast
        from online_spec.checkpoint import load_head
        from online_spec.head import new_head
        from serving.engine import EngineConfig
        from serving.control import ControlConfig
        from serving.head_bank import BankConfig
        from serving.server import ServerConfig, SpecServer
        from serving.server_app import HttpThread
        from trainer.distill import init_from_target

        cfg, target, result = self.cfg, self.target, self.result
        torch.set_num_threads(cfg.server_threads)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # short path: ipc socket names are limited to ~100 chars
        sock_dir = self.sock_dir = Path(tempfile.mkdtemp(prefix="osd-"))
        version, plain = 0, cfg.head == "none" or cfg.num_steps == 0 and cfg.policy == "static"
        if cfg.head and cfg.head != "none":
            head, meta = load_head(cfg.head, target.info, dtype=target.dtype)
            version = int(meta.get("version", 0))
        elif not plain:
            # the day-0 head the trainer starts from too (trainer.daemon._initial_head), so both
            # sides agree on v0: random weights, lm_head and norm from the target
            head = init_from_target(new_head(target).float(), target).to(target.dtype).eval()
        else:
            head = None
        engine_cfg = EngineConfig(max_batch=cfg.max_batch, num_steps=0 if plain else max(cfg.num_steps, 1),
                                  max_steps=max(7, cfg.num_steps), speculative_eagle_topk=1 if plain else cfg.eagle_topk,
                                  speculative_num_draft_tokens=0 if plain else cfg.num_draft_tokens,
                                  capture_sender=cfg.capture_sender, reserve_cpu=cfg.reserve_cpu)
        publisher = None
        if cfg.online:
            publisher = open_publisher(PublisherConfig(endpoint=f"ipc://{sock_dir}/capture.sock"), cfg.capture_sender)
        # the server's own control endpoint, in the private socket directory: the trainer swaps
        # through it, and the head bank through its swapper (one swapper knows the live head)
        control_cfg = ControlConfig(run_dir=str(sock_dir), allowed_roots=str(self.run_dir),
                                    control_endpoint="" if cfg.online else "off")
        scfg = ServerConfig(engine=engine_cfg, capture=cfg.online, log_level="warning", control=control_cfg,
                            bank=BankConfig(enabled=cfg.bank), switch_interval_ms=cfg.switch_interval_ms)
        server = self.server = SpecServer(scfg, target, None if plain else head, head_version=version,
                                          policy=None if plain else build_policy(cfg, target, head, engine_cfg,
                                                                                 self.run_dir),
                                          publisher=publisher)
        server.round_observers.append(RoundLog(result, server.bank))
        if server.drift is not None:
            server.drift.sinks.append(CallbackAlertSink(
                lambda a: result.alerts.append({"t": time.time(), **_alert_dict(a)})))
        server.start()
        self.http = HttpThread(server).start()
        if cfg.online:
            self.trainer = _start_trainer(cfg, self.run_dir, sock_dir, self.http.url)
            if cfg.progress_every_s > 0:
                print(f"trainer: starting (log: {self.run_dir / 'trainer.log'})", flush=True)
            self.watch = TrainerWatch(self.run_dir / "trainer.log", echo=cfg.progress_every_s > 0).start()
            _wait_ready(self.trainer, self.run_dir / "trainer", cfg.wait_trainer_s)
        result.t_serve = time.time()
        self.active.append([result.t_serve, 0.0])
        self.progress = threading.Thread(target=_progress, daemon=True, name="progress",
                                         args=(server, result, result.trace_lines, cfg, self.stop_progress, self.watch))
        self.progress.start()
        return self

    def serve(self, items: list[TraceItem]) -> list[RequestResult]:
        """Replay `items` through the streaming clients; their results (indexed by trace line) join
        the session's."""
        cfg, result = self.cfg, self.result

        def on_done(res: RequestResult) -> None:
            result.done += 1
            result.phase = res.phase

        clients = replay_in_child if cfg.clients_process else (lambda *a, **kw: asyncio.run(replay(*a, **kw)))
        done = clients(self.http.url, items, cfg.concurrency, cfg.max_tokens, cfg.deadline_s, on_done=on_done,
                       phase_budget_s=cfg.phase_budget_s or None)
        result.requests.extend(done)
        result.server_info = self.server.info()
        return done

    def pause(self) -> None:
        """Between chunks: the trainer (and its children) stopped, the active period closed. The
        server's threads are idle without requests (the engine thread sleeps on its event)."""
        if self.active and not self.active[-1][1]:
            self.active[-1][1] = time.time()
        _signal_tree(self.trainer, signal.SIGSTOP)

    def resume(self) -> None:
        """The trainer continued, this session's torch threads set, a new active period opened."""
        _signal_tree(self.trainer, signal.SIGCONT)
        torch.set_num_threads(self.cfg.server_threads)
        if not self.active or self.active[-1][1]:
            self.active.append([time.time(), 0.0])

    def close(self) -> None:
        """Stop everything started here (the trainer gets SIGTERM, then SIGKILL after a grace period)."""
        result = self.result
        _signal_tree(self.trainer, signal.SIGCONT)  # a stopped trainer would never see its SIGTERM
        self.stop_progress.set()
        result.t1 = time.time()
        if self.active and not self.active[-1][1]:
            self.active[-1][1] = result.t1
        torch.set_num_threads(self.caller_threads)
        if self.trainer is not None:
            result.trainer = _stop_trainer(self.trainer, self.run_dir)
            self.trainer = None
        if self.watch is not None:
            self.watch.stop()
            result.trainer["watch"] = self.watch.figures(result.serve_t0)
            self.watch = None
        for closer in (self.http, self.server):
            if closer is not None:
                try:
                    closer.close() if hasattr(closer, "close") else closer.stop()
                except Exception:  # noqa: BLE001 - keep cleaning up the rest
                    log.exception("closing %r failed", closer)
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        # the engine's KV caches (GBs at a long max_len) sit in reference cycles (hooks, policy,
        # threads' closures): collected now, so a bench running session after session holds one
        # session's caches, not all of them (an e2e --quick run grew to ~19 GB and was OOM-killed)
        self.http = self.server = None
        gc.collect()


def _signal_tree(proc, sig, settle_s: float = 2.0) -> None:
    """`sig` to a child process and every process below it; a process gone meanwhile is skipped.
    After SIGSTOP, wait (up to `settle_s`) until each has stopped: a signal lands asynchronously,
    and the next configuration's turn must not begin beside a trainer still running."""
    if proc is None or proc.poll() is not None:
        return
    pids = [proc.pid] + descendants(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + settle_s
    while sig == signal.SIGSTOP and time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.001)


def _running(pid: int) -> bool:
    """Whether a process exists and is not stopped (/proc/PID/stat's state: T or t when stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return False


def _alert_dict(alert) -> dict:
    d = alert.to_dict() if hasattr(alert, "to_dict") else dict(alert)
    return {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _start_trainer(cfg: SessionConfig, run_dir: Path, sock_dir: Path, url: str):
    # every session starts from its own head, fresh; the daemon numbers its versions after the
    # server's live one (control `info`, else the head's metadata), so they never collide
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)
    args = [sys.executable, "-m", "bench.demo_trainer", "--run-dir", str(run_dir / "trainer"),
            "--capture-endpoint", f"ipc://{sock_dir}/capture.sock", "--alerts-url", url + "/server_info",
            "--threads", str(cfg.trainer_threads), "--wandb-mode", "disabled",
            "--max-seconds", str(cfg.deadline_s + 120), "--control-run-dir", str(sock_dir)]
    if cfg.trainer_device or cfg.device != "cpu":
        args += ["--device", cfg.trainer_device or cfg.device]  # empty: colocated, on the server's device
    if cfg.trainer_device and cfg.trainer_device != cfg.device:  # a device of its own: nothing of serving's to
        args += ["--serving-budget", "0"]  # spare (trainer_args given after may still set one)
    if cfg.head and cfg.head != "none":
        args += ["--init-head", str(Path(cfg.head).resolve())]
    args += [str(a) for a in cfg.trainer_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.trainer_threads), "MKL_NUM_THREADS": str(cfg.trainer_threads),
           "PYTHONUNBUFFERED": "1"}
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)  # the trainer forms its own process group, never one this process holds
    logf = open(run_dir / "trainer.log", "ab")
    log.info("trainer: %s", " ".join(args))
    proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=repo)
    proc._logf = logf  # closed in _stop_trainer
    return proc


def _wait_ready(proc, trainer_dir: Path, timeout_s: float) -> None:
    """Records published before the trainer subscribes are lost (ZMQ PUB/SUB): wait for it."""
    from bench.demo_trainer import READY_FILE  # the trainer's module: transformers and datasets

    t0 = time.monotonic()
    while timeout_s > 0 and not (trainer_dir / READY_FILE).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited with {proc.returncode}; see {trainer_dir.parent / 'trainer.log'}")
        if time.monotonic() - t0 > timeout_s:
            warn(log, "session_trainer_late", f"trainer not ready after {timeout_s:.0f}s; sending traffic anyway",
                 cost="capture records published before it subscribes are lost (ZMQ PUB/SUB), so its first "
                      "training steps come later",
                 fix=f"see {trainer_dir.parent / 'trainer.log'} for what it is doing; on a loaded machine allow "
                     "more time (SessionConfig.wait_trainer_s)")
            return
        time.sleep(0.5)
    if timeout_s > 0:
        print(f"trainer ready after {time.monotonic() - t0:.0f}s", flush=True)


def _stop_trainer(proc, run_dir: Path, grace_s: float = 60.0) -> dict:
    import json

    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                warn(log, "session_trainer_kill", f"trainer did not stop in {grace_s:.0f}s: killing pid {proc.pid}",
                     cost="its steps since the last state save are lost (the report's trainer figures come "
                          "from that save)", fix=f"see {run_dir / 'trainer.log'} for where it hung")
                proc.kill()
                proc.wait(10)
    finally:
        proc._logf.close()
    state = run_dir / "trainer" / "state.json"
    out = {"returncode": proc.returncode}
    if state.exists():
        s = json.loads(state.read_text())
        out.update({k: s.get(k) for k in ("step", "live_version", "swaps", "refused_swaps", "evals", "published",
                                          "rolled_back", "seeds_adopted", "seed_checks", "seed_seconds",
                                          "rested_s", "futile", "serving_budget", "cpu")})
    return out


def _progress(server, result: SessionResult, total: int, cfg: SessionConfig, stop: threading.Event,
              watch: TrainerWatch | None = None) -> None:
    """One console line every few seconds (`progress_line`), and the K policy's state beside it."""
    if cfg.progress_every_s <= 0:
        return
    last_rounds = 0
    while not stop.wait(cfg.progress_every_s):
        rounds = result.rounds[last_rounds:]
        last_rounds += len(rounds)
        policy = server.engine.policy
        if hasattr(policy, "info"):  # why the policy chose its K (acceptance estimates, time model) over time
            try:
                result.policy_log.append({"t_s": time.time() - result.serve_t0, **policy.info()})
            except (RuntimeError, ValueError, IndexError, KeyError) as e:  # read while the engine thread updates it
                log.debug("policy info skipped: %s", e)
        print(progress_line(cfg.name, result, rounds, cfg.progress_every_s, server.engine.head_version, total,
                            False if watch is None else watch.step), flush=True)


def progress_line(name: str, result: SessionResult, rounds: list[dict], every_s: float, head_version: int,
                  total: int, trainer_step: int | None | bool = False) -> str:
    """What the loop did over the last `every_s` seconds (`rounds`): times from the start of traffic;
    the phase being served (of the request that finished last); accept_len and K per batch size as
    `b2:...`, the plots' labels (K: the last K at that batch
    size); `trainer_step` None = the trainer has not trained yet, False = no trainer."""
    per_batch: dict[int, list] = {}
    for r in rounds:
        if r["num_steps"] > 0:
            per_batch.setdefault(r["batch_size"], []).extend(r["accepted"])
    acc = " ".join(f"b{b}:{sum(v) / len(v):.2f}" for b, v in sorted(per_batch.items())) or "-"
    k_by_batch = {r["batch_size"]: r["num_steps"] for r in rounds}
    ks = " ".join(f"b{b}:{k}" for b, k in sorted(k_by_batch.items())) or "-"
    tps = sum(r["committed"] for r in rounds) / every_s
    trainer = "" if trainer_step is False else f"  trainer step {'-' if trainer_step is None else trainer_step}"
    phase = f" {result.phase}" if result.phase else ""
    return (f"[{name} {time.time() - result.serve_t0:5.0f}s{phase}] rounds {len(result.rounds):5d}  tok/s {tps:5.1f}  "
            f"accept_len {acc}  K {ks}  head v{head_version}  swaps {len(result.swaps)}{trainer}  "
            f"alerts {len(result.alerts)}  done {result.done}/{total}")
