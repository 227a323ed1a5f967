"""The control endpoint of the serving process (contract 4): swap, rollback, info, set_adaptive.

Transport: a ZMQ REP socket, by default `ipc://RUN_DIR/control.sock`, or `tcp://127.0.0.1:PORT`.
Why ZMQ and not routes on the HTTP server: the HTTP port is the public API and may be bound to a
non-loopback address for clients; the control plane must not share that exposure. An ipc socket
lives in the run directory (mode 0700, socket 0600), so only the serving user can reach it at
all, the token is a second lock, and no TCP port is opened. ZMQ multipart frames also carry
inline tensors as raw buffers without an encoding step, the collector stream already uses ZMQ,
and REP answers every request in order.

Wire format: a request is a multipart message
    frame 0   JSON {"token": "...", "command": "swap|rollback|info|set_adaptive", "args": {...}}
    frame 1.. raw tensor buffers (inline swaps only, in the order of args["tensors"])
and the reply is one JSON frame {"ok": true, "result": {...}} or {"ok": false, "error": "reason"}.

Commands (args):
    info                                        server info + live/previous head versions
    swap          {"dir": PATH, "version"?: int, "digest"?: sha256}
                  {"config": {config.json}, "tensors": [{"name", "dtype", "shape"}...],
                   "version": int, "digest": tensors_digest}        + one frame per tensor
    rollback      {version?}                    reinstall the previous head, bit-identical; with
                                                `version`, only while that version is live (refused
                                                once another head replaced it)
    set_adaptive  {"config": {SGLang adaptive JSON}}  a new EmaTierPolicy, between rounds
    round_clock                                 the steady rounds run per shape and their seconds,
                                                cumulative (`ServerMetrics.round_clock`; what a
                                                colocated trainer's serving budget reads)

Security: the run directory is made 0700 before anything is written into it; the token (64 hex
chars) is generated at start into RUN_DIR/control.token (0600) and compared with
`hmac.compare_digest`; a request without it is refused with a reason and changes nothing. A tcp
endpoint must be loopback unless `allow_remote` is set. Checkpoint directories must resolve under
the allowed roots (serving/swap.py; the packaged heads' directory always is one). Every request
gets a reply, also malformed ones. `close()` removes the token, the endpoint file and the ipc
socket file.

The client (`ControlClient`, what the CLI and the trainer call) lives in serving/control_client.py,
which imports neither torch nor the model: `online-spec status` answers in a fraction of a second.

    control = ControlServer(server, ControlConfig(run_dir="runs/serve")); control.start()
    client = ControlClient.from_run_dir("runs/serve"); client.swap_dir("runs/heads/v3")
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq

from collector.endpoint import is_loopback, prepare_run_dir, remove_ipc_file
from online_spec import PRETRAINED_HEADS
from online_spec.capture import MAX_VERSION
from online_spec.config import ConfigError, check, doc
from online_spec.drift import DriftAlert
from online_spec.starvation import KINDS as STARVATION_KINDS
from serving.control_client import ENDPOINT_FILE, TOKEN_FILE, ControlClient, ControlError  # noqa: F401 (re-export)
from serving.swap import HeadSwapper, SwapError, tensor_from_bytes

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
COMMANDS = ("info", "swap", "rollback", "set_adaptive", "trainer_alert", "round_clock")


@dataclass
class ControlConfig:
    run_dir: str = doc("run directory: control token, ipc socket and endpoint file live here", "runs/serve")
    control_endpoint: str = doc("control endpoint: empty = ipc://RUN_DIR/control.sock, tcp://127.0.0.1:PORT, "
                                "or 'off'", "")
    allowed_roots: str = doc("comma-separated directories swap checkpoints may come from; empty = RUN_DIR (the "
                             "packaged heads' directory is always allowed)", "")
    control_allow_remote: bool = doc("allow a non-loopback tcp control endpoint (the token still applies)", False)

    def __post_init__(self):
        check(bool(self.run_dir), "run_dir", "must be set")
        ep = self.control_endpoint
        if ep and ep != "off":
            check(ep.startswith(("ipc://", "tcp://")), "control_endpoint", f"must be ipc:// or tcp://, got {ep!r}")
            if ep.startswith("tcp://") and not self.control_allow_remote:
                check(is_loopback(ep), "control_endpoint",
                      f"{ep} is not a loopback address; pass --control-allow-remote to bind it anyway")

    @property
    def enabled(self) -> bool:
        return self.control_endpoint != "off"

    def endpoint(self) -> str:
        return self.control_endpoint or f"ipc://{Path(self.run_dir).resolve() / 'control.sock'}"

    def roots(self) -> list[Path]:
        """Where swap checkpoints may come from: the listed roots (or the run directory) and the
        heads that ship with the package."""
        names = [r.strip() for r in self.allowed_roots.split(",") if r.strip()]
        return ([Path(r) for r in names] or [Path(self.run_dir)]) + [PRETRAINED_HEADS]


def write_token(run_dir: Path) -> str:
    """A fresh token in RUN_DIR/control.token, created with mode 0600."""
    token = secrets.token_hex(32)
    path = run_dir / TOKEN_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


class ControlServer:
    """A background thread answering control requests on a ZMQ REP socket."""

    def __init__(self, server, cfg: ControlConfig, swapper: HeadSwapper | None = None):
        self.server, self.cfg = server, cfg
        self.swapper = swapper or HeadSwapper(server, cfg.roots())
        self.run_dir = Path(cfg.run_dir)
        self.endpoint = cfg.endpoint()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control", daemon=True)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self.token = ""
        self.requests = self.refused = 0

    def start(self) -> "ControlServer":
        prepare_run_dir(self.run_dir)
        self.token = write_token(self.run_dir)
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.bind(self.endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:0 -> the real port
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        (self.run_dir / ENDPOINT_FILE).write_text(self.endpoint)
        self._sock = sock
        self._thread.start()
        log.info("control endpoint %s (token in %s)", self.endpoint, self.run_dir / TOKEN_FILE)
        return self

    def close(self) -> None:
        """Stop the thread (it closes the socket), then remove the files start() wrote."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._sock is None:
            return
        remove_ipc_file(self.endpoint)
        for name in (TOKEN_FILE, ENDPOINT_FILE):
            (self.run_dir / name).unlink(missing_ok=True)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    frames = self._sock.recv_multipart(copy=False)
                except zmq.ZMQError:
                    log.exception("control recv failed")
                    continue
                reply = self.handle([f.buffer for f in frames])
                try:
                    self._sock.send(json.dumps(reply).encode())
                except zmq.ZMQError:
                    log.exception("control reply failed")
        finally:
            self._sock.close(0)

    def handle(self, frames: list) -> dict:
        """One request -> its reply; never raises (a failure becomes {"ok": false, "error": ...})."""
        self.requests += 1
        try:
            req = json.loads(bytes(frames[0]))
            if not isinstance(req, dict):
                raise SwapError("request must be a JSON object")
            token = req.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
                self.refused += 1
                return {"ok": False, "error": "refused: missing or wrong token"}
            cmd, args = req.get("command"), req.get("args", {})
            if cmd not in COMMANDS:
                raise SwapError(f"unknown command {cmd!r} (one of {', '.join(COMMANDS)})")
            if not isinstance(args, dict):
                raise SwapError("args must be a JSON object")
            return {"ok": True, "result": getattr(self, "_cmd_" + cmd)(args, frames[1:])}
        except (SwapError, ConfigError, TypeError) as e:
            return {"ok": False, "error": str(e)}
        except (json.JSONDecodeError, UnicodeDecodeError, IndexError) as e:
            return {"ok": False, "error": f"malformed request: {e}"}
        except Exception as e:  # the endpoint keeps serving whatever a request does
            log.exception("control request failed")
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    # -- commands -------------------------------------------------------------------------------
    def _cmd_info(self, args: dict, frames: list) -> dict:
        return {**self.server.info(), "control": {**self.swapper.info(), "endpoint": self.endpoint,
                                                  "requests": self.requests, "refused_requests": self.refused}}

    def _cmd_round_clock(self, args: dict, frames: list) -> dict:
        return self.server.metrics.round_clock()

    def _cmd_swap(self, args: dict, frames: list) -> dict:
        if "dir" in args:
            if frames:
                raise SwapError("a directory swap takes no tensor frames")
            return self.swapper.swap_dir(args["dir"], args.get("version"), args.get("digest"))
        specs = args.get("tensors")
        if not isinstance(specs, list) or not specs:
            raise SwapError("swap needs 'dir' or inline 'tensors' (with 'config', 'version', 'digest')")
        if len(specs) != len(frames):
            raise SwapError(f"{len(specs)} tensor specs but {len(frames)} buffers")
        tensors = {}
        for spec, buf in zip(specs, frames):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise SwapError("each tensor spec needs a name, dtype and shape")
            if spec["name"] in tensors:
                raise SwapError(f"tensor {spec['name']} sent twice")
            tensors[spec["name"]] = tensor_from_bytes(buf, spec.get("dtype"), spec.get("shape"))
        if not isinstance(args.get("digest"), str):
            raise SwapError("an inline swap needs its digest (serving.swap.tensors_digest)")
        return self.swapper.swap_tensors(args.get("config"), tensors, args.get("version"), args["digest"])

    def _cmd_rollback(self, args: dict, frames: list) -> dict:
        version = args.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise SwapError(f"rollback: version must be a non-negative integer, got {version!r}")
        return self.swapper.rollback(version)

    def _cmd_trainer_alert(self, args: dict, frames: list) -> dict:
        """An alert the trainer raised about itself (`online_spec.starvation`): checked, then kept
        in /server_info and given to the server's alert sinks (`SpecServer.on_trainer_alert`)."""
        if args.get("kind") not in STARVATION_KINDS:
            raise SwapError(f"trainer_alert: kind must be one of {STARVATION_KINDS}, got {args.get('kind')!r}")
        for name in ("title", "text"):
            if not isinstance(args.get(name), str) or len(args[name]) > 2000:
                raise SwapError(f"trainer_alert: {name} must be a string of at most 2000 characters")
        nums = {}
        for name in ("before", "after", "time"):
            v = args.get(name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise SwapError(f"trainer_alert: {name} must be a finite number, got {v!r}")
            nums[name] = float(v)
        for name in ("head_version", "round"):
            if not isinstance(args.get(name), int) or isinstance(args.get(name), bool) or \
                    not 0 <= args[name] <= MAX_VERSION:
                raise SwapError(f"trainer_alert: {name} must be an integer in 0..{MAX_VERSION}")
        alert = DriftAlert(kind=args["kind"], level="warn", slot=0, tag="", head_version=args["head_version"],
                           round=args["round"], title=args["title"], text=args["text"], **nums)
        self.server.on_trainer_alert(alert)
        return {"taken": alert.kind}

    def _cmd_set_adaptive(self, args: dict, frames: list) -> dict:
        from online_spec.controller import AdaptiveConfig, EmaTierPolicy

        config = AdaptiveConfig.from_dict(args.get("config"))  # the parser of load_adaptive_config
        engine = self.server.engine
        if max(config.candidate_steps) > engine.cfg.max_steps:
            raise SwapError(f"candidate_steps go up to {max(config.candidate_steps)} but the engine's "
                            f"max_steps is {engine.cfg.max_steps}")
        policy = EmaTierPolicy(config, initial_steps=engine.cfg.num_steps or None)
        engine.set_policy(policy)
        self.server.loop.wake()
        return {"installed": "ema_tier", "config": config.to_dict()}
