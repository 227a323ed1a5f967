"""Replay buffer and span shards on a real disk: budget eviction, held-out split, restarts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from collector.replay import ReplayBuffer, ReplayConfig, is_heldout
from collector.shards import load_dataset_dir, load_spans, read_rows, read_shard, row_to_span, save_spans, shard_paths
from collector.span import CaptureSpan
from collector_records import bits, request_records
from online_spec.config import ConfigError

H = 16


def make_span(i: int, rounds: int = 4, dtype: torch.dtype = torch.bfloat16, tag: str = "chat") -> CaptureSpan:
    return CaptureSpan.from_records(request_records(f"req-{i}", num_rounds=rounds, hidden=H, seed=i, dtype=dtype,
                                                    tag=tag))


def assert_spans_equal(a: CaptureSpan, b: CaptureSpan) -> None:
    assert (a.request_id, a.first_pos, a.tag) == (b.request_id, b.first_pos, b.tag)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(bits(a.features), bits(b.features)) and torch.equal(bits(a.final_hidden), bits(b.final_hidden))
    for name in ("accepted", "draft_token", "draft_prob", "num_steps", "batch_size", "draft_version",
                 "is_prefill", "timestamp"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


SPAN_BYTES = make_span(0).nbytes


def small_cfg(root: Path, **kw) -> ReplayConfig:
    args = dict(root=str(root), shard_bytes=4 * SPAN_BYTES, budget_bytes=400 * SPAN_BYTES,
                memory_bytes=8 * SPAN_BYTES, heldout_every=4, flush_interval_s=3600.0)
    args.update(kw)
    return ReplayConfig(**args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_and_load_spans_round_trip_across_shards(tmp_path: Path, dtype):
    spans = [make_span(i, rounds=i % 5, dtype=dtype) for i in range(9)]
    written = save_spans(iter(spans), tmp_path / "pretrain", shard_bytes=3 * spans[0].nbytes)
    assert len(written) >= 3 and shard_paths(tmp_path / "pretrain") == written
    loaded = load_spans(tmp_path / "pretrain")
    assert len(loaded) == len(spans)
    for a, b in zip(spans, loaded):
        assert_spans_equal(a, b)
    ds = load_dataset_dir(tmp_path / "pretrain")
    assert len(ds) == 9 and ds[4]["request_id"] == "req-4" and ds[4]["num_rows"] == spans[4].num_rows
    more = save_spans([make_span(100, dtype=dtype)], tmp_path / "pretrain")  # appends after the others
    assert more[0].name == f"shard-{len(written):05d}" and len(load_spans(tmp_path / "pretrain")) == 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_read_rows_is_the_slice_of_the_stored_span(tmp_path: Path, dtype):
    # the replay buffer's draws read only a window's bytes; what they read must be exactly the
    # window of the span row_to_span decodes (every column, any window, a concatenated dataset too)
    spans = [make_span(i, rounds=1 + i % 4, dtype=dtype) for i in range(6)]
    save_spans(iter(spans), tmp_path / "d", shard_bytes=2 * spans[0].nbytes)
    for ds in [read_shard(p) for p in shard_paths(tmp_path / "d")] + [load_dataset_dir(tmp_path / "d")]:
        for i in range(len(ds)):
            full = row_to_span(ds[i])
            n = full.num_rows
            for lo, hi in ((0, n), (1, n), (0, 1), (n // 2, n // 2 + 1), (n - 1, n)):
                got = read_rows(ds, i, lo, hi)
                assert_spans_equal(got, full.slice(lo, hi))
                assert got.features.dtype == dtype and got.features.is_contiguous()
    picked = load_dataset_dir(tmp_path / "d").select([4, 1])  # a dataset with an index mapping
    assert_spans_equal(read_rows(picked, 0, 1, 2), row_to_span(picked[0]).slice(1, 2))
    ds = read_shard(shard_paths(tmp_path / "d")[0])
    with pytest.raises(ValueError, match="outside"):
        read_rows(ds, 0, 0, ds[0]["num_rows"] + 1)
    with pytest.raises(IndexError):
        read_rows(ds, len(ds))


def test_read_rows_refuses_a_row_whose_bytes_do_not_match_its_shape(tmp_path: Path):
    span = make_span(1)
    save_spans([span], tmp_path / "d")
    ds = read_shard(shard_paths(tmp_path / "d")[0])
    bad = ds.map(lambda r: {"features": r["features"][:-2]})  # a torn write: 2 bytes short
    with pytest.raises(ValueError, match="stored features has"):
        read_rows(bad, 0)


def test_heldout_and_train_are_split_by_request(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path))
    spans = [make_span(i) for i in range(24)]
    for s in spans:
        assert buf.add(s)
    held_ids = {s.request_id for s in spans if is_heldout(s.request_id, 4)}
    assert 0 < len(held_ids) < len(spans)
    held = buf.heldout(max_tokens=10**9)
    assert [s.request_id for s in held] == [s.request_id for s in reversed(spans) if s.request_id in held_ids]
    oldest = buf.heldout(max_tokens=10**9, newest=False)
    assert [s.request_id for s in oldest] == [s.request_id for s in held][::-1]
    sample = buf.sample_train(max_tokens=500, rng=np.random.default_rng(1))
    assert sum(s.num_rows for s in sample) == 500
    assert not {s.request_id for s in sample} & held_ids
    by_id = {s.request_id: s for s in spans}
    for s in sample:  # every sampled piece is the original rows at its positions
        s.validate()
        ref = by_id[s.request_id].slice(s.first_pos, s.end_pos)
        assert_spans_equal(s, ref)
    cut = buf.heldout(max_tokens=5)
    assert sum(s.num_rows for s in cut) == 5 and cut[0].request_id == held[0].request_id


def test_whole_spans_sampling_never_cuts_a_span(tmp_path: Path):
    """whole_spans: every sampled span is a stored span entire (its prompt included: the context
    serving gives the head), and a batch overshoots its budget by less than one span."""
    buf = ReplayBuffer(small_cfg(tmp_path, whole_spans=True))
    spans = [make_span(i, rounds=3 + i % 7) for i in range(30)]
    for s in spans:
        buf.add(s)
    by_id = {s.request_id: s for s in spans}
    longest = max(s.num_rows for s in spans)
    for seed in range(5):
        sample = buf.sample_train(max_tokens=60, rng=np.random.default_rng(seed))
        rows = sum(s.num_rows for s in sample)
        assert 60 <= rows < 60 + 2 * longest  # two pools (recent window, all), each overshoots < one span
        for s in sample:
            assert_spans_equal(s, by_id[s.request_id])
    cut = ReplayBuffer(small_cfg(tmp_path / "cut"))
    for s in spans:
        cut.add(s)
    assert sum(s.num_rows for s in cut.sample_train(max_tokens=60, rng=np.random.default_rng(0))) == 60


def test_byte_budget_evicts_whole_generations_oldest_first(tmp_path: Path):
    cfg = small_cfg(tmp_path, heldout_every=0, budget_bytes=40 * SPAN_BYTES)
    buf = ReplayBuffer(cfg)
    for i in range(120):
        buf.add(make_span(i))
        assert buf.nbytes <= cfg.budget_bytes + cfg.shard_bytes
    stats = buf.stats()
    assert stats["evicted"] > 0 and stats["evicted_generations"] > 0
    assert stats["received"] == 120 and stats["spans"] == 120 - stats["evicted"]
    gens = sorted(p.name for p in (tmp_path / "gens").iterdir())
    assert len(gens) == stats["generations"] and int(gens[0]) == stats["evicted_generations"]
    kept = {s.request_id for s in buf.sample_train(max_tokens=20_000, rng=np.random.default_rng(0))}
    oldest_kept = min(int(r.split("-")[1]) for r in kept)
    assert oldest_kept >= stats["evicted"]  # nothing evicted is ever sampled again
    assert f"req-{119}" in {s.request_id for s in buf.sample_train(max_tokens=50_000)}


def test_reopening_after_a_crash_keeps_every_flushed_span(tmp_path: Path):
    cfg = small_cfg(tmp_path)
    buf = ReplayBuffer(cfg)
    spans = [make_span(i) for i in range(10)]
    for s in spans:
        buf.add(s)
    flushed = buf.stats()
    assert flushed["generations"] >= 2 and flushed["pending_bytes"] > 0
    on_disk = len(buf) - sum(1 for _ in buf._pending["train"]) - len(buf._pending["heldout"])
    del buf  # no close(): what a kill leaves behind

    again = ReplayBuffer(cfg)
    assert len(again) == on_disk and again.stats()["pending_bytes"] == 0
    assert again.stats()["flushes"] == flushed["flushes"]
    assert again.stats()["recent_spans"] > 0
    n = again.num_tokens
    new = next(i for i in range(50, 100) if not is_heldout(f"req-{i}", cfg.heldout_every))
    again.add(make_span(new))
    again.close()
    third = ReplayBuffer(cfg)
    assert third.num_tokens == n + make_span(new).num_rows
    assert any(s.request_id == f"req-{new}" for s in third.sample_train(max_tokens=10_000))


_WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from test_collector_replay import make_span, small_cfg
from collector.replay import ReplayBuffer
from pathlib import Path
buf = ReplayBuffer(small_cfg(Path(sys.argv[1])))
i = 0
while True:
    before = buf.stats()["flushes"]
    buf.add(make_span(i)); i += 1
    if buf.stats()["flushes"] != before:
        print(buf.stats()["flushes"], flush=True)
"""


