"""What the drift monitor reads and says: one `RoundObservation` per stream per round (built by
`round_observations` from a server's verify round, live or replayed) and the `DriftAlert` it raises.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from online_spec.drift.config import MIX_TAG, MIX_TAG_RESERVED


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
    # when the change began by the rule's estimate (a change's first round: the CUSUM's last zero;
    # the alert's own time for the other rules), on the clock of `time`: the rows since then are
    # the new traffic's (the trainer's seed check scores them)
    since: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)


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
