"""The capture sender process (`ProcessPublisher`) and its shared slots (`SharedRing`), for real:
a spawned child process, ZMQ ipc sockets, files in /dev/shm, a real engine (a tiny random
target on this CPU; the CUDA case, page-locked slots, needs a GPU and is skipped here).

No timing is asserted: a blocking call is detected by running it on a thread with a hard timeout.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from collector.process_publisher import ProcessPublisher, open_publisher
from collector.publisher import CapturePublisher, PublisherConfig
from collector.shared_ring import PREFIX, SharedRing, SlotReader
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from distill_helpers import tiny8
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from serving.engine import Engine, EngineConfig
from serving.requests import Request

DEADLINE_S = 30.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = {"r0": [5, 9, 33, 7], "r1": [1, 2, 3, 4, 5, 6], "r2": [100, 200, 300]}


def wait_until(cond, timeout_s: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def returns_within(fn, timeout_s: float = DEADLINE_S) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    target = tiny8()
    return target, new_head(target, draft_vocab_size=256, seed=3)


def _serve(model, pub, tree: bool = False, sampled: bool = False, tokens: int = 20):
    """The prompts through a real engine with `pub` as its capture sink; returns the outputs."""
    target, head = model
    shape = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if tree else {}
    eng = Engine(target, head, EngineConfig(max_batch=4, max_len=256, num_steps=3, **shape), publisher=pub)
    for rid, p in PROMPTS.items():
        extra = {"temperature": 0.8, "seed": 7} if sampled and rid == "r1" else {}
        eng.add_request(Request(p, SamplingParams(max_tokens=tokens, ignore_eos=True, **extra), request_id=rid))
    outs = {rid: [] for rid in PROMPTS}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return outs


def _capture(model, cls, tmp_path, **kw):
    spans = []
    with cls(PublisherConfig(endpoint=f"ipc://{tmp_path}/{cls.__name__}.sock")) as pub:
        with CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=spans.append).start() as sub:
            assert pub.wait_for_subscriber(DEADLINE_S)
            outs = _serve(model, pub, **kw)
            assert pub.drain(DEADLINE_S)
            stats = pub.stats()
            assert wait_until(lambda: sub.stats()["records"] == stats["sent"] and
                              sub.stats()["end_markers"] == stats["end_markers_sent"])
    return outs, {s.request_id: s for s in spans}, stats


@pytest.mark.parametrize("tree, sampled", [(False, False), (True, True)])
def test_the_sender_process_streams_what_the_sender_thread_streams(model, tmp_path, tree, sampled):
    """A real engine's chain (greedy) or tree (with a sampling request) rounds and prefills go
    out through the child process with the same rows, tokens and drafts, bit for bit, as through
    `CapturePublisher`, and the engine's outputs are the same with either."""
    ref_outs, ref, ref_stats = _capture(model, CapturePublisher, tmp_path, tree=tree, sampled=sampled)
    outs, got, stats = _capture(model, ProcessPublisher, tmp_path, tree=tree, sampled=sampled)
    assert outs == ref_outs and set(got) == set(ref) == set(PROMPTS)
    assert stats["sent"] == stats["submitted"] == ref_stats["sent"] > 0 and stats["end_markers_sent"] == 3
    assert stats["sender"] == "process" and stats["sender_alive"] and stats["queue_depth"] == 0
    for rid, span in got.items():
        r = ref[rid]
        assert span.first_pos == r.first_pos == 0 and torch.equal(span.tokens, r.tokens)
        assert torch.equal(span.features.view(torch.int16), r.features.view(torch.int16))
        assert torch.equal(span.final_hidden.view(torch.int16), r.final_hidden.view(torch.int16))
        assert torch.equal(span.accepted, r.accepted) and torch.equal(span.draft_token, r.draft_token)


def test_a_stopped_sender_process_never_blocks_serving_and_every_drop_is_counted(model, tmp_path):
    """With the child stopped (SIGSTOP) its two slots fill and later rounds are dropped, counted,
    while the engine serves on; continued, it sends what it holds and every record is accounted."""
    pub = ProcessPublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/c.sock"), max_slots=2)
    try:
        os.kill(pub._proc.pid, signal.SIGSTOP)
        done = {}
        assert returns_within(lambda: done.update(_serve(model, pub)))
        assert set(done) == set(PROMPTS)
        stats = pub.stats()
        assert stats["dropped_queue_full"] > 0 and pub.ring.unpooled > 0
        os.kill(pub._proc.pid, signal.SIGCONT)
        assert pub.drain(DEADLINE_S)
        s = pub.stats()  # nobody subscribed: what reached the child is counted there
        assert s["dropped_no_subscriber"] + s["dropped_queue_full"] == s["submitted"] > 0
        assert s["dropped_no_subscriber"] > 0
    finally:
        os.kill(pub._proc.pid, signal.SIGCONT)
        pub.close()


