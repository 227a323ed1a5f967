"""Replay a trace against a server over HTTP: streaming clients, bounded concurrency, file order.

In: a server URL (loopback), `TraceItem`s, a concurrency C, a default max_tokens, a deadline.
Out: one `RequestResult` per request started — phase, tag, the server's request id, times of
submission / first token / last token, completion tokens (the usage chunk), error if any.
Requests start in file order; at most C are in flight; after the deadline no new one starts and
those in flight are cancelled (the server aborts them when the stream closes). With a phase
budget, a phase's remaining lines are skipped once it has run that long.

    results = asyncio.run(replay(url, items, concurrency=4, max_tokens=64, deadline_s=600))

`sse_event(line)` reads one line of a streamed response (server-sent events) for every
streaming client of the benches.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

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
