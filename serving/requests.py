"""What goes into and comes out of the engine: requests, per-request outputs, round statistics,
the refusals, and what the engine needs of a capture publisher.

    req = Request(prompt_ids, SamplingParams(max_tokens=64), request_id="r1", tag="chat")
    engine.add_request(req)            # EngineFull / PromptTooLong when it cannot be taken
    outs = engine.step()               # list[RequestOutput]; engine.on_round hooks get RoundStats
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Protocol

import torch

from online_spec.capture import CaptureRecord
from online_spec.sampling import SamplingParams


class CaptureSink(Protocol):
    """What the engine needs from the collector publisher (never blocks)."""

    def should_capture(self, request_id: str) -> bool: ...
    def submit(self, records: Sequence[CaptureRecord]) -> None:
        """A round's records: a list, or a `CaptureRound` that builds them where it is read (a
        sink on the engine's thread that iterates it builds them there)."""
    def end_request(self, request_id: str) -> None: ...


class EngineFull(RuntimeError):
    """The queue is full; the request was not taken."""


class PromptTooLong(ValueError):
    """The prompt leaves no room to generate within max_len."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    tag: str = ""
    # runtime state, owned by the engine
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    capture: bool = False
    slot: int = -1
    gen: torch.Generator | None = None


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    accept_len: int
    num_steps: int
    finished: bool
    finish_reason: str | None


@dataclass
class RoundStats:
    batch_size: int
    num_steps: int
    accepted: list[int]
    committed: int
    draft_s: float
    verify_s: float
    total_s: float
    head_version: int
    ctx_len: int
    swapped: bool = False
    swap_fill_rows: int = 0  # rows of a staged head's cache rebuilt this round (before it went live)
    catchup_s: float = 0.0  # of draft_s: long draft-cache catch-ups (a new prompt, rows served at K = 0, a swap)
    draft_captures: int = 0  # CUDA graphs captured in the draft phase (a new shape, a new head)
    verify_captures: int = 0  # CUDA graphs captured in the verify phase
    drafted_steps: int = 0  # drafts made per request before the verify-length cut (>= num_steps)
    topk: int = 1  # branching of the round's draft tree (1: a chain)
    num_draft_tokens: int = 0  # tokens verified per request, the root included (a chain: num_steps + 1)
    admitted: int = 0  # requests admitted (prefilled) at the start of this round
    admit_s: float = 0.0  # of total_s: their prefills (the target over each new prompt)
    policy_s: float = 0.0  # the step policy's calls on the engine's thread this round (its decision cost)

    @property
    def steady_draft_s(self) -> float | None:
        """The draft seconds a round at this K costs in steady serving: draft_s without the
        one-off catch-ups; None when a graph capture (milliseconds, once per shape) is inside."""
        return None if self.draft_captures else max(0.0, self.draft_s - self.catchup_s)

    @property
    def steady_verify_s(self) -> float | None:
        """verify_s, or None when a graph capture is inside it."""
        return None if self.verify_captures else self.verify_s
