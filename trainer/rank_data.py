"""The trainer ranks' data path: rank 0 draws every rank's micro-batch and deals it, one step ahead.

`DataPipe` runs on a thread of its own per rank (`trainer/ranks.py` takes one item per step).
Rank 0 (the daemon's rank, which alone holds the replay buffer) draws the next step's N
micro-batches; rank r > 0 receives micro-batch r. A micro-batch travels packed
(`trainer.batch.pack`: rows end to end, unpadded, about half the bytes of a padded batch) over a
gloo group of the pipe's own, as a JSON header (span names, tensor shapes; no pickle) and then
each tensor's bytes; the receiver pads it on the host (into pinned memory when it trains on a GPU,
so the copy to the device is asynchronous).

Each item carries its timings (`pipe` in the rank journal, ms): rank 0 draw / pack / send (to
every other rank) / own (its micro-batch padded); a receiver recv_build (its wait for rank 0
included).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time

import torch

from trainer.batch import PACKED, TrainBatch, collate, pack, unpack

log = logging.getLogger(__name__)

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def send_batch(packed: dict | None, spans: list, dst: int, group, end: bool = False) -> None:
    """Send rank `dst` its packed micro-batch (`trainer.batch.pack`; None: skip this step; end:
    no more batches); `spans` name its spans."""
    import torch.distributed as dist

    header = {"end": True} if end else {"skip": True} if packed is None else {
        "spans": spans, "tensors": [[n, str(packed[n].dtype).removeprefix("torch."), list(packed[n].shape)]
                                    for n in PACKED]}
    raw = torch.tensor(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst, group=group)
    dist.send(raw, dst, group=group)
    for n in PACKED if "tensors" in header else ():
        dist.send(_bytes(packed[n]), dst, group=group)


def recv_batch(group, pin: bool = False) -> tuple[str, TrainBatch | None, list]:
    """("batch", this rank's micro-batch, its spans), ("skip", None, []) or ("end", None, [])."""
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, 0, group=group)
    raw = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(raw, 0, group=group)
    header = json.loads(bytes(raw.numpy()).decode())
    if header.get("end") or header.get("skip"):
        return ("end" if header.get("end") else "skip"), None, []
    out = {}
    for name, dtype, shape in header["tensors"]:
        dt = getattr(torch, dtype)
        buf = torch.empty(math.prod(shape) * torch.empty(0, dtype=dt).element_size(), dtype=torch.uint8)
        dist.recv(buf, 0, group=group)
        out[name] = buf.view(dt).reshape(shape)
    return "batch", unpack(out, pin), header["spans"]


def span_names(spans: list) -> list:
    return [[s.request_id, int(s.first_pos), int(s.num_rows)] for s in spans]


class DataPipe:
    """The data path one step ahead of training, on its own thread per rank (see the module
    docstring). Rank 0 (`daemon` given): once the buffer holds `min_tokens`, draw the next
    step's N micro-batches of `per_rank` rows (reading only the drawn rows' bytes from the
    buffer's shards), send micro-batch r to rank r and queue its own. Rank r > 0: receive,
    build, queue. Every rank takes one item per training step (`next`), so the ranks consume
    the same sequence. `close` ends it: rank 0 finishes the item in hand and sends each rank an
    end mark, the receivers drain until it, so no send is left waiting."""

    def __init__(self, rank: int, world: int, group, daemon, per_rank: int, min_tokens: int, idle_s: float,
                 pin: bool = False):
        self.rank, self.world, self.group, self.daemon, self.pin = rank, world, group, daemon, pin
        self.per_rank, self.min_tokens, self.idle_s = per_rank, min_tokens, idle_s
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._guarded, daemon=True, name=f"data-pipe-{rank}")
        self._thread.start()

    def next(self):
        """(batch or None to skip, its spans, on rank 0 every rank's spans, the item's timings in
        ms); waits for the item."""
        while True:
            try:
                return self._q.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the data pipe of rank {self.rank} stopped: {self.error!r}")

    def close(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _guarded(self) -> None:
        try:
            self._deal() if self.daemon is not None else self._receive()
        except BaseException as e:  # noqa: BLE001 - reported by next()
            self.error = e
            log.exception("data pipe of rank %d failed", self.rank)

    def _deal(self) -> None:
        d = self.daemon
        try:
            while not self._stop.is_set():
                if d.buffer.num_tokens < self.min_tokens:
                    self._stop.wait(self.idle_s)
                    continue
                t0 = time.perf_counter()
                draws = [d._usable(d.buffer.sample_train(self.per_rank)) for _ in range(self.world)]
                if not all(draws):
                    for r in range(1, self.world):
                        send_batch(None, [], r, self.group)
                    self._put((None, [], [], {}))
                    continue
                dealt = [span_names(x) for x in draws]
                t1 = time.perf_counter()
                packed = [None] + [pack(x) for x in draws[1:]]
                t2 = time.perf_counter()
                for r in range(1, self.world):
                    send_batch(packed[r], dealt[r], r, self.group)
                t3 = time.perf_counter()
                batch = collate(draws[0], self.pin)
                t4 = time.perf_counter()
                timing = {"draw": t1 - t0, "pack": t2 - t1, "send": t3 - t2, "own": t4 - t3}
                self._put((batch, dealt[0], dealt, {k: round(1e3 * v, 2) for k, v in timing.items()}))
        finally:
            for r in range(1, self.world):
                send_batch(None, [], r, self.group, end=True)

    def _receive(self) -> None:
        while True:
            t0 = time.perf_counter()
            kind, batch, spans = recv_batch(self.group, self.pin)
            if kind == "end":
                return
            timing = {"recv_build": round(1e3 * (time.perf_counter() - t0), 2)}
            # once stopping: dropped, the receive goes on to the end mark
            self._put((batch, spans, [], timing))
