"""Calibrate the `CostModel` from the engine's own round timings (a short run at start-up).

In: a target, a head, and a grid of batch sizes, K values and context lengths. Out: a
`CostModel` fitted by least squares to the draft and verify seconds the engine measured
(`RoundStats.draft_s`, `RoundStats.verify_s`), plus the observations it was fitted on. The
server calls this once at start; afterwards the cost policy refines the same model online from
every round's `policy.update(..., draft_s=, verify_s=)`.

    model = calibrate_cost_model(target, head, batch_sizes=[1, 4, 16], ks=[0, 1, 3, 7], ctx_lens=[256])
    policy = CostModelPolicy(adaptive, cost_model=model)

Per (batch size, context length) one engine is filled with `batch_size` requests of
`ctx_len` random tokens (round time does not depend on the text). Then, cycle after cycle,
every engine runs one round at each K of `ks` in turn, so drift in machine load (a shared
CPU) hits every point of the grid alike instead of whichever point was measured during a busy
spell. The first cycle is discarded: it holds the draft cache's catch-up over the whole prompt,
a one-off cost of a new request. Later rounds count as the engine feeds its policy (steady
timings: a round with a CUDA graph capture inside is left out, a long catch-up subtracted).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from online_spec.config import ConfigError, check
from online_spec.controller.config import AdaptiveConfig
from online_spec.controller.cost import CostModelPolicy
from online_spec.controller.round_time import CostModel, CostModelConfig
from online_spec.controller.static import StaticSteps
from online_spec.machine import machine_info
from online_spec.sampling import SamplingParams
from serving.engine import Engine, EngineConfig
from serving.requests import Request


CTX_BUCKET = 128  # rounds whose context lengths fall in one bucket share a median
STORE_VERSION = 3  # 3: the [K > 0] terms (2: points stored, 1: coefficients only); older stores are re-measured

log = logging.getLogger(__name__)


class RoundTiming(NamedTuple):
    """One measured round, in the order `CostModel.fit` reads."""

    batch_size: int
    num_steps: int
    ctx_len: float
    draft_s: float
    verify_s: float

    @classmethod
    def of_round(cls, stats) -> "RoundTiming | None":
        """A round's steady timing (`RoundStats.steady_draft_s` / `steady_verify_s`: no long
        catch-up, no graph capture), or None when a capture is inside it."""
        d, v = stats.steady_draft_s, stats.steady_verify_s
        return None if d is None or v is None else cls(stats.batch_size, stats.num_steps, stats.ctx_len, d, v)


def measure_round_timings(target, head, batch_sizes: Sequence[int], ks: Sequence[int], ctx_lens: Sequence[int],
                          rounds: int = 4, seed: int = 0, max_len: int = 0) -> list[RoundTiming]:
    """`rounds` measured rounds per (batch size, K, context length) on the real engine.

    max_len: the serving engine's. On a GPU it sizes the engines measured here: a CUDA graph
    attends over the whole cache (serving/cuda_graphs.py), so a round's time grows with max_len,
    and engines sized to the calibration's few hundred tokens measured H100 rounds 20-25 %
    below those of a 1,024-token server (scripts/gpu_round_costs.py). On a CPU the
    eager attention reads the keys in use only, and a cache of max_len would only cost memory."""
    check(rounds >= 1, "rounds", f"must be >= 1, got {rounds}")
    check(len(ks) >= 1 and all(k >= 0 for k in ks), "ks", f"must be non-empty K values >= 0, got {list(ks)}")
    gen = torch.Generator().manual_seed(seed)
    vocab = target.info.vocab_size
    cycles = rounds + 1
    engines = []
    for ctx in ctx_lens:
        for b in batch_sizes:
            need = ctx + cycles * sum(k + 1 for k in ks) + max(ks) + 32
            engine_len = max(need, max_len) if target.device.type == "cuda" else need
            engine = Engine(target, head, EngineConfig(max_batch=b, max_len=engine_len, max_steps=max(ks), num_steps=0))
            params = SamplingParams(max_tokens=need, ignore_eos=True)
            for _ in range(b):
                ids = torch.randint(1, vocab - 1, (ctx,), generator=gen).tolist()
                engine.add_request(Request(ids, params))
            engines.append((b, engine))
    out: list[RoundTiming] = []
    for cycle in range(cycles):
        for b, engine in engines:
            for k in ks:
                engine.policy = StaticSteps(k)
                engine.step()
                s = engine.last_round
                timing = RoundTiming.of_round(s)
                if cycle > 0 and s.batch_size == b and timing is not None:
                    out.append(timing)
    return out


def median_per_point(timings: Sequence[RoundTiming]) -> list[RoundTiming]:
    """One timing per (batch size, K): the median of its rounds' draft and verify seconds, at
    the median context length of all `timings` (one shared value, so the few tokens a point's
    rounds add are not mistaken for a context effect). A round preempted by another process
    is an outlier; the median drops it."""
    groups: dict[tuple[int, int], list[RoundTiming]] = {}
    for t in timings:
        groups.setdefault((t.batch_size, t.num_steps), []).append(t)
    ctx = statistics.median(t.ctx_len for t in timings) if timings else 0.0
    return [RoundTiming(b, k, ctx, statistics.median(t.draft_s for t in g), statistics.median(t.verify_s for t in g))
            for (b, k), g in groups.items()]


def calibrate_cost_model(target, head, batch_sizes: Sequence[int] = (1, 4, 16), ks: Sequence[int] = (0, 1, 3, 7),
                         ctx_lens: Sequence[int] = (256,), rounds: int = 4, config: CostModelConfig | None = None,
                         timings: list[RoundTiming] | None = None) -> CostModel:
    """A `CostModel` least-squares fitted to the engine's measured rounds (measured here unless
    `timings` are given), one median per (batch size, K, context length) point."""
    if timings is None:
        timings = measure_round_timings(target, head, batch_sizes, ks, ctx_lens, rounds)
    return CostModel(config).fit(calibration_points(timings))


def calibration_points(timings: Sequence[RoundTiming]) -> list[RoundTiming]:
    """The rows a model is fitted to: `median_per_point` within each context-length bucket."""
    points = []
    for bucket in sorted({int(t.ctx_len // CTX_BUCKET) for t in timings}):
        points += median_per_point([t for t in timings if int(t.ctx_len // CTX_BUCKET) == bucket])
    return points


def prediction_errors(model: CostModel, timings: Sequence[RoundTiming], factors: bool = True) -> list[float]:
    """|predicted - measured| / measured of each round's draft + verify seconds (predicted with
    the model's time factors, or by its line alone)."""
    errs = []
    for t in timings:
        measured = t.draft_s + t.verify_s
        if measured > 0:
            predicted = model.predict_round_s(t.batch_size, t.num_steps, t.ctx_len, factors=factors)
            errs.append(abs(predicted - measured) / measured)
    return errs


