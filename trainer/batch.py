"""`TrainBatch`: captured rows of several requests, padded into one tensor batch.

In: spans (`collector.span.CaptureSpan`) or capture records (`online_spec.capture.CaptureRecord`)
— anything with `first_pos`, `tokens [n+1]`, `features [n,3H]`, `final_hidden [n,H]`. Out:

    tokens        int64 [B, T+1]  token at position first_pos[b] + j (0 beyond a row's end)
    features      [B, T, 3H]      target features of row j (storage dtype, e.g. bf16)
    final_hidden  [B, T, H]       post-norm final hidden of row j
    row_mask      bool  [B, T]    row j exists
    rejected      bool  [B, T+1]  token j is the target's correction of a draft the live head got
                                  wrong (a span's `accepted[j-1] == 0`, a verify record's row
                                  accept_len); False for teacher-forced data
    first_pos     int64 [B]       absolute position of row 0 (rope)

Rows of one request sit in one batch row, so the head's attention sees the request's earlier rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from online_spec.capture import CaptureRecord


@dataclass
class TrainBatch:
    tokens: torch.Tensor
    features: torch.Tensor
    final_hidden: torch.Tensor
    row_mask: torch.Tensor
    rejected: torch.Tensor
    first_pos: torch.Tensor

    @property
    def num_rows(self) -> int:
        """Real rows (the tokens a step trains on)."""
        return int(self.row_mask.sum())

    def to(self, device) -> "TrainBatch":
        """On `device`; from pinned memory the copies are asynchronous (stream-ordered)."""
        return TrainBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def rejected_tokens(item) -> torch.Tensor:
    """bool [n+1]: which of the item's tokens corrected a rejected draft (token j + 1 where row
    j's draft was rejected: a span carries `accepted` per row, a record derives it)."""
    accepted = item.row_drafts()[0] if isinstance(item, CaptureRecord) else item.accepted
    out = torch.zeros(int(item.features.shape[0]) + 1, dtype=torch.bool)
    out[1:] = accepted.to(torch.int64) == 0
    return out


def collate(items: Sequence, pin: bool = False) -> TrainBatch:
    """Pad spans/records into a `TrainBatch` (T = the longest item's rows); `pin`: in pinned host
    memory, so `TrainBatch.to` a GPU copies asynchronously."""
    if not items:
        raise ValueError("collate needs at least one span")
    return _padded([_row(it) for it in items], [int(it.first_pos) for it in items], pin)


def _row(item) -> tuple:
    return item.tokens.long(), item.features, item.final_hidden, rejected_tokens(item)


def _padded(rows: list[tuple], first_pos: list[int], pin: bool) -> TrainBatch:
    """rows: (tokens [n+1], features [n,3H], final_hidden [n,H], rejected [n+1]) per batch row.
    The rows are copied in and only the padding is zeroed (not the whole batch first, then the rows)."""
    B, T = len(rows), max(int(r[1].shape[0]) for r in rows)
    f0, h0 = rows[0][1], rows[0][2]
    tokens = torch.empty(B, T + 1, dtype=torch.long, pin_memory=pin)
    features = torch.empty(B, T, f0.shape[1], dtype=f0.dtype, pin_memory=pin)
    final = torch.empty(B, T, h0.shape[1], dtype=h0.dtype, pin_memory=pin)
    rejected = torch.empty(B, T + 1, dtype=torch.bool, pin_memory=pin)
    lens = torch.tensor([int(r[1].shape[0]) for r in rows])
    for b, (tok, feat, fin, rej) in enumerate(rows):
        n = int(feat.shape[0])
        tokens[b, :n + 1] = tok
        tokens[b, n + 1:] = 0
        rejected[b, :n + 1] = rej
        rejected[b, n + 1:] = False
        features[b, :n] = feat
        features[b, n:] = 0
        final[b, :n] = fin
        final[b, n:] = 0
    row_mask = torch.arange(T)[None, :] < lens[:, None]
    if pin:
        row_mask = row_mask.pin_memory()
    first = torch.tensor(first_pos, dtype=torch.long)
    return TrainBatch(tokens, features, final, row_mask, rejected, first.pin_memory() if pin else first)


PACKED = ("lens", "first_pos", "tokens", "features", "final_hidden", "rejected")


def pack(items: Sequence) -> dict[str, torch.Tensor]:
    """Spans/records as unpadded tensors (their rows end to end, with their lengths), what travels
    between trainer ranks: about half the bytes of a padded batch of cut windows. `unpack(pack(x))`
    equals `collate(x)`."""
    if not items:
        raise ValueError("pack needs at least one span")
    return {"lens": torch.tensor([int(it.features.shape[0]) for it in items], dtype=torch.long),
            "first_pos": torch.tensor([int(it.first_pos) for it in items], dtype=torch.long),
            "tokens": torch.cat([it.tokens.long() for it in items]),
            "features": torch.cat([it.features for it in items]),
            "final_hidden": torch.cat([it.final_hidden for it in items]),
            "rejected": torch.cat([rejected_tokens(it) for it in items])}


def unpack(p: dict[str, torch.Tensor], pin: bool = False) -> TrainBatch:
    """The padded `TrainBatch` of `pack`'s tensors (`pin`: as in `collate`)."""
    return assemble(p, (), pin)


def assemble(p: dict[str, torch.Tensor] | None, items: Sequence, pin: bool = False) -> TrainBatch:
    """One padded `TrainBatch` of `pack`'s tensors (None: none) and then `items` (spans or
    records): `assemble(pack(a), b)` equals `collate(a + b)`."""
    rows, first_pos, r0, t0 = [], [], 0, 0
    if p is not None:
        first_pos = p["first_pos"].tolist()
        for n in p["lens"].tolist():
            rows.append((p["tokens"][t0:t0 + n + 1], p["features"][r0:r0 + n], p["final_hidden"][r0:r0 + n],
                         p["rejected"][t0:t0 + n + 1]))
            r0, t0 = r0 + n, t0 + n + 1
    rows += [_row(it) for it in items]
    if not rows:
        raise ValueError("assemble needs at least one span")
    return _padded(rows, first_pos + [int(it.first_pos) for it in items], pin)
