"""The packed grouped-query attention equals SDPA's own GQA broadcast, for every shape the
engine uses (batch 1 decode without a mask, ragged batches with a mask, verify lengths)."""

import pytest
import torch
import torch.nn.functional as F

from online_spec.kvcache import AttentionBatch, KVCache, packed_gqa_attention


def reference(q, keys, vals, mask):
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
    B, nh, T, hd = q.shape
    return out.transpose(1, 2).reshape(B, T, nh * hd)


@pytest.mark.parametrize("nh,kvh", [(9, 3), (4, 1), (3, 3)])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 6), (4, 1), (16, 2), (5, 8)])
def test_packed_equals_sdpa_gqa(nh, kvh, B, T):
    g = torch.Generator().manual_seed(B * 100 + T)
    L = 37
    q = torch.randn(B, nh, T, 16, generator=g, dtype=torch.float64)
    keys = torch.randn(B, kvh, L, 16, generator=g, dtype=torch.float64)
    vals = torch.randn(B, kvh, L, 16, generator=g, dtype=torch.float64)
    starts = torch.randint(0, L - T + 1, (B,), generator=g)
    pos = starts[:, None] + torch.arange(T)[None]
    mask = None if B == 1 and T == 1 else (torch.arange(L)[None, None, None] <= pos[:, None, :, None])
    if mask is not None:
        assert not mask.all(), "the mask must hide some keys, or it tests nothing"
    masks: dict = {}
    got = packed_gqa_attention(q, keys, vals, mask, masks)
    torch.testing.assert_close(got, reference(q, keys, vals, mask), rtol=1e-12, atol=1e-12)
    again = packed_gqa_attention(q, keys, vals, mask, masks)  # the cached packed mask is reused
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_attention_batch_attends_its_slots_only():
    """Through AttentionBatch: each slot sees its own cached keys up to its position."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 3, 2, 20, 8, torch.float64)
    for s in range(3):
        cache.k[0][s] = torch.randn(2, 20, 8, generator=g, dtype=torch.float64)
        cache.v[0][s] = torch.randn(2, 20, 8, generator=g, dtype=torch.float64)
    starts, T = [4, 9, 0], 3
    batch = AttentionBatch(starts, T)
    q = torch.randn(3, 6, T, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, T, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, T, 8, generator=g, dtype=torch.float64)
    out = batch.attend(cache, 0, q, k, v)
    for b, s in enumerate(starts):
        for t in range(T):
            n = s + t + 1  # keys 0 .. s + t
            ks = cache.k[0][b, :, :n].repeat_interleave(3, 0)  # query head h reads kv head h // 3
            vs = cache.v[0][b, :, :n].repeat_interleave(3, 0)
            w = torch.softmax((q[b, :, t, None] * ks).sum(-1) / 8 ** 0.5, -1)  # [6, n]
            want = (w[..., None] * vs).sum(1).reshape(-1)
            torch.testing.assert_close(out[b, t], want, rtol=1e-10, atol=1e-10)


def _filled_cache(layers=3, slots=3, L=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(layers, slots, 2, L, 4, torch.float64)
    for layer in range(layers):  # through the per-layer views, as the forwards write
        cache.k[layer].copy_(torch.randn(slots, 2, L, 4, generator=g, dtype=torch.float64))
        cache.v[layer].copy_(torch.randn(slots, 2, L, 4, generator=g, dtype=torch.float64))
    return cache


def test_gather_rows_moves_every_layers_rows_and_nothing_else():
    """A tree round's commit: row src[b, j] of slot b lands on row dst[b, j] in every layer's
    keys and values (a path onto consecutive rows; past the path a row onto itself); every other
    row and slot keeps its values. The reference is the per-layer copy."""
    cache = _filled_cache()
    before_k = [k.clone() for k in cache.k]
    before_v = [v.clone() for v in cache.v]
    src = torch.tensor([[7, 9, 4], [5, 5, 5]])  # slot 0: a path at scratch rows 7, 9; slot 1: nothing accepted
    dst = torch.tensor([[5, 6, 4], [5, 5, 5]])
    cache.gather_rows(src, dst)
    for layer in range(3):
        for c, before in ((cache.k, before_k), (cache.v, before_v)):
            want = before[layer].clone()
            for b in range(2):
                for j in range(3):
                    want[b, :, dst[b, j]] = before[layer][b, :, src[b, j]]
            assert torch.equal(c[layer], want), f"layer {layer}"
            assert not torch.equal(c[layer], before[layer])  # it moved something
    assert torch.equal(cache.k[2][2], before_k[2][2])  # slot 2 is not in the batch


def test_move_slot_copies_every_layer_up_to_the_length():
    cache = _filled_cache()
    before = {"k": [k.clone() for k in cache.k], "v": [v.clone() for v in cache.v]}
    cache.lengths[2] = 6
    cache.move_slot(2, 0)
    assert cache.lengths == [6, 0, 0]
    for name, now in (("k", cache.k), ("v", cache.v)):
        for layer in range(3):
            was = before[name][layer]
            assert torch.equal(now[layer][0, :, :6], was[2, :, :6]), (name, layer)
            assert torch.equal(now[layer][0, :, 6:], was[0, :, 6:])  # past the length: untouched
            assert torch.equal(now[layer][1], was[1])
