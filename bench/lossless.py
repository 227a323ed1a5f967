"""Checks of the lossless invariant (contract 6), shared by the tests and `bench engine`.

`wrong_head` makes a head whose drafts are always wrong (uniform logits: it always proposes
draft id 0, a special token); `CyclingSteps` is a policy that changes K every round;
`first_divergence` locates where two greedy outputs part, and `tie_gap` measures how close
the target itself was to a tie there.
"""

from __future__ import annotations

import itertools

import torch

from online_spec.controller import StepPolicyBase
from online_spec.head import EagleHead, new_head
from online_spec.kvcache import AttentionBatch
from online_spec.target import TargetModel


def wrong_head(target: TargetModel, seed: int = 5) -> EagleHead:
    head = new_head(target, seed=seed)
    with torch.no_grad():
        head.lm_head.weight.zero_()
    return head


class CyclingSteps(StepPolicyBase):
    """K cycling through `ks`, one per round (a policy the engine must follow exactly)."""

    name = "cycling"
    tree_rounds = True

    def __init__(self, ks=(0, 1, 3, 7)):
        self._ks = itertools.cycle(ks)
        self.k = next(self._ks)

    def steps_for(self, batch_size, ctx_len=0):
        return self.k

    def update(self, batch_size, accepted, **_):
        self.k = next(self._ks)
        return self.k


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@torch.inference_mode()
def tie_gap(target: TargetModel, ids: list[int], tokens: tuple[int, ...]) -> float:
    """How far below the target's top logit the lowest of `tokens` is, for the token after `ids`
    (one fresh forward): two tokens both within a rounding step of the top are a near-tie."""
    x = torch.tensor([ids], device=target.device)
    cache = target.new_cache(1, len(ids) + 1)
    logits, _, _ = target.forward(x, AttentionBatch([0], len(ids), target.device), cache, slice(-1, None))
    row = logits[0, -1].float()
    return float(row.max() - min(row[t] for t in tokens))
