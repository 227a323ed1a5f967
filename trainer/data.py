"""Teacher-forced capture: real conversations through the target -> the engine's capture records.

In: a target and chat conversations (`online_spec.data`). Each conversation is rendered whole with
the tokenizer's chat template, truncated to `max_len` tokens and run through the target once
(no generation); it becomes ONE `CaptureRecord` with `is_prefill=True` — the same type the engine
streams for a prefill, so offline and live data reach the trainer the same way. Out: records,
persisted with `save_records` / `load_records` as the collector's span shards (`collector.shards`:
HF `datasets`, Arrow), the same format as the replay buffer.

Hidden states are stored in bf16 ((3H + H) · 2 bytes = 4.6 KB per token for SmolLM2: 1M tokens ≈
4.6 GB). Pretraining therefore captures once into the run directory and trains for several
epochs over it rather than streaming fresh data; the budget is `--tokens`.

    recs = capture_conversations(target, convs, max_len=1024, tag="sharegpt")
    save_records(recs, "run/records/train");  recs = load_records("run/records/train")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from collector.span import CaptureSpan
from online_spec.capture import CaptureRecord
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams
from serving.requests import Request

STORE_DTYPE = torch.bfloat16


def encode_conversation(tokenizer, messages: list[dict], max_len: int) -> list[int]:
    """The whole conversation through the chat template, truncated to max_len tokens."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)[:max_len]


def capture_tokens(target, token_lists: list[list[int]], request_ids: list[str], tag: str = "") -> list[CaptureRecord]:
    """One target forward over a padded batch -> one prefill record per sequence (n-1 rows:
    the last token is the one 'committed after the last row'). The forward runs in inference
    mode; the copies made here are ordinary tensors, usable in autograd later."""
    B, T = len(token_lists), max(len(t) for t in token_lists)
    toks = torch.zeros(B, T, dtype=torch.long)
    for b, t in enumerate(token_lists):
        toks[b, :len(t)] = torch.tensor(t)
    cache = target.new_cache(B, T)
    # Padding sits after each sequence's end, so causal attention keeps it out of real rows.
    _, feats, final = target.forward(toks.to(target.device), AttentionBatch([0] * B, T, target.device), cache,
                                     logits_rows=None)
    out = []
    for b, t in enumerate(token_lists):
        n = len(t) - 1
        out.append(CaptureRecord(request_id=request_ids[b], first_pos=0, tokens=toks[b, :n + 1].clone(),
                                 features=feats[b, :n].to("cpu", STORE_DTYPE).clone(),
                                 final_hidden=final[b, :n].to("cpu", STORE_DTYPE).clone(),
                                 is_prefill=True, tag=tag))
    return out


def capture_conversations(target, conversations: Iterable[list[dict]], max_len: int, tag: str = "",
                          id_prefix: str = "conv", batch_tokens: int = 4096,
                          max_tokens: int | None = None) -> Iterator[CaptureRecord]:
    """Teacher-forced records of conversations, batched by length, until max_tokens rows."""
    pending: list[tuple[str, list[int]]] = []
    total = 0

    def flush():
        ids = [p[0] for p in pending]
        recs = capture_tokens(target, [p[1] for p in pending], ids, tag)
        pending.clear()
        return recs

    for i, conv in enumerate(conversations):
        ids = encode_conversation(target.tokenizer, conv, max_len)
        if len(ids) < 3:
            continue
        if max_tokens is not None and total + len(ids) - 1 > max_tokens:
            ids = ids[:max_tokens - total + 1]
            if len(ids) < 3:
                break
        pending.append((f"{id_prefix}-{i}", ids))
        total += len(ids) - 1
        longest = max(len(p[1]) for p in pending)
        if longest * len(pending) >= batch_tokens:
            yield from flush()
        if max_tokens is not None and total >= max_tokens:
            break
    if pending:
        yield from flush()


