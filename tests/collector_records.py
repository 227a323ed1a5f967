"""Realistic capture records for the collector tests: a prefill, then verify rounds.

Records of one request are adjacent as the engine makes them: each starts where the previous
one ended, and its first token is the previous record's last (bonus) token.
"""

from __future__ import annotations

import torch

from online_spec.capture import CaptureRecord


def request_records(request_id: str, num_rounds: int, hidden: int = 8, num_steps: int = 3,
                    prefill_rows: int = 4, seed: int = 0, tag: str = "chat",
                    dtype: torch.dtype = torch.float32) -> list[CaptureRecord]:
    """A prefill record and `num_rounds` verify records with pseudo-random accept lengths."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (prefill_rows + 1,), generator=g)
    records = [CaptureRecord(
        request_id=request_id, first_pos=0, tokens=tokens,
        features=torch.randn(prefill_rows, 3 * hidden, generator=g).to(dtype),
        final_hidden=torch.randn(prefill_rows, hidden, generator=g).to(dtype),
        is_prefill=True, tag=tag, timestamp=1000.0)]
    for r in range(num_rounds):
        prev = records[-1]
        accept = int(torch.randint(0, num_steps + 1, (1,), generator=g))
        new = torch.randint(0, 50_000, (accept + 1,), generator=g)
        drafts = torch.randint(0, 50_000, (num_steps,), generator=g)
        drafts[:accept] = new[:accept]  # accepted drafts are the committed tokens
        records.append(CaptureRecord(
            request_id=request_id, first_pos=prev.end_pos,
            tokens=torch.cat([prev.tokens[-1:], new]),
            features=torch.randn(accept + 1, 3 * hidden, generator=g).to(dtype),
            final_hidden=torch.randn(accept + 1, hidden, generator=g).to(dtype),
            draft_tokens=drafts, draft_probs=torch.rand(num_steps, generator=g),
            accept_len=accept, num_steps=num_steps, batch_size=4, draft_version=2,
            tag=tag, timestamp=1001.0 + r))
    return records


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor (so NaN payloads and -0.0 compare exactly)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def assert_records_equal(a: CaptureRecord, b: CaptureRecord, dtype: torch.dtype) -> None:
    """Field-by-field equality, hidden states compared bit for bit after conversion to `dtype`."""
    assert a.request_id == b.request_id and a.first_pos == b.first_pos
    assert torch.equal(a.tokens.to(torch.int64), b.tokens)
    for name in ("features", "final_hidden"):
        want = getattr(a, name).to(dtype)
        got = getattr(b, name)
        assert got.dtype == dtype
        assert torch.equal(bits(want), bits(got)), name
    assert torch.equal(a.draft_tokens.to(torch.int64), b.draft_tokens)
    assert torch.equal(a.draft_probs.to(torch.float32), b.draft_probs)
    for name in ("accept_len", "num_steps", "batch_size", "draft_version", "is_prefill", "timestamp", "tag"):
        assert getattr(a, name) == getattr(b, name), name


def corrupt(frames: list, frame: int, pos: int, value: int, cut: int | None) -> list[bytes]:
    """A copy of a message's frames with one byte of `frame` set to `value` (at `pos`, wrapped)
    and that frame cut to `cut` bytes (wrapped; None: not cut): the fuzz tests' damage."""
    out = [bytes(f) for f in frames]
    b = bytearray(out[frame])
    if b:
        b[pos % len(b)] = value
    if cut is not None:
        b = b[: cut % (len(b) + 1)]
    out[frame] = bytes(b)
    return out
