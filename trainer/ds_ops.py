"""DeepSpeed's C++ communication op: built once per machine, never waited on in silence.

When DeepSpeed forms its process group it loads a C++ op (`deepspeed_shm_comm` with the CPU
accelerator) through torch's JIT extension loader: the first start on a machine compiles it
(about a minute on 2 cores), later starts load it from the cache (TORCH_EXTENSIONS_DIR). The
loader guards the build directory with a lock file that it holds open while it works; a process
killed there leaves the file behind, and every later `online-spec train` then waits on it
forever, printing nothing.

`prepare_ops()` runs before DeepSpeed forms its group and
  1. takes our own lock on the build directory (`flock`, which the kernel releases when its
     holder dies, so it cannot go stale), saying so when another trainer holds it;
  2. clears torch's lock file when no live process holds it open (the owner died mid-build;
     /proc/*/fd says who holds it), and says it did; with a live owner it waits, saying so;
  3. builds or loads the op, saying which and how long it took.
DeepSpeed's own load then comes from its cache of loaded ops.

    prepare_ops()          # in ensure_distributed, before deepspeed.init_distributed
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

OP_BUILDER = "ShareMemCommBuilder"
OUR_LOCK = "online-spec.lock"
SAY_EVERY_S = 10.0


def lock_holders(path: Path) -> list[int]:
    """Pids of live processes holding `path` open (Linux /proc; empty elsewhere)."""
    target = str(path)
    holders = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    holders.append(int(proc.name))
                    break
        except OSError:  # gone, or not ours to look at
            continue
    return holders


def clear_stale_lock(build_dir: Path, poll_s: float = 0.5) -> bool:
    """Remove torch's build lock in `build_dir` if its owner is gone; wait (saying so) while a
    live process holds it. Returns whether a stale lock was removed."""
    lock = build_dir / "lock"
    said = 0.0
    while lock.exists():
        holders = lock_holders(lock)
        if not holders:
            age = time.time() - lock.stat().st_mtime if lock.exists() else 0.0
            lock.unlink(missing_ok=True)
            log.warning("removed a stale build lock %s (%.0f s old; the process building there died)", lock, age)
            return True
        if time.monotonic() - said >= SAY_EVERY_S:
            said = time.monotonic()
            log.info("waiting for pid %s to finish building in %s", ",".join(map(str, holders)), build_dir)
        time.sleep(poll_s)
    return False


def _lock_exclusive(build_dir: Path):
    """Our flock on the build directory (a file object: keep it open while building)."""
    f = open(build_dir / OUR_LOCK, "a+")
    said = 0.0
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            return f
        except BlockingIOError:
            if time.monotonic() - said >= SAY_EVERY_S:
                said = time.monotonic()
                f.seek(0)
                log.info("waiting for another trainer (pid %s) building DeepSpeed ops in %s", f.read().strip() or "?",
                         build_dir)
            time.sleep(0.5)


def prepare_ops() -> None:
    """Build or load DeepSpeed's communication op for this accelerator (see the module docstring)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(OP_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    build_dir = Path(_get_build_directory(builder.NAME, verbose=False))
    with _lock_exclusive(build_dir):
        clear_stale_lock(build_dir)
        built = any(build_dir.glob(f"{builder.NAME}*.so"))
        log.info("%s DeepSpeed op %s (%s)", "loading" if built else "building", builder.NAME,
                 build_dir if built else f"first start on this machine, about a minute; cached in {build_dir}")
        t0 = time.monotonic()
        builder.load(verbose=False)
        log.info("DeepSpeed op %s ready in %.1f s", builder.NAME, time.monotonic() - t0)
