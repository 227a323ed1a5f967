"""Where a trainer step's time goes: `Distiller.train_step` under torch.profiler on one device.

Reads a replay buffer (e.g. the one `online-spec bench ranks` builds under OUT/buffer), draws
batches of --batch-tokens rows as the daemon does, runs --warmup steps, then profiles --steps
steps and prints the step's wall time, the device's busy time, and the top operators by host
and by device time. Usage (on a GPU machine):

    python scripts/profile_train_step.py --buffer runs/bench_ranks/buffer --device cuda:0
"""

from __future__ import annotations

import argparse
import time

import torch

from collector.replay import ReplayBuffer, ReplayConfig
from online_spec.head import new_head
from online_spec.target import load_target
from trainer.batch import collate
from trainer.distill import DistillConfig, Distiller, init_from_target
from trainer.loss import LossConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffer", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--deepspeed-config", default="configs/deepspeed/zero1.json")
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    target = load_target(None, device=a.device)
    head = init_from_target(new_head(target).float(), target)
    d = Distiller(target, head, DistillConfig(deepspeed_config=a.deepspeed_config), LossConfig())
    buf = ReplayBuffer(ReplayConfig(root=a.buffer, heldout_every=0))
    pin = torch.device(a.device).type == "cuda"
    batches = [collate(buf.sample_train(a.batch_tokens), pin) for _ in range(a.warmup + a.steps)]
    sync = torch.cuda.synchronize if pin else (lambda: None)
    for b in batches[:a.warmup]:
        d.train_step(b)
    sync()
    t0 = time.perf_counter()
    for b in batches[a.warmup:]:
        d.train_step(b)
    sync()
    plain_ms = (time.perf_counter() - t0) / a.steps * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if pin else [])
    with torch.profiler.profile(activities=acts) as prof:
        for b in batches[a.warmup:]:
            d.train_step(b)
        sync()
    events = prof.key_averages()
    # kernels only: an operator's own device time repeats its kernels'
    device_us = sum(e.self_device_time_total for e in events if e.device_type != torch.autograd.DeviceType.CPU)
    print(f"train_step: {plain_ms:.1f} ms a step without the profiler ({a.steps} steps of {a.batch_tokens} rows, "
          f"padded/rows {sum(b.row_mask.numel() for b in batches) / sum(b.num_rows for b in batches):.2f}); "
          f"device busy {device_us / a.steps / 1e3:.1f} ms a step (its kernels' time, profiled)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.top))
    if pin:
        print(events.table(sort_by="self_device_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
