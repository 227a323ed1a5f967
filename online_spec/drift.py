"""The drift monitor: a pure policy that turns per-round acceptance into alerts.

In: one `RoundObservation` per speculative round (batch-size slot, traffic tag, the round's
mean `accept_len` — drafts accepted per request, bonus excluded, averaged over the requests of
the round — its `num_steps` K, the head version that drafted, a timestamp, and optionally the
measured tokens/s with speculation and the plain-decode estimate). Out: a list of `DriftAlert`
(usually empty), which the caller hands to the sinks of `online_spec.alerts`. No I/O, no torch,
no clock: the detector only reads what it is given, so it is replayable and deterministic.

State is kept per stream, a stream being one (slot, tag) pair. Each slot also has a **mix
stream** (tag `MIX_TAG` = "*", fed by `round_observations` with every round's whole batch): drift is
a change in the *mix* of traffic over time (ARCHITECTURE.md), and a stream per tag cannot see one —
chat turning into code under the tags `chat` / `code` leaves the chat stream idle and gives the
code stream a level of its own, while the slot's acceptance has fallen. A tag's own stream starts
once its slot has carried a second tag (before, it would be the mix stream's twin and cost a second
stream per round for nothing), and one change is said once per slot: an alert of a kind that the
other side (mix stream vs tag streams) raised on the slot within `cooldown_rounds` of the mix
stream's rounds is not repeated (tag streams among themselves are not merged: `chat` dropped and
`code` dropped are two facts). A mix stream's alert names the slot's tag while it has had only one
(it is that tag's stream), and "all traffic" (tag '*') once it has had two. Per stream four rules run:

- **drop / rise** (level "warn" / "info"): a two-sided CUSUM on the log-likelihood ratio of a
  mean shift. Why this normalisation: the raw accept length depends on K (the step controller
  changes K) and its noise on the batch size, so neither the raw value nor `accept_len / K` has
  a level that stays put when K or the batch moves. Instead the reference is a per-position
  acceptance `alpha`, fitted so that `sum_i alpha**i` (i = 1..K, the mean of the
  truncated-geometric accept length) matches the observed mean. Each round is standardised
  against the reference's mean and SD *at that round's K*: r = (accept_len - mu_K) / sd_K, and
  weighted by its number of requests w, capped at `max_round_weight` (the requests of a batch
  stay together for many rounds, so a big batch is fewer independent samples than its size).
  The SD is inflated by a dispersion factor measured on the reference rounds (never below 1),
  for traffic noisier than the model: the largest of the per-round one, a batch-means one
  (standardised sums over blocks of `block_rounds` rounds) and, where rounds carry request ids
  and per-request counts (the server's do), a request-cluster one (standardised sums over each
  request's own rounds, pooled). Rounds are not independent — a request lives for tens of
  rounds and an easy prompt stays easy — so per-round noise alone understates how far the
  level wanders (on the real server this raised a +35% "rise" on stationary ShareGPT traffic);
  blocks of fixed length understate it too once requests outlive a block or overlap eight to a
  round (the real server at 8 clients: block dispersion 1.07, request clusters ~5, and a false
  +47% "rise"). Requests are the independent units, so the cluster estimate is the inflation
  of a sum over rounds whatever the batch or the answer length, with as many samples as
  requests. The change test waits until the reference has 4 blocks.
  The increment per round is `w * d * (r - d/2)`, d the minimum effect (`min_effect` of the reference mean, at least `min_effect_abs` drafts) in SD
  units: Page's CUSUM, with `threshold` in nats (`rise_threshold` for a rise). A chance
  excursion falls back to zero; a sustained shift of D SDs crosses the threshold after about
  `threshold / (w d (D - d/2))` rounds. Measured with the defaults (8 / 16 nats) on independent
  rounds (2.6 -> 1.6 at K=5, 20 seeds): mean 57 rounds at B=1, 14 at B=4, 9 at B=16; on
  stationary model noise, 3 false drops in 60 runs of 3,000 rounds at B=4 (0 at B=1; at 13
  nats: 2 in 300). On real traffic — recorded requests of the real server resampled into
  runs (`scripts/drift_bootstrap.py`, docs/server.md) — 0 false alerts in 200 runs, and the
  ShareGPT -> HumanEval drop (1.37 -> 0.89) found after a median 124 rounds at B=8: the
  thresholds were chosen there, where the noise is the traffic's and not the model's.
  (Those figures are for independent rounds; with persistent requests, tests/test_drift.py's
  `persistent_rounds`, a 1.26 -> 0.39 drop at B=4 takes ~470 rounds: the honest price.)
  The reference is learned over a warm-up (`warmup_rounds` and `warmup_requests`) and then
  keeps absorbing rounds in which no change is suspected (both statistics below half the
  threshold) until it holds `reference_requests` requests and 4 blocks — a self-starting CUSUM, so a short
  warm-up does not leave a biased reference for good. A change during the warm-up becomes part
  of the reference (collapse still catches the extreme case). After a change alert the stream
  re-learns its reference (the new level is the new normal) and raises no further change alert
  for `cooldown_rounds`. A re-learn (after a change, or a head swap below) keeps the request
  clusters of the old reference, each standardised against its own level, and pools them into the
  new reference's noise; with `NOISE_MIN_REQUESTS` of them the change test runs right after the
  warm-up instead of after 4 new blocks: the noise is mostly the traffic's (how much its requests
  differ), and with a swap every 20-40 s (the demo's trainer) a stream that needed 4 new blocks
  after each swap had its test running a few seconds in every thirty.
- **collapse** (level "error"): the mean accept length over the last `collapse_window` rounds
  with K > 0 is below `collapse_accept_len` — speculation is pure overhead. Needs no warm-up.
  Where rounds carry request ids (the server's do) the window reaches back until it also spans
  `collapse_min_requests` requests: at batch 1 twenty rounds are one request, and on the real
  server single HumanEval tasks on which a head accepted nothing raised two false collapses in
  2,000 stationary rounds.
- **losing** (level "warn"): over the last `losing_window` rounds with K > 0 and both speeds
  measured, tokens/s with speculation is below `(1 - losing_margin)` of plain decoding.
  Collapse and losing fire once and re-arm when their condition clearly clears — the window
  mean back to at least twice `collapse_accept_len`, or speculation back at parity with plain
  decoding — so a window mean wandering around the threshold by chance does not alert again
  at every crossing; and only once `cooldown_rounds` have passed.
- A **head version change** re-warms the stream (`_Stream.rewarm`): the change test's
  reference level and CUSUM, and the collapse and losing windows, restart on the new head's rounds
  only (its acceptance is a new baseline, so a swap never raises a rise by itself, and no window
  mixes two heads). Until the new level can be tested (the warm-up), the old head's reference
  stands in for **drops** — lowered by `HANDOVER_Z` = 2 of its own standard errors, because a
  level learned over the few hundred rounds between two swaps is not exact (on recorded real
  requests at batch 8, handing it over as it was raised 5 false drops in 30 runs of 4,000
  rounds with a swap every 200; lowered, none) — and a drop under way before the swap goes on
  being tested: a trainer that swaps every few hundred rounds would otherwise leave the test
  blind most of the time (a chat -> code shift with a swap every 300 rounds, batch 8: found in
  2 runs of 20 without the hand-over, 6 with it; 20 of 20 without swaps). So a swap to a head
  that accepts clearly less than the old one did on the same traffic is reported as a drop — the
  gate publishes only heads it measured better, and acceptance that falls anyway is what the
  monitor is for. What the stream has already reported stays: a rule's latch and
  cool-down carry over, so a condition that was alerted under the old head and persists under
  the new one (a weak head replaced by a still-weak one) is not reported again because a
  version went live. A new head that collapses where the old one did not is still reported.

Use (in the engine, once per round, after accept):

    detector = DriftDetector(DriftConfig())
    for alert in detector.update(RoundObservation(slot=8, tag="code", accept_len=2.1,
                                                  num_steps=5, head_version=3, timestamp=t,
                                                  num_requests=6)):
        fan_out(alert, sinks)
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Optional

from online_spec.config import check, doc


@dataclass
class DriftConfig:
    """Settings of `DriftDetector`; defaults calibrated in tests/test_drift.py."""

    warmup_rounds: int = doc("rounds (with K > 0) a stream observes before its reference is fixed", 100)
    warmup_requests: int = doc("requests (sum of batch sizes) a stream observes before its reference is fixed", 400)
    reference_requests: int = doc("requests after which the reference stops being refined (after the "
                                  "warm-up it keeps absorbing rounds in which no change is suspected): "
                                  "request-rounds, ~400 requests of ~40 rounds; the level and the noise "
                                  "of traffic whose requests differ this much need that many", 16000)
    min_effect: float = doc("smallest change of the mean accept length, relative to the reference, "
                            "that the change test is tuned to", 0.3)
    min_effect_abs: float = doc("floor on that effect in drafts, so a near-zero reference does not "
                                "make tiny changes count", 0.1)
    large_effect: float = doc("a second CUSUM pair is tuned to this change of the mean accept length, "
                              "relative to the reference (0 = off): a CUSUM tuned to the minimum effect "
                              "gains only d(D - d/2) per round on a shift of D >> d, so a collapse-sized "
                              "drop took ~950 rounds at batch 1; tuned to D it gains ~D^2/2", 0.6)
    max_round_weight: int = doc("most requests a round counts for in the change test: requests of one "
                                "batch stay together for many rounds, so a big batch is less than that "
                                "many independent samples", 8)
    block_rounds: int = doc("rounds per block of the batch-means dispersion: consecutive rounds share "
                            "their requests (a request lives for tens of rounds), so the reference's noise "
                            "is also measured on block means, about a request's lifetime long", 50)
    threshold: float = doc("CUSUM decision threshold of a drop, in nats; higher = fewer false alarms, "
                           "slower detection. 8 is chosen for rounds that carry request ids and counts "
                           "(the server's); a caller without them gets the block noise estimate only "
                           "and should use 13", 8.0)
    rise_threshold: float = doc("CUSUM decision threshold of a rise, in nats (0 = the drop threshold): "
                                "acceptance per request is skewed upwards (an easy, repetitive prompt "
                                "accepts everything for its whole life), so a chance excursion up is "
                                "larger than one down and a rise, an 'info' alert, can wait longer", 16.0)
    cooldown_rounds: int = doc("rounds after an alert during which the stream raises no alert of the "
                               "same rule", 200)
    collapse_accept_len: float = doc("mean accept length below which the window counts as a collapse", 0.1)
    collapse_window: int = doc("rounds with K > 0 over which collapse is judged (at least)", 20)
    collapse_min_requests: int = doc("distinct requests the collapse window must span, when rounds carry "
                                     "request ids: at batch 1, 20 rounds are one request, and one hard "
                                     "prompt is not a collapse of the head (the window grows back until it "
                                     "spans them, up to 32 x collapse_window rounds)", 3)
    losing_margin: float = doc("speculation is losing when its tokens/s is below (1 - margin) x plain "
                               "decoding", 0.05)
    losing_window: int = doc("rounds with both speeds measured over which losing is judged", 50)
    max_streams: int = doc("most (slot, tag) streams kept; the least recently seen is dropped", 256)
    mix_streams: bool = doc("per slot, a stream of all its traffic whatever the tags (tag '*'), which sees a "
                            "change in the mix of tags; off: observations tagged '*' are ignored and every tag "
                            "has its own stream from its first round", True)

    def __post_init__(self) -> None:
        check(self.warmup_rounds >= 2, "warmup_rounds", f"must be >= 2, got {self.warmup_rounds}")
        check(self.warmup_requests >= 1, "warmup_requests", f"must be >= 1, got {self.warmup_requests}")
        check(self.reference_requests >= self.warmup_requests, "reference_requests",
              f"must be >= warmup_requests ({self.warmup_requests}), got {self.reference_requests}")
        check(0.0 < self.min_effect < 1.0, "min_effect", f"must be in (0, 1), got {self.min_effect}")
        check(self.min_effect_abs > 0.0, "min_effect_abs", f"must be > 0, got {self.min_effect_abs}")
        check(self.max_round_weight >= 1, "max_round_weight", f"must be >= 1, got {self.max_round_weight}")
        check(self.block_rounds >= 2, "block_rounds", f"must be >= 2, got {self.block_rounds}")
        check(self.threshold > 0.0, "threshold", f"must be > 0, got {self.threshold}")
        check(self.rise_threshold >= 0.0, "rise_threshold", f"must be >= 0 (0 = threshold), got {self.rise_threshold}")
        check(self.cooldown_rounds >= 0, "cooldown_rounds", f"must be >= 0, got {self.cooldown_rounds}")
        check(0.0 <= self.large_effect < 1.0, "large_effect", f"must be in [0, 1), got {self.large_effect}")
        check(self.collapse_accept_len >= 0.0, "collapse_accept_len",
              f"must be >= 0, got {self.collapse_accept_len}")
        check(self.collapse_window >= 1, "collapse_window", f"must be >= 1, got {self.collapse_window}")
        check(self.collapse_min_requests >= 1, "collapse_min_requests",
              f"must be >= 1, got {self.collapse_min_requests}")
        check(0.0 <= self.losing_margin < 1.0, "losing_margin", f"must be in [0, 1), got {self.losing_margin}")
        check(self.losing_window >= 1, "losing_window", f"must be >= 1, got {self.losing_window}")
        check(self.max_streams >= 1, "max_streams", f"must be >= 1, got {self.max_streams}")


@dataclass(frozen=True)
class RoundObservation:
    """What one speculative round tells the monitor. `accept_len` excludes the bonus token."""

    slot: int
    tag: str
    accept_len: float
    num_steps: int
    head_version: int
    timestamp: float
    spec_tokens_per_s: Optional[float] = None
    plain_tokens_per_s: Optional[float] = None
    num_requests: Optional[int] = None  # requests averaged into accept_len; None = the slot
    request_ids: Optional[tuple] = None  # ids of those requests, for the collapse window's span
    accepted: Optional[tuple] = None  # each request's accepted drafts, aligned with request_ids
    opens_round: bool = True  # False: another observation of the same round (round_observations' tags)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.num_steps < 0:
            raise ValueError(f"num_steps: must be >= 0, got {self.num_steps}")
        if not (math.isfinite(self.accept_len) and 0.0 <= self.accept_len <= self.num_steps):
            raise ValueError(f"accept_len: must be in [0, num_steps={self.num_steps}], got {self.accept_len}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if self.accepted is not None:
            if self.request_ids is None or len(self.accepted) != len(self.request_ids):
                raise ValueError("accepted: needs request_ids of the same length (one count per request)")
            if not all(0 <= a <= self.num_steps for a in self.accepted):
                raise ValueError(f"accepted: each count must be in [0, num_steps={self.num_steps}], got {self.accepted}")
        for name in ("spec_tokens_per_s", "plain_tokens_per_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name}: must be finite and >= 0, got {v}")

    @property
    def weight(self) -> int:
        return self.num_requests if self.num_requests is not None else max(1, self.slot)


@dataclass
class DriftAlert:
    """One alert, ready for a sink; `before`/`after` are mean accept lengths (bonus excluded)."""

    kind: str  # "drop" | "rise" | "collapse" | "losing"
    level: str  # "warn" | "error" | "info"
    slot: int
    tag: str
    before: float
    after: float
    head_version: int
    round: int  # index of the round that raised it (0-based count of observations that open a round)
    time: float  # the round's timestamp
    title: str
    text: str

    def to_dict(self) -> dict:
        return asdict(self)


MIX_TAG = "*"  # the tag of a slot's mix stream: every request of its rounds, whatever their tags
MIX_TAG_RESERVED = f"tag {MIX_TAG!r} is reserved: it names the drift monitor's all-traffic stream (a slot's mix stream)"
COLLAPSE_SPAN = 32  # the collapse window may grow to this many times collapse_window rounds
MIN_BLOCKS = 4  # block means the reference needs before the change test runs (fewer: too noisy)
NOISE_MIN_REQUESTS = 32  # or request clusters, this reference's and earlier ones' (a re-warmed stream)
NOISE_MEMORY = 2000  # request clusters of earlier references kept (beyond, the oldest halve)
HANDOVER_Z = 2.0  # a handed-over level is lowered by this many of its standard errors


# --- the truncated-geometric model of one request's accept length ----------------------------

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


def round_observations(batch_size: int, num_steps: int, accepted, tags, request_ids, head_version: int,
                       timestamp: float, spec_tokens_per_s: Optional[float] = None,
                       plain_tokens_per_s: Optional[float] = None) -> list[RoundObservation]:
    """One verify round of a server as the detector's observations: first the whole round (tag
    `MIX_TAG`, the slot's mix stream), then one per traffic tag present; slot = the round's batch
    size, accept_len = the mean over the requests (bonus excluded). The server (live) and
    `online-spec drift replay` (recorded rounds) both use this, so a recorded round replays to the
    observations the live detector saw. Rounds with K = 0 or no requests give none."""
    if num_steps == 0 or not accepted:
        return []
    by_tag: dict[str, list[tuple[int, str]]] = {MIX_TAG: list(zip(accepted, request_ids))}
    for a, tag, rid in zip(accepted, tags, request_ids):
        if tag == MIX_TAG:
            raise ValueError(f"tags: {MIX_TAG_RESERVED}")
        by_tag.setdefault(tag, []).append((a, rid))
    out = []
    for tag, rows in by_tag.items():
        acc, ids = zip(*rows)
        out.append(RoundObservation(slot=batch_size, tag=tag, accept_len=sum(acc) / len(acc), num_steps=num_steps,
                                    head_version=head_version, timestamp=timestamp,
                                    spec_tokens_per_s=spec_tokens_per_s, plain_tokens_per_s=plain_tokens_per_s,
                                    num_requests=len(acc), request_ids=ids, accepted=acc, opens_round=not out))
    return out


def _group_sums(alpha: float, groups: list[dict]) -> tuple[float, float, float]:
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


def _group_dispersion(alpha: float, groups: list[dict], pooled: bool = False) -> float:
    """Variance inflation of sums over groups of request-rounds: the mean over groups of z^2,
    z = num / sqrt(var) (`_group_sums`), which is 1 when the groups' request-rounds are independent
    draws of the model. `pooled`: the ratio of the sums instead (sum num^2 / sum var), which weighs
    a group by its size — for groups of very different sizes (requests of 3 and of 90 rounds),
    where a mean of ratios would let the short ones rule."""
    num2, var, ratios = _group_sums(alpha, groups)
    return num2 / var if pooled else ratios / len(groups)


# --- per-stream state -------------------------------------------------------------------------

@dataclass
class _Side:
    """One side of the CUSUM plus the rounds of its current excursion (the change estimate)."""

    stat: float = 0.0
    w: float = 0.0  # requests in the excursion
    sum_a: float = 0.0  # sum of weight * accept_len
    sum_mu: float = 0.0  # sum of weight * reference mean at the round's K

    def add(self, inc: float, w: float, a: float, mu: float) -> None:
        self.stat = max(0.0, self.stat + inc)
        if self.stat == 0.0:
            self.w = self.sum_a = self.sum_mu = 0.0
        else:
            self.w += w
            self.sum_a += w * a
            self.sum_mu += w * mu


@dataclass
class _Stream:
    head_version: int
    rounds: int = 0  # rounds seen with K > 0 since the last reset
    # Reference sums per K (JSON keys are strings): [rounds, requests, sum w*a, sum w*a^2].
    ref: dict = field(default_factory=dict)
    alpha: Optional[float] = None
    prev_alpha: Optional[float] = None  # the reference before the last re-learn, for alert texts
    dispersion: float = 1.0
    # The request clusters of earlier references (before re-learns), each against its own level:
    # [sum num^2, sum var, requests] (`_group_sums`), the noise of the traffic across swaps.
    noise: list = field(default_factory=lambda: [0.0, 0.0, 0])
    # [alpha, dispersion, relative shift] of the previous head's reference while the new head's
    # warms up after a swap: the change test goes on against it, lowered by its uncertainty, for
    # drops only (`rewarm`)
    handover: Optional[list] = None
    # Batch means of the reference rounds, per K: [requests, sum w*a]; `block` is the one filling.
    blocks: list = field(default_factory=list)
    block: dict = field(default_factory=dict)
    block_len: int = 0
    # The reference's request-rounds grouped by request (where rounds carry ids and per-request
    # counts), per K: [rounds, sum a]: the cluster-robust dispersion.
    requests: dict = field(default_factory=dict)
    up: _Side = field(default_factory=_Side)
    down: _Side = field(default_factory=_Side)
    up_large: _Side = field(default_factory=_Side)  # the pair tuned to `large_effect`
    down_large: _Side = field(default_factory=_Side)
    last_alert: dict = field(default_factory=dict)  # rule -> stream round of its last alert
    latched: dict = field(default_factory=dict)  # rule -> True while its condition persists
    collapse: deque = field(default_factory=deque)  # (accept_len, request ids or None) of recent rounds
    losing: deque = field(default_factory=deque)  # (spec, plain) tokens/s of recent rounds

    def ref_totals(self) -> tuple[int, float]:
        return (sum(int(v[0]) for v in self.ref.values()), sum(v[1] for v in self.ref.values()))

    def relearn(self) -> None:
        self.prev_alpha = self.alpha if self.alpha is not None else self.prev_alpha
        if self.alpha is not None and self.requests:  # the traffic's noise outlives the level
            num2, var, _ = _group_sums(self.alpha, list(self.requests.values()))
            self.noise = [self.noise[0] + num2, self.noise[1] + var, self.noise[2] + len(self.requests)]
            if self.noise[2] > NOISE_MEMORY:  # forget the oldest by halves
                self.noise = [self.noise[0] / 2, self.noise[1] / 2, self.noise[2] // 2]
        self.ref, self.alpha, self.dispersion = {}, None, 1.0
        self.blocks, self.block, self.block_len = [], {}, 0
        self.requests = {}
        self.up, self.down, self.up_large, self.down_large = _Side(), _Side(), _Side(), _Side()
        self.handover = None

    def level_shift(self) -> float:
        """`HANDOVER_Z` standard errors of the reference's mean accept length, relative to it: the
        requests' own residual sums where rounds carry ids (cluster-robust), else the model's noise
        inflated by the dispersion. At most 0.5."""
        n = var = mean = 0.0
        for k, (_, s0, _, _) in self.ref.items():
            mu, sd = accept_len_moments(self.alpha, int(k))
            n += s0
            var += s0 * sd * sd
            mean += s0 * mu
        if n <= 0 or mean <= 0:
            return 0.5
        se = (math.sqrt(_group_sums(self.alpha, list(self.requests.values()))[0]) / n if self.requests
              else math.sqrt(self.dispersion * var) / n)
        return min(0.5, HANDOVER_Z * se / (mean / n))

    def testable(self) -> bool:
        """The change test can run: a level, and a noise estimate (4 blocks, or enough request
        clusters of this reference and earlier ones)."""
        return self.alpha is not None and (len(self.blocks) >= MIN_BLOCKS
                                           or self.noise[2] + len(self.requests) >= NOISE_MIN_REQUESTS)

    def rewarm(self, head_version: int) -> None:
        """A new head went live: relearn its level, judge windows on its rounds only; keep
        `rounds`, `last_alert` and `latched` (what was reported, and when). Until the new level
        can be tested, the old head's reference, lowered by `HANDOVER_Z` of its standard errors,
        stands in for drops (a swap during a hand-over keeps the first one), and a drop under way
        goes on: the down CUSUMs are kept."""
        handover = [self.alpha, self.dispersion, self.level_shift()] if self.testable() else self.handover
        down, down_large = self.down, self.down_large
        self.head_version = head_version
        self.relearn()
        if handover is not None:
            self.handover, self.down, self.down_large = handover, down, down_large
        self.collapse.clear()
        self.losing.clear()

    def to_dict(self) -> dict:
        return {"head_version": self.head_version, "rounds": self.rounds,
                "ref": {k: list(v) for k, v in self.ref.items()}, "alpha": self.alpha,
                "prev_alpha": self.prev_alpha, "dispersion": self.dispersion,
                "noise": list(self.noise), "handover": self.handover, "up": asdict(self.up), "down": asdict(self.down),
                "up_large": asdict(self.up_large), "down_large": asdict(self.down_large),
                "blocks": [{k: list(v) for k, v in b.items()} for b in self.blocks],
                "block": {k: list(v) for k, v in self.block.items()}, "block_len": self.block_len,
                "requests": {r: {k: list(v) for k, v in g.items()} for r, g in self.requests.items()},
                "last_alert": dict(self.last_alert), "latched": dict(self.latched),
                "collapse": [[a, None if ids is None else list(ids)] for a, ids in self.collapse], "losing": [list(x) for x in self.losing]}

    @classmethod
    def from_dict(cls, d: dict, cfg: DriftConfig) -> "_Stream":
        return cls(head_version=int(d["head_version"]), rounds=int(d["rounds"]),
                   ref={str(k): list(v) for k, v in d["ref"].items()}, alpha=d["alpha"],
                   prev_alpha=d["prev_alpha"], dispersion=float(d["dispersion"]),
                   noise=list(d.get("noise", [0.0, 0.0, 0])), handover=d.get("handover"),
                   up=_Side(**d["up"]), down=_Side(**d["down"]),
                   up_large=_Side(**d.get("up_large", {})), down_large=_Side(**d.get("down_large", {})),
                   blocks=[{str(k): list(v) for k, v in b.items()} for b in d.get("blocks", [])],
                   block={str(k): list(v) for k, v in d.get("block", {}).items()}, block_len=int(d.get("block_len", 0)),
                   requests={str(r): {str(k): list(v) for k, v in g.items()} for r, g in d.get("requests", {}).items()},
                   last_alert=dict(d["last_alert"]), latched=dict(d["latched"]),
                   collapse=deque(((x, None) if isinstance(x, (int, float)) else
                                   (x[0], None if x[1] is None else tuple(x[1])) for x in d["collapse"]),
                                  maxlen=COLLAPSE_SPAN * cfg.collapse_window),
                   losing=deque((tuple(x) for x in d["losing"]), maxlen=cfg.losing_window))


class DriftDetector:
    """Per-(slot, tag) change, collapse and losing rules over round observations. Pure."""

    def __init__(self, cfg: DriftConfig | None = None):
        self.cfg = cfg or DriftConfig()
        self.round = -1
        self._streams: OrderedDict[tuple[int, str], _Stream] = OrderedDict()
        self._slot_tags: dict[int, list[str]] = {}  # per slot the first two tags seen (two = mixed)
        # per slot and alert kind: [side that spoke ("mix" | "tag"), the mix stream's rounds then]
        self._said: dict[str, list] = {}

    # one call per observation (round_observations: the round's mix, then each tag) -------------
    def update(self, obs: RoundObservation) -> list[DriftAlert]:
        obs.validate()
        self.round += obs.opens_round
        if not self._routed(obs):
            return []
        s = self._stream(obs)
        if obs.num_steps == 0:  # plain decode: nothing about the head to learn
            return []
        s.rounds += 1
        alerts = []
        alert = self._change(s, obs)
        if alert:
            alerts.append(alert)
        s.collapse.append((obs.accept_len, obs.request_ids))
        alert = self._collapse(s, obs)
        if alert:
            alerts.append(alert)
        if obs.spec_tokens_per_s is not None and obs.plain_tokens_per_s is not None:
            s.losing.append((obs.spec_tokens_per_s, obs.plain_tokens_per_s))
            alert = self._losing(s, obs)
            if alert:
                alerts.append(alert)
        side = "mix" if obs.tag == MIX_TAG else "tag"
        return [a for a in alerts if not self._said_by_other_side(a, side)]

    def reference(self, slot: int, tag: str) -> Optional[float]:
        """The stream's learned per-position acceptance alpha, or None while it warms up."""
        s = self._streams.get((slot, tag))
        return None if s is None else s.alpha

    # streams ----------------------------------------------------------------------------------
    def _routed(self, obs: RoundObservation) -> bool:
        """Whether `obs` feeds a stream: a mix observation while mix streams are on; a tag's once
        its slot has carried two tags, or at once where the slot has no mix stream (a caller that
        feeds tags only, or mix streams off)."""
        if obs.tag == MIX_TAG:
            return self.cfg.mix_streams
        seen = self._slot_tags.setdefault(obs.slot, [])
        if obs.tag not in seen and len(seen) < 2:
            seen.append(obs.tag)
        return len(seen) >= 2 or (obs.slot, MIX_TAG) not in self._streams

    def _said_by_other_side(self, alert: DriftAlert, side: str) -> bool:
        """True when the other side of the slot (`side`: "mix" stream vs "tag" streams) raised this
        kind within `cooldown_rounds` of the mix stream's rounds: the same change, said once. Else
        records it."""
        mix = self._streams.get((alert.slot, MIX_TAG))
        if mix is None:
            return False
        key = f"{alert.slot}:{alert.kind}"
        last = self._said.get(key)
        if last is not None and last[0] != side and mix.rounds - last[1] < self.cfg.cooldown_rounds:
            return True
        self._said[key] = [side, mix.rounds]
        return False

    def _new_stream(self, version: int) -> _Stream:
        return _Stream(head_version=version, collapse=deque(maxlen=COLLAPSE_SPAN * self.cfg.collapse_window),
                       losing=deque(maxlen=self.cfg.losing_window))

    def _stream(self, obs: RoundObservation) -> _Stream:
        key = (obs.slot, obs.tag)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = self._new_stream(obs.head_version)
        elif s.head_version != obs.head_version:
            s.rewarm(obs.head_version)  # a swap: the new head's level is a new baseline
        self._streams.move_to_end(key)
        while len(self._streams) > self.cfg.max_streams:
            self._streams.popitem(last=False)
        return s

    # rule: drop / rise ------------------------------------------------------------------------
    def _change(self, s: _Stream, obs: RoundObservation) -> Optional[DriftAlert]:
        cfg, w, k = self.cfg, obs.weight, obs.num_steps
        rounds, requests = s.ref_totals()
        limits = {"drop": cfg.threshold, "rise": cfg.rise_threshold or cfg.threshold}
        # a change may be under way: then the reference stops absorbing rounds
        suspect = max(s.down.stat, s.down_large.stat) > 0.5 * limits["drop"] or \
            max(s.up.stat, s.up_large.stat) > 0.5 * limits["rise"]
        blocks_short = len(s.blocks) < MIN_BLOCKS
        if (requests < cfg.reference_requests or blocks_short) and not suspect:  # warm-up, then refinement
            v = s.ref.setdefault(str(k), [0, 0.0, 0.0, 0.0])
            v[0] += 1
            v[1] += w
            v[2] += w * obs.accept_len
            v[3] += w * obs.accept_len ** 2
            bv = s.block.setdefault(str(k), [0.0, 0.0])
            bv[0] += w
            bv[1] += w * obs.accept_len
            s.block_len += 1
            if obs.accepted is not None:
                for rid, a in zip(obs.request_ids, obs.accepted):
                    rv = s.requests.setdefault(str(rid), {}).setdefault(str(k), [0, 0.0])
                    rv[0] += 1
                    rv[1] += a
            block_done = s.block_len >= cfg.block_rounds
            if block_done:
                s.blocks.append(s.block)
                s.block, s.block_len = {}, 0
            if s.alpha is not None or (rounds + 1 >= cfg.warmup_rounds and requests + w >= cfg.warmup_requests):
                # the level every round; the noise (sums over all blocks and requests) once a block
                # completes, so a refining stream costs tens of microseconds a round, not hundreds
                self._fit_reference(s, noise=block_done or s.alpha is None)
        if s.testable():
            if s.handover is not None:  # the new head's level takes over from the old head's
                s.handover, s.down, s.down_large = None, _Side(), _Side()
            alpha, dispersion, kinds, shift = s.alpha, s.dispersion, ("drop", "rise"), 0.0
        elif s.handover is not None:  # after a swap: drops against the old head's level meanwhile
            (alpha, dispersion, shift), kinds = s.handover, ("drop",)
        else:
            return None  # the level or the noise is not known yet
        mu, sd = accept_len_moments(alpha, k)
        mu *= 1.0 - shift  # a handed-over level, lowered by its own uncertainty
        sd *= math.sqrt(dispersion)
        r = (obs.accept_len - mu) / max(sd, 1e-6)
        wc = min(w, cfg.max_round_weight)
        pairs = [(max(cfg.min_effect * mu, cfg.min_effect_abs), s.up, s.down)]
        if cfg.large_effect > cfg.min_effect:
            pairs.append((max(cfg.large_effect * mu, cfg.min_effect_abs), s.up_large, s.down_large))
        for delta, up, down in pairs:
            d = delta / max(sd, 1e-6)
            if "rise" in kinds:
                up.add(wc * d * (r - 0.5 * d), w, obs.accept_len, mu)
            down.add(wc * d * (-r - 0.5 * d), w, obs.accept_len, mu)
        for kind, side in ((kind, side) for _, up, down in pairs for kind, side in (("drop", down), ("rise", up))):
            if side.stat > limits[kind]:
                before, after = side.sum_mu / side.w, side.sum_a / side.w
                cooling = self._cooling(s, "change")
                s.relearn()  # the new level is the new normal, whether or not we speak
                if cooling:
                    return None
                s.last_alert["change"] = s.rounds
                return self._alert(kind, "warn" if kind == "drop" else "info", obs, before, after)
        return None

    @staticmethod
    def _fit_reference(s: _Stream, noise: bool) -> None:
        s.alpha = fit_alpha({int(k): v[1] for k, v in s.ref.items()}, sum(v[2] for v in s.ref.values()), start=s.alpha)
        if not noise:
            return
        # Dispersion: the mean of B r^2 is 1 if the model's per-request SD is right; more means
        # noisier traffic (sum over rounds of w (a - mu)^2 = S2 - 2 mu S1 + mu^2 S0, per K).
        z2, n = 0.0, 0
        for k, (rounds, s0, s1, s2) in s.ref.items():
            mu, sd = accept_len_moments(s.alpha, int(k))
            z2 += max(s2 - 2 * mu * s1 + mu * mu * s0, 0.0) / max(sd, 1e-6) ** 2
            n += int(rounds)
        per_round = z2 / n
        # Batch means: with independent rounds, a block's standardised sum
        # z = sum_K (S1 - mu S0) / sqrt(sum_K S0 sd^2) has E[z^2] = 1; rounds that share their
        # requests (an easy prompt stays easy for its whole life) make it larger, by about the
        # rounds a request's level persists. Counted once 4 blocks exist (fewer are too noisy).
        per_block = _group_dispersion(s.alpha, s.blocks) if len(s.blocks) >= MIN_BLOCKS else 0.0
        # Request clusters: the same sum over each request's own rounds. Requests are the
        # independent units of traffic, so sum_j z_j^2 / sum_j E[..] is the inflation of the
        # variance of a sum over rounds (cluster-robust); unlike blocks of a fixed length it does
        # not depend on how long requests live or how many overlap in a round, and it has as many
        # samples as requests, not blocks (a batch-8 reference of 500 rounds: ~100 vs 10).
        # Earlier references' clusters (before a swap or a change, each against its own level) are
        # pooled in: how much requests differ is the traffic's, and a stream re-warmed every few
        # hundred rounds would otherwise rarely hold enough requests of its own.
        num2, var, _ = _group_sums(s.alpha, list(s.requests.values()))
        clusters = len(s.requests) + s.noise[2]
        per_request = (num2 + s.noise[0]) / (var + s.noise[1]) if clusters >= MIN_BLOCKS and var + s.noise[1] > 0 else 0.0
        s.dispersion = max(1.0, per_round, per_block, per_request)

    # rules: collapse, losing ------------------------------------------------------------------
    def _collapse_window_mean(self, s: _Stream) -> Optional[float]:
        """Mean accept length over the newest `collapse_window` rounds; where rounds carry request
        ids, over the newest rounds that also span `collapse_min_requests` requests, each request
        weighing the same (a round's batch mean counts for each of its requests), so one hard
        prompt and the edges of its neighbours do not make a collapse. None: no verdict yet."""
        cfg = self.cfg
        total, n, known = 0.0, 0, True
        per_request: dict[str, list[float]] = {}
        for a, rids in reversed(s.collapse):
            total += a
            n += 1
            if rids is None:
                known = False
            else:
                for r in rids:
                    v = per_request.setdefault(r, [0.0, 0])
                    v[0] += a
                    v[1] += 1
            if n >= cfg.collapse_window:
                if not known:
                    return total / n
                if len(per_request) >= cfg.collapse_min_requests:
                    return statistics.fmean(v[0] / v[1] for v in per_request.values())
        return None

    def _collapse(self, s: _Stream, obs: RoundObservation) -> Optional[DriftAlert]:
        mean = self._collapse_window_mean(s)
        if mean is None:  # no verdict yet: the latch stays as it was
            return None
        thr = self.cfg.collapse_accept_len
        if not self._latch(s, "collapse", mean < thr, clears=mean >= 2.0 * thr):
            return None
        return self._alert("collapse", "error", obs, self._ref_mean(s, obs.num_steps), mean)

    def _losing(self, s: _Stream, obs: RoundObservation) -> Optional[DriftAlert]:
        if len(s.losing) < self.cfg.losing_window:
            return None
        spec = sum(x[0] for x in s.losing)
        plain = sum(x[1] for x in s.losing)
        if not self._latch(s, "losing", spec < (1.0 - self.cfg.losing_margin) * plain, clears=spec >= plain):
            return None
        n = len(s.losing)
        return self._alert("losing", "warn", obs, self._ref_mean(s, obs.num_steps),
                           statistics.fmean(a for a, _ in list(s.collapse)[-n:]),
                           extra=f" Speculative {spec / n:.1f} tok/s vs plain {plain / n:.1f} tok/s "
                                 f"over the last {n} rounds.")

    def _latch(self, s: _Stream, rule: str, holds: bool, clears: bool) -> bool:
        """True when `rule` should fire now: it holds, is not already latched, and is not cooling.
        The latch opens again only when `clears` (between holding and clearing it stays as it is)."""
        if not holds:
            if clears:
                s.latched[rule] = False
            return False
        if s.latched.get(rule) or self._cooling(s, rule):
            return False
        s.latched[rule] = True
        s.last_alert[rule] = s.rounds
        return True

    def _cooling(self, s: _Stream, rule: str) -> bool:
        last = s.last_alert.get(rule)
        return last is not None and s.rounds - last < self.cfg.cooldown_rounds

    @staticmethod
    def _ref_mean(s: _Stream, k: int) -> float:
        """Reference mean accept length at K (the previous one while re-learning; NaN if none yet)."""
        alpha = s.alpha if s.alpha is not None else s.prev_alpha
        return float("nan") if alpha is None else expected_accept_len(alpha, k)

    def _alert(self, kind: str, level: str, obs: RoundObservation, before: float, after: float,
               extra: str = "") -> DriftAlert:
        tag = obs.tag
        if tag == MIX_TAG and len(self._slot_tags.get(obs.slot, ())) == 1:
            tag = self._slot_tags[obs.slot][0]  # the slot's only tag so far: the mix is that tag's traffic
        where = f"slot {obs.slot}" + (", all traffic" if tag == MIX_TAG else f", tag {tag!r}" if tag else "")
        what = {"drop": "Acceptance dropped", "rise": "Acceptance rose",
                "collapse": "Acceptance collapsed", "losing": "Speculation is slower than plain decoding"}[kind]
        text = (f"{what} on {where} (head v{obs.head_version}, K={obs.num_steps}): mean accept length "
                f"{before:.2f} -> {after:.2f} drafts (bonus excluded) at round {self.round}.{extra}")
        return DriftAlert(kind=kind, level=level, slot=obs.slot, tag=tag, before=before, after=after,
                          head_version=obs.head_version, round=self.round, time=obs.timestamp,
                          title=f"online-spec: {what.lower()} ({where})", text=text)

    # resumable --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"round": self.round,
                "streams": [[slot, tag, s.to_dict()] for (slot, tag), s in self._streams.items()],
                "slot_tags": {str(k): list(v) for k, v in self._slot_tags.items()},
                "said": {k: list(v) for k, v in self._said.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.round = int(state["round"])
        self._slot_tags = {int(k): [str(t) for t in v] for k, v in state.get("slot_tags", {}).items()}
        self._said = {str(k): [str(v[0]), int(v[1])] for k, v in state.get("said", {}).items()}
        self._streams = OrderedDict(((int(slot), str(tag)), _Stream.from_dict(d, self.cfg))
                                    for slot, tag, d in state["streams"])
