"""The engine side of a swap, on a tiny random Llama (the model does not matter here).

The K/V-only cache fill equals the K/V the full head forward writes (naive reference); a swap
under load is staged — the new head's cache is rebuilt a bounded number of rows per round while
the old head drafts — then switches between rounds with a cache equal to a from-scratch rebuild,
and the output stays the target's own greedy output throughout.
"""

import pytest
import torch

from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig
from serving.head_swap import fill_budget

GREEDY = SamplingParams(max_tokens=28, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny8():
    return tiny_target(num_layers=8)


def test_fill_cache_equals_full_forward_kv(tiny8):
    head = new_head(tiny8, seed=2)
    T, H = 37, tiny8.info.hidden_size
    g = torch.Generator().manual_seed(0)
    emb = tiny8.embed_tokens(torch.randint(0, tiny8.info.vocab_size, (1, T), generator=g))
    feats = torch.randn(1, T, 3 * H, generator=g)
    full, fill = head.new_cache(2, 64), head.new_cache(2, 64)
    view = type("View", (), {})()  # slot 1 through a one-slot view, as the engine does
    view.k, view.v, view.lengths = [full.k[0][1:2]], [full.v[0][1:2]], [0]
    head.step(emb, feats, AttentionBatch([5], T), view, tiny8.rope)
    head.fill_cache(emb, feats, 1, 5, fill, tiny8.rope)
    assert torch.allclose(full.k[0], fill.k[0], atol=1e-6) and torch.allclose(full.v[0], fill.v[0], atol=1e-6)
    assert fill.k[0][1, :, 5:5 + T].abs().sum() > 0 and fill.k[0][0].abs().sum() == 0


def test_staged_swap_fills_in_bounded_chunks_then_switches_with_a_full_cache(tiny8):
    prompts = [list(range(3 + i, 60 + 7 * i)) for i in range(3)]
    plain = Engine(tiny8, None, EngineConfig(max_batch=4, max_len=256, num_steps=0)).generate(prompts, GREEDY)
    eng = Engine(tiny8, new_head(tiny8, seed=1), EngineConfig(max_batch=4, max_len=256, num_steps=3,
                                                             swap_fill_rows=24, swap_fill_share=0.0),
                 head_version=1)
    new = new_head(tiny8, seed=9)
    rounds, checked = [], []

    def on_round(stats, outs):
        rounds.append(stats)
        if len(rounds) == 4:
            eng.swap_head(new, 2)
        if stats.swapped and not checked:
            # right after the switch, the live cache equals a from-scratch full-forward rebuild
            for b in range(stats.batch_size):
                n = eng.dcache.lengths[b] - 1  # the last row is rewritten by the next extend
                ref = new.new_cache(1, 256)
                tl = eng.tok_buf[b, 1:n + 1][None]
                new.step(tiny8.embed_tokens(tl), eng.feat_buf[b, :n][None], AttentionBatch([0], n), ref, tiny8.rope)
                assert torch.allclose(eng.dcache.k[0][b, :, :n], ref.k[0][0, :, :n], atol=1e-5)
                checked.append(b)

    eng.on_round.append(on_round)
    assert eng.generate(prompts, GREEDY) == plain
    filling = [r for r in rounds if r.swap_fill_rows]
    assert len(filling) >= 3, "the rebuild was spread over several rounds"
    assert all(r.swap_fill_rows <= 24 for r in filling)
    assert all(r.head_version == 1 for r in filling if not r.swapped)  # the old head drafted meanwhile
    switched = [r for r in rounds if r.swapped]
    assert len(switched) == 1 and switched[0].head_version == 2 and checked
    assert eng.head is new and rounds[-1].head_version == 2


def test_fill_budget_takes_the_share_of_a_round_at_the_measured_row_cost():
    assert fill_budget(48, 0.5, 0.25, 2 ** -12) == 512  # half of a 250 ms round at 244 us a row
    assert fill_budget(48, 0.1, 0.001, 30e-6) == 48  # never below the rows
    assert fill_budget(48, 0.0, 0.3, 30e-6) == fill_budget(48, 0.1, None, 30e-6) == fill_budget(48, 0.1, 0.3, None) == 48


def rounds_to_switch(tiny8, share: float) -> tuple[list, list]:
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(3)]
    eng = Engine(tiny8, new_head(tiny8, seed=1), EngineConfig(max_batch=4, max_len=256, num_steps=3,
                                                             swap_fill_rows=8, swap_fill_share=share),
                 head_version=1)
    rounds = []

    def on_round(stats, outs):
        rounds.append(stats)
        if len(rounds) == 2:
            eng.swap_head(new_head(tiny8, seed=9), 2)

    eng.on_round.append(on_round)
    out = eng.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    return out, rounds


