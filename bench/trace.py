"""Traffic traces: what the demo and `bench e2e` replay against a server, in file order.

A trace is a JSONL file, one request a line:

    {"messages": [{"role": "user", "content": "..."}], "tag": "chat", "max_tokens": 64}
    {"prompt": "def add(a, b):", "tag": "code"}

`messages` (chat, through the model's template) or `prompt` (raw completion), exactly one;
optional `tag` (the traffic tag the server sees, default ""), `max_tokens` (default: the
replayer's) and `phase` (default: the tag). Phases are runs of consecutive lines with the same
phase; the demo reports each one separately. Lines are read through `online_spec.jsonl`;
validation names the file and line of anything wrong.

`build_drift_trace(path, n_chat, n_code, n_mix, seed)` writes the built-in drifting trace:
held-out ShareGPT chat conversations (phase "chat"; no programming: `online_spec.data.
is_code_conversation`), then held-out HumanEval code (phase "code"), then a mix
(phase "mix", lines tagged "chat" or "code"). With `shape="return"` the third phase goes back to
chat instead (phase "chat-return", tagged "chat", conversations the first phase did not serve):
the trace that asks whether adaptation to code cost the chat acceptance the first phase had.
Held-out, so a head pretrained on ShareGPT's train split never saw these conversations.

    python -c "from bench.trace import build_drift_trace; build_drift_trace('t.jsonl', 16, 16, 16, 0)"
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from online_spec.advice import warn
from online_spec.drift import MIX_TAG, MIX_TAG_RESERVED
from online_spec.jsonl import JsonLinesError, parse_json_line, read_json_file, write_json_lines

log = logging.getLogger(__name__)

KEYS = {"messages", "prompt", "tag", "max_tokens", "phase"}

# A malformed trace (bad JSON, a bad field, no requests): one type with every JSON-lines reader.
TraceError = JsonLinesError


@dataclass(frozen=True)
class TraceItem:
    index: int
    """0-based position in the trace (file order = serving order)."""
    messages: list[dict] | None
    prompt: str | None
    tag: str
    phase: str
    max_tokens: int | None


def parse_line(raw: str, index: int, where: str = "<trace>") -> TraceItem:
    """One JSONL line -> TraceItem, or TraceError naming `where:line`."""
    at = f"{where}:{index + 1}"
    return trace_item(parse_json_line(raw, at), index, at)


def trace_item(obj: dict, index: int, at: str) -> TraceItem:
    """One trace line's object -> TraceItem, or TraceError naming `at` (file:line)."""
    unknown = set(obj) - KEYS
    if unknown:
        raise TraceError(f"{at}: unknown key(s) {sorted(unknown)}; allowed: {sorted(KEYS)}")
    has_m, has_p = "messages" in obj, "prompt" in obj
    if has_m == has_p:
        raise TraceError(f"{at}: needs exactly one of 'messages' or 'prompt'")
    messages = prompt = None
    if has_m:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise TraceError(f"{at}: 'messages' must be a non-empty list")
        for j, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str)):
                raise TraceError(f"{at}: messages[{j}] must be {{'role': system|user|assistant, 'content': str}}")
    else:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise TraceError(f"{at}: 'prompt' must be a non-empty string")
    tag = obj.get("tag", "")
    if not isinstance(tag, str):
        raise TraceError(f"{at}: 'tag' must be a string")
    if tag == MIX_TAG:  # the server refuses it
        raise TraceError(f"{at}: {MIX_TAG_RESERVED}")
    phase = obj.get("phase", tag)
    if not isinstance(phase, str):
        raise TraceError(f"{at}: 'phase' must be a string")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise TraceError(f"{at}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    return TraceItem(index, messages, prompt, tag, phase, max_tokens)


def load_trace(path: str | Path) -> list[TraceItem]:
    """Every non-blank line of a JSONL trace, validated; an empty trace is an error."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    items = [trace_item(obj, k, where) for k, (where, obj) in enumerate(read_json_file(path))]
    if not items:
        raise TraceError(f"{path}: the trace has no requests")
    return items


def phases(items: list[TraceItem]) -> list[tuple[str, list[TraceItem]]]:
    """Runs of consecutive items with the same phase, in order: [(phase, items), ...]."""
    return [(name, list(run)) for name, run in groupby(items, key=lambda it: it.phase)]


SHAPES = ("drift", "return")  # the built-in traces: chat -> code -> mix, chat -> code -> chat-return
RETURN_PHASE = "chat-return"


def build_drift_trace(path: str | Path, n_chat: int, n_code: int, n_mix: int, seed: int = 0,
                      max_tokens: int | None = None, max_prompt_tokens: int = 200, shape: str = "drift") -> Path:
    """Write a built-in trace as JSONL; returns the path. shape "drift": chat, then code, then
    `n_mix` lines of a mix; "return": chat, then code, then `n_mix` lines of chat again (phase
    `RETURN_PHASE`, conversations the chat phase did not serve)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: must be one of {', '.join(SHAPES)}, got {shape!r}")
    # torch and transformers come with these; reading a trace needs neither
    from transformers import AutoTokenizer

    from online_spec.data import humaneval_conversations, sharegpt_conversations
    from online_spec.target import prepare_smollm2

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    n_mix_chat = (n_mix + 1) // 2 if shape == "drift" else n_mix  # the third phase's chat lines
    n_chat_total = n_chat + n_mix_chat
    n_code_total = n_code + (n_mix - n_mix_chat)
    chat = sharegpt_conversations(limit=n_chat_total, seed=seed, split="heldout", topic="chat",
                                  max_prompt_tokens=max_prompt_tokens, tokenizer=tok)
    code = humaneval_conversations(split="heldout", seed=seed)
    if len(chat) < n_chat_total:
        # Fewer held-out chat conversations fit than asked (639 at 200 prompt tokens; the demo's
        # default asks 900). The mix keeps its own, never-served ones; the chat phase gets the rest
        # (a demo serves only part of each phase's lines in its time budget anyway).
        if len(chat) <= n_mix_chat:
            raise TraceError(f"only {len(chat)} held-out ShareGPT chat conversations fit; the third phase "
                             f"alone asks for {n_mix_chat}")
        warn(log, "trace_chat_short",
             f"only {len(chat)} held-out ShareGPT chat conversations fit in {max_prompt_tokens} prompt tokens: "
             f"the chat phase gets {len(chat) - n_mix_chat} lines instead of {n_chat}",
             cost="none while the machine serves fewer chat lines than that in the chat phase's time (the demo "
                  "skips a phase's leftover lines by design; a 2-core CPU serves ~100 a minute); on a faster "
                  "machine the chat phase ends early and the code phase starts sooner",
             fix="nothing on a CPU; on a fast machine pass --trace with more chat lines, or fewer "
                 "--requests-per-minute so the phases stay balanced")
        n_chat = len(chat) - n_mix_chat
    code = [code[i % len(code)] for i in range(n_code_total)]  # HumanEval held-out has ~40 tasks
    lines = [{"messages": c[:1], "tag": "chat", "phase": "chat"} for c in chat[:n_chat]]
    lines += [{"messages": c[:1], "tag": "code", "phase": "code"} for c in code[:n_code]]
    if shape == "return":
        lines += [{"messages": c[:1], "tag": "chat", "phase": RETURN_PHASE} for c in chat[n_chat:]]
    else:
        mix = [{"messages": c[:1], "tag": "chat", "phase": "mix"} for c in chat[n_chat:]]
        mix += [{"messages": c[:1], "tag": "code", "phase": "mix"} for c in code[n_code:]]
        random.Random(seed).shuffle(mix)
        lines += mix
    if max_tokens is not None:
        for line in lines:
            line["max_tokens"] = max_tokens
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_json_lines(tmp, lines)
    tmp.replace(path)
    return path
