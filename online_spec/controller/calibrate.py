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
a one-off cost of a new request.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Sequence

import torch

from online_spec.config import check
from online_spec.controller.cost import CostModel, CostModelConfig
from online_spec.controller.static import StaticSteps


CTX_BUCKET = 128  # rounds whose context lengths fall in one bucket share a median


class RoundTiming(NamedTuple):
    """One measured round, in the order `CostModel.fit` reads."""

    batch_size: int
    num_steps: int
    ctx_len: float
    draft_s: float
    verify_s: float


def measure_round_timings(target, head, batch_sizes: Sequence[int], ks: Sequence[int], ctx_lens: Sequence[int],
                          rounds: int = 4, seed: int = 0) -> list[RoundTiming]:
    """`rounds` measured rounds per (batch size, K, context length) on the real engine."""
    from serving.engine import Engine, EngineConfig, Request  # serving depends on the controller, not back
    from online_spec.sampling import SamplingParams

    check(rounds >= 1, "rounds", f"must be >= 1, got {rounds}")
    check(len(ks) >= 1 and all(k >= 0 for k in ks), "ks", f"must be non-empty K values >= 0, got {list(ks)}")
    gen = torch.Generator().manual_seed(seed)
    vocab = target.info.vocab_size
    cycles = rounds + 1
    engines = []
    for ctx in ctx_lens:
        for b in batch_sizes:
            max_len = ctx + cycles * sum(k + 1 for k in ks) + max(ks) + 32
            engine = Engine(target, head, EngineConfig(max_batch=b, max_len=max_len, max_steps=max(ks), num_steps=0))
            params = SamplingParams(max_tokens=max_len, ignore_eos=True)
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
                if cycle > 0 and s.batch_size == b:
                    out.append(RoundTiming(s.batch_size, s.num_steps, s.ctx_len, s.draft_s, s.verify_s))
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
    points = []
    for bucket in sorted({int(t.ctx_len // CTX_BUCKET) for t in timings}):
        points += median_per_point([t for t in timings if int(t.ctx_len // CTX_BUCKET) == bucket])
    return CostModel(config).fit(points)


def prediction_errors(model: CostModel, timings: Sequence[RoundTiming]) -> list[float]:
    """|predicted - measured| / measured of each round's draft + verify seconds."""
    errs = []
    for t in timings:
        measured = t.draft_s + t.verify_s
        if measured > 0:
            errs.append(abs(model.predict_round_s(t.batch_size, t.num_steps, t.ctx_len) - measured) / measured)
    return errs


def median_relative_error(model: CostModel, timings: Sequence[RoundTiming]) -> float:
    errs = prediction_errors(model, timings)
    return statistics.median(errs) if errs else float("nan")


def cost_model_report(model: CostModel) -> dict:
    """The coefficients, named, as stored with a run."""
    return {"draft_step_s": dict(zip(("const", "per_request", "per_request_per_kctx"), model.draft_coef)),
            "verify_s": dict(zip(("const", "per_request", "per_token", "per_request_per_kctx"), model.verify_coef)),
            "draft_coef": list(model.draft_coef), "verify_coef": list(model.verify_coef),
            "observations": model.observations}
