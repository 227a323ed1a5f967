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
