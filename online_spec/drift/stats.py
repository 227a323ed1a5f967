"""The drift monitor's statistics: the truncated-geometric accept length of a per-position
acceptance alpha at K drafts (its mean and SD), alpha fitted to observed means, and the
dispersion of groups of request-rounds against a reference alpha. Pure arithmetic.
"""

from __future__ import annotations

import math
from typing import Optional


def expected_accept_len(alpha: float, num_steps: int) -> float:
    """Mean accept length at K = num_steps when each draft is accepted with prob. alpha."""
    return sum(alpha ** i for i in range(1, num_steps + 1))


def accept_len_moments(alpha: float, num_steps: int) -> tuple[float, float]:
    """(mean, SD) of one request's accept length: P(j) = alpha^j (1 - alpha) for j < K, P(K) = alpha^K."""
    mean = sq = 0.0
    for j in range(num_steps + 1):
        p = alpha ** j * ((1.0 - alpha) if j < num_steps else 1.0)
        mean += j * p
        sq += j * j * p
    return mean, math.sqrt(max(sq - mean * mean, 0.0))


def fit_alpha(weight_by_k: dict[int, float], weighted_sum: float, start: Optional[float] = None) -> float:
    """Per-position acceptance whose expected accept length matches the observed weighted mean.

    Solves sum_K w_K * expected_accept_len(alpha, K) = weighted_sum (increasing in alpha) by
    Newton's method from `start` (the previous fit: a refining reference moves little, so one or
    two steps), kept inside a bracket that bisects where a step would leave it; clamped to
    [0.001, 0.999] so the model keeps a non-zero SD. A stream refits every round, where 50
    bisection steps cost ~100 us a round on this project's CPU.
    """
    lo, hi = 0.001, 0.999
    terms = [(int(k), w) for k, w in weight_by_k.items() if w]

    def value_slope(a: float) -> tuple[float, float]:
        f = df = 0.0
        for k, w in terms:
            p, total, slope = 1.0, 0.0, 0.0
            for i in range(1, k + 1):
                slope += i * p  # d/da a^i = i a^(i-1)
                p *= a
                total += p
            f += w * total
            df += w * slope
        return f, df

    if weighted_sum <= value_slope(lo)[0]:
        return lo
    if weighted_sum >= value_slope(hi)[0]:
        return hi
    a = start if start is not None and lo < start < hi else 0.5
    tol = 1e-13 * max(1.0, abs(weighted_sum))
    for _ in range(60):
        f, df = value_slope(a)
        err = f - weighted_sum
        if abs(err) <= tol:
            break
        if err > 0:
            hi = a
        else:
            lo = a
        step = a - err / df if df > 0 else lo - 1.0
        a = step if lo < step < hi else 0.5 * (lo + hi)
    return a


def group_sums(alpha: float, groups: list[dict]) -> tuple[float, float, float]:
    """(sum num^2, sum var, sum num^2 / var) over groups of request-rounds (each group: K -> [count,
    sum a]), num = sum_K (S1 - mu_K S0) and var = sum_K S0 sd_K^2 its variance when the group's
    request-rounds are independent draws of the model."""
    moments = {int(k): accept_len_moments(alpha, int(k)) for g in groups for k in g}
    num2 = var = ratios = 0.0
    for g in groups:
        num = sum(v[1] - moments[int(k)][0] * v[0] for k, v in g.items())
        gvar = sum(v[0] * max(moments[int(k)][1], 1e-6) ** 2 for k, v in g.items())
        num2 += num * num
        var += gvar
        ratios += num * num / gvar
    return num2, var, ratios


def group_dispersion(alpha: float, groups: list[dict], pooled: bool = False) -> float:
    """Variance inflation of sums over groups of request-rounds: the mean over groups of z^2,
    z = num / sqrt(var) (`group_sums`), which is 1 when the groups' request-rounds are independent
    draws of the model. `pooled`: the ratio of the sums instead (sum num^2 / sum var), which weighs
    a group by its size — for groups of very different sizes (requests of 3 and of 90 rounds),
    where a mean of ratios would let the short ones rule."""
    num2, var, ratios = group_sums(alpha, groups)
    return num2 / var if pooled else ratios / len(groups)


# --- per-stream state -------------------------------------------------------------------------
