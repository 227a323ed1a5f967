"""The trainer's CPU ledger (trainer/cpu_ledger.py): the CPU seconds of its own work by kind, what
its summary, state.json and status line report. The daemon test runs a real step and a real gate
evaluation on a tiny target (8 layers, random weights) standing in for SmolLM2."""

import json
import time

import pytest

from collector.replay import ReplayConfig
from collector.subscriber import SubscriberConfig
from tests.distill_helpers import greedy_records, tiny8
from tests.test_trainer_daemon import served
from trainer.cpu_ledger import CpuLedger
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loss import LossConfig


def spin(seconds):
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_work_counts_under_its_kind_and_sleep_counts_nowhere():
    ledger = CpuLedger()
    with ledger.spend("steps"):
        spin(0.2)
    with ledger.spend("seeds"):
        time.sleep(0.3)  # waiting costs the machine nothing
    r = ledger.report()
    assert 0.19 <= r["steps_s"] <= 0.4 and r["seeds_s"] < 0.05 and r["evals_s"] == 0.0
    assert r["process_s"] >= r["steps_s"] and r["other_s"] >= 0.0
    assert r["wall_s"] >= 0.5 and r["share"] == pytest.approx(r["process_s"] / r["wall_s"], rel=0.05)


def test_work_that_fails_is_counted_and_an_unknown_kind_is_refused():
    ledger = CpuLedger()
    with pytest.raises(RuntimeError), ledger.spend("evals"):
        spin(0.05)
        raise RuntimeError("a failed evaluation still took the CPU")
    assert ledger.report()["evals_s"] >= 0.04
    with pytest.raises(ValueError, match="unknown kind of trainer work 'sleep'"), ledger.spend("sleep"):
        pass


def test_the_daemon_counts_its_step_and_its_evaluation_and_reports_them(tmp_path):
    target = tiny8()
    recs, _ = greedy_records(target, num=6, new_tokens=40)
    d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / "d"), eval_max_steps=3, min_buffer_tokens=16,
                                   batch_tokens=64, eval_every_steps=1), target, None,
                      SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay"), heldout_every=2),
                      DistillConfig(), LossConfig(ttt_steps=3), GateConfig(min_anchors=10))
    for r in recs:
        d.on_span(served(r))
    assert d.train_once()
    cpu = d.summary()["cpu"]
    assert cpu["steps_s"] > 0 and cpu["evals_s"] > 0 and cpu["seeds_s"] == 0.0  # no seeds given
    assert d.state["evals"] == 1
    d.write_state()
    saved = json.loads((tmp_path / "d" / "state.json").read_text())["cpu"]
    assert saved["steps_s"] == pytest.approx(cpu["steps_s"]) and saved["process_s"] >= cpu["process_s"]
