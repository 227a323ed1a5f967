"""The distillation loss: EAGLE-3's training-time-test (TTT) unroll against the target.

In: the head, a `TrainBatch` (captured rows), the target's frozen shared parts (`SharedTarget`:
token embeddings, the lm_head rows of the draft vocabulary, rope) and a `LossConfig`. Out: a
scalar loss and per-step metrics. No target forward happens here: the target's next-token
distribution comes from the captured post-norm final hidden times the shared lm_head.

The unroll (anchor row p; step k = 0 .. num_steps-1 sits at position p + k, as in the engine):

    step 0   reads (embed(tokens[p+1]), fc(features[p]))         -> predicts tokens[p+2]
    step k   reads (embed(tokens[p+k+1]), hidden out of step k-1) -> predicts tokens[p+k+2]

Step k's attention sees what the engine's draft step k sees: the real rows 0..p (step 0's keys,
causal) plus the anchor's own rows of steps 1..k (one key each: the "diagonal"), so every anchor
of a sequence runs in parallel. Teacher forcing feeds the true next token, which is what an
accepted draft would have been. Step k's loss compares the head's distribution q with the
target's p = softmax(lm_head_draft · final_hidden[p+k+1]) restricted to the draft vocabulary:

    kl              -Σ p log q   (forward KL up to the target's entropy)
    tv              ½ Σ |p − q|  (= 1 − α)
    neg_log_alpha   −log Σ min(p, q)   (α: the per-token acceptance probability when sampling)

Positions whose true token is outside the draft vocabulary are masked (the head cannot draft
it); tokens that corrected a rejected live draft get weight 1 + rejected_weight. Step losses are
summed with weight step_decay**k (SpecForge uses 0.8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from online_spec.config import check, doc
from trainer.batch import TrainBatch

LOSS_KINDS = ("kl", "tv", "neg_log_alpha")


@dataclass
class LossConfig:
    ttt_steps: int = doc("draft steps unrolled per anchor (training-time test)", 5)
    step_decay: float = doc("weight of step k is step_decay**k", 0.8)
    kind: str = doc("per-token loss: kl | tv | neg_log_alpha", "kl")
    rejected_weight: float = doc("extra weight on tokens whose live draft was rejected", 0.0)
    early_ttt_steps: int = doc("draft steps unrolled during the first early_fraction of training (0: ttt_steps "
                               "throughout); each unrolled step costs a full head pass", 0)
    early_fraction: float = doc("fraction of the optimizer steps that unroll early_ttt_steps", 0.0)

    def steps_at(self, progress: float) -> int:
        """Draft steps to unroll at training progress in [0, 1]."""
        if self.early_ttt_steps and progress < self.early_fraction:
            return self.early_ttt_steps
        return self.ttt_steps

    def __post_init__(self):
        check(self.ttt_steps >= 1, "ttt_steps", "must be >= 1")
        check(0.0 < self.step_decay <= 1.0, "step_decay", "must be in (0, 1]")
        check(self.kind in LOSS_KINDS, "kind", f"must be one of {LOSS_KINDS}")
        check(self.rejected_weight >= 0.0, "rejected_weight", "must be >= 0")
        check(0 <= self.early_ttt_steps <= self.ttt_steps, "early_ttt_steps", "must be in 0..ttt_steps")
        check(0.0 <= self.early_fraction <= 1.0, "early_fraction", "must be in [0, 1]")


@dataclass
class SharedTarget:
    """The target's frozen parts the trainer shares (never trained, never in a checkpoint)."""

    embed: nn.Embedding
    lm_head_draft: torch.Tensor  # [V_d, H]: target lm_head rows of the draft vocabulary
    rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [B,T] -> cos,sin [B,1,T,hd]

    @classmethod
    def build(cls, target, head) -> "SharedTarget":
        w = target.lm_head.weight.detach()[head.draft_to_target.to(target.device)]
        return cls(embed=target.embed_tokens, lm_head_draft=w, rope=target.rope)


class TTTAttention:
    """attend(q, k, v) for the unroll: step 0 is causal over real rows; step k also sees the
    anchor's keys of steps 1..k. Keys/values of every step are kept for the later steps."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B,nh,T,hd], k/v [B,kvh,T,hd] -> [B,T,nh*hd]
        self.keys.append(k)
        self.values.append(v)
        B, nh, T, hd = q.shape
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != k.shape[1])
            return out.transpose(1, 2).reshape(B, T, nh * hd)
        rep = nh // k.shape[1]
        k0 = self.keys[0].repeat_interleave(rep, 1)
        v0 = self.values[0].repeat_interleave(rep, 1)
        kd = torch.stack([x.repeat_interleave(rep, 1) for x in self.keys[1:]], dim=3)  # [B,nh,T,k,hd]
        vd = torch.stack([x.repeat_interleave(rep, 1) for x in self.values[1:]], dim=3)
        scale = hd ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B,nh,T,T]
        sd = (q[:, :, :, None] * kd).sum(-1) * scale  # [B,nh,T,k]
        w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        out = w[..., :T] @ v0 + (w[..., T:, None] * vd).sum(3)
        return out.transpose(1, 2).reshape(B, T, nh * hd)


def ttt_unroll(head, batch: TrainBatch, shared: SharedTarget, num_steps: int) -> list[torch.Tensor]:
    """Draft logits [B,T,V_d] of each step k (row p of step k predicts tokens[p+k+2])."""
    return [head.logits(h) for h in ttt_hidden(head, batch, shared, num_steps)]


def ttt_hidden(head, batch: TrainBatch, shared: SharedTarget, num_steps: int) -> list[torch.Tensor]:
    """The head's output hidden [B,T,H] of each step k (`ttt_unroll` before the lm_head)."""
    B, T = batch.row_mask.shape
    dtype = head.fc.weight.dtype
    with torch.no_grad():
        emb_all = shared.embed(batch.tokens).to(dtype)  # [B, T+1, H], frozen
    emb_all = torch.cat([emb_all, emb_all.new_zeros(B, num_steps, emb_all.shape[-1])], dim=1)
    positions = batch.first_pos[:, None] + torch.arange(T, device=batch.tokens.device)[None]
    hidden = batch.features.to(dtype)
    attend = TTTAttention()
    out = []
    for k in range(num_steps):
        cos, sin = shared.rope(positions + k)
        hidden = head.hidden_out(emb_all[:, k + 1:k + 1 + T], hidden, cos.squeeze(1).to(dtype),
                                 sin.squeeze(1).to(dtype), attend)
        out.append(hidden)
    return out


