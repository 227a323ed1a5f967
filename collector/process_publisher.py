"""`ProcessPublisher`: the capture publisher with its encoding and sending in a process of its own.

`CapturePublisher`'s engine-facing API (should_capture, submit, end_request, stats, drain,
close), for `serve --capture-sender process`. A sender thread in the serving process takes the
interpreter lock from the engine's host loop whenever it runs (on an H200 the capture cost the
engine alone 10-12 % of its tokens/s with the work on the sender thread or on the engine's own
thread: docs/collector.md). Here a child process (`python -m collector.process_publisher`) owns
the stream: it binds the XPUB socket, encodes each round (collector/wire_round.py) and sends it,
with a `CapturePublisher` of its own. The serving process does per round only what cannot move:

- the engine stages the round's rows into a slot of this publisher's `ring` (`SharedRing`,
  collector/shared_ring.py: /dev/shm, page-locked on CUDA): two async copies and an event;
- `submit` marks the slot busy and queues the round's description (slot, rows, drafts: a few
  hundred bytes) in order behind earlier items; items whose copies have landed (their event
  says so: a query, never a wait) go to the child over a local PUSH socket, at this or a later
  submit, or from a flusher thread when the engine is idle (`FLUSH_S`);
- end markers go in the same order; built records (prefill chunks) go whole, copied to the host.

Never blocks: a full PUSH queue (the child `queue_size` items behind) or no free slot drops the
round, counted in `dropped_queue_full`; the child's own counters come back through the shared
control file. A child that dies is started again (at most every `RESTART_S`); what it had not
sent is counted in `dropped_sender_died`, and its busy slots are freed.

    pub = ProcessPublisher(PublisherConfig(sample_fraction=0.5))   # waits for the child to bind
    engine.publisher = pub                                           # stages rounds into pub.ring
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import torch
import zmq

from online_spec import advice
from online_spec.capture import CaptureRecord, CaptureRound, RoundRow

from collector.publisher import CapturePublisher, PublisherConfig, RequestSampling
from collector.shared_ring import COUNTERS, PUB_COUNTERS, SharedRing, SlotReader
from collector.wire import EndOfRequest

log = logging.getLogger(__name__)
FLUSH_S = 0.02  # an idle engine's items (copies landed, no submit since) go out after this long
RESTART_S = 5.0  # at most one restart of a dead sender process this often
START_TIMEOUT_S = 120.0


class ProcessPublisher(RequestSampling):
    """See the module docstring. `max_slots`: shared slots (rounds the child may be behind)."""

    def __init__(self, cfg: PublisherConfig, *, max_slots: int = 32, pin: bool | None = None):
        self.cfg = cfg
        self.ring = SharedRing(pin=torch.cuda.is_available() if pin is None else pin, max_slots=max_slots)
        self._dir = tempfile.mkdtemp(prefix="online-spec-sender-")  # 0700: the items carry users' text
        self._items_ep = f"ipc://{self._dir}/items.sock"
        self._zctx = zmq.Context()
        self._push = None
        self._proc = None
        self._lock = threading.Lock()  # the push socket and the pending queue: engine thread and flusher
        self._pending: collections.deque = collections.deque()  # (event or None, payload, records, slot or None)
        self._closed = False
        self.requests_seen = self.requests_captured = self.submitted = 0
        self.dropped_queue_full = self.dropped_closed = self.dropped_sender_died = self.dropped_invalid = 0
        self.sender_restarts = 0
        self._ends_dropped = 0
        self._pushed = self._pushed_records = self._pushed_ends = 0  # handed to the current child
        self._lost = collections.Counter()  # counters of children that died, carried into stats()
        self._last_submit = time.monotonic()
        try:
            self.endpoint = self._start()
        except BaseException:
            self._teardown()
            raise
        self._flusher = threading.Thread(target=self._flush_loop, name="capture-process-flusher", daemon=True)
        self._flusher.start()

    # ---- engine-facing API (caller's thread; nothing here waits) -----------------------------

    def submit(self, records: Sequence[CaptureRecord]) -> None:
        n = len(records)
        self.submitted += n
        if self._closed:
            self.dropped_closed += n
            return
        if not n:
            return
        self._last_submit = time.monotonic()
        if isinstance(records, CaptureRound):
            try:
                item = self._round_item(records)
            except Exception:  # keep serving: a round this publisher cannot describe is dropped, counted
                self.dropped_invalid += n
                log.exception("capture (sender process): dropping a round it cannot hand over")
                return
            if item is None:
                self.dropped_queue_full += n
                advice.warn(log, "capture_slots",
                            "capture (sender process): every shared slot is busy, dropping rounds",
                            cost="the trainer learns from fewer rounds; serving is not slowed",
                            fix="capture less (--capture-sample-fraction) or give the host more CPU")
                return
        else:
            item = (None, ("records", [_on_host(r) for r in records]), n, None)
        with self._lock:
            self._pending.append(item)
            self._flush()

    def end_request(self, request_id: str) -> None:
        if self._closed or not self._sampled(request_id):
            return
        with self._lock:
            self._pending.append((None, ("end", request_id, time.time()), 0, None))
            self._flush()

    def stats(self) -> dict[str, Any]:
        c = self._child_counters()
        out: dict[str, Any] = {
            "requests_seen": self.requests_seen, "requests_captured": self.requests_captured,
            "submitted": self.submitted, "sent": c["sent"], "messages_sent": c["messages_sent"],
            "dropped_queue_full": self.dropped_queue_full + c["dropped_queue_full"],
            "dropped_hwm": c["dropped_hwm"], "dropped_no_subscriber": c["dropped_no_subscriber"],
            "dropped_invalid": c["dropped_invalid"] + self.dropped_invalid, "dropped_closed": self.dropped_closed,
            "dropped_sender_died": self.dropped_sender_died, "bytes_sent": c["bytes_sent"],
            "end_markers_sent": c["end_markers_sent"], "end_markers_dropped": c["end_markers_dropped"] + self._ends_dropped,
            "send_errors": c["send_errors"], "queue_depth": len(self._pending) + self._in_flight(),
            "subscribed": bool(self.ring.control.counter("subscribed")), "endpoint": self.endpoint,
            "sender": "process", "sender_alive": self._proc is not None and self._proc.poll() is None,
            "sender_restarts": self.sender_restarts}
        return out

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.ring.control.counter("subscribed") and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self.ring.control.counter("subscribed"))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted item is sent or counted as dropped (benchmarks, tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                self._flush(wait=True)
                if not self._pending and self._in_flight() <= 0:
                    return True
            time.sleep(0.001)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is pending, stop the child (it sends what it holds first) and remove the slots."""
        if self._closed:
            return
        self.drain(timeout_s)
        self._closed = True
        self._flusher.join(1.0)
        self._stop_child(timeout_s)
        self._teardown()

    def __enter__(self) -> "ProcessPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------

    def _round_item(self, rnd: CaptureRound):
        """(event, payload, records, slot) for a round staged in the ring; None when it is not
        in a shared slot (every slot was busy: the scratch slot)."""
        j = self.ring.last
        if j is None or j >= len(self.ring.slots) or rnd.features.data_ptr() != self.ring.slots[j][0].data_ptr():
            return None
        first = None if rnd.first_tokens is None else rnd.first_tokens.tolist()
        drafts = None if rnd.drafts is None else rnd.drafts.cpu().numpy()
        probs = None if rnd.draft_probs is None else rnd.draft_probs.cpu().numpy()
        self.ring.mark(j)
        payload = ("round", self.ring.describe(j), int(rnd.features.shape[0]), [tuple(r) for r in rnd.rows],
                   rnd.row_index, first, drafts, probs, rnd.batch_size, rnd.draft_version, rnd.is_prefill,
                   rnd.timestamp)
        return rnd.ready, payload, len(rnd), j

    def _flush(self, wait: bool = False) -> None:
        """Push the pending items whose copies have landed, in order (caller holds the lock); none
        while a child is being started again."""
        pending = self._pending
        while pending and self._push is not None:
            ready, payload, n, slot = pending[0]
            if ready is not None:
                if wait:
                    ready.synchronize()
                elif not ready.query():
                    return
            pending.popleft()
            try:
                self._push.send(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
                self._pushed += 1
                self._pushed_records += n
                self._pushed_ends += payload[0] == "end"
            except zmq.Again:  # the child is queue_size items behind (or gone): drop, never wait
                if slot is not None:
                    self.ring.free(slot)
                if payload[0] == "end":
                    self._ends_dropped += 1
                else:
                    self.dropped_queue_full += n

    def _in_flight(self) -> int:
        return self._pushed - self.ring.control.counter("items_done")

    def _child_counters(self) -> dict[str, int]:
        return {name: self.ring.control.counter(name) + self._lost[name] for name in COUNTERS}

    def _flush_loop(self) -> None:
        last_restart = 0.0
        while not self._closed:
            time.sleep(FLUSH_S)
            if self._pending and time.monotonic() - self._last_submit >= FLUSH_S:
                with self._lock:
                    if not self._closed:
                        self._flush()
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._closed \
                    and time.monotonic() - last_restart >= RESTART_S:
                last_restart = time.monotonic()
                log.error("capture sender process exited (code %s); starting it again", proc.returncode)
                try:
                    self._restart()
                except Exception:  # keep serving: the next tick tries again
                    log.exception("capture sender process: restart failed")

    def _restart(self) -> None:
        """A new child after one died: what the dead one held is dropped (counted), its slots freed.
        The start (seconds) runs outside the lock, so `submit` never waits for it: meanwhile items
        stay pending, each round holding its slot, and with every slot held rounds are dropped."""
        with self._lock:
            c = self.ring.control
            self.dropped_sender_died += max(self._pushed_records - c.counter("records_done"), 0)
            self._ends_dropped += max(self._pushed_ends - c.counter("end_markers_sent")
                                      - c.counter("end_markers_dropped"), 0)
            for name in PUB_COUNTERS:
                self._lost[name] += c.counter(name)
            self.ring.control.counters[:] = 0
            for j in range(len(self.ring.slots)):
                if not any(slot == j for _, _, _, slot in self._pending):
                    self.ring.free(j)
            if self._push is not None:
                self._push.close(0)  # messages queued for the dead child must not reach the new one
            self._push = None
            self._pushed = self._pushed_records = self._pushed_ends = 0
            self.sender_restarts += 1
        self._start()

    def _start(self) -> str:
        """Start the child (`python -m collector.process_publisher`: a fresh interpreter that imports
        nothing of the serving process's main module), wait until it has bound both sockets, and
        connect the push socket. Returns the stream's endpoint."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen([sys.executable, "-m", "collector.process_publisher"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=False)
        self._proc = proc
        try:
            proc.stdin.write(pickle.dumps((self.cfg, self.ring.control_path, self.ring.max_slots, self._items_ep,
                                           os.getpid())))
            proc.stdin.close()
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        except OSError as e:
            line = f"error {e}"
        if not line.startswith("ready "):
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            why = line[len("error "):] if line.startswith("error ") else \
                f"exited with code {proc.returncode} before it was ready (its stderr above says why)" if line == "" \
                and proc.returncode is not None else f"did not start within {START_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"capture sender process: {why}")
        push = self._zctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, self.cfg.queue_size)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._items_ep)
        self._push = push
        return line[len("ready "):]

    def _stop_child(self, timeout_s: float) -> None:
        if self._push is not None:
            try:
                self._push.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
            except zmq.Again:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("capture sender process did not stop within %.1f s; killing it", timeout_s)
                self._proc.kill()
                self._proc.wait(5)

    def _teardown(self) -> None:
        if self._push is not None:
            self._push.close(0)
        self._zctx.term()
        self.ring.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _on_host(rec: CaptureRecord) -> CaptureRecord:
    """A built record with every tensor on the host (the child has no device)."""
    moved = {f.name: getattr(rec, f.name).cpu() for f in dataclasses.fields(rec)
             if isinstance(getattr(rec, f.name), torch.Tensor) and getattr(rec, f.name).device.type != "cpu"}
    return dataclasses.replace(rec, **moved) if moved else rec


def sender_main(cfg: PublisherConfig, control_path: str, max_slots: int, items_ep: str, parent_pid: int,
                say=print) -> None:
    """The child: a `CapturePublisher` that encodes and sends on this process's main thread, fed
    by the serving process's items; its counters go to the shared control file after each item.
    `say` reports "ready ENDPOINT" or "error WHY" to the parent, once."""
    torch.set_num_threads(1)
    try:
        pub = CapturePublisher(cfg)
        pub.send_inline(True)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        say(f"error {type(e).__name__}: {e}")
        return
    reader = SlotReader(control_path, max_slots)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        pull.bind(items_ep)
    except zmq.ZMQError as e:
        say(f"error cannot bind {items_ep}: {e}")
        pub.close()
        return
    say(f"ready {pub.endpoint}")
    done = records = 0
    try:
        while True:
            if not pull.poll(100):
                if os.getppid() != parent_pid:  # the serving process is gone
                    break
                reader.set("subscribed", int(bool(pub._topics)))
                continue
            msg = pickle.loads(pull.recv())
            if msg[0] == "stop":
                break
            try:
                _handle(pub, reader, msg)
            except Exception:  # noqa: BLE001 - one bad item must not stop the stream
                pub.send_errors += 1
                log.exception("capture sender process: failed on an item; continuing")
            finally:
                if msg[0] == "round":
                    reader.free(msg[1][0])
            done += 1
            records += len(msg[3]) if msg[0] == "round" else len(msg[1]) if msg[0] == "records" else 0
            for name in PUB_COUNTERS:
                reader.set(name, getattr(pub, name))
            reader.set("subscribed", int(bool(pub._topics)))
            reader.set("records_done", records)
            reader.set("items_done", done)  # last: the parent reads the others as of this count
    finally:
        pull.close(0)
        ctx.term()
        pub.close()


def _handle(pub: CapturePublisher, reader: SlotReader, msg: tuple) -> None:
    kind = msg[0]
    if kind == "end":
        pub.end_request(msg[1])
        return
    if kind == "records":
        pub.submit(msg[1])
        return
    _, desc, n, rows, row_index, first, drafts, probs, batch, version, prefill, ts = msg
    f, h = reader.views(desc, n)
    rnd = CaptureRound([RoundRow(*r) for r in rows], f, h, row_index=row_index,
                       first_tokens=None if first is None else torch.tensor(first),
                       drafts=None if drafts is None else torch.from_numpy(drafts),
                       draft_probs=None if probs is None else torch.from_numpy(probs),
                       batch_size=batch, draft_version=version, is_prefill=prefill, timestamp=ts)
    pub.submit(rnd)  # inline: encoded and sent before this returns, so the slot can be freed


def open_publisher(cfg: PublisherConfig, sender: str = "thread") -> CapturePublisher | ProcessPublisher:
    """The capture publisher for an engine's `capture_sender`: 'process' sends from a child
    process (`ProcessPublisher`); 'thread' and 'engine' from this one (`CapturePublisher`)."""
    return ProcessPublisher(cfg) if sender == "process" else CapturePublisher(cfg)


def _child() -> None:
    """`python -m collector.process_publisher`: the arguments come pickled on stdin (from
    `ProcessPublisher._start` only), the handshake line goes to stdout."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s capture-sender %(levelname)s %(message)s")
    args = pickle.load(sys.stdin.buffer)

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        os.dup2(2, 1)  # nothing more on the pipe, which nobody reads: it would fill and stall this process

    sender_main(*args, say=say)


if __name__ == "__main__":
    _child()