def test_a_killed_sender_process_is_started_again_and_the_stream_goes_on(model, tmp_path):
    spans = []
    with ProcessPublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/c.sock")) as pub:
        first = pub._proc.pid
        os.kill(first, signal.SIGKILL)
        # serving goes on while the child is dead and while it is started again (outside the lock)
        assert returns_within(lambda: _serve(model, pub, tokens=8))
        assert wait_until(lambda: pub.stats()["sender_restarts"] == 1 and pub.stats()["sender_alive"])
        assert pub._proc.pid != first
        with CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=spans.append).start() as sub:
            assert pub.wait_for_subscriber(DEADLINE_S)
            _serve(model, pub)
            assert pub.drain(DEADLINE_S)
            stats = pub.stats()
            assert wait_until(lambda: sub.stats()["records"] == stats["sent"] > 0)
            # every record is accounted: sent, or dropped while the child was dead or restarting
            assert stats["sent"] + stats["dropped_queue_full"] + stats["dropped_sender_died"] \
                + stats["dropped_no_subscriber"] == stats["submitted"]
    assert {s.request_id for s in spans} == set(PROMPTS)


def test_a_sender_process_that_cannot_bind_says_why_and_leaves_nothing(tmp_path):
    before = set(glob.glob("/dev/shm/online-spec-capture-*"))
    with CapturePublisher(PublisherConfig(endpoint="tcp://127.0.0.1:*")) as taken:
        with pytest.raises(RuntimeError, match="capture sender process: .*Address already in use"):
            ProcessPublisher(PublisherConfig(endpoint=taken.endpoint))
    assert set(glob.glob("/dev/shm/online-spec-capture-*")) == before
    with open_publisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/t.sock"), "engine") as pub:
        assert type(pub) is CapturePublisher


def test_shared_slots_are_busy_until_freed_grow_by_a_new_file_and_overflow_to_scratch(tmp_path):
    """`SharedRing` on this CPU (pageable shared memory, no event): a marked slot is not reused
    until the reader frees it, a free one too small gets a new file (the old one removed), with
    every slot busy the copies go to a scratch slot that is not in the ring, and close removes
    every file."""
    ring = SharedRing(pin=False, max_slots=2, directory=str(tmp_path))
    reader = SlotReader(ring.control_path, 2)
    x, y = torch.randn(2, 3, 12), torch.randn(2, 3, 4)
    f, h, ev = ring.stage(x, y)
    assert ev is None and ring.last == 0 and torch.equal(f, x.reshape(6, 12))
    ring.mark(0)
    rf, rh = reader.views(ring.describe(0), 6)  # another mapping of the same file
    assert torch.equal(rf, x.reshape(6, 12)) and torch.equal(rh, y.reshape(6, 4))
    ring.stage(x + 1, y + 1)
    assert ring.last == 1 and torch.equal(rf, x.reshape(6, 12))  # slot 0 untouched while busy
    ring.mark(1)
    g, _, _ = ring.stage(x + 2, y + 2)
    assert ring.last is None and ring.unpooled == 1 and torch.equal(g, (x + 2).reshape(6, 12))
    reader.free(0)
    old = ring.describe(0)[1]
    big = torch.randn(4, 10, 12), torch.randn(4, 10, 4)  # 40 rows: more than the 32 of slot 0
    ring.stage(*big)
    assert ring.last == 0 and ring.describe(0)[1] != old and not os.path.exists(old)
    bf, bh = reader.views(ring.describe(0), 40)
    assert torch.equal(bf, big[0].reshape(40, 12)) and torch.equal(bh, big[1].reshape(40, 4))
    with pytest.raises(ValueError, match="rows asked"):
        reader.views(ring.describe(0), 65)
    ring.close()
    assert os.listdir(tmp_path) == []
    ring.stage(x, y)  # closed: the scratch slot, no new file
    assert ring.last is None and os.listdir(tmp_path) == []


