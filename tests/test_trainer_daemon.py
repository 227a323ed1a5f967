"""The trainer daemon with real parts: the real server (SmolLM2) streaming capture records over a
real ZMQ socket, the control endpoint, DeepSpeed on CPU, the replay buffer on disk.

- in-process: the daemon learns from live traffic and publishes a head that beats the live one
  (a deliberately wrong head); the server drafts with it between rounds; no request fails
- kill -9 of the daemon process under load: 0 failed requests, and the restarted daemon resumes
  (step counter and buffer survive)
- the gate refuses a deliberately worse candidate and publishes a better one (tiny target)
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from collector.replay import ReplayConfig
from collector.span import CaptureSpan
from collector.subscriber import SubscriberConfig
from online_spec.config import ConfigError
from online_spec.data import sharegpt_conversations
from online_spec.head import new_head
from serving.control import ControlClient, ControlConfig
from serving.engine import EngineConfig
from bench.lossless import wrong_head
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread
from collector.publisher import CapturePublisher, PublisherConfig
from tests.distill_helpers import greedy_records, tiny8, trained_head
from trainer.batch import collate
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig, Distiller
from trainer.gate import GateConfig
from trainer.loss import LossConfig
from trainer.seeds import eval_copy

REPO = Path(__file__).resolve().parents[1]


def served(record, prompt_rows: int = 8) -> CaptureSpan:
    """A teacher-forced record of a greedy sequence as the server captures it: its first
    `prompt_rows` rows are the prompt's (prefill), the rest generated (the gate scores only
    drafts made from generated rows, where serving drafts)."""
    span = CaptureSpan.from_records([record])
    span.is_prefill = span.is_prefill.clone()
    span.is_prefill[prompt_rows:] = False
    return span


class Load:
    """Streaming /v1/completions clients on loopback until stopped; counts failures."""

    def __init__(self, url: str, prompts: list[str], clients: int = 3, max_tokens: int = 24):
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.done = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            body = {"model": "m", "prompt": self.prompts[n % len(self.prompts)], "max_tokens": self.max_tokens,
                    "temperature": 0, "stream": True}
            n += len(self._threads)
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                    text = "".join(line for line in r.iter_lines())
                    if "[DONE]" not in text:
                        raise RuntimeError("stream ended without [DONE]")
                self.done += 1
            except Exception as e:  # counted, reported by the test
                self.failed += 1
                self.errors.append(repr(e))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


@pytest.fixture(scope="module")
def prompts(smol):
    convs = sharegpt_conversations(limit=24, seed=3, max_prompt_tokens=60, tokenizer=smol.tokenizer)
    return [c[0]["content"] for c in convs]


def start_server(target, tmp: Path, head, version: int):
    pub = PublisherConfig(endpoint=f"ipc://{tmp}/capture.sock")
    cfg = ServerConfig(engine=EngineConfig(max_batch=4, max_len=512, num_steps=3), capture=True, publisher=pub,
                       control=ControlConfig(run_dir=str(tmp / "serve"), allowed_roots=str(tmp)))
    server = SpecServer(cfg, target, head, head_version=version, publisher=CapturePublisher(pub))
    server.start()
    http = HttpThread(server).start()
    return server, http


def daemon_cfgs(tmp: Path):
    return (DaemonConfig(run_dir=str(tmp / "trainer"), batch_tokens=128, min_buffer_tokens=64, eval_every_steps=2,
                         eval_every_s=1000, eval_tokens=256, eval_max_steps=3, save_every_steps=1),
            SubscriberConfig(endpoint=f"ipc://{tmp}/capture.sock", idle_timeout_s=2.0),
            ReplayConfig(root=str(tmp / "trainer" / "replay"), heldout_every=3, flush_interval_s=1.0),
            DistillConfig(lr=2e-3, warmup_steps=0, schedule="constant"),
            LossConfig(ttt_steps=2),
            # no margin: this test is about the publish path (train -> gate -> checkpoint -> swap ->
            # the server drafts with it); the gate's judgment has its own test below
            GateConfig(margin_rel=0.0, margin_abs=0.0, min_anchors=20, rollback_min_rounds=10_000))


def stop_after_publish(daemon: TrainerDaemon, timeout_s: float) -> None:
    """Stops `daemon` once it has swapped a head into the server (or after `timeout_s`)."""
    t_end = time.monotonic() + timeout_s
    while daemon.state["swaps"] < 1 and time.monotonic() < t_end:
        time.sleep(0.2)
    daemon.stop()


def test_daemon_learns_from_live_traffic_and_publishes(smol, prompts, tmp_path):
    server, http = start_server(smol, tmp_path, wrong_head(smol), version=0)
    rounds = []
    server.round_observers.append(lambda s, o, t: rounds.append((s.head_version, s.num_steps, sum(s.accepted))))
    load = Load(http.url, prompts)
    try:
        dcfg, scfg, rcfg, distill, loss, gate = daemon_cfgs(tmp_path)
        daemon = TrainerDaemon(dcfg, smol, ControlClient.from_run_dir(tmp_path / "serve"), scfg, rcfg,
                               distill, loss, gate)
        # Until the first publish (or 600 s), not a fixed step count: the gate needs 20 held-out
        # anchors, and how many steps the trainer takes before the server has generated them
        # depends on the machine (alone: ~16 steps; CI of 2026-11-25 ran 24 steps and never got
        # there). This test is about the publish path, not how soon the traffic arrives.
        stopper = threading.Thread(target=stop_after_publish, args=(daemon, 600), daemon=True)
        stopper.start()
        summary = daemon.run(max_seconds=600)
        stopper.join()
        # some rounds drafted with the new head (30 s at most; the check below says if none came)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and sum(v == daemon.state["live_version"] and k > 0
                                               for v, k, _ in list(rounds)) < 3:
            time.sleep(0.1)
    finally:
        load.stop()
        http.stop()
        server.close()
    assert load.failed == 0, load.errors[:3]
    assert load.done > 0
    assert summary["step"] >= 2 and summary["buffer"]["received"] > 0
    assert summary["swaps"] >= 1, summary
    live = summary["live_version"]
    assert (tmp_path / "trainer" / "ckpt" / f"v{live}" / "model.safetensors").exists()
    drafted_new = [r for r in rounds if r[0] == live and r[1] > 0]
    assert drafted_new, "the server never drafted with the published head"
    assert all(acc == 0 for v, k, acc in rounds if v == 0)  # the wrong head: nothing accepted


def test_kill_9_under_load_then_resume(smol, prompts, tmp_path):
    server, http = start_server(smol, tmp_path, new_head(smol, seed=1), version=0)
    load = Load(http.url, prompts)
    run_dir = tmp_path / "trainer"
    cmd = [sys.executable, "-m", "online_spec.cli", "train", "--run-dir", str(run_dir),
           "--capture-endpoint", f"ipc://{tmp_path}/capture.sock", "--capture-idle-timeout-s", "2",
           "--control-run-dir", str(tmp_path / "serve"), "--batch-tokens", "96", "--min-buffer-tokens", "48",
           "--save-every-steps", "1", "--eval-every-steps", "1000", "--replay-flush-interval-s", "1",
           "--replay-heldout-every", "3", "--loss-ttt-steps", "1", "--wandb-mode", "disabled", "--threads", "1"]
    # a fresh process group of its own: not the rendezvous this pytest process may hold
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | {"PYTHONPATH": str(REPO)}
    proc = None
    try:
        log_file = open(tmp_path / "trainer.log", "w")
        proc = subprocess.Popen(cmd + ["--max-seconds", "900"], cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT)
        state_file = run_dir / "state.json"
        deadline = time.monotonic() + 600
        saved = 0
        while time.monotonic() < deadline and saved < 2:
            time.sleep(1)
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            if state_file.exists():
                saved = json.loads(state_file.read_text())["step"]
        assert saved >= 2, "the daemon never trained"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        time.sleep(2)  # serving goes on without its trainer
        before = json.loads(state_file.read_text())
        received_before = before["buffer"]["counters"]["received"]
        assert received_before > 0
        # restart: it resumes from the saved step, with the buffer it had on disk
        out = subprocess.run(cmd + ["--max-steps", str(before["step"] + 2)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        # state.json is written after distiller.pt: a kill between the two leaves it one step behind
        resumed = int(re.search(r"resumed at step (\d+)", out.stderr).group(1))
        assert resumed in (before["step"], before["step"] + 1), out.stderr[-2000:]
        after = json.loads(state_file.read_text())
        assert after["step"] == before["step"] + 2
        assert after["buffer"]["counters"]["received"] >= received_before
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        load.stop()
        http.stop()
        server.close()
    assert load.failed == 0, load.errors[:3]


def test_gate_refuses_a_worse_candidate_and_publishes_a_better_one(tmp_path):
    target = tiny8()
    recs, _ = greedy_records(target, num=6, new_tokens=40)
    good = trained_head(target, recs)
    bad = new_head(target, 256, seed=0).float()

    def daemon_with(candidate, live, sub):
        d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), eval_max_steps=3), target, None,
                          SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                          ReplayConfig(root=str(tmp_path / sub / "replay"), heldout_every=1),
                          DistillConfig(), LossConfig(ttt_steps=3), GateConfig(min_anchors=10), head=candidate)
        d.live_head = eval_copy(live, target)
        for r in recs:
            d.on_span(served(r))
        return d

    refused = daemon_with(bad, good, "a").evaluate_and_publish()
    assert not refused.publish and refused.candidate < refused.live
    d = daemon_with(good, bad, "b")
    accepted = d.evaluate_and_publish()
    assert accepted.publish and accepted.candidate > accepted.live + 0.5
    assert d.state["live_version"] == 1 and (tmp_path / "b" / "ckpt" / "v1" / "config.json").exists()


def test_gate_scores_generated_rows_and_counts_the_live_head_once_per_version(tmp_path, monkeypatch):
    """The gate's sample holds only held-out requests with generated rows (a prompt-only span is
    skipped), each cut after eval_generated_rows of them; the live head's counts of a span are
    computed once while it stays live (the candidate's every time), the scores equal a fresh
    simulation of the same spans, and a new live head is counted afresh."""
    import trainer.daemon as daemon_mod
    import trainer.evaluate as evaluate_mod
    from trainer.evaluate import simulate_acceptance

    target = tiny8()
    recs, _ = greedy_records(target, num=6, new_tokens=40)
    d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / "d"), eval_max_steps=3, eval_tokens=10**6,
                                   eval_generated_rows=20), target, None,
                      SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay"), heldout_every=1),
                      DistillConfig(), LossConfig(ttt_steps=3), GateConfig(min_anchors=10),
                      head=new_head(target, 256, seed=1).float())
    d.on_span(CaptureSpan.from_records([recs[0]]))  # all prompt: nothing was drafted on it
    for r in recs[1:4]:
        d.on_span(served(r))
    sample = d._gate_sample()
    assert [s.request_id for s in sample] == ["greedy-3", "greedy-2", "greedy-1"]
    assert all(s.num_rows == 8 + 20 and int(s.is_prefill.sum()) == 8 for s in sample)  # 20 anchors: rows 7..26

    ks = [1, 2, 3]  # a fresh simulation of the same spans, before counting starts
    fresh = {name: simulate_acceptance(head, target, sample, 3, ks=ks, generated_only=True)
             for name, head in (("cand", d.distiller.head), ("live", d.live_head))}
    counted = []
    real = daemon_mod.record_counts

    def count(head, t, spans, *a, **k):
        counted.append((head is d.live_head, len(spans)))
        return real(head, t, spans, *a, **k)
    monkeypatch.setattr(daemon_mod, "record_counts", count)  # the candidate's
    monkeypatch.setattr(evaluate_mod, "record_counts", count)  # the live head's (`LiveCounts`)
    c, lv, anchors = d._gate_scores(sample, {3: 1})
    assert anchors == fresh["cand"]["anchors"] == 3 * 20
    assert c == pytest.approx(fresh["cand"]["accept_length"]["3"]) and lv == pytest.approx(fresh["live"]["accept_length"]["3"])
    for r in recs[4:]:
        d.on_span(served(r))
    c2, lv2, _ = d._gate_scores(d._gate_sample(), {3: 1})
    assert counted == [(False, 3), (True, 3), (False, 5), (True, 2)]  # the live head: only the 2 new spans
    d.live_head = eval_copy(d.distiller.head, target)  # a swap: the new live head is counted afresh
    d._gate_scores(d._gate_sample(), {3: 1})
    assert counted[-1] == (True, 5)
    # the server drafts K = 2 (K = 3 in under 1 % of its rounds): the candidate is simulated 2 steps deep
    depths = []
    monkeypatch.setattr(daemon_mod, "record_counts", lambda h, t, sp, n, **k: depths.append(n) or real(h, t, sp, n, **k))
    c2, _, _ = d._gate_scores(sample, {2: 200, 3: 1})
    assert depths == [2] and c2 == pytest.approx(fresh["cand"]["accept_length"]["2"])


def test_gate_refuses_a_head_that_learned_the_new_tag_and_forgot_the_old(tmp_path):
    """Live head trained on "chat" sequences, candidate on "code" ones; the newest held-out traffic
    is code, on which the candidate wins, but the buffer also holds chat, on which it is worse:
    refused with the tag named (and published once the guard is off)."""
    from trainer.data import capture_tokens

    target = tiny8()
    _, chat_seqs = greedy_records(target, num=6, new_tokens=40, seed=1)
    _, code_seqs = greedy_records(target, num=6, new_tokens=40, seed=0)
    chat = capture_tokens(target, chat_seqs, [f"chat-{i}" for i in range(6)], tag="chat")
    code = capture_tokens(target, code_seqs, [f"code-{i}" for i in range(6)], tag="code")

    def trained_on(recs):
        dist = Distiller(target, new_head(target, 256, seed=0).float(),
                         DistillConfig(lr=3e-3, warmup_steps=0, schedule="constant"), LossConfig(ttt_steps=3))
        for _ in range(40):
            dist.train_step(collate(recs))
        return dist.head

    live, cand = trained_on(chat), trained_on(code)

    def decide(tag_regress, sub):
        d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), eval_max_steps=3, eval_tokens=150), target, None,
                          SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                          ReplayConfig(root=str(tmp_path / sub / "replay"), heldout_every=1), DistillConfig(),
                          LossConfig(ttt_steps=3), GateConfig(min_anchors=10, tag_regress=tag_regress), head=cand)
        d.live_head = eval_copy(live, target)
        for r in chat + code:  # code arrives last: the newest held-out traffic is code only
            d.on_span(served(r))
        return d.evaluate_and_publish()

    refused = decide(0.05, "guard")
    assert refused.candidate > refused.live  # it wins on the newest traffic ...
    assert not refused.publish and "'chat'" in refused.reason  # ... but forgot chat
    assert decide(1.0, "off").publish


class FakeServer:
    """The control endpoint as the daemon sees it: info (the live version), swap_dir, rollback."""

    def __init__(self, version: int, with_info: bool = True):
        self.version, self.history = version, [version]
        if not with_info:
            self.info = None

    def info(self):
        return {"head_version": self.version}

    def swap_dir(self, path, version=None, digest=None):
        self.version = version
        self.history.append(version)
        return {"version": version}

    def rollback(self, version=None):
        if version is not None and version != self.version:
            raise RuntimeError(f"v{version} is not live (v{self.version} is): nothing to roll back")
        self.history.append(self.history[-2])
        self.version = self.history[-1]
        return {"version": self.version}


def test_published_versions_continue_after_the_live_head(tmp_path):
    """The daemon numbers its versions after the server's live head (control `info`), or after
    the starting checkpoint's metadata version: never a second v1 beside a live v1. A rollback to
    the starting version restores the starting head for the daemon's own comparisons."""
    from online_spec.checkpoint import save_head

    target = tiny8()
    start = tmp_path / "start"
    save_head(new_head(target, 256, seed=0), start, version=7)

    def daemon(sub, publisher):
        return TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), init_head=str(start)), target, publisher,
                             SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                             ReplayConfig(root=str(tmp_path / sub / "replay")), DistillConfig(), LossConfig(ttt_steps=1))

    d = daemon("meta", None)  # no server to ask: the checkpoint's metadata says v7
    assert d.state["live_version"] == 7 and d.publish() == 8 and d.publish() == 9
    server = FakeServer(12)  # the server says v12 (an operator swapped heads after v7)
    d = daemon("server", server)
    assert d.state["live_version"] == 12 and d.publish() == 13
    server.version = 20  # an operator swap while the daemon runs: the next version goes above it
    assert d.publish() == 21 and server.history == [12, 13, 21]
    assert d.state["published"][-1]["version"] == 21
    # restart: the saved state keeps the numbering; the rollback target of the first version is
    # the starting head, which has no ckpt/v12 directory
    d2 = daemon("server", server)
    assert d2.state["next_version"] == 22 and d2.state["initial_version"] == 12
    assert torch.equal(d2._load_version(12).fc.weight, d2._initial_head().fc.weight)
    d3 = daemon("unreachable", FakeServer(3, with_info=False))
    assert d3.state["live_version"] == 7


