"""Evaluation: a trained head's simulated accept length beats a random head's, and a checkpoint
written by `pretrain` loads in the engine, whose measured accept length agrees with the
simulated one (the records are the target's own greedy continuations, so both see the same
target choices; they differ only in which positions start a round)."""

import torch

from online_spec.checkpoint import load_head
from online_spec.head import new_head
from tests.distill_helpers import greedy_records, tiny8
from trainer.evaluate import engine_accept_length, simulate_acceptance

# |engine - simulated| accept length at K=3: the engine averages over round starts, the
# simulation over every position; on 8 x 40 generated tokens that differs by well under 0.35.
AGREEMENT_TOL = 0.35


def test_trained_head_beats_random(tmp_path):
    from trainer.batch import collate
    from trainer.distill import DistillConfig, Distiller
    from trainer.loss import LossConfig

    target = tiny8()
    recs, _ = greedy_records(target, num=6, new_tokens=40)
    random_head = new_head(target, 256, seed=0).float()
    before = simulate_acceptance(random_head, target, recs, max_steps=3, ks=(3,))
    d = Distiller(target, new_head(target, 256, seed=0).float(),
                  DistillConfig(lr=3e-3, warmup_steps=0, schedule="constant"), LossConfig(ttt_steps=3))
    for _ in range(40):
        d.train_step(collate(recs))
    after = simulate_acceptance(d.head, target, recs, max_steps=3, ks=(3,))
    assert after["accept_length"]["3"] > before["accept_length"]["3"] + 0.5, (before, after)


def test_pretrain_checkpoint_in_engine_agrees_with_simulation(tmp_path):
    from trainer.data import save_records
    from trainer.distill import DistillConfig
    from trainer.loss import LossConfig
    from trainer.pretrain import PretrainConfig, pretrain

    target = tiny8()
    recs, seqs = greedy_records(target, num=12, new_tokens=40, seed=1)
    save_records(recs, tmp_path / "records")
    cfg = PretrainConfig(data=str(tmp_path / "records"), out=str(tmp_path / "run"), epochs=40.0,
                         batch_tokens=600, draft_vocab_size=256, eval_prompts=0, save_every=10)
    result = pretrain(cfg, DistillConfig(lr=3e-3, warmup_steps=0), LossConfig(ttt_steps=3), target=target)
    assert result["steps"] >= 20
    head, meta = load_head(tmp_path / "run" / "head", target.info, dtype=torch.float32)
    assert meta["version"] == 1
    sim = simulate_acceptance(head, target, recs[:8], max_steps=3, ks=(3,))["accept_length"]["3"]
    prompts = [s[:8] for s in seqs[:8]]
    real = engine_accept_length(target, head, prompts, num_steps=3, max_tokens=40)
    assert [o for o in real["outputs"]] == [s[8:8 + len(o)] for s, o in zip(seqs, real["outputs"])]  # lossless
    assert sim > 0.5, sim  # a trained head, so the comparison means something
    assert abs(real["accept_length"] - sim) < AGREEMENT_TOL, (real["accept_length"], sim)
    # rerunning the same command finds the run done and returns its result
    assert pretrain(cfg, DistillConfig(lr=3e-3, warmup_steps=0), LossConfig(ttt_steps=3), target=target) == result
