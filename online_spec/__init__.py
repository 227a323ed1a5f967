"""online-spec: keeps an EAGLE-3 draft head in step with live traffic.

The house has five layers, each importing only those below it:

    online_spec/  (1) what every part shares: the capture record, the head and its codec, policies
    collector/    (2) capture stream: wire format, publisher, subscriber, replay buffer
    serving/      (3) engine, server, control endpoint, swap, SGLang plugin
    trainer/      (4) distillation, gate, checkpoint publishing, the daemon
    bench/        (5) benchmarks and the demo harness

This package holds: target loading (`target`), the EAGLE-3 head (`head`) and its checkpoint
codec (`checkpoint`), the capture record (`capture`), sampling and acceptance (`sampling`), the
KV-cache layout (`kvcache`), data (`data`), config helpers (`config`), the machine description
(`machine`), the pure policies (`controller/`: K per round; `drift`: alerts from acceptance),
alert sinks (`alerts`, `wandb_run`), and the command line (`cli`, which names modules of every
layer by string). The path of one token through the layers: docs/architecture.md.
"""

# OpenMP wait policy: left to the runtime (libgomp spins a while before sleeping). Measured on
# 2 cores (docs/engine.md, "CPU notes"): a 2-thread process alone decodes 1.5-1.8x faster
# spinning than with OMP_WAIT_POLICY=PASSIVE (batch 1: 20 vs 30 ms a step; batch 16 x 4 tokens:
# 59 vs 106 ms), and PASSIVE with 2 threads is slower than 1 thread. Where processes share the
# cores (server + trainer daemon), each runs with its own threads (the demo, `bench e2e` and
# `train` default to 1 each), where the policy does not matter; a multi-threaded process on a
# shared CPU should set OMP_WAIT_POLICY=PASSIVE itself (spinning there: 2.4x slower).

from pathlib import Path

__version__ = "0.1.0"

PRETRAINED_HEADS = Path(__file__).resolve().parent / "pretrained"
"""The head checkpoints that ship with the package (`sharegpt-chat-h100`, `code-h100`)."""
