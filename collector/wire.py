"""Wire format of the capture stream: `CaptureRecord` <-> a list of ZMQ frames (contract 2).

One message is a multipart ZMQ message. Frame 0 is a header; the tensors follow as raw
little-endian buffers, one frame each, so the sender can hand torch memory to ZMQ without
copying it again (`send(..., copy=False)`) and nothing is pickled.

    frame 0  header  = struct "<4sHBBI" (magic b"OSCP", version u16, kind u8, nframes u8,
                       meta_len u32) followed by meta_len bytes of UTF-8 JSON metadata
                       (scalars only: ids, positions, shapes, dtypes; never lists of floats)
    frame 1  tokens        [num_rows + 1]      int32 (int64 if an id does not fit)
    frame 2  features      [num_rows, 3H]      bfloat16 | float16 | float32 (the wire dtype)
    frame 3  final_hidden  [num_rows, H]       same dtype as features
    frame 4  draft_tokens  [num_steps]         int32
    frame 5  draft_probs   [num_steps]         float32

A second kind of message, `EndOfRequest` (kind 2, the header frame alone), tells the
subscriber that a request finished so it can hand the request's span over at once.

`decode` accepts a message only if every frame has exactly the length its header implies and
the values make sense (finite features and hidden states, probabilities in [0, 1], non-negative
token ids, `CaptureRecord.validate()` passes); anything else raises `WireError` naming the
problem. NaN or inf features are a data problem (an fp16 overflow, a broken kernel): they are
rejected here, at the border, rather than poisoning the trainer. `encode` runs the same checks,
metadata bounds included (`META_BOUNDS`, id and tag lengths), so a sender never ships what a
receiver would refuse: what it cannot encode it refuses with a WireError (the publisher counts it
as `dropped_invalid`). A round trip is bit-exact for the wire
dtype: `decode(encode(r, d)).features == r.features.to(d)` bit for bit.

    frames = encode(record, wire_dtype="bfloat16")
    record2 = decode(frames)          # CaptureRecord | EndOfRequest, or raises WireError
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from online_spec.capture import MAX_ID_CHARS, MAX_POSITION, MAX_VERSION, CaptureRecord, row_shapes

MAGIC = b"OSCP"
VERSION = 1
KIND_RECORD = 1
KIND_END = 2
HEADER = struct.Struct("<4sHBBI")  # magic, version, kind, nframes, meta_len
RECORD_FRAMES = 6
MAX_META_BYTES = 1 << 16
# The integer metadata of a record and its range; both ends check it (encode and decode).
META_BOUNDS: dict[str, tuple[int, int]] = {
    "num_rows": (1, 1 << 24), "hidden_size": (1, 1 << 20), "num_steps": (0, 1 << 16),
    "first_pos": (0, MAX_POSITION), "batch_size": (1, 1 << 20), "draft_version": (0, MAX_VERSION),
}

# Names used in the metadata and in configs -> torch dtypes.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
TOKEN_DTYPES: dict[str, torch.dtype] = {"int32": torch.int32, "int64": torch.int64}
_INT32_MAX = 2**31 - 1


class WireError(ValueError):
    """A message that is not a valid capture-stream message; the text says why."""


@dataclass(frozen=True)
class EndOfRequest:
    """Control message: the publisher will send no more records of `request_id`."""

    request_id: str
    timestamp: float


def encode(record: CaptureRecord, wire_dtype: str = "bfloat16") -> list[memoryview]:
    """Frames of one record. Always copies the tensors into fresh contiguous CPU buffers (the
    caller may hold views of larger engine tensors), converting features and final_hidden to
    `wire_dtype`. Raises WireError if the record is inconsistent or has non-finite values."""
    frames = encode_round([record], wire_dtype)[0]
    if isinstance(frames, WireError):
        raise frames
    return frames


def encode_round(records: Sequence[CaptureRecord], wire_dtype: str = "bfloat16") -> list[list[memoryview] | WireError]:
    """`encode` for the records of one engine round: per record its frames, or the WireError
    that refuses it (the others are still encoded)."""
    return [p if isinstance(p, WireError) else [_header(KIND_RECORD, RECORD_FRAMES, p[0])] + _views(p[1])
            for p in encode_parts(records, wire_dtype)]


def _views(arrays: Sequence[np.ndarray]) -> list[memoryview]:
    """Frames over the bytes of contiguous arrays (no copy)."""
    return [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]


def encode_parts(records: Sequence[CaptureRecord], wire_dtype: str = "bfloat16") -> list[tuple | WireError]:
    """What `encode_round` frames, per record: (its metadata, its five wire arrays: tokens,
    features and final_hidden as rows of bytes, draft_tokens, draft_probs), checked, or the
    WireError that refuses it (`collector.wire_round` packs a round's parts into one message).

    The round's features and final hidden states are copied (dtype converted, off the device)
    in one tensor operation each, and each record's frames are numpy views of those copies.
    Per-record torch calls cost little time but each releases and retakes the GIL: a sender
    thread making ~60 of them per record stalled a launch-bound engine thread at every hand-over
    (a host loop of 5 ms rounds lost 14 % with one record a round and 53 % with 16; an H100
    engine at batch 1 / 16 lost 18 % / 31 %, scripts/gpu_round_costs.py --capture-overhead)."""
    if wire_dtype not in FLOAT_DTYPES:
        raise WireError(f"wire dtype {wire_dtype!r} is not one of {sorted(FLOAT_DTYPES)}")
    out: list[tuple | WireError | None] = [None] * len(records)
    good = []
    for i, record in enumerate(records):
        try:
            record.validate()
            good.append(i)
        except ValueError as e:
            out[i] = WireError(f"invalid record {record.request_id!r}: {e}")
    if not good:
        return out
    fdt = FLOAT_DTYPES[wire_dtype]
    try:  # one copy per kind for the whole round; widths differ only in a hand-made mix
        feats = _fresh_rows([records[i].features for i in good], fdt)
        final = _fresh_rows([records[i].final_hidden for i in good], fdt)
    except RuntimeError:
        for i in good:
            out[i] = encode_parts([records[i]], wire_dtype)[0]
        return out
    feat_bad, final_bad = _nonfinite_rows(feats), _nonfinite_rows(final)
    feat_bytes, final_bytes = _row_bytes(feats), _row_bytes(final)
    small = _round_small_arrays([records[i] for i in good])  # None: some record needs its own checks
    row = 0
    for j, i in enumerate(good):
        record = records[i]
        n, row = record.num_rows, row + record.num_rows
        rows = slice(row - n, row)
        try:
            for name, bad in (("features", feat_bad), ("final_hidden", final_bad)):
                if bad[rows].any():
                    raise WireError(f"record {record.request_id!r}: {name} has non-finite values (NaN/inf)")
            arrays = _small_arrays(record) if small is None else small[j]
            out[i] = _parts(record, wire_dtype, feat_bytes[rows], final_bytes[rows], *arrays)
        except WireError as e:
            out[i] = e
    return out


def meta_error(meta: dict) -> str | None:
    """What is out of range in a record's metadata (`META_BOUNDS`, a finite timestamp), if anything."""
    for key, (lo, hi) in META_BOUNDS.items():
        if not lo <= meta[key] <= hi:
            return f"{key}={meta[key]} is outside {lo}..{hi}"
    return None if math.isfinite(meta["timestamp"]) else "timestamp is not finite"


def _small_arrays(record: CaptureRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """A record's token ids, draft tokens and draft probabilities in their wire dtypes, checked."""
    tokens = _small(record.tokens, np.int64)
    token_dtype = "int32" if tokens.size == 0 or int(tokens.max()) <= _INT32_MAX else "int64"
    draft_tokens = _small(record.draft_tokens, np.int32)
    draft_probs = _small(record.draft_probs, np.float32)
    error = _small_error(tokens, draft_tokens, draft_probs)
    if error:
        raise WireError(f"record {record.request_id!r}: {error}")
    return tokens.astype(np.int32 if token_dtype == "int32" else np.int64), draft_tokens, draft_probs, token_dtype


def _round_small_arrays(records: Sequence[CaptureRecord]) -> list[tuple] | None:
    """`_small_arrays` of every record at once: one conversion and one check per kind for the
    round, each record's arrays slices of those. None when the round's check fails (a record
    is invalid, or an id needs int64): then each record takes `_small_arrays` and its own error."""
    if len(records) == 1:
        return None
    tokens = _small(_cat([r.tokens.reshape(-1) for r in records]), np.int64)
    draft_tokens = _small(_cat([r.draft_tokens.reshape(-1) for r in records]), np.int32)
    draft_probs = _small(_cat([r.draft_probs.reshape(-1) for r in records]), np.float32)
    if _small_error(tokens, draft_tokens, draft_probs) or (tokens.size and tokens.max() > _INT32_MAX):
        return None
    tokens = tokens.astype(np.int32)
    out, t, d = [], 0, 0
    for r in records:
        nt, nd = r.tokens.numel(), r.num_steps  # validated: num_rows + 1 tokens
        out.append((tokens[t:t + nt], draft_tokens[d:d + nd], draft_probs[d:d + nd], "int32"))
        t, d = t + nt, d + nd
    return out


def _small_error(tokens: np.ndarray, draft_tokens: np.ndarray, draft_probs: np.ndarray) -> str | None:
    """What is wrong with a record's (or a round's) token ids and draft probabilities, if anything."""
    if draft_probs.size and not ((draft_probs >= 0) & (draft_probs <= 1)).all():  # NaN fails both comparisons
        return "draft_probs not finite or outside [0, 1]"
    for name, t in (("tokens", tokens), ("draft_tokens", draft_tokens)):
        if t.size and t.min() < 0:
            return f"{name} has a negative token id"
    return None


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().cpu() for p in parts])


