"""The cost policy's decisions for one batch size, as a snapshot a round reads.

In: what `CostModelPolicy.plan(batch_size, ctx_len)` knows after the rounds it has learnt from.
Out: a `BatchPlan` — K for the next round, the terms of the in-round early-stop test per draft
step, the confidence calibration (`CalibrationTable`), the round-time terms of the verify-length
cut and its round seconds per K drafted and length kept (`plan_seconds`) — and the two in-round
rules run on it: `continue_on` (does one more draft step raise tokens per second?) and
`verify_cut` (how many drafts to verify). The policy itself runs the same two rules on its live
state, so there is one implementation of each; `tally_step` bins a draft step once for both.

A plan and its table never change once built (tuples, and a list and an array nothing writes
to), so one thread may build the next plan while another reads the current one: this is what
lets the policy's learning leave the engine's thread (serving/policy_planner.py). Pure
arithmetic: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from online_spec.controller.acceptance import SMALL_BATCH, CalibrationTable, confidence_array, small_rows

PADDED_PYTHON = 128  # confidences up to which a padded verify cut runs on Python floats (B 16 x K 8)


def continue_on(terms: tuple | None, draft_confidence, calib: CalibrationTable) -> bool:
    """After s drafts, the last with `draft_confidence` (a value, or one per request: their mean
    calibrated value p_last): is one more draft predicted to raise tokens per second? terms:
    (t_now, t_next - t_now, E and survival through the first s - 1 drafts, a_{s+1})
    (`CostModelPolicy._continue_terms`), None where one more draft never pays. The next draft
    adds P(drafts 1..s accepted) * a_{s+1} tokens per request and costs t_next - t_now.

    A list of up to `SMALL_BATCH` confidences (the engine's per-step probabilities) is binned
    inline: inside an engine round every call runs on cold caches, each costing microseconds."""
    if terms is None:
        return False
    if type(draft_confidence) is list and 0 < len(draft_confidence) <= SMALL_BATCH:
        tbl, n = calib.lookup, len(calib.values)
        total = 0.0  # `CalibrationTable.mean`, inline: a sum in order (`tally_step` adds alike)
        for c in draft_confidence:
            total += tbl[int(c * n) if c < 1.0 else n - 1] if c > 0.0 else tbl[0]
        p_last = total / len(draft_confidence)
    elif isinstance(draft_confidence, (int, float)):
        p_last = calib(draft_confidence)
    else:
        p_last = calib.mean(draft_confidence)
    return continue_p(terms, p_last)


def continue_p(terms: tuple | None, p_last: float) -> bool:
    """`continue_on` given the mean calibrated confidence of the last draft, p_last."""
    if terms is None:
        return False
    t_now, t_more, expected, surv, a_next = terms
    surv *= p_last
    expected += surv
    gain = surv * a_next
    # (E + gain) / t_next > E / t_now, cross-multiplied (both times are >= 0)
    return gain * t_now > expected * t_more


def tally_step(sv: list[float] | None, confidences: list[float], lookup: list[float],
               bins: int) -> tuple[list[float], float, float]:
    """One draft step's confidences (one per request, Python floats) binned once for both
    in-round rules, in one loop (each line of Python run inside an engine round runs on cold
    caches). sv: each row's survival through the steps before (None before the first), updated
    in place. Returns the rows' survivals through this step, their sum in row order (the padded
    verify cut's gain of this draft, added as `padded_cut_rows` adds it) and the mean
    calibrated value (`continue_on`'s p_last, summed as it sums)."""
    total = g = 0.0
    if sv is None:  # before the first step every row survives: 1.0 * p is p
        sv = [1.0] * len(confidences)
    i = 0
    for c in confidences:
        p = lookup[int(c * bins) if c < 1.0 else bins - 1] if c > 0.0 else lookup[0]
        total += p
        x = sv[i] * p
        sv[i] = x
        g += x
        i += 1
    return sv, g, total / len(confidences)


def continue_table(terms: tuple | None, calib: CalibrationTable) -> tuple | None:
    """`continue_on` for one request's confidence, by its calibration index: entry j is the
    verdict for every confidence whose lookup index (`CalibrationTable`'s binning) is j, for
    j = 0..bins (the last repeats the top bin), or None where one more draft never pays. Built
    by `continue_on` itself, on a confidence of each bin: a batch-1 early stop is then one
    index (`BatchPlan.go1`)."""
    if terms is None:
        return None
    n = len(calib.values)
    row = tuple(continue_on(terms, [(j + 0.5) / n], calib) for j in range(n))
    return row + row[-1:]


def padded_cut(gain: list[float], full: list[int], draft_s: float, base: float, per_token: float,
               v_extra: float = 0.0) -> list[int]:
    """One verify length L for every request (fewer where a row has fewer drafts): the L
    maximizing (b + sum_{m<=L} gain[m]) / (draft seconds + verify(b, L)); a tie keeps the
    longer L. gain[m]: the expected tokens the batch gains from verifying draft m + 1 (the
    sum over requests of the survivals S_rm, 0 past a row's last draft); full: each row's
    drafts; base, per_token: the verify line of `CostModel.verify_terms`; v_extra: a verify
    of drafts (L > 0) costs that much more than the line."""
    return best_common_length(gain, full, padded_seconds(len(gain), draft_s, base, per_token, v_extra))


def padded_seconds(k: int, draft_s: float, base: float, per_token: float, v_extra: float = 0.0) -> list[float]:
    """seconds[L], L = 0..k: the round's seconds when every request verifies L of its k drafts
    (draft seconds + verify(b, L), floored at 1e-12), what `best_common_length` divides by."""
    out = []
    for n in range(k + 1):
        v = base + per_token * (n + 1) + (v_extra if n else 0.0)
        out.append(max(draft_s + (v if v > 0.0 else 0.0), 1e-12))
    return out


def best_common_length(gain: list[float], full: list[int], seconds: list[float]) -> list[int]:
    """`padded_cut` given the round's seconds per common length (`padded_seconds`)."""
    best_n, best_rate, tokens = 0, -1.0, float(len(full))
    for n in range(len(gain) + 1):
        if n:
            tokens += gain[n - 1]
        rate = tokens / seconds[n]
        if rate >= best_rate:
            best_n, best_rate = n, rate
    if best_n <= min(full):  # the usual case: every row drafted at least L
        return [best_n] * len(full)
    return [min(best_n, m) for m in full]


def padded_cut_rows(rows: list[list[float]], lookup: list[float], bins: int, seconds: Sequence[float]) -> list[int]:
    """`padded_cut` of Python rows of confidences, k = len(seconds) - 1 drafts at most: the gain
    of draft m + 1 is gain[m] = sum_r S_rm, the survival S_rm = prod_{j<=m} p(conf_rj) with p the
    calibration (`CalibrationTable.lookup`; rows end at their length), summed over the rows in
    order, as numpy's column sums of the [B, k] survivals add them; seconds: `padded_seconds`."""
    gain, full = [0.0] * (len(seconds) - 1), []
    for row in rows:
        full.append(len(row))
        sv = 1.0
        for m, c in enumerate(row):
            sv *= lookup[int(c * bins) if c < 1.0 else bins - 1] if c > 0.0 else lookup[0]  # the bin, inline
            gain[m] += sv
    return best_common_length(gain, full, seconds)


def padded_rows(confidences) -> list[list[float]] | None:
    """The confidences of a padded verify cut as Python rows, or None for numpy's turn: up to
    `PADDED_PYTHON` confidences, and a one-draft batch up to `SMALL_BATCH` (numpy sums a single
    column in blocks of eight, rows in order otherwise, and the cut must add as it does)."""
    if isinstance(confidences, np.ndarray) and confidences.ndim == 2:
        b, k = confidences.shape
        if b * k > PADDED_PYTHON or (k == 1 and b > SMALL_BATCH):
            return None
        return confidences.tolist()
    return small_rows(confidences)


def verify_cut(confidences, calib: CalibrationTable, terms: tuple, verify_token_s: float, *,
               padded: bool = False, keep_all: bool = False) -> list[int]:
    """Drafts to verify per request (AdaSpec's confidence-prior verifier): keep draft m of
    request r while its survival S_rm = prod_{j<=m} p(conf_rj) pays for its verify token at the
    round's throughput, S_rm >= (expected tokens / round seconds) * (seconds per verified
    token). Drafting is already spent; only verify tokens are saved. terms: the round's
    `CostModel.round_terms`; keep_all: verify every draft (a probe round).

    padded: the verify forward runs every request at the longest kept length (the embedded
    engine's batch is rectangular), so a request cut shorter than the longest saves nothing
    and only loses drafts; then one common length is chosen for the whole batch
    (`padded_cut`). Per-request lengths pay only where the verify packs ragged rows."""
    rows = padded_rows(confidences) if padded else None  # a padded batch up to B 16 x K 8: Python floats
    if rows is not None:
        full = [len(r) for r in rows]
        b, k = len(rows), max(full, default=0)
    else:
        conf, lens = confidence_array(confidences)
        b, k = conf.shape
        full = [k] * b if lens is None else lens.tolist()
    if b == 0:
        return []
    if k == 0 or verify_token_s <= 0 or keep_all:
        return full
    step_s, base, per_token, d_extra, v_extra = terms
    draft_s = max(0.0, k * step_s + d_extra)  # already spent, part of the round
    if rows is not None:
        return padded_cut_rows(rows, calib.lookup, calib.bins, padded_seconds(k, draft_s, base, per_token, v_extra))
    # survival S_rm = prod_{j<=m} p(conf_rj), 0 past a row's last draft
    surv = calib.calibrated(conf).cumprod(axis=1)  # the method: np.cumprod's dispatch costs ~1 us more
    if lens is not None:
        surv[np.arange(k) >= lens[:, None]] = 0.0
    if padded:
        return padded_cut(surv.sum(axis=0).tolist(), full, draft_s, base, per_token, v_extra)
    # S_rm never rises along a row, so every throughput threshold keeps a prefix of each row,
    # and the rows' kept drafts together are the largest survivals of the batch: sort them once
    # and scan the cut (the Dinkelbach fixed point is the best cut, and on a tie it keeps the
    # equal drafts too).
    flat = np.sort(surv[surv > 0.0] if lens is not None else surv.ravel())[::-1].tolist()
    v0 = base + per_token  # verify with no draft kept: one token per request
    best_m, best_rate, tokens = 0, b / max(draft_s + max(0.0, v0), 1e-12), float(b)
    for m, sv in enumerate(flat, 1):
        tokens += sv
        if m < len(flat) and flat[m] == sv:
            continue  # a cut between equal survivals keeps them all
        rate = tokens / max(draft_s + max(0.0, v0 + v_extra + verify_token_s * m), 1e-12)
        if rate >= best_rate:
            best_m, best_rate = m, rate
    if best_m == len(flat):
        return full
    if best_m == 0:
        return [0] * b
    return (surv >= flat[best_m - 1]).sum(axis=1).tolist()


def plan_seconds(terms: tuple, depth: int) -> tuple:
    """seconds[k][L] (`padded_seconds`) of a round that drafted k = 0..depth, from its round
    terms: the padded verify cut of a plan divides by them without recomputing the line."""
    step_s, base, per_token, d_extra, v_extra = terms
    return tuple(tuple(padded_seconds(k, max(0.0, k * step_s + d_extra), base, per_token, v_extra))
                 for k in range(depth + 1))


@dataclass(frozen=True)
class BatchPlan:
    """The cost policy's decisions for one batch size, from the rounds it had learnt from when
    `CostModelPolicy.plan` built it."""

    batch_size: int
    ctx_len: float
    steps: int
    """K for the round (`choose_steps`), before the probe schedule."""
    stops: tuple
    """stops[s - 1]: the `continue_on` terms after s drafts, or None where one more never pays."""
    calib: CalibrationTable
    terms: tuple
    """`CostModel.round_terms` of this batch size and context."""
    verify_token_s: float
    plain_round_s: float
    """Predicted seconds of a round at K = 0 (what the drift monitor compares drafting with)."""
    seconds: tuple = ()
    """`plan_seconds(terms, depth)`: the padded verify cut's round seconds per K drafted and
    length kept (a K beyond them takes `verify_cut`'s own arithmetic)."""
    go1: tuple = ()
    """go1[s - 1]: `continue_table(stops[s - 1], calib)`, the early stop after s drafts for a
    batch of one, by the confidence's lookup index (empty: not built)."""

    def continue_one(self, step_index: int, confidence: float) -> bool:
        """`should_continue` of one request's confidence, by `go1` (which must be built)."""
        go1 = self.go1
        row = go1[step_index - 1] if step_index <= len(go1) else None
        if row is None:
            return False
        n = len(row) - 1  # the bins
        return row[int(confidence * n) if confidence < 1.0 else n - 1] if confidence > 0.0 else row[0]

    def should_continue(self, step_index: int, draft_confidence: float | Sequence[float]) -> bool:
        """`CostModelPolicy.should_continue` on this plan (outside a probe round)."""
        stops = self.stops
        return continue_on(stops[step_index - 1] if step_index <= len(stops) else None, draft_confidence,
                           self.calib)

    def verify_lengths(self, confidences, *, padded: bool = False, keep_all: bool = False) -> list[int]:
        """`CostModelPolicy.verify_lengths` on this plan: the engine's padded cut of up to
        `PADDED_PYTHON` confidences by `padded_lengths`, any other by `verify_cut`."""
        if padded and not keep_all and type(confidences) is np.ndarray and confidences.ndim == 2:
            cut = self.padded_lengths(confidences)
            if cut is not None:
                return cut
        return verify_cut(confidences, self.calib, self.terms, self.verify_token_s, padded=padded,
                          keep_all=keep_all)

    def tallied_lengths(self, confidences: np.ndarray, sv: list[float] | None, gain: list[float]) -> list[int] | None:
        """`padded_lengths` of the engine's [B, K] array whose first len(gain) columns the early
        stop has binned already (`tally_step`: sv, the rows' survivals through them, gain, their
        sums): at most one column is left to bin. None where `padded_lengths` would return None
        or the tally does not cover the array's first K - 1 columns."""
        b, k = confidences.shape
        seconds, done = self.seconds, len(gain)
        if not (done and sv is not None and len(sv) == b and k - 1 <= done <= k and 0 < k < len(seconds)
                and b * k <= PADDED_PYTHON) or self.verify_token_s <= 0:
            return None
        if done < k:  # the last draft's column: one numpy call (each costs microseconds in a round)
            lookup, last = self.calib.lookup, k - 1
            column = [row[last] for row in confidences.tolist()]
            gain = gain + [tally_step(sv, column, lookup, len(lookup) - 1)[1]]
        return best_common_length(gain, [k] * b, seconds[k])

    def padded_lengths(self, confidences: np.ndarray) -> list[int] | None:
        """The padded verify cut of the engine's [B, K] array (`verify_cut(padded=True)` outside a
        probe) on the plan's round seconds (`best_common_length`), or None where `verify_cut`
        must run it: more than `PADDED_PYTHON` confidences, a K beyond the plan's seconds, no
        verify cost. A batch of one runs in this frame: its gain per draft is its survival."""
        b, k = confidences.shape
        seconds = self.seconds
        if not (b and 0 < k < len(seconds) and b * k <= PADDED_PYTHON and (k > 1 or b <= SMALL_BATCH)) \
                or self.verify_token_s <= 0:
            return None
        lookup = self.calib.lookup
        n, seconds = len(lookup) - 1, seconds[k]  # the bins; the round's seconds per length kept
        if b > 1:
            return padded_cut_rows(confidences.tolist(), lookup, n, seconds)
        best, best_rate, tokens, sv = 0, 1.0 / seconds[0], 1.0, 1.0  # `best_common_length` of one row
        for m, c in enumerate(confidences.tolist()[0], 1):
            sv *= lookup[int(c * n) if c < 1.0 else n - 1] if c > 0.0 else lookup[0]
            tokens += sv
            rate = tokens / seconds[m]
            if rate >= best_rate:
                best, best_rate = m, rate
        return [best]
