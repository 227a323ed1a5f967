"""Span assembly: adjacency only, every close reason, and a property test across drops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.assembler import SpanAssembler
from collector.span import CaptureSpan
from collector_records import request_records
from online_spec.capture import CaptureRecord

H = 8


def _asm(**kw) -> SpanAssembler:
    args = dict(idle_timeout_s=10.0, max_open_requests=100, max_span_rows=10_000)
    args.update(kw)
    return SpanAssembler(**args)


def test_from_records_joins_rows_and_tokens():
    recs = request_records("a", 3, hidden=H)
    span = CaptureSpan.from_records(recs)
    assert span.first_pos == 0 and span.end_pos == recs[-1].end_pos
    assert span.tokens.tolist() == sum((r.tokens[:-1].tolist() for r in recs), []) + [int(recs[-1].tokens[-1])]
    assert torch.equal(span.features, torch.cat([r.features for r in recs]))
    assert torch.equal(span.final_hidden, torch.cat([r.final_hidden for r in recs]))
    span.validate()


def test_from_records_refuses_non_adjacent_records():
    recs = request_records("a", 3, hidden=H)
    with pytest.raises(ValueError, match="does not follow"):
        CaptureSpan.from_records([recs[0], recs[2]])
    other = request_records("b", 3, hidden=H)
    with pytest.raises(ValueError, match="requests"):
        CaptureSpan.from_records([recs[0], other[1]])
    shifted = request_records("a", 3, hidden=H, seed=5)  # same positions, other tokens
    with pytest.raises(ValueError, match="token at position"):
        CaptureSpan.from_records([recs[0], shifted[1]])


def _verify(accept_len: int, num_steps: int) -> CaptureRecord:
    n = accept_len + 1
    tokens = torch.arange(100, 101 + n)  # tokens[i + 1] == 101 + i
    drafts = torch.tensor([101 + i if i < accept_len else 9000 + i for i in range(num_steps)], dtype=torch.long)
    return CaptureRecord("r", 10, tokens, torch.zeros(n, 3 * H), torch.zeros(n, H), draft_tokens=drafts,
                         draft_probs=torch.linspace(0.9, 0.1, num_steps), accept_len=accept_len,
                         num_steps=num_steps)


@pytest.mark.parametrize("accept_len,num_steps,accepted", [
    (0, 3, [0]),              # first draft rejected: row 0 predicted a rejected draft
    (2, 3, [1, 1, 0]),        # two accepted, the third rejected
    (3, 3, [1, 1, 1, -1]),    # all accepted: the last row's label is the bonus, nothing drafted
    (0, 0, [-1]),             # plain decode (K = 0)
])
def test_per_row_accept_info(accept_len, num_steps, accepted):
    rec = _verify(accept_len, num_steps)
    span = CaptureSpan.from_records([rec])
    assert span.accepted.tolist() == accepted
    drafted = [i for i, a in enumerate(accepted) if a >= 0]
    assert span.draft_token[drafted].tolist() == rec.draft_tokens[:len(drafted)].tolist()
    assert (span.draft_token[[i for i, a in enumerate(accepted) if a < 0]] == -1).all()
    # an accepted draft is the committed token; a rejected one is not
    for i, a in enumerate(accepted):
        if a == 1:
            assert int(span.draft_token[i]) == int(span.tokens[i + 1])
        if a == 0:
            assert int(span.draft_token[i]) != int(span.tokens[i + 1])


def test_prefill_rows_have_no_drafts():
    span = CaptureSpan.from_records(request_records("p", 0, hidden=H, prefill_rows=5))
    assert span.accepted.tolist() == [-1] * 5 and span.is_prefill.all()


def test_slice_is_a_valid_span_at_the_right_positions():
    span = CaptureSpan.from_records(request_records("a", 4, hidden=H))
    part = span.slice(2, 5)
    part.validate()
    assert part.first_pos == 2 and part.num_rows == 3
    assert part.tokens.tolist() == span.tokens[2:6].tolist()
    with pytest.raises(ValueError):
        span.slice(3, 3)


def test_end_marker_hands_over_the_span():
    asm = _asm()
    recs = request_records("a", 3, hidden=H)
    assert sum((asm.add(r, 0.0) for r in recs), []) == []
    (span,) = asm.end("a")
    assert span.num_rows == sum(r.num_rows for r in recs) and asm.closed["end"] == 1
    assert asm.end("a") == [] and asm.num_open == 0


def test_a_gap_closes_the_span_and_starts_a_new_one():
    asm = _asm()
    recs = request_records("a", 4, hidden=H)
    asm.add(recs[0], 0.0)
    asm.add(recs[1], 0.0)
    (closed,) = asm.add(recs[3], 0.0)  # recs[2] was dropped
    assert closed.end_pos == recs[1].end_pos and asm.gaps == 1 and asm.closed["gap"] == 1
    (rest,) = asm.end("a")
    assert rest.first_pos == recs[3].first_pos and rest.num_rows == recs[3].num_rows


def test_idle_requests_expire_and_active_ones_stay():
    asm = _asm(idle_timeout_s=5.0)
    a, b = request_records("a", 2, hidden=H), request_records("b", 2, hidden=H)
    asm.add(a[0], 0.0)
    asm.add(b[0], 3.0)
    assert asm.expire(4.9) == []
    (span,) = asm.expire(5.0)
    assert span.request_id == "a" and asm.closed["idle"] == 1 and asm.num_open == 1


def test_span_row_limit_splits_a_long_request_into_adjacent_spans():
    asm = _asm(max_span_rows=6)
    recs = request_records("a", 6, hidden=H, prefill_rows=4)
    spans = sum((asm.add(r, 0.0) for r in recs), []) + asm.end("a")
    assert all(s.num_rows >= 1 for s in spans) and len(spans) >= 2
    assert [s.first_pos for s in spans[1:]] == [s.end_pos for s in spans[:-1]]
    assert asm.gaps == 0 and asm.closed["limit"] >= 1


def test_too_many_open_requests_evicts_the_least_recent():
    asm = _asm(max_open_requests=2)
    asm.add(request_records("a", 0, hidden=H)[0], 0.0)
    asm.add(request_records("b", 0, hidden=H)[0], 1.0)
    (span,) = asm.add(request_records("c", 0, hidden=H)[0], 2.0)
    assert span.request_id == "a" and asm.closed["evict"] == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_requests=st.integers(1, 4), num_rounds=st.integers(0, 8))
def test_reassembly_across_drops_never_joins_non_adjacent_rows(data, num_requests, num_rounds):
    originals = {f"r{i}": request_records(f"r{i}", num_rounds, hidden=4, seed=i) for i in range(num_requests)}
    kept = {rid: data.draw(st.lists(st.booleans(), min_size=len(recs), max_size=len(recs)), label=f"keep {rid}")
            for rid, recs in originals.items()}
    queues = {rid: [r for r, k in zip(recs, kept[rid]) if k] for rid, recs in originals.items()}
    asm = SpanAssembler(idle_timeout_s=1e9, max_open_requests=100,
                        max_span_rows=data.draw(st.integers(1, 40), label="max_span_rows"))
    spans: list[CaptureSpan] = []
    while any(queues.values()):  # a random interleaving that keeps each request's order
        rid = data.draw(st.sampled_from(sorted(r for r, q in queues.items() if q)))
        spans += asm.add(queues[rid].pop(0), 0.0)
    spans += sum((asm.end(rid) for rid in originals if data.draw(st.booleans())), []) + asm.flush()

    covered: dict[str, list[int]] = {rid: [] for rid in originals}
    for span in spans:
        recs = originals[span.request_id]
        by_pos = {r.first_pos: i for i, r in enumerate(recs)}
        pos, idx = span.first_pos, []
        while pos < span.end_pos:
            assert pos in by_pos, "a span starts or continues mid-record"
            i = by_pos[pos]
            assert kept[span.request_id][i], "a span covers a record that was dropped"
            idx.append(i)
            pos = recs[i].end_pos
        assert pos == span.end_pos
        assert idx == list(range(idx[0], idx[-1] + 1))
        ref = CaptureSpan.from_records([recs[i] for i in idx])
        assert torch.equal(span.tokens, ref.tokens) and torch.equal(span.features, ref.features)
        covered[span.request_id] += idx
    for rid, recs in originals.items():  # every record that arrived is in exactly one span
        assert sorted(covered[rid]) == [i for i, k in enumerate(kept[rid]) if k]
