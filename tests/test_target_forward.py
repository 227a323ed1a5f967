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
