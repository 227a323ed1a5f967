"""Sampling parameters and the speculative acceptance rule, shared by engine and tests.

Temperature, top-k and top-p are applied the same way to the target's and the draft's logits
(`probs_from_logits`), which is what makes speculative rejection sampling exact: the committed
tokens are distributed as if sampled from the target alone.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from online_spec.config import check

# Temperatures outside this range overflow fp32 logits / temperature (to inf, then NaN
# probabilities) for real logits; 0 is greedy.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field the engine could not sample with. Run at
        construction; the server runs it again on the requests of a failing round, which finds
        parameters changed after construction."""
        t = self.temperature
        check(isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
              and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE), "temperature",
              f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t}")
        check(isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1, "top_p",
              f"must be in (0, 1], got {self.top_p}")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an integer >= 0, got {self.top_k}")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              f"must be an integer >= 1, got {self.max_tokens}")
        check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]), "seed",
              f"must be an integer in -2**63..2**64-1, got {self.seed}")
        n_stop = len(self.stop) if isinstance(self.stop, list) else None
        check(n_stop is not None and n_stop <= MAX_STOP_STRINGS, "stop",
              f"at most {MAX_STOP_STRINGS} stop strings in a list, got {n_stop if n_stop is not None else self.stop!r}")
        check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
              f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32) after temperature, top-k, top-p."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = (sp.cumsum(-1) - sp) >= params.top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling for one request.

    p [K+1, V] target probs at each verified position, q [K, V] draft probs, drafts [K].
    Returns (accept_len, next token): the token committed after the accepted drafts.
    """
    k = drafts.numel()
    u = torch.rand(k, generator=gen) if k else None
    for i in range(k):
        x = int(drafts[i])
        # Accept draft x with probability min(1, p(x)/q(x)); on rejection resample from
        # norm((p - q)+), which makes the committed token distributed exactly as p.
        if float(u[i]) * float(q[i, x]) <= float(p[i, x]):
            continue
        resid = (p[i] - q[i]).clamp_min(0)
        s = float(resid.sum())
        resid = resid / s if s > 0 else p[i]
        return i, int(torch.multinomial(resid, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))
