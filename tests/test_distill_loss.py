"""The TTT unroll and loss against a naive per-position reference (the engine's own cached
inference path), and the loss going down on a fixed batch."""

import math

import pytest
import torch

from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch
from trainer.batch import collate
from trainer.loss import LossConfig, SharedTarget, target_probs, token_loss, ttt_loss, ttt_unroll
from tests.distill_helpers import tiny8

K = 4


@pytest.fixture(scope="module")
def setup():
    target = tiny8()
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 100, (target.info.vocab_size,), generator=g)
    head = new_head(target, 200, counts, seed=3).float()
    with torch.no_grad():  # larger weights than the default init: distributions with structure
        for p in head.parameters():
            p.mul_(5.0)
    from trainer.data import capture_tokens
    seqs = [torch.randint(0, 511, (n,), generator=g).tolist() for n in (23, 15)]
    recs = capture_tokens(target, seqs, ["a", "b"])
    batch = collate(recs)
    batch.rejected = torch.rand(batch.rejected.shape, generator=g) < 0.3
    return target, head, recs, batch


def naive_logits(head, target, rec, steps):
    """out[k][p]: draft logits of anchor p at step k, each anchor run alone through head.step
    over a KV cache exactly as the engine drafts (real rows 0..p, then chained steps)."""
    n = rec.num_rows
    out = {}
    for p in range(n):
        cache = head.new_cache(1, n + steps + 2)
        emb = target.embed_tokens(rec.tokens[1:p + 2][None])
        lg, hid = head.step(emb, rec.features[:p + 1][None].float(), AttentionBatch([0], p + 1), cache, target.rope)
        out[(0, p)], h = lg[0, -1], hid[:, -1:]
        for k in range(1, steps):
            if p + k + 1 > n:
                break
            emb = target.embed_tokens(rec.tokens[p + k + 1:p + k + 2][None])
            lg, h = head.step(emb, h, AttentionBatch([p + k], 1), cache, target.rope)
            out[(k, p)] = lg[0, -1]
    return out


def test_ttt_unroll_matches_cached_inference(setup):
    target, head, recs, batch = setup
    with torch.no_grad():
        steps = ttt_unroll(head, batch, SharedTarget.build(target, head), K)
    compared = 0
    for b, rec in enumerate(recs):
        for (k, p), ref in naive_logits(head, target, rec, K).items():
            torch.testing.assert_close(steps[k][b, p], ref, atol=2e-4, rtol=2e-4)
            compared += 1
    assert compared > 60


@pytest.mark.parametrize("kind", ["kl", "tv", "neg_log_alpha"])
def test_ttt_loss_matches_naive(setup, kind):
    target, head, recs, batch = setup
    cfg = LossConfig(ttt_steps=K, step_decay=0.8, kind=kind, rejected_weight=2.0)
    shared = SharedTarget.build(target, head)
    with torch.no_grad():
        loss, metrics = ttt_loss(head, batch, shared, cfg)
        probs = target_probs(batch, shared)
    expected = 0.0
    for k in range(K):
        num = den = 0.0
        for b, rec in enumerate(recs):
            ref = naive_logits(head, target, rec, K)
            n = rec.num_rows
            for p in range(n):
                if p + k + 1 >= n:  # no target row p+k+1
                    continue
                tok = int(rec.tokens[p + k + 2])
                if not bool(head.t2d[tok]):
                    continue
                w = 1.0 + 2.0 * float(batch.rejected[b, p + k + 2])
                num += w * float(token_loss(ref[(k, p)], probs[b, p + k + 1], kind))
                den += w
        expected += 0.8 ** k * num / den
        assert math.isclose(metrics[f"loss_{k}"], num / den, rel_tol=1e-4)
    assert math.isclose(float(loss), expected, rel_tol=1e-4)


def dense_ttt_loss(head, batch, shared, cfg):
    """The loss over every position of the padded batch, masked afterwards (what ttt_loss
    computed before it took logits of the loss's rows only): the reference for its gradients."""
    B, T = batch.row_mask.shape
    probs = target_probs(batch, shared)
    steps = ttt_unroll(head, batch, shared, cfg.ttt_steps)
    total = 0.0
    for k, logits in enumerate(steps):
        n = T - k - 1
        valid = batch.row_mask[:, k + 1:k + 1 + n] & head.t2d[batch.tokens][:, k + 2:k + 2 + n]
        w = valid.float() * (1.0 + cfg.rejected_weight * batch.rejected[:, k + 2:k + 2 + n].float())
        per = token_loss(logits[:, :n], probs[:, k + 1:k + 1 + n], cfg.kind)
        total = total + cfg.step_decay ** k * (per * w).sum() / w.sum().clamp_min(1.0)
    return total


@pytest.mark.parametrize("kind", ["kl", "neg_log_alpha"])
def test_ttt_loss_gradients_equal_the_dense_loss(setup, kind):
    # padding rows and rows without a target take no logits, and change nothing: same loss and
    # same gradient for every parameter as the loss over the whole padded batch
    target, head, recs, batch = setup
    cfg = LossConfig(ttt_steps=K, kind=kind, rejected_weight=1.5)
    shared = SharedTarget.build(target, head)
    grads = []
    for fn in (lambda: ttt_loss(head, batch, shared, cfg)[0], lambda: dense_ttt_loss(head, batch, shared, cfg)):
        head.zero_grad()
        loss = fn()
        loss.backward()
        grads.append((float(loss), [p.grad.clone() for p in head.parameters() if p.grad is not None]))
    (a, ga), (b, gb) = grads
    assert math.isclose(a, b, rel_tol=1e-5) and len(ga) == len(gb) > 5
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-4 * float(y.abs().max()), rtol=1e-4)  # rounding only
    head.zero_grad()


