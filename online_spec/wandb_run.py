"""W&B run helpers shared by the trainer daemon and the server.

`init_wandb(project, entity, run_dir, mode="offline", config=...)` starts a run (offline by
default, so nothing leaves the machine until `wandb sync <run dir>`), and never raises: if wandb
is missing or fails to start, it logs a warning and returns None, and callers skip logging.

`iter_run_records(path)` reads an offline run's `.wandb` file back as `wandb_internal_pb2.Record`
protobufs. wandb 0.31 ships no Python reader (the writer lives in wandb-core, in Go), so the
format is read here: a 7-byte file header (`":W&B"`, magic 0xBEE1 little-endian, version 0),
then LevelDB-log-style 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of the type
byte and the data, length, type: 1 full, 2 first, 3 middle, 4 last); a block tail shorter than a
header is zero padding. `wait_for_run_exit(path, timeout_s)` waits for the file to be
complete (wandb-core writes it asynchronously, after `run.finish()` may have returned). Used by `online_spec.alerts.read_alerts_from_offline_run`.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional

from online_spec.advice import warn

log = logging.getLogger(__name__)

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_BLOCK = 32768
_WANDB_COST = "metrics and drift alerts of this run are not recorded in W&B (they still reach the log and /metrics)"
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def init_wandb(project: str, entity: Optional[str], run_dir: str | os.PathLike, mode: str = "offline",
               config: Optional[dict] = None, name: Optional[str] = None, **settings: Any):
    """Start a W&B run writing under `run_dir`; None (with a warning) when wandb is unavailable."""
    try:
        import wandb
    except Exception as e:  # noqa: BLE001 - wandb is optional at run time
        warn(log, "wandb_unavailable", f"wandb unavailable ({e}): W&B logging is off", cost=_WANDB_COST,
             fix="pip install wandb, or turn W&B off (serve --wandb-mode off, train --wandb-mode disabled)")
        return None
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return wandb.init(project=project, entity=entity, dir=str(run_dir), mode=mode, config=config,
                          name=name, settings=wandb.Settings(**settings) if settings else None)
    except Exception as e:  # noqa: BLE001 - serving and training go on without W&B
        warn(log, "wandb_init_failed", f"wandb.init failed ({type(e).__name__}: {e}): W&B logging is off",
             cost=_WANDB_COST, fix=f"check that {run_dir} is writable and, for mode 'online', the W&B login; "
                                   "or turn W&B off")
        return None


def find_run_file(path: str | os.PathLike) -> Path:
    """The `.wandb` file of an offline run: `path` itself, or the one `run-*.wandb` under it."""
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("run-*.wandb")) or sorted(p.glob("**/run-*.wandb"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one run-*.wandb under {p}, found {[str(f) for f in found]}")
    return found[0]


def wait_for_run_exit(path: str | os.PathLike, timeout_s: float) -> bool:
    """Wait until the run file holds its `exit` record; False if it does not within `timeout_s`.

    `run.finish()` can return before wandb-core has written the run file (seen with 0.31: the
    file still only 7 bytes long), so a reader that wants the whole run waits for this.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if any(r.WhichOneof("record_type") == "exit" for r in iter_run_records(path)):
                return True
        except (FileNotFoundError, ValueError):
            pass  # not written yet, or caught mid-write
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def iter_run_records(path: str | os.PathLike) -> Iterator[Any]:
    """Records of an offline run file, in order. A torn last chunk (run still writing) ends it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = find_run_file(path).read_bytes()
    if len(data) < _FILE_HEADER.size:
        return
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (_IDENT, _MAGIC, _VERSION):
        raise ValueError(f"not a W&B run file (header {ident!r} {magic:#x} v{version})")
    pos, pending = _FILE_HEADER.size, b""
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:  # block tail padding
            pos += left
            continue
        if pos + _CHUNK_HEADER.size > len(data):
            return
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        pos += _CHUNK_HEADER.size
        if pos + length > len(data):
            return
        chunk = data[pos:pos + length]
        pos += length
        if crc == 0 and length == 0 and kind == 0:  # zero fill after the writer stopped
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"W&B run file: checksum mismatch at offset {pos - length - _CHUNK_HEADER.size}")
        if kind == _FULL:
            payload = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        elif kind == _LAST:
            payload, pending = pending + chunk, b""
        else:
            raise ValueError(f"W&B run file: unknown chunk type {kind}")
        record = pb.Record()
        record.ParseFromString(payload)
        yield record
