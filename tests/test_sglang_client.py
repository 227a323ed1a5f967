"""Swap client against SGLang 0.5.23's request structs, deserializer and endpoint order.

Bodies are checked against the msgspec structs of the installed `io_struct.py` (parsed with
ast: the module imports torch/CUDA-side code). The payload is read back by SGLang's own
`SafeUnpickler` and `_safe_load_torch_storage`, executed unchanged from `utils/common.py`.
The HTTP server here is a stand-in for SGLang (its workers need CUDA): it validates each body
with those same struct definitions and records the order of calls.
"""

import base64
import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from online_spec.checkpoint import expected_shapes, save_head
from online_spec.head import new_head
from serving.sglang_client import SglangSwapError, build_swap_requests, push_head_to_sglang
from sglang_source import class_fields, exec_definitions

IO = "srt/managers/io_struct.py"
STRUCTS = {"/begin_weight_update": "BeginWeightUpdateReqInput",
           "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
           "/end_weight_update": "EndWeightUpdateReqInput",
           "/pause_generation": "PauseGenerationReqInput",
           "/continue_generation": "ContinueGenerationReqInput"}


def check_body(path: str, body: dict) -> None:
    fields = class_fields(IO, STRUCTS[path])
    unknown = set(body) - set(fields)
    assert not unknown, f"{path}: fields {unknown} not in {STRUCTS[path]}"
    missing = {n for n, (_, has_default) in fields.items() if not has_default} - set(body)
    assert not missing, f"{path}: required {missing} absent"
    for name, value in body.items():
        ann = fields[name][0]
        if ann == "bool":
            assert isinstance(value, bool), name
        elif ann.startswith("Literal["):
            assert repr(value) in ann, (name, value, ann)
        elif "List[bytes]" in ann:
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), name
        elif ann == "Optional[str]":
            assert value is None or isinstance(value, str), name


@pytest.fixture()
def ckpt(tiny, tmp_path):
    head = new_head(tiny, draft_vocab_size=64, seed=3)
    save_head(head, tmp_path / "v5", version=5)
    return head, tmp_path / "v5"


def test_bodies_match_sglang_structs_and_selector_is_draft(ckpt):
    calls = build_swap_requests(ckpt[1], pause=True, tp_size=2)
    assert [p for p, _ in calls] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                                     "/end_weight_update", "/continue_generation"]
    for path, body in calls:
        check_body(path, body)
    update = dict(calls)["/update_weights_from_tensor"]
    assert update["selector"] == "draft" and update["flush_cache"] is False and update["weight_version"] == "5"
    assert len(update["serialized_named_tensors"]) == 2
    assert "selector" in class_fields(IO, "BeginWeightUpdateReqInput")


def test_payload_is_read_by_sglangs_safe_unpickler(ckpt):
    head, d = ckpt
    ns = exec_definitions("srt/utils/common.py", ["SafeUnpickler", "_safe_load_torch_storage"],
                          {"pickle": pickle, "io": io, "torch": torch})
    body = dict(build_swap_requests(d))["/update_weights_from_tensor"]
    named = ns["SafeUnpickler"](io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
    names = [n for n, _ in named]
    assert "d2t" not in names and "t2d" not in names and not any("embed" in n for n in names)
    sd = head.state_dict()
    assert set(names) == set(expected_shapes(head.cfg)) - {"d2t", "t2d"}
    for n, t in named:
        assert torch.equal(t, sd[n].cpu()), n
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):  # the unpickler is really strict
        ns["SafeUnpickler"](io.BytesIO(pickle.dumps(print))).load()


class _StandInSglang(BaseHTTPRequestHandler):
    calls: list = []
    refuse: str = ""
    draft_model_path: str = ""  # what /get_server_info reports, as SGLang's server_args do

    def do_GET(self):  # noqa: N802
        out = json.dumps({"speculative_draft_model_path": type(self).draft_model_path}).encode()
        self.send_response(200 if self.path == "/get_server_info" else 404)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        check_body(self.path, body)
        type(self).calls.append(self.path)
        ok = self.path != type(self).refuse
        out = json.dumps({"success": ok, "message": "Success" if ok else "refused by test"}).encode()
        self.send_response(200 if ok else 400)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture()
def server(ckpt):
    _StandInSglang.calls, _StandInSglang.refuse = [], ""
    _StandInSglang.draft_model_path = str(ckpt[1])  # the server started with this head
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StandInSglang)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_push_calls_endpoints_in_order(ckpt, server):
    out = push_head_to_sglang(server, ckpt[1], timeout=30)
    assert _StandInSglang.calls == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    assert out["version"] == "5"


def test_refused_update_raises_and_pause_is_always_continued(ckpt, server):
    _StandInSglang.refuse = "/update_weights_from_tensor"
    with pytest.raises(SglangSwapError, match="refused by test"):
        push_head_to_sglang(server, ckpt[1], pause=True, timeout=30)
    assert _StandInSglang.calls == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                                    "/end_weight_update", "/continue_generation"]


def test_a_head_with_another_vocabulary_map_is_refused_saying_why(ckpt, server, tiny, tmp_path):
    """SGLang's worker keeps the map it started with: a head with another map never reaches it."""
    counts = torch.arange(tiny.info.vocab_size).float()  # another top-64 than the live head's
    save_head(new_head(tiny, draft_vocab_size=64, token_counts=counts, seed=4), tmp_path / "other", version=6)
    with pytest.raises(SglangSwapError, match="vocabulary map differs.*keeps the draft vocabulary map"):
        push_head_to_sglang(server, tmp_path / "other", timeout=30)
    assert _StandInSglang.calls == []  # refused before any weight-update call
    with pytest.raises(SglangSwapError, match="keeps the draft vocabulary map"):  # the live head named explicitly
        push_head_to_sglang(server, tmp_path / "other", timeout=30, live_head=ckpt[1])
    _StandInSglang.draft_model_path = "org/some-hub-name"  # not a directory here: cannot check, so refuse
    with pytest.raises(SglangSwapError, match="--live-head"):
        push_head_to_sglang(server, ckpt[1], timeout=30)
    assert push_head_to_sglang(server, ckpt[1], timeout=30, live_head=ckpt[1])["version"] == "5"
