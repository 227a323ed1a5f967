"""On-disk schema of capture spans: Hugging Face `datasets` (Arrow) shards, one row per span.

The replay buffer and the offline pretraining data (teacher-forced records written by the
distillation code) share this schema, so the trainer reads both the same way.

    column         type                 content
    schema         int32                SCHEMA_VERSION
    request_id     string               span.request_id
    tag            string               span.tag
    first_pos      int64                position of the first row
    num_rows       int64                n
    hidden_size    int64                H
    float_dtype    string               "bfloat16" | "float16" | "float32"
    tokens         list<int64>          [n + 1]
    features       large_binary         [n, 3H] raw little-endian bytes of float_dtype
    final_hidden   large_binary         [n, H]  raw bytes of float_dtype
    accepted, draft_token, draft_prob, num_steps, batch_size, draft_version, is_prefill,
    timestamp      list<...>            the per-row arrays of `CaptureSpan`, [n] each

Hidden states are stored as raw bytes (Arrow has no bfloat16, and a list<float32> would double
the size); everything else is a plain column any `datasets` user can read. A directory written
by `save_spans` holds shards `shard-00000/`, `shard-00001/`, ... each a `save_to_disk` output:

    save_spans(spans, "data/pretrain", shard_bytes=256 << 20)   # spans: any iterable, streamed
    spans = load_spans("data/pretrain")          # or: for span in iter_spans(...)
    ds = load_dataset_dir("data/pretrain")       # one datasets.Dataset over all shards

Shards are written to a temporary directory and renamed into place, so a killed writer leaves
no half shard behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import datasets
import torch

from collector.span import PER_ROW, PER_ROW_DTYPES, CaptureSpan
from collector.wire import FLOAT_DTYPES
from online_spec.capture import row_shapes

SCHEMA_VERSION = 1
SHARD_PREFIX = "shard-"
_TMP_PREFIX = ".tmp-"

_ARROW_PER_ROW = {
    "accepted": "int8", "draft_token": "int64", "draft_prob": "float32", "num_steps": "int32",
    "batch_size": "int32", "draft_version": "int64", "is_prefill": "bool", "timestamp": "float64",
}
FEATURES = datasets.Features({
    "schema": datasets.Value("int32"),
    "request_id": datasets.Value("string"),
    "tag": datasets.Value("string"),
    "first_pos": datasets.Value("int64"),
    "num_rows": datasets.Value("int64"),
    "hidden_size": datasets.Value("int64"),
    "float_dtype": datasets.Value("string"),
    "tokens": datasets.List(datasets.Value("int64")),
    "features": datasets.Value("large_binary"),
    "final_hidden": datasets.Value("large_binary"),
    **{name: datasets.List(datasets.Value(_ARROW_PER_ROW[name])) for name in PER_ROW},
})
_DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}


def span_to_row(span: CaptureSpan) -> dict:
    """One Arrow row of a span."""
    if span.features.dtype not in _DTYPE_NAMES:
        raise ValueError(f"span {span.request_id!r}: features dtype {span.features.dtype} cannot be stored")
    return {
        "schema": SCHEMA_VERSION,
        "request_id": span.request_id,
        "tag": span.tag,
        "first_pos": span.first_pos,
        "num_rows": span.num_rows,
        "hidden_size": span.hidden_size,
        "float_dtype": _DTYPE_NAMES[span.features.dtype],
        "tokens": span.tokens.tolist(),
        "features": _to_bytes(span.features),
        "final_hidden": _to_bytes(span.final_hidden.to(span.features.dtype)),
        **{name: getattr(span, name).tolist() for name in PER_ROW},
    }


def row_to_span(row: dict) -> CaptureSpan:
    """The span of one Arrow row; ValueError if the row is inconsistent or of another schema."""
    if row["schema"] != SCHEMA_VERSION:
        raise ValueError(f"span row of schema {row['schema']}, this reader understands {SCHEMA_VERSION}")
    dtype = FLOAT_DTYPES[row["float_dtype"]]
    shapes = row_shapes(row["num_rows"], row["hidden_size"])
    span = CaptureSpan(
        request_id=row["request_id"],
        first_pos=row["first_pos"],
        tokens=torch.tensor(row["tokens"], dtype=torch.int64),
        features=_from_bytes(row["features"], dtype, shapes["features"]),
        final_hidden=_from_bytes(row["final_hidden"], dtype, shapes["final_hidden"]),
        tag=row["tag"],
        **{name: torch.tensor(row[name], dtype=PER_ROW_DTYPES[name]).reshape(-1) for name in PER_ROW},
    )
    span.validate()
    return span


def read_rows(ds: datasets.Dataset, i: int, lo: int = 0, hi: int | None = None, copy: bool = True) -> CaptureSpan:
    """Rows lo..hi-1 of span `i` of a shard, straight from the memory-mapped Arrow table: only
    those rows' bytes are copied, and no Python lists are built (what `row_to_span` of the whole
    row then `CaptureSpan.slice` returns, at a fraction of the cost: the replay buffer's draws).
    Schema and shapes are checked (ValueError); values are not re-scanned for non-finite numbers:
    the replay buffer validated every span before writing it, and a corrupted value reaches the
    distiller as a non-finite loss, a dropped step. `copy` False: the float rows are read-only
    views of the memory-mapped table (no copy, no GIL held for one), for a caller that copies them
    at once (a batch being built) while the dataset stays open."""
    if i < 0:
        raise IndexError(f"span {i} outside a shard of {len(ds)} spans")
    k = int(i) if ds._indices is None else ds._indices.column(0)[int(i)].as_py()  # a select()ed dataset
    row = ds.data.table.slice(k, 1)
    one = {name: next((c for c in row.column(name).chunks if len(c)), None) for name in row.column_names}
    if one["schema"] is None:
        raise IndexError(f"span {i} outside a shard of {len(ds)} spans")
    if one["schema"][0].as_py() != SCHEMA_VERSION:
        raise ValueError(f"span row of schema {one['schema'][0].as_py()}, this reader understands {SCHEMA_VERSION}")
    n, hidden = one["num_rows"][0].as_py(), one["hidden_size"][0].as_py()
    hi = n if hi is None else hi
    if not 0 <= lo < hi <= n:
        raise ValueError(f"rows {lo}:{hi} outside a span of {n} rows")
    dtype = FLOAT_DTYPES[one["float_dtype"][0].as_py()]
    shapes = row_shapes(n, hidden)

    def floats(name: str) -> torch.Tensor:
        width = shapes[name][1]
        buf = one[name][0].as_buffer()
        if buf is None or buf.size != n * width * dtype.itemsize:
            size = 0 if buf is None else buf.size
            raise ValueError(f"stored {name} has {size} bytes, expected {n * width * dtype.itemsize} "
                             f"for [{n}, {width}] {dtype}")
        part = memoryview(buf)[lo * width * dtype.itemsize:hi * width * dtype.itemsize]
        if not copy:
            with warnings.catch_warnings():  # read-only by contract (the docstring)
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(part, dtype=torch.uint8).view(dtype).reshape(hi - lo, width)
        return torch.frombuffer(bytearray(part), dtype=torch.uint8).view(dtype).reshape(hi - lo, width)

    def ints(name: str, a: int, b: int, want: int, dtype_: torch.dtype) -> torch.Tensor:
        values = one[name].flatten()
        if len(values) != want:
            raise ValueError(f"stored {name} has {len(values)} values, expected {want}")
        return torch.from_numpy(values.slice(a, b - a).to_numpy(zero_copy_only=False).copy()).to(dtype_)

    return CaptureSpan(
        request_id=one["request_id"][0].as_py(), first_pos=one["first_pos"][0].as_py() + lo,
        tokens=ints("tokens", lo, hi + 1, n + 1, torch.int64),
        features=floats("features"), final_hidden=floats("final_hidden"), tag=one["tag"][0].as_py(),
        **{name: ints(name, lo, hi, n, PER_ROW_DTYPES[name]) for name in PER_ROW},
    )


def write_shard(spans: list[CaptureSpan], path: str | Path) -> int:
    """Write one shard atomically (temporary directory, then rename); returns its bytes on disk."""
    path = Path(path)
    tmp = path.parent / f"{_TMP_PREFIX}{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    columns: dict[str, list] = {name: [] for name in FEATURES}
    for span in spans:
        for name, value in span_to_row(span).items():
            columns[name].append(value)
    with _quiet():
        datasets.Dataset.from_dict(columns, features=FEATURES).save_to_disk(str(tmp))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return dir_bytes(path)


def read_shard(path: str | Path) -> datasets.Dataset:
    """A shard as a memory-mapped `datasets.Dataset` (rows -> spans with `row_to_span`)."""
    with _quiet():
        return datasets.load_from_disk(str(path))


def save_spans(spans: Iterable[CaptureSpan], directory: str | Path, shard_bytes: int = 256 << 20) -> list[Path]:
    """Stream spans into shards of about `shard_bytes` under `directory` (appending after any
    shards already there); returns the shard paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = len(shard_paths(directory))
    written: list[Path] = []
    batch: list[CaptureSpan] = []
    size = 0
    for span in spans:
        batch.append(span)
        size += span.nbytes
        if size >= shard_bytes:
            written.append(directory / f"{SHARD_PREFIX}{index + len(written):05d}")
            write_shard(batch, written[-1])
            batch, size = [], 0
    if batch:
        written.append(directory / f"{SHARD_PREFIX}{index + len(written):05d}")
        write_shard(batch, written[-1])
    return written


