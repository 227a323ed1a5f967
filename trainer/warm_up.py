"""The daemon's warm-up: its first step's and first evaluation's one-off costs, paid before it
reports ready.

A daemon's first optimizer step costs ~2x a later one on a CPU (CPU-EPYC, 400 rows: 2.1 s, then
0.7-1.1 s); on a GPU the first step also loads kernels, sets up cuBLAS and grows the caching
allocator (not timed alone yet). Paid while traffic flows, they fall on the server sharing the
core or the GPU: on the H200 the e2e bench's `training` factor lost most of its gap in the first
10 s of serving, where the daemon's first steps fall (0.89 / 0.92 of the server without training
there, 0.95 / 1.01 after), and a daemon 10 s past its start cost the server nothing at
`--max-duty 0.25` (`scripts/colocate_probe.py --device cuda`, 2026-12-03). So the CLIs
(`online-spec train`, the demo's trainer) call `warm_up` before they say ready: the target's
features over fixed token ids (no traffic needed: a fresh run's buffer is empty), one throwaway step
(`Distiller.warm_up`: a copy of the head, nothing of the run changes) and the gate's scoring of
the live head on two of them. On CPU-EPYC (1 thread, 400-row batches of a run's buffer, the same
batches both ways) the first real step then took 1.4 / 1.0 s instead of 2.4 / 1.9.

    figures = warm_up(daemon)   # -> {"rows": ..., "features_s": ..., "step_s": ..., "score_s": ...}
"""

from __future__ import annotations

import logging
import time

from trainer.batch import collate
from trainer.data import capture_tokens
from trainer.evaluate import record_counts

log = logging.getLogger(__name__)

ROWS_A_SEQUENCE = 96


def warm_up(daemon) -> dict:
    """The target's features over fixed token ids (sequences of `ROWS_A_SEQUENCE` rows, about the
    daemon's `batch_tokens` rows in all, at most 8), a throwaway step on them and the gate's
    scoring of the live head on two of them -> rows and seconds of each part. A warm-up that fails
    is logged and skipped ({"error": ...}): the daemon starts cold, as it did without one."""
    try:
        return _warm_up(daemon)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation, never a reason not to start
        log.warning("warm-up failed (%s: %s); starting cold", type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}


def _warm_up(daemon) -> dict:
    target, cfg = daemon.target, daemon.cfg
    ids = [(7919 * i + 11) % target.info.vocab_size for i in range(ROWS_A_SEQUENCE + 1)]  # any fixed ids do
    n = max(1, min(8, cfg.batch_tokens // ROWS_A_SEQUENCE))
    t0 = time.perf_counter()
    records = capture_tokens(target, [ids] * n, [f"warm-up-{i}" for i in range(n)], tag="warm-up")
    step_s = daemon.distiller.warm_up(collate(records))
    t1 = time.perf_counter()
    record_counts(daemon.live_head, target, records[:2], cfg.eval_max_steps)  # the gate's copy (eval_copy)
    return {"rows": n * ROWS_A_SEQUENCE, "features_s": round(t1 - t0 - step_s, 3), "step_s": round(step_s, 3),
            "score_s": round(time.perf_counter() - t1, 3)}