def token_loss(logits: torch.Tensor, target_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-position loss [..] between draft logits and target probabilities (fp32)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    if kind == "kl":
        return -(target_probs * logq).sum(-1)
    q = logq.exp()
    if kind == "tv":
        return 0.5 * (target_probs - q).abs().sum(-1)
    alpha = torch.minimum(target_probs, q).sum(-1)
    return -torch.log(alpha.clamp_min(1e-6))


def target_probs(batch: TrainBatch, shared: SharedTarget, rows: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(lm_head_draft · final_hidden) [B,T,V_d]: the target's next-token distribution
    restricted (renormalized) to the draft vocabulary; of the rows where `rows` [B,T] is True
    only ([R,V_d], in row-major order) when given."""
    with torch.no_grad():
        w = shared.lm_head_draft
        h = batch.final_hidden if rows is None else batch.final_hidden[rows]
        return torch.softmax((h.to(w.dtype) @ w.T).float(), dim=-1)


def ttt_loss(head, batch: TrainBatch, shared: SharedTarget, cfg: LossConfig,
             num_steps: int | None = None) -> tuple[torch.Tensor, dict]:
    """The weighted TTT loss over `num_steps` (default cfg.ttt_steps) unrolled draft steps, and
    metrics (loss_k, acc_k: draft argmax == true token over rows).

    Logits and target distributions are computed only for the rows the loss reads (anchors
    with an in-vocabulary target inside their span), not for padding: at 4,096 rows a step the
    vocabulary projections are most of the work, and a batch of spans of unequal length is
    often half padding."""
    B, T = batch.row_mask.shape
    real = batch.row_mask
    probs = target_probs(batch, shared, real)  # [R, V_d], real rows in order
    index = torch.cumsum(real.flatten(), 0).view(B, T) - 1  # row (b, t) -> its place in probs
    in_vocab = head.t2d[batch.tokens]  # [B, T+1]
    d2t = head.draft_to_target
    num_steps = num_steps or cfg.ttt_steps
    # the rows each step's loss reads, found before the unroll: finding them waits for the
    # device (nonzero), which costs nothing while it is idle and a stall in the middle of the work
    reads = []
    for k in range(num_steps):
        n = T - k - 1  # anchors 0..n-1 have a target row p+k+1 inside the batch
        if n <= 0:
            break
        rows = real[:, k + 1:k + 1 + n]
        b, p = (rows & in_vocab[:, k + 2:k + 2 + n]).nonzero(as_tuple=True)
        reads.append((b, p, rows.sum()))
    steps = ttt_hidden(head, batch, shared, num_steps)
    # A batch without any anchor (every span a single row) still yields a loss in the autograd
    # graph: zero, with zero gradients, so every rank's backward and all-reduce run as usual.
    total = steps[0].sum() * 0.0
    # the metrics stay on the device until one transfer at the end: a float() per value would
    # make the host wait for the device 3 times a step (on a GPU the host then cannot queue the
    # next kernels while the device works)
    values: list[torch.Tensor] = []
    for k, (b, p, num_rows) in enumerate(reads):
        logits = head.logits(steps[k][b, p])  # [M, V_d]: the anchors with an in-vocabulary target
        w = 1.0 + cfg.rejected_weight * batch.rejected[b, p + k + 2].float()
        per = token_loss(logits, probs[index[b, p + k + 1]], cfg.kind)
        loss_k = (per * w).sum() / w.sum().clamp_min(1.0)
        total = total + cfg.step_decay ** k * loss_k
        with torch.no_grad():  # a true token outside the draft vocabulary is never hit: valid rows suffice
            hits = (d2t[logits.argmax(-1)] == batch.tokens[b, p + k + 2]).sum()
            values += [loss_k.detach().float(), hits.float() / num_rows.clamp_min(1).float()]
    out = torch.stack(values + [total.detach().float()]).tolist()
    metrics: dict[str, float] = {}
    for k in range(len(reads)):
        metrics[f"loss_{k}"], metrics[f"acc_{k}"] = out[2 * k], out[2 * k + 1]
    metrics["loss"] = out[-1]
    return total, metrics
