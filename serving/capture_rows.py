"""The engine's whole part in capture: hand a round's committed rows over, doing no work on them.

In: the verify's features [B, T, 3H] and final hidden [B, T, H] (fresh tensors of this round,
never written again) and the flat indices (b * T + t) of the rows the round's sampled requests
committed. Out: what `online_spec.capture.CaptureRound` takes (features, final hidden, row
index, ready event). The records are built, gathered, converted and encoded on the publisher's
sender thread (collector/publisher.py), off the decode path.

- CPU: the tensors go over as they are, with the index; the sender gathers the rows.
- CUDA: the rows are gathered on the device (one index_select per tensor) into fresh tensors,
  copied asynchronously into pinned host memory, and an event is recorded after the copies on
  the engine's stream. The sender waits on that event (`CaptureRound.records`), never on the
  stream, and never touches a device tensor: its own device calls would queue behind the
  engine's next round and a synchronous copy would wait for all of it.

    feats, final, index, ready = stage_rows(feats, final, [0, 1, 4])
"""

from __future__ import annotations

import torch


def stage_rows(features: torch.Tensor, final_hidden: torch.Tensor, index: list[int]):
    """-> (features, final_hidden, row_index or None, ready event or None) for a `CaptureRound`."""
    features = features.reshape(-1, features.shape[-1])
    final_hidden = final_hidden.reshape(-1, final_hidden.shape[-1])
    if features.device.type != "cuda":
        return features, final_hidden, index, None
    # non_blocking from pageable memory: staged by the driver, no wait on the stream
    idx = torch.tensor(index, dtype=torch.long).to(features.device, non_blocking=True)
    out = []
    for t in (features, final_hidden):
        rows = t.index_select(0, idx)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        out.append(host)
    ready = torch.cuda.Event()
    ready.record()
    return out[0], out[1], None, ready
