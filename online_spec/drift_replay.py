"""`online-spec drift replay`: run recorded verify rounds through the drift monitor, offline.

An operator tunes the detector (`--drift-threshold`, `--drift-block-rounds`, ...) on traffic
they recorded instead of waiting for the next drift. A trace is JSON lines, one verify round
each, as `online-spec bench drift-alerts` writes them (NAME.rounds.jsonl next to its JSON):

    {"batch_size": 8, "accepted": [2, 5, 0, 1, 3, 3, 0, 1], "num_steps": 5,
     "request_ids": ["r1", ...], "tags": ["", ...], "head_version": 0, "phase": "stationary"}

batch_size, accepted (drafts accepted per request, bonus excluded) and num_steps (K) are
required; request_ids (for the collapse window's span), tags (one per request; default all
""), head_version (default 0) and phase (a label for the summary) are optional. A round
becomes the detector's observations exactly as on the server (`drift.round_observations`),
so replaying a bench's trace with the bench's settings raises the alerts the live run raised.

Out: one JSON line per alert (`--out`, default stdout) with the round's line index and phase;
a summary (`--json`): rounds and alerts per phase, and for each phase after the first the
rounds from its first round to its first drop alert (`rounds_to_drop`), the bench's
`rounds_to_alert` when the phases are the bench's.

    online-spec drift replay --trace results/bench_drift.rounds.jsonl --drift-threshold 16 \\
        --json replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from online_spec.config import add_config_args, check, config_from_args, config_to_dict, doc
from online_spec.controller.replay import TraceError, read_trace_rows, run_replay_command
from online_spec.drift import MIX_TAG, MIX_TAG_RESERVED, DriftConfig, DriftDetector, round_observations
from online_spec.jsonl import open_text, write_json_lines


@dataclass(frozen=True)
class DriftReplayConfig:
    """Inputs of `drift replay` (the detector's settings are the --drift-* options)."""

    trace: Path | None = doc("JSON-lines trace of verify rounds (required; .gz is read through gzip)", None)
    out: Path | None = doc("where to write one JSON line per alert; default: stdout", None)

    def __post_init__(self) -> None:
        check(self.trace is not None, "trace", "is required (--trace ROUNDS.jsonl)")


def read_rounds(lines: Iterable[str], source: str = "trace") -> Iterator[dict]:
    """Trace rows with the fields the detector needs, checked; raises TraceError naming line and field."""
    for where, row in read_trace_rows(lines, source):
        n = len(row["accepted"])
        k = row.get("num_steps")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise TraceError(f"{where}: num_steps: must be an int >= 0 (the drift monitor needs K), got {k!r}")
        if any(a > k for a in row["accepted"]):
            raise TraceError(f"{where}: accepted: a request accepted more than num_steps={k} drafts")
        for key, kind in (("request_ids", str), ("tags", str)):
            v = row.get(key)
            if v is not None and not (isinstance(v, list) and len(v) == n and all(isinstance(x, kind) for x in v)):
                raise TraceError(f"{where}: {key}: must be a list of {n} strings (one per request), got {v!r}")
        if MIX_TAG in (row.get("tags") or ()):
            raise TraceError(f"{where}: tags: {MIX_TAG_RESERVED}")
        version = row.get("head_version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise TraceError(f"{where}: head_version: must be an int, got {version!r}")
        phase = row.get("phase", "")
        if not isinstance(phase, str):
            raise TraceError(f"{where}: phase: must be a string, got {phase!r}")
        yield {"batch_size": row["batch_size"], "accepted": row["accepted"], "num_steps": k,
               "request_ids": row.get("request_ids") or [f"{where}#{i}" for i in range(n)],
               "tags": row.get("tags") or [""] * n, "head_version": version, "phase": phase}


def replay_rounds(detector: DriftDetector, rounds: Iterable[dict],
                  on_round: Callable[[int, dict], None] | None = None) -> Iterator[dict]:
    """The alerts the rounds raise, each as its dict plus `round_index` (0-based line of the round
    among the rounds with K > 0, as the bench counts them) and `phase`. `on_round(index, row)` is
    called for each such round (the ones the detector sees)."""
    index = -1
    for row in rounds:
        obs = round_observations(row["batch_size"], row["num_steps"], row["accepted"], row["tags"],
                                 row["request_ids"], row["head_version"], timestamp=float(index + 1))
        if not obs:
            continue
        index += 1
        if on_round is not None:
            on_round(index, row)
        for o in obs:
            for alert in detector.update(o):
                yield {"round_index": index, "phase": row["phase"], **alert.to_dict()}


def summarize(rounds_by_phase: dict[str, int], first_round: dict[str, int], alerts: list[dict]) -> dict:
    """Rounds and alerts per phase (in trace order); for each phase after the first, rounds from its
    first round up to and including the one that raised its first drop alert (None: none)."""
    phases = {}
    for i, (phase, n) in enumerate(rounds_by_phase.items()):
        mine = [a for a in alerts if a["phase"] == phase]
        drop = next((a for a in mine if a["kind"] == "drop"), None)
        phases[phase] = {"rounds": n, "alerts": len(mine), "alerts_by_kind": dict(Counter(a["kind"] for a in mine)),
                         "rounds_to_drop": (None if i == 0 or drop is None
                                            else drop["round_index"] - first_round[phase] + 1)}
    return {"rounds": sum(rounds_by_phase.values()), "alerts": len(alerts), "phases": phases}


def replay_file(path: Path, cfg: DriftConfig) -> tuple[list[dict], dict]:
    """(alerts, summary) of a trace file replayed through a fresh detector with `cfg`."""
    counted: dict[str, int] = {}
    first: dict[str, int] = {}

    def tally(index: int, row: dict) -> None:
        first.setdefault(row["phase"], index)
        counted[row["phase"]] = counted.get(row["phase"], 0) + 1

    with open_text(path) as f:
        alerts = list(replay_rounds(DriftDetector(cfg), read_rounds(f, source=str(path)), on_round=tally))
    return alerts, summarize(counted, first, alerts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="drift_command", required=True, metavar="SUBCOMMAND")
    help_text = "replay recorded verify rounds through the drift monitor"
    p = sub.add_parser("replay", help=help_text, description=help_text)
    add_config_args(p, DriftReplayConfig)
    add_config_args(p, DriftConfig, prefix="drift_")
    p.add_argument("--json", type=Path, default=None, help="write the summary (and the settings) to this JSON file")


def _replay(args: argparse.Namespace, prog: str) -> None:
    cfg = config_from_args(DriftReplayConfig, args)
    drift = config_from_args(DriftConfig, args, prefix="drift_")
    alerts, summary = replay_file(cfg.trace, drift)
    write_json_lines(cfg.out, ({k: (None if isinstance(v, float) and v != v else v) for k, v in a.items()}
                               for a in alerts))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": str(cfg.trace), **summary, "drift_config": config_to_dict(drift)},
                                        indent=2) + "\n", encoding="utf-8")
    per_phase = ", ".join(f"{p or '(no phase)'}: {v['rounds']} rounds, {v['alerts']} alerts"
                          + (f", first drop after {v['rounds_to_drop']} rounds" if v["rounds_to_drop"] else "")
                          for p, v in summary["phases"].items())
    print(f"{prog}: {summary['rounds']} rounds, {summary['alerts']} alerts ({per_phase})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    prog = f"online-spec drift {args.drift_command}"
    return run_replay_command(prog, lambda: _replay(args, prog))
