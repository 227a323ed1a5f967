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

The geometry of rows is defined here once, for the record and for the span the collector joins
records into (`collector.span.CaptureSpan`): `row_shapes` (n rows -> tokens n + 1, features 3H,
final_hidden H), `check_rows` (both types' validation of it), `adjacency_error` (when a record
directly continues another), `CaptureRecord.row_drafts` (per row: was its next token drafted,
accepted, rejected). The wire codec (`collector.wire`) and the replay buffer import this type;
the engine makes it, the trainer consumes it, offline or live alike.

`CaptureRound` is how the engine hands over one round's records without building them: the
round's own tensors (on a CPU the verify's, fresh each round; on CUDA views of a pinned host
slot the engine reuses only once nothing holds them), which rows each record takes, and
a few Python values per record. It is a sequence of `CaptureRecord`s made on first access, on
whichever thread reads it (the publisher's sender thread), after the host copy of the rows it
may wait for (`ready`, a CUDA event) has landed; a sink that iterates it sees plain records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

FEATURE_LAYERS = 3
"""Target layers EAGLE-3 captures; a row's features are their hidden states concatenated (3H)."""

MAX_ID_CHARS = 1024
"""Longest request id and traffic tag a record carries (the wire refuses longer; the server
refuses them at the door, so everything it serves can be captured)."""
MAX_VERSION = 2**62
"""Largest head version (`draft_version`) a record carries; swaps beyond it are refused."""
MAX_POSITION = 2**40
"""Largest first position a record carries."""


def row_shapes(num_rows: int, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of `num_rows` committed rows: tokens [n + 1] (the last one is the token the target
    committed after the last row), features [n, 3H], final_hidden [n, H]."""
    return {"tokens": (num_rows + 1,), "features": (num_rows, FEATURE_LAYERS * hidden_size),
            "final_hidden": (num_rows, hidden_size)}


def check_rows(what: str, first_pos: int, tokens: torch.Tensor, features: torch.Tensor,
               final_hidden: torch.Tensor) -> None:
    """Raise ValueError naming the first way the rows of `what` (a record, a span) break
    `row_shapes`; the number of rows is the features' first dimension."""
    n = int(features.shape[0]) if features.dim() > 0 else 0
    if n < 1:
        raise ValueError(f"{what} has no rows")
    if first_pos < 0:
        raise ValueError(f"first_pos {first_pos} < 0")
    hidden = int(final_hidden.shape[-1]) if final_hidden.dim() > 0 else 0
    want = row_shapes(n, hidden)
    for name, t in (("tokens", tokens), ("final_hidden", final_hidden), ("features", features)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} shape {tuple(t.shape)}, expected {want[name]} for {n} rows of hidden size {hidden}")


def adjacency_error(prev, rec) -> str | None:
    """Why `rec` does not directly continue `prev` (records or spans: same request, starting at
    `prev.end_pos`, its first token `prev`'s last, same hidden size and dtype); None if it does."""
    if rec.request_id != prev.request_id:
        return f"records of requests {prev.request_id!r} and {rec.request_id!r} in one span"
    if rec.first_pos != prev.end_pos:
        return (f"request {rec.request_id!r}: record at position {rec.first_pos} does not follow the previous "
                f"record ending at {prev.end_pos}")
    if int(rec.tokens[0]) != int(prev.tokens[-1]):
        return (f"request {rec.request_id!r}: token at position {rec.first_pos} is {int(rec.tokens[0])} here but "
                f"{int(prev.tokens[-1])} in the previous record")
    if rec.features.dtype != prev.features.dtype or rec.final_hidden.shape[1] != prev.final_hidden.shape[1]:
        return f"request {rec.request_id!r}: records differ in hidden size or dtype"
    return None


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

    @property
    def hidden_size(self) -> int:
        return int(self.final_hidden.shape[1])

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency; used by both ends of the stream."""
        check_rows("capture record", self.first_pos, self.tokens, self.features, self.final_hidden)
        r = self.num_rows
        k = self.num_steps
        if k < 0 or self.draft_tokens.numel() != k or self.draft_probs.numel() != k:
            raise ValueError(f"draft_tokens/draft_probs must have num_steps={k} entries")
        if not 0 <= self.accept_len <= k:
            raise ValueError(f"accept_len {self.accept_len} outside 0..num_steps={k}")
        if not self.is_prefill and r != self.accept_len + 1:
            raise ValueError(f"a verify record has accept_len+1 = {self.accept_len + 1} rows, got {r}")

    def row_drafts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row i, what the live head drafted for position first_pos + i + 1: accepted int8 [n]
        (1 accepted, 0 rejected, -1 nothing drafted), draft_token int64 [n] (-1: none), draft_prob
        float32 [n] (0: none). Row j of a verify round with a accepted drafts (a + 1 rows): j < a
        predicted an accepted draft; j == a predicted the rejected draft d[a] if a < K, and nothing
        if all K drafts were accepted (its label is the bonus token). Prefill rows and plain
        decode (K = 0) had no drafts. Drafts after the first rejected one belong to no row."""
        n = self.num_rows
        accepted = torch.full((n,), -1, dtype=torch.int8)
        draft_token = torch.full((n,), -1, dtype=torch.int64)
        draft_prob = torch.zeros(n, dtype=torch.float32)
        if not self.is_prefill and self.num_steps > 0:
            m = min(self.accept_len + 1, self.num_steps)  # rows that had a draft for their next token
            accepted[:self.accept_len] = 1
            if self.accept_len < self.num_steps:
                accepted[self.accept_len] = 0
            draft_token[:m] = self.draft_tokens[:m].to(torch.int64)
            draft_prob[:m] = self.draft_probs[:m].to(torch.float32)
        return accepted, draft_token, draft_prob


class RoundRow(NamedTuple):
    """One record of a `CaptureRound`: its request, where its rows start and what the round
    committed. `tokens` are the committed ids after the first row's token (accepted drafts and
    the bonus; a prefill's: the prompt's after the first and the first generated token)."""

    request_id: str
    first_pos: int
    slot: int  # row of the round's [B, ...] tensors (verify inputs, drafts)
    tokens: list[int]
    accept_len: int
    num_steps: int
    tag: str


class CaptureRound(Sequence[CaptureRecord]):
    """One engine round's capture records, built on first access (see the module docstring).

    features, final_hidden: [N, 3H] / [N, H] host tensors holding every record's rows in record
    order, or, with `row_index`, [M, ...] tensors of which rows row_index[i] are the records'
    rows (the engine's verify output, gathered here on the reader's thread). first_tokens: [B]
    the token at each slot's first row (the verify's input), or None when each row's `tokens`
    starts with it. drafts, draft_probs: [B, K] the round's drafts and their probabilities (a
    record takes its first num_steps). ready: an event (`.synchronize()`) the rows' host copy
    completes with, or None. Every tensor is the round's own: the engine never writes it again
    while the round (or a slice of it) is alive."""

    def __init__(self, rows: Sequence[RoundRow], features, final_hidden, *, row_index: list[int] | None = None,
                 first_tokens=None, drafts=None, draft_probs=None, batch_size: int = 1, draft_version: int = 0,
                 is_prefill: bool = False, ready=None, timestamp: float | None = None):
        self.rows = list(rows)
        self.features, self.final_hidden, self.row_index = features, final_hidden, row_index
        self.first_tokens, self.drafts, self.draft_probs = first_tokens, drafts, draft_probs
        self.batch_size, self.draft_version, self.is_prefill = batch_size, draft_version, is_prefill
        self.ready = ready
        self.timestamp = time.time() if timestamp is None else timestamp
        self._records: list[CaptureRecord] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):  # a shorter round, still unbuilt (the publisher drops a full queue's excess)
            picked = range(len(self.rows))[i]
            spans, r0 = [], 0  # each record's rows: its next n of the round's rows in record order (`_build`)
            for row in self.rows:
                n = len(row.tokens) - (1 if self.first_tokens is None else 0)
                spans.append(range(r0, r0 + n))
                r0 += n
            rows = [p for k in picked for p in spans[k]]
            index = rows if self.row_index is None else [self.row_index[p] for p in rows]
            return CaptureRound([self.rows[k] for k in picked], self.features, self.final_hidden, row_index=index,
                                first_tokens=self.first_tokens, drafts=self.drafts, draft_probs=self.draft_probs,
                                batch_size=self.batch_size, draft_version=self.draft_version,
                                is_prefill=self.is_prefill, ready=self.ready, timestamp=self.timestamp)
        return self.records()[i]

    def __iter__(self):
        return iter(self.records())

    def records(self) -> list[CaptureRecord]:
        """The records (built once; waits for `ready` first)."""
        if self._records is None:
            self._records = self._build()
        return self._records

    def host_rows(self) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """(features, final_hidden) of the records' rows in record order, and each slot's first
        token (None when each row's `tokens` starts with it), after `ready`: what `_build` and
        an encoder that builds no record (`collector.wire_round`) read."""
        if self.ready is not None:
            self.ready.synchronize()
        feats, final = self.features, self.final_hidden
        if self.row_index is not None:
            index = torch.tensor(self.row_index)
            feats, final = feats.index_select(0, index), final.index_select(0, index)
        return feats, final, None if self.first_tokens is None else self.first_tokens.tolist()

    def _build(self) -> list[CaptureRecord]:
        feats, final, firsts = self.host_rows()
        out, r0 = [], 0
        for row in self.rows:
            ids = row.tokens if firsts is None else [firsts[row.slot], *row.tokens]
            n = len(ids) - 1  # rows: every token but the last
            out.append(CaptureRecord(
                request_id=row.request_id, first_pos=row.first_pos, tokens=torch.tensor(ids, dtype=torch.long),
                features=feats[r0:r0 + n], final_hidden=final[r0:r0 + n],
                **({} if self.drafts is None else {"draft_tokens": self.drafts[row.slot, :row.num_steps],
                                                   "draft_probs": self.draft_probs[row.slot, :row.num_steps]}),
                accept_len=row.accept_len, num_steps=row.num_steps, batch_size=self.batch_size,
                draft_version=self.draft_version, is_prefill=self.is_prefill, timestamp=self.timestamp, tag=row.tag))
            r0 += n
        return out
