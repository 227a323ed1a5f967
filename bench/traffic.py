"""Replay a trace against a server over HTTP: streaming clients, bounded concurrency, file order.

In: a server URL (loopback), `TraceItem`s, a concurrency C, a default max_tokens, a deadline.
Out: one `RequestResult` per request started — phase, tag, the server's request id, times of
submission / first token / last token, completion tokens (the usage chunk), error if any.
Requests start in file order; at most C are in flight; after the deadline no new one starts and
those in flight are cancelled (the server aborts them when the stream closes). With a phase
budget, a phase's remaining lines are skipped once it has run that long.

    results = asyncio.run(replay(url, items, concurrency=4, max_tokens=64, deadline_s=600))
    results = replay_in_child(url, items, concurrency=4, max_tokens=64, deadline_s=600)

`replay_in_child` runs the same clients in a process of their own (`python -m bench.traffic`),
as a deployment's clients are: in the server's process their Python would hold the interpreter
lock the engine thread retakes after every torch call (docs/engine.md). Each finished request
comes back as a JSON line on the child's stdout (`on_done` runs as it arrives); times are
`time.time()` in both processes.

`sse_event(line)` reads one line of a streamed response (server-sent events) for every
streaming client of the benches.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields

from bench.trace import TraceItem

CANCELLED = "cancelled at the deadline"


@dataclass
class RequestResult:
    index: int
    phase: str
    tag: str
    request_id: str = ""
    t_submit: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.t_last is not None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if not self.ok or self.t_first is None or self.completion_tokens < 2:
            return None
        return (self.t_last - self.t_first) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


def sse_event(line: str) -> dict | None:
    """The JSON event of one server-sent-events line (`data: {...}`); None for any other line
    and for the closing `data: [DONE]`. A `data:` line that is not JSON raises JSONDecodeError."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data == "[DONE]" else json.loads(data)


def request_body(item: TraceItem, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one trace item: greedy, streamed, with usage."""
    body = {"max_tokens": item.max_tokens or max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "tag": item.tag}
    if item.messages is not None:
        return "/v1/chat/completions", {**body, "messages": item.messages}
    return "/v1/completions", {**body, "prompt": item.prompt}


async def _one(client, url: str, item: TraceItem, max_tokens: int, res: RequestResult) -> None:
    path, body = request_body(item, max_tokens)
    res.t_submit = time.time()
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            res.request_id = r.headers.get("x-request-id", "")
            async for line in r.aiter_lines():
                chunk = sse_event(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and ((choices[0].get("delta") or {}).get("content") or choices[0].get("text")):
                    now = time.time()
                    res.t_first = res.t_first or now
                    res.t_last = now
            res.t_last = res.t_last or time.time()
            res.t_first = res.t_first or res.t_last
    except asyncio.CancelledError:
        res.error = CANCELLED
        raise
    except Exception as e:  # noqa: BLE001 - one failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"


async def replay(url: str, items: list[TraceItem], concurrency: int, max_tokens: int,
                 deadline_s: float | None = None, on_done=None,
                 phase_budget_s: float | None = None) -> list[RequestResult]:
    """Serve `items` in order, at most `concurrency` at once, until done or the deadline.
    `phase_budget_s`: once a phase has been served that long, its remaining lines are skipped
    (the next phase starts), so every phase shows whatever the machine's speed."""
    import httpx

    results: list[RequestResult] = []
    queue = list(items)
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    phase_start: dict[str, float] = {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        async def worker():
            while queue and (t_end is None or time.monotonic() < t_end):
                item = queue.pop(0)
                started = phase_start.setdefault(item.phase, time.monotonic())
                if phase_budget_s is not None and time.monotonic() - started > phase_budget_s:
                    continue
                res = RequestResult(item.index, item.phase, item.tag)
                results.append(res)
                await _one(client, url, item, max_tokens, res)
                if on_done is not None:
                    on_done(res)

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            if t_end is None:
                await asyncio.gather(*tasks)
            else:
                done, pending = await asyncio.wait(tasks, timeout=max(t_end - time.monotonic(), 0) + 1.0)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()
    return sorted(results, key=lambda r: r.index)


def replay_in_child(url: str, items: list[TraceItem], concurrency: int, max_tokens: int,
                    deadline_s: float | None = None, on_done=None,
                    phase_budget_s: float | None = None) -> list[RequestResult]:
    """`replay` in a child process (`python -m bench.traffic`); the same results, in index order.
    A child that fails raises RuntimeError with its last stderr lines."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([asdict(it) for it in items], f)
    cmd = [sys.executable, "-m", "bench.traffic", "--url", url, "--items", f.name, "--concurrency", str(concurrency),
           "--max-tokens", str(max_tokens)]
    if deadline_s is not None:
        cmd += ["--deadline-s", repr(deadline_s)]
    if phase_budget_s is not None:
        cmd += ["--phase-budget-s", repr(phase_budget_s)]
    names = {f.name for f in fields(RequestResult)}
    results: list[RequestResult] = []
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `bench` imports from here
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as child:
            for line in child.stdout:
                if not line.startswith("{"):
                    continue
                d = json.loads(line)
                late = d.pop("late", False)  # cancelled at the deadline: no on_done, as in `replay`
                res = RequestResult(**{k: v for k, v in d.items() if k in names})
                results.append(res)
                if on_done is not None and not late:
                    on_done(res)
            child.wait()
            if child.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"the traffic child exited {child.returncode}: {err.read().strip()[-800:]}")
    finally:
        os.unlink(f.name)
    return sorted(results, key=lambda r: r.index)


def main(argv: list[str] | None = None) -> int:
    """The child of `replay_in_child`: items from a JSON file, one JSON line per finished request."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.traffic", description=replay_in_child.__doc__)
    ap.add_argument("--url", required=True)
    ap.add_argument("--items", required=True, help="JSON list of TraceItem fields")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--phase-budget-s", type=float, default=None)
    args = ap.parse_args(argv)
    with open(args.items) as f:
        items = [TraceItem(**d) for d in json.load(f)]

    sent: set[int] = set()

    def done(res: RequestResult) -> None:
        sent.add(res.index)
        print(json.dumps(asdict(res)), flush=True)

    results = asyncio.run(replay(args.url, items, args.concurrency, args.max_tokens, args.deadline_s, on_done=done,
                                 phase_budget_s=args.phase_budget_s))
    for res in results:  # the requests cancelled at the deadline (no on_done in `replay`)
        if res.index not in sent:
            print(json.dumps({**asdict(res), "late": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