def test_a_rollback_of_a_head_the_server_already_replaced_reinstalls_nothing(tmp_path):
    """The trainer judged v1 bad, but the server's head bank had swapped v0 back in meanwhile: an
    unnamed rollback would reinstall the server's previous head, v1 itself (seen on an H100,
    2026-11-28). The daemon names v1; the server refuses; the daemon adopts the server's v0."""
    from online_spec.checkpoint import save_head
    from trainer.gate import RollbackDecision

    target = tiny8()
    start = tmp_path / "start"
    save_head(new_head(target, 256, seed=0), start, version=0)
    server = FakeServer(0)
    d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / "d"), init_head=str(start)), target, server,
                      SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay")), DistillConfig(), LossConfig(ttt_steps=1))
    assert d.publish() == 1 and server.history == [0, 1]
    server.version = 0  # the bank brought v0 back
    server.history.append(0)
    d.rollbacks.update = lambda live: RollbackDecision("rollback", "v1 drafts worse than v0")
    d.watch_rollback()
    assert server.history == [0, 1, 0] and server.version == 0  # v1 was not reinstalled
    assert d.watch_server_head(now=1e9) == 0 and d.state["live_version"] == 0
    # a rollback the server takes: the seed checks wait a dwell (the rolled-back seed is not re-adopted at once)
    assert d.publish() == 2
    before = time.monotonic()
    d.watch_rollback()
    assert server.version == 0 and d.state["rolled_back"] == [2]
    assert d.seeds._next >= before + d.seeds.cfg.min_dwell_s
    assert d.seeds._dwell_until == d.seeds._rows + d.seeds.cfg.dwell_rows