def _parts(record: CaptureRecord, wire_dtype: str, features: np.ndarray, final_hidden: np.ndarray,
           tokens: np.ndarray, draft_tokens: np.ndarray, draft_probs: np.ndarray, token_dtype: str) -> tuple:
    """One record's (metadata, wire arrays) from its arrays, already converted and checked."""
    _check_ids(record.request_id, record.tag)
    meta = {
        "request_id": record.request_id,
        "first_pos": int(record.first_pos),
        "num_rows": record.num_rows,
        "hidden_size": record.hidden_size,
        "num_steps": int(record.num_steps),
        "accept_len": int(record.accept_len),
        "batch_size": int(record.batch_size),
        "draft_version": int(record.draft_version),
        "is_prefill": bool(record.is_prefill),
        "timestamp": float(record.timestamp),
        "tag": record.tag,
        "float_dtype": wire_dtype,
        "token_dtype": token_dtype,
    }
    error = meta_error(meta)
    if error:
        raise WireError(f"record {record.request_id[:80]!r}: {error}")
    return meta, (tokens, features, final_hidden, draft_tokens, draft_probs)


def encode_end(request_id: str, timestamp: float) -> list[memoryview]:
    """The single-frame end-of-request control message (WireError for an id decode would refuse)."""
    _check_ids(request_id, "")
    return [_header(KIND_END, 1, {"request_id": request_id, "timestamp": float(timestamp)})]


