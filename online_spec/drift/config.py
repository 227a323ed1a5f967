"""Settings of the drift monitor (`DriftConfig`) and the names every part of it shares: the
mix stream's tag and the detector's fixed constants. The method: online_spec/drift/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from online_spec.config import check, doc


MIX_TAG = "*"  # the tag of a slot's mix stream: every request of its rounds, whatever their tags
MIX_TAG_RESERVED = f"tag {MIX_TAG!r} is reserved: it names the drift monitor's all-traffic stream (a slot's mix stream)"
COLLAPSE_SPAN = 32  # the collapse window may grow to this many times collapse_window rounds
MIN_BLOCKS = 4  # block means the reference needs before the change test runs (fewer: too noisy)
NOISE_MIN_REQUESTS = 32  # or request clusters, this reference's and earlier ones' (a re-warmed stream)
NOISE_MEMORY = 2000  # request clusters of earlier references kept (beyond, the oldest halve)
HANDOVER_Z = 2.0  # a handed-over level is lowered by this many of its standard errors


# --- the truncated-geometric model of one request's accept length ----------------------------


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
