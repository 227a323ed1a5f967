"""Where an engine round's time goes, stage by stage: `RoundTimeline`.

    tl = RoundTimeline(target.device)   # then engine.timeline = tl; rounds run as usual
    report = tl.report()                # medians per stage; per round on request

The engine marks the end of each stage of a round (`Engine.step`): decide (the policy's K, or
tree, before drafting), draft (the draft cache's catch-up, K head steps with the early stop,
the verify-length cut), verify (the target forward), accept (accept, commit, capture rows
staged; a tree round's verify is inside it), learn (the policy's update, capture submit, the
round hooks). At each mark the timeline takes the host clock and, on a CUDA device, records an
event on the current stream (no synchronization), and it opens a profiler range named
`round.<stage>` so that a `torch.profiler` run over the rounds attributes kernels to stages.

Per stage: host ms (the host's time in it) and, on CUDA, device ms (from the GPU reaching the
previous mark to reaching this one, idle gaps included). `report(busy_ms_per_round=...)` takes
the GPU's kernel time per round (from a profile) and gives the idle share of a round: what host
work between launches costs on a GPU. Off (the engine's default, `NO_TIMELINE`) each mark is a
call of a no-op.
"""

from __future__ import annotations

import statistics
import time

import torch

STAGES = ("decide", "draft", "verify", "accept", "learn")


class RoundTimeline:
    """Stage marks of engine rounds (host clock, CUDA events on a GPU)."""

    def __init__(self, device: torch.device | str = "cpu", max_rounds: int = 100_000):
        self.cuda = torch.device(device).type == "cuda"
        self.max_rounds = max_rounds
        self.rounds: list[dict] = []  # {"k", "batch_size", "host": [(stage, t)], "events": [(stage, event)]}
        self._cur: dict | None = None
        self._range = None

    def start(self) -> None:
        """A round begins (the engine calls it after admission, when it has requests)."""
        self._close_range()
        if len(self.rounds) >= self.max_rounds:
            self._cur = None
            return
        self._cur = {"host": [("start", time.perf_counter())], "events": []}
        if self.cuda:
            self._cur["events"].append(("start", self._event()))
        self._open_range("decide")

    def mark(self, stage: str) -> None:
        """`stage` ended now."""
        cur = self._cur
        if cur is None:
            return
        cur["host"].append((stage, time.perf_counter()))
        if self.cuda:
            cur["events"].append((stage, self._event()))
        self._close_range()
        nxt = STAGES.index(stage) + 1 if stage in STAGES else len(STAGES)
        if nxt < len(STAGES):
            self._open_range(STAGES[nxt])

    def end(self, num_steps: int, batch_size: int, catchup_s: float = 0.0, captures: int = 0) -> None:
        """The round ended (after its last mark); catchup_s: its long draft-cache catch-ups
        (`RoundStats.catchup_s`), captures: CUDA graphs it captured."""
        self._close_range()
        if self._cur is not None:
            self._cur.update(k=num_steps, batch_size=batch_size, catchup_s=catchup_s, captures=captures)
            self.rounds.append(self._cur)
        self._cur = None

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _open_range(self, stage: str) -> None:
        self._range = torch.profiler.record_function(f"round.{stage}")
        self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    # -- after the rounds ---------------------------------------------------------------------

    def per_round(self) -> list[dict]:
        """Each round: K, batch size, wall ms, and per stage host ms (and device ms on CUDA)."""
        if self.cuda and self.rounds:
            torch.cuda.synchronize()
        out = []
        for r in self.rounds:
            row = {"k": r["k"], "batch_size": r["batch_size"],
                   "wall_ms": 1e3 * (r["host"][-1][1] - r["host"][0][1]), "host_ms": {}, "device_ms": {},
                   "catchup_ms": 1e3 * r.get("catchup_s", 0.0), "captures": r.get("captures", 0)}
            for (prev, t0), (stage, t1) in zip(r["host"], r["host"][1:]):
                row["host_ms"][stage] = 1e3 * (t1 - t0)
            for (prev, e0), (stage, e1) in zip(r["events"], r["events"][1:]):
                row["device_ms"][stage] = e0.elapsed_time(e1)
            if r["events"]:
                row["device_span_ms"] = r["events"][0][1].elapsed_time(r["events"][-1][1])
            out.append(row)
        return out

    def report(self, busy_ms_per_round: float | None = None) -> dict:
        """Medians over the rounds: wall ms, host ms and device ms per stage, the K histogram;
        with the GPU's kernel ms per round (a profile's), its idle share of a round."""
        rows = self.per_round()
        if not rows:
            return {"rounds": 0}
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out = {"rounds": len(rows), "wall_ms": med([r["wall_ms"] for r in rows]),
               "mean_wall_ms": statistics.fmean(r["wall_ms"] for r in rows),
               "host_ms": {s: med([r["host_ms"][s] for r in rows if s in r["host_ms"]]) for s in STAGES},
               "k_histogram": {}}
        for r in rows:
            out["k_histogram"][str(r["k"])] = out["k_histogram"].get(str(r["k"]), 0) + 1
        out["slow_rounds"] = slow_rounds(rows, out["wall_ms"])
        if self.cuda:
            out["device_ms"] = {s: med([r["device_ms"][s] for r in rows if s in r["device_ms"]]) for s in STAGES}
            out["device_span_ms"] = med([r["device_span_ms"] for r in rows if "device_span_ms" in r])
        if busy_ms_per_round is not None:
            out["gpu_busy_ms"] = busy_ms_per_round
            out["gpu_idle_share"] = max(0.0, 1.0 - busy_ms_per_round / out["mean_wall_ms"])
        return out


def slow_rounds(rows: list[dict], median_ms: float) -> dict:
    """What a mean round far above the median is made of: the rounds over twice the median
    wall time, their share of all wall time beyond the median, how many had a long draft-cache
    catch-up or a CUDA graph capture, and their K after the previous round's K."""
    slow = [(i, r) for i, r in enumerate(rows) if r["wall_ms"] > 2 * median_ms]
    total = sum(r["wall_ms"] for r in rows)
    excess = sum(r["wall_ms"] - median_ms for _, r in slow)
    after = {}
    for i, r in slow:
        key = f'{rows[i - 1]["k"] if i else None}->{r["k"]}'
        after[key] = after.get(key, 0) + 1
    return {"count": len(slow), "share_of_wall": excess / total if total else 0.0,
            "with_catchup": sum(r["catchup_ms"] > 0 for _, r in slow),
            "with_capture": sum(r["captures"] > 0 for _, r in slow),
            "catchup_ms_total": sum(r["catchup_ms"] for r in rows),
            "captures_total": sum(r["captures"] for r in rows), "k_transitions": after}


class NoTimeline:
    """The engine's timeline when nobody measures: every mark a no-op."""

    def start(self) -> None:
        pass

    def mark(self, stage: str) -> None:
        pass

    def end(self, num_steps: int, batch_size: int, catchup_s: float = 0.0, captures: int = 0) -> None:
        pass


NO_TIMELINE = NoTimeline()
