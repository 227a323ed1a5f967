"""The ranks' data pipe (`trainer/rank_data.py`) between two real processes over gloo: rank 0 owns
a replay buffer on disk (stored generations and pending spans), deals three steps; rank 1 gets its
micro-batches by name (it reads the buffer's directory, the same host) or, `by_name` off, as
rows. Either way each rank's batch is exactly the padded rows of the spans rank 0 dealt it, spans
that do not fit the target are dropped where they are read, and a receiver left with no usable
row fails its step (`Unreadable`) instead of hanging the ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collector.replay import ReplayBuffer  # noqa: E402
from test_collector_replay import SPAN_BYTES, make_span, small_cfg  # noqa: E402
from trainer.batch import collate  # noqa: E402
from trainer.rank_data import DataPipe, Unreadable  # noqa: E402

SPANS = 30
STEPS = 3


class _Daemon:
    """What the pipe uses of rank 0's daemon: the buffer and its check of stored spans."""

    def __init__(self, buffer: ReplayBuffer, bad: set):
        self.buffer, self.bad = buffer, bad

    def _usable(self, spans):
        return [s for s in spans if s.request_id not in self.bad]


def _rank(rank: int, tmp: str, by_name: bool, bad: list, flush: bool) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    daemon = None
    if rank == 0:
        buf = ReplayBuffer(small_cfg(Path(tmp) / "replay", heldout_every=0, memory_bytes=12 * SPAN_BYTES))
        for i in range(SPANS):
            buf.add(make_span(i, rounds=3 + i % 5))  # 7 generations stored, 2 spans pending
        if flush:
            buf.flush()
        daemon = _Daemon(buf, set())
    pipe = DataPipe(rank, 2, None, daemon, per_rank=60, min_tokens=1, idle_s=0.05, by_name=by_name,
                    span_error=lambda s: "unfit" if s.request_id in bad else None)
    out = []
    for _ in range(STEPS):
        batch, spans, dealt, pipe_ms, named = pipe.next()
        item = {"spans": spans, "dealt": dealt, "named": named, "pipe": sorted(pipe_ms)}
        if isinstance(batch, Unreadable):
            item["unreadable"] = batch.reason
        else:
            torch.save({"features": batch.features, "tokens": batch.tokens, "first_pos": batch.first_pos},
                       f"{tmp}/rank{rank}_{len(out)}.pt")
        out.append(item)
    if rank == 0:
        item["reads_buffer"] = pipe.reads_buffer
    pipe.close()
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run_pair(tmp_path: Path, by_name: bool, bad: list, flush: bool = False) -> tuple[list, list]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), by_name, bad, flush)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def expected(names: list) -> torch.Tensor:
    spans = {f"req-{i}": make_span(i, rounds=3 + i % 5) for i in range(SPANS)}
    rows = [spans[rid].slice(pos - spans[rid].first_pos, pos - spans[rid].first_pos + n) for rid, pos, n in names]
    return collate(rows).features


@pytest.mark.parametrize("by_name", [True, False])
def test_each_rank_trains_exactly_the_rows_dealt_it(tmp_path: Path, by_name: bool):
    j0, j1 = run_pair(tmp_path, by_name, [])
    assert j0[-1]["reads_buffer"] == [True, by_name]
    named = 0
    for step, (a, b) in enumerate(zip(j0, j1)):
        assert a["dealt"] == [a["spans"], b["spans"]] and a["named"] == b["named"]
        assert a["pipe"] == ["draw", "own", "pack", "read", "send"] and b["pipe"] == ["build", "read", "recv"]
        for rank, item in ((0, a), (1, b)):
            got = torch.load(tmp_path / f"rank{rank}_{step}.pt")
            assert torch.equal(got["features"], expected(item["spans"])), (rank, step)
        named += b["named"]
    # by name: rank 1's stored spans were read from disk; the pending ones still travelled (the
    # draws are seeded: with these spans a step of rank 1 has both)
    assert (named > 0) == by_name
    assert any(0 < b["named"] < len(b["spans"]) for b in j1) == by_name


def test_a_receiver_with_no_usable_row_fails_its_step_instead_of_hanging(tmp_path: Path):
    # every span stored, so all go by name, and rank 1 finds every one unfit
    j0, j1 = run_pair(tmp_path, True, [f"req-{i}" for i in range(SPANS)], flush=True)
    for a, b in zip(j0, j1):
        assert b["named"] == 0 and b["spans"] == [] and a["named"] == len(a["dealt"][1]) > 0
        assert "none of the" in b["unreadable"]


def test_skipped_deals_do_not_keep_generations_held(tmp_path: Path):
    """A deal that is skipped (nothing usable drawn) still lets go of its generations four deals
    later, so a run of skips never blocks the buffer's eviction; closing the pipe releases all."""
    from trainer.rank_data import HOLD_DEALS

    buf = ReplayBuffer(small_cfg(tmp_path / "replay", heldout_every=0, memory_bytes=4 * SPAN_BYTES))
    for i in range(SPANS):
        buf.add(make_span(i, rounds=3 + i % 5))
    buf.flush()
    daemon = _Daemon(buf, {f"req-{i}" for i in range(SPANS)})  # every stored span refused: every deal skips
    pipe = DataPipe(0, 1, None, daemon, per_rank=200, min_tokens=1, idle_s=0.01)
    for _ in range(3 * HOLD_DEALS):
        assert pipe.next()[0] is None
    assert buf._held and max(buf._held.values()) <= HOLD_DEALS + 2  # the deals in flight, not all twelve
    pipe.close()
    assert not buf._held
