"""Teacher-forced capture: real conversations through the target -> the engine's capture records.

In: a target and chat conversations (`online_spec.data`). Each conversation is rendered whole with
the tokenizer's chat template, truncated to `max_len` tokens and run through the target once
(no generation); it becomes ONE `CaptureRecord` with `is_prefill=True` — the same type the engine
streams for a prefill, so offline and live data reach the trainer the same way. Out: records,
persisted as Hugging Face `datasets` shards (Arrow) with `save_records` / `load_records`.

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

import datasets
import numpy as np
import torch

from online_spec.capture import CaptureRecord
from online_spec.kvcache import AttentionBatch

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


# -- persistence: the one place that knows the on-disk format ----------------------------------
def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


def _from_bytes(b: bytes, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype=np.int16).copy()).view(STORE_DTYPE).view(rows, -1)


def save_records(records: Iterable[CaptureRecord], out: str | Path, shard_tokens: int = 100_000) -> dict:
    """Write records as datasets shards `out/shard-NNNNN` (each written whole, then renamed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows, n_tok, shard, stats = [], 0, 0, {"records": 0, "tokens": 0}

    def write():
        nonlocal rows, n_tok, shard
        tmp, final = out / f".tmp-shard-{shard:05d}", out / f"shard-{shard:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        rows, n_tok, shard = [], 0, shard + 1

    for r in records:
        rows.append({"request_id": r.request_id, "tag": r.tag, "first_pos": r.first_pos,
                     "tokens": r.tokens.tolist(), "features": _to_bytes(r.features.to(STORE_DTYPE)),
                     "final_hidden": _to_bytes(r.final_hidden.to(STORE_DTYPE))})
        n_tok += r.num_rows
        stats["records"] += 1
        stats["tokens"] += r.num_rows
        if n_tok >= shard_tokens:
            write()
    if rows:
        write()
    (out / "records.json").write_text(json.dumps(stats))
    return stats


def load_records(path: str | Path) -> list[CaptureRecord]:
    """Read back what `save_records` wrote (all shards, in order)."""
    path = Path(path)
    out = []
    for shard in sorted(path.glob("shard-*")):
        ds = datasets.load_from_disk(str(shard))
        for row in ds:
            n = len(row["tokens"]) - 1
            out.append(CaptureRecord(request_id=row["request_id"], first_pos=row["first_pos"],
                                     tokens=torch.tensor(row["tokens"], dtype=torch.long),
                                     features=_from_bytes(row["features"], n),
                                     final_hidden=_from_bytes(row["final_hidden"], n),
                                     is_prefill=True, tag=row["tag"]))
    return out


def records_complete(path: str | Path) -> bool:
    """True when `save_records` finished writing `path` (resumable runs skip the capture)."""
    return (Path(path) / "records.json").exists()
