"""The serving budget (trainer/slack.py): the trainer's duty capped by the slowdown the server's
own round clock shows while the trainer steps. The clock here is a stand-in that runs rounds at a
set pace, faster while the trainer rests (the real clock, over the real control socket, is
tested in tests/test_control.py); the daemon is a real one on the tiny target."""

import threading
import time

import pytest

from collector.replay import ReplayConfig
from collector.subscriber import SubscriberConfig
from online_spec.config import ConfigError
from serving.control_client import ControlError
from tests.distill_helpers import tiny8
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.daemon_config import GPU_SERVING_BUDGET
from trainer.distill import DistillConfig
from trainer.duty import DutyCycle
from trainer.gate import GateConfig
from trainer.loss import LossConfig
from trainer.slack import SlackGovernor, clock_cells, slowdown


class Clock:
    """A server's round clock: `rounds` rounds of one shape per read, each `rest_s` long, or
    `rest_s * (1 + slow)` while `busy` (the trainer stepping); a second shape at half the rate."""

    def __init__(self, rest_s=0.001, slow=1.0, rounds=20):
        self.rest_s, self.slow, self.rounds = rest_s, slow, rounds
        self.busy = False
        self.n = {(4, 4, 1): 0, (2, 3, 1): 0}
        self.s = {k: 0.0 for k in self.n}
        self.reads = 0

    def __call__(self):
        self.reads += 1
        pace = self.rest_s * (1 + self.slow if self.busy else 1.0)
        for i, key in enumerate(self.n):
            n = self.rounds // (i + 1)
            self.n[key] += n
            self.s[key] += n * pace * (1 + i)  # the second shape's rounds are longer, slowed alike
        return {"cells": [[*k, self.n[k], self.s[k]] for k in self.n], "rounds": sum(self.n.values())}


def test_the_slowdown_of_like_shapes_weighted_by_the_busy_rounds():
    busy = {(4, 4, 1): [10, 0.02], (2, 3, 1): [30, 0.03], (1, 2, 1): [50, 0.05]}
    rest = {(4, 4, 1): [10, 0.01], (2, 3, 1): [20, 0.04], (8, 9, 1): [99, 1.0]}
    s, weight = slowdown(busy, rest, min_rounds=8)
    # (4,4,1): 2x, (2,3,1): 0.001 / 0.002 = 0.5x; (1,2,1) has no rest rounds, (8,9,1) no busy ones
    assert weight == 40 and s == pytest.approx((10 * 2.0 + 30 * 0.5) / 40 - 1)
    assert slowdown(busy, rest, min_rounds=11) == (pytest.approx(0.5 - 1), 30)
    assert slowdown({(1, 2, 1): [5, 1.0]}, {(1, 2, 1): [5, 1.0]}, min_rounds=8) is None


def test_a_malformed_clock_is_refused_with_its_reason():
    assert clock_cells({"cells": [[4, 4, 1, 3, 0.5]]}) == {(4, 4, 1): (3, 0.5)}
    for bad in (None, {}, {"cells": "x"}, {"cells": [[4, 4, 1, 3]]}, {"cells": [[4, 4, 1, -1, 0.5]]},
                {"cells": [[4, 4.0, 1, 3, 0.5]]}, {"cells": [[4, 4, 1, 3, "0.5"]]}):
        with pytest.raises(ValueError, match="round_clock"):
            clock_cells(bad)


def test_the_cap_keeps_the_servers_loss_within_the_budget():
    clock = Clock(slow=1.0)  # a round takes twice as long while the trainer steps
    gov = SlackGovernor(clock, budget=0.03, min_duty=0.02, probe_duty=0.5, min_rounds=8)
    assert gov.on and gov.cap() == 0.5  # no estimate yet: the probe duty, so that rests exist
    for _ in range(4):
        gov.begin()  # closes a rest interval (none before the first reading)
        clock.busy = True
        gov.end(trained=True)  # the busy interval's rounds ran slow
        clock.busy = False
    s, weight = gov.estimate()
    assert s == pytest.approx(1.0) and weight > 0
    cap = gov.cap()
    assert cap == pytest.approx(0.03 * 2 / 1)
    assert cap * s / (1 + s) == pytest.approx(0.03)  # the loss the cap allows is the budget
    summary = gov.summary()
    assert summary["slowdown"] == pytest.approx(1.0) and summary["duty_cap"] == pytest.approx(0.06)
    assert summary["reads"] == 8 and summary["off"] is None


@pytest.mark.parametrize("slow, cap", [(0.0, 0.75), (-0.1, 0.75), (0.01, 0.75), (50.0, 0.05)])
def test_no_cost_frees_the_duty_but_for_rests_and_a_large_one_stops_at_the_floor(slow, cap):
    """No measurable cost: the duty goes to 0.75, never 1, so that rests keep the comparison current."""
    clock = Clock(slow=slow)
    gov = SlackGovernor(clock, budget=0.03, min_duty=0.05)  # 50x slower: 0.03 * 51 / 50 < the floor
    for _ in range(3):
        gov.begin()
        clock.busy = True
        gov.end(trained=True)
        clock.busy = False
    assert gov.cap() == pytest.approx(cap)


def test_a_spell_without_a_step_counts_as_rest_and_a_window_forgets_old_spells():
    clock = Clock(slow=1.0)
    gov = SlackGovernor(clock, budget=0.03, window=2)
    gov.begin()
    clock.busy = True
    gov.end(trained=False)  # nothing trained: a rest interval, although the clock ran slow
    clock.busy = False
    gov.begin()
    assert gov.estimate() is None  # rest intervals only
    for slow in (1.0, 3.0, 3.0):
        clock.slow = slow
        gov.begin()
        clock.busy = True
        gov.end(trained=True)
        clock.busy = False
    assert gov.estimate()[0] == pytest.approx(3.0, rel=0.01)  # the 1.0 spell left the window of 2


