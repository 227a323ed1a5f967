"""`online-spec controller replay`: run a recorded trace of verify rounds through the EMA policy.

A trace is JSON lines, one verify round each (extra keys are ignored):

    {"batch_size": 8, "accepted": [3, 0, 2, 1, 3, 3, 0, 1]}

`accepted` is drafts accepted per request, bonus excluded; the round goes to the slot with the
largest key <= batch_size. Each output line is `{"steps": k}`, that slot's K after the round,
so a trace replayed here and through SGLang's `AdaptiveSpeculativeParams` gives the same lines.

    online-spec controller replay --config configs/adaptive/sglang_default.json \\
        --initial-steps 3 --trace rounds.jsonl [--out steps.jsonl]

`TraceRecorder` writes such a trace; `attach_trace_recorder(engine, path)` hooks one onto a live
engine's `on_round`, so recorded traffic replays here to the K sequence the live EMA policy ran.
Traces are read and written through `online_spec.jsonl` (a name ending in .gz goes through gzip).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

from online_spec.config import ConfigError, add_config_args, check, config_from_args, doc
from online_spec.controller.config import adaptive_config_path, load_adaptive_config
from online_spec.controller.ema import EmaTierPolicy
from online_spec.jsonl import JsonLinesError, json_line, open_text, read_json_lines, write_json_lines

# A trace line's JSON errors and its field errors are one type, named `file:line` first.
TraceError = JsonLinesError


@dataclass(frozen=True)
class ReplayConfig:
    """Inputs of `controller replay`."""

    config: Path | None = doc("adaptive JSON config (SGLang format); default: configs/adaptive/sglang_default.json", None)
    initial_steps: int | None = doc("initial K of every slot (SGLang's --speculative-num-steps; a slot "
                                    "without it starts at its middle tier); default: middle of all tiers", None)
    trace: Path | None = doc("JSON-lines trace, one verify round per line (required; .gz is read through gzip)", None)
    out: Path | None = doc("where to write {\"steps\": k} lines; default: stdout", None)

    def __post_init__(self) -> None:
        check(self.trace is not None, "trace", "is required (--trace TRACE.jsonl)")


def read_trace_rows(lines: Iterable[str], source: str = "trace") -> Iterator[tuple[str, dict]]:
    """(where, row) per non-blank line, batch_size and accepted checked; extra keys are left to
    the reader that wants them. Raises TraceError naming line and field."""
    for where, row in read_json_lines(lines, source):
        b = row.get("batch_size")
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise TraceError(f"{where}: batch_size: must be an int >= 1, got {b!r}")
        acc = row.get("accepted")
        if not isinstance(acc, list) or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0
                                                for a in acc):
            raise TraceError(f"{where}: accepted: must be a list of non-negative ints, got {acc!r}")
        yield where, row


def read_trace(lines: Iterable[str], source: str = "trace") -> Iterator[tuple[int, list[int]]]:
    """(batch_size, accepted) per non-blank line; raises TraceError naming line and field."""
    for _, row in read_trace_rows(lines, source):
        yield row["batch_size"], row["accepted"]


def replay_trace(policy, rounds: Iterable[tuple[int, Sequence[int]]]) -> Iterator[int]:
    """The routed slot's K after each round."""
    for batch_size, accepted in rounds:
        yield policy.update(batch_size, accepted)


class TraceRecorder:
    """Writes one trace line per verify round; `replay` reads them back.

        with TraceRecorder.open(path) as rec:
            rec.record(batch_size, accept_lens, num_steps=k)   # after each verify
    """

    def __init__(self, stream: IO[str], owns_stream: bool = False):
        self._stream, self._owns = stream, owns_stream
        self.rounds = 0

    @classmethod
    def open(cls, path: str | Path) -> "TraceRecorder":
        """A recorder writing to `path` (a name ending in .gz: gzip'd)."""
        return cls(open_text(path, "w"), owns_stream=True)

    def record(self, batch_size: int, accepted: Sequence[int], **extra) -> None:
        """One round; `extra` (num_steps, ctx_len, draft_s, ...) is written where not None."""
        row = {"batch_size": int(batch_size), "accepted": [int(a) for a in accepted]}
        row.update({k: v for k, v in extra.items() if v is not None})
        self._stream.write(json_line(row))
        self.rounds += 1

    def close(self) -> None:
        self._stream.flush()
        if self._owns:
            self._stream.close()

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach_trace_recorder(engine, path: str | Path) -> TraceRecorder:
    """Record every verify round of `engine` as a trace line (close the recorder when done).

    Each line has batch_size, accepted (bonus excluded), num_steps (the K drafted), ctx_len and
    the round's draft/verify seconds as the policy saw them (steady: without long catch-ups;
    absent where a CUDA graph capture was inside). Rounds without a head are skipped, as the engine does
    not feed them to its policy; a round that began with a head swap is marked "rewarm": true
    (the live policy was rewarmed there; `replay` does not rewarm, so a trace with swaps
    replays exactly only up to the first one).
    """
    rec = TraceRecorder.open(path)

    def on_round(stats, outputs) -> None:
        if engine.head is None:
            return
        rec.record(stats.batch_size, stats.accepted, num_steps=stats.num_steps, ctx_len=stats.ctx_len,
                   draft_s=stats.steady_draft_s, verify_s=stats.steady_verify_s,
                   rewarm=True if stats.swapped else None)

    engine.on_round.append(on_round)
    return rec


def replay_steps_used(policy, rounds: Iterable[tuple[int, Sequence[int]]]) -> Iterator[int]:
    """The K each round runs with (`steps_for` before `update`), to compare with the engine's
    `RoundStats.num_steps`; `replay_trace` yields the K after each round instead."""
    for batch_size, accepted in rounds:
        yield policy.steps_for(batch_size)
        policy.update(batch_size, accepted)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="controller_command", required=True, metavar="SUBCOMMAND")
    help_text = "replay a recorded trace of verify rounds through the EMA step policy"
    add_config_args(sub.add_parser("replay", help=help_text, description=help_text), ReplayConfig)


def run_replay_command(prog: str, body: Callable[[], None]) -> int:
    """Run a replay command: a bad trace, setting or file is one line naming it, exit 2."""
    try:
        body()
    except (ConfigError, TraceError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"{prog}: error: the trace is not UTF-8 text ({e.reason} at byte {e.start})", file=sys.stderr)
        return 2
    except OSError as e:  # a missing file, or a .gz that is not gzip
        where = f"{e.filename}: " if e.filename else ""
        print(f"{prog}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _replay(cfg: ReplayConfig) -> None:
    adaptive = load_adaptive_config(cfg.config or adaptive_config_path())
    policy = EmaTierPolicy(adaptive, initial_steps=cfg.initial_steps)
    with open_text(cfg.trace) as trace:
        write_json_lines(cfg.out, ({"steps": k} for k in replay_trace(policy, read_trace(trace, source=str(cfg.trace)))))


def run(args: argparse.Namespace) -> int:
    return run_replay_command(f"online-spec controller {args.controller_command}",
                              lambda: _replay(config_from_args(ReplayConfig, args)))
