"""`HostRing`: host slots, reused round after round, that a round's verify outputs are copied into.

On CUDA the engine copies a round's whole verify outputs (features [B*T, 3H], final hidden
[B*T, H]) asynchronously into a slot and records the slot's event after the copies: no
allocation, gather kernel or index upload on the decode path. A slot is reused once nothing
holds it any more. In `HostRing` that is once nothing holds a view of it (the storage's use
count says so, not a hand-back a reader could forget); a subclass may say otherwise
(`_is_free`: collector/shared_ring.py's slots live in shared memory another process reads, and
that process marks them free). With every slot busy a round gets fresh memory (`_overflow`),
counted in `unpooled`.

    ring = HostRing(pin=True)
    f, h, event = ring.stage(features, final_hidden)   # views of a slot; event after the copies
"""

from __future__ import annotations

from typing import Protocol

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # None: no reuse, a fresh slot a round
MIN_ROWS = 32  # a slot's smallest capacity in rows; larger rounds grow it to the next power of two


def _in_use(t: torch.Tensor, base: int) -> bool:
    return _use_count(t.untyped_storage()._cdata) > base


class HostRing:
    """Host slots (pinned where `pin`) for whole verify outputs, reused round after round.

    `stage(features, final)` -> (host features [N, 3H], host final hidden [N, H], event or None):
    views of a free slot (N = B * T rows) holding copies queued on the current stream; the event
    (CUDA) completes with them. Counters: `allocated` slots made, `unpooled` rounds that found
    every slot busy. `last` is the index of the slot the last `stage` used (None: fresh memory)."""

    def __init__(self, *, pin: bool, max_slots: int = 32):
        if not (isinstance(max_slots, int) and max_slots >= 1):
            raise ValueError(f"max_slots: must be an int >= 1, got {max_slots!r}")
        self.pin, self.max_slots = pin, max_slots
        self.slots: list[tuple[torch.Tensor, torch.Tensor, object, int, int]] = []  # f, h, event, base counts
        self.next = 0
        self.allocated = self.unpooled = 0
        self.last: int | None = None

    def _new_slot(self, rows: int, feats: torch.Tensor, final: torch.Tensor, index: int | None = None):
        """A slot of `rows` rows for these outputs: (f, h, event, f's base use count, h's). `index`:
        the ring position it fills (None: memory outside the ring)."""
        f = torch.empty((rows, feats.shape[-1]), dtype=feats.dtype, pin_memory=self.pin)
        h = torch.empty((rows, final.shape[-1]), dtype=final.dtype, pin_memory=self.pin)
        # blocking: a sender waiting on it sleeps, where a default event's wait spins in the driver
        # beside the engine thread's own waits (about 2 % of an H200's rounds, docs/results.md)
        event = torch.cuda.Event(blocking=True) if feats.is_cuda else None
        if _use_count is None:
            return f, h, event, 0, 0
        return f, h, event, _use_count(f.untyped_storage()._cdata), _use_count(h.untyped_storage()._cdata)

    def _reusable(self) -> bool:
        """Whether a slot can ever be found free (without the use count it cannot)."""
        return _use_count is not None

    def _is_free(self, j: int) -> bool:
        f, h, _, fb, hb = self.slots[j]
        return not (_in_use(f, fb) or _in_use(h, hb))

    def _overflow(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        """The slot of a round that found every slot busy: fresh memory."""
        self.unpooled += 1
        return self._new_slot(n, feats, final)

    def _pooled_slot(self, n: int, feats: torch.Tensor, final: torch.Tensor, index: int):
        """A new slot of the ring for `n` rows: at least `MIN_ROWS`, rounded up to a power of two."""
        self.allocated += 1
        return self._new_slot(max(MIN_ROWS, 1 << (n - 1).bit_length()), feats, final, index)

    def _take(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        slots, count = self.slots, len(self.slots)
        for i in range(count):
            j = (self.next + i) % count
            if not self._is_free(j):
                continue
            f, h = slots[j][:2]
            if f.shape[0] < n or f.shape[1] != feats.shape[-1] or h.shape[1] != final.shape[-1] \
                    or f.dtype != feats.dtype or h.dtype != final.dtype:  # free but too small (or another model's)
                slots[j] = self._pooled_slot(n, feats, final, j)
            self.next, self.last = j + 1, j
            return slots[j]
        if self._reusable() and count < self.max_slots:
            slots.append(self._pooled_slot(n, feats, final, count))
            self.next, self.last = 0, count
            return slots[-1]
        self.last = None
        return self._overflow(n, feats, final)

    def stage(self, features: torch.Tensor, final_hidden: torch.Tensor):
        features = features.reshape(-1, features.shape[-1])
        final_hidden = final_hidden.reshape(-1, final_hidden.shape[-1])
        n = features.shape[0]
        f, h, event, _, _ = self._take(n, features, final_hidden)
        f, h = f[:n], h[:n]
        f.copy_(features, non_blocking=True)
        h.copy_(final_hidden, non_blocking=True)
        if event is not None:  # on the stream the copies ran on: the device's, not the current device's
            event.record(torch.cuda.current_stream(features.device))
        return f, h, event


class SharesRing(Protocol):
    """A capture sink whose reader can only read its own slots (another process): the engine
    stages every round's rows into `ring` (serving/capture_rows.py), on a CPU too."""

    ring: HostRing
