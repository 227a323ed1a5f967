"""What every `online-spec bench ...` shares: the machine description, timing, JSON output.

Benchmarks report ratios taken side by side in one process, medians of repeats; they never
assert timings. Each writes its report through `write_report`: a JSON with `date`, `command`
and `machine` beside its figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from online_spec.config import add_config_args
from online_spec.machine import machine_info


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync() -> None:
    """Wait for queued GPU work (device calls return before it ends); nothing on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def write_report(path: Path | None, figures: dict, show: Sequence[str] | None = None) -> dict:
    """Add date/command/machine to `figures`, write the report as JSON to `path` (if given) and
    print it (only the `show` keys where given; nothing for an empty `show`); returns the report."""
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["online-spec"] + sys.argv[1:]),
              "machine": machine_info(), **figures}
    text = json.dumps(report, indent=2, default=str)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    if show is None or show:
        print(text if show is None else json.dumps({k: report.get(k) for k in show}, indent=2, default=str))
    return report


SOURCE_PACKAGES = ("online_spec", "collector", "serving", "trainer", "bench")


class SourceGuard:
    """The code a long bench runs, as it was when the bench started. Its sessions start servers and
    trainers in new processes and import modules lazily, so a source file edited during the run
    would make later configurations run other code than earlier ones. `check` raises, naming what
    changed; the bench stops rather than compare two versions of the code."""

    def __init__(self, root: Path | None = None, packages: Sequence[str] = SOURCE_PACKAGES):
        self.root, self.packages = Path(root or Path(__file__).resolve().parents[1]), tuple(packages)
        self._at_start = self._scan()

    def _scan(self) -> dict[str, tuple[int, int]]:
        out = {}
        for pkg in self.packages:
            for p in (self.root / pkg).rglob("*.py"):
                st = p.stat()
                out[str(p.relative_to(self.root))] = (st.st_mtime_ns, st.st_size)
        return out

    def changed(self) -> list[str]:
        """Source files added, removed or modified since the start."""
        now = self._scan()
        return sorted(k for k in now.keys() | self._at_start.keys() if now.get(k) != self._at_start.get(k))

    def check(self, what: str) -> None:
        changed = self.changed()
        if changed:
            raise RuntimeError(f"the source under {self.root} changed since the bench started "
                               f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}): {what} would run "
                               "other code than the configurations before it; run the bench again on a tree "
                               "left alone")


def add_bench_args(parser, config_cls, quick: dict, quick_help: str = "a short run") -> None:
    """A bench's flags: its config dataclass's fields, `--json PATH` and `--quick` (`quick`'s
    settings for every flag the command line does not set; see `quick_overrides`)."""
    add_config_args(parser, config_cls)
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help=f"{quick_help} ({quick})")


def quick_overrides(args, quick: dict) -> dict:
    """With --quick, the `quick` settings for every flag the command line did not set (unset
    flags are absent from args); otherwise nothing."""
    return {k: v for k, v in quick.items() if args.quick and not hasattr(args, k)}
