"""What the trainer child is doing, read from its own log: start-up, steps, gate verdicts, swaps.

The demo's trainer (bench/demo_trainer.py) logs each start-up stage (target, DeepSpeed op and
process group, subscription), a status line every few seconds (`status: step N, ...`), each gate
verdict (`step N gate: candidate 0.730 < 0.744 needed over live 0.721`), each publication and
rollback. `TrainerWatch` tails that log from a thread of the serving process (file reads twice a
second: nothing the engine thread waits on), keeps the latest step and verdict for the progress
line, echoes start-up and verdict lines to the console, and keeps every event for the report.

    watch = TrainerWatch(run_dir / "trainer.log").start()
    ...; watch.step, watch.last_gate, watch.events
    watch.stop()
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

POLL_S = 0.5
_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ trainer (?:(DEBUG|INFO|WARNING|ERROR|CRITICAL) )?")
_STEP = re.compile(r"^status: step (\d+)")
_GATE = re.compile(r"^step (\d+) gate: (.*)$")
_NOISE = ("Loading weights:", "it/s]")  # progress bars of model loading


def classify(line: str) -> tuple[str, str] | None:
    """(kind, text) of one trainer log line; None for noise. Kinds: status, gate, published,
    rollback, drift, warning, info."""
    m = _PREFIX.match(line.strip())
    level = m.group(1) if m else None
    text = line.strip()[m.end():] if m else line.strip()
    if not text or any(n in text for n in _NOISE):
        return None
    if _STEP.match(text):
        return "status", text
    if _GATE.match(text):
        return "gate", text
    for kind, start in (("published", "published v"), ("rollback", "rollback:"), ("drift", "drift alert:")):
        if text.startswith(start):
            return kind, text
    return ("warning" if level in ("WARNING", "ERROR", "CRITICAL") or text.startswith("Traceback") else "info"), text


class TrainerWatch:
    """Tails the trainer's log (see the module docstring); `echo` prints the lines worth reading
    live: everything before the first status line (start-up), then verdicts, swaps and warnings."""

    def __init__(self, path: str | Path, echo: bool = True, prefix: str = "  trainer: "):
        self.path = Path(path)
        self.echo, self.prefix = echo, prefix
        self.events: list[dict] = []  # {"t": epoch s, "kind", "text"}
        self.step: int | None = None
        self.last_gate = ""
        self.gates = self.published = 0
        self._pos = 0
        self._partial = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TrainerWatch":
        self._thread = threading.Thread(target=self._run, daemon=True, name="trainer-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.poll()  # whatever it wrote last (its stop line)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Read what the log gained since the last poll."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:  # not created yet
            return
        self._pos += len(data)
        lines = re.split(r"[\r\n]", self._partial + data.decode("utf-8", "replace"))
        self._partial = lines.pop()  # an unfinished last line waits for the next poll
        for line in lines:
            self.on_line(line)

    def on_line(self, line: str) -> None:
        found = classify(line)
        if found is None:
            return
        kind, text = found
        started = self.step is not None
        self.events.append({"t": time.time(), "kind": kind, "text": text})
        if kind == "status":
            self.step = int(_STEP.match(text).group(1))
        elif kind == "gate":
            self.gates += 1
            self.last_gate = _GATE.match(text).group(2)
        elif kind == "published":
            self.published += 1
        if self.echo and (not started and kind != "status" or kind in ("gate", "published", "rollback", "warning")):
            print(self.prefix + text, flush=True)

    def figures(self, t0: float) -> dict:
        """For the report: the gate verdicts and swaps with times from `t0`, and the counts."""
        keep = ("gate", "published", "rollback", "drift", "warning")
        return {"step": self.step, "gate_evaluations": self.gates, "published": self.published,
                "last_gate": self.last_gate,
                "events": [{"t_s": e["t"] - t0, "kind": e["kind"], "text": e["text"]} for e in self.events
                           if e["kind"] in keep]}
