"""The round message of the capture stream: an engine round's records in one ZMQ message (kind 3).

A record message (`collector.wire`, kind 1) carries one request's rows of one round in six
frames. A batch of B requests made B of them a round, and the trainer's reader paid each
message's fixed work (a ZMQ message, a JSON header, five arrays turned into tensors, their
checks) B times: on a 2-core CPU, its share of a core at batch 16 took ~5 % of the engine's
tokens a second (docs/collector.md). The round message carries up to `MAX_ROUND_RECORDS`
records in the same six frames, each record's rows following the previous record's:

    frame 0  header        the fixed struct of `collector.wire` (kind 3), then JSON metadata:
                           {"float_dtype", "token_dtype", "hidden_size",
                            "records": [{request_id, first_pos, num_rows, num_steps, accept_len,
                                         batch_size, draft_version, is_prefill, timestamp, tag},
                                        ...]}
    frame 1  tokens        [sum(num_rows + 1)]
    frame 2  features      [sum(num_rows), 3H]
    frame 3  final_hidden  [sum(num_rows), H]
    frame 4  draft_tokens  [sum(num_steps)]
    frame 5  draft_probs   [sum(num_steps)]

`decode_message` runs a record message's checks (exact frame lengths, metadata types and
bounds, finite hidden states, probabilities in [0, 1], non-negative ids, a verify record's rows
= accept_len + 1) once over the round's arrays, and refuses a message that fails any of them
whole: one bad record loses its message's records, where a record message lost only itself.
The sender never ships what would be refused: `encode_messages` packs only the records
`collector.wire.encode_parts` accepts and returns the others' errors. A round trip is bit-exact
for the wire dtype, as a record message's; each decoded record's tensors are views of its
message's (one copy of the frames per message). An engine's `CaptureRound` is encoded straight
from its tensors and per-record Python values (`_from_round`: the same bytes, no record built,
its checks once a round); a round failing any check takes the per-record path.

    messages, errors = encode_messages(records, "bfloat16")   # [(frames, records in them)], [WireError]
    decode_message(frames)   # [CaptureRecord] (kind 3), CaptureRecord (1) or EndOfRequest (2)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from online_spec.capture import FEATURE_LAYERS, CaptureRecord, CaptureRound

from collector.wire import (_INT32_MAX, FLOAT_DTYPES, KIND_RECORD, META_BOUNDS, RECORD_FRAMES,
                            EndOfRequest, WireError, _array, _check_arrays, _check_ids, _dtypes, _floats, _fresh, _get,
                            _get_bool, _get_float, _get_int, _get_str, _header, _nonfinite_rows, _parse_header,
                            _row_bytes, _small, _small_error, _view, _views, decode_parsed, encode_parts, meta_error)

KIND_ROUND = 3
MAX_ROUND_RECORDS = 64  # records a message carries at most (a larger round goes out in several)
_SHARED = ("float_dtype", "token_dtype", "hidden_size")  # every record's, said once


def encode_messages(records: Sequence[CaptureRecord],
                    wire_dtype: str = "bfloat16") -> tuple[list[tuple[list[memoryview], int]], list[WireError]]:
    """The round's valid records as round messages, (frames, records in them) each, in order;
    and the WireError of every record refused (`encode_parts`' checks). Records of another
    hidden size than the first valid one's (only a hand-made mix has them), and those of a chunk
    whose metadata would not fit a header (`MAX_META_BYTES`: ids and tags near their bound), go
    as record messages, one each (`collector.wire`)."""
    if isinstance(records, CaptureRound):
        whole = _from_round(records, wire_dtype)
        if whole is not None:
            return whole, []
    good, errors, odd = [], [], []
    for part in encode_parts(records, wire_dtype):
        if isinstance(part, WireError):
            errors.append(part)
        elif good and part[0]["hidden_size"] != good[0][0]["hidden_size"]:
            odd.append(part)
        else:
            good.append(part)
    out = []
    for i in range(0, len(good), MAX_ROUND_RECORDS):
        chunk = good[i:i + MAX_ROUND_RECORDS]
        try:
            out.append((_message(chunk), len(chunk)))
        except WireError:  # metadata over the header's bound (ids and tags near their 1,024 characters)
            odd.extend(chunk)
    for meta, arrays in odd:
        out.append(([_header(KIND_RECORD, RECORD_FRAMES, meta)] + _views(arrays), 1))
    return out, errors


def _from_round(rnd: CaptureRound, wire_dtype: str) -> list[tuple[list[memoryview], int]] | None:
    """An engine round as one round message straight from its tensors, no `CaptureRecord`
    built: the same bytes as its records through `encode_parts` and `_message` (tested), for a
    fraction of the sender's Python a record (on a GPU that Python takes the interpreter lock
    from the engine's host loop). None where the round needs the per-record path: more than
    `MAX_ROUND_RECORDS` records, an id beyond int32, any check failing (its records are then
    refused one by one, with their reasons), metadata over the header's bound."""
    rows = rnd.rows
    if not rows or len(rows) > MAX_ROUND_RECORDS or wire_dtype not in FLOAT_DTYPES:
        return None
    feats, final, firsts = rnd.host_rows()
    ids, metas, prefill, total = [], [], rnd.is_prefill, 0
    common = (int(rnd.batch_size), int(rnd.draft_version), bool(prefill), float(rnd.timestamp))
    for row in rows:
        t = row.tokens if firsts is None else [firsts[row.slot], *row.tokens]
        n, k, a = len(t) - 1, int(row.num_steps), int(row.accept_len)
        if n < 1 or not 0 <= a <= k or (not prefill and n != a + 1) or (k and rnd.drafts is None):
            return None
        ids += t
        total += n
        metas.append({"request_id": row.request_id, "first_pos": int(row.first_pos), "num_rows": n, "num_steps": k,
                      "accept_len": a, "batch_size": common[0], "draft_version": common[1], "is_prefill": common[2],
                      "timestamp": common[3], "tag": row.tag})
    hidden = int(final.shape[-1]) if final.dim() == 2 else 0
    if feats.dim() != 2 or total != feats.shape[0] or total != final.shape[0] \
            or feats.shape[1] != FEATURE_LAYERS * hidden:
        return None
    try:
        for m in metas:
            _check_ids(m["request_id"], m["tag"])
            if meta_error({**m, "hidden_size": hidden}):
                return None
    except WireError:
        return None
    tokens = np.array(ids, dtype=np.int64)
    if rnd.drafts is None:
        drafts, probs = np.zeros(0, np.int32), np.zeros(0, np.float32)
    else:
        d, p = _small(rnd.drafts, np.int32), _small(rnd.draft_probs, np.float32)
        if any(row.num_steps > d.shape[1] for row in rows):
            return None
        drafts = np.concatenate([d[row.slot, :row.num_steps] for row in rows])
        probs = np.concatenate([p[row.slot, :row.num_steps] for row in rows])
    if _small_error(tokens, drafts, probs) or (tokens.size and tokens.max() > _INT32_MAX):
        return None
    fdt = FLOAT_DTYPES[wire_dtype]
    feats, final = _fresh(feats, fdt), _fresh(final, fdt)  # one copy each: converted, contiguous, on the host
    if _nonfinite_rows(feats).any() or _nonfinite_rows(final).any():
        return None
    meta = {"float_dtype": wire_dtype, "token_dtype": "int32", "hidden_size": hidden, "records": metas}
    try:
        head = _header(KIND_ROUND, RECORD_FRAMES, meta)
    except WireError:
        return None
    arrays = [tokens.astype(np.int32), _row_bytes(feats), _row_bytes(final), drafts, probs]
    return [([head] + _views(arrays), len(rows))]


def _message(parts: list[tuple]) -> list[memoryview]:
    token_dtype = "int64" if any(meta["token_dtype"] == "int64" for meta, _ in parts) else "int32"
    first = parts[0][0]
    meta = {"float_dtype": first["float_dtype"], "token_dtype": token_dtype, "hidden_size": first["hidden_size"],
            "records": [{k: v for k, v in m.items() if k not in _SHARED} for m, _ in parts]}
    tokens = np.concatenate([a[0] for _, a in parts]).astype(np.int64 if token_dtype == "int64" else np.int32)
    arrays = [tokens] + [np.concatenate([a[j] for _, a in parts]) for j in range(1, 5)]
    return [_header(KIND_ROUND, RECORD_FRAMES, meta)] + _views(arrays)



def decode_message(frames: Sequence[Any]) -> list[CaptureRecord] | CaptureRecord | EndOfRequest:
    """Parse one message of any kind; a round message gives its records in order. Raises
    WireError naming the problem (the whole message is refused)."""
    bufs = [_view(f) for f in frames]
    if not bufs:
        raise WireError("empty message")
    kind, meta = _parse_header(bufs[0], len(bufs))
    if kind != KIND_ROUND:
        return decode_parsed(bufs, kind, meta)
    if len(bufs) != RECORD_FRAMES:
        raise WireError(f"a round message has {RECORD_FRAMES} frames, got {len(bufs)}")
    hidden = _get_int(meta, "hidden_size", *META_BOUNDS["hidden_size"])
    fdt, tdt = _dtypes(meta)
    entries = _get(meta, "records")
    if type(entries) is not list or not 1 <= len(entries) <= MAX_ROUND_RECORDS:
        raise WireError(f"metadata records is not a list of 1..{MAX_ROUND_RECORDS} records")
    fields = [_fields(e) for e in entries]
    rows = sum(f["num_rows"] for f in fields)
    steps = sum(f["num_steps"] for f in fields)
    parts = {  # numpy, checked once for the round; one torch tensor per array
        "tokens": _array(bufs[1], tdt, (rows + len(fields),), "tokens"),
        "features": _array(bufs[2], fdt, (rows, FEATURE_LAYERS * hidden), "features"),
        "final_hidden": _array(bufs[3], fdt, (rows, hidden), "final_hidden"),
        "draft_tokens": _array(bufs[4], torch.int32, (steps,), "draft_tokens"),
        "draft_probs": _array(bufs[5], torch.float32, (steps,), "draft_probs"),
    }
    _check_arrays(parts, fdt, f"a round message of {len(fields)} records (the first {fields[0]['request_id']!r})")
    tokens = torch.from_numpy(parts["tokens"].astype(np.int64))
    feats, final = _floats(parts["features"], fdt), _floats(parts["final_hidden"], fdt)
    drafts = torch.from_numpy(parts["draft_tokens"].astype(np.int64))
    probs = torch.from_numpy(parts["draft_probs"])
    out, t, r, s = [], 0, 0, 0
    for f in fields:  # shapes hold by construction: each record's slices of the round's arrays
        n, k = f.pop("num_rows"), f["num_steps"]
        out.append(CaptureRecord(tokens=tokens[t:t + n + 1], features=feats[r:r + n], final_hidden=final[r:r + n],
                                 draft_tokens=drafts[s:s + k], draft_probs=probs[s:s + k], **f))
        t, r, s = t + n + 1, r + n, s + k
    return out


def _fields(entry: Any) -> dict:
    """A round message's record metadata, checked as a record message's (`collector.wire`)."""
    if type(entry) is not dict:
        raise WireError(f"a round message's record is a JSON {type(entry).__name__}, expected an object")
    steps = _get_int(entry, "num_steps", *META_BOUNDS["num_steps"])
    f = {"request_id": _get_str(entry, "request_id", nonempty=True),
         "first_pos": _get_int(entry, "first_pos", *META_BOUNDS["first_pos"]),
         "num_rows": _get_int(entry, "num_rows", *META_BOUNDS["num_rows"]),
         "num_steps": steps, "accept_len": _get_int(entry, "accept_len", 0, steps),
         "batch_size": _get_int(entry, "batch_size", *META_BOUNDS["batch_size"]),
         "draft_version": _get_int(entry, "draft_version", *META_BOUNDS["draft_version"]),
         "is_prefill": _get_bool(entry, "is_prefill"), "timestamp": _get_float(entry, "timestamp"),
         "tag": _get_str(entry, "tag")}
    if not f["is_prefill"] and f["num_rows"] != f["accept_len"] + 1:
        raise WireError(f"inconsistent record {f['request_id']!r}: a verify record has accept_len+1 = "
                        f"{f['accept_len'] + 1} rows, got {f['num_rows']}")
    return f
