"""Data-parallel trainer ranks: one capture stream in, N DeepSpeed ranks, one publisher out.

Started by `online-spec train --ranks N` (`trainer/launch.py`) or by torchrun; each rank on its own
device (`--device cuda --trainer-devices 1,2`: rank i on cuda:devices[i], NCCL; on CPU gloo).

Rank 0 is the daemon (`TrainerDaemon`): the only rank that subscribes to the capture stream, so
each span is stored once, in its replay buffer on disk, and the only one that evaluates, publishes
(checkpoint directory + control call: swaps cross GPUs without shared memory) and watches for
rollbacks. The other ranks hold a `Distiller` only. Every step, on every rank:

  1. agree: all_reduce(MAX) of [stop, ready]: any rank's SIGTERM stops every rank at the same
     step; rank 0 alone knows whether its buffer holds enough traffic to train
  2. deal: rank 0 draws N micro-batches of ceil(batch_tokens / N) rows (`sample_train`; N draws
     of that size follow the distribution of one draw of batch_tokens) and deals micro-batch r to
     rank r one step ahead, on a gloo group and thread of its own (`trainer/rank_data.py`): by
     name where rank r reads the buffer's directory (it reads the stored rows itself), rows not
     yet stored and those of a rank that cannot read it unpadded; step k + 1 travels while step
     k trains. Each drawn span is trained on by exactly one rank, once, and nothing drawn is left out; where a draw comes back empty every rank skips the step
  3. step: `Distiller.train_step` on every rank; DeepSpeed averages the gradients (ZeRO 0-2, as
     its JSON says) and all ranks step together; a batch that fails on one rank is dropped by all
     (`StepDropped`)
  4. every `save_every_steps`: commit, a collective (`Distiller.save_state`: every rank's
     optimizer part, then rank 0's head, schedule and step), then rank 0's state.json
  5. rank 0: log, gate evaluation and publish when due, rollback watch (the others wait in step 1)
  6. every `rank_check_every`: the ranks all_gather a digest of their weights; a difference
     (ranks out of step) ends the run with an error

State: what a single daemon keeps (state.json, replay/, ckpt/vN/) plus `distiller.pt` and, under
ZeRO 1-2, `distiller.pt.parts/stepN/rankR.pt`. A rank killed with -9 makes the launcher stop the
others; the same command resumes at the last commit (step counter, optimizer, buffer). With
`rank_journal`, each rank appends a line per step to `RUN_DIR/ranks/rankR.jsonl`: the spans it trained
on and the sum of their token ids (rank 0: also what it dealt to each rank, the versions it
published) and, at each weight check, the digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from collector.subscriber import CaptureSubscriber
from online_spec.checkpoint import load_head
from online_spec.config import check, doc
from online_spec.head import new_head
from trainer.batch import TrainBatch
from trainer.daemon import DaemonConfig, TrainerDaemon
from trainer.distill import DistillConfig, Distiller, StepDropped, init_from_target
from trainer.loss import LossConfig
from trainer.rank_data import DataPipe

log = logging.getLogger(__name__)


@dataclass
class RankConfig:
    ranks: int = doc("data-parallel ranks: this command runs itself N times, torchrun-style; each child gets "
                     "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and NVLink multicast off, and when one "
                     "dies the others are stopped (under torchrun or the deepspeed launcher each process is a "
                     "rank already); rank 0 alone subscribes, evaluates and publishes; DeepSpeed averages "
                     "the gradients (ZeRO 0-2 per --distill-deepspeed-config); see docs/trainer.md", 1)
    trainer_devices: str = doc("with --device cuda: each rank's GPU, comma-separated (rank i on "
                               "cuda:devices[i]), e.g. 1,2 beside a server on GPU 0; empty = rank i on cuda:i", "")
    rank_check_every: int = doc("every N steps the ranks compare a digest of their weights and stop on a "
                                "difference; 0 = never", 50)
    rank_journal: bool = doc("each rank appends a line per step to RUN_DIR/ranks/rankR.jsonl: the spans it "
                             "trained on, the weights' digest at each check", False)
    rank_stop_grace_s: float = doc("seconds ranks get to stop on SIGTERM before SIGKILL", 10.0)

    def __post_init__(self):
        check(self.ranks >= 1, "ranks", f"must be >= 1, got {self.ranks}")
        check(self.rank_check_every >= 0, "rank_check_every", "must be >= 0")
        check(self.rank_stop_grace_s > 0, "rank_stop_grace_s", "must be > 0")
        if self.trainer_devices:
            devices = self.trainer_devices.split(",")
            check(all(d.strip().isdigit() for d in devices), "trainer_devices",
                  f"must be GPU indices separated by commas, got {self.trainer_devices!r}")
            check(len(devices) == self.ranks, "trainer_devices",
                  f"names {len(devices)} devices for {self.ranks} ranks")


def rank_device(cfg: RankConfig, device: str, local_rank: int) -> str:
    """The torch device of this rank: `device` on CPU; on CUDA the GPU `trainer_devices` names."""
    if torch.device(device).type != "cuda":
        return device
    if cfg.trainer_devices:
        return f"cuda:{int(cfg.trainer_devices.split(',')[local_rank])}"
    return f"cuda:{local_rank}"


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every tensor of `module`'s state, bit for bit."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RankZeroDaemon(TrainerDaemon):
    """The daemon as rank 0: what it saves alone (after a publish or a rollback) is state.json;
    the distiller's state is saved by every rank together (`RankLoop.commit`)."""

    def save_state(self) -> None:
        self.write_state()


