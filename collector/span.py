"""`CaptureSpan`: a contiguous run of one request's captured rows, what the trainer consumes.

The stream delivers one `CaptureRecord` per request per round; the subscriber joins the records
of a request whose positions follow each other into one span (never across a gap: a record
lost on the way closes the span and the next record starts a new one). A span of n rows holds

    tokens        int64 [n + 1]  tokens at positions first_pos .. first_pos + n (the last one is
                                 the token the target committed after the last row)
    features      [n, 3H]        EAGLE-3 target features of row i (input token tokens[i])
    final_hidden  [n, H]         post-norm final hidden; lm_head of row i predicts tokens[i + 1]

and per-row information about the round that produced each row:

    accepted      int8  [n]  1: the live head drafted tokens[i + 1] and it was accepted;
                             0: the live head drafted draft_token[i] != tokens[i + 1] (rejected);
                            -1: nothing was drafted for this row (prefill rows, plain decode,
                                and the bonus row of a round whose drafts were all accepted)
    draft_token   int64 [n]  the token the live head drafted for position first_pos + i + 1, or -1
    draft_prob    f32   [n]  the head's probability of that draft, 0 where there is none
    num_steps     int32 [n]  K of the round;  batch_size int32 [n];  draft_version int64 [n]
    is_prefill    bool  [n]; timestamp float64 [n] (rows of one round share it)

Drafts after the first rejected one were conditioned on a wrong prefix and belong to no
committed row; they are not kept. `CaptureSpan.from_records(records)` builds a span and raises
ValueError unless the records are adjacent (each starts at the previous one's `end_pos` and
its first token is the previous record's last token). The geometry of rows, adjacency and the
per-row draft information are the capture record's (`online_spec.capture`), not restated here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from online_spec.capture import CaptureRecord, adjacency_error, check_rows

PER_ROW = ("accepted", "draft_token", "draft_prob", "num_steps", "batch_size", "draft_version",
           "is_prefill", "timestamp")
NUMPY_ROW_DTYPES = {"num_steps": np.int32, "batch_size": np.int32, "draft_version": np.int64, "is_prefill": np.bool_,
                    "timestamp": np.float64}
PER_ROW_DTYPES: dict[str, torch.dtype] = {
    "accepted": torch.int8, "draft_token": torch.int64, "draft_prob": torch.float32,
    "num_steps": torch.int32, "batch_size": torch.int32, "draft_version": torch.int64,
    "is_prefill": torch.bool, "timestamp": torch.float64,
}


@dataclass
class CaptureSpan:
    request_id: str
    first_pos: int
    tokens: torch.Tensor  # int64 [n + 1]
    features: torch.Tensor  # [n, 3H]
    final_hidden: torch.Tensor  # [n, H]
    accepted: torch.Tensor  # int8 [n]
    draft_token: torch.Tensor  # int64 [n]
    draft_prob: torch.Tensor  # float32 [n]
    num_steps: torch.Tensor  # int32 [n]
    batch_size: torch.Tensor  # int32 [n]
    draft_version: torch.Tensor  # int64 [n]
    is_prefill: torch.Tensor  # bool [n]
    timestamp: torch.Tensor  # float64 [n]
    tag: str = ""

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def end_pos(self) -> int:
        """First position after the span's rows."""
        return self.first_pos + self.num_rows

    @property
    def hidden_size(self) -> int:
        return int(self.final_hidden.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data: what the replay buffer charges against its budget."""
        return sum(t.nbytes for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    @classmethod
    def from_records(cls, records: Sequence[CaptureRecord]) -> "CaptureSpan":
        """Join adjacent records of one request; ValueError if they are not adjacent."""
        if not records:
            raise ValueError("a span needs at least one record")
        first = records[0]
        for prev, rec in zip(records, records[1:]):
            error = adjacency_error(prev, rec)
            if error:
                raise ValueError(error)
        tokens = torch.cat([r.tokens[:-1].to(torch.int64) for r in records] + [records[-1].tokens[-1:].to(torch.int64)])
        return cls(
            request_id=first.request_id,
            first_pos=int(first.first_pos),
            tokens=tokens,
            features=torch.cat([r.features for r in records]),
            final_hidden=torch.cat([r.final_hidden for r in records]),
            tag=first.tag,
            **_rows_info(records),
        )

    def slice(self, lo: int, hi: int) -> "CaptureSpan":
        """Rows lo..hi-1 as a span of their own (still contiguous, so still a valid span)."""
        if not 0 <= lo < hi <= self.num_rows:
            raise ValueError(f"slice {lo}:{hi} outside a span of {self.num_rows} rows")
        return CaptureSpan(
            request_id=self.request_id, first_pos=self.first_pos + lo, tokens=self.tokens[lo:hi + 1],
            features=self.features[lo:hi], final_hidden=self.final_hidden[lo:hi], tag=self.tag,
            **{name: getattr(self, name)[lo:hi] for name in PER_ROW},
        )

    def cut_generated(self, max_generated: int | None = None) -> "CaptureSpan | None":
        """The span up to where serving stops drafting on it: all its prompt rows (the head
        attends to them: cut to its last 64 rows, the shipped head's simulated accept length on
        HumanEval requests falls from 1.40 to 0.83) and its first `max_generated` rows that drafts
        start from (the last prompt row on), with the row after them (their drafts' target);
        None if it has no generated rows."""
        prompt = int(self.is_prefill.sum())
        if prompt >= self.num_rows:
            return None
        if max_generated is None:
            return self
        return self.slice(0, min(self.num_rows, max(prompt - 1, 0) + max_generated + 1))

    def target_error(self, info) -> str | None:
        """Why the span cannot be trained on with the target `info` describes (a `TargetInfo`:
        its hidden size, vocabulary and context; a frame can be well-formed on the wire and
        still not fit the model), or None."""
        hidden_size, vocab_size, max_positions = info.hidden_size, info.vocab_size, info.max_position_embeddings
        if self.hidden_size != hidden_size or int(self.features.shape[1]) != 3 * hidden_size:
            return (f"hidden size {self.hidden_size} (features {int(self.features.shape[1])}), "
                    f"the target's is {hidden_size}")
        for name, t, lo in (("tokens", self.tokens, 0), ("draft_token", self.draft_token, -1)):
            if t.numel() and (int(t.min()) < lo or int(t.max()) >= vocab_size):
                return f"{name} outside the target's vocabulary of {vocab_size}"
        if self.end_pos + 1 > max_positions:
            return f"positions up to {self.end_pos} beyond the target's {max_positions}"
        if not self.features.is_floating_point() or not self.final_hidden.is_floating_point():
            return "features are not floating point"
        return None

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency (shapes, dtypes, non-finite values)."""
        check_rows("span", self.first_pos, self.tokens, self.features, self.final_hidden)
        n = self.num_rows
        for name in PER_ROW:
            t = getattr(self, name)
            if t.shape != (n,) or t.dtype != PER_ROW_DTYPES[name]:
                raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, expected {PER_ROW_DTYPES[name]} ({n},)")
        for name in ("features", "final_hidden", "draft_prob"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise ValueError(f"{name} has non-finite values")


def _rows_info(records: Sequence[CaptureRecord]) -> dict[str, torch.Tensor]:
    """The per-row arrays (`PER_ROW`) of a span's records, built on numpy in one pass: per
    record its drafts as `CaptureRecord.row_drafts` gives them, and its round's values on each
    of its rows. The trainer's reader builds these for every record it receives, on the serving
    machine's cores: per-record torch calls (eight `torch.full` each) cost it ~30 us a record."""
    counts = [r.num_rows for r in records]
    total = sum(counts)
    accepted = np.full(total, -1, dtype=np.int8)
    draft_token = np.full(total, -1, dtype=np.int64)
    draft_prob = np.zeros(total, dtype=np.float32)
    lo = 0
    for r, n in zip(records, counts):
        k, a = r.num_steps, r.accept_len
        if not r.is_prefill and k > 0:  # `row_drafts`: rows before the first rejected draft, and it
            m = min(a + 1, k)
            accepted[lo:lo + a] = 1
            if a < k:
                accepted[lo + a] = 0
            draft_token[lo:lo + m] = r.draft_tokens[:m].numpy()
            draft_prob[lo:lo + m] = r.draft_probs[:m].numpy()
        lo += n
    per_record = {name: [getattr(r, name) for r in records]
                  for name in ("num_steps", "batch_size", "draft_version", "is_prefill", "timestamp")}
    out = {"accepted": accepted, "draft_token": draft_token, "draft_prob": draft_prob}
    for name, values in per_record.items():
        out[name] = np.repeat(np.array(values, dtype=NUMPY_ROW_DTYPES[name]), counts)
    return {name: torch.from_numpy(a) for name, a in out.items()}
