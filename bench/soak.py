"""`online-spec bench soak`: a long mixed run of the real server — well-formed and hostile clients,
operator swaps and rollbacks, the trainer killed and restarted — checked for what must hold.

Starts `online-spec serve` (SmolLM2 fp32, the shipped head, capture on) as a child process on
loopback, and `online-spec train` beside it (the capture stream, publishing through the control
endpoint). For `duration_s`:
- `clients` well-formed streaming clients cycle through ShareGPT held-out first turns; the greedy
  ones (`greedy_fraction`) are compared token for token with plain decoding of the same prompt
  (computed here first, K = 0, fp32: only fp32 greedy is token-identical);
- one hostile client sends, every `hostile_interval_s`, the next input of bench/hostile.py (HTTP,
  control requests, bad checkpoints), each expecting the answer the server must give;
- every `swap_every_s` an operator swaps in the packaged code head, then the shipped chat head
  (each with its own draft vocabulary), then rolls back;
- every `trainer_restart_every_s` the trainer gets kill -9 and is started again;
- every `sample_every_s` the server's RSS and the size of /metrics are sampled.
Reported (JSON): failed well-formed requests (must be 0), greedy mismatches (lossless: 0),
hostile answers that were not the expected ones, swaps/rollbacks/refusals, trainer starts, the
RSS after `warmup_s` and its largest growth after (`rss_flat`: within 10 %), /metrics size (first,
largest, last), the server's own failure counters, and whether SIGTERM left its run directory clean.

    online-spec bench soak --duration-s 600 --json bench/results/bench_soak.json
    online-spec bench soak --duration-s 3600                                   # the hour-long run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.common import add_bench_args, quick_overrides, write_report
from bench.hostile import CONTROL_CASES, HTTP_CASES, write_bad_heads
from bench.traffic import sse_event
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.heads import CODE_HEAD as CODE, SHIPPED_HEAD as SHIPPED
from serving.control_client import ControlClient, ControlError

RUN_FILES = ("control.token", "control.endpoint", "control.sock", "capture.sock")


@dataclass
class SoakConfig:
    duration_s: float = doc("how long the mixed load runs (an hour-long soak: 3600)", 600.0)
    warmup_s: float = doc("the server's RSS at this point is the reference its growth is measured from", 60.0)
    clients: int = doc("well-formed streaming clients", 4)
    greedy_fraction: float = doc("share of well-formed requests that are greedy and checked against plain decoding",
                                 0.75)
    max_tokens: int = doc("tokens generated per well-formed request", 32)
    prompts: int = doc("ShareGPT held-out first turns the clients cycle through", 16)
    hostile_interval_s: float = doc("seconds between hostile inputs (HTTP, control, checkpoints)", 0.5)
    swap_every_s: float = doc("seconds between operator actions: swap the code head, swap the chat head, roll back",
                              30.0)
    trainer: bool = doc("run `online-spec train` beside the server", True)
    trainer_restart_every_s: float = doc("kill -9 the trainer and start it again this often (0 = never)", 300.0)
    sample_every_s: float = doc("seconds between samples of the server's RSS and /metrics size", 10.0)
    max_batch: int = doc("engine max_batch", 8)
    max_len: int = doc("engine max_len", 1024)
    num_steps: int = doc("K", 3)
    max_tags: int = doc("the server's --max-tags", 16)
    run_dir: str = doc("where the server and trainer write; empty = a temporary directory", "")

    def __post_init__(self):
        check(self.duration_s > 0, "duration_s", "must be > 0")
        check(self.clients >= 1, "clients", "must be >= 1")
        check(0 <= self.greedy_fraction <= 1, "greedy_fraction", "must be in [0, 1]")
        check(self.prompts >= 1, "prompts", "must be >= 1")
        check(self.hostile_interval_s > 0 and self.swap_every_s > 0 and self.sample_every_s > 0, "sample_every_s",
              "intervals must be > 0")


QUICK = dict(duration_s=60.0, warmup_s=20.0, clients=2, prompts=4, max_tokens=16, swap_every_s=10.0,
             trainer_restart_every_s=30.0, sample_every_s=5.0)


def references(cfg: SoakConfig) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and what plain decoding (K = 0, fp32, greedy) makes of each."""
    import torch

    from online_spec.data import sharegpt_conversations
    from online_spec.sampling import SamplingParams
    from online_spec.target import load_target
    from serving.engine import Engine, EngineConfig

    torch.set_num_threads(1)  # the server and the trainer run beside this process
    target = load_target(dtype=torch.float32)
    convs = sharegpt_conversations(limit=cfg.prompts, seed=1, split="heldout", max_prompt_tokens=128,
                                   tokenizer=target.tokenizer)
    prompts = [target.encode_chat(c[:1]) for c in convs]
    engine = Engine(target, None, EngineConfig(max_batch=cfg.max_batch, max_len=cfg.max_len, num_steps=0))
    return prompts, engine.generate(prompts, SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True))


