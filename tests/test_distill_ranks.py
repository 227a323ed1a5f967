"""DeepSpeed on CPU: two ranks under torchrun end with identical weights (each trained on a
different half of the batch, so only gradient averaging can make them agree); one process
without any launcher trains, and a saved state resumes to the same weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from online_spec.head import new_head
from tests.distill_helpers import greedy_records, tiny8
from trainer.batch import collate
from trainer.distill import DistillConfig, Distiller
from trainer.loss import LossConfig

REPO = Path(__file__).resolve().parents[1]


# One 2-rank run (ZeRO-1: sharded optimizer state plus gradient averaging); ZeRO-0 runs in the
# single-process test below (the default config). A second torchrun costs ~1.5 min under load.
@pytest.mark.parametrize("ds_config", ["configs/deepspeed/zero1.json", "configs/deepspeed/zero1_overlap.json"])
def test_two_ranks_end_identical(tmp_path, ds_config):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617",
           str(REPO / "tests/scripts/distill_ranks.py"), str(tmp_path), ds_config]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(tmp_path / "rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "rank1.pt", weights_only=True)
    init = new_head(tiny8(), 128, seed=0).float().state_dict()
    assert not torch.equal(a["fc.weight"], init["fc.weight"])  # they trained
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_single_process_without_launcher_and_resume(tmp_path):
    import torch.distributed as dist
    target = tiny8()
    recs, _ = greedy_records(target, num=2, new_tokens=16)
    batch = collate(recs)
    d = Distiller(target, new_head(target, 128, seed=0).float(), DistillConfig(warmup_steps=1, total_steps=10),
                  LossConfig(ttt_steps=2))
    assert dist.get_world_size() == 1
    m = [d.train_step(batch) for _ in range(2)]
    assert m[1]["step"] == 2 and m[1]["tokens"] == 2 * batch.num_rows
    d.save_state(tmp_path / "state.pt")
    d.train_step(batch)
    after = {k: v.clone() for k, v in d.head.state_dict().items()}
    d.load_state(tmp_path / "state.pt")
    assert d.step == 2
    d.train_step(batch)
    for k, v in d.head.state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=0)
