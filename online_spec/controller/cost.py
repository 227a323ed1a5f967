"""Cost-model step policy (AdaSpec-style): pick K to maximize committed tokens per second.

In: per verify round, the batch size, accepted drafts per request (bonus excluded), the K used,
the mean context length and, when the engine measured them, the round's draft and verify
seconds and the head's confidence in each draft. Out: K for the next round, an early-stop
verdict inside a round, and per-request verify lengths. Pure arithmetic: no torch, no I/O.

Three parts:
  - `CostModel`: least-squares fit of the draft phase, K * (1, b, b*ctx) + [K > 0] * (1, b),
    and of the verify, (1, b, b*n, b*ctx, b*[n > 1]) with n = K + 1 tokens verified per request
    and ctx in thousands of tokens. The [K > 0] terms are what entering speculation costs once
    a round whatever K: the first draft comes out of the draft cache's catch-up, a forward
    dearer than a later step, and a verify of n > 1 tokens is dearer than a plain decode step
    (on an H100 at batch 1: catch-up + first draft 0.72 ms, each later step 0.35 ms; verify
    3.2 ms at n = 1, 3.9-4.1 ms at n = 2-5). A model linear in K through 0 put K = 1 0.9 ms
    below its measured round and every further step at 0.47 ms against 0.37 measured, so it
    chose K and stopped drafting below the best static K. The calibration (`fit`) is an anchor
    that never decays, the rounds served refine it with exponential forgetting, and a prior
    holds where neither says anything. What the line cannot fit is corrected by a measured
    factor per (batch-size bucket, K) (`time_factors`): the rounds of that batch and K measured
    against the line's prediction for them.
  - `AcceptanceEstimate` (one per batch-size slot): a_i = P(draft i accepted | drafts < i
    accepted), hits over trials with exponential forgetting per trial (a window of
    `accept_window` request-drafts, so one request at batch 1 moves it as little as one of 16
    requests does), so the expected committed tokens of K drafts, E(K) = 1 + sum_{i<=K}
    prod_{j<=i} a_j, is known before drafting. Positions never tried borrow the deepest tried
    estimate to their left, which lets the policy look one tier deeper.
  - `ConfidenceCalibrator`: maps the head's draft confidence to an acceptance probability
    (binned, starting at the identity), used once a round's drafts exist.

    policy = CostModelPolicy(load_adaptive_config(path))
    k = policy.steps_for(b, ctx_len)                                   # before drafting
    while i < k and policy.should_continue(i, conf_i, b, ctx_len): ...  # optional early stop
    lens = policy.verify_lengths(confidences, ctx_len)                 # optional truncation
    policy.update(b, accepted, num_steps=lens or k, ctx_len=ctx_len, draft_s=.., verify_s=..)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from online_spec.config import ConfigError, check, doc
from online_spec.controller.config import AdaptiveConfig

CTX_SCALE = 1000.0  # context length enters the model in thousands of tokens (conditioning)
FACTOR_RANGE = (0.25, 4.0)  # a time factor outside it is a broken measurement, not a misfit of the line
PRIOR_TRIALS = 4.0  # the acceptance prior counts as this many trials: one lucky draft at a rarely
                    # tried position must not read as certainty (1/1 = 1.0 made K = 7 look free)


def draft_features(batch_size: float, ctx_len: float) -> tuple[float, float, float]:
    """Features of one draft step's time."""
    return (1.0, batch_size, batch_size * ctx_len / CTX_SCALE)


def draft_row(batch_size: float, num_steps: int, ctx_len: float) -> list[float]:
    """Features of a round's draft phase: K steps, plus the once-a-round extra of K > 0."""
    on = 1.0 if num_steps > 0 else 0.0
    return [num_steps * f for f in draft_features(batch_size, ctx_len)] + [on, on * batch_size]


def verify_features(batch_size: float, tokens_per_request: float, ctx_len: float) -> tuple[float, ...]:
    """Features of one verify forward's time (tokens_per_request = K + 1; more than one: the
    forward verifies drafts, its extra over a plain decode step is the last feature)."""
    return (1.0, batch_size, batch_size * tokens_per_request, batch_size * ctx_len / CTX_SCALE,
            batch_size if tokens_per_request > 1 else 0.0)


