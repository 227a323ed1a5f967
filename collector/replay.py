"""`ReplayBuffer`: the trainer's store of captured spans, in memory and on disk, bounded in bytes.

Spans come in with `add(span)` (wire it as the subscriber's `on_span`); the trainer reads with
`sample_train(max_tokens)` and `heldout(max_tokens)`. "Tokens" here are rows: one row trains
one next-token prediction.

Layout under `root` (reopened as is after a restart, also after kill -9):

    root/state.json                  counters and the next generation number (atomic rewrite)
    root/gens/00000012/train/        a `datasets` shard (schema: `collector.shards`)
    root/gens/00000012/heldout/      the held-out spans of the same generation, if any

New spans gather in memory until `shard_bytes` of them are pending or `flush_interval_s` has
passed since the first (checked at `add` and by the trainer's loop, `flush_if_due`); then
they are written as one generation (to a temporary directory,
renamed into place, so a kill leaves no half generation; it loses at most the pending spans).
When the bytes on disk plus pending exceed `budget_bytes`, whole generations are deleted,
oldest first. The newest train spans (up to `memory_bytes`) are also kept in memory, the
recent window; after a restart it is refilled from the newest generations.

Held-out slice: a request goes to held-out iff a hash of its id falls in 1/`heldout_every` of
the range, so every span of one request lands on the same side and no request is both trained
on and evaluated on.

Sampling (`sample_train`), with replacement and recent-biased: `recent_fraction` of the token
budget is drawn from the recent window, the rest from all stored train spans (disk and
pending); within each pool a span is drawn with probability proportional to its rows (uniform
over tokens), and a span longer than what is left of the budget is cut to a random contiguous
window of it (or, `whole_spans`, taken whole: the batch overshoots by less than one span). `heldout` is deterministic: held-out spans newest first (or oldest first), the
last one cut to fit; optionally only spans serving drafted on, each cut after its first
generated rows (the gate's sample).

Draws by location (`sample_train_refs`): the same draw as `sample_train` (the same generator, the
same spans and windows), each as a `Drawn`: its rows where they are in memory (the recent window,
pending spans) and where they are stored, (generation, span index in its train shard, lo, hi), for
those on disk. A process on the same host that does not own the buffer reads stored rows with a
`collector.replay_reader.GenerationReader` (a trainer rank > 0: only the rows' names travel to it). `hold(generations)`
keeps generations from eviction until `release`, so the names stay readable while in flight.

All methods take a lock: the subscriber thread adds while the trainer thread samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from online_spec.config import check, doc

from collector.replay_reader import Drawn, Where, generation_dir, held_generations
from collector.shards import dir_bytes, read_rows, read_shard, remove_partial, row_to_span, write_shard
from collector.span import CaptureSpan

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")
_COUNTERS = ("received", "received_tokens", "dropped", "malformed", "evicted", "evicted_tokens",
             "evicted_generations", "flushes")


@dataclass
class ReplayConfig:
    root: str = doc("directory of the buffer; created, and reopened with its contents after a restart", "replay")
    budget_bytes: int = doc("bytes on disk plus pending; beyond it the oldest generations are deleted", 4 << 30)
    shard_bytes: int = doc("pending bytes that trigger writing a generation of shards", 64 << 20)
    memory_bytes: int = doc("bytes of the newest train spans also kept in memory (the recent window)", 256 << 20)
    flush_interval_s: float = doc("write pending spans at least this often; bounds what a kill loses", 60.0)
    heldout_every: int = doc("one request in N (by a hash of its id) is held out for evaluation; 0 = none", 20)
    recent_fraction: float = doc("share of each sample_train token budget drawn from the recent window", 0.5)
    whole_spans: bool = doc("sample_train takes drawn spans whole (a batch overshoots its budget by up to one "
                            "span) instead of cutting the last one to a random window: a window that starts after "
                            "the prompt trains the head without the context serving gives it (44 % of the rows "
                            "of 512-row batches of an e2e run's buffer came from such windows)", False)
    seed: int = doc("seed of the sampling generator", 0)

    def __post_init__(self) -> None:
        check(bool(self.root), "root", "must not be empty")
        check(self.shard_bytes >= 1, "shard_bytes", f"{self.shard_bytes} < 1")
        check(self.budget_bytes >= 2 * self.shard_bytes, "budget_bytes",
              f"{self.budget_bytes} < 2 * shard_bytes ({2 * self.shard_bytes}); eviction needs room for two")
        check(0 <= self.memory_bytes <= self.budget_bytes - self.shard_bytes, "memory_bytes",
              f"{self.memory_bytes} not in 0..budget_bytes - shard_bytes; the window must fit what is stored")
        check(self.flush_interval_s > 0, "flush_interval_s", f"{self.flush_interval_s} <= 0")
        check(self.heldout_every >= 0, "heldout_every", f"{self.heldout_every} < 0")
        check(0.0 <= self.recent_fraction <= 1.0, "recent_fraction", f"{self.recent_fraction} not in [0, 1]")


def is_heldout(request_id: str, every: int) -> bool:
    """Whether a request belongs to the held-out slice (deterministic, about 1/every of ids)."""
    if every <= 0:
        return False
    digest = hashlib.blake2b(f"heldout\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


@dataclass
class _Pool:
    """Spans to draw from: their row counts, a way to fetch rows lo..hi-1 of span i, and one to
    name them (`Drawn`) without reading what is on disk."""

    lens: np.ndarray
    get: Callable[[int, int, int], CaptureSpan]
    ref: Callable[[int, int, int], Drawn]

    @classmethod
    def of(cls, spans: list[CaptureSpan], stored: list[tuple[int, int] | None] | None = None) -> "_Pool":
        """A pool of spans in memory; `stored[i]`: (generation, index) of span i on disk, if written."""
        def ref(i, lo, hi):
            at = stored[i] if stored is not None else None
            return Drawn(_window(spans[i], lo, hi), None if at is None else (at[0], at[1], lo, hi),
                         (spans[i].request_id, spans[i].first_pos + lo, hi - lo))

        return cls(np.array([s.num_rows for s in spans], dtype=np.int64),
                   lambda i, lo, hi: _window(spans[i], lo, hi), ref)


def _window(span: CaptureSpan, lo: int, hi: int) -> CaptureSpan:
    return span if (lo, hi) == (0, span.num_rows) else span.slice(lo, hi)


class _Generation:
    def __init__(self, index: int, path: Path):
        self.index, self.path = index, path
        self.nbytes = dir_bytes(path)
        self.data = {s: read_shard(path / s) for s in SPLITS if (path / s).is_dir()}
        self.lens = {s: np.asarray(self.data[s].data.column("num_rows").to_numpy(), dtype=np.int64)
                     if s in self.data else np.zeros(0, dtype=np.int64) for s in SPLITS}
        self.tags = {s: self.data[s].data.column("tag").to_pylist() if s in self.data else [] for s in SPLITS}
        train = self.data.get("train")
        self.train_ids = train.data.column("request_id").to_pylist() if train is not None else []
        self.train_first = train.data.column("first_pos").to_pylist() if train is not None else []

    def name(self, i: int, lo: int, hi: int) -> Drawn:
        """Train rows lo..hi-1 of span i, named, not read."""
        return Drawn(None, (self.index, i, lo, hi), (self.train_ids[i], self.train_first[i] + lo, hi - lo))

    def span(self, split: str, i: int) -> CaptureSpan:
        return row_to_span(self.data[split][int(i)])

    def rows(self, split: str, i: int, lo: int, hi: int, copy: bool = True) -> CaptureSpan:
        """Rows lo..hi-1 of span i, only their bytes read (`collector.shards.read_rows`)."""
        return read_rows(self.data[split], i, lo, hi, copy)


class ReplayBuffer:
    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.root = Path(cfg.root)
        self._gens_dir = self.root / "gens"
        self._gens_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._rng = np.random.default_rng(cfg.seed)
        self.counters = {name: 0 for name in _COUNTERS}
        self._next_gen = 0
        self._gens: list[_Generation] = []
        self._pending: dict[str, list[CaptureSpan]] = {s: [] for s in SPLITS}
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._recent: deque[CaptureSpan] = deque()
        # per recent span, a one-item list: its (generation, index) once written; by id() the slots
        # of recent spans still pending (the objects are alive while in the window)
        self._recent_at: deque[list] = deque()
        self._unwritten: dict[int, list] = {}
        self._recent_bytes = 0
        self._held: Counter = Counter()
        self._reopen()

    # ---- writing --------------------------------------------------------------------------------

    def add(self, span: CaptureSpan) -> bool:
        """Store a span; False if it was refused (malformed, or larger than a shard may be)."""
        with self._lock:
            try:
                span.validate()
            except ValueError as e:
                self.counters["malformed"] += 1
                log.warning("replay buffer: refusing a malformed span of %r: %s", span.request_id, e)
                return False
            if span.nbytes > self.cfg.budget_bytes - self.cfg.shard_bytes:
                self.counters["dropped"] += 1
                return False
            self.counters["received"] += 1
            self.counters["received_tokens"] += span.num_rows
            split = "heldout" if is_heldout(span.request_id, self.cfg.heldout_every) else "train"
            if self._pending_bytes == 0:
                self._pending_since = time.monotonic()
            self._pending[split].append(span)
            self._pending_bytes += span.nbytes
            if split == "train":
                self._remember(span)
            if self._pending_bytes >= self.cfg.shard_bytes:
                self.flush()
            else:
                self.flush_if_due()
            return True

    def flush_if_due(self) -> None:
        """Write the pending spans if the first came `flush_interval_s` ago (checked at `add`; the
        trainer's loop calls it too, so spans are written when traffic stops)."""
        with self._lock:
            if self._pending_bytes and time.monotonic() - self._pending_since >= self.cfg.flush_interval_s:
                self.flush()

    def flush(self) -> None:
        """Write the pending spans as a new generation, then evict down to the budget."""
        with self._lock:
            if self._pending_bytes == 0:
                return
            index = self._next_gen
            final = generation_dir(self.root, index)
            tmp = self._gens_dir / f".tmp-{index:08d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for split in SPLITS:
                if self._pending[split]:
                    write_shard(self._pending[split], tmp / split)
            os.replace(tmp, final)
            for i, span in enumerate(self._pending["train"]):  # written in this order
                slot = self._unwritten.pop(id(span), None)
                if slot is not None:
                    slot[0] = (index, i)
            self._next_gen = index + 1
            self._gens.append(_Generation(index, final))
            self._pending = {s: [] for s in SPLITS}
            self._pending_bytes = 0
            self.counters["flushes"] += 1
            self._evict()
            self._save_state()

    def close(self) -> None:
        self.flush()

    # ---- reading --------------------------------------------------------------------------------

    def sample_train(self, max_tokens: int, rng: np.random.Generator | None = None) -> list[CaptureSpan]:
        """About `max_tokens` rows of train spans (exactly, unless the buffer is empty); see the
        module docstring for the distribution."""
        rng = self._rng if rng is None else rng
        with self._lock:
            out: list[CaptureSpan] = []
            recent = list(self._recent)
            recent_pool = [_Pool.of(recent)]
            cut = not self.cfg.whole_spans
            got = _draw(out, round(max_tokens * self.cfg.recent_fraction), recent_pool, rng, cut)
            _draw(out, max_tokens - got, self._pools("train"), rng, cut)
            return out

    def sample_train_refs(self, max_tokens: int, rng: np.random.Generator | None = None,
                          hold: bool = False) -> list[Drawn]:
        """`sample_train`'s draw (the same spans and windows for the same generator state), each as
        a `Drawn`: rows on disk are named, not read; rows in memory come with their location when
        they are also written (`rows_at` or a `GenerationReader` reads a location). `hold`: the
        generations named are held (`hold`) before the lock is let go; the caller releases them."""
        rng = self._rng if rng is None else rng
        with self._lock:
            out: list[Drawn] = []
            live = {g.index for g in self._gens}
            stored = [at if at is not None and at[0] in live else None for at, in self._recent_at]
            recent_pool = [_Pool.of(list(self._recent), stored)]
            cut = not self.cfg.whole_spans
            got = _draw(out, round(max_tokens * self.cfg.recent_fraction), recent_pool, rng, cut, refs=True)
            _draw(out, max_tokens - got, self._pools("train"), rng, cut, refs=True)
            if hold:
                self.hold(held_generations(out))
            return out

    def rows_at(self, where: Where, copy: bool = True) -> CaptureSpan:
        """The stored train rows `where` names (KeyError: its generation is gone); `copy` as in
        `collector.shards.read_rows`."""
        gen, i, lo, hi = where
        with self._lock:
            g = next((g for g in self._gens if g.index == gen), None)
        if g is None:
            raise KeyError(f"generation {gen} is no longer stored")
        return g.rows("train", i, lo, hi, copy)

    def hold(self, generations) -> None:
        """Keep these generations from eviction until as many `release` calls name them (the budget
        may be exceeded meanwhile; eviction catches up at the next flush)."""
        with self._lock:
            self._held.update(generations)

    def release(self, generations) -> None:
        with self._lock:
            self._held.subtract(generations)
            self._held = +self._held

    def heldout(self, max_tokens: int, newest: bool = True, tag: str | None = None,
                generated: bool = False, max_generated: int | None = None) -> list[CaptureSpan]:
        """Held-out spans, newest first (or oldest first), up to `max_tokens` rows in all; only
        those of traffic tag `tag` when given. `generated`: only spans with rows serving drafted
        on, each cut after `max_generated` of them (`CaptureSpan.cut_generated`), so a long
        generation does not fill the sample alone."""
        with self._lock:
            return fill_rows(self._iter_split("heldout", newest, tag), max_tokens, generated, max_generated)

    def stored_spans(self):
        """(generation index, span) of every span written to disk, both splits, oldest generation
        first (pending spans are not included): for offline replays of what a trainer received."""
        with self._lock:
            gens = list(self._gens)
        for g in gens:
            for split in SPLITS:
                for i in range(len(g.lens[split])):
                    yield g.index, g.span(split, i)

    def heldout_tags(self) -> list[str]:
        """Traffic tags of the stored held-out spans, sorted."""
        with self._lock:
            return sorted({str(t) for g in self._gens for t in g.tags["heldout"]}
                          | {s.tag for s in self._pending["heldout"]})

    def __len__(self) -> int:
        with self._lock:
            return (sum(len(g.lens[s]) for g in self._gens for s in SPLITS)
                    + sum(len(v) for v in self._pending.values()))

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return (sum(int(g.lens[s].sum()) for g in self._gens for s in SPLITS)
                    + sum(s.num_rows for v in self._pending.values() for s in v))

    @property
    def nbytes(self) -> int:
        """Bytes charged against the budget: generations on disk plus pending spans."""
        with self._lock:
            return sum(g.nbytes for g in self._gens) + self._pending_bytes

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            out.update(spans=len(self), tokens=self.num_tokens, bytes=self.nbytes, pending_bytes=self._pending_bytes,
                       generations=len(self._gens), recent_spans=len(self._recent),
                       train_spans=sum(len(g.lens["train"]) for g in self._gens) + len(self._pending["train"]),
                       heldout_spans=sum(len(g.lens["heldout"]) for g in self._gens) + len(self._pending["heldout"]))
            return out

    def state_dict(self) -> dict:
        """Counters and generation number; the spans themselves live on disk under `root`."""
        with self._lock:
            return {"counters": dict(self.counters), "next_gen": self._next_gen}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.counters.update({k: int(v) for k, v in state["counters"].items() if k in self.counters})
            self._next_gen = max(self._next_gen, int(state["next_gen"]))

    # ---- internals ------------------------------------------------------------------------------

    def _pools(self, split: str) -> list[_Pool]:
        pools = [_Pool(g.lens[split], lambda i, lo, hi, g=g: g.rows(split, i, lo, hi), g.name)
                 for g in self._gens if len(g.lens[split])]
        pools.append(_Pool.of(list(self._pending[split])))
        return pools

    def _iter_split(self, split: str, newest: bool, tag: str | None = None):
        """Spans of `split` in arrival order (or newest first); only those of `tag` when given
        (skipped by their stored tag, without reading them)."""
        pending = [s for s in self._pending[split] if tag is None or s.tag == tag]
        gens = self._gens

        def indices(g: _Generation):
            return [i for i in range(len(g.lens[split])) if tag is None or g.tags[split][i] == tag]

        if newest:
            yield from reversed(pending)
            for g in reversed(gens):
                for i in reversed(indices(g)):
                    yield g.span(split, i)
        else:
            for g in gens:
                for i in indices(g):
                    yield g.span(split, i)
            yield from pending

    def _remember(self, span: CaptureSpan, at: tuple[int, int] | None = None) -> None:
        """Into the recent window; `at`: its (generation, index) when already written."""
        slot = [at]
        self._recent.append(span)
        self._recent_at.append(slot)
        if at is None:
            self._unwritten[id(span)] = slot
        self._recent_bytes += span.nbytes
        while self._recent and self._recent_bytes > self.cfg.memory_bytes:
            old = self._recent.popleft()
            self._recent_at.popleft()
            self._unwritten.pop(id(old), None)
            self._recent_bytes -= old.nbytes

    def _evict(self) -> None:
        while len(self._gens) > 1 and self.nbytes > self.cfg.budget_bytes:
            if self._held[self._gens[0].index]:
                log.info("replay buffer: generation %d held (rows in flight to a rank); eviction waits",
                         self._gens[0].index)
                break
            g = self._gens.pop(0)
            spans = sum(len(v) for v in g.lens.values())
            self.counters["evicted"] += spans
            self.counters["evicted_tokens"] += int(sum(v.sum() for v in g.lens.values()))
            self.counters["evicted_generations"] += 1
            g.data.clear()
            shutil.rmtree(g.path, ignore_errors=True)
            log.info("replay buffer: evicted generation %d (%d spans, %d bytes)", g.index, spans, g.nbytes)

    def _save_state(self) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(self.state_dict()))
        os.replace(tmp, self.root / "state.json")

    def _reopen(self) -> None:
        remove_partial(self._gens_dir)
        state_path = self.root / "state.json"
        if state_path.exists():
            try:
                self.load_state_dict(json.loads(state_path.read_text()))
            except (ValueError, KeyError, TypeError) as e:
                log.warning("replay buffer: ignoring unreadable %s: %s", state_path, e)
        for path in sorted(p for p in self._gens_dir.iterdir() if p.is_dir() and p.name.isdigit()):
            try:
                self._gens.append(_Generation(int(path.name), path))
            except Exception as e:  # a damaged generation must not keep the trainer from starting
                log.warning("replay buffer: removing unreadable generation %s: %s", path, e)
                shutil.rmtree(path, ignore_errors=True)
        if self._gens:
            self._next_gen = max(self._next_gen, self._gens[-1].index + 1)
        self._refill_recent()

    def _refill_recent(self) -> None:
        newest_first: list[tuple[CaptureSpan, tuple[int, int]]] = []
        size = 0
        stored = ((g, i) for g in reversed(self._gens) for i in reversed(range(len(g.lens["train"]))))
        for g, i in stored:  # the stored train spans, newest first, with their locations
            span = g.span("train", i)
            if size + span.nbytes > self.cfg.memory_bytes:
                break
            newest_first.append((span, (g.index, i)))
            size += span.nbytes
        for span, at in reversed(newest_first):
            self._remember(span, at)


