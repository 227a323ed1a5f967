"""The `StepPolicy` protocol every step controller implements, and its decision-cost probe.

The engine holds one policy and, per round, calls `steps_for(batch_size, ctx_len)` before
drafting and `update(batch_size, accepted, num_steps=..., ...)` after verify; on a head swap
it calls `rewarm()`. `info()` feeds logs and the control endpoint; `state_dict()` is stored with
the run. `measure_decision_cost_us` times one round of those calls (with the in-round
`should_continue` / `verify_lengths` of policies that declare them) for the benchmarks, and
`TimedPolicy` times them inside the engine's rounds.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class StepPolicy(Protocol):
    """Chooses K (draft steps) per round from what past rounds showed. No I/O, no torch.

    Everything the engine and the server may call on a policy is declared here; nothing is
    discovered with `hasattr`. The in-round capabilities are optional: a policy declares them
    with `early_stop` / `truncates`, and the engine calls `should_continue` / `verify_lengths`
    only where the flag is set. `StepPolicyBase` gives every optional member its "absent" form."""

    name: str
    """The policy's kind, as `info()["policy"]` and the logs name it."""
    early_stop: bool
    """True when `should_continue` may stop drafting inside a round."""
    truncates: bool
    """True when `verify_lengths` may verify fewer drafts than K for some requests."""
    tree_rounds: bool
    """True when the policy may drive tree rounds (topk > 1), its K then being the tree's depth.
    SGLang's adaptive policy requires chains; a static K serves trees as SGLang's flags do."""
    chooses_trees: bool
    """True when the policy picks, round by round, a draft tree to run instead of its chain
    (`tree_for`), whatever the engine's configured topk."""

    def steps_for(self, batch_size: int, ctx_len: int = 0) -> int:
        """K for the next round of a batch of `batch_size` requests of mean context `ctx_len`."""

    def update(self, batch_size: int, accepted: Sequence[int], *,
               num_steps: int | Sequence[int] | None = None, ctx_len: int = 0,
               draft_s: float | None = None, verify_s: float | None = None,
               confidences: Sequence[Sequence[float]] | None = None, tree=None) -> int:
        """Feed one verify round (accepted drafts per request, bonus excluded); returns the next K.
        `tree`: the `TreeShape` the round ran, None for a chain."""

    def rewarm(self) -> None:
        """A new head went live: relearn its acceptance from scratch."""

    def info(self) -> dict:
        """A JSON-safe summary: `{"policy": name, "slots": {slot: {"steps": K, ...}}, ...}`."""

    def state_dict(self) -> dict:
        """JSON-safe state to store with the run."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""

    def should_continue(self, step_index: int, draft_confidence, batch_size: int, ctx_len: float = 0) -> bool:
        """After draft step `step_index` (1-based) of the round: is one more step worth it?
        Called only when `early_stop`, after every step but the round's last, in order; when the
        policy `truncates` too, also after the last (its answer unused: the round is at K), so a
        policy may tally every drafted step for its `verify_lengths`."""

    def verify_lengths(self, confidences, ctx_len: float = 0, *, padded: bool = False) -> list[int]:
        """Per request, how many of the round's drafts ([B, K] confidences) to verify. Called only
        when `truncates`."""

    def predict_round_s(self, batch_size: int, k: int, ctx_len: float = 0) -> float | None:
        """Predicted seconds of a round at this batch, K and context; None for a policy without a
        round-time model (the drift monitor's "losing" rule then has nothing to compare)."""

    def tree_for(self, batch_size: int, ctx_len: float = 0):
        """The `TreeShape` the next round drafts instead of `steps_for`'s chain, or None. Called
        after `steps_for`, only when `chooses_trees`."""

    def tree_shapes(self) -> list:
        """Every `TreeShape` `tree_for` may return ([] when not `chooses_trees`): a GPU server
        captures their graphs when it starts."""


class StepPolicyBase:
    """The optional members of `StepPolicy` in their absent form: no in-round early stop, no
    verify-length cut, no round-time model. Policies inherit it and override what they have."""

    name = "policy"
    early_stop = False
    truncates = False
    tree_rounds = False
    chooses_trees = False

    def should_continue(self, step_index: int, draft_confidence, batch_size: int, ctx_len: float = 0) -> bool:
        return True

    def verify_lengths(self, confidences, ctx_len: float = 0, *, padded: bool = False) -> list[int]:
        return [len(row) for row in confidences]

    def predict_round_s(self, batch_size: int, k: int, ctx_len: float = 0) -> float | None:
        return None

    def tree_for(self, batch_size: int, ctx_len: float = 0):
        return None

    def tree_shapes(self) -> list:
        return []

    def rewarm(self) -> None:
        pass

    def info(self) -> dict:
        return {"policy": self.name}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


POLICY_MEMBERS = tuple(sorted(set(StepPolicy.__annotations__)
                              | {n for n, v in vars(StepPolicy).items() if callable(v) and not n.startswith("_")}))


def check_policy(policy) -> None:
    """Raise TypeError naming what `policy` lacks of `StepPolicy` (the engine checks every policy
    it is given, so a missing member fails when the policy is installed, not rounds later)."""
    missing = [m for m in POLICY_MEMBERS if not hasattr(policy, m)]
    if missing:
        raise TypeError(f"{type(policy).__name__} is not a StepPolicy: it lacks {', '.join(missing)} "
                        "(inherit online_spec.controller.StepPolicyBase for the optional members)")


def measure_decision_cost_us(policy: StepPolicy, n: int = 2000, batch_size: int = 8,
                             ctx_len: int = 512) -> float:
    """Median microseconds of one round's policy work, on a copy of `policy`: steps_for, then
    as the engine calls them when the policy has them, should_continue after each draft step
    and verify_lengths over the round's confidences (padded, as the engine asks), then update
    with the round's measured draft and verify seconds (which the cost policy fits online).

    Acceptance and confidences follow fixed patterns (request r accepts r mod (K+1) drafts;
    confidences cycle through the ten deciles) so runs compare. Confidences are passed as the
    engine passes them: views of one float32 [B, K] array. The round's seconds are fixed at a
    2-core CPU's calibration of SmolLM2-135M (draft step 3.2 ms + 0.2 ms per request; verify
    63 ms + 1.7 ms per request + 0.56 ms per verified token).
    """
    draft_s = 0.0032 + 0.0002 * batch_size
    verify_s, verify_token_s = 0.063 + 0.0017 * batch_size, 0.00056
    policy = copy.deepcopy(policy)
    early_stop = policy.should_continue if policy.early_stop else None
    truncate = policy.verify_lengths if policy.truncates else None
    patterns: dict[tuple, list[int]] = {}
    conf = np.array([[((3 * r + 7 * i) % 10 + 0.5) / 10 for i in range(64)] for r in range(batch_size)],
                    dtype=np.float32)
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        k = policy.steps_for(batch_size, ctx_len)
        if early_stop is not None:
            for i in range(1, k):
                if not early_stop(i, conf[:, i - 1], batch_size, ctx_len):
                    k = i
                    break
        lens: int | list[int] = k
        if truncate is not None and k > 0:
            lens = [min(k, m) for m in truncate(conf[:, :k], ctx_len, padded=True)]
        t_verify = time.perf_counter_ns()  # the round's accept counts are the verify's, not policy work
        key = (k, lens if isinstance(lens, int) else tuple(lens))
        accepted = patterns.get(key)
        if accepted is None:
            accepted = patterns[key] = [min(r % (k + 1), m) for r, m in
                                        zip(range(batch_size), [lens] * batch_size if isinstance(lens, int) else lens)]
        verified = max(lens, default=0) if isinstance(lens, list) else lens
        t_update = time.perf_counter_ns()
        policy.update(batch_size, accepted, num_steps=lens, ctx_len=ctx_len, draft_s=draft_s * k,
                      verify_s=verify_s + verify_token_s * batch_size * (verified + 1),
                      confidences=conf[:, :verified])  # as the engine passes them
        times.append(time.perf_counter_ns() - t0 - (t_update - t_verify))
    return statistics.median(times) / 1000.0


class TimedPolicy:
    """`policy` as the engine drives it, with the time of its calls summed per round
    (`steps_for` opens a round, `update` closes it, the in-round `should_continue` and
    `verify_lengths` count inside it): the decision cost *inside* the engine, where each call runs
    between torch ops on cold caches. `measure_decision_cost_us` times the same calls in a hot
    loop; in the engine they cost several times more (docs/controller.md). A `StepPolicy` with
    the wrapped policy's capabilities; every decision is the policy's own."""

    def __init__(self, policy: StepPolicy):
        check_policy(policy)
        self.policy = policy
        self.name, self.early_stop, self.truncates = policy.name, policy.early_stop, policy.truncates
        self.tree_rounds, self.chooses_trees = policy.tree_rounds, policy.chooses_trees
        self.round_ns: list[int] = []
        self._acc = 0

    def steps_for(self, batch_size: int, ctx_len: int = 0) -> int:
        t = time.perf_counter_ns()
        k = self.policy.steps_for(batch_size, ctx_len)
        self._acc = time.perf_counter_ns() - t
        return k

    def should_continue(self, step_index: int, draft_confidence, batch_size: int, ctx_len: float = 0) -> bool:
        t = time.perf_counter_ns()
        out = self.policy.should_continue(step_index, draft_confidence, batch_size, ctx_len)
        self._acc += time.perf_counter_ns() - t
        return out

    def verify_lengths(self, confidences, ctx_len: float = 0, *, padded: bool = False) -> list[int]:
        t = time.perf_counter_ns()
        out = self.policy.verify_lengths(confidences, ctx_len, padded=padded)
        self._acc += time.perf_counter_ns() - t
        return out

    def tree_for(self, batch_size: int, ctx_len: float = 0):
        t = time.perf_counter_ns()
        out = self.policy.tree_for(batch_size, ctx_len)
        self._acc += time.perf_counter_ns() - t
        return out

    def tree_shapes(self) -> list:
        return self.policy.tree_shapes()

    def update(self, batch_size: int, accepted: Sequence[int], **round_) -> int:
        t = time.perf_counter_ns()
        k = self.policy.update(batch_size, accepted, **round_)
        self.round_ns.append(self._acc + time.perf_counter_ns() - t)
        self._acc = 0
        return k

    def predict_round_s(self, batch_size: int, k: int, ctx_len: float = 0) -> float | None:
        return self.policy.predict_round_s(batch_size, k, ctx_len)

    def rewarm(self) -> None:
        self.policy.rewarm()

    def info(self) -> dict:
        return self.policy.info()

    def state_dict(self) -> dict:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state)

    def median_us(self) -> float | None:
        """Median microseconds of the policy's calls per round so far (None before any round)."""
        return statistics.median(self.round_ns) / 1000.0 if self.round_ns else None

    def mean_us(self) -> float | None:
        """Mean microseconds of the policy's calls per round so far (rare slow rounds count)."""
        return statistics.fmean(self.round_ns) / 1000.0 if self.round_ns else None
