"""Who can read the capture stream, and what is never sent (issue 32), with real ZMQ sockets.

The stream carries users' prompts. Its default socket lives in a private run directory (made
0700 before the socket is bound, even one that existed with 0755) and is itself 0600; a
non-loopback tcp endpoint is refused unless explicitly allowed; across hosts, CURVE encrypts it
and only subscribers whose keys are authorised receive anything. A record the receiver would
refuse (an id or tag over 1,024 characters, a version beyond 2^62) is not sent and not counted
as sent: it is `dropped_invalid`.
"""

import os
import stat
import time

import pytest
import torch
import zmq.auth

from collector.endpoint import default_endpoint, prepare_run_dir
from collector.publisher import CapturePublisher, PublisherConfig
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from online_spec.capture import CaptureRecord
from online_spec.config import ConfigError


def record(rid: str, tag: str = "", version: int = 0, pos: int = 0) -> CaptureRecord:
    return CaptureRecord(rid, pos, torch.tensor([1, 2, 3]), torch.randn(2, 12), torch.randn(2, 4), is_prefill=True,
                         tag=tag, draft_version=version)


def wait(cond, timeout_s=20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_default_socket_is_private(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    with CapturePublisher(PublisherConfig(run_dir=str(run))) as pub:
        assert pub.endpoint == f"ipc://{run / 'capture.sock'}" == default_endpoint(run)
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run / "capture.sock").st_mode) == 0o600
    assert not (run / "capture.sock").exists()  # closing removes the socket file
    assert default_endpoint("").startswith("ipc:///") and f"online-spec-{os.getuid()}/" in default_endpoint("")


def test_a_run_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() == 0:
        d = tmp_path / "theirs"
        d.mkdir()
        os.chown(d, 12345, 12345)
        with pytest.raises(PermissionError, match="belongs to uid 12345"):
            prepare_run_dir(d)
    else:
        with pytest.raises(PermissionError, match="belongs to uid 0"):
            prepare_run_dir("/")


def test_non_loopback_tcp_needs_an_explicit_allow():
    with pytest.raises(ConfigError, match="endpoint: tcp://0.0.0.0:5555 is not a loopback address.*--capture-allow-remote"):
        PublisherConfig(endpoint="tcp://0.0.0.0:5555")
    PublisherConfig(endpoint="tcp://127.0.0.1:5555")
    PublisherConfig(endpoint="tcp://0.0.0.0:5555", allow_remote=True)


def test_unencodable_records_are_dropped_invalid_not_sent(tmp_path):
    ep = f"ipc://{tmp_path}/c.sock"
    got = []
    sub = CaptureSubscriber(SubscriberConfig(endpoint=ep, idle_timeout_s=0.5, poll_ms=10), on_span=got.append).start()
    try:
        with CapturePublisher(PublisherConfig(endpoint=ep, wire_dtype="float32")) as pub:
            assert pub.wait_for_subscriber(20)
            time.sleep(0.3)
            bad = [record("r" * 1025), record("ok-id", tag="t" * 1025), record("v", version=2**62 + 1),
                   record("p", pos=2**40 + 1)]
            pub.submit(bad + [record("good")])
            pub.end_request("e" * 1025)
            assert pub.drain(20)
            st = pub.stats()
            assert (st["dropped_invalid"], st["sent"]) == (4, 1)
            assert st["end_markers_dropped"] == 1 and st["end_markers_sent"] == 0
        assert wait(lambda: sub.stats()["records"] == 1)
    finally:
        sub.close()
    assert sub.stats()["malformed"] == 0  # nothing the receiver had to refuse
    assert [s.request_id for s in got] == ["good"]


def test_curve_stream_reaches_only_authorised_subscribers(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "authorized").mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    _, trainer_secret = zmq.auth.create_certificates(keys, "trainer")
    _, stranger_secret = zmq.auth.create_certificates(keys, "stranger")
    (keys / "authorized" / "trainer.key").write_bytes((keys / "trainer.key").read_bytes())
    port = _free_port()
    ep = f"tcp://127.0.0.1:{port}"
    received = {"trainer": [], "stranger": [], "plain": []}
    subs = [
        CaptureSubscriber(SubscriberConfig(endpoint=ep, curve_server_key=str(keys / "server.key"),
                                           curve_secret_key=trainer_secret, poll_ms=10), received["trainer"].append),
        CaptureSubscriber(SubscriberConfig(endpoint=ep, curve_server_key=str(keys / "server.key"),
                                           curve_secret_key=stranger_secret, poll_ms=10), received["stranger"].append),
        CaptureSubscriber(SubscriberConfig(endpoint=ep, poll_ms=10), received["plain"].append),
    ]
    for s in subs:
        s.start()
    try:
        cfg = PublisherConfig(endpoint=ep, wire_dtype="float32", curve_secret_key=server_secret,
                              curve_authorized=str(keys / "authorized"))
        with CapturePublisher(cfg) as pub:
            assert pub.wait_for_subscriber(20)
            time.sleep(0.3)
            for i in range(5):
                pub.submit([record(f"req-{i}")])
                pub.end_request(f"req-{i}")
            assert pub.drain(20)
            assert wait(lambda: len(received["trainer"]) == 5)
    finally:
        for s in subs:
            s.close()
    assert [s.request_id for s in received["trainer"]] == [f"req-{i}" for i in range(5)]
    # the others were connected all along and got nothing: not even a frame to count as malformed
    assert received["stranger"] == [] and received["plain"] == []
    assert subs[1].stats()["messages"] == 0 and subs[2].stats()["messages"] == 0


def test_curve_settings_are_checked():
    with pytest.raises(ConfigError, match="curve_secret_key: CURVE needs both"):
        PublisherConfig(endpoint="tcp://127.0.0.1:5555", curve_secret_key="x")
    with pytest.raises(ConfigError, match="curve_secret_key: secret certificate /nope is not a file"):
        SubscriberConfig(endpoint="tcp://127.0.0.1:5555", curve_secret_key="/nope", curve_server_key="/nope2")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