def median_relative_error(model: CostModel, timings: Sequence[RoundTiming], factors: bool = True) -> float:
    """The median of `prediction_errors`; factors=False: the least-squares line's alone."""
    errs = prediction_errors(model, timings, factors)
    return statistics.median(errs) if errs else float("nan")


def cost_model_report(model: CostModel) -> dict:
    """The coefficients, named, as stored with a run."""
    return {"draft_s": dict(zip(("per_step", "per_step_per_request", "per_step_per_request_per_kctx",
                                 "first_draft_extra", "first_draft_extra_per_request"), model.draft_coef)),
            "verify_s": dict(zip(("const", "per_request", "per_token", "per_request_per_kctx",
                                  "drafts_extra_per_request"), model.verify_coef)),
            "draft_coef": list(model.draft_coef), "verify_coef": list(model.verify_coef),
            "time_factors": model.factors_info(),
            "observations": model.observations, "calibration_points": model.calibration_points}


def calibration_key(target, max_len: int = 0) -> dict:
    """What a stored calibration is valid for: the model, dtype, device, CPU and thread count,
    and on a GPU the engine's max_len (its graphs attend over the whole cache)."""
    info = machine_info()
    key = {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
           "cpu": info.get("gpu") or info["cpu"], "threads": torch.get_num_threads()}
    if target.device.type == "cuda":
        key["max_len"] = max_len
    return key


