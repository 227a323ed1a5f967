"""The trainer: teacher-forced capture, the distillation step (loss, TTT unroll, DeepSpeed),
evaluation, and the `online-spec pretrain` command."""
