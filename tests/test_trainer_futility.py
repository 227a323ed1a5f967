"""Futility: a trainer whose candidates the gate keeps refusing while the server serves trains at
--futile-scale of its duty (trainer/duty.py), gives the full duty back on a publish, a drift alert
or a head change, and is not reported starved while it rests by choice. The daemon's loop rests
in slices, so its watchers (seeds, rollback, the server's head) keep their cadence through a rest.
Tiny target (tests/distill_helpers.py); the gate's sample and scores are set by the test."""

import json
import threading
import time

import pytest

from collector.replay import ReplayConfig
from collector.subscriber import SubscriberConfig
from online_spec.config import ConfigError
from online_spec.starvation import StarvationConfig
from tests.distill_helpers import tiny8
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig
from trainer.duty import DutyCycle
from trainer.gate import GateConfig
from trainer.loss import LossConfig


class Load:
    idle, busy = False, True


def test_refusals_in_a_row_lower_the_duty_while_serving_only():
    load = Load()
    dc = DutyCycle(0.5, 1.0, threading.Event(), load, futile_evals=3, futile_scale=0.2)
    assert dc.duty() == 0.5
    dc.gate(False), dc.gate(False)
    assert dc.duty() == 0.5 and not dc.resting()
    dc.gate(False)
    assert dc.resting() and dc.duty() == pytest.approx(0.1) and dc.futile_spells == 1
    assert dc.rest_for(1.0) == pytest.approx(9.0) and dc.futile_rested_s == pytest.approx(9.0)
    dc.gate(False)
    assert dc.futile_spells == 1  # one spell, however long
    load.idle, load.busy = True, False
    assert dc.duty() == 1.0 and not dc.resting()  # a lull costs serving nothing: the idle duty
    load.idle = False
    assert dc.duty() == 0.5  # load unknown: never futile
    load.busy = True
    dc.gate(True)
    assert dc.duty() == 0.5 and dc.refused == 0  # a publish: the full duty
    for _ in range(3):
        dc.gate(False)
    dc.wake()
    assert dc.duty() == 0.5 and not dc.resting()
    off = DutyCycle(0.5, 1.0, threading.Event(), load, futile_evals=0, futile_scale=0.2)
    for _ in range(10):
        off.gate(False)
    assert off.duty() == 0.5
    with pytest.raises(ConfigError, match="futile_scale"):
        DaemonConfig(futile_scale=0.0)
    with pytest.raises(ConfigError, match="futile_evals"):
        DaemonConfig(futile_evals=-1)


class Server:
    """The control client's side the daemon uses: info (a serving server), swaps."""

    def __init__(self):
        self.version, self.swaps = 0, []

    def info(self):
        return {"head_version": self.version, "running_requests": 2, "waiting_requests": 1}

    def swap_dir(self, path, version=None, digest=None):
        self.swaps.append(version)
        self.version = version
        return {}

    def rollback(self, version=None):
        raise AssertionError("no rollback expected")


def daemon(tmp_path, **kw) -> TrainerDaemon:
    cfg = DaemonConfig(**{"run_dir": str(tmp_path / "d"), "max_duty": 0.5, "futile_evals": 3, "futile_scale": 0.2,
                          **kw})
    d = TrainerDaemon(cfg, tiny8(), None, SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay")), DistillConfig(), LossConfig(ttt_steps=3),
                      GateConfig(min_anchors=10, tag_regress=1.0), starvation_cfg=StarvationConfig(window_s=30, min_steps_per_min=6))
    d.publisher = Server()
    d.watch_server_head(now=0.0)
    assert d.server_head.busy
    return d


def test_the_gate_refusing_makes_the_daemon_rest_and_a_publish_or_drift_wakes_it(tmp_path, monkeypatch):
    d = daemon(tmp_path)
    scores = {"c": 1.0, "live": 1.5, "anchors": 50}
    monkeypatch.setattr(d, "_gate_sample", lambda tag=None: ["a span"])
    monkeypatch.setattr(d, "_gate_scores", lambda heldout, k: (scores["c"], scores["live"], scores["anchors"]))
    scores["anchors"] = 5  # too few anchors: no verdict, so no futility
    for _ in range(4):
        d.evaluate_and_publish()
    assert d.duty() == 0.5 and d.duty_cycle.refused == 0
    scores["anchors"] = 50
    for _ in range(3):
        d.evaluate_and_publish()
    assert d.duty() == pytest.approx(0.1) and d.summary()["futile"]["spells"] == 1
    d.on_drift({"kind": "acceptance_drop", "title": "drift"})
    assert d.duty() == 0.5
    for _ in range(3):
        d.evaluate_and_publish()
    assert d.duty() == pytest.approx(0.1)
    d.on_drift({"kind": "trainer_starved"})  # its own alert coming back: not drift
    assert d.duty() == pytest.approx(0.1)
    scores["c"] = 2.0
    d.evaluate_and_publish()
    assert d.publisher.swaps == [1] and d.duty() == 0.5
    saved = json.loads((tmp_path / "d" / "state.json").read_text())  # what bench e2e reports of the trainer
    assert saved["futile"] == {"rested_s": 0.0, "spells": 2, "refused_in_a_row": 0} and "rested_s" in saved


