"""Teacher-forced capture: batched (padded) capture equals one sequence alone, records survive
the collector's span shards, and rejected drafts of live spans reach the batch."""

import torch

from tests.distill_helpers import tiny8
from trainer.batch import collate
from trainer.data import capture_tokens, load_records, records_complete, save_records


def test_capture_batched_equals_alone_and_round_trips(tmp_path):
    target = tiny8()
    seqs = [list(range(1, 30)), list(range(40, 49))]
    batched = capture_tokens(target, seqs, ["a", "b"], tag="t")
    alone = capture_tokens(target, seqs[1:], ["b"], tag="t")[0]
    assert batched[1].num_rows == len(seqs[1]) - 1 and batched[1].is_prefill
    torch.testing.assert_close(batched[1].features.float(), alone.features.float(), atol=2e-2, rtol=2e-2)
    batched[1].validate()
    save_records(batched, tmp_path / "r")
    assert records_complete(tmp_path / "r")
    back = load_records(tmp_path / "r")
    assert [s.request_id for s in back] == ["a", "b"]
    for r, s in zip(batched, back):
        assert torch.equal(r.tokens, s.tokens) and torch.equal(r.features, s.features)
        assert torch.equal(r.final_hidden, s.final_hidden)


def test_rejected_flags_from_live_records():
    from collector.span import CaptureSpan
    from online_spec.capture import CaptureRecord

    H = 4
    prefill = CaptureRecord("r", 0, torch.tensor([1, 2, 3]), torch.zeros(2, 3 * H), torch.zeros(2, H), is_prefill=True)
    verify = CaptureRecord("r", 2, torch.tensor([3, 7, 9]), torch.zeros(2, 3 * H), torch.zeros(2, H),
                           draft_tokens=torch.tensor([7, 8, 5]), draft_probs=torch.ones(3), accept_len=1, num_steps=3)
    span = CaptureSpan.from_records([prefill, verify])
    b = collate([span])
    # the draft 8 for position 4 was rejected; the target's 9 there is the flagged token
    assert b.rejected[0].tolist() == [False, False, False, False, True]
    assert collate([verify]).rejected[0].tolist() == [False, False, True]


def test_generated_spans_are_the_greedy_path_with_teacher_forced_features():
    """Self-distillation capture: each span is prompt + the target's greedy continuation (as the
    HF model decodes it), its features equal a teacher-forced capture of that same text, and only
    the rows after the prompt are decode rows."""
    from tests.distill_helpers import greedy_records
    from trainer.data import generate_records

    target = tiny8()
    _, seqs = greedy_records(target, num=3, prompt_len=8, new_tokens=12, seed=2)
    prompts = [s[:8] for s in seqs]
    spans = sorted(generate_records(target, prompts, 12, id_prefix="g", max_batch=2), key=lambda s: s.request_id)
    assert [s.request_id for s in spans] == ["g-0", "g-1", "g-2"]
    tf = capture_tokens(target, seqs, ["a", "b", "c"])
    for s, seq, ref in zip(spans, seqs, tf):
        s.validate()
        assert s.tokens.tolist() == seq[:8 + 12]
        assert s.is_prefill.tolist() == [True] * 8 + [False] * (s.num_rows - 8)
        n = s.num_rows
        torch.testing.assert_close(s.features.float(), ref.features[:n].float(), atol=3e-2, rtol=3e-2)
    limited = list(generate_records(target, prompts, 12, max_batch=3, max_tokens=1))
    assert len(limited) == 1  # stops at the first span once max_tokens rows are in


def test_pack_then_unpack_equals_collate():
    """What travels between trainer ranks (unpadded) gives the padded batch collate gives."""
    from tests.distill_helpers import greedy_records, tiny8
    from trainer.batch import collate, pack, unpack

    recs, _ = greedy_records(tiny8(), num=4, new_tokens=12)
    recs[1] = recs[1].__class__(**{**recs[1].__dict__, "first_pos": 5})
    items = [recs[0], recs[1], recs[2]]
    items[2].features, items[2].final_hidden, items[2].tokens = \
        items[2].features[:7], items[2].final_hidden[:7], items[2].tokens[:8]  # a shorter one: padding
    a, b = collate(items), unpack(pack(items))
    for name in ("tokens", "features", "final_hidden", "row_mask", "rejected", "first_pos"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert sum(t.numel() * t.element_size() for t in pack(items).values()) < \
        sum(getattr(a, n).numel() * getattr(a, n).element_size() for n in ("tokens", "features", "final_hidden"))
