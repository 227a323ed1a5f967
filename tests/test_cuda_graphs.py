"""CUDA-graph path of the engine (serving/cuda_graphs.py).

On CPU: the capturable forward (StaticBatch: padded batch, whole-cache keys under a mask,
positions in a buffer) computes what the eager AttentionBatch forward does, for the target and
the head, and padding rows touch only free slots. On a GPU (skipped here): the graphed engine's
greedy output equals the eager engine's token for token (scripts/gpu_bench.py does the same
with the real model and the shipped head).
"""

import pytest
import torch

from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.cuda_graphs import CudaGraphs, StaticBatch, buckets_for
from serving.engine import Engine, EngineConfig

MAX_LEN = 64


def test_buckets():
    assert buckets_for(16) == [1, 2, 4, 8, 16]
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    assert buckets_for(1) == [1]


def _prefilled(target, lens, slots=4, seed=0):
    """A cache with slot b holding a random prompt of lens[b] tokens (slots beyond: free)."""
    g = torch.Generator().manual_seed(seed)
    cache = target.new_cache(slots, MAX_LEN)
    for b, n in enumerate(lens):
        ids = torch.randint(1, 500, (1, n), generator=g)
        view = _view(cache, b)
        target.forward(ids, AttentionBatch([0], n), view)
        cache.lengths[b] = n
    return cache


def _view(cache, b):
    from serving.engine import _SlotView
    return _SlotView(cache, b)


def _static(B, Bp, T, starts):
    sb = StaticBatch(Bp, T, MAX_LEN, "cpu")
    pos = torch.zeros(Bp, dtype=torch.long)
    pos[:B] = torch.tensor(starts)
    sb.positions.copy_(pos[:, None] + torch.arange(T)[None])
    sb.build_mask()
    return sb


@pytest.mark.parametrize("T", [1, 4])
def test_static_batch_target_forward_matches_eager(T):
    target = tiny_target()
    lens = [7, 12, 3]
    eager_cache, static_cache = _prefilled(target, lens), _prefilled(target, lens)
    tokens = torch.randint(1, 500, (3, T), generator=torch.Generator().manual_seed(1))
    ref = target.forward(tokens, AttentionBatch(lens, T), eager_cache)
    padded = torch.cat([tokens, torch.zeros(1, T, dtype=torch.long)])  # batch padded to a bucket of 4
    got = target.forward(padded, _static(3, 4, T, lens), static_cache)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g[:3], r, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0][:3].argmax(-1), ref[0].argmax(-1))
    for layer in range(target.info.num_layers):  # the real slots' cache rows are the eager ones
        for b, n in enumerate(lens):
            torch.testing.assert_close(static_cache.k[layer][b, :, :n + T], eager_cache.k[layer][b, :, :n + T])
            torch.testing.assert_close(static_cache.v[layer][b, :, :n + T], eager_cache.v[layer][b, :, :n + T])


def test_static_batch_head_step_matches_eager():
    target = tiny_target()
    head = new_head(target, draft_vocab_size=256, seed=3).float()
    g = torch.Generator().manual_seed(2)
    lens, T, H = [5, 9], 3, target.info.hidden_size
    caches = []
    for _ in range(2):
        c = head.new_cache(4, MAX_LEN)
        for b, n in enumerate(lens):  # same history in both caches
            emb = target.embed_tokens(torch.arange(1, n + 1)[None] * (b + 1))
            feats = torch.linspace(-1, 1, n * 3 * H).view(1, n, 3 * H) * (b + 1)
            head.fill_cache(emb, feats, b, 0, c, target.rope)
        caches.append(c)
    emb = torch.randn(2, T, H, generator=g)
    hid = torch.randn(2, T, H, generator=g)
    ref = head.step(emb, hid, AttentionBatch(lens, T), caches[0], target.rope)
    pad = torch.zeros(2, T, H)
    got = head.step(torch.cat([emb, pad]), torch.cat([hid, pad]), _static(2, 4, T, lens), caches[1], target.rope)
    for r, x in zip(ref, got):
        torch.testing.assert_close(x[:2], r, rtol=1e-5, atol=1e-5)


def test_rope_bound_is_the_same_table():
    target = tiny_target()
    pos = torch.tensor([[3, 4, 5], [40, 41, 42]])
    a = target.rope(pos)
    b = target.rope(pos, 43)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_graphs_on_cpu():
    target = tiny_target()
    assert CudaGraphs.for_engine(target, 4, 128) is None
    eng = Engine(target, None, EngineConfig(max_batch=2, max_len=128, num_steps=0))
    assert eng.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_engine_equals_eager_on_gpu():
    target = tiny_target().to("cuda")
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6, [8, 16, 24]]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for K in (0, 3):
        outs = []
        for graphs in (False, True):
            eng = Engine(target, head if K else None,
                         EngineConfig(max_batch=4, max_len=128, num_steps=K, cuda_graphs=graphs))
            outs.append(eng.generate(prompts, sp))
            assert (eng.graphs is not None) == graphs and (not graphs or eng.graphs.captures > 0)
        assert outs[0] == outs[1]
