"""Round messages (collector/wire_round.py): a round's records in one message, bit-exact, and
every kind of bad message refused whole with WireError."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.wire import HEADER, WireError, decode, encode, encode_end
from collector.wire_round import KIND_ROUND, MAX_ROUND_RECORDS, decode_message, encode_messages
from collector_records import assert_records_equal, corrupt, request_records
from online_spec.capture import CaptureRecord, CaptureRound, RoundRow
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from serving.engine import Engine, EngineConfig
from serving.requests import Request
from tests.distill_helpers import tiny8

H = 8


def _bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def _round(n: int = 6) -> list[CaptureRecord]:
    """One engine round: a record per request, of varying rows, and a prefill."""
    recs = [request_records(f"req-{i}", num_rounds=3, hidden=H, seed=i)[1 + i % 3] for i in range(n - 1)]
    return recs + [request_records("req-p", num_rounds=0, hidden=H, seed=99)[0]]


def _meta(frames) -> dict:
    return json.loads(bytes(frames[0])[HEADER.size:])


def _with_meta(frames, change) -> list[bytes]:
    """A copy of a round message with its metadata changed by `change(meta)` (header rebuilt)."""
    head = bytes(frames[0])
    magic, version, kind, nframes, _ = HEADER.unpack_from(head)
    meta = json.loads(head[HEADER.size:])
    change(meta)
    blob = json.dumps(meta).encode()
    return [HEADER.pack(magic, version, kind, nframes, len(blob)) + blob] + _bytes(frames[1:])


@pytest.mark.parametrize("dtype_name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                              ("float32", torch.float32)])
def test_a_round_travels_as_one_message_bit_exact(dtype_name, dtype):
    recs = _round()
    assert len({r.num_rows for r in recs}) > 1
    messages, errors = encode_messages(recs, dtype_name)
    assert errors == [] and len(messages) == 1 and messages[0][1] == len(recs)
    frames = messages[0][0]
    assert HEADER.unpack_from(bytes(frames[0]))[2] == KIND_ROUND and len(frames) == 6
    got = decode_message(_bytes(frames))
    assert [r.request_id for r in got] == [r.request_id for r in recs]
    for want, have in zip(recs, got):
        assert_records_equal(want, have, dtype)
        have.validate()


def test_record_and_end_messages_still_decode():
    rec = _round()[0]
    assert_records_equal(rec, decode_message(_bytes(encode(rec))), torch.bfloat16)
    assert decode_message(_bytes(encode_end("req-e", 3.0))).request_id == "req-e"
    with pytest.raises(WireError, match="unknown message kind"):  # a record reader refuses the new kind
        decode(_bytes(encode_messages(_round())[0][0][0]))


def test_bad_records_are_left_out_and_the_rest_sent():
    recs = _round()
    recs[1].features = recs[1].features.clone()
    recs[1].features[0, 2] = float("nan")
    recs[3].accept_len = recs[3].num_steps + 1
    messages, errors = encode_messages(recs)
    assert len(errors) == 2 and "non-finite" in str(errors[0]) and "accept_len" in str(errors[1])
    got = decode_message(_bytes(messages[0][0]))
    assert messages[0][1] == len(got) == len(recs) - 2
    assert [r.request_id for r in got] == [r.request_id for i, r in enumerate(recs) if i not in (1, 3)]
    assert encode_messages([recs[1]])[0] == []  # nothing valid: no message


def test_a_large_round_goes_out_in_several_messages():
    recs = [request_records(f"req-{i}", num_rounds=1, hidden=H, seed=i)[1] for i in range(MAX_ROUND_RECORDS + 3)]
    messages, _ = encode_messages(recs)
    assert [n for _, n in messages] == [MAX_ROUND_RECORDS, 3]
    got = [r for frames, _ in messages for r in decode_message(_bytes(frames))]
    assert [r.request_id for r in got] == [r.request_id for r in recs]


def test_large_ids_make_the_round_int64_and_odd_widths_go_alone():
    recs = _round(3)
    big = CaptureRecord("req-t", 0, torch.tensor([2**40, 3]), torch.randn(1, 3 * H), torch.randn(1, H),
                        is_prefill=True)
    wide = CaptureRecord("req-w", 0, torch.tensor([1, 2]), torch.randn(1, 6 * H), torch.randn(1, 2 * H),
                         is_prefill=True)
    messages, errors = encode_messages(recs + [big, wide])
    assert errors == [] and [n for _, n in messages] == [4, 1]
    assert _meta(messages[0][0])["token_dtype"] == "int64"
    got = decode_message(_bytes(messages[0][0]))
    assert got[-1].tokens.tolist() == [2**40, 3] and got[0].tokens.tolist() == recs[0].tokens.tolist()
    assert decode_message(_bytes(messages[1][0])).final_hidden.shape == (1, 2 * H)  # a record message


def _set(key, value, i=1):
    def change(meta):
        meta["records"][i][key] = value
    return change


@pytest.mark.parametrize("change,reason", [
    (_set("num_rows", 99, i=5), "frame has"),  # the prefill's
    (_set("num_steps", 7), "frame has"),
    (_set("accept_len", 0), "a verify record has"),
    (_set("accept_len", 9), "accept_len"),
    (_set("request_id", ""), "request_id"),
    (_set("is_prefill", 1), "is_prefill"),
    (_set("timestamp", "now"), "timestamp"),
    (_set("first_pos", -1), "first_pos"),
    (lambda m: m["records"][2].pop("tag"), "lacks 'tag'"),
    (lambda m: m.update(records=[]), "records"),
    (lambda m: m.update(records={"a": 1}), "records"),
    (lambda m: m.update(records=(m["records"] * MAX_ROUND_RECORDS)[:MAX_ROUND_RECORDS + 1]), "records"),
    (lambda m: m["records"].__setitem__(0, [1]), "JSON list"),
    (lambda m: m.update(hidden_size=2 * H), "frame has"),
    (lambda m: m.update(float_dtype="float8"), "float_dtype"),
    (lambda m: m.update(token_dtype="int8"), "token_dtype"),
])
def test_inconsistent_metadata_refuses_the_whole_round(change, reason):
    recs = _round()
    recs[1] = request_records("req-1", num_rounds=3, hidden=H, seed=1, num_steps=3)[2]
    assert not recs[1].is_prefill and recs[1].accept_len >= 1 and recs[1].num_steps == 3
    frames = encode_messages(recs)[0][0][0]
    with pytest.raises(WireError, match=reason):
        decode_message(_with_meta(frames, change))


@pytest.mark.parametrize("frame,reason", [(2, "non-finite"), (3, "non-finite"), (1, "negative token id"),
                                          (5, "draft_probs")])
def test_bad_values_anywhere_refuse_the_whole_round(frame, reason):
    frames = _bytes(encode_messages(_round(), "float32")[0][0][0])
    b = bytearray(frames[frame])
    b[-4:] = (b"\xff\xff\xff\xff" if frame in (1, 5) else b"\x00\x00\xc0\x7f")  # -1 / NaN / NaN / NaN
    frames[frame] = bytes(b)
    with pytest.raises(WireError, match=reason):
        decode_message(frames)


@pytest.mark.parametrize("mutate,reason", [
    (lambda f: [], "empty message"),
    (lambda f: f[:-1], "frames"),
    (lambda f: f[:2] + [f[2][:-2]] + f[3:], "features frame"),
    (lambda f: f[:4] + [f[4] + b"\0\0\0\0"] + f[5:], "draft_tokens frame"),
])
def test_damaged_round_messages_are_refused(mutate, reason):
    with pytest.raises(WireError, match=reason):
        decode_message(mutate(_bytes(encode_messages(_round())[0][0][0])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=st.integers(0, 5), pos=st.integers(0, 10_000), value=st.integers(0, 255),
       cut=st.one_of(st.none(), st.integers(0, 10_000)))
def test_a_corrupted_round_decodes_or_raises_wire_error(frame, pos, value, cut):
    frames = corrupt(encode_messages(_round())[0][0][0], frame, pos, value, cut)
    try:
        got = decode_message(frames)
    except WireError:
        return
    for record in got:  # whatever decodes is consistent records
        record.validate()
        assert torch.isfinite(record.features.float()).all()


def test_metadata_over_the_header_bound_goes_as_record_messages():
    """Ids and tags near their 1,024 characters: 40 records' metadata would pass the header's
    64 KiB, so the chunk goes as one record message each, every record still sent."""
    recs = [request_records(("r%d-" % i).ljust(1000, "x"), num_rounds=1, hidden=H, seed=i, tag="t" * 1000)[1]
            for i in range(40)]
    messages, errors = encode_messages(recs)
    assert errors == [] and [n for _, n in messages] == [1] * 40
    for (frames, _), want in zip(messages, recs):
        assert_records_equal(want, decode_message(_bytes(frames)), torch.bfloat16)
    messages, _ = encode_messages(recs[:20])  # 20 of them fit: one round message
    assert [n for _, n in messages] == [20]


# -- an engine round encoded straight from its tensors -------------------------------------------

def _hand_round(**kw) -> CaptureRound:
    """A round as the chain round hands it over: rows gathered by index, drafts by slot."""
    g = torch.Generator().manual_seed(5)
    feats, final = torch.randn(3 * 4, 3 * H, generator=g), torch.randn(3 * 4, H, generator=g)
    drafts, probs = torch.tensor([[7, 8, 9], [4, 5, 6], [1, 2, 3]]), torch.rand(3, 3, generator=g)
    rows = [RoundRow("a", 10, 0, [1, 7, 8, 3], 2, 3, "chat"), RoundRow("b", 20, 2, [2, 9], 0, 3, ""),
            RoundRow("c", 5, 1, [4, 5, 6, 11, 12], 3, 3, "code")]
    return CaptureRound(rows, feats, final, row_index=[0, 1, 2, 8, 4, 5, 6, 7], drafts=drafts, draft_probs=probs,
                        batch_size=3, draft_version=5, timestamp=1.5, **kw)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_a_round_from_its_tensors_is_the_bytes_of_its_records(dtype_name):
    rnd = _hand_round()
    fast, errors = encode_messages(rnd, dtype_name)
    assert errors == [] and rnd._records is None  # no record built
    slow, _ = encode_messages(list(_hand_round().records()), dtype_name)
    assert [_bytes(f) for f, _ in fast] == [_bytes(f) for f, _ in slow] and [n for _, n in fast] == [3]
    got = decode_message(_bytes(fast[0][0]))
    assert [r.request_id for r in got] == ["a", "b", "c"] and got[2].draft_tokens.tolist() == [4, 5, 6]


def test_a_round_that_fails_a_check_takes_the_per_record_path():
    rnd = _hand_round()
    rnd.features = rnd.features.clone()
    rnd.features[8, 0] = float("nan")  # the row of "b"
    messages, errors = encode_messages(rnd)
    assert len(errors) == 1 and "non-finite" in str(errors[0]) and rnd._records is not None
    assert [r.request_id for r in decode_message(_bytes(messages[0][0]))] == ["a", "c"]
    wide = _hand_round()
    wide.rows[0] = wide.rows[0]._replace(tokens=[1, 7, 8, 2**40])  # an id beyond int32
    messages, errors = encode_messages(wide)
    assert errors == [] and _meta(messages[0][0])["token_dtype"] == "int64"


class _Sink:
    def __init__(self):
        self.rounds = []

    def should_capture(self, request_id):
        return True

    def submit(self, records):
        if isinstance(records, CaptureRound):
            self.rounds.append(records)

    def end_request(self, request_id):
        pass


@pytest.mark.parametrize("tree, sampled", [(False, False), (False, True), (True, False), (True, True)])
def test_engine_rounds_from_their_tensors_are_the_bytes_of_their_records(tree, sampled):
    """Chain and tree rounds of a real engine (tiny fp32 target), greedy and with a sampled request."""
    torch.manual_seed(0)
    target = tiny8()
    shape = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if tree else {}
    eng = Engine(target, new_head(target, draft_vocab_size=256, seed=3),
                 EngineConfig(max_batch=4, max_len=256, num_steps=3, **shape), publisher=(sink := _Sink()))
    for i, p in enumerate([[5, 9, 33, 7], [1, 2, 3, 4, 5, 6], [100, 200, 300]]):
        params = SamplingParams(max_tokens=16, ignore_eos=True, **({"temperature": 0.8, "seed": 7}
                                                                    if sampled and i == 1 else {}))
        eng.add_request(Request(p, params, request_id=f"r{i}"))
    while eng.has_work():
        eng.step()
    assert len(sink.rounds) > 3
    for rnd in sink.rounds:
        fast, errors = encode_messages(rnd, "bfloat16")
        assert errors == [] and rnd._records is None and len(fast) == 1
        slow, _ = encode_messages(list(rnd.records()), "bfloat16")
        assert [_bytes(f) for f, _ in fast] == [_bytes(f) for f, _ in slow]
