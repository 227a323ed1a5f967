"""Wire codec: bit-exact round trips, and every kind of bad message rejected with WireError."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.wire import (HEADER, MAGIC, VERSION, EndOfRequest, WireError, decode, encode, encode_end,
                            encode_round, frames_nbytes)
from collector_records import assert_records_equal, corrupt, request_records
from online_spec.capture import CaptureRecord

H = 8


def _bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def _with_meta(frames, **changes) -> list[bytes]:
    """A copy of an encoded message with metadata fields changed (header rebuilt consistently)."""
    head = bytes(frames[0])
    magic, version, kind, nframes, _ = HEADER.unpack_from(head)
    meta = json.loads(head[HEADER.size:])
    meta.update(changes)
    blob = json.dumps(meta).encode()
    return [HEADER.pack(magic, version, kind, nframes, len(blob)) + blob] + _bytes(frames[1:])


@pytest.mark.parametrize("dtype_name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                              ("float32", torch.float32)])
def test_round_trip_is_bit_exact_for_the_wire_dtype(dtype_name, dtype):
    for record in request_records("req-a", num_rounds=4, hidden=H):
        got = decode(_bytes(encode(record, dtype_name)))
        assert_records_equal(record, got, dtype)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_a_round_encodes_as_its_records_do_one_by_one(dtype_name):
    # one round of the engine: a record per request, of varying rows, plus a prefill
    recs = [request_records(f"req-{i}", num_rounds=3, hidden=H, seed=i, dtype=torch.bfloat16)[1 + i % 3]
            for i in range(6)] + [request_records("req-p", num_rounds=0, hidden=H)[0]]
    assert len({r.num_rows for r in recs}) > 1
    got = encode_round(recs, dtype_name)
    assert [_bytes(f) for f in got] == [_bytes(encode(r, dtype_name)) for r in recs]


def test_a_round_refuses_only_its_bad_records():
    recs = [request_records(f"req-{i}", num_rounds=1, hidden=H, seed=i)[1] for i in range(5)]
    recs[1].features = recs[1].features.clone()
    recs[1].features[0, 2] = float("nan")
    recs[3].tokens = recs[3].tokens.clone()
    recs[3].tokens[0] = -4
    recs[4].accept_len = recs[4].num_steps + 1  # inconsistent
    got = encode_round(recs)
    assert isinstance(got[1], WireError) and "non-finite" in str(got[1])
    assert isinstance(got[3], WireError) and "negative token id" in str(got[3])
    assert isinstance(got[4], WireError) and "accept_len" in str(got[4])
    for i in (0, 2):
        assert_records_equal(recs[i], decode(_bytes(got[i])), torch.bfloat16)
    assert encode_round([]) == []


def test_views_of_larger_tensors_are_copied_and_strides_ignored():
    big = torch.randn(10, 2 * 3 * H)
    hidden = torch.randn(H, 10).t()  # non-contiguous
    record = CaptureRecord("req-v", 7, torch.tensor([5, 6, 7]), big[2:4, ::2], hidden[3:5], torch.tensor([6, 9]),
                           torch.tensor([0.9, 0.2]), accept_len=1, num_steps=2)
    frames = encode(record)
    big.fill_(1.0)  # the engine reusing its buffer after the send must not change what was encoded
    got = decode(_bytes(frames))
    assert not torch.equal(got.features.float(), torch.ones_like(got.features.float()))
    assert torch.equal(got.final_hidden, hidden[3:5].to(torch.bfloat16))


def test_large_token_ids_travel_as_int64():
    record = CaptureRecord("req-t", 0, torch.tensor([2**40, 3]), torch.randn(1, 3 * H), torch.randn(1, H),
                           is_prefill=True)
    frames = encode(record)
    assert json.loads(bytes(frames[0])[HEADER.size:])["token_dtype"] == "int64"
    assert decode(_bytes(frames)).tokens.tolist() == [2**40, 3]


def test_end_of_request_round_trip():
    msg = decode(_bytes(encode_end("req-e", 12.5)))
    assert msg == EndOfRequest("req-e", 12.5)


def test_frames_nbytes_counts_every_frame():
    frames = encode(request_records("req-n", 1, hidden=H)[1])
    assert frames_nbytes(frames) == sum(len(b) for b in _bytes(frames))


GOOD = request_records("req-x", num_rounds=1, hidden=H, num_steps=3)[1]
assert GOOD.accept_len >= 1  # the metadata cases below lower it


@pytest.mark.parametrize("mutate,reason", [
    (lambda f: [], "empty message"),
    (lambda f: [f[0][:5]] + f[1:], "shorter than"),
    (lambda f: [f[0][:-1]] + f[1:], "truncated"),
    (lambda f: f[:-1], "frames"),
    (lambda f: f + [b"extra"], "frames"),
    (lambda f: [b"XXXX" + f[0][4:]] + f[1:], "bad magic"),
    (lambda f: [f[0][:4] + struct.pack("<H", VERSION + 1) + f[0][6:]] + f[1:], "version"),
    (lambda f: [f[0][:6] + b"\x07" + f[0][7:]] + f[1:], "unknown message kind"),
    (lambda f: f[:2] + [f[2][:-2]] + f[3:], "features frame"),
    (lambda f: f[:3] + [f[3] + b"\0\0"] + f[4:], "final_hidden frame"),
    (lambda f: [f[0]] + [f[1][:-4]] + f[2:], "tokens frame"),
])
def test_damaged_messages_are_rejected_with_a_reason(mutate, reason):
    with pytest.raises(WireError, match=reason):
        decode(mutate(_bytes(encode(GOOD))))


@pytest.mark.parametrize("changes,reason", [
    ({"num_rows": GOOD.num_rows + 1}, "frame has"),
    ({"hidden_size": H * 2}, "frame has"),
    ({"num_rows": -1}, "num_rows"),
    ({"num_steps": "3"}, "num_steps"),
    ({"accept_len": GOOD.accept_len - 1}, "a verify record has"),
    ({"accept_len": 9}, "accept_len"),
    ({"float_dtype": "float8"}, "float_dtype"),
    ({"request_id": ""}, "request_id"),
    ({"is_prefill": 1}, "is_prefill"),
    ({"timestamp": "now"}, "timestamp"),
])
def test_inconsistent_metadata_is_rejected(changes, reason):
    with pytest.raises(WireError, match=reason):
        decode(_with_meta(encode(GOOD), **changes))


def test_missing_metadata_field_is_rejected():
    frames = _bytes(encode(GOOD))
    head = frames[0]
    meta = json.loads(head[HEADER.size:])
    del meta["first_pos"]
    blob = json.dumps(meta).encode()
    frames[0] = head[:8] + struct.pack("<I", len(blob)) + blob
    with pytest.raises(WireError, match="first_pos"):
        decode(frames)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_features_are_rejected_at_both_ends(bad):
    record = request_records("req-nan", 1, hidden=H)[1]
    record.features[0, 3] = bad
    with pytest.raises(WireError, match="non-finite"):
        encode(record)
    clean = request_records("req-nan", 1, hidden=H)[1]
    frames = _bytes(encode(clean, "float32"))
    poisoned = bytearray(frames[2])
    poisoned[0:4] = struct.pack("<f", bad)
    with pytest.raises(WireError, match="features has non-finite"):
        decode(frames[:2] + [bytes(poisoned)] + frames[3:])


def test_fp16_overflow_is_rejected_rather_than_sent_as_inf():
    record = request_records("req-big", 1, hidden=H)[1]
    record.final_hidden[0, 0] = 1e6  # beyond float16's range
    with pytest.raises(WireError, match="final_hidden has non-finite"):
        encode(record, "float16")
    assert decode(_bytes(encode(record, "bfloat16"))).final_hidden[0, 0].item() == pytest.approx(1e6, rel=1e-2)


def test_bad_probabilities_and_negative_tokens_are_rejected():
    frames = _bytes(encode(GOOD))
    probs = bytearray(frames[5])
    probs[0:4] = struct.pack("<f", 1.5)
    with pytest.raises(WireError, match="draft_probs not finite or outside"):
        decode(frames[:5] + [bytes(probs)])
    probs[0:4] = struct.pack("<f", float("nan"))
    with pytest.raises(WireError, match="draft_probs not finite"):
        decode(frames[:5] + [bytes(probs)])
    toks = bytearray(frames[1])
    toks[0:4] = struct.pack("<i", -3)
    with pytest.raises(WireError, match="negative token"):
        decode([frames[0], bytes(toks)] + frames[2:])


def test_metadata_that_is_not_json_is_rejected():
    frames = _bytes(encode(GOOD))
    blob = b"\xff\xfe not json"
    with pytest.raises(WireError, match="not UTF-8 JSON"):
        decode([HEADER.pack(MAGIC, VERSION, 1, 6, len(blob)) + blob] + frames[1:])
    blob = b'{"request_id": NaN}'
    with pytest.raises(WireError, match="NaN"):
        decode([HEADER.pack(MAGIC, VERSION, 2, 1, len(blob)) + blob])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_garbage_never_raises_anything_but_wire_error(frames):
    with pytest.raises(WireError):
        decode(frames)


@settings(max_examples=300, deadline=None)
@given(frame=st.integers(0, 5), pos=st.integers(0, 10_000), value=st.integers(0, 255),
       cut=st.one_of(st.none(), st.integers(0, 10_000)))
def test_a_corrupted_valid_message_decodes_or_raises_wire_error(frame, pos, value, cut):
    frames = corrupt(encode(GOOD), frame, pos, value, cut)
    try:
        got = decode(frames)
    except WireError:
        return
    got.validate()  # whatever decodes is a consistent record
    assert torch.isfinite(got.features.float()).all()