def test_anchor_is_kept_for_a_starting_head_and_dropped_for_a_random_one(tmp_path):
    """--distill-anchor pulls toward the head the daemon starts from: from a checkpoint it stays;
    from a random day-0 head (no --init-head) it would pull toward noise, so it is turned off."""
    from online_spec.checkpoint import save_head

    target = tiny8()
    start = tmp_path / "start"
    save_head(new_head(target, 256, seed=3), start, version=0)

    def daemon(sub, init_head):
        return TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), init_head=init_head), target, None,
                             SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                             ReplayConfig(root=str(tmp_path / sub / "replay")), DistillConfig(anchor=30.0),
                             LossConfig(ttt_steps=3))

    assert daemon("from-ckpt", str(start)).distiller.cfg.anchor == 30.0
    assert daemon("day0", "").distiller.cfg.anchor == 0.0


def test_max_duty_rests_in_proportion_to_the_work(tmp_path, monkeypatch):
    """--max-duty 0.25: after each step of busy seconds the daemon rests 3x as long, so training
    and evaluation take at most a quarter of its wall time; a step-less loop only idles."""
    target = tiny8()
    d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / "d"), max_duty=0.25), target, None,
                      SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay")), DistillConfig(), LossConfig(ttt_steps=3))
    busy = []

    def step():
        t0 = time.monotonic()
        time.sleep(0.02)
        busy.append(time.monotonic() - t0)
        return True

    monkeypatch.setattr(d, "train_once", step)
    t0 = time.monotonic()
    summary = d.run(max_seconds=0.8)
    wall = time.monotonic() - t0
    assert len(busy) >= 2
    # each rest is 3x its step's time (loop overhead included, so never less than 3x the sleeps);
    # the summary rounds rested_s to the millisecond, hence the half-millisecond allowance
    assert summary["rested_s"] >= 3 * sum(busy) - 0.0005
    assert sum(busy) <= 0.3 * wall
    with pytest.raises(ConfigError, match="max_duty"):
        DaemonConfig(max_duty=0.0)


