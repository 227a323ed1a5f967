"""Capture inside SGLang: turn a committed verify round (or prefill chunk) into `CaptureRecord`s.

`CaptureHooks` holds the hook functions `serving.sglang_plugin` registers (AROUND
`SchedulerBatchResultProcessor.process_batch_result_decode` / `_prefill`, AFTER
`SchedulerWeightUpdaterManager.update_weights_from_tensor`). Each AROUND hook snapshots, per
request, what SGLang had committed before the original runs, lets SGLang commit, then reads the
rows of the committed positions from `result.logits_output` (features = `.hidden_states`, 3H;
final_hidden = `.last_hidden_states`, H), copies them to CPU and hands the records to
`CapturePublisher.submit` (never blocks). The publisher is created lazily in the scheduler
process; with tensor parallelism every rank runs these hooks, the first binds the endpoint and
the others fail to bind, log it once and disable their capture (rank selection: not done yet).

What SGLang 0.5.23 does not expose, and how records say so: the rejected drafts and the draft
probabilities are not in the verify result, so a verify record carries num_steps = accept_len,
draft_tokens = the accepted drafts (equal to the committed tokens) and draft_probs = 0, with
tag "sglang". Any failure disables capture (logged once); the server keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from collector.publisher import CapturePublisher, PublisherConfig
from online_spec.capture import CaptureRecord
from serving.sglang_adaptive import LIVE_POLICIES

log = logging.getLogger(__name__)


def verify_record(rid: str, seq_before: list[int], emitted: list[int], features: torch.Tensor,
                  final_hidden: torch.Tensor, batch_size: int, draft_version: int) -> CaptureRecord:
    """Rows = the round's verify positions whose outputs were committed: the last committed
    token (position len(seq_before) - 1) and the accepted drafts; emitted includes the bonus."""
    n = len(emitted)
    accepted = emitted[: n - 1]
    return CaptureRecord(
        request_id=rid, first_pos=len(seq_before) - 1,
        tokens=torch.tensor([seq_before[-1], *emitted], dtype=torch.long),
        features=features, final_hidden=final_hidden,
        draft_tokens=torch.tensor(accepted, dtype=torch.long), draft_probs=torch.zeros(n - 1),
        accept_len=n - 1, num_steps=n - 1, batch_size=batch_size, draft_version=draft_version, tag="sglang")


def prefill_record(rid: str, fill: list[int], first_pos: int, next_token: int | None, features: torch.Tensor,
                   final_hidden: torch.Tensor, batch_size: int, draft_version: int) -> CaptureRecord | None:
    """Rows = positions first_pos .. first_pos+L-1 of this chunk; the token after the last row is
    the next input token, or (last chunk) the token SGLang sampled. None if it is not known."""
    rows = features.shape[0]
    end = first_pos + rows
    after = fill[end] if end < len(fill) else next_token
    if after is None or end > len(fill):
        return None
    return CaptureRecord(request_id=rid, first_pos=first_pos,
                         tokens=torch.tensor([*fill[first_pos:end], after], dtype=torch.long),
                         features=features, final_hidden=final_hidden, batch_size=batch_size,
                         draft_version=draft_version, is_prefill=True, tag="sglang")


class CaptureHooks:
    """The plugin's hook functions and the state they share (publisher, sampled requests)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.draft_version = cfg.draft_version
        self.enabled = cfg.capture
        self._publisher = None
        self._sampled: dict[str, bool] = {}
        self.skipped_no_hidden = 0

    # ---- hooks (signatures of SGLang 0.5.23's targets, `original` first for AROUND) ----------

    def around_decode(self, original, processor, batch, result):
        snap = self._guard(self._snapshot, batch) if self._active(batch, spec_only=True) else None
        out = original(processor, batch, result)
        if snap is not None:
            self._guard(self._after_decode, snap, batch, result)
        return out

    def around_prefill(self, original, processor, batch, result):
        snap = self._guard(self._snapshot, batch) if self._active(batch, spec_only=True) else None
        out = original(processor, batch, result)
        if snap is not None:
            self._guard(self._after_prefill, snap, batch, result)
        return out

    def after_weight_update(self, result, manager, recv_req):
        """A new draft head is live: re-warm every online-spec policy in this process."""
        if getattr(result, "success", False) and recv_req.selector in ("draft", "all"):
            for policy in list(LIVE_POLICIES):
                policy.rewarm()
            if recv_req.weight_version and str(recv_req.weight_version).isdigit():
                self.draft_version = int(recv_req.weight_version)
        return None

    # ---- mechanics ----------------------------------------------------------------------------

    def _active(self, batch, spec_only: bool) -> bool:
        return self.enabled and not (spec_only and batch.spec_algorithm.is_none())

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # never let capture take the server down
            self.enabled = False
            log.exception("online-spec capture failed; capture disabled, the server keeps serving")
            return None

    def _snapshot(self, batch) -> list[tuple[int, int, int]]:
        """Per request: (outputs committed before, prefix_len, skip flag)."""
        return [(len(r.output_ids), r.prefix_len, int(r.finished() or r.is_retracted)) for r in batch.reqs]

    def _publisher_or_none(self):
        if self._publisher is None:
            self._publisher = CapturePublisher(PublisherConfig(endpoint=self.cfg.endpoint,
                                                               sample_fraction=self.cfg.sample_fraction))
            log.info("online-spec capture publishing on %s", self._publisher.endpoint)
        return self._publisher

    def _take(self, pub, rid: str) -> bool:
        if rid not in self._sampled:
            self._sampled[rid] = pub.should_capture(rid)
        return self._sampled[rid]

    def _rows(self, result):
        lo = result.logits_output
        feats, final = lo.hidden_states, lo.last_hidden_states
        if feats is None or final is None or feats.shape[0] != final.shape[0]:
            self.skipped_no_hidden += 1
            return None, None
        return feats, final

    def _after_decode(self, snap, batch, result) -> None:
        feats, final = self._rows(result)
        if feats is None:
            return
        stride = result.speculative_output_stride or result.speculative_num_draft_tokens
        pub, records, bs = self._publisher_or_none(), [], len(batch.reqs)
        for i, (req, (before, _, skip)) in enumerate(zip(batch.reqs, snap)):
            n = len(req.output_ids) - before
            if skip or n <= 0 or not self._take(pub, req.rid) or (i + 1) * stride > feats.shape[0]:
                continue
            seq = list(req.origin_input_ids) + list(req.output_ids[:before])
            rows = slice(i * stride, i * stride + n)
            records.append(verify_record(req.rid, seq, list(req.output_ids[before:]), feats[rows].to("cpu"),
                                         final[rows].to("cpu"), bs, self.draft_version))
            if req.finished():
                pub.end_request(req.rid)
                self._sampled.pop(req.rid, None)
        pub.submit(records)

    def _after_prefill(self, snap, batch, result) -> None:
        feats, final = self._rows(result)
        lens = result.extend_input_len_per_req
        if feats is None or lens is None or feats.shape[0] != sum(lens):
            return  # not full-mode rows: nothing to align safely
        pub, records, bs, offset = self._publisher_or_none(), [], len(batch.reqs), 0
        for req, (before, prefix_len, skip), n in zip(batch.reqs, snap, lens):
            rows = slice(offset, offset + n)
            offset += n
            if skip or n <= 0 or not self._take(pub, req.rid):
                continue
            fill = list(req.origin_input_ids) + list(req.output_ids[:before])
            next_token = req.output_ids[before] if len(req.output_ids) > before else None
            rec = prefill_record(req.rid, fill, prefix_len, next_token, feats[rows].to("cpu"),
                                 final[rows].to("cpu"), bs, self.draft_version)
            if rec is not None:
                records.append(rec)
        pub.submit(records)