def follower_distiller(cfg: DaemonConfig, target, distill_cfg: DistillConfig, loss_cfg: LossConfig) -> Distiller:
    """A rank > 0: the Distiller rank 0's daemon builds, from the same starting head, resumed
    from the same run directory (DeepSpeed also broadcasts rank 0's weights at start)."""
    if cfg.init_head:
        head, _ = load_head(cfg.init_head, target.info, dtype=torch.float32)
    else:  # a day-0 head: the daemon turns the anchor off, so does this rank
        head = init_from_target(new_head(target).float(), target)
        distill_cfg = replace(distill_cfg, anchor=0.0)
    d = Distiller(target, head, distill_cfg, loss_cfg)
    if (Path(cfg.run_dir) / "distiller.pt").exists():
        d.load_state(Path(cfg.run_dir) / "distiller.pt")
        log.info("resumed at step %d", d.step)
    return d


class RankLoop:
    """One rank's training loop (see the module docstring); rank 0 passes its daemon."""

    def __init__(self, cfg: RankConfig, distiller: Distiller, daemon: TrainerDaemon | None,
                 daemon_cfg: DaemonConfig):
        import torch.distributed as dist

        self.cfg, self.distiller, self.daemon, self.dcfg = cfg, distiller, daemon, daemon_cfg
        self.rank, self.world = distiller.rank, distiller.world_size
        check((self.rank == 0) == (daemon is not None), "daemon", "rank 0, and only rank 0, runs the daemon")
        # control and data travel over gloo on the CPU (a side group under NCCL): small, and no
        # GPU synchronisation for a flag
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.data_group = dist.new_group(backend="gloo")  # the data pipe's, beside the control flags
        self.pipe: DataPipe | None = None
        self.run_dir = Path(daemon_cfg.run_dir)
        self._stop = threading.Event()
        self.dropped_steps = 0
        self._agree_s = 0.0  # the last step's agreement (rank 0: with the buffer's size), for the journal
        self._journal = None
        if cfg.rank_journal:
            (self.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
            self._journal = open(self.run_dir / "ranks" / f"rank{self.rank}.jsonl", "a")

    def stop(self) -> None:
        self._stop.set()
        if self.daemon is not None:
            self.daemon.stop()

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict:
        d = self.daemon
        if d is not None:
            d.subscriber = CaptureSubscriber(d.subscriber_cfg, on_span=d.on_span).start()
        self.pipe = DataPipe(self.rank, self.world, self.data_group, d, math.ceil(self.dcfg.batch_tokens / self.world),
                             self.dcfg.min_buffer_tokens, self.dcfg.idle_sleep_s,
                             pin=self.distiller.device.type == "cuda",  # batches leave for the GPU asynchronously
                             span_error=self._span_error)
        t_end = None if max_seconds is None else time.monotonic() + max_seconds
        clean = False
        try:
            while True:
                stop = self._stop.is_set() or (d is not None and (
                    (max_steps is not None and self.distiller.step >= max_steps)
                    or (t_end is not None and time.monotonic() > t_end)))
                t_agree = time.perf_counter()
                ready = d is not None and d.buffer.num_tokens >= self.dcfg.min_buffer_tokens
                stop, ready = self.agree(stop, ready)
                self._agree_s = time.perf_counter() - t_agree
                if stop:
                    break
                t0 = time.monotonic()
                # rank 0's spells between its serving budget's reads of the server's clock
                if not (ready and (self.step_once() if d is None else d.duty_cycle.spell(self.step_once))):
                    self._stop.wait(self.dcfg.idle_sleep_s)
                elif d is not None:
                    d.rest_after(time.monotonic() - t0)
                if d is not None:
                    d.watch_rollback()
                    d.watch_starvation()
                    d.buffer.flush_if_due()
            clean = True
        finally:
            if clean:
                self.pipe.close()
                self.commit()  # every rank left the loop at the same step: the collective is safe
            if d is not None:  # otherwise a peer is gone: no collective, but the versions and the buffer
                d.write_state()
                d.subscriber.close(flush=True)
                d.buffer.flush()
            if self._journal is not None:
                self._journal.close()
        out = {"rank": self.rank, "world_size": self.world, "step": self.distiller.step,
               "dropped_steps": self.dropped_steps}
        return {**d.summary(), **out} if d is not None else out

    def _span_error(self, span) -> str | None:
        return span.target_error(self.distiller.target.info)

    def agree(self, stop: bool, ready: bool) -> tuple[bool, bool]:
        """The step's decision, the same on every rank: stop if any rank stops; train if rank 0 can."""
        import torch.distributed as dist

        flags = torch.tensor([int(stop), int(ready)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def step_once(self) -> bool:
        """Deal, train, commit, and on rank 0 evaluate/publish; False if the step was skipped."""
        t0 = time.perf_counter()
        batch, spans, dealt, pipe, named = self.deal()
        if batch is None:
            return False
        t1 = time.perf_counter()
        try:
            metrics = self.distiller.train_step(batch)
        except StepDropped as e:  # every rank raised it: they stay in step
            self.dropped_steps += 1
            if self.daemon is not None:
                self.daemon.failed_steps += 1
                self.daemon._warn("step", f"training step failed on a rank: {e}")
            return False
        t2 = time.perf_counter()
        step = self.distiller.step
        digest = None
        if self.cfg.rank_check_every and step % self.cfg.rank_check_every == 0:
            digest = self.check_weights()
        if step % self.dcfg.save_every_steps == 0:
            self.commit()
        if self.daemon is not None:
            self.daemon.after_step(metrics)
        if self._journal is not None:
            # per span the sum of the token ids of its rows, from the tensors trained on: an audit
            # that a rank's rows are the spans it was dealt
            sums = (batch.tokens[:, :-1] * batch.row_mask).sum(1).tolist()
            # wait_s: this rank waited for its micro-batch (the data path behind training);
            # train_s: the step itself (forward, backward, gradient all-reduce, optimizer);
            # agree_s: the step's agreement before it; after_s: what followed it here (rank 0: the
            # daemon's logging, evaluation, publishing); padded: batch rows x the longest row; pipe:
            # the data pipe's ms for this micro-batch (`trainer/rank_data.py`), spent while the step before trained;
            # named: the spans that went by name (rank 0: dealt so, a receiver: read from the buffer's directory)
            line = {"step": step, "rows": batch.num_rows, "spans": spans, "token_sums": sums, "time": time.time(),
                    "wait_s": round(t1 - t0, 5), "train_s": round(t2 - t1, 5), "agree_s": round(self._agree_s, 5),
                    "after_s": round(time.perf_counter() - t2, 5), "padded": int(batch.row_mask.numel()),
                    "pipe": pipe, "named": named, **({"digest": digest} if digest else {}),
                    **({"dealt": dealt} if dealt else {})}
            if self.daemon is not None and self.daemon.state["published"] and \
                    self.daemon.state["published"][-1]["step"] == step:
                line["published"] = self.daemon.state["published"][-1]["version"]
            self._journal.write(json.dumps(line) + "\n")
            self._journal.flush()
        return True

    def deal(self) -> tuple[TrainBatch | None, list, list, dict, int]:
        """(this rank's micro-batch, its spans, on rank 0 every rank's spans, the pipe's timings, the
        spans that went by name);
        None to skip. Each drawn span is trained on by one rank, once (`DataPipe`)."""
        return self.pipe.next()

    def commit(self) -> None:
        """Save the resumable state on every rank at this step, then rank 0's state.json."""
        self.distiller.save_state(self.run_dir / "distiller.pt")
        if self.daemon is not None:
            self.daemon.state["step"] = self.distiller.step
            self.daemon.write_state()

    def check_weights(self) -> str:
        """All ranks' weight digests compared; raises if they differ (the ranks are out of step)."""
        import torch.distributed as dist

        digest = weights_digest(self.distiller.head)
        mine = torch.tensor([int(digest, 16) - (1 << 63)], dtype=torch.int64)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        if len({int(t) for t in every}) != 1:
            raise RuntimeError(f"step {self.distiller.step}: the ranks' weights differ "
                               f"({[format(int(t) + (1 << 63), '016x') for t in every]})")
        return digest
