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
  The alert's `since` is the timestamp of the excursion's first round (the CUSUM's last zero),
  the change-point estimate: the rounds between it and the alert are the new traffic's already.
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

Modules: `config` (DriftConfig, the mix tag, the detector's constants), `observation`
(RoundObservation, DriftAlert, round_observations), `stats` (the accept-length law, alpha
fitting, group dispersion), `detector` (the streams and their rules). Replay of recorded rounds:
online_spec/drift_replay.py; alert sinks: online_spec/alerts.py.
"""

from online_spec.drift.config import MIX_TAG, MIX_TAG_RESERVED, DriftConfig
from online_spec.drift.detector import DriftDetector
from online_spec.drift.observation import DriftAlert, RoundObservation, round_observations
from online_spec.drift.stats import accept_len_moments, expected_accept_len, fit_alpha

__all__ = ["MIX_TAG", "MIX_TAG_RESERVED", "DriftConfig", "DriftDetector", "DriftAlert", "RoundObservation",
           "round_observations", "accept_len_moments", "expected_accept_len", "fit_alpha"]
