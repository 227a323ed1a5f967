"""ZMQ CURVE for a capture stream that leaves the host: encrypted, and only for known subscribers.

The stream carries users' prompts and outputs. On one host it stays on an ipc socket in a 0700
run directory (collector/endpoint.py); across hosts, a tcp endpoint with CURVE: the publisher
binds as a CURVE server with its own certificate and a ZAP authenticator that admits only the
subscribers whose public certificates sit in an authorised directory; a subscriber connects with
the publisher's public certificate and its own secret one. Without a certificate the handshake
fails and the subscriber receives nothing.

Certificates are ZMQ's own files (`zmq.auth`): `NAME.key` (public) and `NAME.key_secret`
(public + secret). Make them with `create_certificates`:

    python -c "import zmq.auth as a; a.create_certificates('keys', 'server'); a.create_certificates('keys', 'trainer')"
    mkdir keys/authorized && cp keys/trainer.key keys/authorized/
    online-spec serve --capture --capture-endpoint tcp://10.0.0.5:5555 --capture-allow-remote \
        --capture-curve-secret-key keys/server.key_secret --capture-curve-authorized keys/authorized
    online-spec train --capture-endpoint tcp://10.0.0.5:5555 \
        --capture-curve-server-key keys/server.key --capture-curve-secret-key keys/trainer.key_secret

    auth = make_curve_server(ctx, sock, "keys/server.key_secret", "keys/authorized")   # before bind
    make_curve_client(sock, "keys/server.key", "keys/trainer.key_secret")              # before connect
    auth.stop()                                                                        # on close
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from online_spec.config import check


def check_curve_files(name: str, secret_key: str, other: str, other_is_dir: bool) -> None:
    """ConfigError naming `name` unless both CURVE settings are given (or neither) and exist."""
    if not secret_key and not other:
        return
    check(bool(secret_key) and bool(other), name, "CURVE needs both a secret certificate and the peer's key(s)")
    check(zmq.has("curve"), name, "this libzmq has no CURVE support")
    check(Path(secret_key).is_file(), name, f"secret certificate {secret_key} is not a file")
    check(Path(other).is_dir() if other_is_dir else Path(other).is_file(), name,
          f"{other} is not a {'directory' if other_is_dir else 'file'}")


def _secret(path: str) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (use the NAME.key_secret file)")
    return public, secret


def make_curve_server(ctx: zmq.Context, sock: zmq.Socket, secret_key: str, authorized_dir: str) -> ThreadAuthenticator:
    """Make `sock` (not yet bound) a CURVE server admitting only `authorized_dir`'s public keys."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_dir))
    public, secret = _secret(secret_key)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def make_curve_client(sock: zmq.Socket, server_key: str, secret_key: str) -> None:
    """Make `sock` (not yet connected) a CURVE client of the server whose public key is in `server_key`."""
    server_public, _ = zmq.auth.load_certificate(server_key)
    public, secret = _secret(secret_key)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
