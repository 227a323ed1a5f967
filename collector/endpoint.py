"""Where the capture stream lives: the default endpoint and its validation.

The publisher binds and the subscriber connects to the same endpoint string. The default is an
`ipc://` socket file under the run directory (or the system temp directory when no run
directory is given), so a server and its sidecar trainer on one host need no port; a
`tcp://127.0.0.1:PORT` endpoint works the same way across containers.

    resolve_endpoint("", run_dir="/runs/a")  -> "ipc:///runs/a/capture.sock"
    check_endpoint("tcp://127.0.0.1:5555", "endpoint")   # raises ConfigError if malformed
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from online_spec.config import check

SOCKET_NAME = "capture.sock"
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), including the terminating NUL.
_IPC_PATH_MAX = 103


def default_endpoint(run_dir: str | Path = "") -> str:
    """`ipc://<run_dir>/capture.sock`, or a per-user socket in the temp directory."""
    if run_dir:
        return f"ipc://{Path(run_dir).absolute() / SOCKET_NAME}"
    return f"ipc://{Path(tempfile.gettempdir()) / f'online-spec-{os.getuid()}-{SOCKET_NAME}'}"


def check_endpoint(endpoint: str, name: str, allow_wildcard_port: bool = False) -> None:
    """Raise ConfigError naming `name` unless `endpoint` is a usable ipc:// or tcp:// address
    (a binding side may ask for any free port with `tcp://HOST:*`)."""
    check(endpoint.startswith(("ipc://", "tcp://")), name, f"{endpoint!r} must start with ipc:// or tcp://")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        check(bool(path), name, "ipc:// endpoint has an empty path")
        check(len(path.encode()) <= _IPC_PATH_MAX, name,
              f"ipc path is {len(path.encode())} bytes, the OS limit is {_IPC_PATH_MAX}; use a shorter run dir")
    else:
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        check(bool(sep) and bool(host), name, f"{endpoint!r} must look like tcp://HOST:PORT")
        if allow_wildcard_port and port == "*":
            return
        check(port.isdigit() and 0 < int(port) < 65536, name, f"port {port!r} is not in 1..65535")


def resolve_endpoint(endpoint: str, run_dir: str | Path = "") -> str:
    """The endpoint to use: `endpoint` itself, or the default when it is empty."""
    return endpoint or default_endpoint(run_dir)


def prepare_endpoint(endpoint: str) -> None:
    """Create the parent directory of an ipc socket file so `bind` can succeed."""
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
