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
`hot_token_id`). So the head must have the live head's vocabulary map: the map of the head the
server started with (`live_head`, by default its `speculative_draft_model_path` from
`/get_server_info`) is read and compared, and a head with another map is refused with the reason
(`SGLANG_KEEPS_MAP`). The embedded server has no such limit: it takes a head with its own map.
Requests are not drained: SGLang's scheduler applies control requests between forward passes.

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

from online_spec.checkpoint import CheckpointError, read_checkpoint, same_vocab_map, validate_tensors

# Names never sent: the vocabulary map stays the live one (contract 4).
SKIPPED_TENSORS = ("d2t", "t2d")
SGLANG_KEEPS_MAP = ("SGLang's draft worker keeps the draft vocabulary map (d2t/t2d) it started with, and "
                    "/update_weights_from_tensor carries weights only, so there a head trained with another draft "
                    "vocabulary would draft the wrong tokens (the embedded server, online-spec serve, takes a head "
                    "together with its own map)")


class SglangSwapError(RuntimeError):
    """SGLang refused a step of the swap; the message names the endpoint and SGLang's reason."""


def serialize_named_tensors(named: list[tuple[str, Any]]) -> str:
    """Base64 text of a plain pickle of [(name, CPU tensor)], as SGLang's deserializer reads it."""
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=4).dump([(n, t.detach().to("cpu").contiguous()) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def head_named_tensors(ckpt_dir: str | Path, live_vocab: tuple | None = None) -> tuple[list[tuple[str, Any]], dict]:
    """The checkpoint's tensors to send (validated, d2t/t2d left out) and its metadata; with
    `live_vocab` (the live head's (d2t, t2d)), a head with another map is refused."""
    cfg, tensors, meta = read_checkpoint(ckpt_dir)
    validate_tensors(cfg, tensors)
    if live_vocab is not None and not same_vocab_map((tensors["d2t"], tensors["t2d"]), live_vocab):
        raise SglangSwapError(f"{ckpt_dir}: draft vocabulary map differs from the live head's: {SGLANG_KEEPS_MAP}")
    return [(n, t) for n, t in sorted(tensors.items()) if n not in SKIPPED_TENSORS], meta


def live_vocab_map(live_head: str | Path) -> tuple:
    """(d2t, t2d) of the head checkpoint the SGLang server started with."""
    try:
        cfg, tensors, _ = read_checkpoint(live_head)
    except CheckpointError as e:
        raise SglangSwapError(f"cannot read the live head {live_head} to check the draft vocabulary map: {e}") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise SglangSwapError(f"the live head {live_head} has no d2t/t2d to check the draft vocabulary map against")
    return tensors["d2t"], tensors["t2d"]


def find_live_head(client: httpx.Client) -> Path:
    """The server's `speculative_draft_model_path` (`/get_server_info`), if it is a local directory."""
    try:
        r = client.get("/get_server_info")
        path = _json(r).get("speculative_draft_model_path") if r.status_code == 200 else None
    except httpx.HTTPError as e:
        raise SglangSwapError(f"/get_server_info failed ({e}): pass the live head directory (--live-head) so the "
                              f"draft vocabulary map can be checked") from None
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        raise SglangSwapError(f"the server's speculative_draft_model_path ({path!r}) is not a head directory here: "
                              "pass the live head directory (--live-head) so the draft vocabulary map can be checked")
    return Path(path)


def build_swap_requests(ckpt_dir: str | Path, *, flush_cache: bool = False, pause: bool = False,
                        tp_size: int = 1, weight_version: str | None = None,
                        live_vocab: tuple | None = None) -> list[tuple[str, dict]]:
    """The (path, JSON body) calls of one swap, in order (see the module docstring)."""
    named, meta = head_named_tensors(ckpt_dir, live_vocab)
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
                        weight_version: str | None = None, live_head: str | Path | None = None) -> dict:
    """Put the head in `ckpt_dir` into the draft worker of the SGLang server at `url`.

    `live_head`: the head directory the server started with (default: its
    `speculative_draft_model_path`); the new head must have its vocabulary map. Returns
    {"version", "calls": [(path, status)], "message"}. Raises SglangSwapError on a refused head or
    the first refused step; an opened weight-update session is closed and, with pause=True,
    generation is continued even then.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done: list[tuple[str, int]] = []
    message = ""
    session_open = False
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers) as client:
        live_vocab = live_vocab_map(live_head if live_head is not None else find_live_head(client))
        calls = build_swap_requests(ckpt_dir, flush_cache=flush_cache, pause=pause, tp_size=tp_size,
                                    weight_version=weight_version, live_vocab=live_vocab)
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