class SpanSink:
    """The engine's `CaptureSink`, in process: keeps every request's records and joins them into
    one `CaptureSpan` (prompt prefill + each decode round) when the request ends."""

    def __init__(self):
        self.pending: dict[str, list[CaptureRecord]] = {}
        self.done: list = []

    def should_capture(self, request_id: str) -> bool:
        return True

    def submit(self, records: list[CaptureRecord]) -> None:
        for r in records:
            self.pending.setdefault(r.request_id, []).append(_detached(r))

    def end_request(self, request_id: str) -> None:
        recs = self.pending.pop(request_id, [])
        if recs:
            self.done.append(CaptureSpan.from_records(recs))


def _detached(r: CaptureRecord) -> CaptureRecord:
    r.features = r.features.to("cpu", STORE_DTYPE).clone()
    r.final_hidden = r.final_hidden.to("cpu", STORE_DTYPE).clone()
    return r


def generate_records(target, prompts: Iterable[list[int]], max_new_tokens: int, tag: str = "",
                     id_prefix: str = "gen", max_batch: int = 64, max_tokens: int | None = None,
                     max_len: int = 1024) -> Iterator:
    """Self-distillation capture: the target's OWN greedy continuations of `prompts` (what a head
    drafts against at serving time, where greedy verify compares with the target's argmax).
    Plain batched decoding through `serving.engine.Engine` (K=0); its capture records carry the
    features of every committed row at no extra forward. Yields one `CaptureSpan` per request
    (prompt rows then generated rows) until `max_tokens` rows."""
    # transformers comes with the engine: teacher-forced capture needs only torch
    from serving.engine import Engine, EngineConfig

    sink = SpanSink()
    eng = Engine(target, None, EngineConfig(max_batch=max_batch, max_len=max_len, max_steps=0, num_steps=0),
                 publisher=sink)
    params = SamplingParams(max_tokens=max_new_tokens)
    total, it = 0, iter(enumerate(prompts))
    while max_tokens is None or total < max_tokens:
        while len(eng.waiting) + len(eng.running) < 2 * max_batch:
            nxt = next(it, None)
            if nxt is None:
                break
            i, p = nxt
            if len(p) + max_new_tokens + 2 < max_len:
                eng.add_request(Request(list(p), params, request_id=f"{id_prefix}-{i}", tag=tag))
        if not eng.has_work():
            break
        eng.step()
        while sink.done and (max_tokens is None or total < max_tokens):
            span = sink.done.pop(0)
            total += span.num_rows
            yield span


# -- persistence: the collector's span shards, the one on-disk format for live and offline data ---
def save_records(records: Iterable[CaptureRecord], out: str | Path, shard_bytes: int = 256 << 20) -> dict:
    """Write records as `collector.shards` span shards under `out` (each record one span), then
    mark the directory complete. An incomplete directory from an interrupted run is replaced."""
    from collector.shards import save_spans  # datasets (Arrow): only where records are stored

    out = Path(out)
    if out.exists() and not records_complete(out):
        shutil.rmtree(out)
    stats = {"records": 0, "tokens": 0}

    def spans():
        for r in records:
            stats["records"] += 1
            stats["tokens"] += r.num_rows
            yield r if isinstance(r, CaptureSpan) else CaptureSpan.from_records([r])
    save_spans(spans(), out, shard_bytes=shard_bytes)
    (out / "records.json").write_text(json.dumps(stats))
    return stats


def load_records(path: str | Path) -> list:
    """The spans `save_records` (or the replay buffer) wrote: `collector.span.CaptureSpan`s,
    which the trainer consumes like records (first_pos, tokens, features, final_hidden)."""
    from collector.shards import load_spans  # datasets: see save_records

    return load_spans(path)


def records_complete(path: str | Path) -> bool:
    """True when `save_records` finished writing `path` (resumable runs skip the capture)."""
    return (Path(path) / "records.json").exists()
