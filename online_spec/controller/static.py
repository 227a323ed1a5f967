"""`StaticSteps`: the fixed-K policy (benchmarks' static baselines, and the engine's default)."""

from __future__ import annotations

from typing import Sequence

from online_spec.config import check
from online_spec.controller.base import StepPolicyBase


class StaticSteps(StepPolicyBase):
    """K fixed; a `StepPolicy` with no in-round capabilities."""

    name = "static"
    tree_rounds = True  # K is the tree's depth, as SGLang's --speculative-num-steps

    def __init__(self, num_steps: int):
        check(num_steps >= 0, "num_steps", f"must be >= 0, got {num_steps}")
        self.num_steps = num_steps
        self.rounds = 0

    @property
    def candidate_steps(self) -> list[int]:
        return [self.num_steps]

    def steps_for(self, batch_size: int, ctx_len: int = 0) -> int:
        return self.num_steps

    def update(self, batch_size: int, accepted: Sequence[int], **_round) -> int:
        self.rounds += 1
        return self.num_steps

    def info(self) -> dict:
        return {"policy": self.name, "slots": {"1": {"steps": self.num_steps, "rounds": self.rounds}}}

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps, self.rounds = int(state["num_steps"]), int(state["rounds"])
