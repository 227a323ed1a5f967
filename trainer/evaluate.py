"""Evaluation of a head: simulated acceptance on held-out records, and the real one in the engine.

Simulated (`simulate_acceptance`): from every start row p of held-out records the head drafts
greedily (the TTT unroll, teacher-forced on the recorded tokens) and each draft is compared with
the target's greedy choice g[r] = argmax lm_head(final_hidden[r]) at that position. Draft k of
anchor p is *eligible* when drafts 0..k-1 were accepted and the recorded tokens follow the
target's greedy path (tokens[p+j+2] == g[p+j+1] for j < k), so the recorded features are the ones
the engine would see; alpha_k = accepted_k / eligible_k, and the expected accept length for K
drafts (bonus excluded) is sum_{j=1..K} prod_{k<j} alpha_k. On records the target generated
greedily every anchor is eligible and this is the exact mean over start positions; on
teacher-forced text it is the conditional estimate.

Real (`engine_accept_length`): greedy generation through `serving.engine.Engine` with K fixed;
`engine.on_round` collects `accepted` per round; returns the mean accept length and tokens/s.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from online_spec.sampling import SamplingParams
from trainer.batch import collate
from trainer.loss import SharedTarget, ttt_hidden


@torch.no_grad()
def simulate_acceptance(head, target, records: Sequence, max_steps: int = 7, batch_size: int | None = None,
                        ks: Sequence[int] = (1, 3, 5, 7), generated_only: bool = False) -> dict:
    """-> {"alpha": [alpha_k], "accept_length": {str(K): ...}, "anchors": n}.
    generated_only: anchors only where the engine drafts (the last prompt row onwards: row p+1 is
    a decode row of a span with per-row `is_prefill`), so self-distilled records give the mean
    accept length over generated positions, prompts excluded."""
    hits, eligible = record_counts(head, target, records, max_steps, batch_size, generated_only)
    return acceptance_from_counts(hits.sum(0), eligible.sum(0), ks)


@torch.no_grad()
def record_counts(head, target, records: Sequence, max_steps: int = 7, batch_size: int | None = None,
                  generated_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per record: (hits, eligible), each [len(records), max_steps], drafts accepted and eligible
    at each draft position (see the module docstring); their column sums give alpha. Kept per
    record so that a caller can reuse one head's counts on records it has already seen.
    batch_size None: 1 on a CPU (a padded batch costs its longest record's rows for every record:
    the daemon's gate sample of 1,024 rows took 2.6 s in batches of 4, 1.9 s one by one, one
    core), 4 on an accelerator."""
    head = head.eval()
    if batch_size is None:
        batch_size = 1 if head.fc.weight.device.type == "cpu" else 4
    shared = SharedTarget.build(target, head)
    lm_head = target.lm_head.weight.detach()
    d2t = head.draft_to_target
    hits = torch.zeros(len(records), max_steps)
    eligible = torch.zeros(len(records), max_steps)
    dtype = head.fc.weight.dtype
    # batches of similar lengths (a batch is padded to its longest record); counts go back in order
    order = sorted(range(len(records)), key=lambda j: records[j].num_rows)
    for i in range(0, len(records), batch_size):
        idx = order[i:i + batch_size]
        part = [records[j] for j in idx]
        batch = collate(part).to(head.fc.weight.device)
        B, T = batch.row_mask.shape
        alive = batch.row_mask.clone()  # anchor p still eligible
        if generated_only:
            decode = torch.zeros_like(alive)
            for b, r in enumerate(part):
                decode[b, :r.num_rows - 1] = ~r.is_prefill[1:]
            alive &= decode
        bf16 = dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            steps = ttt_hidden(head, batch, shared, max_steps)
        for k, h in enumerate(steps):
            n = T - k - 1
            if n <= 0:
                break
            alive = alive[:, :n] & batch.row_mask[:, k + 1:k + 1 + n]
            # the vocabulary projections only where an anchor is still eligible: the target's
            # greedy token g[p + k + 1] and the head's draft at p (most rows of a span are its
            # prompt, and most anchors stop within a few steps)
            bi, pi = alive.nonzero(as_tuple=True)
            g = (batch.final_hidden[bi, pi + k + 1].to(lm_head.dtype) @ lm_head.T).argmax(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                draft = head.logits(h[bi, pi]).argmax(-1)
            hit = d2t[draft] == g
            eligible[idx, k] = alive.sum(1).float().cpu()
            hits[idx, k] = torch.zeros(B).index_add_(0, bi.cpu(), hit.float().cpu())
            alive = torch.zeros_like(alive)
            alive[bi, pi] = hit & (batch.tokens[bi, pi + k + 2] == g)
    return hits, eligible


LIVE_CACHE_SPANS = 4096  # spans whose live-head counts are kept (one span's: 2 x max_steps floats)


class LiveCounts:
    """The live head's `record_counts` per span, each span counted once while that head stays
    live (the gate compares every candidate with it on mostly the same held-out spans). Spans
    are immutable: a (request id, first position, rows) key names the same rows."""

    def __init__(self, head, target, max_steps: int):
        self.head, self.target, self.max_steps = head, target, max_steps
        self._cache: dict = {}  # key -> (hits, eligible)

    def counts(self, spans: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(hits, eligible) per span, [spans, max_steps] each, counting only spans not seen yet."""
        keys = [(s.request_id, s.first_pos, s.num_rows) for s in spans]
        todo = [i for i, k in enumerate(keys) if k not in self._cache]
        if todo:
            hits, eligible = record_counts(self.head, self.target, [spans[i] for i in todo], self.max_steps,
                                           generated_only=True)
            if len(self._cache) + len(todo) > LIVE_CACHE_SPANS:
                self._cache.clear()
            for j, i in enumerate(todo):
                self._cache[keys[i]] = (hits[j], eligible[j])
        return (torch.stack([self._cache[k][0] for k in keys]), torch.stack([self._cache[k][1] for k in keys]))


def acceptance_from_counts(hits: torch.Tensor, eligible: torch.Tensor, ks: Sequence[int]) -> dict:
    """alpha per draft position and the expected accept length at each K from summed counts."""
    alpha = (hits / eligible.clamp_min(1)).tolist()
    out = {"alpha": alpha, "anchors": int(eligible[0]), "accept_length": {}}
    for K in ks:
        total, run = 0.0, 1.0
        for k in range(min(K, len(alpha))):
            run *= alpha[k]
            total += run
        out["accept_length"][str(K)] = total
    return out


def engine_accept_length(target, head, prompts: list[list[int]], num_steps: int, max_tokens: int = 64,
                         max_len: int = 2048) -> dict:
    """Greedy decode of `prompts` one at a time (batch 1) with K = num_steps (0: plain decode)
    -> accept_length (mean over rounds, bonus excluded), tokens_per_s, outputs."""
    from serving.engine import Engine, EngineConfig  # transformers: the gate's simulation needs only torch

    eng = Engine(target, head if num_steps > 0 else None,
                 EngineConfig(max_batch=1, max_len=max_len, max_steps=max(num_steps, 1), num_steps=num_steps))
    accepted: list[int] = []
    eng.on_round.append(lambda stats, outs: accepted.extend(stats.accepted) if stats.num_steps else None)
    outputs, n_tok, elapsed = [], 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = eng.generate([p], SamplingParams(max_tokens=max_tokens))[0]
        elapsed += time.perf_counter() - t0
        n_tok += len(out)
        outputs.append(out)
    return {"accept_length": statistics.fmean(accepted) if accepted else 0.0, "rounds": len(accepted),
            "tokens_per_s": n_tok / max(elapsed, 1e-9), "tokens": n_tok, "outputs": outputs}
