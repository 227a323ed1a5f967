"""The fixed-shape attention batches the CUDA graphs replay over (serving/cuda_graphs.py,
serving/cuda_prefill.py, serving/cuda_tree.py): each has the interface of its eager counterpart
in online_spec/kvcache.py (`positions`, `rope_bound`, `attend`) over a padded batch and the whole
cache length, with its layout in device buffers the caller fills before a replay and the mask
built inside the graph (`build_mask`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class StaticBatch:
    """`AttentionBatch`'s interface (positions, rope_bound, attend) over a fixed (B, T) and the
    whole cache length, with positions in a device buffer the caller fills before each replay."""

    def __init__(self, B: int, T: int, max_len: int, device):
        self.B, self.T, self.kv_len, self.rope_bound = B, T, max_len, max_len
        self.positions = torch.zeros(B, T, dtype=torch.long, device=device)
        self.b_idx = torch.arange(B, device=device)[:, None].expand(B, T)
        self._keys = torch.arange(max_len, device=device)
        self.mask = None

    def build_mask(self) -> None:
        """Causal mask [B,1,T,max_len] from the current positions (runs inside the graph)."""
        self.mask = self._keys[None, None, None, :] <= self.positions[:, None, :, None]

    def attend(self, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = cache.k[layer], cache.v[layer]
        ck[self.b_idx, :, self.positions] = k.transpose(1, 2)
        cv[self.b_idx, :, self.positions] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, self.rows_of(ck), self.rows_of(cv), attn_mask=self.mask,
                                             enable_gqa=q.shape[1] != ck.shape[1])
        return out.transpose(1, 2).reshape(self.B, self.T, -1)

    def rows_of(self, c: torch.Tensor) -> torch.Tensor:
        """The batch's slots of a cache tensor: slots 0..B-1."""
        return c[:self.B]


class SlotBatch(StaticBatch):
    """A `StaticBatch` of T rows of one slot chosen per replay (`slot`, a device buffer the
    caller fills, like the positions): one graph serves every slot (serving/cuda_prefill.py)."""

    def __init__(self, T: int, max_len: int, device):
        super().__init__(1, T, max_len, device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.b_idx = self.slot[:, None].expand(1, T)  # a view: it follows the slot buffer

    def rows_of(self, c: torch.Tensor) -> torch.Tensor:
        return c.index_select(0, self.slot)


class StaticTreeBatch(StaticBatch):
    """`TreeAttentionBatch`'s interface over a fixed (B, T, scratch) and the whole cache length:
    row (b, t) is written at cache row write[b, t], roped at positions[b, t], and attends to every
    committed row (< base[b]) and the scratch rows base[b] + j with visible[b, t, j]. All four
    are device buffers the caller fills before each replay; the mask is built inside the graph."""

    def __init__(self, B: int, T: int, max_len: int, scratch: int, device):
        super().__init__(B, T, max_len, device)
        self.scratch = scratch
        self.base = torch.zeros(B, dtype=torch.long, device=device)
        self.write = torch.zeros(B, T, dtype=torch.long, device=device)
        self.visible = torch.zeros(B, T, scratch, dtype=torch.bool, device=device)
        # a padding row's visibility (itself only), kept on the device: setting it with a host
        # value every replay would wait for the device (a copy from pageable memory)
        pad = torch.arange(T, device=device)
        self._pad_visible = torch.zeros(T, scratch, dtype=torch.bool, device=device)
        self._pad_visible[pad, pad.clamp_max(scratch - 1)] = True

    def build_mask(self) -> None:
        off = self._keys[None, :] - self.base[:, None]  # [B, L]: each key's offset into the scratch region
        in_scratch = (off >= 0) & (off < self.scratch)
        seen = self.visible.gather(2, off.clamp(0, self.scratch - 1)[:, None, :].expand(self.B, self.T, self.kv_len))
        self.mask = ((off < 0)[:, None, :] | (in_scratch[:, None, :] & seen))[:, None]  # [B,1,T,L]

    def attend(self, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = cache.k[layer], cache.v[layer]
        ck[self.b_idx, :, self.write] = k.transpose(1, 2)
        cv[self.b_idx, :, self.write] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, ck[:self.B], cv[:self.B], attn_mask=self.mask,
                                             enable_gqa=q.shape[1] != ck.shape[1])
        return out.transpose(1, 2).reshape(self.B, self.T, -1)

    def fill(self, B: int, base: torch.Tensor, write: torch.Tensor, positions: torch.Tensor,
             visible: torch.Tensor) -> None:
        """The real rows' layout into the buffers; padding rows (free slots) write rows 0..T-1 of
        their own slot, each seeing only itself."""
        T = self.T
        self.base.zero_()
        self.base[:B].copy_(base)
        pad = torch.arange(T, device=self.write.device)
        self.write.copy_(pad.expand(self.B, T))
        self.write[:B].copy_(write)
        self.positions.copy_(pad.expand(self.B, T))
        self.positions[:B].copy_(positions)
        self.visible.copy_(self._pad_visible.expand_as(self.visible))
        self.visible[:B].copy_(visible)