def fill_rows(spans: Iterable[CaptureSpan], max_tokens: int, generated: bool = False,
              max_generated: int | None = None) -> list[CaptureSpan]:
    """`spans` in their order up to `max_tokens` rows in all, the last one cut to fit; with
    `generated`, only spans serving drafted on, each cut after `max_generated` of their generated
    rows (`CaptureSpan.cut_generated`). What `ReplayBuffer.heldout` returns, for any span order
    (scripts replaying a run as of a past moment use it too)."""
    out: list[CaptureSpan] = []
    left = max_tokens
    for span in spans:
        if left <= 0:
            break
        if generated:
            span = span.cut_generated(max_generated)
            if span is None:
                continue
        if span.num_rows > left:
            span = span.slice(0, left)
        out.append(span)
        left -= span.num_rows
    return out


def _draw(out: list, budget: int, pools: list[_Pool], rng: np.random.Generator,
          cut: bool = True, refs: bool = False) -> int:
    """Append spans drawn token-uniformly from `pools` until `budget` rows (the last one cut to a
    random window of what is left, or, `cut` False, whole); returns rows drawn. `refs`: append
    each as its pool's `Drawn` instead of its rows."""
    lens = np.concatenate([p.lens for p in pools]) if pools else np.zeros(0, dtype=np.int64)
    if budget <= 0 or lens.sum() == 0:
        return 0
    cum = np.cumsum(lens)
    pool_end = np.cumsum([len(p.lens) for p in pools])
    got = 0
    while got < budget:
        flat = int(np.searchsorted(cum, rng.integers(0, cum[-1]), side="right"))
        k = int(np.searchsorted(pool_end, flat, side="right"))
        n = int(lens[flat])
        take = min(n, budget - got) if cut else n
        lo = int(rng.integers(0, n - take + 1)) if take < n else 0
        pick = pools[k].ref if refs else pools[k].get
        out.append(pick(flat - (int(pool_end[k - 1]) if k else 0), lo, lo + take))
        got += take
    return got