def test_masking_out_of_vocab_changes_loss(setup):
    target, head, recs, batch = setup
    shared = SharedTarget.build(target, head)
    with torch.no_grad():
        base, _ = ttt_loss(head, batch, shared, LossConfig(ttt_steps=2))
        saved = head.t2d.clone()
        head.t2d.fill_(True)  # every token "in vocab": the masked positions now count
        unmasked, _ = ttt_loss(head, batch, shared, LossConfig(ttt_steps=2))
        head.t2d.copy_(saved)
    assert not math.isclose(float(base), float(unmasked), rel_tol=1e-3)


def test_loss_decreases_on_fixed_batch():
    from trainer.distill import DistillConfig, Distiller
    target = tiny8()
    from tests.distill_helpers import greedy_records
    recs, _ = greedy_records(target, num=3, new_tokens=24)
    head = new_head(target, 256, seed=0).float()
    d = Distiller(target, head, DistillConfig(lr=2e-3, warmup_steps=0, schedule="constant"), LossConfig(ttt_steps=3))
    batch = collate(recs)
    first = d.train_step(batch)["loss"]
    for _ in range(15):
        last = d.train_step(batch)["loss"]
    assert last < 0.7 * first, (first, last)


def test_schedules_and_early_ttt_steps():
    from trainer.distill import DistillConfig, lr_factor

    wsd = DistillConfig(schedule="wsd", warmup_steps=2, total_steps=10, decay_fraction=0.3, min_lr_ratio=0.1)
    f = [lr_factor(s, wsd) for s in range(11)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[6] == 1.0  # warmup, then flat until step 7
    assert f[7] == 1.0 and 0.1 < f[8] < 1.0 and f[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    cfg = LossConfig(ttt_steps=3, early_ttt_steps=1, early_fraction=0.75)
    assert [cfg.steps_at(p) for p in (0.0, 0.74, 0.75, 1.0)] == [1, 1, 3, 3]
    assert LossConfig(ttt_steps=3).steps_at(0.0) == 3
    with pytest.raises(ValueError, match="early_ttt_steps"):
        LossConfig(ttt_steps=2, early_ttt_steps=3)


def test_batch_without_anchors_trains_without_error():
    """Live spans of a single row (a round that accepted nothing, alone in its span) have no
    anchor: the loss is zero but still in the graph, so DeepSpeed's backward accepts it and the
    step changes nothing it should not."""
    from trainer.distill import DistillConfig, Distiller
    from trainer.data import capture_tokens
    target = tiny8()
    head = new_head(target, 256, seed=0).float()
    one_row = capture_tokens(target, [[5, 6]], ["x"])  # one row
    batch = collate(one_row)
    assert batch.row_mask.shape[1] == 1
    loss, _ = ttt_loss(head, batch, SharedTarget.build(target, head), LossConfig(ttt_steps=2))
    assert loss.grad_fn is not None and float(loss.detach()) == 0.0
    d = Distiller(target, head, DistillConfig(lr=2e-3, warmup_steps=0, schedule="constant"), LossConfig(ttt_steps=2))
    before = {k: v.clone() for k, v in d.head.state_dict().items()}
    metrics = d.train_step(batch)
    assert metrics["loss"] == 0.0 and d.step == 1
    assert all(torch.equal(before[k], v) for k, v in d.head.state_dict().items())


def test_anchor_pulls_the_weights_toward_the_starting_head(tmp_path):
    """DistillConfig.anchor: lr * anchor >= 1 puts every weight back at the start after each step;
    a moderate anchor keeps the head nearer the start than no anchor, while the loss still falls;
    ZeRO stage 3 (partitioned weights) is refused with the reason."""
    import json as _json

    from tests.distill_helpers import greedy_records
    from trainer.distill import DistillConfig, Distiller

    target = tiny8()
    recs, _ = greedy_records(target, num=3, new_tokens=24)
    batch = collate(recs)
    start = {k: v.clone() for k, v in new_head(target, 256, seed=0).float().state_dict().items()}

    def run(anchor):
        d = Distiller(target, new_head(target, 256, seed=0).float(),
                      DistillConfig(lr=2e-3, warmup_steps=0, schedule="constant", anchor=anchor), LossConfig(ttt_steps=3))
        losses = [d.train_step(batch)["loss"] for _ in range(12)]
        dist = sum(float((v.float() - start[k].float()).pow(2).sum()) for k, v in d.head.state_dict().items()
                   if v.is_floating_point()) ** 0.5
        return dist, losses

    frozen, _ = run(1 / 2e-3)
    free, free_losses = run(0.0)
    braked, braked_losses = run(20.0)
    assert frozen == pytest.approx(0.0, abs=1e-6) and free > 0
    assert 0 < braked < 0.8 * free
    assert braked_losses[-1] < 0.9 * braked_losses[0]
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(_json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="anchor"):
        Distiller(target, new_head(target, 256, seed=0).float(),
                  DistillConfig(anchor=1.0, deepspeed_config=str(zero3)), LossConfig(ttt_steps=3))
