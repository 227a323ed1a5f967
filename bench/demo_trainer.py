"""The demo's trainer process: `online-spec train` plus drift alerts polled from the server.

In: every `online-spec train` flag (the daemon, gate, distillation, replay, capture), and
`--alerts-url URL` (the server's `/server_info`). A background thread polls that URL every
`--alerts-every-s` seconds; each alert in `drift.recent_alerts` not seen before (counted by
`drift.alerts_total`) is handed to `daemon.on_drift`, which makes the daemon evaluate every
step for a while so it adapts sooner. Out: what the daemon writes in its run directory, and a
log that says what it is doing: each start-up stage, then `status: step N, ...` every
`--status-every-s` seconds, the gate's verdicts and the swaps (read by bench/trainer_watch.py).
SIGTERM: the daemon finishes its step, saves and exits.

    python -m bench.demo_trainer --alerts-url http://127.0.0.1:PORT/server_info \
        --run-dir runs/demo/trainer --capture-endpoint ipc:///tmp/x/capture.sock --control-run-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.request
from pathlib import Path

from trainer.daemon import install_signal_handlers
from trainer.train_cli import add_arguments as add_train_arguments
from trainer.train_cli import build_daemon, share_machine
from trainer.warm_up import warm_up

log = logging.getLogger("bench.demo_trainer")

READY_FILE = "ready"


def log_status(daemon, stop: threading.Event, every_s: float) -> None:
    """One line every `every_s` seconds: steps, buffered rows, evaluations, swaps, the CPU its work
    took (plain reads of counters the training thread updates; a line a step stale is fine)."""
    while not stop.wait(every_s):
        state = daemon.state
        gov = daemon.duty_cycle.governor.summary()
        slowdown = "-" if gov["slowdown"] is None else f"{gov['slowdown']:.3f}"
        budget = "" if gov["off"] else f", serving budget: duty cap {gov['duty_cap']:.3g} (slowdown {slowdown})"
        cpu = daemon.cpu.report()
        log.info("status: step %d, buffer %d rows, %d evaluations, %d swaps, live v%s%s; cpu %.2f of a core "
                 "(steps %.0f s, evals %.0f s, seeds %.0f s, other %.0f s)", daemon.distiller.step,
                 daemon.buffer.num_tokens, state.get("evals", 0), state.get("swaps", 0), state.get("live_version"),
                 budget, cpu["share"], cpu["steps_s"], cpu["evals_s"], cpu["seeds_s"], cpu["other_s"])


def poll_alerts(url: str, on_alert, stop: threading.Event, every_s: float) -> None:
    """Forward alerts the server raised since the last poll (its recent list keeps the last 10)."""
    seen = None
    while not stop.wait(every_s):
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                drift = json.loads(r.read()).get("drift") or {}
        except Exception as e:  # noqa: BLE001 - the server may be busy or gone; try again
            log.debug("alert poll failed: %s", e)
            continue
        total, recent = int(drift.get("alerts_total", 0)), list(drift.get("recent_alerts", []))
        if seen is None:
            seen = total - len(recent)  # alerts raised before we started watching count too
        for alert in recent[len(recent) - min(total - seen, len(recent)):] if total > seen else []:
            try:
                on_alert(alert)
            except Exception:  # noqa: BLE001
                log.exception("on_drift failed")
        seen = total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_arguments(parser)
    parser.add_argument("--alerts-url", default="", help="the server's /server_info URL (loopback)")
    parser.add_argument("--alerts-every-s", type=float, default=2.0, help="alert polling period")
    parser.add_argument("--status-every-s", type=float, default=5.0, help="status line period")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    share_machine(args)
    t0 = time.monotonic()
    log.info("starting: target model, replay buffer, then the distiller (DeepSpeed op and process group)")
    daemon = build_daemon(args)
    install_signal_handlers(daemon)
    daemon.starvation_watch.follow_stops()
    log.info("warmed up: %s", warm_up(daemon))  # the first step's one-off costs before traffic (trainer/warm_up.py)
    (Path(daemon.cfg.run_dir) / READY_FILE).write_text("ready")  # the session waits for this before traffic
    log.info("ready in %.0f s: subscribed to the capture stream; training starts at %d buffered rows",
             time.monotonic() - t0, daemon.cfg.min_buffer_tokens)
    stop = threading.Event()
    threading.Thread(target=log_status, args=(daemon, stop, args.status_every_s), daemon=True, name="status").start()
    if args.alerts_url:
        threading.Thread(target=poll_alerts, args=(args.alerts_url, daemon.on_drift, stop, args.alerts_every_s),
                         daemon=True, name="alerts").start()
    try:
        summary = daemon.run(max_steps=args.max_steps, max_seconds=args.max_seconds)
        log.info("stopped: %s", {k: summary[k] for k in ("step", "live_version", "swaps", "rollbacks")})
    finally:
        stop.set()
        if daemon.wandb is not None:
            daemon.wandb.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