def test_a_resting_trainer_is_not_starved_but_a_busy_one_is(tmp_path):
    d = daemon(tmp_path, min_buffer_tokens=0)  # traffic "waits" from the start: an empty buffer suffices
    for _ in range(3):
        d.duty_cycle.gate(False)
    assert d.duty_cycle.resting()
    assert all(d.watch_starvation(now=t) == [] for t in range(0, 65, 5))  # no steps for a minute, by choice
    d.wake()
    alerts = [a for t in range(65, 130, 5) for a in d.watch_starvation(now=t)]
    assert [a.kind for a in alerts] == ["trainer_starved"]


def test_the_loop_rests_in_slices_and_a_wake_cuts_a_futile_rest(tmp_path, monkeypatch):
    d = daemon(tmp_path, idle_sleep_s=0.05, futile_scale=0.1)
    for _ in range(3):
        d.duty_cycle.gate(False)
    steps, watched = [], []

    def step():
        time.sleep(0.02)
        steps.append(time.monotonic())
        return True

    monkeypatch.setattr(d, "train_once", step)
    monkeypatch.setattr(d, "watch_seeds", lambda now=None: watched.append(time.monotonic()))
    out = {}
    runner = threading.Thread(target=lambda: out.update(d.run(max_seconds=1.2)))
    t0 = time.monotonic()
    runner.start()
    time.sleep(0.5)
    # futile (duty 0.05): a step of ~0.02 s, then ~0.38 s of rest, through which the watchers ran
    before = len(steps)
    assert 1 <= before and len([w for w in watched if w < t0 + 0.5]) >= 5
    d.on_drift({"kind": "acceptance_drop", "title": "drift"})
    runner.join(5)
    after = [s for s in steps if s > t0 + 0.5]
    # at the full duty (0.5) a step of ~0.02 s rests ~0.02 s: several times the futile rate
    assert len(after) >= 3 * max(before, 1), (before, len(after))
    assert out["futile"]["spells"] == 1 and out["futile"]["rested_s"] > 0


def test_the_starvation_watch_checks_on_time_through_a_long_step(tmp_path, monkeypatch):
    """A starved trainer's step can take minutes (beside a busy process at niceness 19: 4 minutes
    for one step); the watch runs on a thread of its own, so its checks keep their cadence through
    the step and stop with the loop."""
    import trainer.starvation_watch as sw

    monkeypatch.setattr(sw, "STARVATION_CHECK_S", 0.05)
    d = daemon(tmp_path)
    checks, in_step = [], threading.Event()

    def step():
        in_step.set()
        time.sleep(0.6)  # one slow step
        return True

    monkeypatch.setattr(d, "train_once", step)
    monkeypatch.setattr(d, "watch_starvation", lambda now=None: checks.append((time.monotonic(), in_step.is_set())))
    d.run(max_steps=None, max_seconds=0.5)  # the loop ends after the step that began inside 0.5 s
    during = [t for t, busy in checks if busy]
    assert len(during) >= 6, checks  # ~12 checks in the 0.6 s step, every 0.05 s
    n = len(checks)
    time.sleep(0.2)
    assert len(checks) == n  # the watch stopped with the loop

    def failing(now=None):
        checks.append((time.monotonic(), False))
        raise RuntimeError("the server is gone")
    stop = d.starvation_watch.beside(failing)
    time.sleep(0.2)
    stop.set()
    assert len(checks) >= n + 2  # a failed check is logged and the next one goes on


def test_a_resting_trainer_evaluates_every_n_steps_only_not_on_the_clock(tmp_path, monkeypatch):
    """--eval-every-s fires on the clock; while training is futile a candidate a step or two past
    the last refusal is no news, so only --eval-every-steps does (an evaluation costs more CPU than
    a step on a CPU: 2-4 s against ~2 s, trainer/cpu_ledger.py)."""
    d = daemon(tmp_path, eval_every_steps=3, eval_every_s=1.0, drift_boost_s=0.0)
    evals = []
    monkeypatch.setattr(d, "evaluate_and_publish", lambda: evals.append(d.distiller.step) or
                        setattr(d, "_last_eval_step", d.distiller.step))

    def step(n):  # a step taken with the clock's trigger long due
        d.distiller.step, d._last_eval_t = n, time.monotonic() - 60.0
        d.after_step({})

    step(1)
    assert evals == [1]  # not resting: the clock's trigger
    for _ in range(3):
        d.duty_cycle.gate(False)
    assert d.duty_cycle.resting()
    for n in (2, 3, 4, 5):
        step(n)
    assert evals == [1, 4]  # resting: every 3 steps
    d.on_drift({"kind": "acceptance_drop", "title": "drift"})  # a wake: the clock's trigger again
    step(6)
    assert evals == [1, 4, 6]
