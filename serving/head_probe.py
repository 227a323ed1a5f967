"""Running a head before trusting it: does a draft step give finite logits?

A checkpoint can pass every static check (names, shapes, dtypes, finite weights) and still be
unusable: weights near the dtype's largest value (~3e38) overflow in the first matmul, and
every sampled request then fails on a NaN probability. `HeadProbe.check(head)` runs the head
the way the engine drafts with it — a catch-up over committed rows, then one chained step on its
own draft — and returns the reason it is unusable, or None.

Two kinds of input:
- the fixed probe (the default): the target's own EAGLE-3 features of a short fixed token
  sequence, computed once (one target forward) and reused; what a swap candidate is checked on
  before it goes live (serving/swap.py);
- `rows`: committed rows of live traffic (token ids and their features), what the server
  checks the live head on between rounds (serving/server.py).

    probe = HeadProbe(target)
    problem = probe.check(head)            # None, or e.g. "draft logits are not finite (...)"
"""

from __future__ import annotations

import threading

import torch

from online_spec.head import EagleHead
from online_spec.kvcache import AttentionBatch

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
PROBE_ROWS = 16


class HeadProbe:
    """A head's draft step on probe rows; see the module docstring."""

    def __init__(self, target):
        self.target = target
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None  # tokens [T + 1], features [T, 3H]
        self._lock = threading.Lock()

    def fixed_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [T + 1] and the target's features of the first T of them [T, 3H] (computed once)."""
        with self._lock:
            if self._fixed is None:
                t = self.target
                tok = t.tokenizer
                ids = tok.encode(PROBE_TEXT) if tok is not None else []
                if len(ids) < PROBE_ROWS + 1:
                    ids = [(7 * i + 1) % t.info.vocab_size for i in range(PROBE_ROWS + 1)]
                ids = torch.tensor(ids[:PROBE_ROWS + 1])
                T = len(ids) - 1
                cache = t.new_cache(1, T + 1)
                _, feats, _ = t.forward(ids[None, :T].to(t.device), AttentionBatch([0], T, t.device), cache,
                                        logits_rows=None)
                self._fixed = ids, feats[0]
            return self._fixed

    @torch.inference_mode()
    def check(self, head: EagleHead, rows: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> str | None:
        """Why `head` cannot draft (non-finite logits or hidden states), or None. `rows`: (token
        ids [T + 1], features [T, 3H], position of the first row) of live traffic; default: the
        fixed probe at position 0."""
        t = self.target
        tokens, feats, start = rows if rows is not None else (*self.fixed_rows(), 0)
        T = int(feats.shape[0])
        if T < 1:
            return None
        dev = t.device
        cache = head.new_cache(1, start + T + 1)
        # 1) catch-up: row p reads the embedding of token p + 1 and the target's features of p
        emb = t.embed_tokens(tokens[1:T + 1][None].to(dev))
        logits, hidden = head.step(emb, feats[None].to(dev, t.dtype), AttentionBatch([start], T, dev), cache, t.rope)
        problem = _nonfinite("catch-up", logits, hidden)
        if problem:
            return problem
        # 2) one chained step on its own draft, as the engine's second draft step
        d = int(logits[0, -1].float().argmax())
        draft = head.draft_to_target[d].reshape(1, 1).to(dev)
        logits, hidden = head.step(t.embed_tokens(draft), hidden[:, -1:], AttentionBatch([start + T], 1, dev), cache,
                                   t.rope)
        return _nonfinite("chained step", logits, hidden)


def _nonfinite(stage: str, logits: torch.Tensor, hidden: torch.Tensor) -> str | None:
    for name, x in (("draft logits", logits), ("hidden states", hidden)):
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            return f"{name} are not finite in a probe draft ({stage}: {bad} of {x.numel()} values)"
    return None