def test_a_buffer_killed_mid_write_reopens_clean(tmp_path: Path):
    root = tmp_path / "buf"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(6):  # let it write a few generations (and evict), then kill it mid-stream
            assert proc.stdout.readline().strip()
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    buf = ReplayBuffer(small_cfg(root))
    assert buf.stats()["generations"] >= 1 and len(buf) > 0
    assert not list((root / "gens").glob(".tmp-*"))
    for s in buf.sample_train(max_tokens=200) + buf.heldout(max_tokens=200):
        s.validate()


def test_malformed_and_oversized_spans_are_refused_and_counted(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path))
    bad = make_span(1)
    bad.features[0, 0] = float("nan")
    assert not buf.add(bad) and buf.stats()["malformed"] == 1
    huge = CaptureSpan.from_records(request_records("huge", num_rounds=400, hidden=H, prefill_rows=6000,
                                                    dtype=torch.bfloat16))
    assert huge.nbytes > 396 * SPAN_BYTES
    assert not buf.add(huge) and buf.stats()["dropped"] == 1
    assert len(buf) == 0


@pytest.mark.parametrize("reopen", [False, True])
def test_heldout_of_one_tag_and_the_tags_held_out(tmp_path: Path, reopen: bool):
    """The gate's per-tag guard reads each tag's newest held-out spans, from pending spans and from
    flushed generations (after a restart too); tags are listed from what is stored."""
    spans = [make_span(i, tag="chat" if i < 12 else "code") for i in range(40)]
    cfg = small_cfg(tmp_path)
    buf = ReplayBuffer(cfg)
    for s in spans:
        buf.add(s)
    if reopen:
        buf.close()
        buf = ReplayBuffer(cfg)
    held = [s for s in spans if is_heldout(s.request_id, 4)]
    assert {s.tag for s in held} == {"chat", "code"} and buf.heldout_tags() == ["chat", "code"]
    for tag in ("chat", "code"):
        got = buf.heldout(10**9, tag=tag)
        assert [s.request_id for s in got] == [s.request_id for s in reversed(held) if s.tag == tag]
    newest_chat = [s for s in reversed(held) if s.tag == "chat"][0]
    cut = buf.heldout(3, tag="chat")
    assert len(cut) == 1 and cut[0].request_id == newest_chat.request_id and cut[0].num_rows == 3
    assert buf.heldout(100, tag="other") == []
    if reopen:  # everything was flushed: offline replays read every stored span, both splits
        assert sorted(s.request_id for _, s in buf.stored_spans()) == sorted(s.request_id for s in spans)


