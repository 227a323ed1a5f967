"""`CaptureSubscriber`: the trainer's end of the capture stream, records in, spans out.

It CONNECTS a SUB socket to the publisher's endpoint (so either side may start first, and it
reconnects by itself when the serving process restarts), decodes every message with
`collector.wire_round.decode_message` (a round's records, a record or an end marker), counts
and drops whatever does not decode (it never raises on bad input; a refused round message loses
all its records), joins the records per request into contiguous `CaptureSpan`s with a `SpanAssembler`
and hands each finished span to `on_span` (typically `ReplayBuffer.add`). A request's span is
finished by the publisher's end-of-request marker, by a gap, by `idle_timeout_s` without a
record (the marker may have been dropped), or by the size limits.

    sub = CaptureSubscriber(SubscriberConfig(endpoint=pub_endpoint), on_span=buffer.add).start()
    ...
    sub.stats(); sub.close()

A background thread does all the socket work; `on_span` runs on it. Failures of `on_span` are
logged and counted, and the thread keeps going; `close()` stops it with a sentinel message on
an inproc control socket and, by default, hands the still-open spans over first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from online_spec.config import check, doc

from collector.assembler import SpanAssembler
from collector.curve import check_curve_files, make_curve_client
from collector.endpoint import check_endpoint, resolve_endpoint
from collector.span import CaptureSpan
from collector.wire import EndOfRequest, WireError
from collector.wire_round import decode_message

log = logging.getLogger(__name__)

_CONTROL_IDS = itertools.count()


@dataclass
class SubscriberConfig:
    endpoint: str = doc("ZMQ endpoint of the publisher to connect to; empty = ipc://<run_dir>/capture.sock", "")
    run_dir: str = doc("directory of the default ipc socket; empty = the server's run directory (online-spec "
                       "train --control-run-dir) or a per-user directory in the system temp directory", "")
    curve_server_key: str = doc("CURVE: the publisher's public certificate (zmq.auth NAME.key); empty = no CURVE", "")
    curve_secret_key: str = doc("CURVE: this subscriber's certificate (NAME.key_secret), authorised by the publisher",
                                "")
    recv_hwm: int = doc("ZMQ receive high-water mark in messages (beyond it the publisher drops)", 1000)
    max_message_bytes: int = doc("largest frame accepted; a peer sending more is disconnected", 1 << 28)
    idle_timeout_s: float = doc("hand over a request's span after this long without a record of it", 30.0)
    max_open_requests: int = doc("requests assembled at once; beyond it the least recent is handed over", 4096)
    max_span_rows: int = doc("hand over a span when it reaches this many rows (the request goes on in a new one)", 8192)
    poll_ms: int = doc("how often the thread wakes to expire idle requests when no message comes", 100)

    def __post_init__(self) -> None:
        check_endpoint(resolve_endpoint(self.endpoint, self.run_dir), "endpoint")
        check_curve_files("curve_secret_key", self.curve_secret_key, self.curve_server_key, other_is_dir=False)
        check(self.recv_hwm >= 1, "recv_hwm", f"{self.recv_hwm} < 1 (0 would mean unbounded)")
        check(self.max_message_bytes >= 1024, "max_message_bytes", f"{self.max_message_bytes} < 1024")
        check(self.idle_timeout_s > 0, "idle_timeout_s", f"{self.idle_timeout_s} <= 0")
        check(self.max_open_requests >= 1, "max_open_requests", f"{self.max_open_requests} < 1")
        check(self.max_span_rows >= 1, "max_span_rows", f"{self.max_span_rows} < 1")
        check(self.poll_ms >= 1, "poll_ms", f"{self.poll_ms} < 1")


class CaptureSubscriber:
    """Receives, validates and reassembles the capture stream on a background thread."""

    def __init__(self, cfg: SubscriberConfig, on_span: Callable[[CaptureSpan], None]):
        self.cfg = cfg
        self.on_span = on_span
        self.endpoint = resolve_endpoint(cfg.endpoint, cfg.run_dir)
        self.assembler = SpanAssembler(cfg.idle_timeout_s, cfg.max_open_requests, cfg.max_span_rows)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        self._sub.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self._sub.setsockopt(zmq.LINGER, 0)
        if cfg.curve_secret_key:
            make_curve_client(self._sub, cfg.curve_server_key, cfg.curve_secret_key)
        self._sub.connect(self.endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")  # everything: bad frames must arrive to be counted
        control = f"inproc://capture-subscriber-control-{next(_CONTROL_IDS)}"
        self._control_in = self._ctx.socket(zmq.PAIR)
        self._control_in.bind(control)
        self._control_out = self._ctx.socket(zmq.PAIR)
        self._control_out.connect(control)
        self._thread = threading.Thread(target=self._run, name="capture-subscriber", daemon=True)
        self._started = False
        self._closed = False
        self._last_warn = -1e9
        self.messages = 0
        self.records = 0
        self.end_markers = 0
        self.malformed = 0
        self.last_malformed = ""
        self.spans = 0
        self.span_rows = 0
        self.handler_errors = 0

    def start(self) -> "CaptureSubscriber":
        self._started = True
        self._thread.start()
        return self

    def stats(self) -> dict[str, Any]:
        names = ("messages", "records", "end_markers", "malformed", "last_malformed", "spans", "span_rows",
                 "handler_errors")
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["gaps"] = self.assembler.gaps
        out["open_requests"] = self.assembler.num_open
        out.update({f"spans_closed_by_{k}": v for k, v in self.assembler.closed.items()})
        return out

    def close(self, flush: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the thread (sentinel); with `flush`, open spans are handed to `on_span` first."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._control_out.send(b"flush" if flush else b"stop")
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("capture subscriber: thread did not stop within %.1f s", timeout_s)
                return
        else:
            self._sub.close()
            self._control_in.close()
        self._control_out.close()
        self._ctx.term()

    def __enter__(self) -> "CaptureSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._control_in, zmq.POLLIN)
        stop = b""
        try:
            while not stop:
                try:
                    events = dict(poller.poll(self.cfg.poll_ms))
                    if self._control_in in events:
                        stop = self._control_in.recv()
                    if self._sub in events:
                        self._receive_ready()
                    self._emit(self.assembler.expire(time.monotonic()))
                except Exception:  # keep receiving: a bug in one message must not end the stream
                    log.exception("capture subscriber: error in the receive loop; continuing")
            if stop == b"flush":
                self._emit(self.assembler.flush())
        finally:
            self._sub.close()
            self._control_in.close()

    def _receive_ready(self, max_batch: int = 256) -> None:
        for _ in range(max_batch):  # bounded, so expiry and the sentinel are still seen under load
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list) -> None:
        self.messages += 1
        try:
            msg = decode_message(frames)
        except WireError as e:
            self.malformed += 1
            self.last_malformed = str(e)
            now = time.monotonic()
            if now - self._last_warn >= 10.0:
                self._last_warn = now
                log.warning("capture subscriber: dropping a malformed message (%d so far): %s", self.malformed, e)
            return
        if isinstance(msg, EndOfRequest):
            self.end_markers += 1
            self._emit(self.assembler.end(msg.request_id))
        elif isinstance(msg, list):  # a round message: its records in order
            self.records += len(msg)
            now = time.monotonic()
            for record in msg:
                self._emit(self.assembler.add(record, now))
        else:
            self.records += 1
            self._emit(self.assembler.add(msg, time.monotonic()))

    def _emit(self, spans: list[CaptureSpan]) -> None:
        for span in spans:
            self.spans += 1
            self.span_rows += span.num_rows
            try:
                self.on_span(span)
            except Exception:
                self.handler_errors += 1
                log.exception("capture subscriber: on_span failed for request %r; continuing", span.request_id)
