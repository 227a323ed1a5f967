"""Host windows (online_spec/host_window.py): background Python placed where the engine waits on the device.

The window's effect (less contention for the interpreter lock on a GPU host) is measured by
`bench e2e --device cuda` (docs/results.md); these tests hold its mechanics: the publisher's
sender and the planner's worker start their work only inside a window (or after the wait
bound), an engine opens windows around its read-backs and still outputs plain decoding's
tokens, and the planner never stalls an engine that waits for it. An engine on a CPU has the
publisher send on its own thread instead (measured by `bench collector`, docs/results.md).
"""

from __future__ import annotations

import threading
import time

import pytest

from collector import wire_round
from collector.publisher import CapturePublisher, PublisherConfig
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from collector_records import request_records
from online_spec.config import ConfigError
from online_spec.head import new_head
from online_spec.host_window import HostWindow, follow
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig
from serving.policy_planner import PlannedPolicy
from test_collector_stream import wait_until
from test_policy_planner import bare_policy


def test_wait_returns_when_a_window_opens_and_times_out_otherwise():
    w = HostWindow(wait_s=0.05)
    t0 = time.monotonic()
    assert w.wait() is False and time.monotonic() - t0 >= 0.04
    seen = []
    opened = threading.Event()

    def waiter():
        opened.set()
        seen.append(w.wait(10.0))

    th = threading.Thread(target=waiter)
    th.start()
    opened.wait(5)
    with pytest.raises(RuntimeError):
        with w.waiting():
            th.join(5)
            raise RuntimeError("a read-back failed")
    assert seen == [True] and w.opened == 1
    assert w.wait(0.01) is False  # closed again, though the body raised


def test_follow_hands_the_window_only_to_parts_that_take_one():
    class Part:
        window = None

        def follow_window(self, window):
            self.window = window

    w, part, other = HostWindow(), Part(), object()
    follow(part, w)
    follow(other, w)
    follow(None, w)
    assert part.window is w


def test_the_publisher_sends_a_round_only_inside_a_window(tmp_path):
    first, second = request_records("r1", 3), request_records("r2", 1)
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        window = HostWindow(wait_s=30.0)
        pub.follow_window(window)
        time.sleep(0.15)  # the sender is back at its queue, now following the window
        pub.submit(first)
        time.sleep(0.5)
        assert pub.stats()["sent"] == 0  # queued, waiting for the engine's next device wait
        with window.waiting():  # a short wait (the draft chain's read-back) does not start it
            time.sleep(0.3)
            assert pub.stats()["sent"] == 0
        with window.waiting(long=True):  # the verify's does
            assert pub.drain(10.0)
        assert pub.stats()["sent"] == len(first)
        pub.follow_window(None)
        pub.submit(second)
        assert pub.drain(10.0) and pub.stats()["sent"] == len(first) + len(second)  # no window: at once


class _ScriptedWindow(HostWindow):
    """A window that is never open and whose waits return at once, each recorded: the first
    `opens` of them as if a window opened, the rest as if none came within the bound."""

    def __init__(self, opens=1_000_000):
        super().__init__()
        self.waits, self.opens = [], opens

    def wait(self, timeout_s=None, long=False):
        self.waits.append(long)
        return len(self.waits) <= self.opens

    def is_open(self):
        return False


def test_the_publisher_sends_a_rounds_later_messages_only_in_later_windows(tmp_path, monkeypatch):
    """Once the engine's thread runs again (its window closed), the sender waits for its next
    long wait before each further message of the round, rather than take turns with it. A
    round's records share a message (up to `MAX_ROUND_RECORDS`): one record a message here, so
    that a round of three records is three messages."""
    rounds = request_records("r1", 2)  # a prefill record and two verify records
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/one.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        window = _ScriptedWindow()
        pub.follow_window(window)
        time.sleep(0.15)
        window.waits.clear()
        pub.submit(rounds)
        assert pub.drain(10.0) and pub.stats()["sent"] == 3 and pub.stats()["messages_sent"] == 1
        assert window.waits == [True]  # the round's start: its one message follows at once
    monkeypatch.setattr(wire_round, "MAX_ROUND_RECORDS", 1)
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        window = _ScriptedWindow()
        pub.follow_window(window)
        time.sleep(0.15)  # the sender is back at its queue, now following the window
        window.waits.clear()
        pub.submit(rounds)  # one round of three records, three messages
        assert pub.drain(10.0) and pub.stats()["sent"] == 3 == pub.stats()["messages_sent"]
        assert window.waits == [True, True, True]  # the round's start, then before messages 2 and 3
        # no long wait within the bound (an idle engine; rounds that read nothing back in one):
        # the round goes out whole after that one wait, as it did before windows knew their length
        window.opens, window.waits = 0, []
        pub.submit(request_records("r2", 2))
        assert pub.drain(10.0) and pub.stats()["sent"] == 6
        assert window.waits == [True]
        # a window for the start, none for the second message: the third goes out without waiting
        window.opens, window.waits = 1, []
        window.opened += 1  # the engine opened a window since that timed-out wait: items wait for one again
        pub.submit(request_records("r3", 2))
        assert pub.drain(10.0) and pub.stats()["sent"] == 9
        assert window.waits == [True, True]


