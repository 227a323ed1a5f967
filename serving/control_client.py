"""The control endpoint's client: what `online-spec swap | rollback | status` and the trainer call.

Imports neither torch nor the model (only zmq and the standard library), so a control command
answers in a fraction of a second: `online-spec status` reads RUN_DIR/control.endpoint and
RUN_DIR/control.token, sends one request, prints the reply. Only `swap_tensors` (inline tensors,
the trainer's path) needs torch, and imports it when called.

    client = ControlClient.from_run_dir("runs/serve")        # or ControlClient(endpoint, token)
    client.swap_dir("/abs/runs/heads/v7", version=7, digest=sha256)
    client.rollback(); client.info(); client.set_adaptive(sglang_json)

Every method returns the server's result dict or raises `ControlError(reason)`. The wire format
and the commands: serving/control.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import zmq

TOKEN_FILE = "control.token"
ENDPOINT_FILE = "control.endpoint"


class ControlError(RuntimeError):
    """The server refused a control request (the message is its reason) or did not answer."""


class ControlClient:
    """Talks to a `ControlServer`: one REQ socket per request, so a timeout never wedges it.

        client = ControlClient(endpoint, token)
        client.swap_dir("/runs/heads/v3", version=3, digest=sha256)   # what the trainer daemon calls
        client.swap_tensors(head_tensors(head), config_json, version=3)
        client.rollback(); client.info(); client.set_adaptive(sglang_json_dict)
    """

    def __init__(self, endpoint: str, token: str, timeout_s: float = 60.0):
        self.endpoint, self.token, self.timeout_s = endpoint, token, timeout_s

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, endpoint: str | None = None, token_file: str | Path | None = None,
                     timeout_s: float = 60.0) -> "ControlClient":
        run_dir = Path(run_dir)
        endpoint = endpoint or (run_dir / ENDPOINT_FILE).read_text().strip()
        token = Path(token_file or run_dir / TOKEN_FILE).read_text().strip()
        return cls(endpoint, token, timeout_s)

    def request(self, command: str, args: dict | None = None, buffers: list | None = None) -> dict:
        """Send one request; returns its result or raises ControlError with the server's reason."""
        header = json.dumps({"token": self.token, "command": command, "args": args or {}}).encode()
        reply = self.send_raw([header, *(buffers or [])])
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "no reason given"))
        return reply["result"]

    def send_raw(self, frames: list) -> dict:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        try:
            sock.connect(self.endpoint)
            sock.send_multipart(frames, copy=False)
            return json.loads(sock.recv())
        except zmq.Again:
            raise ControlError(f"no reply from {self.endpoint} within {self.timeout_s:g} s") from None
        finally:
            sock.close(0)

    def info(self) -> dict:
        return self.request("info")

    def round_clock(self, timeout_s: float = 2.0) -> dict:
        """The server's steady rounds per shape, cumulative (control `round_clock`); a read that
        gets no answer within `timeout_s` raises ControlError, as does a server without it."""
        return ControlClient(self.endpoint, self.token, min(self.timeout_s, timeout_s)).request("round_clock")

    def swap_dir(self, path: str | Path, version: int | None = None, digest: str | None = None) -> dict:
        args = {"dir": str(Path(path).resolve())}
        if version is not None:
            args["version"] = version
        if digest is not None:
            args["digest"] = digest
        return self.request("swap", args)

    def swap_tensors(self, tensors: dict, config: dict, version: int) -> dict:
        """Inline swap of {name: tensor} with its config.json dict (imports torch: the caller has it)."""
        from serving.swap import tensor_bytes, tensors_digest  # torch, only for this command

        names = sorted(tensors)
        specs = [{"name": n, "dtype": str(tensors[n].dtype).removeprefix("torch."), "shape": list(tensors[n].shape)}
                 for n in names]
        return self.request("swap", {"config": config, "tensors": specs, "version": version,
                                     "digest": tensors_digest(tensors)},
                            [tensor_bytes(tensors[n]) for n in names])

    def rollback(self, version: int | None = None) -> dict:
        """Reinstall the previous head; `version`: only if that version is still the live one."""
        return self.request("rollback", {} if version is None else {"version": version})

    def set_adaptive(self, config: dict) -> dict:
        return self.request("set_adaptive", {"config": config})