def test_an_idle_server_lets_the_trainer_take_its_idle_duty(tmp_path, monkeypatch):
    """--max-duty 0.25 while the server serves, --idle-duty 1 while its control `info` says no
    request is running or waiting: the daemon trains back to back through a lull and rests 3x its
    step again from the first read that finds requests (reads every 0.5 s while idle); a server
    it cannot ask counts as serving."""
    target = tiny8()
    d = TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / "d"), max_duty=0.25, idle_duty=1.0), target, None,
                      SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                      ReplayConfig(root=str(tmp_path / "d" / "replay")), DistillConfig(), LossConfig(ttt_steps=3))

    class Server:
        load = {"running_requests": 0, "waiting_requests": 0}

        def info(self):
            return {"head_version": 0, **self.load}

    d.publisher = server = Server()
    assert d.duty() == 0.25  # nothing read yet
    assert d.watch_server_head(now=0.0) is None and d.duty() == 1.0 and d.rest_after(0.05) == 0.0
    server.load = {"running_requests": 0, "waiting_requests": 3}
    assert d.watch_server_head(now=0.4) is None and d.duty() == 1.0  # the next read is due at 0.5 s
    d.watch_server_head(now=0.5)
    assert d.duty() == 0.25 and abs(d.rest_after(0.01) - 0.03) < 1e-9
    server.load = {"running_requests": 0, "waiting_requests": 0}
    d.watch_server_head(now=1.5)
    assert d.duty() == 0.25  # serving: read every 2 s
    d.watch_server_head(now=2.5)
    assert d.duty() == 1.0

    def down():
        raise ConnectionError("gone")
    monkeypatch.setattr(server, "info", down)
    d.watch_server_head(now=3.0)
    assert d.duty() == 0.25
    with pytest.raises(ConfigError, match="idle_duty"):
        DaemonConfig(idle_duty=1.5)


