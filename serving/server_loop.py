"""The engine thread: one background thread drives `engine.step()` for every HTTP request.

In: `submit(request)` from the asyncio side (the event loop thread). Out: each `RequestOutput`
of that request, put on its own `asyncio.Queue` through `loop.call_soon_threadsafe`, the only
way another thread may touch an asyncio queue. The thread steps while the engine has work and
otherwise sleeps on an event that `submit` sets. A failing round is logged, the requests it
held get an `EngineError` on their queue and are aborted, and the loop keeps going; `close()`
stops it with a sentinel (the stop event) and fails whatever is still outstanding.

    loop = EngineLoop(engine); loop.start()
    stream = loop.submit(Request(ids, params, "cmpl-1", tag="chat"))   # on the event loop
    out = await stream.queue.get()                                       # RequestOutput | EngineError
    loop.abort("cmpl-1")                                                 # client went away
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from serving.engine import Engine
from serving.requests import Request, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class EngineError:
    """Put on a request's queue when the engine failed or stopped while serving it."""

    message: str


@dataclass
class RequestStream:
    """The asyncio end of one request: its queue and what its outputs added up to."""

    request: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    outputs: int = 0            # RequestOutputs received; the first is the prefill's
    accepted: int = 0           # drafts accepted over its verify rounds (bonus excluded)
    proposed: int = 0           # drafts proposed over its verify rounds
    finished: bool = False
    finish_reason: str | None = None

    @property
    def verify_ct(self) -> int:
        """Verify rounds this request took part in (the prefill is not one)."""
        return max(0, self.outputs - 1)

    def note(self, out: RequestOutput) -> None:
        """Account one output (called on the event loop as it is read from the queue)."""
        now = time.perf_counter()
        if out.new_token_ids and self.t_first is None:
            self.t_first = now
        if out.new_token_ids:
            self.t_last = now
        if self.outputs > 0:
            self.accepted += out.accept_len
            self.proposed += out.num_steps
        self.outputs += 1
        if out.finished:
            self.finished, self.finish_reason = True, out.finish_reason


class EngineLoop:
    def __init__(self, engine: Engine, on_step: Callable[[list[RequestOutput], float], None] | None = None,
                 idle_wait_s: float = 0.5):
        self.engine = engine
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.rounds_failed = 0

    # -- asyncio side ---------------------------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Register and queue `request` (call on the event loop). Raises what add_request raises."""
        if self._stop.is_set():
            raise RuntimeError("the engine loop is stopped")
        stream = RequestStream(request, asyncio.Queue(), asyncio.get_running_loop())
        # registered before the engine sees it: its first output may come before we return
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._streams[request.request_id] = stream
        try:
            self.engine.add_request(request)
        except BaseException:
            with self._lock:
                self._streams.pop(request.request_id, None)
            raise
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client disconnect); its slot is freed at the start of the next round."""
        with self._lock:
            self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    def wake(self) -> None:
        """Run a round soon even if idle (a swap waiting to be applied)."""
        self._wake.set()

    def tag_of(self, request_id: str) -> str:
        with self._lock:
            s = self._streams.get(request_id)
        return s.request.tag if s is not None else ""

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._fail_all("the server is shutting down")

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                if self.engine.has_pending:  # a swap or policy change lands even when idle
                    self._step_idle()
                    continue
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outs = self.engine.step()
            except Exception as e:  # a bad round must not take the server down
                self.rounds_failed += 1
                log.exception("engine round failed; aborting the requests it held")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                time.sleep(0.05)
                continue
            self._deliver(outs)
            if self.on_step is not None:
                try:
                    self.on_step(outs, time.perf_counter() - t0)
                except Exception:
                    log.exception("on_step hook failed (ignored)")

    def _step_idle(self) -> None:
        try:
            self.engine.step()
        except Exception:
            self.rounds_failed += 1
            log.exception("idle round (applying a swap) failed")
            time.sleep(0.05)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None:
                continue  # aborted: nobody is listening
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            except RuntimeError:  # its event loop is closed
                self.engine.abort(out.request_id)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self.engine.abort(s.request.request_id)
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineError(message))
            except RuntimeError:
                pass