def _check_ids(request_id: object, tag: object) -> None:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_CHARS:
        raise WireError(f"request id {str(request_id)[:80]!r} is not a non-empty string of at most "
                        f"{MAX_ID_CHARS} characters")
    if not isinstance(tag, str) or len(tag) > MAX_ID_CHARS:
        raise WireError(f"tag {str(tag)[:80]!r} of request {request_id[:80]!r} is not a string of at most "
                        f"{MAX_ID_CHARS} characters")


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total payload bytes of a message (what goes on the wire, ZMQ framing aside)."""
    return sum(_view(f).nbytes for f in frames)


def decode(frames: Sequence[Any]) -> CaptureRecord | EndOfRequest:
    """Parse one message (bytes, memoryviews or zmq.Frames). Raises WireError naming the
    problem for truncated frames, wrong magic or version, inconsistent shapes, garbage bytes
    or non-finite values. Returned tensors own their memory (they are copies)."""
    bufs = [_view(f) for f in frames]
    if not bufs:
        raise WireError("empty message")
    kind, meta = _parse_header(bufs[0], len(bufs))
    return decode_parsed(bufs, kind, meta)


def decode_parsed(bufs: list[memoryview], kind: int, meta: dict) -> CaptureRecord | EndOfRequest:
    """`decode` of a message whose header `_parse_header` read (kind 3: `collector.wire_round`)."""
    if kind == KIND_END:
        return EndOfRequest(_get_str(meta, "request_id", nonempty=True), _get_float(meta, "timestamp"))
    if kind != KIND_RECORD:
        raise WireError(f"unknown message kind {kind}")
    if len(bufs) != RECORD_FRAMES:
        raise WireError(f"a record message has {RECORD_FRAMES} frames, got {len(bufs)}")
    rows = _get_int(meta, "num_rows", *META_BOUNDS["num_rows"])
    hidden = _get_int(meta, "hidden_size", *META_BOUNDS["hidden_size"])
    steps = _get_int(meta, "num_steps", *META_BOUNDS["num_steps"])
    fdt, tdt = _dtypes(meta)
    shapes = row_shapes(rows, hidden)
    # numpy end to end, one torch tensor per array at the end: each torch call costs the
    # trainer's reader microseconds of dispatch, and on 2 cores its time is the engine's
    parts = {
        "tokens": _array(bufs[1], tdt, shapes["tokens"], "tokens"),
        "features": _array(bufs[2], fdt, shapes["features"], "features"),
        "final_hidden": _array(bufs[3], fdt, shapes["final_hidden"], "final_hidden"),
        "draft_tokens": _array(bufs[4], torch.int32, (steps,), "draft_tokens"),
        "draft_probs": _array(bufs[5], torch.float32, (steps,), "draft_probs"),
    }
    request_id = _get_str(meta, "request_id", nonempty=True)
    _check_arrays(parts, fdt, f"record {request_id!r}")
    record = CaptureRecord(
        request_id=request_id,
        first_pos=_get_int(meta, "first_pos", *META_BOUNDS["first_pos"]),
        tokens=torch.from_numpy(parts["tokens"].astype(np.int64)),
        features=_floats(parts["features"], fdt),
        final_hidden=_floats(parts["final_hidden"], fdt),
        draft_tokens=torch.from_numpy(parts["draft_tokens"].astype(np.int64)),
        draft_probs=torch.from_numpy(parts["draft_probs"]),
        accept_len=_get_int(meta, "accept_len", 0, steps),
        num_steps=steps,
        batch_size=_get_int(meta, "batch_size", *META_BOUNDS["batch_size"]),
        draft_version=_get_int(meta, "draft_version", *META_BOUNDS["draft_version"]),
        is_prefill=_get_bool(meta, "is_prefill"),
        timestamp=_get_float(meta, "timestamp"),
        tag=_get_str(meta, "tag"),
    )
    try:
        record.validate()
    except ValueError as e:
        raise WireError(f"inconsistent record {request_id!r}: {e}") from None
    return record


# ---------------------------------------------------------------------------------------------
# helpers


def _fresh(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # One copy that also converts dtype, gathers a strided view and leaves the device.
    return torch.empty(tuple(t.shape), dtype=dtype).copy_(t.detach())


def _fresh_rows(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rows of every part, concatenated into one fresh contiguous CPU tensor of `dtype`."""
    if len(parts) == 1:
        return _fresh(parts[0], dtype)
    t = torch.cat([p.detach() for p in parts])  # a fresh contiguous tensor already
    return t if t.device.type == "cpu" and t.dtype == dtype else _fresh(t, dtype)


