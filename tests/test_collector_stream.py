"""The capture stream through real ZMQ sockets (tcp on 127.0.0.1 and ipc in a temp dir).

No timing is asserted: a blocking `submit` is detected by running it on a thread and joining
with a hard timeout; waits for the other side poll with deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.publisher import CapturePublisher, PublisherConfig, sample_score
from collector.span import CaptureSpan
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from collector.wire import MAGIC, VERSION, encode, encode_end
from collector_records import bits, request_records
from online_spec.capture import CaptureRecord
from online_spec.config import ConfigError

H = 8
DEADLINE_S = 20.0


def wait_until(cond: Callable[[], bool], timeout_s: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def returns_within(fn: Callable[[], None], timeout_s: float = DEADLINE_S) -> bool:
    """Run fn on a thread; True if it finished before the hard timeout."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def accounted(stats: dict) -> int:
    return (stats["sent"] + stats["dropped_queue_full"] + stats["dropped_hwm"]
            + stats["dropped_no_subscriber"] + stats["dropped_invalid"])


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/capture.sock"


def _connectable(pub: CapturePublisher) -> str:
    return pub.endpoint  # the bound address, with the actual port for tcp://...:*


def test_records_arrive_bit_exact_as_contiguous_spans(endpoint):
    reqs = {rid: request_records(rid, num_rounds=5, hidden=H, seed=i) for i, rid in enumerate(["a", "b"])}
    spans: list[CaptureSpan] = []
    with CapturePublisher(PublisherConfig(endpoint=endpoint)) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=_connectable(pub)), on_span=spans.append).start() as sub:
        assert pub.wait_for_subscriber(DEADLINE_S)
        assert all(pub.should_capture(rid) for rid in reqs)
        for round_ in range(6):  # one submit per round with that round's records of both requests
            pub.submit([recs[round_] for recs in reqs.values()])
        for rid in reqs:
            pub.end_request(rid)
        assert wait_until(lambda: len(spans) == 2)
        stats = pub.stats()
    assert stats["sent"] == stats["submitted"] == 12 and stats["end_markers_sent"] == 2
    assert sub.stats()["malformed"] == 0 and sub.stats()["spans_closed_by_end"] == 2
    for span in spans:
        ref = CaptureSpan.from_records(reqs[span.request_id])
        assert span.first_pos == 0 and torch.equal(span.tokens, ref.tokens)
        assert torch.equal(bits(span.features), bits(ref.features.to(torch.bfloat16)))
        assert torch.equal(bits(span.final_hidden), bits(ref.final_hidden.to(torch.bfloat16)))
        assert torch.equal(span.accepted, ref.accepted) and torch.equal(span.draft_token, ref.draft_token)


def _big_round(i: int, hidden: int = 1024, rows: int = 8) -> list:
    g = torch.Generator().manual_seed(i)
    return [CaptureRecord(f"req-{i}-{j}", 0, torch.arange(rows + 1), torch.randn(rows, 3 * hidden, generator=g),
                          torch.randn(rows, hidden, generator=g), is_prefill=True) for j in range(4)]


def test_a_stalled_subscriber_never_blocks_submit_and_drops_are_counted(endpoint):
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)  # connected, subscribed, never reads
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.LINGER, 0)
    pub = CapturePublisher(PublisherConfig(endpoint=endpoint, queue_size=8, send_hwm=2))
    try:
        stalled.connect(_connectable(pub))
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        assert pub.wait_for_subscriber(DEADLINE_S)

        def flood() -> None:
            # ~40 MB of records: far beyond the HWMs and the kernel's socket buffers.
            for batch in range(40):
                for i in range(8):
                    pub.submit(_big_round(batch * 8 + i))
                pub.drain(DEADLINE_S)  # waits on the sender thread, not on submit

        assert returns_within(flood), "submit blocked behind a stalled subscriber"
        stats = pub.stats()
        assert stats["dropped_hwm"] > 0, stats
        assert accounted(stats) == stats["submitted"] == 40 * 8 * 4
        assert pub._thread.is_alive()
    finally:
        pub.close()
        stalled.close()
        ctx.term()


def test_an_absent_subscriber_never_blocks_submit(endpoint):
    with CapturePublisher(PublisherConfig(endpoint=endpoint, queue_size=4)) as pub:
        recs = request_records("lonely", num_rounds=50, hidden=H)
        assert returns_within(lambda: [pub.submit([r]) for r in recs])
        assert pub.drain(DEADLINE_S) and accounted(pub.stats()) == len(recs)
        stats = pub.stats()
        assert stats["sent"] == 0 and stats["dropped_no_subscriber"] > 0
        assert stats["dropped_no_subscriber"] + stats["dropped_queue_full"] == len(recs)


