"""The trainer ranks' data path: rank 0 draws every rank's micro-batch and deals it, one step ahead.

`DataPipe` runs on a thread of its own per rank (`trainer/ranks.py` takes one item per step).
Rank 0 (the daemon's rank, which alone holds the replay buffer) draws the next step's N
micro-batches; rank r > 0 gets micro-batch r over a gloo group of the pipe's own, as a JSON header
(no pickle) and then the bytes of any rows that travel.

What travels: at start rank 0 tells each rank where its buffer is and leaves a probe file there;
a rank that reads the probe back (the same host, or a shared file system) is dealt its rows by
name (`ReplayBuffer.sample_train_refs`: generation, span, rows) and reads the stored rows itself
(`collector.replay_reader.GenerationReader`); only rows not yet written to disk travel, packed
(`trainer.batch.pack`: rows end to end, unpadded). A rank that cannot read the buffer is sent all
its rows packed. Named generations are held from eviction until the ranks have read them. The
receiver drops a read span that does not fit the target (as rank 0 drops a stored one); a
micro-batch left with no rows fails its step on that rank, which every rank then drops
(`Distiller.train_step`'s agreement). Batches are built padded on the host, into pinned memory when
the rank trains on a GPU (the copy to the device is asynchronous).

Each item carries its timings (`pipe` in the rank journal, ms): rank 0 draw / read (its own rows
that are only on disk) / pack / send (to every other rank) / own (its micro-batch padded); a
receiver recv (its wait for rank 0 included) / read / build.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import secrets
import threading
import time
from collections import deque
from pathlib import Path

import torch

from collector.replay_reader import GenerationReader, held_generations
from trainer.batch import PACKED, assemble, collate, pack

log = logging.getLogger(__name__)

PROBE = ".rank-probe"  # the file rank 0 leaves in its buffer's directory while the ranks look for it
# deals whose generations stay held after their send: rank 0's pipe runs at most 3 deals ahead of a
# receiver's reads (its own queue's item and the one in hand; its training up to a step ahead of the
# receiver's, whose pipe may still be reading the item after)
HOLD_DEALS = 4


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _send_json(obj: dict, dst: int, group) -> None:
    import torch.distributed as dist

    raw = torch.tensor(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst, group=group)
    dist.send(raw, dst, group=group)


def _recv_json(group) -> dict:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, 0, group=group)
    raw = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(raw, 0, group=group)
    return json.loads(bytes(raw.numpy()).decode())


def send_batch(packed: dict | None, spans: list, dst: int, group, end: bool = False,
               where: list | None = None) -> None:
    """Send rank `dst` its micro-batch: `packed` rows (`trainer.batch.pack`; None: none travel)
    named by `spans`, then the stored rows `where` names (read there); neither: skip this step;
    end: no more batches."""
    import torch.distributed as dist

    header = {"end": True} if end else {"skip": True} if packed is None and not where else {
        "spans": spans, "where": [list(map(int, w)) for w in where or ()],
        "tensors": [] if packed is None else [[n, str(packed[n].dtype).removeprefix("torch."), list(packed[n].shape)]
                                               for n in PACKED]}
    _send_json(header, dst, group)
    for n in PACKED if header.get("tensors") else ():
        dist.send(_bytes(packed[n]), dst, group=group)


def recv_packed(group) -> tuple[str, dict | None, list, list]:
    """("batch", the packed rows or None, their spans, the stored rows' locations), ("skip", None,
    [], []) or ("end", None, [], [])."""
    import torch.distributed as dist

    header = _recv_json(group)
    if header.get("end") or header.get("skip"):
        return ("end" if header.get("end") else "skip"), None, [], []
    out = {}
    for name, dtype, shape in header["tensors"]:
        dt = getattr(torch, dtype)
        buf = torch.empty(math.prod(shape) * torch.empty(0, dtype=dt).element_size(), dtype=torch.uint8)
        dist.recv(buf, 0, group=group)
        out[name] = buf.view(dt).reshape(shape)
    return "batch", out or None, header["spans"], header.get("where", [])


def span_names(spans: list) -> list:
    return [[s.request_id, int(s.first_pos), int(s.num_rows)] for s in spans]


class Unreadable:
    """A receiver's micro-batch none of whose rows could be used: its training step fails on this
    rank (reading `num_rows` raises inside `Distiller.train_step`), and every rank drops it."""

    def __init__(self, reason: str):
        self.reason = reason

    @property
    def num_rows(self) -> int:
        raise RuntimeError(self.reason)


class DataPipe:
    """The data path one step ahead of training, on its own thread per rank (see the module
    docstring). Rank 0 (`daemon` given): once the buffer holds `min_tokens`, draw the next
    step's N micro-batches of `per_rank` rows, deal micro-batch r to rank r (by name where rank r
    reads the buffer; `by_name` False: always as rows) and queue its own. Rank r > 0: receive,
    read, build, queue; `span_error(span)` says why a read span cannot be trained on (or None).
    Every rank takes one item per training step (`next`), so the ranks consume the same sequence.
    `close` ends it: rank 0 finishes the item in hand and sends each rank an end mark, the
    receivers drain until it, so no send is left waiting."""

    def __init__(self, rank: int, world: int, group, daemon, per_rank: int, min_tokens: int, idle_s: float,
                 pin: bool = False, by_name: bool = True, span_error=None):
        self.rank, self.world, self.group, self.daemon, self.pin = rank, world, group, daemon, pin
        self.per_rank, self.min_tokens, self.idle_s = per_rank, min_tokens, idle_s
        self.by_name, self.span_error = by_name, span_error
        self.reads_buffer: list[bool] = [True] + [False] * (world - 1)  # rank 0: which ranks read it (after start)
        self.dropped_spans = 0  # a receiver: read spans that did not fit the target
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._guarded, daemon=True, name=f"data-pipe-{rank}")
        self._thread.start()

    def next(self):
        """(batch, or None to skip, or `Unreadable`; its spans; on rank 0 every rank's spans; the
        item's timings in ms; the spans that went by name: rank 0 dealt, a receiver read); waits
        for the item."""
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

    def _probe_ranks(self) -> None:
        """Rank 0: tell every rank where the buffer is and learn which of them can read it."""
        import torch.distributed as dist

        root = Path(self.daemon.buffer.root).resolve()
        nonce = secrets.token_hex(16)
        probe = root / f"{PROBE}-{nonce}"
        for stale in root.glob(f"{PROBE}-*"):  # left by a rank 0 killed while it asked
            stale.unlink(missing_ok=True)
        if self.by_name:
            probe.write_text(nonce)
        try:
            for r in range(1, self.world):
                _send_json({"buffer": str(root) if self.by_name else None, "nonce": nonce}, r, self.group)
                answer = torch.zeros(1, dtype=torch.int64)
                dist.recv(answer, r, group=self.group)
                self.reads_buffer[r] = bool(answer)
        finally:
            probe.unlink(missing_ok=True)
        log.info("data pipe: ranks reading the buffer by name: %s",
                 [r for r in range(1, self.world) if self.reads_buffer[r]] or "none")

    def _answer_probe(self) -> GenerationReader | None:
        """Rank r > 0: read rank 0's probe; a reader of its buffer if it is visible here."""
        import torch.distributed as dist

        hello = _recv_json(self.group)
        reader = None
        if hello.get("buffer"):
            probe = Path(hello["buffer"]) / f"{PROBE}-{hello['nonce']}"
            try:
                if probe.read_text() == hello["nonce"]:
                    reader = GenerationReader(hello["buffer"])
            except OSError:
                pass
        dist.send(torch.tensor([int(reader is not None)], dtype=torch.int64), 0, group=self.group)
        return reader

    def _deal(self) -> None:
        d = self.daemon
        held: deque = deque()
        try:
            self._probe_ranks()
            while not self._stop.is_set():
                if d.buffer.num_tokens < self.min_tokens:
                    self._stop.wait(self.idle_s)
                    continue
                t0 = time.perf_counter()
                draws = [d.buffer.sample_train_refs(self.per_rank, hold=True) for _ in range(self.world)]
                held.append(held_generations(x for draw in draws for x in draw))
                while len(held) > HOLD_DEALS:  # every receiver is past those deals' reads (a skip included)
                    d.buffer.release(held.popleft())
                t1 = time.perf_counter()
                # rank 0's own rows, and those of a rank that does not read the buffer, in memory
                rows = [d._usable([x.span if x.span is not None else d.buffer.rows_at(x.where, copy=False)
                                   for x in draw])  # copied at once, into the batch or the packed rows
                        if r == 0 or not self.reads_buffer[r] else None for r, draw in enumerate(draws)]
                t2 = time.perf_counter()
                deal = []  # per rank > 0: (rows that travel, their names, the locations it reads)
                for r in range(1, self.world):
                    if rows[r] is not None:
                        deal.append((rows[r], []))
                    else:
                        deal.append((d._usable([x.span for x in draws[r] if x.where is None]),
                                     [x for x in draws[r] if x.where is not None]))
                if not rows[0] or not all(m or named for m, named in deal):
                    for r in range(1, self.world):
                        send_batch(None, [], r, self.group)
                    self._put((None, [], [], {}, 0))
                    continue
                packed = [pack(m) if m else None for m, _ in deal]
                t3 = time.perf_counter()
                dealt = [span_names(rows[0])]
                for r, ((m, named), p) in enumerate(zip(deal, packed), start=1):
                    dealt.append(span_names(m) + [list(x.name) for x in named])
                    send_batch(p, dealt[r], r, self.group, where=[x.where for x in named])
                t4 = time.perf_counter()
                batch = collate(rows[0], self.pin)
                t5 = time.perf_counter()
                timing = {"draw": t1 - t0, "read": t2 - t1, "pack": t3 - t2, "send": t4 - t3, "own": t5 - t4}
                self._put((batch, dealt[0], dealt, {k: round(1e3 * v, 2) for k, v in timing.items()},
                           sum(len(named) for _, named in deal)))
        finally:
            while held:
                d.buffer.release(held.popleft())
            for r in range(1, self.world):
                send_batch(None, [], r, self.group, end=True)

    def _receive(self) -> None:
        reader = self._answer_probe()
        while True:
            t0 = time.perf_counter()
            kind, packed, spans, where = recv_packed(self.group)
            if kind == "end":
                return
            if kind == "skip":
                self._put((None, [], [], {}, 0))
                continue
            t1 = time.perf_counter()
            named = self._read(reader, where)
            t2 = time.perf_counter()
            n_packed = 0 if packed is None else len(packed["lens"])
            spans = spans[:n_packed] + span_names(named)
            batch = assemble(packed, named, self.pin) if packed is not None or named else \
                Unreadable(f"rank {self.rank}: none of the {len(where)} stored spans dealt to it could be used")
            timing = {"recv": t1 - t0, "read": t2 - t1, "build": time.perf_counter() - t2}
            # once stopping: dropped, the receive goes on to the end mark
            self._put((batch, spans, [], {k: round(1e3 * v, 2) for k, v in timing.items()}, len(named)))

    def _read(self, reader: GenerationReader | None, where: list) -> list:
        """The stored spans `where` names, those that do not fit the target dropped (counted)."""
        if where and reader is None:
            raise RuntimeError("rank 0 dealt rows by name to a rank that cannot read its buffer")
        out = []
        for w in where:
            span = reader.rows(w, copy=False)  # copied at once into the batch
            problem = self.span_error(span) if self.span_error is not None else None
            if problem is None:
                out.append(span)
            else:
                self.dropped_spans += 1
                log.warning("rank %d: dropping a stored span that does not fit the target (%r: %s)",
                            self.rank, span.request_id[:80], problem)
        return out
