"""Shared pieces of the distillation tests: a tiny target whose three captured layers are
distinct (8 layers) and records of its own greedy continuations (so the recorded tokens are the
target's choices, as in live traffic)."""

from __future__ import annotations

import torch

from online_spec.target import tiny_target


def tiny8():
    return tiny_target(num_layers=8)


def greedy_records(target, num: int = 6, prompt_len: int = 8, new_tokens: int = 40, seed: int = 0):
    """Records (one per sequence) of the target's own greedy continuations of random prompts."""
    from trainer.data import capture_tokens

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(num):
        ids = torch.randint(0, target.info.vocab_size - 1, (prompt_len,), generator=g).tolist()
        for _ in range(new_tokens):
            with torch.no_grad():
                logits = target.hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        seqs.append(ids)
    return capture_tokens(target, seqs, [f"greedy-{i}" for i in range(num)]), seqs


def trained_head(target, records, steps: int = 40, seed: int = 0):
    """A fresh head (draft vocabulary 256) trained `steps` steps on `records` at a high rate: it
    drafts them well enough that drafts are accepted at several steps."""
    from online_spec.head import new_head
    from trainer.batch import collate
    from trainer.distill import DistillConfig, Distiller
    from trainer.loss import LossConfig

    dist = Distiller(target, new_head(target, 256, seed=seed).float(),
                     DistillConfig(lr=3e-3, warmup_steps=0, schedule="constant"), LossConfig(ttt_steps=3))
    for _ in range(steps):
        dist.train_step(collate(records))
    return dist.head
