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
