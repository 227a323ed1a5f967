"""Swap client for a running SGLang server: push a head checkpoint into its EAGLE-3 draft worker.

In: a head checkpoint directory (`online_spec.checkpoint` layout). Out: SGLang's own HTTP
endpoints (0.5.23, `sglang/srt/entrypoints/http_server.py`, bodies = structs of
`sglang/srt/managers/io_struct.py`), called in this order:

    [POST /pause_generation   {"mode": "in_place"}]          only with pause=True
    POST /begin_weight_update {"selector": "draft"}           BeginWeightUpdateReqInput
    POST /update_weights_from_tensor                          UpdateWeightsFromTensorReqInput
         {"serialized_named_tensors": [<base64>], "selector": "draft", "flush_cache": false,
          "weight_version": "<version>"}
    POST /end_weight_update   {}                              EndWeightUpdateReqInput
    [POST /continue_generation {}]                            only with pause=True

The tensors sent are the head's weights only: no embeddings (the checkpoint has none) and no
`d2t`/`t2d` (the live vocabulary map stays; SGLang's loader would otherwise reset its
`hot_token_id`). Requests are not drained: SGLang's scheduler applies control requests between
forward passes.

Payload format: SGLang deserializes each entry of `serialized_named_tensors` with
`MultiprocessingSerializer.deserialize` (base64 -> `SafeUnpickler`). A *plain* pickle of CPU
tensors (protocol 4; storages reduce through `torch.storage._load_from_bytes`, which
`SafeUnpickler` maps to its safe `torch.load(weights_only=True)`) is self-contained, so it
works across processes and hosts; torch's ForkingPickler reductions would instead pass shared
memory file descriptors valid only on the same host while this process lives. Only CPU torch
is imported here. One entry per tensor-parallel rank: the same bytes, `tp_size` times.

    from serving.sglang_client import push_head_to_sglang
    push_head_to_sglang("http://127.0.0.1:30000", "runs/x/heads/v7")
"""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path
from typing import Any

import httpx

from online_spec.checkpoint import read_checkpoint, validate_tensors

# Names never sent: the vocabulary map stays the live one (contract 4).
SKIPPED_TENSORS = ("d2t", "t2d")


class SglangSwapError(RuntimeError):
    """SGLang refused a step of the swap; the message names the endpoint and SGLang's reason."""


def serialize_named_tensors(named: list[tuple[str, Any]]) -> str:
    """Base64 text of a plain pickle of [(name, CPU tensor)], as SGLang's deserializer reads it."""
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=4).dump([(n, t.detach().to("cpu").contiguous()) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def head_named_tensors(ckpt_dir: str | Path) -> tuple[list[tuple[str, Any]], dict]:
    """The checkpoint's tensors to send (validated, d2t/t2d left out) and its metadata."""
    cfg, tensors, meta = read_checkpoint(ckpt_dir)
    validate_tensors(cfg, tensors)
    return [(n, t) for n, t in sorted(tensors.items()) if n not in SKIPPED_TENSORS], meta


def build_swap_requests(ckpt_dir: str | Path, *, flush_cache: bool = False, pause: bool = False,
                        tp_size: int = 1, weight_version: str | None = None) -> list[tuple[str, dict]]:
    """The (path, JSON body) calls of one swap, in order (see the module docstring)."""
    named, meta = head_named_tensors(ckpt_dir)
    payload = serialize_named_tensors(named)
    version = weight_version if weight_version is not None else str(meta.get("version", ""))
    update: dict[str, Any] = {"serialized_named_tensors": [payload] * tp_size, "selector": "draft",
                              "flush_cache": flush_cache}
    if version:
        update["weight_version"] = version
    calls = [("/begin_weight_update", {"selector": "draft"}),
             ("/update_weights_from_tensor", update),
             ("/end_weight_update", {})]
    if pause:
        calls = [("/pause_generation", {"mode": "in_place"}), *calls, ("/continue_generation", {})]
    return calls


def push_head_to_sglang(url: str, ckpt_dir: str | Path, *, flush_cache: bool = False, pause: bool = False,
                        timeout: float = 120.0, tp_size: int = 1, api_key: str | None = None,
                        weight_version: str | None = None) -> dict:
    """Put the head in `ckpt_dir` into the draft worker of the SGLang server at `url`.

    Returns {"version", "calls": [(path, status)], "message"}. Raises SglangSwapError on the
    first refused step; an opened weight-update session is closed and, with pause=True,
    generation is continued even then.
    """
    calls = build_swap_requests(ckpt_dir, flush_cache=flush_cache, pause=pause, tp_size=tp_size,
                                weight_version=weight_version)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done: list[tuple[str, int]] = []
    message = ""
    session_open = False
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers) as client:
        try:
            for path, body in calls:
                if path in ("/end_weight_update", "/continue_generation"):
                    continue  # sent in `finally`, whatever happened
                r = client.post(path, json=body)
                session_open = session_open or (path == "/begin_weight_update" and r.status_code == 200)
                done.append((path, r.status_code))
                reply = _json(r)
                if r.status_code != 200 or reply.get("success") is False:
                    raise SglangSwapError(f"{path} refused ({r.status_code}): {reply.get('message', r.text)}")
                message = reply.get("message", message)
        finally:
            if session_open:  # close SGLang's weight-update session even after a refused update
                r = client.post("/end_weight_update", json={})
                done.append(("/end_weight_update", r.status_code))
                if r.status_code != 200:
                    message = f"/end_weight_update returned {r.status_code}"
            if pause:
                r = client.post("/continue_generation", json={})
                done.append(("/continue_generation", r.status_code))
    update = dict(calls)["/update_weights_from_tensor"]
    return {"version": update.get("weight_version"), "calls": done, "message": message}


def _json(r: httpx.Response) -> dict:
    try:
        out = r.json()
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}