def engine_cost_model(target, head, max_batch: int, max_steps: int, store: str | Path | None = None,
                      rounds: int = 2, ctx_len: int = 256, max_len: int = 0) -> tuple[CostModel, dict]:
    """The cost model of this engine, stored with the run: loaded from `store` when it holds a
    calibration of the same target, dtype, device, CPU and thread count; else measured now
    (batch sizes 1/4/16/64 below max_batch and max_batch itself, K 0/1/3/7 up to max_steps; a few seconds to a
    minute on a CPU) and written to `store` atomically. A store that is unreadable, of another
    machine or malformed is measured over, with the reason logged. Returns (model, report):
    the report says where the model came from (`source`: "store" or "calibrated")."""
    key = calibration_key(target, max_len)
    path = Path(store) if store else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            if saved.get("version") != STORE_VERSION or saved.get("key") != key:
                raise ValueError(f"calibrated for {saved.get('key')}, this engine is {key}")
            # refit from the stored points, so the calibration stays the model's anchor (coefficients
            # alone would be replaced by the first online refit, on whatever K the first rounds ran)
            points = [RoundTiming(int(b), int(k), float(c), float(d), float(v)) for b, k, c, d, v in saved["points"]]
            if not points or not all(math.isfinite(x) for p in points for x in p):
                raise ValueError("no calibration points, or non-finite ones")
            model = CostModel().fit(points)
            stored = [float(c) for c in saved["draft_coef"]] + [float(c) for c in saved["verify_coef"]]
            fitted = model.draft_coef + model.verify_coef
            if len(stored) != len(fitted) or not all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
                                                     for a, b in zip(stored, fitted)):
                raise ValueError("the stored coefficients are not the fit of the stored points")
            return model, {**cost_model_report(model), "source": "store", "path": str(path)}
        except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
            log.warning("cost model store %s not used (%s): calibrating", path, e)
    batch_sizes = [b for b in (1, 4, 16, 64) if b < max_batch] + [max_batch]  # the largest batch measured, not extrapolated
    ks = [k for k in (0, 1, 3, 7) if k <= max_steps]
    t0 = time.perf_counter()
    timings = measure_round_timings(target, head, batch_sizes, ks, [ctx_len], rounds, max_len=max_len)
    points = calibration_points(timings)
    model = CostModel().fit(points)
    report = {**cost_model_report(model), "source": "calibrated", "seconds": time.perf_counter() - t0,
              "median_rel_error": median_relative_error(model, points, factors=False),
              "batch_sizes": batch_sizes, "ks": ks}
    log.info("cost model calibrated in %.1f s (batch sizes %s, K %s): median error %.1f%%", report["seconds"],
             batch_sizes, ks, 100 * report["median_rel_error"])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": STORE_VERSION, "key": key, "draft_coef": model.draft_coef,
                                   "verify_coef": model.verify_coef, "points": [list(p) for p in points],
                                   "report": report}, indent=1))
        os.replace(tmp, path)
        report["path"] = str(path)
    return model, report


def engine_cost_policy(target, head, max_batch: int, max_steps: int, store: str | Path | None = None,
                       adaptive=None, max_len: int = 0, trees: list[list[int]] | None = None
                       ) -> tuple[CostModelPolicy, dict]:
    """The cost-model policy an engine serves with: its round-time model from
    `engine_cost_model` (stored with the run), its tiers those of `adaptive` or, by default,
    every K from 0 to max_steps in one slot (the policy weighs every K by its predicted tokens
    per second; SGLang's tiers exist for its EMA rule), with `trees` ([num_steps, topk,
    num_draft_tokens] each) as that slot's tree candidates. Returns (policy, the model's report)."""
    if adaptive is None:
        adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": list(range(max_steps + 1)),
                                                   "tree_candidates": [list(t) for t in trees or []]}})
    model, report = engine_cost_model(target, head, max_batch, max_steps, store=store, max_len=max_len)
    return CostModelPolicy(adaptive, cost_model=model), report
