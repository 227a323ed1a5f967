"""The engine's whole part in capture: hand a round's committed rows over, doing no work on them.

In: the verify's features [B, T, 3H] and final hidden [B, T, H] and the flat indices (b * T + t)
of the rows the round's sampled requests committed. Out: what `online_spec.capture.CaptureRound`
takes (features, final hidden, row index, ready event). The records are built, gathered,
converted and encoded on the publisher's sender thread (collector/publisher.py), off the decode
path, which gathers the committed rows by the index.

- CPU: the tensors (fresh each round, never written again) go over as they are.
- CUDA: both tensors are copied whole, asynchronously, into a slot of pinned host memory the
  engine keeps (`HostRing`), and the slot's event is recorded after the copies on the engine's
  stream: three calls on the decode path, no allocation, no gather kernel, no index upload (a
  round's verify output is small: batch 16 x 8 rows of 4 x 576 bf16 values is 590 KB). The
  sender waits on that event (`CaptureRound.records`), never on the stream, and never touches a
  device tensor: its own device calls would queue behind the engine's next round and a
  synchronous copy would wait for all of it. The copies are queued before the next round's
  kernels, so a CUDA graph's output buffer may be rewritten by it.

A slot is reused once nothing holds a view of it any more (the publisher dropped the round it
went out with; the storage's use count says so, not a hand-back the sender could forget). With
every slot busy (a sender more than `max_slots` rounds behind) a round gets fresh pinned memory,
counted in `HostRing.unpooled`.

    feats, final, index, ready = self._stage_rows(feats, final, [0, 1, 4])   # in a round
"""

from __future__ import annotations

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
    every slot busy."""

    def __init__(self, *, pin: bool, max_slots: int = 32):
        if not (isinstance(max_slots, int) and max_slots >= 1):
            raise ValueError(f"max_slots: must be an int >= 1, got {max_slots!r}")
        self.pin, self.max_slots = pin, max_slots
        self.slots: list[tuple[torch.Tensor, torch.Tensor, object, int, int]] = []  # f, h, event, base counts
        self.next = 0
        self.allocated = self.unpooled = 0

    def _new_slot(self, rows: int, feats: torch.Tensor, final: torch.Tensor):
        f = torch.empty((rows, feats.shape[-1]), dtype=feats.dtype, pin_memory=self.pin)
        h = torch.empty((rows, final.shape[-1]), dtype=final.dtype, pin_memory=self.pin)
        event = torch.cuda.Event() if feats.is_cuda else None
        if _use_count is None:
            return f, h, event, 0, 0
        return f, h, event, _use_count(f.untyped_storage()._cdata), _use_count(h.untyped_storage()._cdata)

    def _pooled_slot(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        """A new slot of the ring for `n` rows: at least `MIN_ROWS`, rounded up to a power of two."""
        self.allocated += 1
        return self._new_slot(max(MIN_ROWS, 1 << (n - 1).bit_length()), feats, final)

    def _take(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        slots, count = self.slots, len(self.slots)
        for i in range(count):
            j = (self.next + i) % count
            slot = slots[j]
            f, h, _, fb, hb = slot
            if _in_use(f, fb) or _in_use(h, hb):
                continue
            if f.shape[0] < n or f.shape[1] != feats.shape[-1] or h.shape[1] != final.shape[-1] \
                    or f.dtype != feats.dtype or h.dtype != final.dtype:  # free but too small (or another model's)
                slot = slots[j] = self._pooled_slot(n, feats, final)
            self.next = j + 1
            return slot
        if _use_count is not None and count < self.max_slots:
            slots.append(self._pooled_slot(n, feats, final))
            self.next = 0
            return slots[-1]
        self.unpooled += 1
        return self._new_slot(n, feats, final)

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


class RowStaging:
    """The engine's side of capture staging (a mixin of the round kinds): `_stage_rows`."""

    def _stage_rows(self, features: torch.Tensor, final_hidden: torch.Tensor, index: list[int]):
        """-> (features, final_hidden, row_index, ready event or None) for a `CaptureRound`."""
        if features.device.type != "cuda":
            return features.reshape(-1, features.shape[-1]), final_hidden.reshape(-1, final_hidden.shape[-1]), \
                index, None
        ring = self.__dict__.get("_host_ring")
        if ring is None:
            ring = self._host_ring = HostRing(pin=True)
        f, h, ready = ring.stage(features, final_hidden)
        return f, h, index, ready
