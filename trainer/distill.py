"""The distillation step: `Distiller` trains an EAGLE-3 head through DeepSpeed.

In: the target (its embeddings and lm_head are shared and frozen, never trainable), a head, a
`DistillConfig` (optimizer, schedule, precision) and a `LossConfig`; per step a `TrainBatch`.
Out: metrics per step, head checkpoints in the SGLang layout (rank 0 only), and a resumable
state (`state_dict()` / `load_state_dict()`: weights, optimizer, scheduler, counters; under
ZeRO 1-2 across ranks each rank saves its own part of the optimizer, `save_state`).

AdamW keeps fp32 master weights (the head's parameters are fp32); the forward/backward run under
bf16 autocast when `bf16` is set (on a CPU only where it computes bf16 natively). Gradient
clipping, ZeRO stage and micro-batching are DeepSpeed's and live in its own JSON
(`configs/deepspeed/*.json`). A single process needs no launcher (the rendezvous variables get
single-rank defaults); under torchrun or the deepspeed launcher the same code runs data-parallel,
each rank stepping on its own share of the batch.

    d = Distiller(target, head, DistillConfig(total_steps=1000), LossConfig())
    metrics = d.train_step(collate(spans));  d.save("out/head", version=1)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from online_spec.checkpoint import save_head
from online_spec.config import check, doc
from online_spec.head import EagleHead
from online_spec.target import cpu_has_native_bf16
from trainer.batch import TrainBatch
from trainer.ds_ops import prepare_ops
from trainer.loss import LossConfig, SharedTarget, ttt_loss

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("cosine", "constant", "wsd")


@dataclass
class DistillConfig:
    lr: float = doc("peak learning rate of AdamW", 5e-4)
    weight_decay: float = doc("AdamW weight decay", 0.0)
    beta1: float = doc("AdamW beta1", 0.9)
    beta2: float = doc("AdamW beta2", 0.95)
    schedule: str = doc("learning-rate schedule after warmup: cosine | constant | wsd (constant, then a "
                        "cosine to min_lr_ratio over the last decay_fraction of total_steps)", "cosine")
    decay_fraction: float = doc("wsd: fraction of total_steps spent decaying", 0.3)
    warmup_steps: int = doc("linear warmup steps", 20)
    total_steps: int = doc("steps of the cosine schedule (it stays at min_lr_ratio after)", 1000)
    min_lr_ratio: float = doc("cosine floor as a fraction of lr", 0.1)
    bf16: bool = doc("bf16 autocast for forward/backward (master weights stay fp32) on a GPU and on a CPU with "
                     "native bf16 (AVX512-BF16, AMX); an AVX2-only CPU emulates bf16 matmuls up to ~100x slower "
                     "than fp32 (a 256-row step: 20.7 s bf16, see docs/trainer.md), so there it trains in fp32", True)
    deepspeed_config: str = doc("DeepSpeed JSON (ZeRO stage, gradient clipping), relative to the repo",
                                "configs/deepspeed/zero0.json")
    seed: int = doc("seed of the head's initialisation and the data order", 0)
    anchor: float = doc("after each step pull every weight toward the head the Distiller was built with "
                        "(the run's starting head): p <- p - lr_t * anchor * (p - p0), AdamW's decoupled "
                        "decay aimed at the starting weights instead of 0; a brake on forgetting what the "
                        "starting head knew (L2-SP); 0 = off; ZeRO stages 0-2", 0.0)

    def __post_init__(self):
        check(self.lr > 0, "lr", "must be > 0")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1", "betas must be in [0, 1)")
        check(self.schedule in SCHEDULES, "schedule", f"must be one of {SCHEDULES}")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(self.total_steps >= 1, "total_steps", "must be >= 1")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(0 < self.decay_fraction <= 1, "decay_fraction", "must be in (0, 1]")
        check(self.anchor >= 0, "anchor", "must be >= 0")


def lr_factor(step: int, cfg: DistillConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        start = max(cfg.warmup_steps, round(cfg.total_steps * (1 - cfg.decay_fraction)))
        if step < start:
            return 1.0
        t = min(1.0, (step - start) / max(1, cfg.total_steps - start))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed(device: str = "cpu") -> None:
    """Join (or, alone, create) the process group DeepSpeed uses: gloo on CPU; on CUDA, DeepSpeed's
    cuda accelerator with NCCL (gloo if NCCL cannot form the group)."""
    cuda = torch.device(device).type == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    if "MASTER_PORT" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())  # alone: any free port, never a clash
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        prepare_ops()  # the op DeepSpeed's group loads: built once, a stale build lock cleared, said aloud
        if cuda:  # the device named (`--trainer-devices`), else the launcher's local rank
            index = torch.device(device).index
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) if index is None else index)
            try:
                deepspeed.init_distributed(dist_backend="nccl")
                return
            except Exception as e:  # noqa: BLE001 - fall back to gloo, which needs no NCCL
                import logging
                logging.getLogger(__name__).warning("NCCL process group failed (%s): using gloo", e)
                if dist.is_initialized():
                    dist.destroy_process_group()
        deepspeed.init_distributed(dist_backend="gloo")


def load_deepspeed_config(path: str | Path) -> dict:
    p = Path(path)
    return json.loads((p if p.is_absolute() else REPO / p).read_text())


INIT_NORMS = ("one", "target")
INIT_FCS = ("random", "last_layer")


def init_from_target(head: EagleHead, target, norm: str = "one", fc: str = "random") -> EagleHead:
    """Start the head's lm_head from the target's rows of the draft vocabulary (always).
    norm "one" keeps the final norm at 1; "target" copies the target's final norm (measured:
    raises the initial loss from 7.7 to 26, since the head's hidden is not the target's last
    residual). fc "last_layer" makes fc pass the last captured layer through (identity on the
    third H-block of the features), so the midlayer starts from a real hidden, not noise."""
    check(norm in INIT_NORMS, "norm", f"must be one of {INIT_NORMS}")
    check(fc in INIT_FCS, "fc", f"must be one of {INIT_FCS}")
    with torch.no_grad():
        ids = head.draft_to_target.to(target.device)
        head.lm_head.weight.copy_(target.lm_head.weight[ids].to(head.lm_head.weight.dtype))
        if norm == "target":
            head.norm.weight.copy_(target.hf.model.norm.weight.to(head.norm.weight.dtype))
        if fc == "last_layer":
            H = head.cfg.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * H:3 * H].copy_(torch.eye(H, dtype=head.fc.weight.dtype))
    return head


class StepDropped(RuntimeError):
    """Every rank dropped this step's batch (one of them failed on it); the ranks stay in step."""