def test_an_old_server_turns_it_off_and_a_failed_read_drops_its_interval():
    def old():
        raise ControlError("unknown command 'round_clock' (one of info, swap)")

    gov = SlackGovernor(old, budget=0.03)
    gov.begin()
    assert not gov.on and gov.cap() is None and "no round_clock" in gov.summary()["off"]
    flaky, clock = {"fail": False}, Clock(slow=1.0)

    def read():
        if flaky["fail"]:
            raise ControlError("no reply within 2 s")
        return clock()

    gov = SlackGovernor(read, budget=0.03)
    gov.begin()
    clock.busy = True
    flaky["fail"] = True
    gov.end(trained=True)  # the busy interval is lost with its read
    flaky["fail"] = False
    clock.busy = False
    gov.begin()  # a first reading again: nothing to close
    assert gov.on and gov.estimate() is None and gov.failed_reads == 1
    assert SlackGovernor(clock, budget=0.0).cap() is None and SlackGovernor(None, 0.03).summary()["off"]
    with pytest.raises(ValueError, match="serving budget"):
        SlackGovernor(clock, budget=1.0)


def test_a_trainer_waiting_for_traffic_reads_the_clock_at_most_once_a_second():
    clock = Clock(slow=1.0)
    gov = SlackGovernor(clock, budget=0.03, idle_read_s=60.0)
    for _ in range(50):  # nothing to train on: the daemon's loop asks every --idle-sleep-s
        gov.begin()
        gov.end(trained=False)
    assert clock.reads == 2  # the first spell's two reads, then none within idle_read_s
    gov.begin()  # not read: the spell turns out to train
    clock.busy = True
    gov.end(trained=True)  # read, but as a new baseline: its interval mixed rest and busy rounds
    clock.busy = False
    assert clock.reads == 3 and gov.estimate() is None and not gov._busy
    for _ in range(2):
        gov.begin()
        clock.busy = True
        gov.end(trained=True)
        clock.busy = False
    assert gov.estimate()[0] == pytest.approx(1.0)


class Load:
    idle, busy = False, True


def test_the_duty_cycle_takes_the_lower_of_its_duty_and_the_cap():
    clock, load = Clock(slow=1.0), Load()
    dc = DutyCycle(0.25, 1.0, threading.Event(), load, read_clock=clock, serving_budget=0.03)
    assert dc.duty() == 0.25  # before an estimate: min(0.25, the probe duty 0.5)
    for _ in range(3):  # each spell's begin closes a rest interval, its end a busy one
        assert dc.spell(lambda: (setattr(clock, "busy", True), True)[1])
        clock.busy = False
    assert dc.duty() == pytest.approx(0.06)
    load.idle, load.busy = True, False
    assert dc.duty() == 1.0  # an idle server: its rounds are not there to slow
    reads = clock.reads
    with pytest.raises(RuntimeError):
        dc.spell(lambda: (_ for _ in ()).throw(RuntimeError("step failed")))
    assert clock.reads == reads + 2  # the failed spell was closed too (as rest: nothing trained)
    assert DutyCycle(0.25, 1.0, threading.Event(), load).governor.cap() is None  # no governor: off


def test_the_budget_defaults_to_the_device_and_refuses_odd_values():
    assert DaemonConfig().budget_on("cuda") == GPU_SERVING_BUDGET and DaemonConfig().budget_on("cpu") == 0.0
    assert DaemonConfig(serving_budget=0.0).budget_on("cuda") == 0.0
    assert DaemonConfig(serving_budget=0.05).budget_on("cpu") == 0.05
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="serving_budget"):
            DaemonConfig(serving_budget=bad)


class Server:
    """The control client's side the daemon uses: info (a serving server) and the round clock."""

    def __init__(self, clock):
        self.clock = clock

    def info(self):
        return {"head_version": 0, "running_requests": 4, "waiting_requests": 0}

    def round_clock(self):
        return self.clock()

    def swap_dir(self, path, version=None, digest=None):
        raise AssertionError("no swap expected")


def test_the_daemons_loop_measures_its_own_cost_and_rests_to_the_budget(tmp_path, monkeypatch):
    clock = Clock(slow=1.0)
    cfg = DaemonConfig(run_dir=str(tmp_path / "d"), max_duty=1.0, serving_budget=0.1, idle_sleep_s=0.01)
    d = TrainerDaemon(cfg, tiny8(), Server(clock), SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay")), DistillConfig(), LossConfig(ttt_steps=3),
                      GateConfig(min_anchors=10))
    d.watch_server_head(now=0.0)
    assert d.duty_cycle.governor.on and d.server_head.busy
    busy_s = []

    def step():
        clock.busy = True  # the server's rounds slow while this "step" runs
        t = time.monotonic()
        time.sleep(0.01)
        busy_s.append(time.monotonic() - t)
        return True

    def rest_reads():  # the clock's rounds between spells ran at the rest pace
        clock.busy = False

    monkeypatch.setattr(d, "train_once", step)
    monkeypatch.setattr(d.duty_cycle.governor, "end", _after(d.duty_cycle.governor.end, rest_reads))
    summary = d.run(max_seconds=1.5)
    budget = summary["serving_budget"]
    assert budget["slowdown"] == pytest.approx(1.0) and budget["duty_cap"] == pytest.approx(0.2)
    # the loop rested to the cap: about 0.2 of its time in steps (a few spells at the probe duty first)
    assert 0.12 < sum(busy_s) / 1.5 < 0.3, (len(busy_s), sum(busy_s))


def _after(fn, then):
    def wrapped(*a, **kw):
        out = fn(*a, **kw)
        then()
        return out
    return wrapped
