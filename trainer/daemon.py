"""`online-spec train`: the sidecar trainer daemon that keeps the server's head current.

In: the capture stream (ZMQ, `collector`), the server's control endpoint, a run directory.
Out: versioned head checkpoints (SGLang layout) published into the server, W&B logs.

Loop (one thread; the subscriber fills the replay buffer from its own thread):
  1. train: a batch of recent traffic from the replay buffer -> one distillation step (DeepSpeed)
  2. every `eval_every_steps` steps or `eval_every_s` seconds: simulate the candidate and the
     live head on the newest held-out traffic at the live K mix (drafts from generated rows only),
     and on each stored traffic tag's own (no forgetting of an earlier phase); the `SwapGate`
     decides; a winner is written as a new version and swapped in over the control endpoint; a
     run of refusals while the server serves lowers the duty (futility, `trainer/duty.py`)
  3. watch live acceptance of the new version (`RollbackMonitor`) and roll back if it is worse
     than the previous version's beyond a threshold
  4. follow the server when it changed its head on its own (its head bank brought back a head
     for returning traffic, or it rolled back a broken one): that head becomes the live one the
     gate compares with, and training continues from it (`trainer/server_head.py`)
Bad input never stops it: a span that does not fit the target (hidden size, token ids, positions)
is counted and dropped before the replay buffer (stored spans are checked again when sampled); a
training step or an evaluation that fails drops its batch, logs why and goes on.
Everything the loop needs to resume lives in the run directory: `state.json` (step, versions),
`distiller.pt` (head, optimizer, scheduler), `replay/` (the buffer), `ckpt/vN/` (published
heads). A kill -9 loses at most the steps since the last state save; SIGTERM saves and exits.
Across N data-parallel ranks this daemon is rank 0 (`trainer/ranks.py`).

    online-spec train --run-dir runs/daemon --capture-endpoint ipc:///tmp/capture.sock \
        --control-endpoint ipc://runs/server/control.sock --token-file runs/server/control.token
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from collector.replay import ReplayBuffer, ReplayConfig
from collector.span import CaptureSpan
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from online_spec.checkpoint import META, load_head
from online_spec.head import EagleHead, new_head
from online_spec.starvation import KINDS as STARVATION_KINDS
from online_spec.starvation import StarvationConfig
from trainer.batch import collate
from trainer.cpu_ledger import CpuLedger
from trainer.daemon_config import DaemonConfig
from trainer.distill import DistillConfig, Distiller, init_from_target
from trainer.duty import DutyCycle
from trainer.evaluate import LiveCounts, acceptance_from_counts, record_counts
from trainer.gate import GateConfig, LiveAcceptance, RollbackMonitor, SwapGate, k_mix_depth, k_mix_score
from trainer.loss import LossConfig
from trainer.seeds import SeedConfig, SeedWatch, change_start, eval_copy
from trainer.server_head import HeadPublisher, ServerHeadWatch, server_live_version
from trainer.starvation_watch import StarvationWatch

log = logging.getLogger(__name__)

class TrainerDaemon:
    def __init__(self, cfg: DaemonConfig, target, publisher: HeadPublisher | None,
                 subscriber_cfg: SubscriberConfig, replay_cfg: ReplayConfig | None = None,
                 distill_cfg: DistillConfig | None = None, loss_cfg: LossConfig | None = None,
                 gate_cfg: GateConfig | None = None, wandb_run=None, head: EagleHead | None = None,
                 starvation_cfg: StarvationConfig | None = None, seed_cfg: SeedConfig | None = None):
        self.cfg, self.target, self.publisher, self.wandb = cfg, target, publisher, wandb_run
        self.seeds = SeedWatch(seed_cfg or SeedConfig(), target)  # trainer/seeds.py
        self.cpu = CpuLedger()  # the CPU seconds of its own work (trainer/cpu_ledger.py)
        self.run_dir = Path(cfg.run_dir)
        (self.run_dir / "ckpt").mkdir(parents=True, exist_ok=True)
        self.gate_cfg = gate_cfg or GateConfig()
        self.gate, self.rollbacks = SwapGate(self.gate_cfg), RollbackMonitor(self.gate_cfg)
        self.live = LiveAcceptance()
        self.state = {"step": 0, "next_version": 1, "live_version": 0, "previous_version": None,
                      "initial_version": 0, "published": [], "rolled_back": [], "swaps": 0, "refused_swaps": 0,
                      "evals": 0, "seeds_adopted": [], "seed_checks": 0, "seed_seconds": 0.0}
        self._init_meta: dict = {}
        day0 = head is None and not cfg.init_head  # a random head: nothing the anchor should keep
        if head is None:
            head = self._initial_head()
        if not self._load_state():
            # a fresh run continues the live head's numbering: versions stay unique and monotonic
            v0 = self._starting_version()
            self.state.update(live_version=v0, initial_version=v0, next_version=v0 + 1)
        self.live_head = eval_copy(head, self.target)
        self.buffer = ReplayBuffer(replay_cfg or ReplayConfig(root=str(self.run_dir / "replay")))
        if self._saved_buffer:  # its spans reload from disk; its counters from the state file
            self.buffer.load_state_dict(self._saved_buffer)
        distill_cfg = distill_cfg or DistillConfig(schedule="constant")
        if day0 and distill_cfg.anchor:
            log.warning("--distill-anchor %g ignored: the daemon starts from a random day-0 head", distill_cfg.anchor)
            distill_cfg = replace(distill_cfg, anchor=0.0)
        self.distiller = Distiller(target, head, distill_cfg, loss_cfg or LossConfig())
        if (self.run_dir / "distiller.pt").exists():
            self.distiller.load_state(self.run_dir / "distiller.pt")
            log.info("resumed at step %d", self.distiller.step)
        if self.seeds and self.distiller.world_size > 1:
            log.warning("--seed-heads ignored: a trainer of %d ranks cannot start over from a seed",
                        self.distiller.world_size)
        # sockets are opened only by run(): a daemon that never runs owns none (a zmq context
        # garbage-collected with open sockets blocks its finalizer forever)
        self.subscriber_cfg = subscriber_cfg
        self.subscriber: CaptureSubscriber | None = None
        self._stop = threading.Event()
        self._last_eval_t, self._last_eval_step = time.monotonic(), self.distiller.step
        self._drift_until = self._drift_at = 0.0  # a drift alert's boost ends; when its change began
        self.refused_spans = {"stream": 0, "stored": 0}  # spans that do not fit the target, by where met
        self.last_refused, self.failed_steps, self.failed_evals = "", 0, 0
        self._last_warn: dict[str, float] = {}
        self.starvation_watch, self.server_head = StarvationWatch(starvation_cfg, wandb_run), ServerHeadWatch()
        self.starvation = self.starvation_watch.detector
        self.duty_cycle = DutyCycle(cfg.max_duty, cfg.idle_duty, self._stop, self.server_head, cfg.futile_evals,
                                    cfg.futile_scale, getattr(publisher, "round_clock", None),
                                    cfg.budget_on(self.distiller.device.type))
        self._rest_until, self._last_step = 0.0, (0.0, 0.0)  # rest until; the last step's (end, busy seconds)

    # -- inputs ---------------------------------------------------------------------------
    def span_error(self, span: CaptureSpan) -> str | None:
        """Why `span` cannot be trained on with this target, or None."""
        return span.target_error(self.target.info)

    def on_span(self, span: CaptureSpan) -> None:
        """Subscriber thread: store the span and tally live acceptance per version/slot/tag; a
        span that does not fit the target is counted and dropped, never stored."""
        problem = self.span_error(span)
        if problem is not None:
            self._refuse("stream", span, problem)
            return
        self.buffer.add(span)
        self.seeds.observe(span, time.monotonic())
        self.live.observe_rows(span.accepted.tolist(), span.num_steps.tolist(), span.draft_version.tolist(),
                               span.batch_size.tolist(), getattr(span, "tag", ""))

    def on_drift(self, alert: dict) -> None:
        """A drift alert (from the server): evaluate every step for a while to adapt sooner. The
        trainer's own alerts (starved, capture dropped) come back in the server's list: not drift."""
        if alert.get("kind") in STARVATION_KINDS:
            return
        log.warning("drift alert: %s", alert.get("title", alert))
        self._drift_at = change_start(alert, time.monotonic(), time.time())  # where the alert puts the change
        self._drift_until = time.monotonic() + self.cfg.drift_boost_s
        self.seeds.wake()
        self.wake()

    def wake(self) -> None:
        """What training can win changed (drift, a new live head): a futile rest is cut to the full duty's."""
        self.duty_cycle.wake()
        end, busy = self._last_step
        self._rest_until = min(self._rest_until, end + self.duty_cycle.rest_at(busy, self.duty_cycle.duty()))

    def stop(self) -> None:
        self._stop.set()

    # -- the loop ----------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict:
        self.subscriber = CaptureSubscriber(self.subscriber_cfg, on_span=self.on_span).start()
        stop_watch = self.starvation_watch.beside(self.watch_starvation)  # on time however slow a step is
        t_end = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            while not self._stop.is_set():
                if max_steps is not None and self.distiller.step >= max_steps:
                    break
                if t_end is not None and time.monotonic() > t_end:
                    break
                t0 = time.monotonic()
                if t0 < self._rest_until:  # resting in slices: the watchers below keep their cadence
                    self._stop.wait(min(self.cfg.idle_sleep_s, self._rest_until - t0))
                elif not self.duty_cycle.spell(self.train_once):
                    self._stop.wait(self.cfg.idle_sleep_s)
                else:
                    t1 = time.monotonic()
                    self._last_step = (t1, t1 - t0)
                    self._rest_until = t1 + self.duty_cycle.rest_for(t1 - t0)
                self.watch_server_head()  # first: the rollback below judges the head the server has live
                self.watch_rollback()
                self.watch_seeds()
                self.buffer.flush_if_due()  # what a kill may lose stays bounded when traffic stops
        finally:
            stop_watch.set()
            self.save_state()
            self.subscriber.close(flush=True)
            self.buffer.flush()
        return self.summary()

    def duty(self) -> float:  # trainer/duty.py: idle_duty while the server was last seen idle, less when futile
        return self.duty_cycle.duty()

    def rest_after(self, busy_s: float) -> float:  # the rest due after busy_s of work, rested
        return self.duty_cycle.rest_after(busy_s)

    def train_once(self) -> bool:
        """One step if the buffer holds enough traffic; evaluation/publication when due."""
        if self.buffer.num_tokens < self.cfg.min_buffer_tokens:
            return False
        spans = self._usable(self.buffer.sample_train(self.cfg.batch_tokens))
        if not spans:
            return False
        try:
            with self.cpu.spend("steps"):
                metrics = self.distiller.train_step(collate(spans))
        except Exception as e:  # noqa: BLE001 - one bad batch must not stop the trainer
            self.failed_steps += 1
            self._warn("step", f"training step failed ({type(e).__name__}: {e}); dropped the batch of "
                               f"{len(spans)} spans ({self.failed_steps} dropped so far)")
            return False
        self.after_step(metrics)
        return True

    def after_step(self, metrics: dict) -> None:
        """What follows an optimizer step: log it, save when due, evaluate and publish when due."""
        self.state["step"] = self.distiller.step
        self._log({f"train/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        if self.distiller.step % self.cfg.save_every_steps == 0:
            self.save_state()
        boosted = time.monotonic() < self._drift_until  # the clock's trigger not while resting (futile)
        if (boosted or self.distiller.step - self._last_eval_step >= self.cfg.eval_every_steps or
                not self.duty_cycle.resting() and time.monotonic() - self._last_eval_t >= self.cfg.eval_every_s):
            try:
                with self.cpu.spend("evals"):
                    self.evaluate_and_publish()
            except Exception as e:  # noqa: BLE001 - the next evaluation may succeed
                self.failed_evals += 1
                self._last_eval_t, self._last_eval_step = time.monotonic(), self.distiller.step
                self._warn("eval", f"evaluation failed ({type(e).__name__}: {e}); training goes on")

    def watch_starvation(self, now: float | None = None) -> list:
        """Too few steps while traffic waits, or capture dropped on the way? (`StarvationWatch`)"""
        # resting by choice (futile training) is not waiting traffic: no trainer_starved
        trainable = self.buffer.num_tokens >= self.cfg.min_buffer_tokens and not self.duty_cycle.resting()
        return self.starvation_watch.check(time.monotonic() if now is None else now, self.distiller.step,
                                           trainable, self.publisher, self.subscriber, self.state["live_version"])

    def _usable(self, spans: list) -> list:
        """`spans` without those that do not fit the target (stored before they were checked)."""
        problems = [(span, self.span_error(span)) for span in spans]
        for span, problem in problems:
            if problem is not None:
                self._refuse("stored", span, problem)
        return [span for span, problem in problems if problem is None]

    def _refuse(self, where: str, span: CaptureSpan, problem: str) -> None:
        self.refused_spans[where] += 1
        self.last_refused = f"{span.request_id[:80]!r}: {problem}"
        self._warn("span", f"dropping a span that does not fit the target ({self.last_refused}); "
                           f"{self.refused_spans} so far")

    def _warn(self, kind: str, message: str) -> None:
        """Log a warning at most every 10 s per kind (counts go to the summary and W&B)."""
        now = time.monotonic()
        if now - self._last_warn.get(kind, -1e9) >= 10.0:
            self._last_warn[kind] = now
            log.warning(message)

    def evaluate_and_publish(self):
        """Candidate vs live head on the newest held-out traffic; publish a winner."""
        self._last_eval_t, self._last_eval_step = time.monotonic(), self.distiller.step
        heldout = self._gate_sample()
        if not heldout:
            return None
        k_counts = dict(self.live.k_counts)
        c, lv, anchors = self._gate_scores(heldout, k_counts)
        decision, per_tag = self.gate.decide(c, lv, anchors), {}
        if decision.publish and self.gate.cfg.tag_regress < 1:
            # a winner on the mix: also each stored tag on its own newest held-out traffic (only
            # now, an evaluation per tag being as costly as the one above); specialising, not the
            # tags the server's bank holds another head for: theirs comes back when they return
            mix_tags = {sp.tag for sp in heldout}
            banked = self.server_head.banked_elsewhere(self.state["live_version"]) if self.cfg.specialise else set()
            for tag in (t for t in self.buffer.heldout_tags() if t not in banked):
                per_tag[tag] = ((c, lv, anchors) if mix_tags == {tag} else
                                self._gate_scores(self._gate_sample(tag), k_counts))
            decision = self.gate.decide(c, lv, anchors, per_tag)
        self.state["evals"] += 1
        self._log({"gate/candidate": c, "gate/live": lv, "gate/anchors": anchors,
                   "gate/publish": int(decision.publish),
                   **{f"gate/{key}/{tag or 'untagged'}": v for tag, (ct, lt, _) in per_tag.items()
                      for key, v in (("candidate", ct), ("live", lt))}})
        log.info("step %d gate: %s", self.distiller.step, decision.reason)
        if anchors >= self.gate.cfg.min_anchors:  # a verdict (too few anchors says nothing of futility)
            self.duty_cycle.gate(decision.publish)
        if decision.publish:
            self.publish()
        return decision

    def _gate_sample(self, tag: str | None = None) -> list:
        return self._usable(self.buffer.heldout(self.cfg.eval_tokens, newest=True, tag=tag, generated=True,
                                                max_generated=self.cfg.eval_generated_rows))

    def _gate_scores(self, heldout: list, k_counts: dict) -> tuple[float, float, int]:
        """(candidate, live, anchors): simulated accept lengths over the generated rows of
        `heldout` at the live K mix. The live head's counts of a span are computed once per live
        version (`LiveCounts`), so an evaluation mostly costs the candidate's."""
        steps = k_mix_depth(k_counts, self.cfg.eval_max_steps)  # no deeper than the server drafts
        ks = list(range(1, steps + 1))
        hits, eligible = record_counts(self.distiller.head, self.target, heldout, steps, generated_only=True)
        cand = acceptance_from_counts(hits.sum(0), eligible.sum(0), ks)
        hits, eligible = self._live.counts(heldout)  # counted at eval_max_steps, once a span
        live = acceptance_from_counts(hits.sum(0)[:steps], eligible.sum(0)[:steps], ks)
        return (k_mix_score(cand["accept_length"], k_counts), k_mix_score(live["accept_length"], k_counts),
                cand["anchors"])

    @property
    def live_head(self) -> EagleHead:
        return self._live_head

    @live_head.setter
    def live_head(self, head: EagleHead) -> None:
        self._live_head = head
        self._live = LiveCounts(head, self.target, self.cfg.eval_max_steps)  # counted afresh per live head
        self._live_since = time.monotonic()  # the seeds are scored on traffic from here on

    def publish(self) -> int | None:
        """Write the candidate as a new version and swap it into the server."""
        # above anything the server has had live (an operator may have swapped in a head meanwhile)
        version = max(self.state["next_version"], server_live_version(getattr(self.publisher, "info", None)) + 1)
        out = self.run_dir / "ckpt" / f"v{version}"
        digest = self.distiller.save(out, version)
        self.state["next_version"] = version + 1
        if self.publisher is not None:
            try:
                self.publisher.swap_dir(str(out.resolve()), version, digest)
            except Exception as e:  # refused or unreachable: serving keeps its head, we keep training
                self.state["refused_swaps"] += 1
                log.error("swap of v%d refused: %s", version, e)
                self.save_state()
                return None
        prev = self.state["live_version"]
        self.rollbacks.start_from(self.live, version, prev)
        self.state.update(previous_version=prev, live_version=version, swaps=self.state["swaps"] + 1)
        self.wake()
        self.state["published"].append({"version": version, "digest": digest, "step": self.distiller.step,
                                        "time": time.time()})
        self.live_head = eval_copy(self.distiller.head, self.target)
        self._log({"swap/version": version, "swap/count": self.state["swaps"]})
        log.info("published v%d (digest %s)", version, digest[:12])
        self.save_state()
        return version

    def watch_seeds(self, now: float | None = None) -> int | None:
        """When due, score the seed heads against the live head on the traffic since it went live
        (trainer/seeds.py); adopt and publish a seed that beats it by the margin."""
        now = time.monotonic() if now is None else now
        if not self.seeds.due(now, now < self._drift_until) or self.distiller.world_size > 1:
            return None
        with self.cpu.spend("seeds"):
            pick = self.seeds.check(max(self._live_since, self._drift_at), self.live_head)  # after a shift: its rows
        self.state.update(seed_checks=self.seeds.checks, seed_seconds=round(self.seeds.seconds, 3))
        self._log({f"seeds/{k}": v for k, v in self.seeds.last.items()})
        if pick is None:
            return None
        log.info("seed %r drafts today's traffic better than the live v%d (%.3f vs %.3f over %d anchors): "
                 "training goes on from it", pick.seed.label, self.state["live_version"], pick.score, pick.live,
                 pick.anchors)
        self.distiller.set_weights(pick.seed.master, re_anchor=True)
        self.seeds.head_changed(now)
        version = self.publish()
        self.state["seeds_adopted"].append({"seed": pick.seed.label, "version": version, "step": self.distiller.step,
                                            "score": round(pick.score, 4), "live": round(pick.live, 4),
                                            "time": time.time()})
        self.write_state()
        return version

    def watch_rollback(self) -> None:
        decision = self.rollbacks.update(self.live)
        if decision.action != "rollback":
            return
        log.warning("rollback: %s", decision.reason)
        bad, prev = self.state["live_version"], self.state["previous_version"]
        if self.publisher is not None:
            try:  # named: if another head replaced v`bad` meanwhile, the server refuses (never reinstalls it)
                self.publisher.rollback(bad)
            except Exception as e:  # the monitor has let go of v`bad`; the server's live head is adopted
                log.error("rollback refused: %s", e)
                return
        self.state["rolled_back"].append(bad)
        self.state.update(live_version=prev, previous_version=None)
        self.wake()
        self.seeds.head_changed(time.monotonic())  # the seed just rolled back is not re-adopted at once
        self.live_head = eval_copy(self._load_version(prev), self.target)
        self._log({"swap/rollback_of": bad, "swap/rollbacks": len(self.state["rolled_back"])})
        self.save_state()

    def watch_server_head(self, now: float | None = None) -> int | None:
        """Adopt the server's live head if the server changed it on its own (`ServerHeadWatch`)."""
        now = time.monotonic() if now is None else now
        v = self.server_head.changed(now, getattr(self.publisher, "info", None), self.state["live_version"],
                                     self._loadable)
        if v is None:
            return None
        prev = self.state["live_version"]
        try:
            head = self._load_version(v)
            self.distiller.set_weights(head)
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint: train on from our own line
            self.server_head.refuse(v)
            log.error("cannot adopt the server's v%d (%s: %s): training goes on from v%d's line", v,
                      type(e).__name__, e, prev)
            return None
        self.rollbacks.start_from(self.live, v, prev)
        self.state.update(previous_version=prev, live_version=v)
        self.live_head = eval_copy(head, self.target)
        self.wake()
        self.server_head.adopted += 1
        self.seeds.head_changed(now)  # the bank's choice stands a dwell before a seed may answer it
        self._log({"swap/adopted_server_head": v})
        log.info("the server made v%d live (it was v%d): training continues from it", v, prev)
        self.save_state()
        return v

    def _loadable(self, version: int) -> bool:
        if version == self.state.get("initial_version", 0):
            return bool(self.cfg.init_head)  # a random day-0 head cannot be loaded again
        return (self.run_dir / "ckpt" / f"v{version}").is_dir()

    # -- state -------------------------------------------------------------------------------
    def save_state(self) -> None:
        self.distiller.save_state(self.run_dir / "distiller.pt")
        self.write_state()

    def write_state(self) -> None:
        """state.json alone: step, versions, monitor and buffer counters, rests (atomic rewrite)."""
        state = {**self.state, "rollback_monitor": self.rollbacks.state_dict(), "buffer": self.buffer.state_dict(),
                 **self.duty_cycle.report(), "cpu": self.cpu.report()}  # cpu: this process's, since it began
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.run_dir / "state.json")

    def _load_state(self) -> bool:
        """Restore state.json if there is one (a restart); False on a fresh run directory."""
        self._saved_buffer = None
        path = self.run_dir / "state.json"
        if not path.exists():
            return False
        saved = json.loads(path.read_text())
        self.rollbacks.load_state_dict(saved.pop("rollback_monitor", {}) or {})
        self._saved_buffer = saved.pop("buffer", None)
        self.state.update(saved)
        return True

    def _starting_version(self) -> int:
        """Version of the head the daemon starts from: the server's live version, else the
        starting checkpoint's metadata (`online_spec.json`), else 0; never below either."""
        meta = self._init_meta
        if not meta and self.cfg.init_head and (Path(self.cfg.init_head) / META).exists():
            meta = json.loads((Path(self.cfg.init_head) / META).read_text())
        v = meta.get("version", 0)
        v = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
        return max(server_live_version(getattr(self.publisher, "info", None)), v)

    def _load_version(self, version: int) -> EagleHead:
        if version == self.state.get("initial_version", 0):
            return self._initial_head()
        head, _ = load_head(self.run_dir / "ckpt" / f"v{version}", self.target.info, dtype=torch.float32)
        return head

    def _initial_head(self) -> EagleHead:
        if self.cfg.init_head:
            head, self._init_meta = load_head(self.cfg.init_head, self.target.info, dtype=torch.float32)
            return head
        return init_from_target(new_head(self.target).float(), self.target)

    def _log(self, metrics: dict) -> None:
        if self.wandb is not None:
            try:
                self.wandb.log({**metrics, "trainer/step": self.distiller.step,
                                "buffer/tokens": self.buffer.num_tokens,
                                "trainer/refused_spans": sum(self.refused_spans.values()),
                                "trainer/failed_steps": self.failed_steps,
                                **{f"stream/{k}": v for k, v in self._stream_stats().items()
                                   if isinstance(v, (int, float))}})
            except Exception:  # W&B must never stop training
                log.exception("wandb.log failed")

    def _stream_stats(self) -> dict:
        return self.subscriber.stats() if self.subscriber is not None else {}

    def summary(self) -> dict:
        return {"step": self.distiller.step, "tokens": self.distiller.tokens, "live_version": self.state["live_version"],
                "swaps": self.state["swaps"], "rollbacks": len(self.state["rolled_back"]),
                **self.duty_cycle.report(), "buffer": self.buffer.stats(), "stream": self._stream_stats(),
                "live": self.live.summary(), "refused_spans": dict(self.refused_spans),
                "last_refused": self.last_refused, "failed_steps": self.failed_steps, "failed_evals": self.failed_evals,
                **self.starvation_watch.report(), "cpu": self.cpu.report(),
                "adopted_server_heads": self.server_head.adopted,
                "seeds": {"checks": self.seeds.checks, "seconds": round(self.seeds.seconds, 3),
                          "last": self.seeds.last, "adopted": self.state["seeds_adopted"]}}


def install_signal_handlers(daemon) -> None:
    """SIGTERM/SIGINT: `daemon.stop()` (a daemon, or a rank's loop: trainer/ranks.py); it finishes
    the current step, saves and exits."""
    def handler(signum, frame):
        log.info("signal %d: stopping after this step", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