def _row_bytes(t: torch.Tensor) -> np.ndarray:
    """[rows, width] tensor -> [rows, width * itemsize] uint8 array over the same memory."""
    return t.view(torch.uint8).numpy().reshape(t.shape[0], -1)


def _nonfinite_rows(t: torch.Tensor) -> np.ndarray:
    """Per row: does it hold a NaN or inf? On the bit pattern for 16-bit floats (numpy has no
    bf16, and torch.isfinite on bf16 is several times slower here)."""
    mask = _EXPONENT_MASK.get(t.dtype)
    if mask is None:
        return ~np.isfinite(t.numpy()).all(axis=1)
    bits = t.view(torch.int16).numpy()
    return ((bits & mask) == mask).any(axis=1)


def _small(t: torch.Tensor, dtype) -> np.ndarray:
    """A small tensor (token ids, draft probabilities) as a fresh contiguous numpy array."""
    if t.device.type != "cpu" or t.requires_grad or t.dtype == torch.bfloat16:  # (numpy has no bf16)
        t = t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()
    return np.array(t.numpy(), dtype=dtype)


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise WireError(f"frame of type {type(frame).__name__} is not a byte buffer: {e}") from None


def _header(kind: int, nframes: int, meta: dict) -> memoryview:
    try:
        blob = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, UnicodeEncodeError) as e:  # NaN, a lone surrogate in an id
        raise WireError(f"metadata cannot be encoded: {e}") from None
    if len(blob) > MAX_META_BYTES:
        raise WireError(f"metadata of {len(blob)} bytes exceeds {MAX_META_BYTES}")
    return memoryview(HEADER.pack(MAGIC, VERSION, kind, nframes, len(blob)) + blob)


def _reject_constant(name: str) -> Any:
    raise WireError(f"metadata contains the non-JSON constant {name}")


