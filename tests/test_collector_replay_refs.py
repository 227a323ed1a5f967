"""Draws by location (`ReplayBuffer.sample_train_refs`) on a real disk: the same draw as
`sample_train`, its names readable by the buffer and by another reader (`GenerationReader`), the
recent window's locations after a flush and after a reopen, held generations kept from eviction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from collector.replay import ReplayBuffer
from collector.replay_reader import GenerationReader, held_generations
from test_collector_replay import SPAN_BYTES, assert_spans_equal, make_span, small_cfg
from trainer.batch import assemble, collate, pack


def check_draw(buf: ReplayBuffer, seed: int, tokens: int) -> dict:
    """sample_train and sample_train_refs from the same generator state: the same spans, the names
    and the rows behind them the same (read by the buffer and by a reader of its directory)."""
    plain = buf.sample_train(tokens, rng=np.random.default_rng(seed))
    refs = buf.sample_train_refs(tokens, rng=np.random.default_rng(seed))
    reader = GenerationReader(buf.root)
    assert len(plain) == len(refs)
    kinds = {"memory": 0, "disk": 0, "both": 0}
    for span, d in zip(plain, refs):
        assert d.name == (span.request_id, span.first_pos, span.num_rows) and d.num_rows == span.num_rows
        if d.span is not None:
            assert_spans_equal(d.span, span)
        if d.where is not None:
            assert_spans_equal(buf.rows_at(d.where), span)
            assert_spans_equal(reader.rows(d.where), span)
            assert_spans_equal(reader.rows(d.where, copy=False), span)  # views of the mapped table
        kinds["memory" if d.where is None else "disk" if d.span is None else "both"] += 1
    return kinds


def test_refs_draw_is_the_draw_and_its_names_read_back_the_rows(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path, heldout_every=0, memory_bytes=12 * SPAN_BYTES))
    for i in range(30):
        buf.add(make_span(i, rounds=3 + i % 5))  # 7 generations of 4, 2 spans pending
    assert buf.stats()["generations"] == 7 and buf.stats()["pending_bytes"] > 0
    seen = {"memory": 0, "disk": 0, "both": 0}
    for seed in range(6):
        for k, v in check_draw(buf, seed, 80).items():
            seen[k] += v
    # pending spans (memory only), older generations (disk only), the written part of the recent
    # window (both): each kind drawn, or the test would not see its path
    assert all(seen.values()), seen
    buf.flush()  # the pending spans of the window get their location
    refs = buf.sample_train_refs(400, rng=np.random.default_rng(0))
    assert all(d.where is not None for d in refs)


def test_after_a_reopen_the_recent_window_knows_where_its_spans_are(tmp_path: Path):
    cfg = small_cfg(tmp_path, heldout_every=0, memory_bytes=12 * SPAN_BYTES)
    buf = ReplayBuffer(cfg)
    for i in range(24):
        buf.add(make_span(i))
    buf.close()
    again = ReplayBuffer(cfg)
    kinds = check_draw(again, 1, 120)
    assert kinds["both"] > 0 and kinds["memory"] == 0, kinds


def test_held_generations_wait_for_release_and_an_open_reader_outlives_eviction(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path, heldout_every=0, budget_bytes=12 * SPAN_BYTES,
                                 memory_bytes=4 * SPAN_BYTES))
    for i in range(8):
        buf.add(make_span(i))  # generations 0 and 1
    refs = buf.sample_train_refs(200, rng=np.random.default_rng(0), hold=True)
    held = held_generations(refs)
    assert 0 in held
    reader = GenerationReader(buf.root)
    first = next(d for d in refs if d.where is not None and d.where[0] == 0)
    reader.rows(first.where)  # generation 0 opened here
    for i in range(8, 16):
        buf.add(make_span(i))
    assert buf.stats()["evicted_generations"] == 0  # over budget, but generation 0 is held
    assert_spans_equal(buf.rows_at(first.where), reader.rows(first.where))
    buf.release(held)
    for i in range(16, 20):
        buf.add(make_span(i))
    assert buf.stats()["evicted_generations"] >= 1
    with pytest.raises(KeyError):
        buf.rows_at(first.where)
    assert reader.rows(first.where).request_id == first.name[0]  # open before the eviction: still readable
    with pytest.raises(FileNotFoundError):
        GenerationReader(buf.root).rows(first.where)  # never opened: gone, said so


def test_a_window_span_whose_generation_was_evicted_is_drawn_from_memory(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path, heldout_every=0, budget_bytes=12 * SPAN_BYTES,
                                 memory_bytes=8 * SPAN_BYTES))
    for i in range(20):
        buf.add(make_span(i))
    evicted = buf.stats()["evicted_generations"]
    assert any(at is not None and at[0] < evicted for at, in buf._recent_at)  # the case under test
    stale = 0
    for d in buf.sample_train_refs(2000, rng=np.random.default_rng(1)):
        assert d.where is None or d.where[0] >= evicted  # never a name nobody can read
        stale += d.where is None and d.span is not None
    assert stale


def test_assemble_packed_rows_then_spans_equals_collate_of_both():
    a = [make_span(i, rounds=2 + i) for i in range(3)]
    b = [make_span(10 + i, rounds=4 - i) for i in range(2)]
    want, got = collate(a + b), assemble(pack(a), b)
    for name in ("tokens", "features", "final_hidden", "row_mask", "rejected", "first_pos"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    only = assemble(None, b)
    assert torch.equal(only.features, collate(b).features)
    with pytest.raises(ValueError):
        assemble(None, [])
