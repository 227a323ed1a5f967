"""The capture record: what the serving process learns from one verify round (contract 1).

One `CaptureRecord` per request per verify round (and one per prefill). Rows cover the
positions `first_pos .. first_pos + num_rows - 1` whose target features were computed in that
forward and whose input tokens are committed; rows after the first rejection are never made.

    tokens[i]        token at position first_pos + i, for i < num_rows; tokens[num_rows] is the
                     token the target committed after the last row (the bonus/corrected token),
                     so len(tokens) == num_rows + 1.
    features         [num_rows, 3*H]  EAGLE-3 target features (three captured layers, concat)
    final_hidden     [num_rows, H]    post-norm final hidden; lm_head(final_hidden[i]) is the
                                      target's distribution of tokens[i + 1]
    draft_tokens     [num_steps]      tokens the live head drafted this round (empty at K=0 or
                                      for a prefill record)
    draft_probs      [num_steps]      the head's probability of each drafted token
    accept_len       drafts accepted, bonus excluded (0..num_steps)

The wire codec (`collector.wire`) and the replay buffer import this type; the engine makes it,
the trainer consumes it, offline or live alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CaptureRecord:
    request_id: str
    first_pos: int
    tokens: torch.Tensor  # int64 [num_rows + 1]
    features: torch.Tensor  # [num_rows, 3H]
    final_hidden: torch.Tensor  # [num_rows, H]
    draft_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    draft_probs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    accept_len: int = 0
    num_steps: int = 0
    batch_size: int = 1
    draft_version: int = 0
    is_prefill: bool = False
    timestamp: float = field(default_factory=time.time)
    tag: str = ""

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def end_pos(self) -> int:
        """First position after this record's rows; the next record of the request starts here."""
        return self.first_pos + self.num_rows

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency; used by both ends of the stream."""
        r = self.num_rows
        if r < 1:
            raise ValueError("capture record has no rows")
        if self.first_pos < 0:
            raise ValueError(f"first_pos {self.first_pos} < 0")
        if self.tokens.dim() != 1 or self.tokens.numel() != r + 1:
            raise ValueError(f"tokens has {self.tokens.numel()} entries, expected num_rows+1 = {r + 1}")
        if self.final_hidden.dim() != 2 or self.final_hidden.shape[0] != r:
            raise ValueError(f"final_hidden shape {tuple(self.final_hidden.shape)} does not match {r} rows")
        if self.features.dim() != 2 or self.features.shape[1] != 3 * self.final_hidden.shape[1]:
            raise ValueError(
                f"features width {self.features.shape[1]} != 3 * hidden {self.final_hidden.shape[1]}"
            )
        k = self.num_steps
        if k < 0 or self.draft_tokens.numel() != k or self.draft_probs.numel() != k:
            raise ValueError(f"draft_tokens/draft_probs must have num_steps={k} entries")
        if not 0 <= self.accept_len <= k:
            raise ValueError(f"accept_len {self.accept_len} outside 0..num_steps={k}")
        if not self.is_prefill and r != self.accept_len + 1:
            raise ValueError(f"a verify record has accept_len+1 = {self.accept_len + 1} rows, got {r}")