OWNER = """
import sys, torch
from collector.shared_ring import SharedRing
ring = SharedRing(pin=False, max_slots=2, directory=sys.argv[1])
ring.stage(torch.randn(1, 3, 12), torch.randn(1, 3, 4))
print(ring.prefix, flush=True)
sys.stdin.read()  # lives until the test closes stdin or kills it
"""


def _rename_owner(directory, prefix: str, fake: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(prefix):
            os.rename(os.path.join(directory, name), os.path.join(directory, fake + name[len(prefix):]))


def test_a_live_rings_files_are_kept_whatever_pid_they_name_and_a_killed_ones_removed(tmp_path):
    """Liveness is the control file's lock, held by the ring's process: a serving process in
    another pid namespace sharing /dev/shm names a pid that means nothing here (simulated: a real
    second process's files renamed to carry a pid that is gone); once it is killed, its files go."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        prefix = owner.stdout.readline().strip()
        assert prefix.startswith(PREFIX), prefix
        fake = f"{PREFIX}{gone.pid}-{prefix.rsplit('-', 1)[1]}"
        _rename_owner(tmp_path, prefix, fake)  # the lock stays with the file: a rename keeps the inode
        theirs = sorted(os.listdir(tmp_path))
        assert theirs == [f"{fake}-1.slot", f"{fake}.ctl"]
        ring = SharedRing(pin=False, max_slots=1, directory=str(tmp_path))
        assert set(theirs) <= set(os.listdir(tmp_path))  # alive: nothing of it removed
        ring.close()
        owner.kill()
        owner.wait()
        ring = SharedRing(pin=False, max_slots=1, directory=str(tmp_path))
        assert os.listdir(tmp_path) == [os.path.basename(ring.control_path)]  # killed: every file of it gone
        ring.close()
        assert os.listdir(tmp_path) == []
    finally:
        owner.kill()
        owner.wait()


def test_files_nobody_holds_are_removed_even_under_a_live_pid(tmp_path):
    """A pid reused since (here: this process's own pid) keeps nothing alive: files whose control
    file nobody has locked, and slot files with no control file, go; another program's files and
    a control file still being made (its private name, young) stay."""
    me = f"{PREFIX}{os.getpid()}-2e"
    (tmp_path / f"{me}.ctl").write_bytes(b"x")
    (tmp_path / f"{me}-1.slot").write_bytes(b"x")
    (tmp_path / f"{PREFIX}{os.getpid()}-3f-2.slot").write_bytes(b"x")  # its control file is gone
    other = tmp_path / "unrelated.slot"
    other.write_bytes(b"x")
    making = tmp_path / f"{PREFIX}{os.getpid()}-4a.ctl.{os.getpid()}.new"
    making.write_bytes(b"x")
    left = tmp_path / f"{PREFIX}{os.getpid()}-5b.ctl.{os.getpid()}.new"  # a maker that died before its rename
    left.write_bytes(b"x")
    os.utime(left, (time.time() - 3600, time.time() - 3600))
    ring = SharedRing(pin=False, max_slots=1, directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([other.name, making.name, os.path.basename(ring.control_path)])
    ring.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_slots_are_page_locked_on_cuda():
    """In /dev/shm, the default: CUDA page-locks shared memory there (on the H200 VM it refused a
    file under /tmp)."""
    ring = SharedRing(pin=True, max_slots=2)
    x, y = torch.randn(2, 3, 12, device="cuda"), torch.randn(2, 3, 4, device="cuda")
    f, h, ev = ring.stage(x, y)
    ev.synchronize()
    assert f.is_pinned() and h.is_pinned() and torch.equal(f, x.reshape(6, 12).cpu())
    ring.close()


def test_a_round_the_publisher_cannot_hand_over_is_dropped_counted_and_serving_goes_on(tmp_path):
    from online_spec.capture import CaptureRound, RoundRow

    with ProcessPublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/c.sock")) as pub:
        f, h, _ = pub.ring.stage(torch.randn(1, 2, 12), torch.randn(1, 2, 4))
        bad = CaptureRound([RoundRow("a", 0, 0, [1, 2], 0, 1, "")], f, h, row_index=[0], drafts=object(),
                           draft_probs=object())
        pub.submit(bad)  # does not raise
        assert pub.stats()["dropped_invalid"] == 1 and not pub.ring.control.busy.any()
