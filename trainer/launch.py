"""`online-spec train --ranks N`: start N trainer ranks from one command and stop them together.

The launcher is the command itself. With `--ranks N` (N > 1) and no rank of its own in its
environment, `online-spec train` runs itself N times as `python -m online_spec.cli train <the same
flags>`, each child with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT = a free loopback port) and NVLink multicast off (`NVLS_OFF`,
forced in every child whatever the caller's environment says). A process started by torchrun or
the deepspeed launcher (WORLD_SIZE > 1 in its environment) is a rank already, so

    torchrun --nproc-per-node 2 -m online_spec.cli train --ranks 2 ...

runs the same layout (`trainer/ranks.py`) under torchrun's own watch.

Watch: a rank that exits non-zero or dies from a signal (kill -9, the OOM killer) ends the run:
the others get SIGTERM, then SIGKILL after `stop_grace_s` (a rank blocked in a collective with a
dead peer cannot act on SIGTERM), and the launcher exits 1 naming the rank. Run again, the same
command resumes from the run directory (`trainer/ranks.py`, "State"). SIGTERM or SIGINT to the
launcher goes to every rank: they agree to stop at the next step, save and exit 0. Each rank dies
with the launcher (PR_SET_PDEATHSIG, Linux), so a kill -9 of the launcher leaves no rank behind.
`RUN_DIR/ranks/launch.json` names the ranks' pids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in NCCL, PyTorch and NVSHMEM: on shared multi-GPU hosts a program using
it can put the host's GPUs out of service; set in every rank the launcher starts."""

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def world_from_env() -> tuple[int, int]:
    """(rank, world size) this process was started as; (0, 1) outside a launcher."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags of `parser` that `args` holds, as a command line that parses back to them (flags
    left unset stay unset, so each rank derives the same defaults)."""
    out: list[str] = []
    for a in parser._actions:  # argparse keeps them here; there is no public accessor
        if not a.option_strings or a.dest == "help" or not hasattr(args, a.dest):
            continue
        v = getattr(args, a.dest)
        if isinstance(a, argparse.BooleanOptionalAction):
            out.append(a.option_strings[0] if v else a.option_strings[1])
        elif v is None:
            continue
        elif a.type is json.loads:
            out += [a.option_strings[0], json.dumps(v)]
        else:
            out += [a.option_strings[0], str(v)]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the ranks outlive a killed launcher
        pass


def rank_env(base: dict, rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in base.items() if k not in RANK_VARS}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NVLS_OFF)
    return env


class RankLauncher:
    """Starts the ranks, watches them, stops them all when one fails (see the module docstring)."""

    def __init__(self, argv: list[str], ranks: int, run_dir: Path, stop_grace_s: float = 10.0,
                 env: dict | None = None):
        self.argv, self.ranks, self.run_dir, self.stop_grace_s = argv, ranks, Path(run_dir), stop_grace_s
        self.env = dict(os.environ if env is None else env)
        self.procs: list[subprocess.Popen] = []
        self._stopping = False

    def start(self) -> "RankLauncher":
        port = _free_port()
        repo = str(Path(__file__).resolve().parents[1])
        base = dict(self.env, PYTHONPATH=os.pathsep.join(p for p in (repo, self.env.get("PYTHONPATH", "")) if p))
        cmd = [sys.executable, "-m", "online_spec.cli", "train", *self.argv]
        for r in range(self.ranks):
            self.procs.append(subprocess.Popen(cmd, env=rank_env(base, r, self.ranks, port),
                                               preexec_fn=_die_with_parent))
        (self.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "ranks" / "launch.json").write_text(json.dumps(
            {"pids": [p.pid for p in self.procs], "master_port": port, "launcher_pid": os.getpid(),
             "nvls_off": NVLS_OFF}))
        log.info("started %d ranks (pids %s), rendezvous 127.0.0.1:%d", self.ranks,
                 ",".join(str(p.pid) for p in self.procs), port)
        return self

    def forward_signals(self) -> None:
        """SIGTERM/SIGINT to the launcher: every rank stops at the next step (they agree), saves."""
        def handler(signum, frame):
            log.info("signal %d: asking every rank to stop", signum)
            self._stopping = True
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def wait(self, poll_s: float = 0.2) -> int:
        """Until every rank has exited: 0 if all exited 0; 1 (the others stopped) once one fails."""
        done_since = None
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                how = f"was killed by signal {-c}" if c < 0 else f"exited with status {c}"
                log.error("rank %d %s: stopping the other ranks; run the same command again to resume from %s",
                          r, how, self.run_dir)
                self.stop_all()
                return 1
            if all(c == 0 for c in codes):
                return 0
            # ranks agree to stop at the same step: one that has exited 0 while another still
            # runs after the grace period is stuck (a lost peer)
            if any(c == 0 for c in codes):
                done_since = done_since or time.monotonic()
                if time.monotonic() - done_since > self.stop_grace_s:
                    log.error("ranks %s still running %.0f s after another finished: stopping them",
                              [r for r, c in enumerate(codes) if c is None], self.stop_grace_s)
                    self.stop_all()
                    return 1
            time.sleep(poll_s)

    def stop_all(self) -> None:
        """SIGTERM to every live rank, SIGKILL to those still alive after the grace period."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + self.stop_grace_s
        for p in live:
            try:
                p.wait(max(0.0, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop within %.0f s: SIGKILL", p.pid, self.stop_grace_s)
                p.kill()
                p.wait()


def launch(argv: list[str], ranks: int, run_dir: Path, stop_grace_s: float) -> int:
    """Run `ranks` ranks of `online-spec train <argv>` until they finish; the exit status."""
    launcher = RankLauncher(argv, ranks, run_dir, stop_grace_s)
    launcher.forward_signals()
    launcher.start()
    return launcher.wait()
