"""The capture-off-by-parts arms of `bench collector`'s engine-overhead run (`serving_sink`).

Each stands in for the capture publisher (the engine-facing calls: should_capture, submit,
end_request, drain, stats) with part of its work, so the run splits capture's cost:
  null    the engine stages each round's rows as for capture and the round is dropped
  wait    as null, and a thread of the serving process waits on each round's ready event
  encode  as wait, and that thread builds and encodes each round's messages (no socket, at once)
  busy    nothing captured; one busy-spinning process beside the engine

    tps, counts = split_arm("wait", run_decode, mp.get_context("spawn"))
"""

from __future__ import annotations

import queue
import threading
import time

from collector.wire import frames_nbytes
from collector.wire_round import encode_messages

SINKS = ("publisher", "null", "wait", "encode", "busy")  # `serving_sink`: 'publisher' is the figure itself


class NullSink:
    """`serving_sink` 'null': takes every request, lets the engine stage each round's rows as for
    capture (the CaptureRound, and on CUDA the copies into the host ring), and drops the round."""

    def __init__(self):
        self.rounds = self.records = 0

    def should_capture(self, request_id: str) -> bool:
        return True

    def submit(self, records) -> None:
        self.rounds += 1
        self.records += len(records)

    def end_request(self, request_id: str) -> None:
        pass

    def drain(self, timeout_s: float) -> bool:
        return True

    def stats(self) -> dict[str, int]:
        return {"rounds": self.rounds, "records": self.records}


class ThreadSink(NullSink):
    """`serving_sink` 'wait' / 'encode': as 'null', and a thread of the serving process takes each
    round as the publisher's sender thread does: waits on its ready event ('wait'), or builds and
    encodes its messages ('encode', which waits first as `CaptureRound` does); nothing is sent."""

    def __init__(self, encode: bool, wire_dtype: str):
        super().__init__()
        self.encode, self.wire_dtype = encode, wire_dtype
        self.done = self.bytes = self.errors = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-sink", daemon=True)
        self._thread.start()

    def submit(self, records) -> None:
        super().submit(records)
        self._queue.put(records)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self.encode:
                    messages, _ = encode_messages(item, self.wire_dtype)
                    self.bytes += sum(frames_nbytes(frames) for frames, _ in messages)
                elif getattr(item, "ready", None) is not None:
                    item.ready.synchronize()
            except Exception:  # counted, and the arm goes on: a bench figure, never a hang in drain
                self.errors += 1
            self.done += 1

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.done < self.rounds and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.done >= self.rounds

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "taken": self.done, "bytes_encoded": self.bytes, "errors": self.errors}


def _spin(conn) -> None:
    """Child process: busy on one core (pure Python, as a sender or reader would be) until told."""
    conn.send("ready")
    while not conn.poll():
        for _ in range(10_000):
            pass


def split_arm(sink: str, run_decode, ctx, wire_dtype: str = "bfloat16") -> tuple[float, dict]:
    """The 'on' arm of `serving_sink` 'null', 'wait', 'encode' or 'busy' (see the field): (tokens/s, its counts)."""
    if sink == "null":
        null = NullSink()
        return run_decode(null), null.stats()
    if sink in ("wait", "encode"):
        taker = ThreadSink(sink == "encode", wire_dtype)
        try:
            return run_decode(taker), taker.stats()
        finally:
            taker.close()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_spin, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("bench busy neighbour did not start")
        return run_decode(None), {"neighbours": 1}
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
