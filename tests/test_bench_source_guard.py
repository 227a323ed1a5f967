"""`bench.common.SourceGuard`: a long bench stops, naming the file, when its source changes under it
(its later configurations would run other code than the earlier ones)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.common import SourceGuard


def test_an_edit_an_addition_and_a_removal_each_stop_the_bench(tmp_path: Path):
    pkg = tmp_path / "serving"
    pkg.mkdir()
    (pkg / "engine.py").write_text("x = 1\n")
    (pkg / "notes.txt").write_text("not code\n")
    guard = SourceGuard(tmp_path, packages=("serving",))
    guard.check("configuration 'plain'")  # nothing changed
    (pkg / "notes.txt").write_text("changed, not code\n")
    guard.check("configuration 'static'")
    os.utime(pkg / "engine.py", ns=(1, 1))  # an edit: its time moved (same size)
    with pytest.raises(RuntimeError, match=r"serving/engine\.py.*configuration 'online_spec'"):
        guard.check("configuration 'online_spec'")
    guard = SourceGuard(tmp_path, packages=("serving",))
    (pkg / "new.py").write_text("y = 2\n")
    assert guard.changed() == ["serving/new.py"]
    (pkg / "new.py").unlink()
    (pkg / "engine.py").unlink()
    assert guard.changed() == ["serving/engine.py"]


def test_the_repository_guard_sees_every_layer():
    guard = SourceGuard()
    assert {p.split("/")[0] for p in guard._at_start} == {"online_spec", "collector", "serving", "trainer", "bench"}
    assert guard.changed() == []
