"""Seed heads (trainer/seeds.py): the daemon starts over from a pretrained head when today's
traffic is that head's. A tiny target (8 layers, random weights) stands in for SmolLM2 so the
heads can be trained to be each good on one kind of sequence within a test; the daemon, the
distiller (DeepSpeed on CPU, gloo) and the checkpoints are the real ones.
"""

import time

import pytest
import torch

from collector.replay import ReplayConfig
from collector.subscriber import SubscriberConfig
from online_spec.checkpoint import load_head, save_head
from online_spec.config import ConfigError
from online_spec.head import new_head
from tests.distill_helpers import greedy_records, tiny8
from tests.test_trainer_daemon import FakeServer, served
from trainer.batch import collate
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig, Distiller
from trainer.evaluate import simulate_acceptance
from trainer.gate import GateConfig
from trainer.loss import LossConfig
from trainer.seeds import MAX_CHANGE_AGE_S, SeedConfig, SeedWatch, change_start, eval_copy, same_weights


@pytest.fixture(scope="module")
def world():
    """A tiny target; "chat" and "code" greedy records; a chat head (the default vocabulary map)
    and a code head whose draft vocabulary is code's most frequent tokens (another map)."""
    target = tiny8()
    chat, _ = greedy_records(target, num=6, new_tokens=40, seed=1)
    code, code_seqs = greedy_records(target, num=6, new_tokens=40, seed=0)

    def trained(recs, head):
        dist = Distiller(target, head, DistillConfig(lr=3e-3, warmup_steps=0, schedule="constant"),
                         LossConfig(ttt_steps=3))
        for _ in range(40):
            dist.train_step(collate(recs))
        return dist.head

    chat_head = trained(chat, new_head(target, 256, seed=0).float())
    code_head = new_head(target, 256, seed=0).float()
    counts = torch.bincount(torch.tensor([t for s in code_seqs for t in s]), minlength=target.info.vocab_size)
    ids = counts.argsort(descending=True)[:256].sort().values
    t2d = torch.zeros(target.info.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    code_head.set_vocab_map(ids - torch.arange(256), t2d)
    code_head = trained(code, code_head)
    return target, chat, code, chat_head, code_head


def daemon_for(world, tmp_path, sub, seed_dir, publisher=None):
    target, _, _, chat_head, _ = world
    return TrainerDaemon(DaemonConfig(run_dir=str(tmp_path / sub), eval_max_steps=3), target, publisher,
                         SubscriberConfig(endpoint=f"ipc://{tmp_path}/unused.sock"),
                         ReplayConfig(root=str(tmp_path / sub / "replay"), heldout_every=3), DistillConfig(anchor=5.0),
                         LossConfig(ttt_steps=3), GateConfig(min_anchors=10), head=chat_head,
                         seed_cfg=SeedConfig(heads=str(seed_dir), min_anchors=20, margin=0.1))


def test_the_daemon_adopts_the_seed_that_drafts_todays_traffic_and_trains_on_from_it(world, tmp_path):
    target, chat, code, chat_head, code_head = world
    seed_dir = tmp_path / "code-seed"
    save_head(code_head, seed_dir, version=0)
    assert not torch.equal(code_head.d2t, chat_head.d2t)  # the seed brings another vocabulary map

    # chat traffic: the live chat head drafts it better than the code seed; nothing happens
    server = FakeServer(0)
    d = daemon_for(world, tmp_path, "chat", seed_dir, server)
    for r in chat:
        d.on_span(served(r))
    assert d.watch_seeds() is None and d.seeds.checks == 1
    assert d.seeds.last["live"] > d.seeds.last["code-seed"]
    assert not same_weights(d.live_head, d.seeds.seeds[0].counts.head)
    assert same_weights(d.live_head, eval_copy(chat_head, target))  # the starting head as a seed: not scored again
    assert d.watch_seeds() is None and d.seeds.checks == 1  # not due again before --seed-check-s

    # code traffic after the shift: the code seed wins by far, is adopted and published
    d = daemon_for(world, tmp_path, "code", seed_dir, server)
    for r in code:
        d.on_span(served(r))
    version = d.watch_seeds()
    assert not d.seeds.due(time.monotonic() + 30, boosted=True)  # a dwell after the adoption
    assert version == 1 and server.history == [0, 1] and d.state["live_version"] == 1
    adopted = d.state["seeds_adopted"]
    assert adopted[0]["seed"] == "code-seed" and adopted[0]["score"] > 1.1 * adopted[0]["live"]
    published, _ = load_head(tmp_path / "code" / "ckpt" / "v1", target.info, dtype=torch.float32)
    assert torch.equal(published.d2t, code_head.d2t) and torch.equal(published.t2d, code_head.t2d)
    spans = [served(r) for r in code]
    sim = {name: simulate_acceptance(h, target, spans, 3, ks=[3], generated_only=True)["accept_length"]["3"]
           for name, h in (("published", published), ("seed", code_head))}
    assert sim["published"] == pytest.approx(sim["seed"], abs=0.02)  # weights and map, not weights alone

    # training goes on from the seed: its map, the target rows the loss scores against, the anchor
    dist = d.distiller
    assert torch.equal(dist.head.draft_to_target.cpu(), code_head.draft_to_target)
    assert torch.equal(dist.shared.lm_head_draft, target.lm_head.weight.detach()[code_head.draft_to_target])
    assert all(torch.equal(a, p.detach()) for a, p in zip(dist._anchor, code_head.parameters()))
    assert d.train_once() and torch.isfinite(dist.head.fc.weight).all()
    after = simulate_acceptance(dist.head, target, spans, 3, ks=[3], generated_only=True)["accept_length"]["3"]
    assert after > 0.8 * sim["seed"]  # a step on code traffic from the seed stays a code head

    # a restart resumes the seed's line with its map
    d.save_state()
    again = daemon_for(world, tmp_path, "code", seed_dir, server)
    assert torch.equal(again.distiller.head.draft_to_target.cpu(), code_head.draft_to_target)
    assert torch.equal(again.distiller.shared.lm_head_draft, dist.shared.lm_head_draft)


class Span:
    def __init__(self, name, generated):
        self.name = name
        self.is_prefill = torch.tensor([True] * 4 + [False] * generated)


class Counts:
    """`LiveCounts` as the check sees it: fixed per-position hits of `alpha` on every span."""

    def __init__(self, alpha, head=None):
        self.alpha, self.head = alpha, head

    def counts(self, spans):
        eligible = torch.full((len(spans), 3), 10.0)
        return eligible * torch.tensor(self.alpha), eligible


LIVE = object()  # the live head of the pure tests: its counts are `Counts(LIVE_ALPHA)`
LIVE_ALPHA = [0.5, 0.5, 0.5]


def watch_with(alphas, **cfg):
    from trainer.seeds import Seed

    seeds = [Seed(label, None, Counts(a)) for label, a in alphas.items()]
    w = SeedWatch(SeedConfig(heads="given", **cfg), None, seeds=seeds)
    w._live = Counts(LIVE_ALPHA, head=LIVE)
    return w


def test_the_window_holds_the_newest_spans_since_the_live_head_up_to_the_rows():
    w = watch_with({"s": [0.5, 0.5, 0.5]}, rows=50)
    for i in range(6):
        w.observe(Span(f"r{i}", 20), now=float(i))
    assert [s.name for s in w.window(since=0.0)] == ["r5", "r4", "r3"]  # 60 rows: the third crosses 50
    assert [s.name for s in w.window(since=4.5)] == ["r5"]  # what came before the live head is left out
    assert w.window(since=9.0) == []


def test_a_seed_must_beat_the_live_head_by_the_margin_on_enough_anchors():
    w = watch_with({"near": [0.52, 0.52, 0.52], "far": [0.7, 0.7, 0.7]}, min_anchors=20, margin=0.1)
    w.observe(Span("a", 8), now=1.0)
    assert w.check(0.0, LIVE) is None and w.checks == 0  # 10 anchors < 20: no decision
    w.observe(Span("b", 8), now=2.0)
    pick = w.check(0.0, LIVE)
    assert pick.seed.label == "far" and pick.anchors == 20 and pick.score > 1.1 * pick.live
    assert w.last["near"] == pytest.approx(0.52 + 0.52 ** 2 + 0.52 ** 3)
    w = watch_with({"near": [0.52, 0.52, 0.52]}, min_anchors=20, margin=0.1)
    for i in range(3):
        w.observe(Span(f"r{i}", 8), now=float(i))
    assert w.check(0.0, LIVE) is None and w.checks == 1  # within the margin: the live head stays


def test_due_every_check_s_and_sooner_after_a_drift_alert():
    w = watch_with({"s": [0.5] * 3}, check_s=20.0, boost_check_s=5.0)
    assert w.due(100.0, boosted=False) and not w.due(110.0, boosted=False) and w.due(120.0, boosted=True)
    assert not w.due(124.0, boosted=True) and w.due(125.0, boosted=True)
    assert not watch_with({}).due(100.0, boosted=True)  # no seeds: never due

def test_after_a_head_went_live_no_check_before_the_dwell_of_traffic_however_long_it_takes():
    w = watch_with({"s": [0.5] * 3}, check_s=5.0, boost_check_s=5.0, dwell_rows=100, min_dwell_s=60.0)
    w.observe(Span("before", 30), now=1.0)
    w.head_changed(1.0)  # a head went live: no check before 100 more generated rows and 60 s, boosted or not
    assert not w.due(1e6, boosted=True)  # time alone (a paused trainer, a slow server) does not end it
    for i in range(3):
        w.observe(Span(f"r{i}", 30), now=2.0 + i)
    assert not w.due(1e6 + 10, boosted=True)  # 90 rows (prompt rows do not count)
    w.observe(Span("r3", 30), now=6.0)
    assert w.due(1e6 + 20, boosted=False)
    w.head_changed(2e6)
    for i in range(4):
        w.observe(Span(f"s{i}", 30), now=2e6 + i)
    assert not w.due(2e6 + 59, boosted=True) and w.due(2e6 + 60, boosted=True)  # the rows came at once: 60 s


def test_the_window_after_a_drift_alert_holds_the_traffic_after_it_alone(world, tmp_path):
    """Chat traffic, a drift alert, then code: the check scores the code rows alone, so the code
    seed wins at once where a window of chat and code rows together might not."""
    _, chat, code, _, code_head = world
    seed_dir = tmp_path / "code-seed"
    save_head(code_head, seed_dir, version=0)
    d = daemon_for(world, tmp_path, "alert", seed_dir, FakeServer(0))
    for r in chat + chat:
        d.on_span(served(r))
    d.on_drift({"kind": "acceptance_drop", "title": "acceptance dropped"})
    time.sleep(0.01)
    for r in code[:2]:
        d.on_span(served(r))
    seen = []
    d.seeds.check = lambda since, live: seen.append([t for t, _ in d.seeds._recent if t >= since]) or None
    d.watch_seeds()
    assert len(seen) == 1 and len(seen[0]) == 2  # the two code spans, none of the chat ones before the alert


def test_the_window_after_a_drift_alert_starts_where_the_alert_puts_the_change(world, tmp_path):
    """Chat, then code rows that arrive before the alert (the detector's delay, the poll's): the
    alert's `since` (the change estimate, the server's wall clock) puts them in the window, and the
    check comes at once instead of after the rows that follow the alert."""
    _, chat, code, _, code_head = world
    seed_dir = tmp_path / "code-seed"
    save_head(code_head, seed_dir, version=0)
    d = daemon_for(world, tmp_path, "since", seed_dir, FakeServer(0))
    for r in chat:
        d.on_span(served(r))
    time.sleep(0.05)
    change = time.time()
    time.sleep(0.05)
    for r in code[:3]:
        d.on_span(served(r))
    d.seeds._next = time.monotonic() + 1e6  # the clock's check far away: the alert alone makes it due
    seen = []
    d.seeds.check = lambda since, live: seen.append([t for t, _ in d.seeds._recent if t >= since]) or None
    d.watch_seeds()
    assert seen == []
    d.on_drift({"kind": "drop", "title": "acceptance dropped", "time": time.time(), "since": change})
    d.watch_seeds()
    assert len(seen) == 1 and len(seen[0]) == 3  # the three code spans that came before the alert, no chat


def test_change_start_maps_the_servers_estimate_to_this_clock_and_bounds_it():
    assert change_start({"since": 970.0}, now=50.0, wall_now=1000.0) == 20.0
    assert change_start({"since": 1010.0}, now=50.0, wall_now=1000.0) == 50.0  # ahead of this clock: now
    assert change_start({"since": 0.0}, now=5000.0, wall_now=1e6) == 5000.0 - MAX_CHANGE_AGE_S
    for alert in ({}, {"since": None}, {"since": float("nan")}, {"since": True}, {"since": "970"}):
        assert change_start(alert, now=50.0, wall_now=1000.0) == 50.0  # no estimate: the alert's arrival


def test_a_seed_that_does_not_exist_or_is_day0_is_refused_by_name(world, tmp_path):
    target = world[0]
    with pytest.raises(ConfigError, match="seed-heads"):
        SeedWatch(SeedConfig(heads=str(tmp_path / "missing")), target)
    with pytest.raises(ConfigError, match="seed-heads"):
        SeedWatch(SeedConfig(heads="day0"), target)
    save_head(world[3], tmp_path / "one" / "h", version=0)
    save_head(world[4], tmp_path / "two" / "h", version=0)
    with pytest.raises(ConfigError, match="two seeds are called 'h'"):
        SeedWatch(SeedConfig(heads=f"{tmp_path / 'one' / 'h'},{tmp_path / 'two' / 'h'}"), target)