def test_nice_lowers_the_trainer_process_priority():
    """`--nice N` raises the trainer process's niceness (in a child process: niceness cannot be
    lowered again); out of 0..19 it is refused with the flag's name, the niceness left as it was."""
    code = ("import argparse, os; from trainer.train_cli import add_arguments, share_machine\n"
            "p = argparse.ArgumentParser(); add_arguments(p); before = os.nice(0)\n"
            "try:\n    share_machine(p.parse_args(['--nice', '25'])); print('accepted')\n"
            "except SystemExit as e:\n    print('refused:', e)\n"
            "print(os.nice(0) - before)\n"
            "share_machine(p.parse_args(['--nice', '7'])); print(os.nice(0) - before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, after_bad, after_ok = out.stdout.strip().splitlines()
    assert refused.startswith("refused: --nice") and after_bad == "0"
    assert after_ok == "7"


def test_warm_up_trains_a_throwaway_copy_and_leaves_the_run_as_it_was(tmp_path):
    """`warm_up` (trainer/warm_up.py) runs a step and the gate's scoring before traffic: the head's
    weights, its gradients, the optimizer's state and the step counter stay as they were, and the
    first real step after it gives the same weights as a daemon that did not warm up; a warm-up
    that fails is reported and changes nothing."""
    from trainer.warm_up import warm_up

    target = tiny8()
    recs, _ = greedy_records(target, num=4, new_tokens=24)

    def daemon(sub):
        return TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), eval_max_steps=3, batch_tokens=200), target,
                             None, SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                             ReplayConfig(root=str(tmp_path / sub / "replay")), DistillConfig(lr=1e-3),
                             LossConfig(ttt_steps=2), GateConfig(), head=new_head(target, 256, seed=0).float())

    warm, cold = daemon("warm"), daemon("cold")
    before = [p.detach().clone() for p in warm.distiller.head.parameters()]
    figures = warm_up(warm)
    assert figures["rows"] == 2 * 96 and figures["step_s"] > 0
    assert all(torch.equal(a, p) for a, p in zip(before, warm.distiller.head.parameters()))
    assert all(p.grad is None for p in warm.distiller.head.parameters())
    assert warm.distiller.step == 0 and not warm.distiller.optimizer.state_dict()["state"]
    for d in (warm, cold):
        d.distiller.train_step(collate(recs))
    for a, b in zip(warm.distiller.head.parameters(), cold.distiller.head.parameters()):
        torch.testing.assert_close(a, b)
    assert not torch.equal(before[0], next(warm.distiller.head.parameters()))  # the real step did train
    # a warm-up that fails is logged and skipped: the daemon starts cold, nothing of the run changed
    def broken(batch):
        raise RuntimeError("out of memory")

    warm.distiller.warm_up = broken
    after = [p.detach().clone() for p in warm.distiller.head.parameters()]
    assert warm_up(warm) == {"error": "RuntimeError: out of memory"}
    assert all(torch.equal(a, p) for a, p in zip(after, warm.distiller.head.parameters()))
