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
counted in `HostRing.unpooled` (online_spec/host_ring.py).

A sink with slots of its own (`SharesRing`: the sender process's shared-memory slots,
collector/process_publisher.py) gets every round staged there, on a CPU too: its reader is
another process, which can read nothing else.

    feats, final, index, ready = self._stage_rows(feats, final, [0, 1, 4])   # in a round
"""

from __future__ import annotations

import torch

from online_spec.host_ring import HostRing


class RowStaging:
    """The engine's side of capture staging (a mixin of the round kinds): `_stage_rows`."""

    def _stage_rows(self, features: torch.Tensor, final_hidden: torch.Tensor, index: list[int]):
        """-> (features, final_hidden, row_index, ready event or None) for a `CaptureRound`."""
        ring = getattr(self.__dict__.get("_publisher"), "ring", None)  # a sink's own slots (`SharesRing`)
        if ring is None:
            if features.device.type != "cuda":
                return features.reshape(-1, features.shape[-1]), final_hidden.reshape(-1, final_hidden.shape[-1]), \
                    index, None
            ring = self.__dict__.get("_host_ring")
            if ring is None:
                ring = self._host_ring = HostRing(pin=True)
        f, h, ready = ring.stage(features, final_hidden)
        return f, h, index, ready