def batch_bucket(batch_size: float) -> int:
    """The time-factor bucket of a batch size: 1 | 2-3 | 4-7 | 8-15 | ... (bit length)."""
    return int(batch_size).bit_length() or 1


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """Solve m x = v by Gaussian elimination with partial pivoting (m is small and SPD)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        piv = a[c][c]
        for r in range(c + 1, n):
            f = a[r][c] / piv
            if f:
                for j in range(c, n + 1):
                    a[r][j] -= f * a[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][j] * x[j] for j in range(r + 1, n))) / a[r][r]
    return x


class _RidgeLeastSquares:
    """Exponentially weighted least squares, ridge-pulled toward `prior` (sufficient statistics),
    plus an anchor: observations that never decay (a calibration), so the directions that online
    data stop spanning (the K the policy no longer runs) keep what the calibration measured.

    Online observations wait as rows until the next `solve` folds them into the Gram matrix and
    moment in one numpy product (row i of n weighs decay^(n-1-i), the earlier sums decay^n: what
    decaying and adding them one at a time gives, up to rounding). Decaying the 5x5 sums entry by
    entry in Python on every observation cost ~3.5 us each, two a round: 2026-11-24, docs/controller.md.
    """

    def __init__(self, prior: Sequence[float], ridge: float, decay: float):
        self.prior, self.ridge, self.decay = list(prior), ridge, decay
        d = len(prior)
        self.gram = [[0.0] * d for _ in range(d)]  # online rows up to the last fold
        self.moment = [0.0] * d
        self.anchor_gram = [[0.0] * d for _ in range(d)]
        self.anchor_moment = [0.0] * d
        self.count = 0  # online observations
        self.anchors = 0  # anchor observations
        self._rows: list[tuple[float, ...]] = []  # (*x, y) of online observations not folded yet

    def add(self, x: Sequence[float], y: float) -> None:
        self._rows.append((*x, y))  # one append: a reader on another thread sees whole rows
        self.count += 1

    def add_anchor(self, x: Sequence[float], y: float, weight: float) -> None:
        """anchor_gram += weight * x x^T, anchor_moment += weight * x y (never decayed)."""
        for i, xi in enumerate(x):
            row = self.anchor_gram[i]
            for j, xj in enumerate(x):
                row[j] += weight * xi * xj
            self.anchor_moment[i] += weight * xi * y
        self.anchors += 1

    def _fold(self) -> None:
        """Decay the pending rows (the oldest first) into gram and moment, after the current sums."""
        rows, self._rows = self._rows, []
        if not rows:
            return
        d, n = len(self.prior), len(rows)
        xy = np.array(rows, dtype=np.float64)  # [n, d + 1]
        xw = xy[:, :d].T * self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64)  # [d, n]
        sums = xw @ xy  # [d, d + 1]: the rows' weighted x x^T beside their weighted x y
        keep = self.decay ** n
        self.gram = (keep * np.array(self.gram) + sums[:, :d]).tolist()
        self.moment = (keep * np.array(self.moment) + sums[:, d]).tolist()

    def solve(self) -> list[float]:
        self._fold()
        d = len(self.prior)
        m = [[self.gram[i][j] + self.anchor_gram[i][j] + (self.ridge if i == j else 0.0) for j in range(d)]
             for i in range(d)]
        v = [self.moment[i] + self.anchor_moment[i] + self.ridge * self.prior[i] for i in range(d)]
        # Jacobi scaling: features span ~1 to ~1e4, so solve the unit-diagonal system.
        s = [1.0 / math.sqrt(m[i][i]) for i in range(d)]
        z = _solve([[m[i][j] * s[i] * s[j] for j in range(d)] for i in range(d)], [v[i] * s[i] for i in range(d)])
        return [z[i] * s[i] for i in range(d)]

    def state_dict(self) -> dict:
        # the pending rows as they are: folding them here would group the next fold's sums
        # differently from a run that never stopped, and a resumed run would differ by rounding
        return {"gram": [r[:] for r in self.gram], "moment": self.moment[:], "count": self.count,
                "rows": [list(r) for r in self._rows[:]],
                "anchor_gram": [r[:] for r in self.anchor_gram], "anchor_moment": self.anchor_moment[:],
                "anchors": self.anchors}

    def load_state_dict(self, state: dict) -> None:
        d = len(self.prior)
        self.gram = [[float(x) for x in r] for r in state["gram"]]
        self.moment = [float(x) for x in state["moment"]]
        self.count = int(state["count"])
        self._rows = [tuple(float(x) for x in r) for r in state.get("rows", [])]  # states before 2026-11-24: folded
        # states stored before the anchor existed have none
        self.anchor_gram = [[float(x) for x in r] for r in state.get("anchor_gram", [[0.0] * d] * d)]
        self.anchor_moment = [float(x) for x in state.get("anchor_moment", [0.0] * d)]
        self.anchors = int(state.get("anchors", 0))


@dataclass(frozen=True)
class CostModelConfig:
    """How the round-time model starts and how fast it forgets."""

    prior_draft_step_s: float = doc("draft-step seconds assumed before any measurement", 0.004)
    prior_verify_s: float = doc("verify seconds assumed before any measurement", 0.02)
    decay: float = doc("weight an observation keeps per newer one (1 = plain least squares)", 0.999)
    ridge: float = doc("pull toward the prior in directions the data do not constrain", 1e-6)
    refit_interval: int = doc("observations between two online refits of the coefficients", 16)
    anchor_weight: float = doc("rounds each calibration point (`fit`) counts as, for good: online rounds decay, "
                               "the calibration does not, so a K the policy stops running keeps its measured cost", 4.0)
    time_factors: bool = doc("correct the line by a measured factor per (batch-size bucket, K) "
                             "(`CostModel.time_factors`); off = the least-squares line alone", True)

    def __post_init__(self) -> None:
        for f in ("prior_draft_step_s", "prior_verify_s"):
            check(math.isfinite(getattr(self, f)) and getattr(self, f) > 0, f, f"must be > 0, got {getattr(self, f)!r}")
        check(0 < self.decay <= 1, "decay", f"must be in (0, 1], got {self.decay!r}")
        check(math.isfinite(self.ridge) and self.ridge > 0, "ridge", f"must be > 0, got {self.ridge!r}")
        check(isinstance(self.refit_interval, int) and self.refit_interval >= 1, "refit_interval",
              f"must be an int >= 1, got {self.refit_interval!r}")
        check(math.isfinite(self.anchor_weight) and self.anchor_weight > 0, "anchor_weight",
              f"must be > 0, got {self.anchor_weight!r}")


class CostModel:
    """Predicts a round's seconds from batch size, K and context length; learns from measurements."""

    def __init__(self, config: CostModelConfig | None = None):
        self.config = cfg = config or CostModelConfig()
        self._draft = _RidgeLeastSquares((cfg.prior_draft_step_s, 0.0, 0.0, 0.0, 0.0), cfg.ridge, cfg.decay)
        self._verify = _RidgeLeastSquares((cfg.prior_verify_s, 0.0, 0.0, 0.0, 0.0), cfg.ridge, cfg.decay)
        self._memo: tuple | None = None  # (batch_size, ctx_len, round_terms) of the last round asked
        # bucket -> K -> [sum 1, sum b, sum b*ctx, sum b*n, sum b*[n > 1], sum seconds, online round
        # count they were decayed to] over that bucket's rounds of K drafts (n: tokens verified per
        # request): what draft_row and verify_features are made of. A prediction is linear in the
        # coefficients, so the sums give those rounds' predicted seconds under the coefficients of
        # now; they decay as the line's rows do (`decay` per online round, of any bucket and K), so
        # factor and line describe the same rounds.
        self._tally: dict[int, dict[int, list[float]]] = {}
        self._factors: dict[int, list[float]] = {}  # bucket -> factor per K under the current coefficients
        self.draft_coef = list(self._draft.prior)
        self.verify_coef = list(self._verify.prior)
        self._pending = 0

    @property
    def draft_coef(self) -> list[float]:
        return self._draft_coef

    @draft_coef.setter
    def draft_coef(self, coef: Sequence[float]) -> None:
        self._draft_coef, self._memo, self._factors = list(coef), None, {}

    @property
    def verify_coef(self) -> list[float]:
        return self._verify_coef

    @verify_coef.setter
    def verify_coef(self, coef: Sequence[float]) -> None:
        self._verify_coef, self._memo, self._factors = list(coef), None, {}

    @classmethod
    def with_coefficients(cls, draft_coef: Sequence[float], verify_coef: Sequence[float],
                          config: CostModelConfig | None = None) -> "CostModel":
        """A model with known coefficients (e.g. from a benchmark), in `draft_row`/`verify_features` order.
        They hold until the first online refit (`refit_interval` observations), which has only the
        online rounds to go by: a model that should keep a calibration is built with `fit`."""
        model = cls(config)
        check(len(draft_coef) == 5, "draft_coef",
              f"needs 5 values (K, K*b, K*b*ctx, [K>0], [K>0]*b), got {len(draft_coef)}")
        check(len(verify_coef) == 5, "verify_coef",
              f"needs 5 values (1, b, b*n, b*ctx, b*[n>1]), got {len(verify_coef)}")
        model.draft_coef, model.verify_coef = [float(c) for c in draft_coef], [float(c) for c in verify_coef]
        return model

    def observe(self, batch_size: int, num_steps: int, ctx_len: float, draft_s: float | None,
                verify_s: float | None, *, verify_tokens: int | None = None) -> None:
        """One measured round; `verify_tokens` = total tokens verified if not batch_size * (K + 1)."""
        if batch_size <= 0:
            return
        if draft_s is not None and num_steps > 0:
            self._draft.add(draft_row(batch_size, num_steps, ctx_len), draft_s)
        if verify_s is not None:
            per_req = (verify_tokens / batch_size) if verify_tokens is not None else num_steps + 1
            self._verify.add(verify_features(batch_size, per_req, ctx_len), verify_s)
            if num_steps <= 0 or draft_s is not None:
                self._tally_round(batch_size, num_steps, ctx_len, per_req, verify_s + (draft_s or 0.0), 1.0)
        self._pending += 1
        if self._pending >= self.config.refit_interval:
            self.refit()

    def fit(self, observations: Iterable[Sequence[float]]) -> "CostModel":
        """Least-squares fit to calibration rows (batch_size, num_steps, ctx_len, draft_s, verify_s),
        kept as the model's anchor: they never decay, each weighs `anchor_weight` online rounds."""
        w = self.config.anchor_weight
        for b, k, ctx, d, v in observations:
            if b <= 0:
                continue
            if k > 0:
                self._draft.add_anchor(draft_row(b, k, ctx), d, w)
            self._verify.add_anchor(verify_features(b, k + 1, ctx), v, w)
            self._tally_round(b, k, ctx, k + 1, d + v, w)
        self.refit()
        return self

    def _tally_round(self, batch_size: float, num_steps: int, ctx_len: float, tokens_per_request: float,
                     seconds: float, weight: float) -> None:
        """Add one round (draft + verify seconds) to its (bucket, K) sums; the factors follow at the next refit."""
        if not self.config.time_factors or not seconds > 0:
            return
        per_k = self._tally.setdefault(batch_bucket(batch_size), {})
        old, now = per_k.get(num_steps), self._verify.count
        w_b = weight * batch_size
        # a new list, not an update in place: `info` reads the sums from another thread
        if old is None:
            per_k[num_steps] = [weight, w_b, w_b * ctx_len, w_b * tokens_per_request,
                                w_b if tokens_per_request > 1 else 0.0, weight * seconds, now]
        else:
            keep = self.config.decay ** (now - old[6])  # a ratio of two sums: decayed alike only when added to
            per_k[num_steps] = [keep * old[0] + weight, keep * old[1] + w_b, keep * old[2] + w_b * ctx_len,
                                keep * old[3] + w_b * tokens_per_request,
                                keep * old[4] + (w_b if tokens_per_request > 1 else 0.0),
                                keep * old[5] + weight * seconds, now]

    def time_factors(self, batch_size: float, max_steps: int) -> list[float]:
        """Measured over predicted seconds of this batch size's rounds (as the line now predicts
        them), per K = 0..max_steps (or more): the line's misfit where it was measured. One line
        for every batch size and K missed CPU rounds by 7-18 % in the median, and by more where it
        mattered: at batch 16 it priced K = 1 at 1.6x a plain round, measured 1.32x, and the policy
        ran K = 0 in 91 % of the rounds, 0.79x of static K = 1 (2026-11-24, docs/controller.md). A
        K without rounds of its own takes the factor interpolated between the nearest measured
        K > 0 (the nearest one beyond them); K = 0 only its own. Rebuilt when the coefficients
        change (every refit), so between refits a bucket's factors stay fixed."""
        bucket = batch_bucket(batch_size)
        table = self._factors.get(bucket)
        if table is None or len(table) <= max_steps:
            table = self._factor_table(bucket, max_steps)
            self._factors[bucket] = table
        return table

    def factors_info(self) -> dict[str, list[float]]:
        """The time factors of every bucket with rounds, K = 0.. the deepest measured, keyed by the
        bucket's smallest batch size; built afresh (for readers on other threads)."""
        return {str(1 << (b - 1)): [round(f, 4) for f in self._factor_table(b, 0)] for b in sorted(list(self._tally))}

    def _factor_table(self, bucket: int, max_steps: int) -> list[float]:
        (d0, d1, d2, d3, d4), (v0, v1, v2, v3, v4) = self.draft_coef, self.verify_coef
        lo, hi = FACTOR_RANGE
        measured = {}
        for k, (n, sb, sbc, sbn, sbv, secs, _) in list(self._tally.get(bucket, {}).items()):
            # the sums of draft_row and verify_features over the rounds, dotted with the coefficients
            drafted = k * (d0 * n + d1 * sb + d2 * sbc / CTX_SCALE) + (d3 * n + d4 * sb if k > 0 else 0.0)
            predicted = drafted + v0 * n + v1 * sb + v2 * sbn + v3 * sbc / CTX_SCALE + v4 * sbv
            if predicted > 0:
                measured[k] = min(max(secs / predicted, lo), hi)
        drafted = sorted(k for k in measured if k > 0)
        table = [measured.get(0, 1.0)]
        j = 0  # drafted[j - 1] < k <= drafted[j]
        for k in range(1, max(max_steps, drafted[-1] if drafted else 0) + 1):
            while j < len(drafted) and drafted[j] < k:
                j += 1
            if not drafted:
                table.append(1.0)
            elif j == len(drafted):
                table.append(measured[drafted[-1]])
            elif drafted[j] == k or j == 0:
                table.append(measured[drafted[j]])
            else:
                k0, k1 = drafted[j - 1], drafted[j]
                table.append(measured[k0] + (measured[k1] - measured[k0]) * (k - k0) / (k1 - k0))
        return table

    def refit(self) -> None:
        self.draft_coef = self._draft.solve()
        self.verify_coef = self._verify.solve()
        self._pending = 0

    def draft_step_s(self, batch_size: float, ctx_len: float = 0) -> float:
        """Seconds of one more draft step (the marginal step; the first costs `draft_extra_s` more)."""
        return max(0.0, _dot(self.draft_coef[:3], draft_features(batch_size, ctx_len)))

    def draft_extra_s(self, batch_size: float) -> float:
        """What a round with K > 0 spends drafting beyond K steps (the catch-up's share of the first)."""
        c = self.draft_coef
        return c[3] + c[4] * batch_size

    def draft_s(self, batch_size: float, num_steps: float, ctx_len: float = 0) -> float:
        """Draft-phase seconds of a round with num_steps drafts (0 at K = 0)."""
        if num_steps <= 0:
            return 0.0
        return max(0.0, num_steps * self.draft_step_s(batch_size, ctx_len) + self.draft_extra_s(batch_size))

    def verify_s(self, batch_size: float, num_steps: float, ctx_len: float = 0) -> float:
        """Verify seconds with num_steps drafts (+ 1) per request; num_steps may be a mean."""
        base, per_token = self.verify_terms(batch_size, ctx_len)
        extra = self.verify_extra_s(batch_size) if num_steps > 0 else 0.0
        return max(0.0, base + per_token * (num_steps + 1) + extra)

    def verify_terms(self, batch_size: float, ctx_len: float = 0) -> tuple[float, float]:
        """(base, per_token) with verify_s(b, k, ctx) = max(0, base + per_token * (k + 1) +
        [k > 0] * verify_extra_s(b)): the policy's loops over K evaluate this line instead of
        the whole model per K."""
        c0, c1, c2, c3, _ = self.verify_coef
        return c0 + c1 * batch_size + c3 * batch_size * ctx_len / CTX_SCALE, c2 * batch_size

    def verify_extra_s(self, batch_size: float) -> float:
        """What a verify of drafts costs beyond a plain decode step's line."""
        return self.verify_coef[4] * batch_size

    def round_terms(self, batch_size: float, ctx_len: float = 0) -> tuple[float, float, float, float, float]:
        """(draft step, verify base, verify per token, draft extra, verify extra) for one round's
        batch size and context: a round of K > 0 takes K * step + draft extra + max(0, base +
        per_token * (K + 1) + verify extra), one of K = 0 max(0, base + per_token). The policy
        asks for them up to K + 2 times a round with the same arguments: the last answer is kept
        until the arguments or the coefficients change."""
        memo = self._memo
        if memo is not None and memo[0] == batch_size and memo[1] == ctx_len:
            return memo[2]
        terms = (self.draft_step_s(batch_size, ctx_len), *self.verify_terms(batch_size, ctx_len),
                 self.draft_extra_s(batch_size), self.verify_extra_s(batch_size))
        self._memo = (batch_size, ctx_len, terms)
        return terms

    def verify_token_s(self) -> float:
        """Extra verify seconds for one more token in the batch."""
        return max(0.0, self.verify_coef[2])

    def predict_round_s(self, batch_size: float, k: float, ctx_len: float = 0, *, factors: bool = True) -> float:
        """Draft K steps then verify K + 1 tokens per request; with `factors`, times the
        `time_factors` of (batch size, K) when K is a whole number (the line alone otherwise)."""
        line = self.draft_s(batch_size, k, ctx_len) + self.verify_s(batch_size, k, ctx_len)
        if not factors or k != int(k) or k < 0:
            return line
        return line * self.time_factors(batch_size, int(k))[int(k)]

    @property
    def observations(self) -> int:
        """Online rounds observed (calibration points not included)."""
        return self._verify.count

    @property
    def calibration_points(self) -> int:
        """Rows given to `fit`: the anchor."""
        return self._verify.anchors

    def state_dict(self) -> dict:
        return {"draft": self._draft.state_dict(), "verify": self._verify.state_dict(),
                "draft_coef": self.draft_coef[:], "verify_coef": self.verify_coef[:], "pending": self._pending,
                "tally": {f"{b}:{k}": t[:] for b, per_k in self._tally.items() for k, t in per_k.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._draft.load_state_dict(state["draft"])
        self._verify.load_state_dict(state["verify"])
        self.draft_coef = [float(c) for c in state["draft_coef"]]
        self.verify_coef = [float(c) for c in state["verify_coef"]]
        self._pending = int(state["pending"])
        self._tally = {}
        for key, sums in state.get("tally", {}).items():  # states written before the time factors have none
            b, k = (int(x) for x in key.split(":"))
            check(len(sums) == 7, f"state.tally[{key!r}]", f"needs 6 sums and a round count, got {len(sums)}")
            self._tally.setdefault(b, {})[k] = [float(x) for x in sums]


def fill_untried(rates: Sequence[float], tried: Sequence, prior: float) -> list[float]:
    """Per-position acceptance with every untried position (tried[i] falsy) taking the deepest
    tried rate to its left, or `prior` left of any tried one."""
    out, last = [], prior
    for rate, t in zip(rates, tried):
        last = rate if t else last
        out.append(last)
    return out


def expected_accepted(a: Sequence[float], k: int) -> float:
    """Drafts accepted per round with K = k from per-position acceptance a_1..: sum over
    i <= k of prod_{j <= i} a_j (bonus excluded; positions past len(a) add nothing)."""
    total, surv = 0.0, 1.0
    for i in range(min(k, len(a))):
        surv *= a[i]
        total += surv
    return total


class AcceptanceEstimate:
    """Conditional acceptance of each draft position, for one batch-size slot: hits / trials,
    both discounted by (1 - 1/window) per later trial of the same position, starting from the
    prior counted as PRIOR_TRIALS trials."""

    def __init__(self, depth: int, prior: float, window: float):
        self.depth, self.prior, self.window = depth, prior, window
        self.rates = [prior] * depth
        self.seen = [0] * depth  # rounds that tried the position
        self.weight = [PRIOR_TRIALS] * depth  # discounted trials (prior included) behind rates[i]
        self._filled: list[float] | None = None

    def observe(self, accepted: Sequence[int], num_steps: int | Sequence[int]) -> None:
        """One round: request r drafted num_steps (or num_steps[r]) and had accepted[r] accepted.

        Position i was tried by every request whose first i drafts were accepted and that drafted
        more than i, and hit by every request that accepted more than i: counted in one pass
        over the requests (tried_to[t]: requests whose trials stop before position t), then suffix sums."""
        uniform = isinstance(num_steps, int) or (len(num_steps) > 0 and num_steps.count(num_steps[0]) == len(num_steps))
        if uniform:
            n = num_steps if isinstance(num_steps, int) else num_steps[0]
            k = min(n, self.depth)
            if k <= 0 or not accepted:
                return
            # every request drafted k: hit_to[a] = requests that accepted a (a >= k counted at k),
            # by list.count, which does in C what the loop below does per request (B up to 64+)
            acc = accepted if isinstance(accepted, list) else list(accepted)
            hit_to = [acc.count(a) for a in range(k)]
            hit_to.append(len(acc) - sum(hit_to))
            tried_to = [0] + hit_to[:k]
            tried_to[k] += hit_to[k]
        else:
            k = min(max(num_steps), self.depth)
            if k <= 0:
                return
            tried_to, hit_to = [0] * (k + 1), [0] * (k + 1)
            for a, kr in zip(accepted, num_steps):  # comparisons, not min(): this runs B times a round
                if kr > k:
                    kr = k
                if a > kr:
                    a = kr
                tried_to[a + 1 if a < kr else kr] += 1
                hit_to[a] += 1
        trials, hits = [0] * k, [0] * k
        t = h = 0
        for i in range(k - 1, -1, -1):
            t += tried_to[i + 1]
            h += hit_to[i + 1]
            trials[i], hits[i] = t, h
        keep = 1.0 - 1.0 / self.window
        for i in range(k):
            if trials[i]:
                old = self.weight[i] * keep ** trials[i]
                self.weight[i] = old + trials[i]
                self.rates[i] = (old * self.rates[i] + hits[i]) / self.weight[i]
                self.seen[i] += 1
        self._filled = None

    def estimates(self) -> list[float]:
        """a_1..a_depth; a position never tried takes the deepest tried estimate to its left.
        Cached until the next `observe` (the engine thread's hot path)."""
        if self._filled is None:
            self._filled = self.fresh_estimates()
        return self._filled

    def fresh_estimates(self) -> list[float]:
        """`estimates` computed now, leaving the cache alone: for readers on other threads (a
        cache they filled while `observe` ran could hold the previous round's values)."""
        return fill_untried(list(self.rates), list(self.seen), self.prior)

    def reset(self) -> None:
        self.rates = [self.prior] * self.depth
        self.seen = [0] * self.depth
        self.weight = [PRIOR_TRIALS] * self.depth
        self._filled = None

    def soften(self, trials: float) -> None:
        """Keep the rates as a prior worth at most `trials` trials per position (0 = `reset`):
        a new head's own rounds outweigh them within a few rounds."""
        if trials <= 0:
            self.reset()
            return
        self.weight = [min(w, trials) for w in self.weight]
        self._filled = None


SMALL_BATCH = 16  # confidences in a call up to which the policy's in-round work runs on Python floats


def small_rows(confidences) -> list[list[float]] | None:
    """The confidences as Python rows when the batch holds at most `SMALL_BATCH` of them, else
    None (numpy's turn). `confidences`: a 1-D or 2-D array, or a sequence of rows."""
    if isinstance(confidences, np.ndarray):
        if confidences.size > SMALL_BATCH:
            return None
        rows = confidences.tolist()
        return [rows] if confidences.ndim == 1 else rows
    if sum(len(r) for r in confidences) > SMALL_BATCH:
        return None
    return [r.tolist() if isinstance(r, np.ndarray) else list(r) for r in confidences]


def confidence_array(confidences) -> tuple[np.ndarray, np.ndarray | None]:
    """(array [B, K] of the drafts' confidences, row lengths or None when every row has K).

    `confidences` is a 2-D array (the engine passes its [B, K] draft probabilities as one) or
    one sequence of floats per request; ragged rows are padded with 0 and their lengths returned."""
    if isinstance(confidences, np.ndarray) and confidences.ndim == 2:
        return confidences, None
    rows = [list(r) for r in confidences]
    lens = [len(r) for r in rows]
    k = max(lens, default=0)
    if all(n == k for n in lens):
        return np.array(rows, dtype=np.float64).reshape(len(rows), k), None
    out = np.zeros((len(rows), k))
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, np.array(lens)


class ConfidenceCalibrator:
    """Draft confidence -> P(accepted | earlier drafts accepted), per confidence bin.

    Each bin starts at its midpoint with `prior_weight` pseudo-observations (the identity map).
    A confidence (a probability) c falls in bin floor(c * bins) taken in float64 (1.0 and
    above: the top bin, below 0 or NaN: the first). Batches of more than `SMALL_BATCH` confidences go through numpy;
    smaller ones (batch 1-4 rounds, where speculation pays most) through Python floats: inside
    an engine round each numpy call costs several microseconds (2026-11-24: the calibrator's
    numpy calls were 70 of the ~150 us the cost policy spent in a batch-1 round of a tiny
    model, against ~17 us for the same calls in a hot loop).
    """

    def __init__(self, bins: int, prior_weight: float):
        self.bins, self.prior_weight = bins, prior_weight
        self._bin_ids = np.arange(bins)
        self._verdict_tables: dict[int, np.ndarray] = {}
        self.load(None, None)

    def table(self) -> list[float]:
        """Calibrated value of every bin (a list), recomputed only after new observations."""
        if self._list is None:
            w, n = self.prior_weight, self.bins
            self._list = [(h + w * (j + 0.5) / n) / (t + w)
                          for j, (h, t) in enumerate(zip(self.hits, self.trials))]
        return self._list

    def _values(self) -> np.ndarray:
        """`table` as an array, for the numpy path."""
        if self._table is None:
            self._table = np.array(self.table())
        return self._table

    def bin(self, confidence: float) -> int:
        """Bin index of one confidence (Python float)."""
        n = self.bins
        if not confidence > 0.0:  # below 0, or NaN
            return 0
        j = int(confidence * n) if confidence < 1.0 else n - 1
        return j if j < n else n - 1  # c * n rounds up to n for c just below 1

    def bin_of(self, confidences: np.ndarray) -> np.ndarray:
        """Bin index of each confidence of an array (`bin`, elementwise)."""
        # take(mode="clip") clamps the index as it gathers: one numpy call where np.minimum and
        # np.maximum were two (~0.5 us each; numpy's per-call cost is most of the policy's round)
        return self._bin_ids.take((np.asarray(confidences, dtype=np.float64) * self.bins).astype(np.int64), mode="clip")

    def __call__(self, confidence: float) -> float:
        return self.table()[self.bin(float(confidence))]

    def mean(self, confidences) -> float:
        """Mean calibrated value of a sequence or 1-D array of confidences (0 if empty)."""
        if len(confidences) <= SMALL_BATCH:
            tbl = self.table()
            row = confidences.tolist() if isinstance(confidences, np.ndarray) else confidences
            return sum(tbl[self.bin(c)] for c in row) / len(row) if len(row) else 0.0
        vals = self.calibrated(confidences)
        return float(vals.sum()) / vals.size if vals.size else 0.0  # .sum() / size: np.mean costs more

    def calibrated(self, confidences: np.ndarray) -> np.ndarray:
        """`self(c)` for every element of an array of confidences."""
        return self._values().take(self.bin_of(confidences))

    def _verdicts(self, k: int) -> np.ndarray:
        """[k + 1, k]: row a holds, per draft position, 0 where a request that accepted a drafts
        had it accepted, `bins` where it was rejected, 2 * `bins` where it was never judged."""
        table = self._verdict_tables.get(k)
        if table is None:
            pos, a, n = np.arange(k), np.arange(k + 1)[:, None], self.bins
            table = self._verdict_tables[k] = np.where(pos < a, 0, np.where(pos == a, n, 2 * n))
        return table

    def observe(self, confidences, accepted: Sequence[int]) -> None:
        """One round: request r's drafts had `confidences[r]` and the first accepted[r] were
        accepted; draft accepted[r] (if drafted) was rejected, later ones were never judged."""
        if isinstance(confidences, np.ndarray) and confidences.size == 0:
            return  # a K = 0 round (the engine passes its [B, 0] array)
        rows = small_rows(confidences)
        if rows is not None:
            hits, trials = self.hits, self.trials
            for row, a in zip(rows, accepted):
                for i, c in enumerate(row[:a + 1]):
                    j = self.bin(c)
                    trials[j] += 1
                    if i < a:
                        hits[j] += 1
            self._changed()
            return
        conf, lens = confidence_array(confidences)
        if conf.size == 0:
            return
        n, bins = self.bins, self.bin_of(conf)
        if lens is None:
            # every request drafted K (the engine's case): one bincount of each draft's bin offset
            # by its verdict, the offsets a row of `_verdicts` per request (accepted > K: all
            # accepted); two boolean masks and two bincounts cost ~4 us more at b = 16 (2026-11-24)
            code = self._verdicts(conf.shape[1]).take(accepted, axis=0, mode="clip")
            code += bins
            counts = np.bincount(code.ravel(), minlength=3 * n)
            hit, tried = counts[:n].tolist(), (counts[:n] + counts[n:2 * n]).tolist()
        else:
            pos = np.arange(conf.shape[1])
            a = np.asarray(accepted)[:, None]
            tried = np.bincount(bins[(pos <= a) & (pos < lens[:, None])], minlength=n).tolist()
            hit = np.bincount(bins[pos < a], minlength=n).tolist()  # accepted drafts exist, so never padding
        # counts summed as ints first: the totals may be fractional (soften)
        self.hits = [h + c for h, c in zip(self.hits, hit)]
        self.trials = [t + c for t, c in zip(self.trials, tried)]
        self._changed()

    def _changed(self) -> None:
        self._list: list[float] | None = None
        self._table: np.ndarray | None = None

    def load(self, hits: Sequence[float] | None, trials: Sequence[float] | None) -> None:
        """Hits and trials per bin (floats; None: none)."""
        self.hits = [0.0] * self.bins if hits is None else [float(h) for h in hits]
        self.trials = [0.0] * self.bins if trials is None else [float(t) for t in trials]
        self._changed()

    def reset(self) -> None:
        self.load(None, None)

    def soften(self, trials: float) -> None:
        """Keep each bin's calibrated value, held by at most `trials` observations (0 = `reset`)."""
        if trials <= 0:
            self.reset()
            return
        scale = [min(1.0, trials / max(t, 1e-12)) for t in self.trials]
        self.load([h * f for h, f in zip(self.hits, scale)], [t * f for t, f in zip(self.trials, scale)])


@dataclass(frozen=True)
class CostPolicyConfig:
    """Knobs of the cost-model policy (its K tiers come from the adaptive config's slots)."""

    accept_window: float = doc("request-drafts each per-position acceptance estimate averages over "
                               "(exponential forgetting per trial)", 64.0)
    prior_accept: float = doc("per-position acceptance assumed before any round", 0.6)
    tpot_slo_s: float | None = doc("never pick a K whose predicted round seconds exceed this (None = off)", None)
    calib_bins: int = doc("confidence bins of the calibrator", 10)
    calib_prior_weight: float = doc("pseudo-observations holding each bin at its midpoint", 4.0)
    rewarm_keep_trials: float = doc("when a new head goes live, the old head's acceptance estimates and confidence "
                                    "calibration stay as a prior worth this many trials per position and bin (the "
                                    "new head is usually its fine-tuned successor: the live position-1 acceptance of 9 "
                                    "successive versions of an e2e run stayed within 0.60-0.63; at 4 trials, three "
                                    "misses after a swap put a 0.6 estimate at 0.35); 0 = start over from prior_accept "
                                    "and the identity calibration", 16.0)
    probe_interval: int = doc("decisions a slot makes below its deepest tier before it runs one round at the "
                              "next tier up, re-measuring positions it no longer drafts (0 = never)", 32)

    def __post_init__(self) -> None:
        check(math.isfinite(self.accept_window) and self.accept_window >= 1, "accept_window",
              f"must be >= 1, got {self.accept_window!r}")
        check(0 <= self.prior_accept <= 1, "prior_accept", f"must be in [0, 1], got {self.prior_accept!r}")
        check(self.tpot_slo_s is None or (math.isfinite(self.tpot_slo_s) and self.tpot_slo_s > 0), "tpot_slo_s",
              f"must be > 0 seconds or None, got {self.tpot_slo_s!r}")
        check(isinstance(self.calib_bins, int) and self.calib_bins >= 1, "calib_bins",
              f"must be an int >= 1, got {self.calib_bins!r}")
        check(self.calib_prior_weight > 0, "calib_prior_weight", f"must be > 0, got {self.calib_prior_weight!r}")
        check(math.isfinite(self.rewarm_keep_trials) and self.rewarm_keep_trials >= 0, "rewarm_keep_trials",
              f"must be >= 0, got {self.rewarm_keep_trials!r}")
        check(isinstance(self.probe_interval, int) and self.probe_interval >= 0, "probe_interval",
              f"must be an int >= 0, got {self.probe_interval!r}")


class CostModelPolicy:
    """K maximizing expected committed tokens per predicted second, per batch-size slot."""

    name = "cost_model"

    def __init__(self, adaptive: AdaptiveConfig, config: CostPolicyConfig | None = None,
                 cost_model: CostModel | None = None):
        self.adaptive = adaptive
        self.config = cfg = config or CostPolicyConfig()
        self.cost = cost_model or CostModel()
        self._slots = adaptive.slots
        self._accept = [AcceptanceEstimate(max(s.candidate_steps), cfg.prior_accept, cfg.accept_window)
                        for s in self._slots]
        self._calib = ConfidenceCalibrator(cfg.calib_bins, cfg.calib_prior_weight)
        self._last: list[int | None] = [None] * len(self._slots)
        self._decisions = [0] * len(self._slots)
        self._below = [0] * len(self._slots)  # decisions since the slot last drafted its next tier up
        self._probing = [False] * len(self._slots)  # the slot's current round is a probe: draft and verify all of it
        self._choice: tuple | None = None  # (estimates, round terms, K) of the last choose_steps

    @property
    def candidate_steps(self) -> list[int]:
        return self.adaptive.candidate_steps

    # -- before drafting ---------------------------------------------------------------------

    def expected_tokens(self, batch_size: int, k: int, estimates: Sequence[float] | None = None) -> float:
        """E(K): committed tokens per request (bonus included) with K drafts, from the estimates
        (the slot's, or the given a_1..a_depth)."""
        a = self._accept[self.adaptive.slot_index(batch_size)].estimates() if estimates is None else estimates
        return 1.0 + expected_accepted(a, k)

    def choose_steps(self, batch_size: int, ctx_len: float = 0) -> int:
        """The slot's tier maximizing E(K) / round seconds; ties go to the smaller K. Under a
        TPOT SLO, tiers predicted slower than it are skipped; if none fits, the smallest tier."""
        i = self.adaptive.slot_index(batch_size)
        a = self._accept[i].estimates()
        terms = self.cost.round_terms(batch_size, ctx_len)
        tiers = self._slots[i].candidate_steps
        factor = self.cost.time_factors(batch_size, tiers[-1])
        memo = self._choice
        if memo is not None and memo[0] is a and memo[1] is terms and memo[3] is factor:
            return memo[2]  # the same cached estimates, round terms and factors: update's choice, asked again
        slo = self.config.tpot_slo_s
        step_s, base, per_token, d_extra, v_extra = terms
        best_k, best_rate = None, -1.0
        expected, surv, pos = 1.0, 1.0, 0
        for k in tiers:
            while pos < k:
                surv *= a[pos]
                expected += surv
                pos += 1
            if k:
                v = base + per_token * (k + 1) + v_extra
                t = (max(0.0, k * step_s + d_extra) + (v if v > 0.0 else 0.0)) * factor[k]
            else:
                v = base + per_token
                t = (v if v > 0.0 else 0.0) * factor[0]
            if slo is not None and t > slo:
                continue
            rate = expected / max(t, 1e-12)
            if rate > best_rate:
                best_k, best_rate = k, rate
        best_k = tiers[0] if best_k is None else best_k
        self._choice = (a, terms, best_k, factor)  # holds the objects, so `is` cannot match a recycled id
        return best_k

    def steps_for(self, batch_size: int, ctx_len: float = 0) -> int:
        """`choose_steps`, remembered as this slot's K for an `update` that omits num_steps.

        Every `probe_interval` decisions below the slot's deepest tier, one round runs the next
        tier up instead. Positions beyond the chosen K are never observed, so without the probe
        an estimate that a run of bad rounds pushed down would stay down for good (at K = 0
        nothing is observed at all: plain decoding would be absorbing, as SGLang's policy also
        knows, which probes up from K = 0). A probe round drafts and verifies all its K drafts: the
        in-round early stop (`should_continue`) and the verify-length cut (`verify_lengths`) read the
        same low estimate the probe is there to re-measure, and in an e2e run of 2026-11-23 they cut
        every probe back to one draft: a position-2 estimate that three misses after a swap had put
        at 0.35 (true ~0.6) held K at 1 for the last 60 s of the run."""
        i = self.adaptive.slot_index(batch_size)
        k = self.choose_steps(batch_size, ctx_len)
        tiers = self._slots[i].candidate_steps
        self._probing[i] = False
        if self.config.probe_interval and k < tiers[-1]:
            self._below[i] += 1
            if self._below[i] >= self.config.probe_interval:
                self._below[i] = 0
                k = tiers[tiers.index(k) + 1]
                self._probing[i] = True
        else:
            self._below[i] = 0
        self._last[i] = k
        self._decisions[i] += 1
        return k

    # -- inside a round ----------------------------------------------------------------------

    def should_continue(self, step_index: int, draft_confidence: float | Sequence[float],
                        batch_size: int, ctx_len: float = 0) -> bool:
        """After `step_index` drafts (the last with `draft_confidence`, a value or one per
        request), is drafting one more predicted to raise tokens per second? The next draft
        adds P(drafts 1..step_index accepted) * a_{step_index+1} tokens per request and costs
        one draft step plus one verified token per request."""
        if not (isinstance(step_index, int) and step_index >= 1):  # no check(): its message is built every call
            raise ConfigError(f"step_index: must be an int >= 1, got {step_index!r}")
        i = self.adaptive.slot_index(batch_size)
        if self._probing[i]:  # a probe measures the positions the estimates doubt: no early stop
            return step_index < (self._last[i] or 0)
        a = self._accept[i].estimates()
        if step_index >= len(a):
            return False
        step_s, base, per_token, d_extra, v_extra = self.cost.round_terms(batch_size, ctx_len)
        factor = self.cost.time_factors(batch_size, step_index + 1)
        t_now = (max(0.0, step_index * step_s + d_extra)
                 + max(0.0, base + v_extra + per_token * (step_index + 1))) * factor[step_index]
        t_next = (max(0.0, (step_index + 1) * step_s + d_extra)
                  + max(0.0, base + v_extra + per_token * (step_index + 2))) * factor[step_index + 1]
        if self.config.tpot_slo_s is not None and t_next > self.config.tpot_slo_s:
            return False
        if isinstance(draft_confidence, (int, float)):
            p_last = self._calib(draft_confidence)
        else:
            p_last = self._calib.mean(draft_confidence)
        expected, surv = 1.0, 1.0
        for j in range(step_index - 1):
            surv *= a[j]
            expected += surv
        surv *= p_last
        expected += surv
        gain = surv * a[step_index]
        # (E + gain) / t_next > E / t_now, cross-multiplied (both times are >= 0).
        return gain * t_now > expected * (t_next - t_now)

    def verify_lengths(self, confidences: Sequence[Sequence[float]], ctx_len: float = 0, *,
                       padded: bool = False) -> list[int]:
        """Drafts to verify per request (AdaSpec's confidence-prior verifier): keep draft m of
        request r while its survival S_rm = prod_{j<=m} p(conf_rj) pays for its verify token
        at the round's throughput, S_rm >= (expected tokens / round seconds) * (seconds per
        verified token). Drafting is already spent; only verify tokens are saved.

        padded: the verify forward runs every request at the longest kept length (the embedded
        engine's batch is rectangular), so a request cut shorter than the longest saves nothing
        and only loses drafts; then one common length is chosen for the whole batch (see
        `_padded_cut`). Per-request lengths pay only where the verify packs ragged rows."""
        rows = small_rows(confidences) if padded else None  # a small padded batch: Python floats
        if rows is not None:
            full = [len(r) for r in rows]
            b, k = len(rows), max(full, default=0)
        else:
            conf, lens = confidence_array(confidences)
            b, k = conf.shape
            full = [k] * b if lens is None else lens.tolist()
        if b == 0:
            return []
        if k == 0 or self.cost.verify_token_s() <= 0 or self._probing[self.adaptive.slot_index(b)]:
            return full
        step_s, base, per_token, d_extra, v_extra = self.cost.round_terms(b, ctx_len)
        draft_s = max(0.0, k * step_s + d_extra)  # already spent, part of the round
        if rows is not None:
            # gain[m] = sum_r S_rm, the survival S_rm = prod_{j<=m} p(conf_rj) (rows end at their length)
            calib, tbl, gain = self._calib, self._calib.table(), [0.0] * k
            for row in rows:
                sv = 1.0
                for m, c in enumerate(row):
                    sv *= tbl[calib.bin(c)]
                    gain[m] += sv
            return self._padded_cut(gain, full, draft_s, base, per_token, v_extra)
        # survival S_rm = prod_{j<=m} p(conf_rj), 0 past a row's last draft
        surv = self._calib.calibrated(conf).cumprod(axis=1)  # the method: np.cumprod's dispatch costs ~1 us more
        if lens is not None:
            surv[np.arange(k) >= lens[:, None]] = 0.0
        if padded:
            return self._padded_cut(surv.sum(axis=0).tolist(), full, draft_s, base, per_token, v_extra)
        # S_rm never rises along a row, so every throughput threshold keeps a prefix of each
        # row, and the rows' kept drafts together are the largest survivals of the batch: sort
        # them once and scan the cut (the Dinkelbach fixed point is the best cut, and on a tie
        # it keeps the equal drafts too).
        flat = np.sort(surv[surv > 0.0] if lens is not None else surv.ravel())[::-1].tolist()
        tok_s = self.cost.verify_token_s()
        v0 = base + per_token  # verify with no draft kept: one token per request
        best_m, best_rate, tokens = 0, b / max(draft_s + max(0.0, v0), 1e-12), float(b)
        for m, sv in enumerate(flat, 1):
            tokens += sv
            if m < len(flat) and flat[m] == sv:
                continue  # a cut between equal survivals keeps them all
            rate = tokens / max(draft_s + max(0.0, v0 + v_extra + tok_s * m), 1e-12)
            if rate >= best_rate:
                best_m, best_rate = m, rate
        if best_m == len(flat):
            return full
        if best_m == 0:
            return [0] * b
        return (surv >= flat[best_m - 1]).sum(axis=1).tolist()

    @staticmethod
    def _padded_cut(gain: list[float], full: list[int], draft_s: float, base: float, per_token: float,
                    v_extra: float = 0.0) -> list[int]:
        """One verify length L for every request (fewer where a row has fewer drafts): the L
        maximizing (b + sum_{m<=L} gain[m]) / (draft seconds + verify(b, L)); a tie keeps the
        longer L. gain[m]: the expected tokens the batch gains from verifying draft m + 1 (the
        sum over requests of the survivals S_rm, 0 past a row's last draft); full: each row's
        drafts; base, per_token: the verify line of `CostModel.verify_terms`; v_extra: a verify
        of drafts (L > 0) costs that much more than the line."""
        best_n, best_rate, tokens = 0, -1.0, float(len(full))
        for n in range(len(gain) + 1):
            if n:
                tokens += gain[n - 1]
            v = base + per_token * (n + 1) + (v_extra if n else 0.0)
            rate = tokens / max(draft_s + (v if v > 0.0 else 0.0), 1e-12)
            if rate >= best_rate:
                best_n, best_rate = n, rate
        if best_n <= min(full):  # the usual case: every row drafted at least L
            return [best_n] * len(full)
        return [min(best_n, m) for m in full]

    # -- after verify ------------------------------------------------------------------------

    def update(self, batch_size: int, accepted: Sequence[int], *, num_steps: int | Sequence[int] | None = None,
               ctx_len: float = 0, draft_s: float | None = None, verify_s: float | None = None,
               confidences: Sequence[Sequence[float]] | None = None) -> int:
        """Learn from one verify round; returns `choose_steps` for the same batch size and context.

        num_steps: K drafted (or drafts verified per request, after `verify_lengths` or an early
        stop); defaults to the slot's last `steps_for`. draft_s / verify_s: measured seconds.
        confidences: the head's confidence per draft per request, to calibrate.
        """
        i = self.adaptive.slot_index(batch_size)
        if num_steps is None:
            num_steps = self._last[i]
            if num_steps is None:
                raise ConfigError("num_steps: required until steps_for has been called for this batch size")
        if accepted:
            self._accept[i].observe(accepted, num_steps)
            if confidences is not None:
                self._calib.observe(confidences, accepted)
        if draft_s is not None or verify_s is not None:
            if isinstance(num_steps, int):
                self.cost.observe(batch_size, num_steps, ctx_len, draft_s, verify_s)
            else:
                self.cost.observe(batch_size, max(num_steps, default=0), ctx_len, draft_s, verify_s,
                                  verify_tokens=sum(num_steps) + len(num_steps))
        return self.choose_steps(batch_size, ctx_len)

    def rewarm(self) -> None:
        """A new head went live: acceptance and calibration are cut to a weak prior (or start over,
        `rewarm_keep_trials` 0), so the new head's rounds decide within a few; round costs are kept.
        Starting over cost the e2e runs of 2026-11-23 seconds at K = 1 after swaps: the 0.6 prior and
        the identity calibration of the head's confidences stopped drafting early."""
        for acc in self._accept:
            acc.soften(self.config.rewarm_keep_trials)
        self._calib.soften(self.config.rewarm_keep_trials)

    def info(self) -> dict:
        slots = {}  # read from other threads (status, progress lines): never through the engine's cache
        for slot, acc, last, n in zip(self._slots, self._accept, self._last, self._decisions):
            a = acc.fresh_estimates()
            slots[str(slot.min_batch_size)] = {
                "steps": last, "decisions": n, "accept": a,
                "expected_tokens": {str(k): self.expected_tokens(slot.min_batch_size, k, a)
                                    for k in slot.candidate_steps}}
        return {"policy": self.name, "slots": slots,
                "cost": {"draft_coef": list(self.cost.draft_coef), "verify_coef": list(self.cost.verify_coef),
                         "observations": self.cost.observations, "time_factors": self.cost.factors_info()}}

    def state_dict(self) -> dict:
        return {"policy": self.name, "cost": self.cost.state_dict(),
                "calibrator": {"hits": self._calib.hits[:], "trials": self._calib.trials[:]},
                "slots": {str(s.min_batch_size): {"rates": acc.rates[:], "seen": acc.seen[:],
                                                  "weight": acc.weight[:], "steps": last,
                                                  "decisions": n, "below": below}
                          for s, acc, last, n, below in zip(self._slots, self._accept, self._last, self._decisions,
                                                            self._below)}}

    def load_state_dict(self, state: dict) -> None:
        check(state.get("policy") == self.name, "state.policy", f"expected {self.name!r}, got {state.get('policy')!r}")
        saved = state.get("slots", {})
        want = [str(s.min_batch_size) for s in self._slots]
        check(sorted(saved) == sorted(want), "state.slots", f"has slots {sorted(saved)}, the config has {want}")
        for j, (key, acc) in enumerate(zip(want, self._accept)):
            entry = saved[key]
            check(len(entry["rates"]) == acc.depth, f'state.slots["{key}"].rates',
                  f"has {len(entry['rates'])} positions, the slot drafts up to {acc.depth}")
            acc.rates = [float(r) for r in entry["rates"]]
            acc.seen = [int(s) for s in entry["seen"]]
            acc.weight = [float(w) for w in entry.get("weight", [PRIOR_TRIALS] * acc.depth)]
            acc._filled = None
            self._last[j] = entry["steps"]
            self._decisions[j] = int(entry["decisions"])
            self._below[j] = int(entry.get("below", 0))  # states written before probing have none
        calib = state["calibrator"]
        check(len(calib["hits"]) == self._calib.bins, "state.calibrator.hits",
              f"has {len(calib['hits'])} bins, the config has {self._calib.bins}")
        self._calib.load(calib["hits"], calib["trials"])
        self.cost.load_state_dict(state["cost"])
