"""Hostile capture frames against the trainer daemon, with real parts: a real publisher and the
daemon's own subscriber on a real ZMQ ipc socket, DeepSpeed on CPU (gloo), the replay buffer on
disk, a tiny Llama target.

Frames that pass every wire check but do not fit the target (a hidden size of 4, a token id of
10^9, a first position near 2^40) used to crash `online-spec train`, and, being already stored in
the replay buffer, crash every restart. Now they are counted and dropped before the buffer, a
stored one (an older run's) is skipped when sampled, and a batch whose step fails (a non-finite
loss from huge-but-finite features) is dropped with the weights untouched.
"""

import threading
import time

import torch

from collector.publisher import CapturePublisher, PublisherConfig
from collector.replay import ReplayBuffer, ReplayConfig
from collector.span import CaptureSpan
from collector.subscriber import SubscriberConfig
from online_spec.capture import CaptureRecord
from online_spec.head import new_head
from tests.distill_helpers import greedy_records, tiny8
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loss import LossConfig


def misfits(target) -> list[CaptureRecord]:
    """Records every wire check accepts and the target cannot train on."""
    H = target.info.hidden_size
    tokens = torch.tensor([1, 2, 3])
    return [
        CaptureRecord("bad-hidden", 0, tokens, torch.randn(2, 12), torch.randn(2, 4), is_prefill=True),
        CaptureRecord("bad-token", 0, torch.tensor([1, 10**9, 3]), torch.randn(2, 3 * H), torch.randn(2, H),
                      is_prefill=True),
        CaptureRecord("bad-position", 2**40 - 8, tokens, torch.randn(2, 3 * H), torch.randn(2, H), is_prefill=True),
    ]


def make_daemon(target, tmp, sub="trainer"):
    return TrainerDaemon(
        DaemonConfig(run_dir=str(tmp / sub), batch_tokens=64, min_buffer_tokens=32, eval_every_steps=1000,
                     eval_every_s=1e6, eval_max_steps=2, save_every_steps=1, idle_sleep_s=0.05),
        target, None, SubscriberConfig(endpoint=f"ipc://{tmp}/capture.sock", idle_timeout_s=1.0, poll_ms=10),
        ReplayConfig(root=str(tmp / sub / "replay"), heldout_every=0, flush_interval_s=0.2, shard_bytes=1 << 20,
                     budget_bytes=8 << 20, memory_bytes=1 << 20),
        DistillConfig(lr=1e-3, warmup_steps=0, schedule="constant", bf16=False), LossConfig(ttt_steps=2),
        GateConfig(), head=new_head(target, 256, seed=0).float())


def run_in_thread(daemon, **kw):
    out = {}

    def go():
        try:
            out["summary"] = daemon.run(**kw)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def stored_ids(root) -> set[str]:
    buf = ReplayBuffer(ReplayConfig(root=str(root), budget_bytes=8 << 20, shard_bytes=1 << 20, memory_bytes=1 << 20))
    return {span.request_id for _, span in buf.stored_spans()}


def test_misfit_frames_are_dropped_before_the_buffer_and_restarts_train_on(tmp_path):
    target = tiny8()
    good, _ = greedy_records(target, num=4, new_tokens=24)
    daemon = make_daemon(target, tmp_path)
    thread, out = run_in_thread(daemon, max_seconds=60, max_steps=3)
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/capture.sock", wire_dtype="float32")) as pub:
        assert pub.wait_for_subscriber(20)
        time.sleep(0.3)  # the PUB/SUB slow joiner
        for rec in misfits(target) + good:
            pub.submit([rec])
            pub.end_request(rec.request_id)
        assert pub.drain(20)
        assert pub.stats()["dropped_invalid"] == 0  # all of them well-formed on the wire
        thread.join(90)
    assert not thread.is_alive()
    assert "error" not in out, out.get("error")
    s = out["summary"]
    assert s["refused_spans"] == {"stream": 3, "stored": 0}
    assert s["step"] == 3  # trained on the good spans
    assert s["stream"]["records"] == len(misfits(target)) + len(good)
    ids = stored_ids(tmp_path / "trainer" / "replay")
    assert ids == {r.request_id for r in good}  # the misfits were never persisted

    # an older run's buffer holding a misfit (stored before spans were checked): a restart skips it
    buf = ReplayBuffer(daemon.buffer.cfg)
    big = CaptureRecord("stored-bad", 0, torch.arange(201) % 7, torch.randn(200, 12), torch.randn(200, 4),
                        is_prefill=True)
    assert buf.add(CaptureSpan.from_records([big]))
    buf.flush()
    again = make_daemon(target, tmp_path)
    assert again.distiller.step == 3
    thread, out = run_in_thread(again, max_seconds=60, max_steps=6)
    thread.join(90)
    assert "error" not in out, out.get("error")
    assert out["summary"]["step"] == 6 and out["summary"]["refused_spans"]["stored"] >= 1