class Soak:
    """The processes, the load and the tallies of one soak (see the module docstring)."""

    def __init__(self, cfg: SoakConfig, root: Path, prompts, refs):
        self.cfg, self.root, self.prompts, self.refs = cfg, root, prompts, refs
        self.serve_dir, self.trainer_dir = root / "serve", root / "trainer"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop = threading.Event()
        self.t0 = 0.0
        self.tally = {"requests": 0, "failed": 0, "greedy_checked": 0, "mismatches": 0, "tokens": 0,
                      "hostile": 0, "hostile_unexpected": 0, "swaps": 0, "rollbacks": 0, "operator_errors": 0,
                      "trainer_starts": 0, "trainer_kills": 0}
        self.errors: list[str] = []
        self.samples: list[dict] = []
        self.server: subprocess.Popen | None = None
        self.trainer: subprocess.Popen | None = None

    # -- processes --------------------------------------------------------------------------------
    def start_server(self) -> None:
        c = self.cfg
        self.serve_dir.mkdir(parents=True, exist_ok=True)
        (self.trainer_dir / "ckpt").mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "online_spec.cli", "serve", "--port", str(self.port), "--draft", str(SHIPPED),
               "--dtype", "float32", "--run-dir", str(self.serve_dir), "--capture", "--threads", "1",
               "--allowed-roots", f"{self.trainer_dir / 'ckpt'},{self.root / 'heads'}", "--max-batch", str(c.max_batch),
               "--max-len", str(c.max_len), "--num-steps", str(c.num_steps), "--max-tags", str(c.max_tags),
               "--log-level", "warning"]
        self.server = subprocess.Popen(cmd, stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"the server exited ({self.server.returncode}): see {self.root / 'server.log'}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 300 s")
            time.sleep(0.5)

    def start_trainer(self) -> None:
        cmd = [sys.executable, "-m", "online_spec.cli", "train", "--run-dir", str(self.trainer_dir),
               "--control-run-dir", str(self.serve_dir), "--init-head", str(SHIPPED), "--threads", "1",
               "--nice", "10", "--wandb-mode", "disabled", "--capture-idle-timeout-s", "5"]
        self.trainer = subprocess.Popen(cmd, stdout=open(self.root / "trainer.log", "ab"), stderr=subprocess.STDOUT)
        self.tally["trainer_starts"] += 1

    def kill_trainer(self, sig=signal.SIGKILL) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.send_signal(sig)
            self.trainer.wait(120)
            self.tally["trainer_kills"] += sig == signal.SIGKILL

    # -- load -------------------------------------------------------------------------------------
    async def client(self, http: httpx.AsyncClient, k: int) -> None:
        rng = random.Random(k)
        for n in itertools.count(k, self.cfg.clients):
            if self.stop.is_set():
                return
            i = n % len(self.prompts)
            greedy = rng.random() < self.cfg.greedy_fraction
            sp = {"max_new_tokens": self.cfg.max_tokens, "ignore_eos": True, "temperature": 0.0 if greedy else 0.8}
            if not greedy:
                sp["sampling_seed"] = n
            body = {"input_ids": self.prompts[i], "stream": True, "sampling_params": sp, "tag": ("chat", "code")[n % 2]}
            ids, finish, problem = None, None, None
            try:
                async with http.stream("POST", "/generate", json=body) as r:
                    if r.status_code != 200:
                        problem = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    else:
                        async for line in r.aiter_lines():
                            ev = sse_event(line)
                            if ev is None:
                                continue
                            if "error" in ev:
                                problem = f"error event: {ev['error'].get('message')}"
                            else:
                                ids, finish = ev.get("output_ids"), ev["meta_info"].get("finish_reason") or finish
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            self.tally["requests"] += 1
            if problem is None and finish is None:
                problem = "no finish_reason"
            if problem is not None:
                self.tally["failed"] += 1
                self._error(f"request {n}: {problem}")
                continue
            self.tally["tokens"] += len(ids)
            if greedy:
                self.tally["greedy_checked"] += 1
                if ids != self.refs[i]:
                    self.tally["mismatches"] += 1
                    self._error(f"request {n} (prompt {i}) differs from plain decoding")

    async def hostile(self, http: httpx.AsyncClient, control: ControlClient, heads: dict) -> None:
        loop = asyncio.get_running_loop()
        cases = [("http", c) for c in HTTP_CASES] + [("control", c) for c in CONTROL_CASES]
        for n in itertools.count():
            if self.stop.is_set():
                return
            kind, case = cases[n % len(cases)]
            if kind == "http":
                problem = await case(http, n)
            else:
                problem = await loop.run_in_executor(None, case, control, heads)
            self.tally["hostile"] += 1
            if problem is not None:
                self.tally["hostile_unexpected"] += 1
                self._error(f"hostile {case.__name__}: {problem}")
            await asyncio.sleep(self.cfg.hostile_interval_s)

    def operator(self, control: ControlClient) -> None:
        actions = itertools.cycle(["code", "chat", "rollback"])
        while not self.stop.wait(self.cfg.swap_every_s):
            action = next(actions)
            try:
                if action == "rollback":
                    control.rollback()
                    self.tally["rollbacks"] += 1
                else:
                    control.swap_dir(CODE if action == "code" else SHIPPED, version=1000 + self.tally["swaps"])
                    self.tally["swaps"] += 1
            except ControlError as e:
                self.tally["operator_errors"] += 1
                self._error(f"operator {action}: {e}")

    def watch(self) -> None:
        """Samples; restarts the trainer on schedule."""
        proc = psutil.Process(self.server.pid)
        last_restart = time.monotonic()
        while not self.stop.wait(self.cfg.sample_every_s):
            info = httpx.get(self.url + "/server_info", timeout=30).json()
            self.samples.append({"t": round(time.monotonic() - self.t0, 1), "rss_mb": proc.memory_info().rss / 2**20,
                                 "metrics_bytes": len(httpx.get(self.url + "/metrics", timeout=30).content),
                                 "head_version": info["head_version"], "rounds_failed": info["rounds_failed"],
                                 "requests_failed": info["requests_failed"]})
            every = self.cfg.trainer_restart_every_s
            if self.cfg.trainer and every and time.monotonic() - last_restart >= every:
                last_restart = time.monotonic()
                self.kill_trainer()
                self.start_trainer()

    def _error(self, message: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(f"{time.monotonic() - self.t0:.1f}s {message}")

    # -- the run ------------------------------------------------------------------------------------
    async def load(self, control: ControlClient, heads: dict) -> None:
        limits = httpx.Limits(max_connections=self.cfg.clients + 8)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=httpx.Timeout(300)) as http:
            tasks = [asyncio.create_task(self.client(http, k)) for k in range(self.cfg.clients)]
            tasks.append(asyncio.create_task(self.hostile(http, control, heads)))
            while time.monotonic() - self.t0 < self.cfg.duration_s:
                await asyncio.sleep(0.5)
            self.stop.set()
            await asyncio.gather(*tasks)

    def run(self) -> dict:
        heads = write_bad_heads(SHIPPED, self.root / "heads")
        self.start_server()
        if self.cfg.trainer:
            self.start_trainer()
        control = ControlClient.from_run_dir(self.serve_dir, timeout_s=120)
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.operator, args=(control,), daemon=True),
                   threading.Thread(target=self.watch, daemon=True)]
        for t in threads:
            t.start()
        try:
            asyncio.run(self.load(control, heads))
        finally:
            self.stop.set()
            for t in threads:
                t.join(120)
            info = _get_json(self.url + "/server_info")
            self.kill_trainer(signal.SIGTERM)
            self.server.send_signal(signal.SIGTERM)
            server_rc = self.server.wait(120)
        return self.report(info, server_rc)

    def report(self, info: dict, server_rc: int) -> dict:
        after = [s for s in self.samples if s["t"] >= self.cfg.warmup_s]
        ref = after[0]["rss_mb"] if after else None
        growth = max(s["rss_mb"] for s in after) / ref - 1 if after else None
        sizes = [s["metrics_bytes"] for s in self.samples]
        t = self.tally
        return {
            "failed_requests": t["failed"], "lossless": t["mismatches"] == 0, **t,
            "tokens_per_s": t["tokens"] / self.cfg.duration_s,
            "rss_mb_after_warmup": ref, "rss_growth_after_warmup": growth,
            "rss_flat": growth is not None and growth <= 0.10,
            "metrics_bytes": {"first": sizes[0] if sizes else None, "max": max(sizes, default=None),
                              "last": sizes[-1] if sizes else None},
            "server": {k: info.get(k) for k in ("rounds_failed", "requests_failed", "head_version", "head_faults",
                                                "tags")},
            "server_exit_code": server_rc,
            "run_dir_clean_after_sigterm": not set(RUN_FILES) & set(os.listdir(self.serve_dir)),
            "errors": self.errors, "samples": self.samples,
        }


def _get_json(url: str) -> dict:
    try:
        return httpx.get(url, timeout=30).json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": str(e)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, SoakConfig, QUICK, "a one-minute run")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(SoakConfig, args, **quick_overrides(args, QUICK))
    prompts, refs = references(cfg)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run_dir = Path(cfg.run_dir or tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        figures = Soak(cfg, run_dir, prompts, refs).run()
    report = write_report(args.json, {"bench": "soak", "quick": bool(args.quick), "config": config_to_dict(cfg),
                                      **figures}, show=[k for k in figures if k not in ("samples", "errors")])
    ok = report["failed_requests"] == 0 and report["lossless"] and report["hostile_unexpected"] == 0
    return 0 if ok else 1
