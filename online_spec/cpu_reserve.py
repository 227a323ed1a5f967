"""`CpuReserve`: one CPU core kept for the engine's thread; every other thread, and the children, elsewhere.

On a GPU the engine's host loop launches a kernel every few microseconds, so anything that runs on
its core (the capture sender, ZMQ's I/O thread, a reader or trainer process, another hardware
thread of the same core) delays the next launch and costs tokens/s directly. A reserve pins the
engine's thread to one CPU and keeps that CPU's core (its SMT siblings, from /sys topology) for
it alone: a sweeper thread moves every other thread of the process, and every thread of its
descendant processes, onto the rest of the CPUs the process may use, every `sweep_s` seconds (so
threads that are started later, by torch, ZMQ or our own parts, are moved within one sweep).
`close` gives every thread the process's original CPUs back.

In: the CPU for the engine (None: the highest-numbered one the process may use), at least one
more core. Out: `hold()`, called on the engine's thread each round (a thread-id compare after
the first), and `stats()` (the engine's CPU, the reserved and the rest, sweeps, threads moved).

`mode` 'shared' does the opposite, a diagnostic for benches only: every other thread and child is
moved onto the engine's core (what a neighbour on that core costs).

    reserve = CpuReserve()          # on the engine's thread:
    reserve.hold()                  # each round; the first call pins and starts the sweeper
    reserve.close()
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

MODES = ("apart", "shared")


def core_siblings(cpu: int, root: str = "/sys/devices/system/cpu") -> frozenset[int]:
    """The CPUs of `cpu`'s core (itself and its SMT siblings); {cpu} where the topology is not exposed."""
    try:
        text = Path(root, f"cpu{cpu}", "topology", "thread_siblings_list").read_text().strip()
    except OSError:
        return frozenset({cpu})
    return parse_cpu_list(text) | {cpu}


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's list format)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cpu list: bad entry {part!r} in {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def descendants(pid: int) -> list[int]:
    """Pids of every process below `pid` (through /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                kids = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append(int(k))
                todo.append(int(k))
    return out


def threads(pid: int | None = None) -> list[int]:
    """Thread ids of process `pid` (this one by default) and of every process below it."""
    me, out = os.getpid() if pid is None else pid, []
    for pid in [me] + descendants(me):
        try:
            out.extend(map(int, os.listdir(f"/proc/{pid}/task")))
        except OSError:
            continue
    return out


class CpuReserve:
    """One CPU core kept for the calling engine thread (see the module docstring)."""

    def __init__(self, cpu: int | None = None, *, mode: str = "apart", sweep_s: float = 0.2,
                 topology_root: str = "/sys/devices/system/cpu"):
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
        if not sweep_s > 0:
            raise ValueError(f"sweep_s: must be > 0 seconds, got {sweep_s!r}")
        self.allowed = frozenset(os.sched_getaffinity(0))
        if cpu is None:
            cpu = max(self.allowed)
        if cpu not in self.allowed:
            raise ValueError(f"cpu: {cpu} is not one this process may use ({sorted(self.allowed)})")
        self.cpu, self.mode, self.sweep_s = cpu, mode, sweep_s
        self.reserved = core_siblings(cpu, topology_root) & self.allowed
        self.rest = self.allowed - self.reserved
        if not self.rest:
            raise ValueError(f"cpu: reserving core {sorted(self.reserved)} leaves no CPU for the rest "
                             f"(this process may use {sorted(self.allowed)})")
        # where the others go: apart = off the engine's core; shared = onto it
        self.others = self.rest if mode == "apart" else self.reserved
        self.tid: int | None = None  # the engine thread's native id, once held
        self.sweeps = self.moved = self.errors = 0
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._lock = threading.Lock()

    def hold(self) -> None:
        """On the engine's thread: pin it to the reserved CPU and start sweeping (once per thread)."""
        tid = threading.get_native_id()
        if tid == self.tid:
            return
        with self._lock:
            if self._stop.is_set():
                return
            if self.tid is not None:  # another thread now runs the engine: the old one goes with the rest
                self._set(self.tid, self.others)
            self.tid = tid
            os.sched_setaffinity(0, {self.cpu})
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._run, name="cpu-reserve", daemon=True)
                self._sweeper.start()
        self.sweep()

    def sweep(self) -> int:
        """Move every thread but the engine's, and the descendants' threads, to `others`; -> threads moved."""
        moved = 0
        for t in threads():
            if t != self.tid:
                moved += self._set(t, self.others)
        self.sweeps += 1
        self.moved += moved
        return moved

    def _set(self, tid: int, cpus: frozenset[int]) -> int:
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
                return 1
        except (ProcessLookupError, PermissionError, OSError):
            self.errors += 1  # a thread that ended between the listing and the call, mostly
        return 0

    def _run(self) -> None:
        os.sched_setaffinity(0, self.others)
        while not self._stop.wait(self.sweep_s):
            try:
                self.sweep()
            except Exception:  # counted; the next sweep tries again
                self.errors += 1

    def close(self) -> None:
        """Stop sweeping and give every thread of the process (and the children's) its original CPUs."""
        with self._lock:
            self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(5)
        for t in threads():
            self._set(t, self.allowed)

    def stats(self) -> dict:
        return {"mode": self.mode, "engine_cpu": self.cpu, "reserved": sorted(self.reserved),
                "others": sorted(self.others), "sweeps": self.sweeps, "moved": self.moved, "errors": self.errors}
