"""Graphed prefill: a new prompt through the target in CUDA-graph replays of fixed-size chunks.

An eager prefill is launch-bound on a GPU like an eager decode step: the target's ~30 layers
launch a dozen kernels each, and the Python around them costs more than the arithmetic. On an
H200's host one eager prefill took ~20-40 ms whatever the prompt's length (46 tokens: 19-24 ms,
330: 33 ms; scripts/gpu_admission_probe.py), several plain rounds' worth, paid at every
admission; in the served e2e prefills were a quarter of a static configuration's serving time.

A prompt of P tokens runs as chunks of at most PREFILL_CHUNKS[-1] tokens, each padded up to the
smallest chunk size that holds it; a chunk is one replay of the graph of its size. The slot is a
device buffer (`SlotBatch`, serving/cuda_graphs.py), so one graph per chunk size serves every
slot. Padding rows sit at positions after the prompt (clamped to the cache's last row): they
write K/V only into rows of this slot beyond its committed length, which no committed row
attends to and the next forward rewrites before any reads them. Only the last real row's logits
are computed (its index is a device buffer too). The draft head's catch-up over a new prompt
(`head_fill`: its K/V of every row but the last) runs the same way over the draft cache. Mixed
into `CudaGraphs` (serving/cuda_graphs.py), whose capture, replay and memory pool it shares; the
engine calls `prefill` and `head_fill` where it would run the eager forwards.
"""

from __future__ import annotations

import torch

PREFILL_CHUNKS = (16, 32, 64, 128, 256, 512)  # chunk sizes with a graph; longer prompts run several


def chunk_plan(P: int) -> list[tuple[int, int, int]]:
    """(start, real rows, chunk size) of each replay that prefills P tokens."""
    plan, s = [], 0
    while s < P:
        n = min(P - s, PREFILL_CHUNKS[-1])
        plan.append((s, n, next(c for c in PREFILL_CHUNKS if c >= n)))
        s += n
    return plan


class PrefillGraphs:
    """`CudaGraphs.prefill`, `head_fill` and their warm-up; reads the runner's target, device,
    max_len, _head_module, _get, _run, _slot_batch (a `SlotBatch`)."""

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

    @torch.inference_mode()
    def head_fill(self, head, cache, embeds: torch.Tensor, hidden: torch.Tensor, slot: int, start: int) -> None:
        """The draft head's K/V of rows start..start+T-1 of slot `slot` into `cache` (embeds
        [T, H], hidden [T, 3H], on the device), as `EagleHead.fill_cache`: a new prompt's rows,
        or rows served at K = 0, in chunk replays of the head's step (its outputs unread)."""
        T = embeds.shape[0]
        for s, n, C in chunk_plan(T):
            g = self._head_fill_graph(head, cache, C, embeds.shape[-1], hidden.shape[-1], embeds.dtype)
            g.inputs["embeds"][0, :n].copy_(embeds[s:s + n])
            g.inputs["hidden"][0, :n].copy_(hidden[s:s + n])
            g.batch.slot.fill_(slot)
            g.batch.positions.copy_(torch.arange(start + s, start + s + C).clamp_max(self.max_len - 1)[None])
            self._run(g, 1)

    def warm_prefill(self, tcache, head=None, caches=()) -> None:
        """Capture every chunk size's graph: the target's prefill into `tcache` and, with a head,
        its fill of each draft cache in `caches` (dummy rows into slot 0, rows 0..C-1)."""
        dt, H = self.target.dtype, self.target.info.hidden_size
        for C in PREFILL_CHUNKS:
            if C > self.max_len:
                continue
            self.prefill(torch.zeros(C, dtype=torch.long), 0, tcache)
            for cache in caches:
                self.head_fill(head, cache, torch.zeros(C, H, dtype=dt, device=self.device),
                               torch.zeros(C, 3 * head.cfg.target_hidden_size, dtype=dt, device=self.device), 0, 0)

    def _head_fill_graph(self, head, cache, C: int, E: int, W: int, dtype):
        module, rope = self._head_module(head, cache), self.target.rope

        def make(_):
            return {"embeds": torch.zeros(1, C, E, dtype=dtype, device=self.device),
                    "hidden": torch.zeros(1, C, W, dtype=dtype, device=self.device)}

        return self._get(("hfill", 1, C, W), (module, cache), make,
                         lambda ins, sb: module.step(ins["embeds"], ins["hidden"], sb, cache, rope),
                         batch=self._slot_batch(C))

    def _prefill_graph(self, C: int, cache):
        target = self.target

        def make(_):
            return {"tokens": torch.zeros(1, C, dtype=torch.long, device=self.device),
                    "last": torch.zeros(1, dtype=torch.long, device=self.device)}

        def run(ins, sb):
            _, f, h = target.forward(ins["tokens"], sb, cache, logits_rows=None)
            return target.lm_head(h.index_select(1, ins["last"])), f, h

        return self._get(("prefill", 1, C), (cache,), make, run, batch=self._slot_batch(C))
