"""Where the capture stream lives: the default endpoint, its validation and its files.

The publisher binds and the subscriber connects to the same endpoint string. The default is an
`ipc://` socket file in a private run directory (mode 0700, created or tightened before the
socket is bound; the socket itself is made 0600), so a server and its sidecar trainer on one
host need no port and no other local user can connect: the stream carries users' prompts and
outputs. The serving process passes its own run directory; with none, a per-user directory
in the system temp directory is used (`online-spec-UID`, refused if another user owns it).

A `tcp://` endpoint must be loopback unless the binding side explicitly allows remote peers
(`check_endpoint(..., allow_remote=True)`); across hosts, use ZMQ CURVE (collector/curve.py) so
the stream is encrypted and only authorised subscribers get it.

    resolve_endpoint("", run_dir="/runs/a")  -> "ipc:///runs/a/capture.sock"
    check_endpoint("tcp://127.0.0.1:5555", "endpoint")   # raises ConfigError if malformed
    prepare_run_dir("/runs/a")                             # exists, mode 0700, ours
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from online_spec.config import check

log = logging.getLogger(__name__)

SOCKET_NAME = "capture.sock"
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), including the terminating NUL.
_IPC_PATH_MAX = 103


def private_dir() -> Path:
    """The per-user directory of the default socket when no run directory is given."""
    return Path(tempfile.gettempdir()) / f"online-spec-{os.getuid()}"


def default_endpoint(run_dir: str | Path = "") -> str:
    """`ipc://<run_dir>/capture.sock`, or the socket in the per-user private directory."""
    return f"ipc://{(Path(run_dir).absolute() if run_dir else private_dir()) / SOCKET_NAME}"


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp:// endpoint's host is a loopback address (localhost, 127.0.0.0/8, ::1)."""
    host = urlparse(endpoint.replace("tcp://", "http://", 1)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, name: str, allow_wildcard_port: bool = False, allow_remote: bool = True,
                   remote_flag: str = "") -> None:
    """Raise ConfigError naming `name` unless `endpoint` is a usable ipc:// or tcp:// address
    (a binding side may ask for any free port with `tcp://HOST:*`); with `allow_remote` False, a
    tcp host must be loopback (`remote_flag` is the flag that allows it, for the message)."""
    check(endpoint.startswith(("ipc://", "tcp://")), name, f"{endpoint!r} must start with ipc:// or tcp://")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        check(bool(path), name, "ipc:// endpoint has an empty path")
        check(len(path.encode()) <= _IPC_PATH_MAX, name,
              f"ipc path is {len(path.encode())} bytes, the OS limit is {_IPC_PATH_MAX}; use a shorter run dir")
        return
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    check(bool(sep) and bool(host), name, f"{endpoint!r} must look like tcp://HOST:PORT")
    check(allow_remote or is_loopback(endpoint), name,
          f"{endpoint} is not a loopback address: the capture stream carries users' prompts; pass {remote_flag} "
          "to bind it anyway (with CURVE keys for an encrypted, authenticated stream)")
    if allow_wildcard_port and port == "*":
        return
    check(port.isdigit() and 0 < int(port) < 65536, name, f"port {port!r} is not in 1..65535")


def resolve_endpoint(endpoint: str, run_dir: str | Path = "") -> str:
    """The endpoint to use: `endpoint` itself, or the default when it is empty."""
    return endpoint or default_endpoint(run_dir)


def prepare_run_dir(path: str | Path) -> Path:
    """Create `path` with mode 0700, or tighten an existing directory of ours to 0700; refuse one
    that another user owns (a planted directory would let its owner read the sockets in it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user: refusing it as a run directory")
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("run directory %s was mode %o; making it 0700 (it holds the control token and the capture "
                    "socket)", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    return path


def prepare_endpoint(endpoint: str, private: bool = False) -> None:
    """Before `bind`: create the parent directory of an ipc socket (mode 0700); `private` (the
    default endpoint's run directory) also tightens an existing one (`prepare_run_dir`)."""
    if endpoint.startswith("ipc://"):
        parent = Path(endpoint[len("ipc://"):]).parent
        if private:
            prepare_run_dir(parent)
        else:
            parent.mkdir(parents=True, exist_ok=True, mode=0o700)


def secure_ipc_file(endpoint: str) -> None:
    """After `bind`: only the owner may connect to an ipc socket (connecting needs write access)."""
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)


def remove_ipc_file(endpoint: str) -> None:
    """After the socket is closed: remove an ipc socket's file (a clean exit leaves nothing)."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s: %s", endpoint, e)
