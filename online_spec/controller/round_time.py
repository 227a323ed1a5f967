"""The round-time model of the cost policy: predicted seconds of a round's draft and verify.

In: measured rounds (batch size, K, mean context length, draft seconds, verify seconds), from the
engine's calibration (serving/calibrate.py) and then from every round served. Out: predicted
draft, verify and whole-round seconds for any (batch size, K, context length). Pure arithmetic:
no torch, no I/O.

`CostModel` fits, by least squares, the draft phase, K * (1, b, b*ctx) + [K > 0] * (1, b), and
the verify, (1, b, b*n, b*ctx, b*[n > 1]) with n = K + 1 tokens verified per request and ctx in
thousands of tokens. The [K > 0] terms are what entering speculation costs once a round whatever
K: the first draft comes out of the draft cache's catch-up, a forward dearer than a later step,
and a verify of n > 1 tokens is dearer than a plain decode step (on an H100 at batch 1: catch-up
+ first draft 0.72 ms, each later step 0.35 ms; verify 3.2 ms at n = 1, 3.9-4.1 ms at n = 2-5;
a model linear in K through 0 mispriced both and chose too little K). The calibration (`fit`) is
an anchor that never decays, the rounds served refine it with exponential forgetting, and a
prior holds where neither says anything. What the line cannot fit is corrected by a measured
factor per (batch-size bucket, K) (`time_factors`): the rounds of that batch and K measured
against the line's prediction for them.

    model = CostModel().fit(points)                  # points: (b, K, ctx, draft_s, verify_s)
    model.observe(b, k, ctx, draft_s, verify_s)      # every round served
    model.predict_round_s(b, k, ctx)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from online_spec.config import check, doc

CTX_SCALE = 1000.0  # context length enters the model in thousands of tokens (conditioning)
FACTOR_RANGE = (0.25, 4.0)  # a time factor outside it is a broken measurement, not a misfit of the line


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
    decaying and adding them one at a time gives, up to rounding): decaying the 5x5 sums entry by
    entry in Python on every observation costs ~3.5 us each, two a round (docs/controller.md).
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
        self._rows = [tuple(float(x) for x in r) for r in state.get("rows", [])]  # absent: a state stored folded
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
        self._reference = list(self._verify.prior)  # `reference_round_s`'s coefficients
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
        model._reference = model.verify_coef[:]
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
        self._reference = self.verify_coef[:]
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
        for every batch size and K misses CPU rounds by 7-18 % in the median, and by more where it
        matters (at batch 16 it prices K = 1 at 1.6x a plain round, measured 1.32x, which made the
        policy run plain decode where K = 1 paid; docs/controller.md). A
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

    def reference_round_s(self, batch_size: float, ctx_len: float = 0) -> float:
        """Seconds of a plain round at this batch and context by the line as the calibration left
        it (`fit`, `with_coefficients`; the prior's before either), never refitted: a yardstick
        that scales with batch and context and stays put in time, so rounds measured minutes apart
        compare (the tree choice's time multiples). The live prediction drifts as the rounds
        refit it: in an H100 e2e run with a trainer beside the server it rose 86 % at batch 4 in
        15 s, and the chain's rounds, measured after, read 0.59x the trees' time (measured before)
        against it where they took 0.75x. A negative context slope (a misfit)
        is not followed; a line at or below zero gives the prior's verify seconds."""
        c0, c1, c2, c3, _ = self._reference
        s = c0 + (c1 + c2) * batch_size + max(0.0, c3) * batch_size * ctx_len / CTX_SCALE
        return s if s > 0 else self.config.prior_verify_s

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
                "reference_coef": self._reference[:],
                "tally": {f"{b}:{k}": t[:] for b, per_k in self._tally.items() for k, t in per_k.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._draft.load_state_dict(state["draft"])
        self._verify.load_state_dict(state["verify"])
        self.draft_coef = [float(c) for c in state["draft_coef"]]
        self.verify_coef = [float(c) for c in state["verify_coef"]]
        # a state written before the reference: the loaded line, from now on
        self._reference = [float(c) for c in state.get("reference_coef", self.verify_coef)]
        check(len(self._reference) == 5, "state.reference_coef", f"needs 5 values, got {len(self._reference)}")
        self._pending = int(state["pending"])
        self._tally = {}
        for key, sums in state.get("tally", {}).items():  # states written before the time factors have none
            b, k = (int(x) for x in key.split(":"))
            check(len(sums) == 7, f"state.tally[{key!r}]", f"needs 6 sums and a round count, got {len(sums)}")
            self._tally.setdefault(b, {})[k] = [float(x) for x in sums]
