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
