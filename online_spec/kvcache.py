"""Slot KV cache shared by the target model and the draft head.

Each running request owns a slot; keys/values live in one preallocated tensor each,
`[num_layers, num_slots, kv_heads, max_len, head_dim]`, and `k[layer]` / `v[layer]` are its
per-layer views, so what moves rows of every layer (`gather_rows`, `move_slot`) is one copy, not
one per layer. A forward writes its new positions at
`start[b] .. start[b] + T - 1` and attends to everything before them; rolling back past a
rejected draft is just lowering `lengths[b]` (entries beyond are garbage and masked out).
Active requests occupy slots `0 .. B-1` so a batch is a view, never a gather; when one leaves,
`move_slot` copies the last one into its place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.k_all.unbind(0))  # views: a write through k[layer] is a write to k_all
        self.v = list(self.v_all.unbind(0))
        self.lengths = [0] * num_slots

    def move_slot(self, src: int, dst: int) -> None:
        n = self.lengths[src]
        self.k_all[:, dst, :, :n] = self.k_all[:, src, :, :n]
        self.v_all[:, dst, :, :n] = self.v_all[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def gather_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy row src[b, j] to row dst[b, j] of slot b (slots 0..B-1), every layer: a tree
        round's accepted path moved from its scratch rows to consecutive positions. Keys keep
        their rope (the path node at depth d was written at position base + d, where it lands).
        Every layer in one gather and one write per tensor (the rows are read whole before any is
        written): on an H100 the per-layer loop was 120 of a tree verify graph's 1,718 kernels."""
        B = src.shape[0]
        b_idx = torch.arange(B, device=src.device)[:, None].expand_as(src)
        self.k_all[:, b_idx, :, dst] = self.k_all[:, b_idx, :, src]
        self.v_all[:, b_idx, :, dst] = self.v_all[:, b_idx, :, src]


def packed_gqa_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
                         packed_masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped-query attention with each KV head's query heads packed into the query length.

    q [B,nh,T,hd], keys/vals [B,kvh,L,hd], mask [B,1,T,L] or None -> [B,T,nh*hd]. Query head h
    reads KV head h // (nh/kvh) (SDPA's `enable_gqa`), so q viewed as [B,kvh,group*T,hd] is
    the same product with kvh heads and group*T queries: one matrix product per KV head instead
    of a broadcast per query head. On CPU this is what keeps decode fast: torch 2.13's SDPA
    with enable_gqa takes 1.73 ms for B=16, T=1, L=300 (SmolLM2's 9/3 heads, bf16, 2 threads)
    and 0.29 ms packed, 0.55 / 0.33 ms at T=2 (docs/engine.md). `packed_masks` caches the
    repeated mask by group size across the layers of one forward.
    """
    B, nh, T, hd = q.shape
    kvh = keys.shape[1]
    group = nh // kvh
    if group == 1:
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return out.transpose(1, 2).reshape(B, T, nh * hd)
    if mask is not None:
        packed = None if packed_masks is None else packed_masks.get(group)
        if packed is None:
            packed = mask.repeat(1, 1, group, 1)  # row g*T + t is query t of group member g
            if packed_masks is not None:
                packed_masks[group] = packed
        mask = packed
    out = F.scaled_dot_product_attention(q.reshape(B, kvh, group * T, hd), keys, vals, attn_mask=mask)
    return out.reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)


class AttentionBatch:
    """Where a forward of T new tokens per slot writes and what it may attend to.

    starts[b]: first new position of slot b (slots 0..B-1). Built once per forward and shared by
    all layers, so the mask and indices are computed once.
    """

    def __init__(self, starts: list[int], num_new: int, device: torch.device | str = "cpu"):
        self.starts = starts
        self.B, self.T = len(starts), num_new
        self.kv_len = max(starts) + num_new
        self.rope_bound = self.kv_len  # positions are < kv_len (TargetModel.rope sizes its table from it)
        t = torch.arange(num_new, device=device)
        st = torch.tensor(starts, device=device)
        self.positions = st[:, None] + t[None, :]  # [B, T]
        self.b_idx = torch.arange(self.B, device=device)[:, None].expand(self.B, num_new)
        if self.B == 1 and num_new == 1:
            self.mask = None  # one query sees every cached key
        else:
            keys = torch.arange(self.kv_len, device=device)
            self.mask = (keys[None, None, None, :] <= self.positions[:, None, :, None])  # [B,1,T,L]
        self._packed_masks: dict[int, torch.Tensor] = {}  # the mask per query-head group, built once

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B,nh,T,hd], k/v [B,kvh,T,hd] (rope applied) -> attention output [B,T,nh*hd]."""
        ck, cv = cache.k[layer], cache.v[layer]
        if self.B == 1:
            s = self.starts[0]
            ck[0, :, s:s + self.T] = k[0]
            cv[0, :, s:s + self.T] = v[0]
        else:
            ck[self.b_idx, :, self.positions] = k.transpose(1, 2)
            cv[self.b_idx, :, self.positions] = v.transpose(1, 2)
        keys = ck[:self.B, :, :self.kv_len]
        vals = cv[:self.B, :, :self.kv_len]
        return packed_gqa_attention(q, keys, vals, self.mask, self._packed_masks)


class TreeAttentionBatch:
    """Where a forward over draft-tree nodes writes, and what each node may attend to.

    Slot b's committed rows are 0..base[b]-1; the tree's rows live in a scratch region of
    `scratch` rows from base[b]. write [B,T] is each new row's cache index (in the scratch
    region), positions [B,T] its rope position (base + depth, so siblings share a position),
    visible [B,T,scratch] which scratch rows it attends to (its ancestors and itself). Every
    node attends to all committed rows. Same interface as `AttentionBatch`."""

    def __init__(self, base: list[int], write: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                 device: torch.device | str = "cpu"):
        self.starts = base
        self.B, self.T = write.shape
        scratch = visible.shape[-1]
        self.kv_len = max(base) + scratch
        self.rope_bound = self.kv_len
        self.positions = positions.to(device)
        self.write = write.to(device)
        self.b_idx = torch.arange(self.B, device=device)[:, None].expand(self.B, self.T)
        keys = torch.arange(self.kv_len)
        off = keys[None, :] - torch.tensor(base)[:, None]  # [B, L]: key's offset into the scratch region
        in_scratch = (off >= 0) & (off < scratch)
        seen = visible.gather(2, off.clamp(0, scratch - 1)[:, None, :].expand(self.B, self.T, self.kv_len))
        self.mask = ((off < 0)[:, None, :] | (in_scratch[:, None, :] & seen))[:, None].to(device)  # [B,1,T,L]
        self._packed_masks: dict[int, torch.Tensor] = {}

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B,nh,T,hd], k/v [B,kvh,T,hd] (rope applied) -> attention output [B,T,nh*hd]."""
        ck, cv = cache.k[layer], cache.v[layer]
        ck[self.b_idx, :, self.write] = k.transpose(1, 2)
        cv[self.b_idx, :, self.write] = v.transpose(1, 2)
        keys = ck[:self.B, :, :self.kv_len]
        vals = cv[:self.B, :, :self.kv_len]
        return packed_gqa_attention(q, keys, vals, self.mask, self._packed_masks)
