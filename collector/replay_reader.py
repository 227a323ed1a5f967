"""Reading a replay buffer's stored rows from a process that does not own it.

`collector.replay.ReplayBuffer` writes each generation of spans under `root/gens/NNNNNNNN/`
(`generation_dir`); `ReplayBuffer.sample_train_refs` names drawn rows by `Where`. A process on the
same host (a trainer rank > 0) reads those rows with a `GenerationReader`, so only the names travel
between processes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from collector.shards import read_rows, read_shard
from collector.span import CaptureSpan

Where = tuple[int, int, int, int]  # (generation, span index in its train shard, lo, hi)


@dataclass
class Drawn:
    """One draw of `ReplayBuffer.sample_train_refs`: rows lo..hi-1 of a stored span. `span`: those
    rows in memory (None: on disk only); `where`: where they are stored (None: not yet written)."""

    span: CaptureSpan | None
    where: Where | None
    name: tuple[str, int, int]  # (request id, position of the first row, rows)

    @property
    def num_rows(self) -> int:
        return self.name[2]


def held_generations(drawn: Iterable[Drawn]) -> list[int]:
    """The generations a draw names (what `sample_train_refs(hold=True)` held), once each."""
    return sorted({d.where[0] for d in drawn if d.where is not None})


def generation_dir(root: str | Path, index: int) -> Path:
    """The directory of generation `index` of the buffer at `root`."""
    return Path(root) / "gens" / f"{index:08d}"


class GenerationReader:
    """Stored train rows of a buffer by location (`Drawn.where`), for a process on the same host
    that does not own the buffer: each generation's shard is opened (memory-mapped) on first use
    and kept open, so its rows stay readable after the owner evicts it."""

    def __init__(self, root: str | Path, max_open: int = 512):
        self.root = Path(root)
        self.max_open = max_open
        self._open: OrderedDict = OrderedDict()

    def rows(self, where: Where, copy: bool = True) -> CaptureSpan:
        """Rows lo..hi-1 of span i of generation g's train shard (FileNotFoundError: the
        generation is gone and was never opened here); `copy` as in `collector.shards.read_rows`."""
        gen, i, lo, hi = (int(x) for x in where)
        ds = self._open.get(gen)
        if ds is None:
            path = generation_dir(self.root, gen) / "train"
            if not path.is_dir():
                raise FileNotFoundError(f"generation {gen} of the buffer at {self.root} is not stored")
            ds = self._open[gen] = read_shard(path)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(gen)
        return read_rows(ds, i, lo, hi, copy)