def test_on_a_cpu_the_fill_takes_a_share_of_the_round_so_a_swap_lands_in_fewer_rounds(tiny8):
    """With `swap_fill_share` the fill rebuilds as many rows as take that share of a round (its
    own seconds a row measured), not 8 a round: the switch comes rounds sooner, the output the same."""
    plain = Engine(tiny8, None, EngineConfig(max_batch=4, max_len=256, num_steps=0)).generate(
        [list(range(3 + i, 40 + 5 * i)) for i in range(3)], SamplingParams(max_tokens=60, ignore_eos=True))
    out_rows, by_rows = rounds_to_switch(tiny8, 0.0)
    out_share, by_share = rounds_to_switch(tiny8, 0.5)
    assert out_rows == out_share == plain
    switch = [next(i for i, r in enumerate(rs) if r.swapped) for rs in (by_rows, by_share)]
    assert all(r.swap_fill_rows <= 8 for r in by_rows)
    assert max(r.swap_fill_rows for r in by_share) > 8 and switch[1] < switch[0], switch


def test_swap_when_idle_is_immediate(tiny8):
    eng = Engine(tiny8, new_head(tiny8, seed=1), EngineConfig(max_batch=2, max_len=128))
    eng.swap_head(new_head(tiny8, seed=3), 4)
    assert eng.has_pending
    eng.step()  # no requests: the swap lands at once, nothing to rebuild
    assert eng.head_version == 4 and not eng.has_pending


def test_staged_fill_is_one_call_per_round_and_prepared_off_the_engine_thread(tiny8):
    """Each filling round rebuilds the rows of every slot that needs them in ONE head call; the
    staged head's cache is allocated by swap_head (the caller's thread), so the engine thread only
    fills; a swap superseded before it went live hands its cache on; the output stays the target's."""
    prompts = [list(range(3 + i, 50 + 5 * i)) for i in range(3)]
    plain = Engine(tiny8, None, EngineConfig(max_batch=4, max_len=256, num_steps=0)).generate(prompts, GREEDY)
    eng = Engine(tiny8, new_head(tiny8, seed=1), EngineConfig(max_batch=4, max_len=256, num_steps=3,
                                                             swap_fill_rows=200), head_version=1)
    first, second = new_head(tiny8, seed=5), new_head(tiny8, seed=9)
    calls, rounds = [], []
    kv = second.kv
    second.kv = lambda *a: calls.append(a[0].shape[1]) or kv(*a)  # rows per call

    def on_round(stats, outs):
        rounds.append(stats)
        if len(rounds) == 3:
            eng.swap_head(first, 2)
            staged_cache = eng._pending_swap[2].cache  # ready before the engine thread sees it
            assert staged_cache.lengths == [0] * 4
            eng.swap_head(second, 3)  # supersedes it before the next round: its cache becomes the spare
            assert eng._spare_cache is staged_cache

    eng.on_round.append(on_round)
    assert eng.generate(prompts, GREEDY) == plain
    filled = [r for r in rounds if r.swap_fill_rows]
    assert filled and len(calls) == len(filled)  # one call per filling round, all slots in it
    assert calls[0] == filled[0].swap_fill_rows > max(len(p) for p in prompts)  # rows of several slots at once
    assert eng.head is second and rounds[-1].head_version == 3
    assert not any(r.head_version == 2 for r in rounds)  # the superseded head never went live
