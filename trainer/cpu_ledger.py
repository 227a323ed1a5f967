"""What the trainer's own work costs the machine it shares with the server, in CPU seconds.

A colocated trainer takes CPU time the server, its clients and its capture could use, whatever
its niceness, and the kernels of the two share the memory bus and the last-level cache. So the
daemon counts the CPU time of its work by kind: optimizer steps, gate evaluations, seed checks,
and the rest of the process (the subscriber's decoding, the watchers): what an operator weighs
against the gain, and where to look when the trainer is to cost less.

Counted with `time.thread_time` around each piece of work on the daemon's thread (torch's
intra-op threads, when there are more than one, show in the process total, under `other_s`), and
`time.process_time` for the whole process; a process stopped with SIGSTOP spends none.

    ledger = CpuLedger()
    with ledger.spend("steps"):
        distiller.train_step(batch)
    ledger.report()   # {"process_s": ..., "steps_s": ..., "evals_s": ..., "seeds_s": ..., "other_s": ...,
                      #  "wall_s": ..., "share": process_s / wall_s}
"""

from __future__ import annotations

import time
from contextlib import contextmanager

KINDS = ("steps", "evals", "seeds")


class CpuLedger:
    def __init__(self):
        self._process0, self._wall0 = time.process_time(), time.monotonic()
        self.spent = dict.fromkeys(KINDS, 0.0)

    @contextmanager
    def spend(self, kind: str):
        """Count the calling thread's CPU time inside the block as `kind` (one of KINDS)."""
        if kind not in self.spent:
            raise ValueError(f"unknown kind of trainer work {kind!r}; one of {', '.join(KINDS)}")
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.spent[kind] += time.thread_time() - t0

    def report(self) -> dict:
        """CPU seconds since the ledger began: the process's, each kind's, the rest; and the
        process's CPU seconds over wall seconds (`share`: 1.0 = one core all the time)."""
        process, wall = time.process_time() - self._process0, time.monotonic() - self._wall0
        out = {"process_s": round(process, 3), **{f"{k}_s": round(v, 3) for k, v in self.spent.items()}}
        out["other_s"] = round(max(0.0, process - sum(self.spent.values())), 3)
        out["wall_s"] = round(wall, 3)
        out["share"] = round(process / wall, 4) if wall > 0 else 0.0
        return out
