"""JSON lines: the one reader and writer of every `.jsonl` file the project reads or writes.

In: a path (a name ending in `.gz` goes through gzip, both ways) or lines of text. Out of the
reader: `(where, row)` per non-blank line, `where` being `file:line` (1-based) and `row` a JSON
object; a line that is not valid JSON or not an object raises `JsonLinesError` naming `where`
and the problem. Each caller checks its own fields and raises the same error type, with
`where` at the front of its message. The writer writes one `json.dumps` line per row.

    for where, row in read_json_file("rounds.jsonl.gz"):
        if "batch_size" not in row:
            raise JsonLinesError(f"{where}: batch_size: is required")
    write_json_lines("out.jsonl", rows)       # None: to stdout
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import IO, Iterable, Iterator


class JsonLinesError(ValueError):
    """A malformed JSON-lines file; the message starts with `file:line`."""


def open_text(path: str | Path, mode: str = "r") -> IO[str]:
    """`path` as UTF-8 text (mode "r", "w" or "a"); a name ending in .gz through gzip."""
    if str(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def parse_json_line(line: str, where: str) -> dict:
    """One line -> its JSON object, or JsonLinesError naming `where`."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise JsonLinesError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise JsonLinesError(f"{where}: must be a JSON object, got {type(row).__name__}")
    return row


def read_json_lines(lines: Iterable[str], source: str) -> Iterator[tuple[str, dict]]:
    """(`source:line`, object) per non-blank line; JsonLinesError for bad JSON or a non-object."""
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            where = f"{source}:{lineno}"
            yield where, parse_json_line(line, where)


def read_json_file(path: str | Path) -> Iterator[tuple[str, dict]]:
    """`read_json_lines` of a file (.gz through gzip), named by its path; closed when exhausted.
    A missing file raises OSError, a .gz that is not gzip OSError, bytes that are not UTF-8
    UnicodeDecodeError."""
    with open_text(path) as f:
        yield from read_json_lines(f, str(path))


def json_line(row: dict) -> str:
    """One row as a JSON line, newline included."""
    return json.dumps(row) + "\n"


def write_json_lines(path: str | Path | None, rows: Iterable[dict]) -> int:
    """Each row as one JSON line, to `path` (.gz through gzip) or (None) to stdout; returns the
    number of rows written."""
    out = open_text(path, "w") if path is not None else sys.stdout
    n = 0
    try:
        for row in rows:
            out.write(json_line(row))
            n += 1
    finally:
        if out is not sys.stdout:
            out.close()
    return n
