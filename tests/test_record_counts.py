"""The gate's and the seed checks' simulated counts (trainer/evaluate.record_counts) project to
the vocabularies only where an anchor is still eligible; the counts must equal those of the whole
projection (every row, every step), on greedy records (every anchor eligible) and on random text
(teacher-forced: the recorded token leaves the greedy path), batched and not, generated rows only
or all. A tiny target (8 layers, random weights) stands in for SmolLM2; the head is trained a
little so that drafts are accepted at several steps."""

import torch

from tests.distill_helpers import greedy_records, tiny8, trained_head
from tests.test_trainer_daemon import served
from trainer.batch import collate
from trainer.data import capture_tokens
from trainer.evaluate import record_counts
from trainer.loss import SharedTarget, ttt_unroll


@torch.no_grad()
def whole_projection_counts(head, target, records, max_steps, generated_only):
    """The counts with every row projected at every step, one record at a time."""
    shared, lm_head, d2t = SharedTarget.build(target, head), target.lm_head.weight.detach(), head.draft_to_target
    hits, eligible = torch.zeros(len(records), max_steps), torch.zeros(len(records), max_steps)
    for j, r in enumerate(records):
        batch = collate([r])
        T = batch.row_mask.shape[1]
        greedy = (batch.final_hidden.to(lm_head.dtype) @ lm_head.T).argmax(-1)
        alive = batch.row_mask.clone()
        if generated_only:
            decode = torch.zeros_like(alive)
            decode[0, :r.num_rows - 1] = ~r.is_prefill[1:]
            alive &= decode
        for k, logits in enumerate(ttt_unroll(head.eval(), batch, shared, max_steps)):
            n = T - k - 1
            if n <= 0:
                break
            alive = alive[:, :n] & batch.row_mask[:, k + 1:k + 1 + n]
            g = greedy[:, k + 1:k + 1 + n]
            hit = (d2t[logits[:, :n].argmax(-1)] == g) & alive
            eligible[j, k], hits[j, k] = alive.sum(), hit.sum()
            alive = hit & (batch.tokens[:, k + 2:k + 2 + n] == g)
    return hits, eligible


def test_counts_projected_at_eligible_anchors_equal_the_whole_projection():
    target = tiny8()
    recs, _ = greedy_records(target, num=5, new_tokens=30)
    head = trained_head(target, recs, steps=25)
    g = torch.Generator().manual_seed(3)
    text = capture_tokens(target, [torch.randint(0, target.info.vocab_size - 1, (n,), generator=g).tolist()
                                   for n in (20, 33, 41)], ["text-0", "text-1", "text-2"])
    spans = [served(r, prompt_rows=p) for r, p in zip(recs + text, (8, 12, 5, 8, 20, 6, 9, 15))]
    for generated_only in (True, False):
        want = whole_projection_counts(head, target, spans, 5, generated_only)
        assert want[0][:, 1].sum() > 0 and (want[0] < want[1]).any()  # drafts accepted past the first, and missed
        for batch_size in (1, 4):
            got = record_counts(head, target, spans, 5, batch_size=batch_size, generated_only=generated_only)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (generated_only, batch_size)
