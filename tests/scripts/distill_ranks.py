"""Run by test_distill_ranks under torchrun: each rank trains the same tiny head on its half
of a fixed batch for a few steps through the Distiller, then writes its weights to OUT/rank{r}.pt."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from online_spec.head import new_head  # noqa: E402
from tests.distill_helpers import greedy_records, tiny8  # noqa: E402
from trainer.batch import collate  # noqa: E402
from trainer.distill import DistillConfig, Distiller  # noqa: E402
from trainer.loss import LossConfig  # noqa: E402


def main(out: str) -> None:
    target = tiny8()
    recs, _ = greedy_records(target, num=4, new_tokens=16)
    d = Distiller(target, new_head(target, 128, seed=0).float(),
                  DistillConfig(lr=1e-3, warmup_steps=0, deepspeed_config=sys.argv[2]), LossConfig(ttt_steps=2))
    for _ in range(3):
        d.train_step(collate(recs[d.rank::d.world_size]))
    torch.save({k: v.clone() for k, v in d.head.state_dict().items()}, Path(out) / f"rank{d.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
