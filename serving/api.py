"""HTTP request schemas and response bodies: OpenAI completions/chat and SGLang's /generate.

In: the JSON an OpenAI client (or SGLang client) sends, validated by pydantic. Out: the engine's
`SamplingParams` (`sampling_params()`), and the response dicts / SSE lines each API expects.
Fields a client may send that we cannot honour (n > 1, logprobs, penalties) are refused with
`ApiError` (-> 400 and a message), never silently ignored.

SGLang's /generate (`GenerateRequest`): `{"text" | "input_ids", "sampling_params": {...},
"stream"}` -> `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "spec_verify_ct", "spec_accept_length", ...}}`; SGLang's conventions kept:
`finish_reason` is an object (`{"type": "length", "length": n}` / `{"type": "stop", "matched": x}`),
`spec_accept_length` is tokens per verify round (bonus included), streamed `text` is cumulative.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from online_spec.config import ConfigError
from online_spec.sampling import SamplingParams


class ApiError(Exception):
    """A request the server will not run: HTTP status, message, OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def _stop_list(stop: str | list[str] | None) -> list[str]:
    """The stop strings, empty ones left out (OpenAI clients send "" for none)."""
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _make_params(**kw) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ConfigError as e:
        raise ApiError(400, str(e), param=str(e).split(":")[0]) from None


class _OpenAIRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    tag: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: only n=1", param="n")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ApiError(400, f"{name} is not supported (must be 0)", param=name)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, f"max_tokens: must be >= 1, got {self.max_tokens}", param="max_tokens")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.check_supported()
        return _make_params(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            max_tokens=self.max_tokens or default_max_tokens, stop=_stop_list(self.stop),
                            seed=self.seed, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def prompt_ids(self, tokenizer) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and p and not all(isinstance(x, int) for x in p):
            raise ApiError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        ids = list(p) if isinstance(p, list) else tokenizer.encode(p)
        if not ids:
            raise ApiError(400, "empty prompt", param="prompt")
        return ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ApiError(400, f"content part of type {part.get('type')!r} is not supported", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class GenerateSampling(BaseModel):
    """SGLang's sampling_params (the subset this engine implements)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    n: int = 1


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    rid: str | None = None
    tag: str | None = None

    def prompt_ids(self, tokenizer) -> list[int]:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", param="text")
        if isinstance(self.text, list) or (self.input_ids and isinstance(self.input_ids[0], list)):
            raise ApiError(400, "batched /generate is not supported: send one prompt per request", param="text")
        ids = list(self.input_ids) if self.input_ids is not None else tokenizer.encode(self.text)
        if not ids:
            raise ApiError(400, "empty prompt", param="text")
        return ids

    def params(self) -> SamplingParams:
        sp = self.sampling_params
        if sp.n != 1:
            raise ApiError(400, f"n={sp.n} is not supported: only n=1", param="n")
        if sp.max_new_tokens < 1:
            raise ApiError(400, f"max_new_tokens: must be >= 1, got {sp.max_new_tokens}", param="max_new_tokens")
        return _make_params(temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                            max_tokens=sp.max_new_tokens, stop=_stop_list(sp.stop),
                            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
                            ignore_eos=sp.ignore_eos)


# -- response bodies -----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(rid: str, obj: str, model: str, use: dict) -> dict:
    """The last streamed chunk when stream_options.include_usage is set: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def openai_finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", None: None}.get(reason, reason)


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None,
                    chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(finish)}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str | None, finish: str | None, use: dict | None,
              chunk: bool = False, first: bool = False) -> dict:
    if chunk:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": openai_finish_reason(finish)}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": openai_finish_reason(finish)}
        obj = "chat.completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def sglang_finish_reason(reason: str | None, matched_stop: str | None, last_token: int | None,
                         completion_tokens: int) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched_stop if matched_stop is not None else last_token}
    return {"type": "abort", "message": reason}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