def test_a_batch_whose_step_fails_is_dropped_and_the_weights_stay(tmp_path):
    """Huge-but-finite features (3e38 passes every finiteness check) give a non-finite loss."""
    target = tiny8()
    H = target.info.hidden_size
    daemon = make_daemon(target, tmp_path)
    before = {k: v.clone() for k, v in daemon.distiller.head.state_dict().items()}
    n = 40
    huge = CaptureRecord("huge", 0, torch.arange(n + 1) % 50, torch.full((n, 3 * H), 3e38), torch.full((n, H), 3e38),
                         is_prefill=True)
    daemon.on_span(CaptureSpan.from_records([huge]))
    assert daemon.train_once() is False  # the step failed, the batch was dropped
    assert daemon.failed_steps == 1 and daemon.distiller.step == 0
    after = daemon.distiller.head.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in daemon.distiller.head.parameters())
    good, _ = greedy_records(target, num=2, new_tokens=24)
    for r in good:
        daemon.on_span(CaptureSpan.from_records([r]))
    for _ in range(30):  # batches drawn without the huge span train normally (each draw: ~70 %)
        daemon.train_once()
        if daemon.distiller.step:
            break
    assert daemon.distiller.step == 1
    assert all(bool(torch.isfinite(p).all()) for p in daemon.distiller.head.parameters())


class _Server:
    """The control client's side the daemon uses for its own alerts: info (the publisher's drops)
    and request("trainer_alert", ...)."""

    def __init__(self):
        self.dropped, self.alerts = 0, []

    def info(self):
        return {"head_version": 0, "capture_publisher": {"dropped_hwm": self.dropped, "dropped_queue_full": 0}}

    def request(self, command, args=None):
        assert command == "trainer_alert"
        self.alerts.append(args)
        return {"taken": args["kind"]}


def test_a_trainer_without_steps_while_traffic_waits_says_it_is_starved(tmp_path):
    """No steps in a window with traffic in the buffer, then dropped capture records: each raises
    its own alert, reported to the server and counted in the summary; a drift alert of the
    trainer's own kind does not boost its evaluations."""
    from collector.span import CaptureSpan
    from online_spec.starvation import StarvationConfig

    target = tiny8()
    recs, _ = greedy_records(target, num=2, new_tokens=24)
    daemon = make_daemon(target, tmp_path)
    daemon.publisher = server = _Server()
    daemon.starvation.cfg = StarvationConfig(window_s=60, min_steps_per_min=6, min_dropped=5)
    assert daemon.watch_starvation(now=1000.0) == []  # the buffer is empty: nothing waits
    for r in recs:
        daemon.buffer.add(CaptureSpan.from_records([r]))
    assert daemon.buffer.num_tokens >= daemon.cfg.min_buffer_tokens
    raised = [a.kind for t in range(1010, 1130, 10) for a in daemon.watch_starvation(now=float(t))]
    assert raised == ["trainer_starved"]  # once a whole window saw traffic waiting and no step
    server.dropped = 7
    assert [a.kind for a in daemon.watch_starvation(now=1130.0)] == ["capture_dropping"]
    assert [a["kind"] for a in server.alerts] == ["trainer_starved", "capture_dropping"]
    assert daemon.watch_starvation(now=1132.0) == []  # checked every 5 s at most
    s = daemon.summary()
    assert s["starvation_alerts"] == 2 and s["starved"] == ["capture_dropping", "trainer_starved"]
    daemon.on_drift(server.alerts[0])
    assert daemon._drift_until == 0.0
