"""`online-spec bench swap`: live head swaps through the control endpoint under streaming load.

Starts the real server (SmolLM2 fp32, a day-0 head) on a loopback port with its control endpoint
on an ipc socket in a temporary run directory, runs `clients` concurrent streaming `/generate`
clients (greedy, fixed ShareGPT prompts, bounded in count and time), and meanwhile publishes
`swaps` heads (every `rollback_every`-th is a rollback) through `ControlClient`, each a freshly
written checkpoint directory. Reported:

    swap_stall_ms p50/max   extra time of the round in which a swap was applied: its total_s
                            minus the median total_s of the unaffected rounds within 8 before
                            and after with the same batch size and K
    swap_draft_ms p50/max   the same difference for the draft phase alone
    swap_work_ms p50/max    time a round spends in the engine's swap step (filling the new head's
                            cache, or switching), timed directly: the stall without the noise
                            of the neighbouring rounds
    swap_work_cpu_ms        the same step in CPU time of the engine thread (time.thread_time):
                            what it costs on a core of its own, without the preemption of a
                            shared CPU; the whole cost only with --threads 1 (other torch
                            threads' CPU time is not counted)
    fill_round_extra_ms     the same difference for the rounds before the switch in which the new
                            head's cache was being rebuilt (EngineConfig.swap_fill_rows rows each)
    swaps, rollbacks        applied through the control endpoint (landed between rounds)
    failed_requests         HTTP errors, error events, missing finish (must be 0)
    lossless                every stream's output ids == plain greedy decoding (the target
                            alone, K = 0, same engine settings) of the same prompt
    trainer_to_serving_s    checkpoint on disk (save_head returned) -> end of the first round
                            that drafted with it, p50/max

    online-spec bench swap --json results/bench_swap.json [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from bench.common import add_bench_args, write_report
from bench.traffic import sse_event
from online_spec.checkpoint import save_head
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.data import sharegpt_conversations
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import load_target
from serving.control import ControlClient, ControlConfig
from serving.engine import Engine, EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread


@dataclass
class SwapBenchConfig:
    swaps: int = doc("head swaps to publish (rollbacks included)", 60)
    rollback_every: int = doc("every n-th publish is a rollback (0 = never)", 10)
    clients: int = doc("concurrent streaming clients", 6)
    prompts: int = doc("distinct ShareGPT prompts the clients cycle through", 8)
    max_tokens: int = doc("max_new_tokens per request", 48)
    max_prompt_tokens: int = doc("longest prompt, in tokens", 160)
    swap_interval_s: float = doc("pause between two publishes", 0.4)
    time_limit_s: float = doc("stop publishing after this long", 420.0)
    num_steps: int = doc("K per round", 3)
    max_batch: int = doc("engine max_batch", 8)
    threads: int = doc("torch CPU threads (the CPU may be shared)", 2)
    device: str = doc("torch device of the served model ('cuda': the engine replays CUDA graphs)", "cpu")
    swap_fill_rows: int = doc("EngineConfig.swap_fill_rows: cache rows rebuilt per round before the switch "
                              "(0 = switch at once, rebuilding every row in the swap round)", 48)

    def __post_init__(self):
        check(self.swaps >= 1, "swaps", "must be >= 1")
        check(self.clients >= 1, "clients", "must be >= 1")
        check(self.prompts >= 1, "prompts", "must be >= 1")
        check(self.rollback_every >= 0, "rollback_every", "must be >= 0")


QUICK = dict(swaps=12, clients=3, prompts=4, max_tokens=32, time_limit_s=120.0)


class LoadClients:
    """`n` threads streaming greedy /generate requests over a fixed prompt list until stopped."""

    def __init__(self, url: str, prompts: list[list[int]], n: int, max_tokens: int):
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.results: list[tuple[int, list[int] | None, str | None]] = []  # (prompt index, ids, error)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> "LoadClients":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def _run(self, i: int) -> None:
        k = i
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                p = k % len(self.prompts)
                k += 1
                ids, err = self._one(http, self.prompts[p])
                with self._lock:
                    self.results.append((p, ids, err))

    def _one(self, http: httpx.Client, prompt: list[int]):
        body = {"input_ids": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}}
        ids, finished = None, False
        try:
            with http.stream("POST", self.url + "/generate", json=body) as r:
                if r.status_code != 200:
                    return None, f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    ev = sse_event(line)
                    if ev is None:
                        continue
                    if "error" in ev:
                        return None, str(ev["error"])
                    ids = ev["output_ids"]
                    finished = finished or ev["meta_info"].get("finish_reason") is not None
        except Exception as e:  # counted as a failure
            return None, f"{type(e).__name__}: {e}"
        return (ids, None) if finished else (None, "no finish_reason")


def measure(cfg: SwapBenchConfig, prompts: list[list[int]] | None = None) -> dict:
    """The figures above; `prompts` (token ids) replace the ShareGPT prompts where that package
    is missing (the GPU machine)."""
    torch.set_num_threads(cfg.threads)
    # fp32: greedy is token-identical (bf16 only up to near-ties)
    target = load_target(dtype=torch.float32, device=cfg.device)
    if prompts is None:
        convs = sharegpt_conversations(limit=cfg.prompts, seed=1, max_prompt_tokens=cfg.max_prompt_tokens,
                                       tokenizer=target.tokenizer)
        prompts = [target.encode_chat(c[:1]) for c in convs]
    prompts = prompts[:cfg.prompts]
    engine_cfg = EngineConfig(max_batch=cfg.max_batch, max_len=1024, num_steps=cfg.num_steps,
                              swap_fill_rows=cfg.swap_fill_rows)
    plain = Engine(target, None, EngineConfig(max_batch=cfg.max_batch, max_len=1024, num_steps=0))
    reference = plain.generate(prompts, SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True))
    del plain

    run_dir = Path(tempfile.mkdtemp(prefix="bench_swap_"))
    server = SpecServer(ServerConfig(engine=engine_cfg, drift_monitor=False,
                                     control=ControlConfig(run_dir=str(run_dir))), target, new_head(target, seed=0))
    rounds: list[tuple[float, object]] = []
    swap_work: list[tuple[float, bool, float]] = []  # (seconds in the engine's swap step, switched, CPU seconds)
    apply = server.engine._apply_pending_swap

    def timed_apply() -> bool:  # instrumentation only: the time a round spends on a swap, noise-free
        staged = server.engine.has_pending
        t, c = time.perf_counter(), time.thread_time()
        switched = apply()
        if staged:
            swap_work.append((time.perf_counter() - t, switched, time.thread_time() - c))
        return switched
    server.engine._apply_pending_swap = timed_apply
    server.round_observers.append(lambda stats, outs, tags: rounds.append((time.perf_counter(), stats)))
    server.start()
    http = HttpThread(server).start()
    heads = [new_head(target, seed=s) for s in range(1, 4)]
    published: list[tuple[int, float]] = []  # (version, checkpoint ready on disk)
    load = None
    try:
        client = ControlClient.from_run_dir(run_dir)
        load = LoadClients(http.url, prompts, cfg.clients, cfg.max_tokens).start()
        while len(rounds) < 5:
            time.sleep(0.05)
        t_end = time.monotonic() + cfg.time_limit_s
        n_swaps = n_rollbacks = 0
        for i in range(1, cfg.swaps + 1):
            if time.monotonic() > t_end:
                break
            if cfg.rollback_every and i % cfg.rollback_every == 0:
                client.rollback()
                n_rollbacks += 1
            else:
                d = run_dir / "heads" / f"v{i}"
                save_head(heads[i % len(heads)], d, version=100 + i)
                published.append((100 + i, time.perf_counter()))
                client.swap_dir(d)
                n_swaps += 1
            time.sleep(cfg.swap_interval_s)
        time.sleep(1.0)
        load.stop()
        info = client.info()
    finally:
        if load is not None:
            load.stop()
        http.stop()
        server.close()

    stats = [s for _, s in rounds]
    affected = [s.swapped or s.swap_fill_rows > 0 for s in stats]

    def extra_ms(i: int, field: str) -> float | None:
        """Round i's `field` minus the median over the nearest unaffected rounds of the same shape."""
        s = stats[i]
        near = [stats[j] for j in range(max(0, i - 8), min(len(stats), i + 9))
                if not affected[j] and stats[j].batch_size == s.batch_size and stats[j].num_steps == s.num_steps]
        return 1000 * (getattr(s, field) - statistics.median(getattr(r, field) for r in near)) if near else None

    stall = [x for i, s in enumerate(stats) if s.swapped for x in [extra_ms(i, "total_s")] if x is not None]
    draft_stall = [x for i, s in enumerate(stats) if s.swapped for x in [extra_ms(i, "draft_s")] if x is not None]
    fill = [x for i, s in enumerate(stats) if s.swap_fill_rows and not s.swapped
            for x in [extra_ms(i, "total_s")] if x is not None]
    t2s = []
    for version, t_ready in published:
        first = next((t for t, s in rounds if s.head_version == version and s.num_steps > 0), None)
        if first is not None:
            t2s.append(first - t_ready)
    done = [r for r in load.results if r[2] is None]
    failed = [r for r in load.results if r[2] is not None]
    mismatches = sum(ids != reference[p] for p, ids, _ in done)

    def q(xs, p):
        return None if not xs else round(statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else xs[0], 3)
    return {
        "swap_stall_ms_p50": q(stall, 50), "swap_stall_ms_max": round(max(stall), 3) if stall else None,
        "swap_draft_ms_p50": q(draft_stall, 50),
        "swap_draft_ms_max": round(max(draft_stall), 3) if draft_stall else None,
        "stall_samples": len(stall),
        "swap_work_ms_p50": q([1000 * t for t, _, _ in swap_work], 50),
        "swap_work_ms_max": round(1000 * max(t for t, _, _ in swap_work), 3) if swap_work else None,
        "swap_work_cpu_ms_p50": q([1000 * c for _, _, c in swap_work], 50),
        "swap_work_cpu_ms_max": round(1000 * max(c for _, _, c in swap_work), 3) if swap_work else None,
        "switch_work_ms_max": round(1000 * max((t for t, sw, _ in swap_work if sw), default=0), 3),
        "fill_round_extra_ms_p50": q(fill, 50), "fill_round_extra_ms_max": round(max(fill), 3) if fill else None,
        "fill_rounds": sum(1 for s in stats if s.swap_fill_rows and not s.swapped),
        "fill_rows_per_swap": round(sum(s.swap_fill_rows for s in stats) / max(1, sum(s.swapped for s in stats)), 1),
        "round_ms_p50": q([1000 * s.total_s for s in stats if not s.swapped], 50),
        "swaps": n_swaps + n_rollbacks, "rollbacks": n_rollbacks,
        "swaps_landed_in_rounds": sum(s.swapped for s in stats),
        "requests": len(load.results), "failed_requests": len(failed),
        "failures": sorted({e for _, _, e in failed})[:5],
        "lossless": mismatches == 0 and bool(done), "mismatched_requests": mismatches,
        "trainer_to_serving_s_p50": q(t2s, 50), "trainer_to_serving_s_max": round(max(t2s), 3) if t2s else None,
        "final_head_version": info["head_version"], "rounds": len(stats),
        "mean_batch_size": round(statistics.mean(s.batch_size for s in stats), 2) if stats else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, SwapBenchConfig, QUICK, "a short run")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(SwapBenchConfig, args, **(QUICK if args.quick else {}))
    t0 = time.time()
    results = measure(cfg)
    write_report(args.json, {"bench": "swap", "config": config_to_dict(cfg), "results": results,
                             "wall_s": round(time.time() - t0, 1)})
    return 0
