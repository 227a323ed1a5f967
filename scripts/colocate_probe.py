"""What the trainer costs the server it shares the machine with, per sharing setting.

The e2e bench's `overhead_split.training` factor mixes two things: the trainer's CPU and memory
traffic beside the server, and whatever its swapped heads gained or lost. This probe measures
the first alone: the same static head serves the same requests (capture off, no swaps) while a
real trainer daemon (`python -m bench.demo_trainer`, the demo's flags) trains back to back
on a copy of a finished run's trainer directory (its replay buffer and optimizer state reload
from disk; it gets no new traffic and publishes nothing), under each setting in turn:

    off        no trainer: the server alone
    on         the trainer with the demo's flags only
    FLAGS      the trainer with these flags added, e.g. "--nice 19" or "--max-duty 0.5"

With `--device cuda` the server runs on the GPU (CUDA graphs) and the trainer trains there too
(`--device cuda` among its flags; a setting's own `--device cpu` moves it to the host's cores):
the trainer's kernels time-slice with the server's, which `--max-duty` bounds.

The traffic starts `--settle-s` seconds after the trainer reports ready (default 10: past its
first steps; 0: its first steps, the ones whose one-off costs trainer/warm_up.py pays before
ready, fall in the window).

Settings run interleaved, `--repeats` times; reported: the server's tokens/s per setting (median
over repeats, and each repeat), its ratio to `off` within each repeat (median), and the trainer's
optimizer steps per second (how fast it still learns).

    PYTHONPATH=$PWD python scripts/colocate_probe.py --trainer-dir RUN/online_spec/trainer \
        --trace RUN/trace.jsonl --requests 64 --repeats 3 --settings "off;on;--nice 19;--max-duty 0.5" \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_trainer(src: Path, work: Path, flags: list[str], head: str,
                  device: str = "cpu", settle_s: float = 10.0) -> tuple[subprocess.Popen, int, float]:
    """A daemon resuming from a copy of `src`, started and past its first steps; returns (process,
    its optimizer step when it started, time.monotonic() when it was ready)."""
    from bench.demo import DEMO_TRAINER_ARGS
    from bench.demo_trainer import READY_FILE

    run_dir = work / "trainer"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns(READY_FILE, "wandb"))
    step0 = json.loads((run_dir / "state.json").read_text())["step"]
    args = [sys.executable, "-m", "bench.demo_trainer", "--run-dir", str(run_dir),
            "--capture-endpoint", f"ipc://{work}/unused.sock", "--threads", "1", "--wandb-mode", "disabled",
            "--init-head", head, "--device", device, *DEMO_TRAINER_ARGS, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    logf = open(work / "trainer.log", "ab")
    proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    t0 = time.monotonic()
    while not (run_dir / READY_FILE).exists():
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            tail = (work / "trainer.log").read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError("trainer did not start; its log ends:\n" + "\n".join(tail))
        time.sleep(0.5)
    ready = time.monotonic()
    time.sleep(settle_s)  # 10 s: past its first steps (a step is ~2 s on a 2-core CPU); 0: they are measured
    return proc, step0, ready


def stop_trainer(proc: subprocess.Popen, run_dir: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return json.loads((run_dir / "state.json").read_text())["step"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer-dir", required=True, help="a finished run's trainer directory (state, replay)")
    ap.add_argument("--trace", required=True, help="trace JSONL; its first --requests lines are served")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--skip", type=int, default=0, help="start at this line of the trace")
    ap.add_argument("--head", default="shipped")
    ap.add_argument("--num-steps", type=int, default=2, help="static K of the server")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="off;on;--nice 19;--max-duty 0.5",
                    help="';'-separated trainer flag sets; 'off' = no trainer, 'on' = no flags added")
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="seconds between the trainer's ready and the traffic (0: its first steps fall in the window)")
    ap.add_argument("--device", default="cpu", help="the server's and (unless a setting says) the trainer's device")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    import torch

    from bench.common import machine_info
    from bench.heads import resolve_head
    from bench.report import session_figures
    from bench.session import SessionConfig, run_session
    from online_spec.target import load_target
    from bench.trace import load_trace

    target = load_target(device=args.device)
    head = resolve_head(args.head, target, 0)
    items = load_trace(args.trace)[args.skip:args.skip + args.requests]
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    work = Path(tempfile.mkdtemp(prefix="colocate-"))
    rows: dict[str, list[dict]] = {s: [] for s in settings}
    try:
        for rep in range(args.repeats):
            for s in settings:
                proc = None
                if s != "off":
                    proc, step0, ready = start_trainer(Path(args.trainer_dir), work, [] if s == "on" else s.split(),
                                                       str(Path(head).resolve()), args.device, args.settle_s)
                t0 = time.monotonic()
                try:
                    figs = session_figures(run_session(target, SessionConfig(
                        name=s, run_dir=str(work / "session"), head=head, num_steps=args.num_steps, device=args.device,
                        concurrency=args.concurrency, max_tokens=args.max_tokens, progress_every_s=0), items))
                finally:
                    wall = time.monotonic() - t0
                    steps, trained_s = 0, 0.0
                    if proc is not None:
                        steps, trained_s = stop_trainer(proc, work / "trainer") - step0, time.monotonic() - ready
                row = {"tokens_per_s": figs["overall"]["tokens_per_s"], "wall_s": wall,
                       "trainer_steps": steps, "trainer_steps_per_s": steps / trained_s if trained_s else 0.0}
                rows[s].append(row)
                print(f"rep {rep} {s!r}: {row['tokens_per_s']:.1f} tok/s, trainer {steps} steps "
                      f"({row['trainer_steps_per_s']:.3f}/s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = rows.get("off")
    out = {"probe": "colocate", "machine": machine_info(), "torch": torch.__version__, "args": vars(args),
           "settings": {}}
    for s, rs in rows.items():
        entry = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                 "trainer_steps_per_s_median": statistics.median(r["trainer_steps_per_s"] for r in rs),
                 "repeats": rs}
        if base and s != "off":
            entry["vs_off_median"] = statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                                       for r, b in zip(rs, base))
        out["settings"][s] = entry
    Path(args.json).write_text(json.dumps(out, indent=1))
    for s, e in out["settings"].items():
        print(f"{s!r}: {e['tokens_per_s_median']:.1f} tok/s, vs off {e.get('vs_off_median', 1.0):.3f}, "
              f"trainer {e['trainer_steps_per_s_median']:.3f} steps/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
