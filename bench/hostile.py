"""The hostile side of `bench soak`: inputs a client, an operator or a checkpoint can send, each with
the answer the server must give.

`HTTP_CASES`: requests to the HTTP API (parameters the engine cannot sample with, an oversized
body, a lone surrogate, deep nesting, ids and tags over 1,024 characters, a fresh tag every time,
malformed JSON, a client that goes away mid-stream). `CONTROL_CASES`: control requests (a wrong
token, garbage frames, versions beyond 2^62, a directory outside the allowed roots) and
checkpoints (huge-but-finite weights, a FIFO named model.safetensors, a config.json that is a
list), written once by `write_bad_heads`. Each case returns None when the server answered as it
must, else what it did instead.

    cases = HTTP_CASES; problem = await cases[i](client, n)            # httpx.AsyncClient
    problem = CONTROL_CASES[j](control_client, bad_heads)                # blocking: run in a thread
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import torch
from safetensors.torch import load_file, save_file

from serving.control_client import ControlClient, ControlError

BODY_LIMIT = 2 << 20  # the server's --max-body-bytes default


async def _expect(client: httpx.AsyncClient, path: str, content: bytes, status: int, headers=None) -> str | None:
    try:
        r = await client.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})
    except httpx.HTTPError as e:
        return f"{path}: {type(e).__name__}: {e}"
    if r.status_code != status or not r.headers.get("content-type", "").startswith("application/json"):
        return f"{path}: HTTP {r.status_code} ({r.text[:120]!r}), expected {status}"
    return None


def _completion(extra: str) -> bytes:
    return ('{"prompt": "hello", "max_tokens": 4, %s}' % extra).encode()


async def tiny_temperature(c, n):
    return await _expect(c, "/v1/completions", _completion('"temperature": 1e-40'), 400)


async def infinite_temperature(c, n):
    return await _expect(c, "/generate", b'{"text": "hi", "sampling_params": {"temperature": Infinity}}', 400)


async def huge_seed(c, n):
    return await _expect(c, "/v1/completions", _completion('"temperature": 0.7, "seed": 18446744073709551616'), 400)


async def oversized_body(c, n):
    return await _expect(c, "/v1/completions", _completion('"stop": "%s"' % ("x" * (BODY_LIMIT + 1))), 413)


async def lone_surrogate(c, n):
    return await _expect(c, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400)


async def deep_nesting(c, n):
    return await _expect(c, "/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400)


async def long_tag(c, n):
    return await _expect(c, "/v1/completions", _completion('"tag": "%s"' % ("t" * 1025)), 400)


async def long_rid(c, n):
    return await _expect(c, "/generate", ('{"text": "hi", "rid": "%s"}' % ("r" * 1025)).encode(), 400)


async def fresh_tag(c, n):
    """A well-formed request under a tag never seen before: /metrics must not grow with them."""
    return await _expect(c, "/v1/completions", _completion('"temperature": 0, "tag": "client-tag-%d"' % n), 200)


async def malformed_json(c, n):
    return await _expect(c, "/generate", b'{"text": "hi", ', 400)


async def gone_mid_stream(c, n):
    """A client that reads the first chunk of a stream and goes away (its slot must be freed)."""
    body = {"text": "Tell me a long story.", "stream": True, "sampling_params": {"max_new_tokens": 64}}
    try:
        async with c.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return f"/generate stream: HTTP {r.status_code}"
            async for _ in r.aiter_lines():
                break
    except httpx.HTTPError as e:
        return f"/generate stream: {type(e).__name__}: {e}"
    return None


HTTP_CASES: list[Callable[[httpx.AsyncClient, int], Awaitable[str | None]]] = [
    tiny_temperature, infinite_temperature, huge_seed, oversized_body, lone_surrogate, deep_nesting, long_tag,
    long_rid, fresh_tag, malformed_json, gone_mid_stream]


# -- control and checkpoints ----------------------------------------------------------------------
def write_bad_heads(good: Path, out: Path) -> dict[str, Path]:
    """Checkpoints every swap must refuse, made from the good head `good` (copied too, as "good",
    under `out`: the control cases that need a valid head under the allowed roots use it)."""
    out.mkdir(parents=True, exist_ok=True)
    heads = {name: out / f"bad-{name}" for name in ("huge", "fifo", "list-config")}
    heads["good"] = out / "good"
    shutil.rmtree(heads["good"], ignore_errors=True)
    shutil.copytree(good, heads["good"])
    for name, d in heads.items():
        if name == "good":
            continue
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy(good / f, d / f)
    tensors = load_file(str(good / "model.safetensors"))
    tensors["fc.weight"] = torch.full_like(tensors["fc.weight"], 3e38)
    save_file(tensors, str(heads["huge"] / "model.safetensors"), metadata={"format": "pt"})
    (heads["fifo"] / "model.safetensors").unlink()
    os.mkfifo(heads["fifo"] / "model.safetensors")
    cfg = json.loads((good / "config.json").read_text())
    (heads["list-config"] / "config.json").write_text(json.dumps([cfg]))
    return heads


def _refused(call: Callable[[], object], needle: str) -> str | None:
    try:
        call()
    except ControlError as e:
        return None if needle in str(e) else f"refused for another reason: {e}"
    return f"accepted; expected a refusal mentioning {needle!r}"


def wrong_token(client: ControlClient, heads: dict) -> str | None:
    return _refused(ControlClient(client.endpoint, "0" * 64, client.timeout_s).info, "wrong token")


def garbage_frames(client: ControlClient, heads: dict) -> str | None:
    reply = client.send_raw([b"\xff\xfe\x00 not json"])
    return None if reply.get("ok") is False and "malformed" in reply.get("error", "") else f"reply {reply}"


def huge_version(client: ControlClient, heads: dict) -> str | None:
    return _refused(lambda: client.swap_dir(heads["good"], version=10**30), "version must be an integer")


def outside_roots(client: ControlClient, heads: dict) -> str | None:
    return _refused(lambda: client.swap_dir("/etc"), "outside the allowed roots")


def huge_weights(client: ControlClient, heads: dict) -> str | None:
    return _refused(lambda: client.swap_dir(heads["huge"]), "cannot draft")


def fifo_weights(client: ControlClient, heads: dict) -> str | None:
    return _refused(lambda: client.swap_dir(heads["fifo"]), "not a regular file")


def list_config(client: ControlClient, heads: dict) -> str | None:
    return _refused(lambda: client.swap_dir(heads["list-config"]), "must be a JSON object")


CONTROL_CASES: list[Callable[[ControlClient, dict], str | None]] = [
    wrong_token, garbage_frames, huge_version, outside_roots, huge_weights, fifo_weights, list_config]
