"""The trainer: distills the head from captured traffic and publishes it (layer 4; imports
`online_spec`, `collector`, `serving`).

- `daemon`       `TrainerDaemon`, `online-spec train`: subscriber -> replay buffer -> distill ->
                 gate -> checkpoint -> swap over the control endpoint, rollback watch (`train_cli`
                 builds it from flags; `daemon_config`: its flags)
- `seeds`        seed heads: pretrained heads the daemon starts over from when one drafts the
                 traffic of now better than the live head
- `starvation_watch`  the daemon's starvation alerts: when it checks, what it reads, where they go
- `server_head`  the daemon follows a head the server made live on its own (its head bank, a
                 rollback of a broken head), and learns which tags the bank holds a head for
- `warm_up`      the daemon's first step's one-off costs, paid on a throwaway copy of the head
                 before the CLIs report ready
- `duty`         the daemon's duty cycle: its rests beside a serving server, lower while the gate
                 keeps refusing (futility); `slack`: the serving budget, the duty capped by the
                 server's measured slowdown while the trainer steps
- `ranks`        the daemon across N data-parallel ranks (rank 0 subscribes, publishes; `rank_data`:
                 its deal of the micro-batches, by name to ranks that read its buffer); `launch`:
                 `online-spec train --ranks N` starts and watches them
- `distill`      `Distiller`: one distillation step (DeepSpeed; `loss`: the EAGLE-3 loss with the
                 training-time-test unroll; `batch`: padded training batches)
- `evaluate`     a head's simulated acceptance on held-out rows (the gate's evidence; the live
                 head's counted once per span, `LiveCounts`), and its real one in the engine
- `gate`         `SwapGate`: publish a candidate only when it measurably beats the live head on
                 the mix and on every traffic tag; `RollbackMonitor`
- `data`         teacher-forced capture: real conversations (ShareGPT, HumanEval) through the
                 target into the engine's capture records
- `pretrain`     `online-spec pretrain`: an offline head from those records

Where a token goes: its captured row (a `CaptureSpan` from collector/) is sampled into a batch,
the distiller learns from it, the gate weighs the candidate, a winner is written as a new
checkpoint version (online_spec/checkpoint.py) and swapped into the server (serving/control.py).
"""