def _parse_header(head: memoryview, nframes_got: int) -> tuple[int, dict]:
    if head.nbytes < HEADER.size:
        raise WireError(f"header frame has {head.nbytes} bytes, shorter than the {HEADER.size}-byte fixed header")
    magic, version, kind, nframes, meta_len = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"wire version {version}, this reader understands version {VERSION}")
    if nframes != nframes_got:
        raise WireError(f"header announces {nframes} frames, message has {nframes_got}")
    if meta_len > MAX_META_BYTES:
        raise WireError(f"metadata length {meta_len} exceeds {MAX_META_BYTES}")
    if head.nbytes != HEADER.size + meta_len:
        raise WireError(f"header frame has {head.nbytes} bytes, expected {HEADER.size + meta_len} (truncated or padded)")
    try:
        meta = json.loads(bytes(head[HEADER.size:]).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError(f"metadata is not UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        raise WireError(f"metadata is a JSON {type(meta).__name__}, expected an object")
    return kind, meta


def _dtypes(meta: dict) -> tuple[torch.dtype, torch.dtype]:
    """The message's (float, token) torch dtypes from its metadata's names."""
    fname, tname = _get_str(meta, "float_dtype"), _get_str(meta, "token_dtype")
    if fname not in FLOAT_DTYPES:
        raise WireError(f"unknown float_dtype {fname!r}")
    if tname not in TOKEN_DTYPES:
        raise WireError(f"unknown token_dtype {tname!r}")
    return FLOAT_DTYPES[fname], TOKEN_DTYPES[tname]


def _get(meta: dict, key: str) -> Any:
    if key not in meta:
        raise WireError(f"metadata lacks {key!r}")
    return meta[key]


def _get_int(meta: dict, key: str, lo: int, hi: int) -> int:
    v = _get(meta, key)
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"metadata {key}={v!r} is not an integer in {lo}..{hi}")
    return v


def _get_float(meta: dict, key: str) -> float:
    v = _get(meta, key)
    if type(v) not in (int, float) or not math.isfinite(v):
        raise WireError(f"metadata {key}={v!r} is not a finite number")
    return float(v)


def _get_bool(meta: dict, key: str) -> bool:
    v = _get(meta, key)
    if type(v) is not bool:
        raise WireError(f"metadata {key}={v!r} is not a boolean")
    return v


def _get_str(meta: dict, key: str, nonempty: bool = False) -> str:
    v = _get(meta, key)
    if not isinstance(v, str) or len(v) > MAX_ID_CHARS or (nonempty and not v):
        raise WireError(f"metadata {key}={str(v)[:80]!r} is not a{' non-empty' if nonempty else ''} string "
                        f"of at most {MAX_ID_CHARS} characters")
    return v


# torch dtype -> the numpy dtype its bytes are read as (numpy has no bfloat16: its bits, int16)
_NUMPY_OF = {torch.bfloat16: np.int16, torch.float16: np.float16, torch.float32: np.float32,
             torch.int32: np.int32, torch.int64: np.int64}
# Exponent bits of the 16-bit floats: all ones means inf or NaN.
_EXPONENT_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _array(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The frame as a fresh writable numpy array of `dtype`'s bytes (`_NUMPY_OF`), owning its
    memory (a copy: ZMQ's buffer is not ours)."""
    expected = math.prod(shape) * dtype.itemsize
    if buf.nbytes != expected:
        raise WireError(f"{name} frame has {buf.nbytes} bytes, expected {expected} for shape {list(shape)} {dtype}")
    return np.frombuffer(buf, dtype=_NUMPY_OF[dtype]).reshape(shape).copy()


def _floats(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`_array`'s floats as the torch tensor of `dtype` (bfloat16: a view of its int16 bits)."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _check_arrays(parts: dict[str, np.ndarray], fdt: torch.dtype, what: str) -> None:
    """Raise WireError for non-finite hidden states (16-bit floats: on their exponent bits),
    draft probabilities outside [0, 1] or a negative token id, on `_array`'s numpy arrays."""
    mask = _EXPONENT_MASK.get(fdt)
    for name in ("features", "final_hidden"):
        a = parts[name]
        if mask is not None:  # on the bit pattern: several times faster than isfinite on 16-bit floats
            bits = a.view(np.int16)
            bad = bool(((bits & mask) == mask).any())
        else:
            bad = not np.isfinite(a).all()
        if bad:
            raise WireError(f"{what}: {name} has non-finite values (NaN/inf)")
    p = parts["draft_probs"]
    if p.size and not ((p >= 0) & (p <= 1)).all():  # NaN fails both comparisons
        raise WireError(f"{what}: draft_probs not finite or outside [0, 1]")
    for name in ("tokens", "draft_tokens"):
        t = parts[name]
        if t.size and t.min() < 0:
            raise WireError(f"{what}: {name} has a negative token id")