def test_an_idle_engine_costs_a_backlog_one_wait_and_end_markers_none(tmp_path):
    """A wait that finds no window within its bound (the engine idle) lets the queued rounds after
    it go out without waiting, until the engine opens a window again; an end marker never waits
    for one. Before, a backlog met by an idle engine (the end of a run, a pause in traffic) went
    out one `wait_s` (20 ms) an item, and every end marker took a window a round needed."""
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        window = _ScriptedWindow(opens=0)  # no window ever comes within the bound
        pub.follow_window(window)
        time.sleep(0.15)  # the sender is back at its queue, now following the window
        window.waits.clear()
        for i in range(5):  # a backlog of five rounds and their end markers
            pub.submit(request_records(f"r{i}", 1))
            pub.end_request(f"r{i}")
        assert pub.drain(10.0)
        stats = pub.stats()
        assert stats["sent"] == 10 and stats["end_markers_sent"] == 5
        assert window.waits == [True]  # the first round's wait timed out; nothing waited after it
        window.opened += 1  # the engine runs again: the next round waits for its window
        window.opens, window.waits = 1_000_000, []
        pub.submit(request_records("r5", 1))
        pub.end_request("r5")
        assert pub.drain(10.0) and pub.stats()["sent"] == 12 and pub.stats()["end_markers_sent"] == 6
        assert window.waits == [True]  # the round's; its end marker's none


def test_a_deferred_publisher_sends_when_pumped_and_flushes_what_no_pump_took(tmp_path, monkeypatch):
    """`send_deferred`: rounds and end markers wait for the caller's `pump` (the engine's thread,
    before its verify read-back), which sends them in order on the caller's thread; what no pump
    takes for `DEFER_FLUSH_S` (an idle engine) the sender thread sends; `close` sends the rest."""
    import collector.publisher as publisher_mod

    monkeypatch.setattr(publisher_mod, "DEFER_FLUSH_S", 3600.0)
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        pub.send_deferred()
        pub.submit(request_records("r1", 2))
        pub.end_request("r1")
        time.sleep(0.3)  # the sender thread polls every 0.1 s: it must leave kept items alone
        assert pub.stats()["sent"] == 0 and pub.stats()["end_markers_sent"] == 0
        senders = []
        deliver = pub._deliver
        monkeypatch.setattr(pub, "_deliver", lambda item, in_window=False: (
            senders.append((threading.current_thread().name, type(item).__name__)), deliver(item, in_window)))
        pub.pump()  # this thread sends both, the round first
        assert pub.stats()["sent"] == 3 and pub.stats()["end_markers_sent"] == 1
        assert senders == [("MainThread", "list"), ("MainThread", "EndOfRequest")]
        monkeypatch.setattr(publisher_mod, "DEFER_FLUSH_S", 0.0)  # an idle engine: the sender thread flushes
        pub.submit(request_records("r2", 1))
        assert wait_until(lambda: pub.stats()["sent"] == 5)  # not `drain`: it pumps on the caller's thread
        assert senders[-1] == ("capture-publisher", "list")
        monkeypatch.setattr(publisher_mod, "DEFER_FLUSH_S", 3600.0)
        pub.end_request("r2")  # kept: the publisher's close sends it
        pub.close()
    assert pub.stats()["end_markers_sent"] == 2 and pub.stats()["queue_depth"] == 0