_SUBSCRIBER_SCRIPT = """
import sys, time, zmq
s = zmq.Context().socket(zmq.SUB)
s.connect(sys.argv[1]); s.setsockopt(zmq.SUBSCRIBE, b"")
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_subscriber_is_noticed_and_submit_goes_on(endpoint):
    with CapturePublisher(PublisherConfig(endpoint=endpoint, queue_size=64)) as pub:
        proc = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER_SCRIPT, _connectable(pub)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            assert pub.wait_for_subscriber(DEADLINE_S)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        recs = request_records("after-kill", num_rounds=20, hidden=H)
        assert returns_within(lambda: [pub.submit([r]) for r in recs])
        assert wait_until(lambda: not pub.stats()["subscribed"])
        # the 20 may still be in the sender's hands (each is sent or dropped after the flag flips):
        # count from the point where every one of them is accounted for
        assert pub.drain(DEADLINE_S)
        before = pub.stats()["dropped_no_subscriber"]
        pub.submit(recs[:3])
        assert wait_until(lambda: pub.stats()["dropped_no_subscriber"] == before + 3)


def test_subscriber_first_then_publisher_restart_on_the_same_ipc_socket(tmp_path: Path):
    endpoint = f"ipc://{tmp_path}/run/capture.sock"
    spans: list[CaptureSpan] = []
    with CaptureSubscriber(SubscriberConfig(endpoint=endpoint), on_span=spans.append).start():
        for generation in range(2):  # the second publisher binds where the first one was
            with CapturePublisher(PublisherConfig(endpoint=endpoint)) as pub:
                assert pub.wait_for_subscriber(DEADLINE_S)
                recs = request_records(f"gen{generation}", num_rounds=3, hidden=H, seed=generation)
                pub.submit(recs)
                pub.end_request(f"gen{generation}")
                assert wait_until(lambda: len(spans) == generation + 1)
    assert [s.request_id for s in spans] == ["gen0", "gen1"]
    assert all(s.num_rows == s.end_pos for s in spans)


def test_sampling_is_per_request_deterministic_and_near_the_fraction():
    ids = [f"req-{i}" for i in range(4000)]
    with CapturePublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", sample_fraction=0.25)) as pub:
        first = [pub.should_capture(i) for i in ids]
        assert first == [pub.should_capture(i) for i in ids]
        assert 0.22 < sum(first) / len(ids) < 0.28
        assert first == [sample_score(i) < 0.25 for i in ids]
        assert pub.stats()["requests_seen"] == 8000
    with CapturePublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*", sample_fraction=0.25,
                                          sample_salt="other")) as pub:
        assert first != [pub.should_capture(i) for i in ids]


@pytest.mark.parametrize("field,value", [("sample_fraction", 1.5), ("queue_size", 0), ("send_hwm", 0),
                                         ("wire_dtype", "int8"), ("endpoint", "udp://x"),
                                         ("endpoint", "tcp://127.0.0.1:99999"),
                                         ("endpoint", "ipc:///" + "x" * 200)])
def test_publisher_config_names_the_bad_field(field, value):
    with pytest.raises(ConfigError, match=field):
        PublisherConfig(**{field: value})


def test_subscriber_config_names_the_bad_field():
    with pytest.raises(ConfigError, match="idle_timeout_s"):
        SubscriberConfig(endpoint="tcp://127.0.0.1:5555", idle_timeout_s=0)
    with pytest.raises(ConfigError, match="endpoint"):
        SubscriberConfig(endpoint="tcp://127.0.0.1:*")


# ---- malformed traffic through a real socket ---------------------------------------------------

_VALID = request_records("valid", num_rounds=1, hidden=H)
_VALID_FRAMES = [bytes(f) for f in encode(_VALID[1])]


def _truncated(cut: int) -> list[bytes]:
    frames = list(_VALID_FRAMES)
    frames[2] = frames[2][: cut % len(frames[2])]
    return frames


def _other_version() -> list[bytes]:
    head = _VALID_FRAMES[0]
    return [head[:4] + (VERSION + 1).to_bytes(2, "little") + head[6:]] + _VALID_FRAMES[1:]


def _wrong_shape() -> list[bytes]:
    return _VALID_FRAMES[:2] + [_VALID_FRAMES[3], _VALID_FRAMES[2]] + _VALID_FRAMES[4:]


BAD_MESSAGES = st.one_of(
    st.lists(st.binary(max_size=200), min_size=1, max_size=7),
    st.integers(0, 10_000).map(_truncated),
    st.just(_other_version()),
    st.just(_wrong_shape()),
    st.binary(max_size=64).map(lambda b: [MAGIC + VERSION.to_bytes(2, "little") + b"\x01\x06" + b]),
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(bad=st.lists(BAD_MESSAGES, min_size=1, max_size=12))
def test_malformed_messages_through_a_socket_are_counted_and_dropped(bad):
    spans: list[CaptureSpan] = []
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)  # a rogue or buggy publisher
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        with CaptureSubscriber(SubscriberConfig(endpoint=f"tcp://127.0.0.1:{port}"), on_span=spans.append).start() as sub:
            assert raw.poll(int(DEADLINE_S * 1000)) and raw.recv() == b"\x01"  # its subscription
            for frames in bad:
                raw.send_multipart(frames)
            raw.send_multipart(_VALID_FRAMES)
            raw.send_multipart([bytes(f) for f in encode_end("valid", 0.0)])
            assert wait_until(lambda: len(spans) == 1)
            stats = sub.stats()
            assert stats["malformed"] == len(bad) and stats["records"] == 1
            assert sub._thread.is_alive()
    finally:
        raw.close()
        ctx.term()
    assert spans[0].request_id == "valid" and spans[0].num_rows == _VALID[1].num_rows
