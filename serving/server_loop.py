"""The engine thread: one background thread drives `engine.step()` for every HTTP request.

In: `submit(request)` from the asyncio side (the event loop thread). Out: each `RequestOutput`
of that request, put on its own `asyncio.Queue` through `loop.call_soon_threadsafe`, the only
way another thread may touch an asyncio queue. The thread steps while the engine has work and
otherwise sleeps on an event that `submit` sets. `close()` stops it with a sentinel (the stop
event) and fails whatever is still outstanding.

A failing round fails only the request that caused it, and the loop keeps going:
  1. tokens the round committed before it failed (requests whose outputs were made but not
     returned) are delivered, so every other stream stays exactly the target's;
  2. the round's requests are validated again (`SamplingParams.validate`): one that fails is the
     culprit; it gets an `EngineError` (status 400) and is aborted, and the next round runs
     without it;
  3. with no culprit, `on_failure(exc)` is asked (the server checks whether the live head
     drafts non-finite values and, if so, rolls it back: a fault of the head, not of a request);
     while it reports the fault handled the round is retried;
  4. otherwise the round is retried once; failing again, its requests get an `EngineError`
     (status 500) and are aborted.

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

from online_spec.config import ConfigError
from serving.engine import Engine
from serving.requests import Request, RequestOutput

log = logging.getLogger(__name__)

RETRY_SLEEP_S = 0.05
MAX_HANDLED_RETRIES = 200  # rounds retried while on_failure reports the fault handled (~10 s)


@dataclass
class EngineError:
    """Put on a request's queue when the engine failed or stopped while serving it: the HTTP
    status (400: the request itself could not be served, 500: the engine failed) and why."""

    message: str
    status: int = 500


@dataclass
class RequestStream:
    """The asyncio end of one request: its queue and what its outputs added up to."""

    request: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    delivered: int = 0          # tokens put on the queue (engine thread)
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
                 idle_wait_s: float = 0.5, on_failure: Callable[[Exception], bool] | None = None):
        self.engine = engine
        self.on_step = on_step
        self.on_failure = on_failure  # engine thread: True when it handled the fault (retry the round)
        self.idle_wait_s = idle_wait_s
        self._failed_in_a_row = 0
        self.requests_failed = 0  # requests given an EngineError by a failing round
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
                self._round_failed(e)
                continue
            self._failed_in_a_row = 0
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

    def _round_failed(self, e: Exception) -> None:
        """A round raised: deliver what it committed, fail its culprit or retry (module docstring)."""
        self.rounds_failed += 1
        self._failed_in_a_row += 1
        log.error("engine round failed: %s: %s", type(e).__name__, e, exc_info=self._failed_in_a_row == 1)
        self._deliver_committed()
        culprits = self._culprits()
        if culprits:
            for rid, reason in culprits:
                log.warning("request %s failed the round and is refused: %s", rid, reason)
                self._fail(rid, EngineError(f"request refused: {reason}", status=400))
            self._failed_in_a_row = 0
            return
        handled = False
        if self.on_failure is not None:
            try:
                handled = bool(self.on_failure(e))
            except Exception:  # noqa: BLE001 - the hook must not end the loop either
                log.exception("on_failure hook failed (ignored)")
        limit = MAX_HANDLED_RETRIES if handled else 2
        if self._failed_in_a_row >= limit:
            log.error("the round failed %d times in a row; failing the requests it held", self._failed_in_a_row)
            for r in _snapshot(self.engine.running):
                self._fail(r.request_id, EngineError(f"engine error: {type(e).__name__}: {e}"))
            self._failed_in_a_row = 0
        time.sleep(RETRY_SLEEP_S)

    def _culprits(self) -> list[tuple[str, str]]:
        """(request id, reason) of each request of the round whose parameters fail validation."""
        reqs = _snapshot(self.engine.running) + _snapshot(self.engine.waiting)
        out = []
        for r in reqs:
            if r.finish_reason is not None:
                continue
            try:
                r.params.validate()
            except (ConfigError, TypeError) as err:
                out.append((r.request_id, str(err)))
        return out

    def _deliver_committed(self) -> None:
        """Outputs for tokens a failed round committed to its requests before it raised (the
        round's outputs were lost with it): each stream gets the rest of its request's tokens."""
        outs = []
        for r in _snapshot(self.engine.running):
            with self._lock:
                stream = self._streams.get(r.request_id)
            if stream is not None and len(r.output_ids) > stream.delivered:
                outs.append(RequestOutput(r.request_id, list(r.output_ids[stream.delivered:]), 0, 0,
                                          r.finish_reason is not None, r.finish_reason))
        self._deliver(outs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None:
                continue  # aborted: nobody is listening
            stream.delivered += len(out.new_token_ids)
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            except RuntimeError:  # its event loop is closed
                self.engine.abort(out.request_id)

    def _fail(self, request_id: str, error: EngineError) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        if stream is not None:
            self.requests_failed += 1
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self.engine.abort(s.request.request_id)
            self.requests_failed += 1
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineError(message))
            except RuntimeError:
                pass


def _snapshot(seq) -> list:
    """A copy of a list or deque another thread may append to (add_request adds to `waiting`)."""
    for _ in range(100):
        try:
            return list(seq)
        except RuntimeError:  # mutated during the copy: copy again
            continue
    return []