# DeepSpeed's ZeRO optimizer state holds objects that weights_only loading refuses; these are
# either rebuilt from the config at load (the loss scaler, unused without fp16) or only serve
# its universal checkpoints (the slice mappings)
_NOT_SAVED = ("loss_scaler", "param_slice_mappings")


def portable_optimizer_state(sd: dict) -> dict:
    """`sd` as plain tensors, numbers and strings (loadable with weights_only=True)."""
    if "base_optimizer_state" not in sd:
        return sd
    out = {k: v for k, v in sd.items() if k not in _NOT_SAVED}
    if "zero_stage" in out:
        out["zero_stage"] = int(out["zero_stage"])
    return out


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


class Distiller:
    """Owns the trainable head (fp32 master weights) and its DeepSpeed engine."""

    def __init__(self, target, head: EagleHead, cfg: DistillConfig, loss_cfg: LossConfig):
        self.device = target.device  # the target's device: CPU, or the GPU the server shares
        ensure_distributed(str(self.device))  # sets DS_ACCELERATOR before deepspeed is first imported
        import deepspeed
        import torch.distributed as dist

        self.cfg, self.loss_cfg, self.target = cfg, loss_cfg, target
        self.autocast = cfg.bf16 and (self.device.type != "cpu" or cpu_has_native_bf16())
        if cfg.bf16 and not self.autocast:
            logging.getLogger(__name__).info("training in fp32: this CPU has no native bf16 (its bf16 matmuls "
                                             "are emulated, many times slower than fp32)")
        head = head.float().to(self.device).train()
        for p in target.parameters():
            p.requires_grad_(False)
        self.shared = SharedTarget.build(target, head)
        optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
        ds_cfg = load_deepspeed_config(cfg.deepspeed_config)
        stage = int(ds_cfg.get("zero_optimization", {}).get("stage", 0))
        check(cfg.anchor == 0 or stage <= 2, "anchor",
              f"needs whole parameters on every rank (ZeRO stage 0-2); {cfg.deepspeed_config} is stage {stage}")
        # the starting weights the anchor pulls toward (a resumed run is built with its starting head too)
        self._anchor = [p.detach().clone() for p in head.parameters()] if cfg.anchor > 0 else []
        # DeepSpeed moves the model to GPU LOCAL_RANK unless told the device: a trainer on another
        # GPU than its local rank (--trainer-devices, --trainer-device cuda:1 beside a server on 0)
        # would train a head on the server's GPU against a target on its own
        where = argparse.Namespace(device_rank=self.device.index) if self.device.type == "cuda" and \
            self.device.index is not None else None
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            args=where, model=head, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.zero_stage = stage
        self.step = 0
        self.tokens = 0  # rows trained on, all ranks

    @property
    def head(self) -> EagleHead:
        return self.engine.module

    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer step on this rank's batch -> metrics (loss, loss_k, acc_k, lr, grad_norm)."""
        import torch.distributed as dist

        self.engine.train()
        failure, rows = None, 0
        try:  # a batch that fails (or gives a non-finite loss) leaves no gradient behind
            rows = batch.num_rows  # counted where the batch is (host memory): no wait for the device
            batch = batch.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                k = self.loss_cfg.steps_at(self.step / self.cfg.total_steps)
                loss, metrics = ttt_loss(self.head, batch, self.shared, self.loss_cfg, k)
            if not math.isfinite(metrics["loss"]):  # the metrics' one read-back carries the loss
                raise FloatingPointError(f"the loss is {metrics['loss']}")
        except Exception as e:  # noqa: BLE001 - raised below, after the ranks agree
            failure = e
        total_rows = rows
        if self.world_size > 1:
            # every rank's backward joins the same gradient reduction: all ranks go on, or none
            # does (a rank that skipped it would leave the others waiting in the collective);
            # one all-reduce carries the agreement and the step's rows
            ok = failure is None
            agree = torch.tensor([int(ok), rows if ok else 0], dtype=torch.long, device=self.device)
            dist.all_reduce(agree)
            ok_ranks, total_rows = agree.tolist()
            if ok_ranks < self.world_size:
                failure = StepDropped(f"batch dropped by every rank ({failure or 'another rank failed'})")
        try:
            if failure is not None:
                raise failure
            self.engine.backward(loss)
        except BaseException:
            for p in self.head.parameters():
                p.grad = None
            raise
        lr = self.scheduler.get_last_lr()[0]
        pre_clip = float("nan")
        if self.zero_stage == 0:  # ZeRO stages report the norm themselves (get_global_grad_norm)
            grads = [p.grad for p in self.head.parameters() if p.grad is not None]
            pre_clip = float(torch.nn.utils.get_total_norm(grads)) if grads else pre_clip
        self.engine.step()
        if self._anchor:  # every rank applies the same pull to the same weights: they stay in step
            with torch.no_grad():
                pull = min(1.0, lr * self.cfg.anchor)
                for p, p0 in zip(self.head.parameters(), self._anchor):
                    p.lerp_(p0, pull)
        self.step += 1
        self.tokens += int(total_rows)
        gn = self.engine.get_global_grad_norm()  # ZeRO stages report it; stage 0 does not
        metrics.update(lr=lr, grad_norm=float(gn) if gn is not None else pre_clip,
                       step=self.step, tokens=self.tokens)
        return metrics

    def warm_up(self, batch: TrainBatch) -> float:
        """One forward, backward and AdamW step of a throwaway copy of the head on `batch`: the
        first step's one-off costs (kernel loading, the allocator's growth, cuBLAS / oneDNN set-up)
        paid now, before the daemon reports ready, rather than while it shares the device with a
        serving server. The head, its optimizer state and the engine are untouched. -> seconds"""
        t0 = time.perf_counter()
        live = self.head
        head = EagleHead(live.cfg)
        head.load_state_dict(live.state_dict())
        head.set_vocab_map(live.d2t.cpu(), live.t2d.cpu())
        head = head.float().to(self.device).train()
        opt = torch.optim.AdamW(head.parameters(), lr=0.0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, _ = ttt_loss(head, batch.to(self.device), self.shared, self.loss_cfg, self.loss_cfg.ttt_steps)
        loss.backward()
        opt.step()
        del head, opt, loss
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @property
    def partitioned(self) -> bool:
        """ZeRO 1-2 over several ranks: each rank holds its own part of the optimizer state."""
        return self.world_size > 1 and self.zero_stage >= 1

    def set_weights(self, head: EagleHead, re_anchor: bool = False) -> None:
        """Train on from `head`'s weights (the server's live head changed under the trainer: its
        head bank swapped back a head it had before; or a seed head, trainer/seeds.py); optimizer
        moments, schedule and counters go on. A head with another draft vocabulary brings its map
        (and the target rows the loss scores against). `re_anchor`: the anchor (if on) pulls
        toward `head` from now on, not toward the starting head. ZeRO keeps its own fp32 copy of
        the weights: refreshed from the new ones. One rank only (several would each need the
        same weights: `trainer/ranks.py` does not follow)."""
        check(self.world_size == 1, "set_weights", f"one rank only, this trainer has {self.world_size}")
        new = head.state_dict()
        with torch.no_grad():
            for name, p in self.head.named_parameters():
                p.copy_(new[name].to(device=p.device, dtype=p.dtype))
            if not torch.equal(self.head.d2t.cpu(), head.d2t.cpu()) or not torch.equal(self.head.t2d.cpu(),
                                                                                      head.t2d.cpu()):
                self.head.set_vocab_map(head.d2t.to(self.head.d2t.device), head.t2d.to(self.head.t2d.device))
            self._sync_vocab()
            if re_anchor and self._anchor:
                self._anchor = [p.detach().clone() for p in self.head.parameters()]
        if self.zero_stage >= 1:
            self.optimizer.refresh_fp32_params()

    def _sync_vocab(self) -> None:
        """After the head's vocabulary map changed (a seed adopted, or a resumed state): its
        draft-to-target ids and the target rows of its draft vocabulary follow."""
        h = self.head
        if not torch.equal(h.draft_to_target.cpu(), torch.arange(h.cfg.draft_vocab_size) + h.d2t.cpu()):
            h.set_vocab_map(h.d2t.clone(), h.t2d.clone())
        self.shared = SharedTarget.build(self.target, h)

    def state_dict(self) -> dict:
        """Weights, optimizer, scheduler, counters; partitioned, the optimizer is this rank's part."""
        return {"head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
                "optimizer": portable_optimizer_state(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(), "step": self.step, "tokens": self.tokens,
                "world_size": self.world_size, "zero_stage": self.zero_stage}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self._sync_vocab()
        self._load_optimizer(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])

    def _load_optimizer(self, sd: dict) -> None:
        if self.zero_stage >= 1:  # DeepSpeed's ZeRO optimizer takes one state per saved rank
            parts: list = [None] * self.world_size
            parts[self.rank] = sd
            self.optimizer.load_state_dict(parts)
        else:
            self.optimizer.load_state_dict(sd)

    def save_state(self, path: str | Path) -> None:
        """Write the resumable state (torch.save; read back with weights_only=True). One rank:
        rank 0 writes `path`. Partitioned (`partitioned`): a collective; every rank first writes
        its optimizer part to `PATH.parts/stepN/rankR.pt`, then, once all have (barrier), rank 0
        writes `path` naming that directory and removes older ones, so a kill at any moment
        leaves `path` naming a complete set."""
        path = Path(path)
        state = self.state_dict()
        if self.partitioned:
            import torch.distributed as dist

            parts = path.with_name(path.name + ".parts") / f"step{self.step:08d}"
            parts.mkdir(parents=True, exist_ok=True)
            _atomic_save(state.pop("optimizer"), parts / f"rank{self.rank}.pt")
            state.update(optimizer=None, parts=parts.name)
            dist.barrier()
        if self.rank == 0:
            _atomic_save(state, path)
            if self.partitioned:
                for old in path.with_name(path.name + ".parts").iterdir():
                    if old.name != state["parts"]:
                        shutil.rmtree(old, ignore_errors=True)

    def load_state(self, path: str | Path) -> None:
        """Resume from `save_state`'s files (every rank reads them). Optimizer parts saved with
        another number of ranks cannot be re-cut here: the weights, schedule and counters resume,
        the optimizer moments start afresh (said in the log)."""
        path = Path(path)
        state = torch.load(path, weights_only=True)
        saved = (int(state.get("world_size", 1)), int(state.get("zero_stage", 0)))
        if state.get("parts") is not None:
            part = path.with_name(path.name + ".parts") / state["parts"] / f"rank{self.rank}.pt"
            state["optimizer"] = (torch.load(part, weights_only=True) if self.partitioned and part.exists()
                                  and saved == (self.world_size, self.zero_stage) else None)
        elif self.partitioned:
            state["optimizer"] = None  # one whole state; ZeRO here wants its own rank's part
        if state["optimizer"] is None:
            logging.getLogger(__name__).warning(
                "optimizer state saved by %d rank(s) at ZeRO stage %d, resuming on %d at stage %d: the weights, "
                "schedule and step resume, the optimizer moments start afresh", *saved, self.world_size,
                self.zero_stage)
            self.head.load_state_dict(state["head"])
            self._sync_vocab()
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            return
        self.load_state_dict(state)

    def save(self, out: str | Path, version: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
        """Rank 0 writes the head checkpoint (SGLang layout) in `dtype`; returns its digest."""
        if self.rank != 0:
            return None
        copy = EagleHead(self.head.cfg)
        copy.load_state_dict(self.head.state_dict())
        copy.set_vocab_map(self.head.d2t.cpu(), self.head.t2d.cpu())
        return save_head(copy.to(dtype), out, version=version,
                         extra={"step": self.step, "trained_tokens": self.tokens})