def test_heldout_generated_sample_skips_prompt_only_spans_and_cuts_long_generations(tmp_path: Path):
    """The gate's sample: held-out spans serving drafted on, newest first, each with all its prompt
    rows (4 here) and at most `max_generated` rows drafts start from (the last prompt row on) plus
    the row after them; a span of a continuing request (no prompt rows) keeps its first ones."""
    buf = ReplayBuffer(small_cfg(tmp_path, heldout_every=1))
    spans = [make_span(i, rounds=0 if i == 2 else 8) for i in range(4)]  # span 2: a prefill only
    tail = make_span(9, rounds=6).slice(5, 14)  # a later piece of a request: no prompt rows
    for s in spans + [tail]:
        buf.add(s)
    got = buf.heldout(10**9, generated=True, max_generated=3)
    assert [s.request_id for s in got] == ["req-9", "req-3", "req-1", "req-0"]
    assert got[0].num_rows == 4 and not bool(got[0].is_prefill.any()) and got[0].first_pos == tail.first_pos
    for s in got[1:]:
        full = spans[int(s.request_id.split("-")[1])]
        assert full.num_rows > 4 + 3 and s.num_rows == 3 + 4  # prompt rows 0..3, anchors 3..5, row 6
        assert_spans_equal(s, full.slice(0, 7))
    whole = buf.heldout(10**9, generated=True)  # no cap: whole spans, still without the prompt-only one
    assert [s.num_rows for s in whole] == [tail.num_rows] + [spans[i].num_rows for i in (3, 1, 0)]
    assert [s.request_id for s in buf.heldout(10, generated=True, max_generated=3)] == ["req-9", "req-3"]


def test_empty_buffer_samples_nothing(tmp_path: Path):
    buf = ReplayBuffer(small_cfg(tmp_path))
    assert buf.sample_train(100) == [] and buf.heldout(100) == [] and len(buf) == 0 and buf.num_tokens == 0


@pytest.mark.parametrize("field,kw", [("budget_bytes", dict(budget_bytes=10, shard_bytes=8)),
                                      ("memory_bytes", dict(memory_bytes=10**12)),
                                      ("heldout_every", dict(heldout_every=-1)),
                                      ("recent_fraction", dict(recent_fraction=2.0)),
                                      ("root", dict(root=""))])
def test_replay_config_names_the_bad_field(tmp_path: Path, field, kw):
    with pytest.raises(ConfigError, match=field):
        ReplayConfig(**{"root": str(tmp_path), **kw})


def test_pending_spans_are_written_once_due_even_when_traffic_stops(tmp_path: Path):
    """flush_interval_s bounds what a kill loses: `flush_if_due` (the trainer's loop) writes spans
    pending that long though no `add` comes to check."""
    buf = ReplayBuffer(small_cfg(tmp_path, flush_interval_s=0.2))
    for i in range(2):
        buf.add(make_span(i))
    buf.flush_if_due()
    assert buf.stats()["generations"] == 0  # not due yet
    import time
    time.sleep(0.25)
    buf.flush_if_due()
    assert buf.stats()["generations"] == 1 and buf.stats()["pending_bytes"] == 0
