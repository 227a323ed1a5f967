"""`DriftDetector`: the per-stream rules (drop / rise CUSUM, collapse, losing, head-version
hand-over) over `RoundObservation`s; no I/O, no clock. The method: online_spec/drift/__init__.py.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Optional

from online_spec.drift.config import (COLLAPSE_SPAN, HANDOVER_Z, MIN_BLOCKS, MIX_TAG, NOISE_MEMORY,
                                      NOISE_MIN_REQUESTS, DriftConfig)
from online_spec.drift.observation import DriftAlert, RoundObservation
from online_spec.drift.stats import group_dispersion, group_sums, accept_len_moments, expected_accept_len, fit_alpha


@dataclass
class _Side:
    """One side of the CUSUM plus the rounds of its current excursion (the change estimate)."""

    stat: float = 0.0
    w: float = 0.0  # requests in the excursion
    sum_a: float = 0.0  # sum of weight * accept_len
    sum_mu: float = 0.0  # sum of weight * reference mean at the round's K
    # the first round's timestamp of the excursion: the change estimate (the CUSUM's last zero)
    since: Optional[float] = None

    def add(self, inc: float, w: float, a: float, mu: float, t: float) -> None:
        self.stat = max(0.0, self.stat + inc)
        if self.stat == 0.0:
            self.w = self.sum_a = self.sum_mu = 0.0
            self.since = None
        else:
            if self.since is None:
                self.since = t
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
    # [sum num^2, sum var, requests] (`group_sums`), the noise of the traffic across swaps.
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
            num2, var, _ = group_sums(self.alpha, list(self.requests.values()))
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
        se = (math.sqrt(group_sums(self.alpha, list(self.requests.values()))[0]) / n if self.requests
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
                up.add(wc * d * (r - 0.5 * d), w, obs.accept_len, mu, obs.timestamp)
            down.add(wc * d * (-r - 0.5 * d), w, obs.accept_len, mu, obs.timestamp)
        for kind, side in ((kind, side) for _, up, down in pairs for kind, side in (("drop", down), ("rise", up))):
            if side.stat > limits[kind]:
                before, after = side.sum_mu / side.w, side.sum_a / side.w
                cooling = self._cooling(s, "change")
                s.relearn()  # the new level is the new normal, whether or not we speak
                if cooling:
                    return None
                s.last_alert["change"] = s.rounds
                return self._alert(kind, "warn" if kind == "drop" else "info", obs, before, after, since=side.since)
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
        per_block = group_dispersion(s.alpha, s.blocks) if len(s.blocks) >= MIN_BLOCKS else 0.0
        # Request clusters: the same sum over each request's own rounds. Requests are the
        # independent units of traffic, so sum_j z_j^2 / sum_j E[..] is the inflation of the
        # variance of a sum over rounds (cluster-robust); unlike blocks of a fixed length it does
        # not depend on how long requests live or how many overlap in a round, and it has as many
        # samples as requests, not blocks (a batch-8 reference of 500 rounds: ~100 vs 10).
        # Earlier references' clusters (before a swap or a change, each against its own level) are
        # pooled in: how much requests differ is the traffic's, and a stream re-warmed every few
        # hundred rounds would otherwise rarely hold enough requests of its own.
        num2, var, _ = group_sums(s.alpha, list(s.requests.values()))
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
               extra: str = "", since: Optional[float] = None) -> DriftAlert:
        tag = obs.tag
        if tag == MIX_TAG and len(self._slot_tags.get(obs.slot, ())) == 1:
            tag = self._slot_tags[obs.slot][0]  # the slot's only tag so far: the mix is that tag's traffic
        where = f"slot {obs.slot}" + (", all traffic" if tag == MIX_TAG else f", tag {tag!r}" if tag else "")
        what = {"drop": "Acceptance dropped", "rise": "Acceptance rose",
                "collapse": "Acceptance collapsed", "losing": "Speculation is slower than plain decoding"}[kind]
        change = (f"{before:.2f} -> {after:.2f} drafts" if math.isfinite(before)
                  else f"{after:.2f} drafts (no reference level yet)")
        text = (f"{what} on {where} (head v{obs.head_version}, K={obs.num_steps}): mean accept length "
                f"{change} (bonus excluded) at round {self.round}.{extra}")
        return DriftAlert(kind=kind, level=level, slot=obs.slot, tag=tag, before=before, after=after,
                          head_version=obs.head_version, round=self.round, time=obs.timestamp,
                          title=f"online-spec: {what.lower()} ({where})", text=text,
                          since=obs.timestamp if since is None else since)

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
