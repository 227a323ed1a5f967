"""Acceptance estimates: how many drafts a round of K will commit, before and after drafting.

In: per verify round, the drafts accepted per request (bonus excluded), the K (or per-request
verify lengths) used, and the head's confidence in each draft. Out: per-position acceptance
rates and the expected accepted drafts of K. Used by the cost policy (online_spec/controller/
cost.py) to price K, and by the trainer's swap gate (trainer/gate.py) to turn a candidate's
per-position acceptance into expected committed tokens. Pure arithmetic: no torch, no I/O.

- `AcceptanceEstimate` (one per batch-size slot): a_i = P(draft i accepted | drafts < i
  accepted), hits over trials with exponential forgetting per trial (a window of request-drafts,
  so one request at batch 1 moves it as little as one of 16 requests does), so the expected
  accepted drafts of K, sum_{i<=K} prod_{j<=i} a_j, is known before drafting
  (`expected_accepted`). Positions never tried borrow the deepest tried estimate to their left
  (`fill_untried`), which lets the policy look one tier deeper.
- `ConfidenceCalibrator`: maps the head's draft confidence to an acceptance probability
  (binned, starting at the identity), used once a round's drafts exist.
- `small_rows` / `confidence_array`: the two forms confidences take in the policy's in-round
  work (Python floats for small batches, where numpy's per-call cost dominates; arrays beyond).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PRIOR_TRIALS = 4.0  # the acceptance prior counts as this many trials: one lucky draft at a rarely
                    # tried position must not read as certainty (1/1 = 1.0 made K = 7 look free)


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


@dataclass(frozen=True)
class CalibrationTable:
    """Calibrated acceptance per confidence bin (`ConfidenceCalibrator.snapshot()`): a confidence
    c falls in bin floor(c * bins) in float64 (1.0 and above: the top bin, below 0 or NaN: the
    first). `lookup` repeats the top bin once more so `int(c * bins)` indexes it for 0 < c < 1
    without a clamp (c * bins rounds up to bins for c just below 1)."""

    lookup: list[float]
    values: np.ndarray

    @property
    def bins(self) -> int:
        return len(self.values)

    def __call__(self, confidence: float) -> float:
        c, n = float(confidence), len(self.values)
        return self.lookup[(int(c * n) if c < 1.0 else n - 1) if c > 0.0 else 0]

    def calibrated(self, confidences) -> np.ndarray:
        """The calibrated value of every element of an array of confidences."""
        # take(mode="clip") clamps the bin as it gathers (NaN casts to the smallest int64: bin 0)
        idx = (np.asarray(confidences, dtype=np.float64) * len(self.values)).astype(np.int64)
        return self.values.take(idx, mode="clip")

    def mean(self, confidences) -> float:
        """Mean calibrated value of a sequence or 1-D array of confidences (0 if empty). Small
        ones on Python floats: inside an engine round each numpy call costs several microseconds."""
        if len(confidences) <= SMALL_BATCH:
            row = confidences.tolist() if isinstance(confidences, np.ndarray) else confidences
            if not len(row):
                return 0.0
            tbl, n, total = self.lookup, len(self.values), 0.0
            for c in row:  # a sum in order (on Python 3.12 sum() compensates: the in-round rules add alike)
                total += tbl[int(c * n) if c < 1.0 else n - 1] if c > 0.0 else tbl[0]
            return total / len(row)
        vals = self.calibrated(confidences)
        return float(vals.sum()) / vals.size if vals.size else 0.0  # .sum() / size: np.mean costs more


class ConfidenceCalibrator:
    """Draft confidence -> P(accepted | earlier drafts accepted), per confidence bin.

    Each bin starts at its midpoint with `prior_weight` pseudo-observations (the identity map).
    A confidence (a probability) c falls in bin floor(c * bins) taken in float64 (1.0 and
    above: the top bin, below 0 or NaN: the first). Batches of more than `SMALL_BATCH` confidences go through numpy;
    smaller ones (batch 1-4 rounds, where speculation pays most) through Python floats: inside
    an engine round each numpy call costs several microseconds (measured: the calibrator's numpy
    calls were 70 of the ~150 us the cost policy spent in a batch-1 round of a tiny model,
    against ~17 us for the same calls in a hot loop; docs/controller.md).
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

    def lookup(self) -> list[float]:
        """`table` with the top bin repeated once more, indexed by `int(c * bins)` for 0 < c < 1
        without a clamp (c * bins rounds up to bins for c just below 1): the small-batch paths
        bin inline with it, a method call per confidence being most of their cost."""
        if self._ext is None:
            tbl = self.table()
            self._ext = tbl + tbl[-1:]
        return self._ext

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

    def snapshot(self) -> CalibrationTable:
        """The calibration as it stands, as an immutable table (kept until new observations)."""
        if self._snap is None:
            self._snap = CalibrationTable(self.lookup(), self._values())
        return self._snap

    def __call__(self, confidence: float) -> float:
        return self.snapshot()(confidence)

    def mean(self, confidences) -> float:
        """Mean calibrated value of a sequence or 1-D array of confidences (0 if empty)."""
        return self.snapshot().mean(confidences)

    def calibrated(self, confidences: np.ndarray) -> np.ndarray:
        """`self(c)` for every element of an array of confidences."""
        return self.snapshot().calibrated(confidences)

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
            hits, trials, n = self.hits, self.trials, self.bins
            for row, a in zip(rows, accepted):
                for i, c in enumerate(row[:a + 1]):
                    j = (int(c * n) if c < 1.0 else n - 1) if c > 0.0 else 0  # `bin` inline
                    if j == n:
                        j = n - 1
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
            # accepted); two boolean masks and two bincounts cost ~4 us more at b = 16
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
        self._ext: list[float] | None = None
        self._table: np.ndarray | None = None
        self._snap: CalibrationTable | None = None

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