def test_an_engine_pumps_the_kept_capture_before_its_verify_read_back(tmp_path):
    """capture_sender 'engine': each round's capture goes out from the engine's thread just before
    the next verify read-back (on a GPU, while the device verifies); the output is plain
    decoding's and every record is sent. Run here on a CPU engine, whose verify does not run
    asynchronously: the placement, not its overlap, is what this holds."""
    from serving.engine_config import EngineConfig as Cfg
    from online_spec.config import ConfigError as CfgError

    with pytest.raises(CfgError, match="capture_sender"):
        Cfg(capture_sender="child")
    target = tiny_target(num_layers=4)
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=3, max_len=256, num_steps=0)).generate(prompts, params)
    with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap.sock")) as pub, \
            CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=lambda span: None).start():
        assert pub.wait_for_subscriber(10.0)
        eng = Engine(target, new_head(target, seed=4), EngineConfig(max_batch=3, max_len=256, num_steps=3,
                                                                   capture_sender="engine"), publisher=pub)
        pumps = []
        pump = pub.pump
        eng._pump = lambda: (pumps.append((threading.current_thread().name, len(pub._deferred))), pump())
        out = eng.generate(prompts, params)
        assert pub.drain(10.0)
        stats = pub.stats()
        assert {name for name, _ in pumps} == {"MainThread"} and sum(n for _, n in pumps) > 0
        pumps.clear()  # sampled requests read no greedy choice back: the accept pumps before its own work
        eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=3))
        assert pub.drain(10.0) and pub.stats()["sent"] == pub.stats()["submitted"] > stats["submitted"]
        assert {name for name, _ in pumps} == {"MainThread"} and sum(n for _, n in pumps) > 0
    assert out == plain
    assert stats["submitted"] > 0 and stats["sent"] == stats["submitted"] and stats["dropped_invalid"] == 0


def test_engine_windows_change_nothing_but_where_the_workers_run():
    target = tiny_target(num_layers=4)
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=3, max_len=256, num_steps=0)).generate(prompts, params)
    runs = {}
    for windows in ("off", "on"):
        planned = PlannedPolicy(bare_policy())
        eng = Engine(target, new_head(target, seed=4),
                     EngineConfig(max_batch=3, max_len=256, max_steps=5, host_windows=windows), policy=planned)
        if eng.window is not None:
            eng.window.wait_s = 30.0  # a worker that missed every window would stall the run: it must not
        t0 = time.monotonic()
        out = eng.generate(prompts, params)
        runs[windows] = (out, planned.info()["planner"], eng.window, time.monotonic() - t0)
        planned.close()
    for windows, (out, info, window, wall) in runs.items():
        assert out == plain, windows
        assert info["rounds_learnt"] > 10 and info["failures"] == 0
    assert runs["off"][2] is None
    window = runs["on"][2]
    assert window.opened >= runs["on"][1]["rounds_queued"]  # at least the verify's read-back each round
    assert runs["on"][3] < 30.0


def test_host_windows_default_to_cuda_devices_only():
    import torch
    cfg = EngineConfig()
    assert cfg.windows_on(torch.device("cuda")) and not cfg.windows_on(torch.device("cpu"))
    assert EngineConfig(host_windows="on").windows_on(torch.device("cpu"))
    assert not EngineConfig(host_windows="off").windows_on(torch.device("cuda"))
    with pytest.raises(ConfigError):
        EngineConfig(host_windows="sometimes")


def _thread_spy(pub: CapturePublisher) -> list[str]:
    """The names of the threads that send the publisher's items, in order."""
    names: list[str] = []
    send = pub._send_item

    def spy(item, *args):
        names.append(threading.current_thread().name)
        send(item, *args)

    pub._send_item = spy
    return names


def test_a_cpu_engine_has_the_publisher_send_on_its_own_thread(tmp_path):
    """On a CPU (no host windows) every round's records and every end marker are encoded and sent
    on the engine's thread, before `submit` / the round returns: nothing is left queued for the
    sender thread, the subscriber gets every record, and the output is plain decoding's. An engine
    with windows leaves the sending to the sender thread (it follows the windows), and a
    publisher handed over later is placed the same way."""
    target = tiny_target(num_layers=2)
    prompts = [list(range(3 + i, 30 + 4 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=3, max_len=128, num_steps=0)).generate(prompts, params)
    received = []
    for n, windows in enumerate(("off", "on", "off")):
        with CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/cap{n}.sock")) as pub, \
                CaptureSubscriber(SubscriberConfig(endpoint=pub.endpoint), on_span=received.append).start() as sub:
            assert pub.wait_for_subscriber(10.0)
            names = _thread_spy(pub)
            cfg = EngineConfig(max_batch=3, max_len=128, num_steps=3, host_windows=windows)
            if n < 2:
                eng = Engine(target, new_head(target, seed=2), cfg, publisher=pub)
            else:  # handed over after the engine was built
                eng = Engine(target, new_head(target, seed=2), cfg)
                eng.publisher = pub
            if eng.window is not None:
                eng.window.wait_s = 0.001
            assert eng.generate(prompts, params) == plain
            eng.step()  # releases the requests of the last round: their end markers
            stats = pub.stats()
            if windows == "off":
                # sent as the rounds ran: counted before any drain, and by the engine's thread only
                assert stats["submitted"] > 0 and stats["sent"] == stats["submitted"]
                assert stats["end_markers_sent"] == len(prompts)
                assert set(names) == {threading.current_thread().name}
            else:
                assert pub.drain(10.0)
                assert set(names) == {"capture-publisher"}
            assert wait_until(lambda: sub.records >= stats["submitted"])
