"""`TargetModel.forward` computes HF's model: its stacked q/k/v and gate/up projections and
fused norms give HF's logits (tiny fp32 Llama, a stand-in for SmolLM2 that runs the same code),
and the stacked weights follow HF's own: rebuilt after a dtype move, and after an in-place
write once `refresh_projections` is called."""

import torch

from online_spec.kvcache import AttentionBatch
from online_spec.target import tiny_target


def _logits(t, x):
    cache = t.new_cache(1, 64)
    return t.forward(x, AttentionBatch([0], x.shape[1], t.device), cache)[0]


def test_forward_equals_hf_and_follows_its_weights():
    t = tiny_target(seed=3)
    x = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_logits(t, x), t.hf(x).logits, rtol=1e-5, atol=1e-5)
        before = _logits(t, x)
        t.hf.model.layers[2].self_attn.v_proj.weight.mul_(1.5)  # in place, then refreshed
        t.hf.model.layers[3].mlp.up_proj.weight.mul_(0.5)
        t.refresh_projections()
        after = _logits(t, x)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, t.hf(x).logits, rtol=1e-5, atol=1e-5)
        t.hf.to(torch.float64)
        assert _logits(t, x).dtype == torch.float64


def test_q_and_k_rotated_together_equal_hfs_rotary_embedding_bit_for_bit():
    """`rope_rotate` over q and k as one tensor gives HF's `apply_rotary_pos_emb`, every bit, in
    the dtypes the engine serves in, at positions beyond the table's first size (it grows)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from online_spec.target import rope_rotate

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = tiny_target(seed=3)
        t.hf.to(dtype)
        i = t.info
        B, T = 3, 5
        pos = torch.tensor([[0, 1, 2, 3, 4], [700, 701, 702, 702, 703], [1500, 1501, 1502, 1503, 1504]])
        cos, sin = t.rope(pos, 2048)  # [B,1,T,hd]: HF's operands
        c, ss = t.rope_rows(pos, 2048)  # [B,T,1,hd]
        qk = torch.randn(B, T, i.num_heads + i.kv_heads, i.head_dim, generator=g).to(dtype)
        q, k = qk[:, :, :i.num_heads].transpose(1, 2), qk[:, :, i.num_heads:].transpose(1, 2)
        hq, hk = apply_rotary_pos_emb(q, k, cos.squeeze(1), sin.squeeze(1))
        ours = rope_rotate(qk, c, ss)
        assert torch.equal(ours[:, :, :i.num_heads].transpose(1, 2), hq), dtype
        assert torch.equal(ours[:, :, i.num_heads:].transpose(1, 2), hk), dtype