def shard_paths(directory: str | Path) -> list[Path]:
    """The complete shards of a `save_spans` directory, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(SHARD_PREFIX))


def iter_spans(directory: str | Path) -> Iterator[CaptureSpan]:
    """Every span of a `save_spans` directory, shard by shard, in the order written."""
    for path in shard_paths(directory):
        ds = read_shard(path)
        for i in range(len(ds)):
            yield row_to_span(ds[i])


def load_spans(directory: str | Path) -> list[CaptureSpan]:
    return list(iter_spans(directory))


def load_dataset_dir(directory: str | Path) -> datasets.Dataset:
    """All shards of a `save_spans` directory as one `datasets.Dataset`."""
    paths = shard_paths(directory)
    if not paths:
        raise FileNotFoundError(f"no {SHARD_PREFIX}* shards under {directory}")
    return datasets.concatenate_datasets([read_shard(p) for p in paths])


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def remove_partial(directory: str | Path) -> None:
    """Delete temporary directories a killed writer left behind."""
    for p in Path(directory).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(blob: bytes, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    expected = shape[0] * shape[1] * dtype.itemsize
    if len(blob) != expected:
        raise ValueError(f"stored tensor has {len(blob)} bytes, expected {expected} for {list(shape)} {dtype}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype).reshape(shape)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # datasets draws a progress bar per save/load; the trainer's logs should not fill with them.
    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            datasets.utils.logging.enable_progress_bar()
