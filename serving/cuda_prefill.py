"""Graphed prefill: a new prompt through the target in CUDA-graph replays of fixed-size chunks.

An eager prefill is launch-bound on a GPU like an eager decode step: the target's ~30 layers
launch a dozen kernels each, and the Python around them costs more than the arithmetic. On an
H200's host one eager prefill took ~20-40 ms whatever the prompt's length (46 tokens: 19-24 ms,
330: 33 ms; scripts/gpu_admission_probe.py), several plain rounds' worth, paid at every
admission; in the served e2e prefills were a quarter of a static configuration's serving time.

A prompt of P tokens runs as chunks of at most PREFILL_CHUNKS[-1] tokens, each padded up to the
smallest chunk size that holds it; a chunk is one replay of the graph of its size. The slot is a
device buffer (`SlotBatch`), so one graph per chunk size serves every slot. Padding rows sit at
positions after the prompt (clamped to the cache's last row): they write K/V only into rows of
this slot beyond its committed length, which no committed row attends to and the next forward
rewrites before any reads them. Only the last real row's logits are computed (its index is a
device buffer too). Mixed into `CudaGraphs` (serving/cuda_graphs.py), whose capture, replay and
memory pool it shares; the engine calls `prefill` where it would run the eager forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_CHUNKS = (16, 32, 64, 128, 256, 512)  # chunk sizes with a graph; longer prompts run several


class SlotBatch:
    """`AttentionBatch`'s interface for T new rows of one slot chosen per replay: positions and
    the slot are device buffers the caller fills; keys are the slot's whole cache under a causal
    mask built (inside the graph) from the positions."""

    def __init__(self, T: int, max_len: int, device):
        self.B, self.T, self.kv_len, self.rope_bound = 1, T, max_len, max_len
        self.positions = torch.zeros(1, T, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self._keys = torch.arange(max_len, device=device)
        self.mask = None

    def build_mask(self) -> None:
        self.mask = self._keys[None, None, None, :] <= self.positions[:, None, :, None]

    def attend(self, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = cache.k[layer], cache.v[layer]
        rows = self.slot[:, None].expand(1, self.T)
        ck[rows, :, self.positions] = k.transpose(1, 2)
        cv[rows, :, self.positions] = v.transpose(1, 2)
        keys, vals = ck.index_select(0, self.slot), cv.index_select(0, self.slot)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask, enable_gqa=q.shape[1] != ck.shape[1])
        return out.transpose(1, 2).reshape(1, self.T, -1)


def chunk_plan(P: int) -> list[tuple[int, int, int]]:
    """(start, real rows, chunk size) of each replay that prefills P tokens."""
    plan, s = [], 0
    while s < P:
        n = min(P - s, PREFILL_CHUNKS[-1])
        plan.append((s, n, next(c for c in PREFILL_CHUNKS if c >= n)))
        s += n
    return plan


class PrefillGraphs:
    """`CudaGraphs.prefill` and its warm-up; reads the runner's target, device, max_len, _get, _run."""

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, slot: int, cache):
        """ids [P] (host) into slot `slot` of `cache` from row 0 -> (logits of the last row [V],
        features [P, 3H], final hidden [P, H]), as the eager `TargetModel.forward` of the prompt."""
        P = ids.shape[0]
        feats, finals, logits = [], [], None
        for s, n, C in chunk_plan(P):
            g = self._prefill_graph(C, cache)
            tokens = torch.zeros(1, C, dtype=torch.long)
            tokens[0, :n] = ids[s:s + n]
            g.inputs["tokens"].copy_(tokens)
            g.inputs["last"].fill_(n - 1)
            g.batch.slot.fill_(slot)
            g.batch.positions.copy_(torch.arange(s, s + C).clamp_max(self.max_len - 1)[None])
            logits, f, h = self._run(g, 1)
            feats.append(f[0, :n])
            finals.append(h[0, :n])
        return logits[0, 0], torch.cat(feats), torch.cat(finals)

    def warm_prefill(self, cache) -> None:
        """Capture every chunk size's graph (dummy rows into slot 0 of `cache`, rows 0..C-1)."""
        for C in PREFILL_CHUNKS:
            if C <= self.max_len:
                self.prefill(torch.zeros(C, dtype=torch.long), 0, cache)

    def _prefill_graph(self, C: int, cache):
        target = self.target

        def make(_):
            return {"tokens": torch.zeros(1, C, dtype=torch.long, device=self.device),
                    "last": torch.zeros(1, dtype=torch.long, device=self.device)}

        def run(ins, sb):
            _, f, h = target.forward(ins["tokens"], sb, cache, logits_rows=None)
            return target.lm_head(h.index_select(1, ins["last"])), f, h

        return self._get(("prefill", 1, C), (cache,), make, run, batch=SlotBatch(C, self.max_len, self.device))
