"""`CapturePublisher`: the serving process's end of the capture stream. It never blocks decode.

The engine calls, from its round loop:

    pub = CapturePublisher(PublisherConfig(sample_fraction=0.5))
    if pub.should_capture(request_id): ...      # once, when the request is admitted
    pub.submit(records)                          # once per round: this round's sampled records
    pub.end_request(request_id)                  # when the request finishes
    pub.stats(); pub.close()

`submit` only appends the round's records, as one item, to an in-process queue bounded in
records (`queue_size`; records beyond it are dropped and counted). A sender thread copies the
round's tensors into fresh CPU buffers in the wire dtype, a few tensor operations for the whole
round (an engine's `CaptureRound` straight from its tensors, other records through
`collector.wire.encode_parts`; the engine may pass views of its own tensors and promises not to
mutate them after submitting), and sends the round's records as one round message
(`collector.wire_round`: six frames for up to 64 records, where each record was a message of
its own) with `zmq.NOBLOCK` and `copy=False`; the HWM refuses a message whole (`dropped_hwm`
counts its records). Whole rounds, because every torch call of the sender thread releases and retakes
the GIL, and each hand-over stalls the engine's thread: per-record encoding cost an H100 engine
18 % of its tokens/s at batch 1 and 31 % at batch 16 (docs/collector.md). For the same reason,
given the engine's host window (`follow_window`: a GPU engine's), the sender starts each round's
work when the engine's thread next waits on the verify forward (the round's longest wait), and
sends each further message of a round only while it still waits, else in its next wait
(online_spec/host_window.py). End markers (a few microseconds each) go out without a window;
once a wait finds none within the window's bound, the queued items after it go out at once
until the engine opens a window again (an idle engine opens none). With `send_deferred` (the engine's
`capture_sender` 'engine') nothing of this runs on the sender thread while rounds come: the
engine's own thread pumps what it kept just before its next verify read-back, on a GPU while the
device verifies, and the sender thread sends only what no pump took for `DEFER_FLUSH_S`. An engine on
a CPU has the publisher encode and send on its own thread instead (`send_inline`), between
forwards, where the work costs only its own time.

Why XPUB with `XPUB_NODROP`, bound by the publisher:
- a plain PUB socket never blocks but also drops silently at its high-water mark, so drops
  could not be counted; with `XPUB_NODROP` the send raises `zmq.Again` instead, and we count
  `dropped_hwm`. The HWM counts whole messages, so `Again` can only come at a message's first
  frame: a multipart message is either sent whole or not at all;
- XPUB also receives the subscribers' subscriptions, so the publisher knows whether anyone is
  listening. Messages while nobody is (trainer not started yet, killed, or the first instants
  after it connects: the PUB/SUB "slow joiner") are counted as `dropped_no_subscriber` rather
  than lost silently;
- PUSH/PULL would raise `Again` with no peer too, but could not tell "no peer" from "peer
  slow", and several PULL peers would split the stream between them, whereas PUB/SUB lets a
  trainer and a monitoring tap each see every record.
Either side may start first or restart: the subscriber reconnects by itself, and a restarted
publisher re-binds the ipc socket file left by a killed one. "Sent" means handed to ZMQ;
messages queued towards a subscriber that is then killed are lost uncounted.

Who can read it: the stream carries users' prompts and outputs. The default endpoint is an ipc
socket in the run directory, which is made 0700 before the socket is bound, and the socket file
0600 after; a non-loopback tcp endpoint is refused unless `allow_remote`, and across hosts CURVE
(`curve_secret_key`, `curve_authorized`: collector/curve.py) encrypts the stream and admits only
authorised subscribers. `close()` removes the ipc socket file.

Sampling is per request and deterministic: `should_capture(id)` hashes the id (blake2b, with
`sample_salt`) to a number in [0, 1) and compares it with `sample_fraction`, so a request is
either captured in every round or in none and the trainer gets contiguous sequences.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import zmq

from online_spec import advice
from online_spec.capture import CaptureRecord
from online_spec.config import check, doc
from online_spec.host_window import HostWindow

from collector.curve import check_curve_files, make_curve_server
from collector.endpoint import (check_endpoint, prepare_endpoint, remove_ipc_file, resolve_endpoint,
                                secure_ipc_file)
from collector.wire import FLOAT_DTYPES, EndOfRequest, WireError, encode_end, frames_nbytes
from collector.wire_round import encode_messages

log = logging.getLogger(__name__)
DEFER_FLUSH_S = 0.05  # kept items (`send_deferred`) no pump took for this long: the sender thread sends them

_STOP = object()  # sentinel that ends the sender thread


@dataclass
class PublisherConfig:
    endpoint: str = doc("ZMQ endpoint the publisher binds (ipc://PATH or tcp://HOST:PORT, PORT may be *); "
                        "empty = ipc://<run_dir>/capture.sock", "")
    run_dir: str = doc("directory of the default ipc socket, made 0700; empty = the server's run directory "
                       "(online-spec serve) or a per-user directory in the system temp directory", "")
    allow_remote: bool = doc("allow a non-loopback tcp endpoint (the stream carries users' prompts: add CURVE "
                             "keys, --capture-curve-*)", False)
    curve_secret_key: str = doc("CURVE: this publisher's certificate (zmq.auth NAME.key_secret); the stream is "
                                "encrypted and only subscribers in --capture-curve-authorized may connect; empty = off",
                                "")
    curve_authorized: str = doc("CURVE: directory of the public certificates (NAME.key) of allowed subscribers", "")
    sample_fraction: float = doc("fraction of requests captured, decided once per request by a hash of its id", 1.0)
    sample_salt: str = doc("salt of the sampling hash; change it to sample a different set of requests", "")
    queue_size: int = doc("records the in-process queue holds; submit drops (and counts) beyond it", 1024)
    send_hwm: int = doc("ZMQ send high-water mark in messages; sends beyond it are dropped and counted", 256)
    wire_dtype: str = doc("dtype of features/final_hidden on the wire: bfloat16, float16 or float32", "bfloat16")
    linger_ms: int = doc("how long close() lets ZMQ flush queued messages", 200)

    def __post_init__(self) -> None:
        check_endpoint(resolve_endpoint(self.endpoint, self.run_dir), "endpoint", allow_wildcard_port=True,
                       allow_remote=self.allow_remote, remote_flag="--capture-allow-remote")
        check_curve_files("curve_secret_key", self.curve_secret_key, self.curve_authorized, other_is_dir=True)
        check(0.0 <= self.sample_fraction <= 1.0, "sample_fraction", f"{self.sample_fraction} is not in [0, 1]")
        check(self.queue_size >= 1, "queue_size", f"{self.queue_size} < 1")
        check(self.send_hwm >= 1, "send_hwm", f"{self.send_hwm} < 1 (0 would mean unbounded)")
        check(self.wire_dtype in FLOAT_DTYPES, "wire_dtype", f"{self.wire_dtype!r} not in {sorted(FLOAT_DTYPES)}")
        check(self.linger_ms >= 0, "linger_ms", f"{self.linger_ms} < 0")


def sample_score(request_id: str, salt: str = "") -> float:
    """A deterministic number in [0, 1) for a request id (same in every process and run)."""
    digest = hashlib.blake2b(f"{salt}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class RequestSampling:
    """Per-request sampling (see the module docstring) for a publisher with `cfg` (a
    `PublisherConfig`) and the counters `requests_seen`, `requests_captured`."""

    cfg: PublisherConfig
    requests_seen: int
    requests_captured: int

    def should_capture(self, request_id: str) -> bool:
        """Whether to capture this request; call once when it is admitted."""
        self.requests_seen += 1
        take = self._sampled(request_id)
        self.requests_captured += take
        return take

    def _sampled(self, request_id: str) -> bool:
        f = self.cfg.sample_fraction
        return f >= 1.0 or (f > 0.0 and sample_score(request_id, self.cfg.sample_salt) < f)


class CapturePublisher(RequestSampling):
    """Binds the capture stream; `submit` never blocks (see the module docstring)."""

    def __init__(self, cfg: PublisherConfig):
        self.cfg = cfg
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, 1000)  # bounds the continuation frames (see _send)
        self._sock.setsockopt(zmq.LINGER, cfg.linger_ms)
        self._auth = None
        endpoint = resolve_endpoint(cfg.endpoint, cfg.run_dir)
        try:
            prepare_endpoint(endpoint, private=not cfg.endpoint)
            if cfg.curve_secret_key:
                self._auth = make_curve_server(self._ctx, self._sock, cfg.curve_secret_key, cfg.curve_authorized)
            self._sock.bind(endpoint)
            self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            secure_ipc_file(self.endpoint)
        except BaseException:
            self._sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise
        self._queue: queue.Queue = queue.Queue()  # items: a round's records, or an end marker
        self._records_in = 0  # records and end markers queued (caller's thread)
        self._records_out = 0  # ... and taken by the sender thread: the depth is the difference
        self._topics: set[bytes] = set()
        self._closed = False
        self._last_warn: dict[str, float] = {}
        # Each counter has one writer: the caller's thread or the sender thread (inline: the caller's).
        self.requests_seen = 0
        self.requests_captured = 0
        self.submitted = 0
        self.dropped_queue_full = 0
        self.dropped_closed = 0
        self.sent = 0  # records
        self.messages_sent = 0  # round messages (and record messages) that carried them
        self.dropped_hwm = 0
        self.dropped_no_subscriber = 0
        self.dropped_invalid = 0
        self.bytes_sent = 0
        self.end_markers_sent = 0
        self.end_markers_dropped = 0  # the sender thread's: invalid, or no subscriber / HWM
        self._ends_queue_full = 0  # the caller's: no room in the queue
        self._ends_queued = 0  # the caller's
        self._ends_done = 0  # the sender's: markers it has sent or dropped
        self.send_errors = 0
        self._window: HostWindow | None = None
        self._inline = False  # rounds encoded and sent on the caller's thread (`send_inline`)
        self._defer = False  # rounds kept for the caller's `pump` (`send_deferred`)
        self._deferred: collections.deque = collections.deque()
        self._pump_lock = threading.Lock()  # one pump at a time: items go out in order
        self._pumped_at = time.monotonic()
        self._sock_lock = threading.Lock()  # the socket is used by one thread at a time
        self._thread = threading.Thread(target=self._run, name="capture-publisher", daemon=True)
        self._thread.start()

    # ---- engine-facing API (caller's thread; nothing here waits) -----------------------------

    def submit(self, records: Sequence[CaptureRecord]) -> None:
        """Queue this round's records of sampled requests; drops (and counts) when full.
        Call from one thread (the engine's): the counters it updates have that single writer."""
        self.submitted += len(records)
        if self._closed:
            self.dropped_closed += len(records)
            return
        room = self.cfg.queue_size - self._depth()
        if room < len(records):
            self.dropped_queue_full += len(records) - max(room, 0)
            records = records[:max(room, 0)]
        if records:
            self._records_in += len(records)
            item = list(records) if isinstance(records, list) else records
            if self._defer:
                self._deferred.append(item)
                return
            if self._inline:
                self._records_out += len(records)
                self._deliver(item)
                return
            # another sequence goes as it is: a `CaptureRound` builds its records when the sender reads it
            self._queue.put_nowait(item)

    def end_request(self, request_id: str) -> None:
        """The request finished; queue an end-of-request marker if it was sampled."""
        if self._closed or not self._sampled(request_id):
            return
        if self._depth() >= self.cfg.queue_size:
            self._ends_queue_full += 1
            return
        self._ends_queued += 1
        self._records_in += 1
        if self._defer:
            self._deferred.append(EndOfRequest(request_id, time.time()))
            return
        if self._inline:
            self._records_out += 1
            self._deliver(EndOfRequest(request_id, time.time()))
            return
        self._queue.put_nowait(EndOfRequest(request_id, time.time()))

    def follow_window(self, window: HostWindow | None) -> None:
        """Start each queued round's work when the engine's thread next waits on the verify (at
        most the window's `wait_s` later), and send a round's further records only inside such
        waits (online_spec/host_window.py)."""
        self._window = window

    def send_inline(self, on: bool = True) -> None:
        """Encode and send each round on the caller's thread (the engine's), not the sender
        thread's. For an engine on a CPU whose cores its torch threads fill: there the sender
        thread's work preempts a torch worker mid-operation and the whole operation waits for it
        (the figures: docs/collector.md), while on the engine's thread it takes only its own time,
        between forwards. Call before the first `submit`; anything already queued is sent first."""
        if on and not self._inline:
            self.drain(10.0)
        self._inline = bool(on)

    def send_deferred(self, on: bool = True) -> None:
        """Keep each round and end marker until the caller's thread (the engine's) calls `pump`,
        which encodes and sends them there. An engine on a GPU pumps right after launching its
        verify forward, so the work runs on its own thread while the device verifies, and no
        second thread takes turns with it on the interpreter lock (on an H200 the sender thread
        cost the engine alone ~12 % of its tokens/s, ~0.8 ms a round at batch 1, against ~0.1 ms
        of encoding: docs/collector.md). What no pump takes for `DEFER_FLUSH_S` (an idle engine)
        the sender thread sends. Call before the first `submit`; anything queued is sent first."""
        if on and not self._defer:
            self.drain(10.0)
        if not on:
            self.pump()
        self._defer = bool(on)

    def pump(self) -> None:
        """Send every kept item now, in order, on the caller's thread (`send_deferred`)."""
        if not self._deferred:
            return
        with self._pump_lock:
            self._pumped_at = time.monotonic()
            while self._deferred:
                item = self._deferred.popleft()
                self._records_out += 1 if isinstance(item, EndOfRequest) else len(item)
                self._deliver(item)

    def stats(self) -> dict[str, Any]:
        names = ("requests_seen", "requests_captured", "submitted", "sent", "messages_sent", "dropped_queue_full",
                 "dropped_hwm",
                 "dropped_no_subscriber", "dropped_invalid", "dropped_closed", "bytes_sent",
                 "end_markers_sent", "end_markers_dropped", "send_errors")
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["end_markers_dropped"] += self._ends_queue_full
        out["queue_depth"] = self._depth()
        out["subscribed"] = bool(self._topics)
        out["endpoint"] = self.endpoint
        return out

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Wait until a subscriber is connected (start-up and tests; never called by the engine)."""
        deadline = time.monotonic() + timeout_s
        while not self._topics and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self._topics)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted record and queued end marker is sent or counted as dropped
        (benchmarks, tests); what `send_deferred` keeps is pumped first, on the caller's thread."""
        self.pump()
        deadline = time.monotonic() + timeout_s
        while not self._drained() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self._drained()

    def _drained(self) -> bool:
        return self._accounted() >= self.submitted and self._ends_done >= self._ends_queued

    def _depth(self) -> int:
        """Records and end markers queued and not yet taken by the sender thread."""
        return self._records_in - self._records_out

    def _accounted(self) -> int:
        return (self.sent + self.dropped_queue_full + self.dropped_hwm + self.dropped_no_subscriber
                + self.dropped_invalid + self.dropped_closed)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, stop the sender thread (sentinel) and release the socket."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)  # may wait for room: the sender thread is draining the queue
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("capture publisher: sender thread did not stop within %.1f s", timeout_s)
            return
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        remove_ipc_file(self.endpoint)

    def __enter__(self) -> "CapturePublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        idle_at = None  # the window's `opened` when a wait for one last timed out
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.1)
                except queue.Empty:  # idle: keep `subscribed` fresh for stats()
                    with self._sock_lock:
                        self._read_subscriptions()
                    if self._deferred and time.monotonic() - self._pumped_at > DEFER_FLUSH_S:
                        self.pump()  # kept items no engine round pumped (an idle engine)
                    continue
                if item is _STOP:
                    self.pump()
                    break
                window, in_window = self._window, False
                # an end marker (a few microseconds of work) never waits for a window; a round does,
                # unless the last wait found none and the engine has opened none since (idle: a backlog
                # then went out one `wait_s` an item, ~20 ms each). In a window the round's further
                # records wait for the engine's next ones too; no window within `wait_s`: none do
                if window is not None and not isinstance(item, EndOfRequest) \
                        and (idle_at is None or window.opened != idle_at):
                    in_window = window.wait(long=True)
                    idle_at = None if in_window else window.opened
                self._records_out += 1 if isinstance(item, EndOfRequest) else len(item)
                self._deliver(item, in_window)
        finally:
            with self._sock_lock:
                self._sock.close()

    def _deliver(self, item: list[CaptureRecord] | EndOfRequest, in_window: bool = False) -> None:
        """Send one item (the sender thread's, or the caller's when inline); never raises."""
        try:
            with self._sock_lock:
                self._send_item(item, in_window)
        except Exception:  # keep serving: one bad record must not stop the stream
            self.send_errors += 1
            log.exception("capture publisher: failed to send a message; continuing")
        finally:
            self._ends_done += isinstance(item, EndOfRequest)

    def _send_item(self, item: list[CaptureRecord] | EndOfRequest, in_window: bool = False) -> None:
        self._read_subscriptions()
        if isinstance(item, EndOfRequest):
            try:
                frames = encode_end(item.request_id, item.timestamp)
            except WireError as e:
                self.end_markers_dropped += 1
                self._warn("invalid", f"capture publisher: dropping an invalid end marker: {e}")
                return
            if self._topics and self._send(frames):
                self.end_markers_sent += 1
                self.bytes_sent += frames_nbytes(frames)
            else:
                self.end_markers_dropped += 1
            return
        if not self._topics:
            self.dropped_no_subscriber += len(item)
            return
        window = self._window if in_window else None
        messages, invalid = encode_messages(item, self.cfg.wire_dtype)
        for error in invalid:
            self.dropped_invalid += 1
            self._warn("invalid", f"capture publisher: dropping an invalid record: {error}")
        for i, (frames, n) in enumerate(messages):
            if i and window is not None and not window.is_open() and not window.wait(long=True):
                window = None  # the engine's thread runs again, and no long wait came: send the rest now
            if not self._send(frames):
                self.dropped_hwm += n
                advice.warn(log, "capture_hwm",
                            f"capture publisher: the trainer reads slower than serving captures, dropping records "
                            f"({self.dropped_hwm} so far, send HWM reached)",
                            cost="the trainer learns from fewer requests; serving is not slowed",
                            fix="nothing if it trains anyway; else capture less (--capture-sample-fraction) or give "
                                "the trainer more CPU/GPU")
            else:
                self.sent += n
                self.messages_sent += 1
                self.bytes_sent += frames_nbytes(frames)

    def _send(self, frames: list) -> bool:
        """False if ZMQ refused the message (HWM). Only the first frame can be refused: the HWM
        counts whole messages, so once it is accepted the rest follow without waiting."""
        try:
            self._sock.send(frames[0], zmq.NOBLOCK | (zmq.SNDMORE if len(frames) > 1 else 0), copy=False)
        except zmq.Again:
            return False
        for i, frame in enumerate(frames[1:], start=2):
            self._sock.send(frame, zmq.SNDMORE if i < len(frames) else 0, copy=False)
        return True

    def _read_subscriptions(self) -> None:
        # XPUB delivers b"\x01topic" / b"\x00topic" when the first subscriber of a topic joins /
        # the last one leaves (a killed subscriber counts as leaving).
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self._topics.add(msg[1:])
            elif msg[:1] == b"\x00":
                self._topics.discard(msg[1:])

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warn.get(kind, -1e9) >= 10.0:
            self._last_warn[kind] = now
            log.warning(message)
