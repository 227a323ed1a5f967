"""`online-spec bench server`: many concurrent streaming clients against the real server.

Starts the real server (SmolLM2 bf16, the shipped head or `--draft`, e.g. `day0` for a random
one) on a loopback port, runs `clients` concurrent streaming chat clients (asyncio + httpx, real
ShareGPT held-out first turns) until
`requests` requests are done or `time_limit_s` has passed, then restarts the server with K = 0
(plain decoding, same head) and runs the same load again. Per mode:

    failed_requests         non-200, error events, no finish_reason, or exceptions (must be 0)
    ttft_s p50/p99          request sent -> first chunk carrying text
    tpot_s p50/p99          (last text chunk - first) / (completion tokens - 1), per request
    tokens_per_s            completion tokens of all requests / wall time of the load
    avg_spec_accept_length  /server_info after the load (bonus included; 1.0 at K = 0)

plus the machine (CPU, cores, torch threads, versions). `--quick` shortens everything.

    online-spec bench server --quick --json results/bench_server.json
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.common import add_bench_args, quick_overrides, write_report
from bench.heads import HEAD_CHOICES, resolve_head
from bench.traffic import sse_event
from online_spec.checkpoint import load_head
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.data import sharegpt_conversations
from online_spec.head import new_head
from online_spec.target import load_target
from serving.control import ControlConfig
from serving.engine import EngineConfig
from serving.server import ServerConfig, SpecServer, build_policy
from serving.server_app import HttpThread


@dataclass
class ServerBenchConfig:
    clients: int = doc("concurrent streaming clients", 64)
    requests: int = doc("requests per mode in all (each client sends until they are used up)", 256)
    max_tokens: int = doc("max_tokens per request", 64)
    max_prompt_tokens: int = doc("longest ShareGPT first turn used as a prompt, in tokens", 256)
    time_limit_s: float = doc("stop sending new requests after this long, per mode", 600.0)
    num_steps: int = doc("K of the speculative mode (the other mode runs K = 0)", 3)
    max_batch: int = doc("engine max_batch", 32)
    max_len: int = doc("engine max_len", 1024)
    draft: str = doc("head: " + HEAD_CHOICES + " (default: shipped; day0, a random head, accepts nothing, "
                     "so the speculative mode measures only its overhead)", "")
    temperature: float = doc("sampling temperature of the requests (0 = greedy)", 0.0)
    policy: str = doc("K policy of the speculative mode: static (K = --num-steps), ema (SGLang's default "
                      "adaptive tiers) or cost (the cost-model policy, calibrated on the engine before the load; "
                      "tiers 0..7)", "static")

    def __post_init__(self):
        check(self.clients >= 1, "clients", "must be >= 1")
        check(self.requests >= self.clients, "requests", f"must be >= clients={self.clients}")
        check(self.max_tokens >= 2, "max_tokens", "must be >= 2 (TPOT needs two tokens)")
        check(self.time_limit_s > 0, "time_limit_s", "must be > 0")
        check(self.policy in ("static", "ema", "cost"), "policy", f"must be static, ema or cost, got {self.policy!r}")


QUICK = dict(requests=64, max_tokens=16, max_prompt_tokens=96, time_limit_s=240.0)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(client: httpx.AsyncClient, messages: list[dict], cfg: ServerBenchConfig) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    t_first = t_last = None
    finish, tokens, error = None, 0, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                ev = sse_event(line)
                if ev is None:
                    continue
                if "error" in ev:
                    error = ev["error"].get("message")
                    continue
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices", []):
                    if ch["delta"].get("content"):
                        t_last = time.perf_counter()
                        t_first = t_first or t_last
                    finish = ch.get("finish_reason") or finish
    except Exception as e:  # counted as a failure, never hidden
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = error is None and finish is not None
    return {"ok": ok, "error": error or (None if ok else "no finish_reason"), "tokens": tokens,
            "ttft": None if t_first is None else t_first - t0,
            "tpot": (t_last - t_first) / (tokens - 1) if t_first is not None and tokens > 1 else None}


async def _load(url: str, prompts: list[list[dict]], cfg: ServerBenchConfig) -> dict:
    todo = iter(range(cfg.requests))
    deadline = time.monotonic() + cfg.time_limit_s
    results: list[dict] = []

    async def worker(client):
        for i in todo:
            if time.monotonic() > deadline:
                return
            results.append(await _one(client, prompts[i % len(prompts)], cfg))

    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    timeout = httpx.Timeout(cfg.time_limit_s + 120)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(cfg.clients)))
    wall = time.perf_counter() - t0
    good = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in good if r["ttft"] is not None]
    tpot = [r["tpot"] for r in good if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in good)
    return {"requests": len(results), "failed_requests": len(results) - len(good),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
            "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
            "tpot_s": {"p50": _pct(tpot, 0.5), "p99": _pct(tpot, 0.99)}}


def run_mode(target, head, cfg: ServerBenchConfig, num_steps: int, prompts: list[list[dict]],
             policy: str = "static") -> dict:
    """One mode under load; `policy` (spec mode only): static, ema or cost, built as `serve --policy`
    builds it (the cost model calibrated into a temporary run directory, before the clients start)."""
    engine = EngineConfig(max_batch=cfg.max_batch, max_len=cfg.max_len,
                          max_steps=7 if policy != "static" else max(num_steps, 1),
                          num_steps=num_steps, max_queue=max(1024, cfg.clients))
    with tempfile.TemporaryDirectory(prefix="bench-server-") as run_dir:
        scfg = ServerConfig(engine=engine, drift_monitor=False, policy=policy,
                            adaptive="sglang_default" if policy == "ema" else "", control=ControlConfig(run_dir=run_dir))
        server = SpecServer(scfg, target, head, policy=build_policy(scfg, target, head))
        server.start()
        http = HttpThread(server).start()
        try:
            out = asyncio.run(_load(http.url, prompts, cfg))
            st = server.info()["internal_states"][0]
            out.update(num_steps=num_steps, avg_spec_accept_length=st["avg_spec_accept_length_lifetime"] or 1.0,
                       rounds_failed=server.loop.rounds_failed, policy=server.engine.policy.name,
                       steps_per_slot=st.get("speculative_num_steps_per_slot"))
            return out
        finally:
            http.stop()
            server.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, ServerBenchConfig, QUICK, "a short run")


def run(args: argparse.Namespace) -> int:
    overrides = quick_overrides(args, QUICK)
    cfg = config_from_args(ServerBenchConfig, args, **overrides)
    results: dict[str, Any] = {"bench": "server", "quick": bool(args.quick), "config": config_to_dict(cfg)}
    target = load_target()
    draft = resolve_head(cfg.draft or "shipped", target)
    head = load_head(draft, target.info, dtype=target.dtype)[0] if draft else new_head(target)
    # held-out conversations: a packaged head was trained on the train split
    convs = sharegpt_conversations(limit=cfg.requests, seed=0, split="heldout", max_prompt_tokens=cfg.max_prompt_tokens,
                                   tokenizer=target.tokenizer)
    prompts = [c[:1] for c in convs]
    results["model"] = target.name
    results["head"] = draft or "day-0 (random)"
    results["spec"] = run_mode(target, head, cfg, cfg.num_steps, prompts, policy=cfg.policy)
    results["plain"] = run_mode(target, head, cfg, 0, prompts)
    results["failed_requests"] = results["spec"]["failed_requests"] + results["plain"]["failed_requests"]
    results["speedup_tokens_per_s"] = results["spec"]["tokens_per_s"] / max(results["plain"]["tokens_per_s"], 1e-9)
    write_report(args.json, results)
    return 0 if results["failed_requests"] == 0 else 1
