"""The EAGLE-3 draft head: same math and weight names as SGLang's `LlamaForCausalLMEagle3`.

    fc            Linear(3H -> H)   target features -> hidden (only for rows fed target features)
    midlayer      one Llama decoder layer whose attention input is
                  [input_layernorm(embed(token)), hidden_norm(hidden)]  (2H), residual = hidden
    norm          final RMSNorm;  lm_head  Linear(H -> draft_vocab)
    d2t, t2d      draft id -> target id offset (target = draft + d2t[draft]); target-vocab mask

Row p of the head reads (embedding of the token at p+1, hidden for position p) and predicts the
token at p+2; its output hidden (pre-norm residual stream) feeds the next draft step. The
token embeddings are the target's, shared and frozen, never stored in a checkpoint.

`EagleHead.forward(tokens [B,T], hidden [B,T,3H or H], batch, cache, rope)` runs over a slot KV
cache (one layer) and returns (draft-vocab logits [B,T,V_d], output hidden [B,T,H]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half

from online_spec.kvcache import AttentionBatch, KVCache
from online_spec.target import rms_norm
from online_spec.tree import select_nodes, wide_topk


@dataclass
class HeadConfig:
    """The head's shape; mirrors the fields of SGLang's Eagle3 config.json."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=lambda: [1, 14, 26])
    hidden_act: str = "silu"

    @classmethod
    def for_target(cls, info, draft_vocab_size: int = 8192) -> "HeadConfig":
        return cls(hidden_size=info.hidden_size, intermediate_size=info.intermediate_size,
                   num_attention_heads=info.num_heads, num_key_value_heads=info.kv_heads,
                   head_dim=info.head_dim, vocab_size=info.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, info.vocab_size), rms_norm_eps=info.rms_norm_eps,
                   rope_theta=info.rope_theta, max_position_embeddings=info.max_position_embeddings,
                   target_hidden_size=info.hidden_size, aux_layer_ids=list(info.aux_layer_ids))

    # HF-style view for transformers' LlamaMLP / LlamaRMSNorm constructors.
    def as_llama_like(self):
        class _C:  # noqa: N801 - a plain attribute bag
            pass
        c = _C()
        for k, v in asdict(self).items():
            setattr(c, k, v)
        c.mlp_bias = False
        return c


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B,heads,T,hd] with cos/sin [B,T,hd] (the target's convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kvh * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kvh * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)


class RMSNorm(LlamaRMSNorm):
    """HF's Llama RMSNorm (its parameter and checkpoint key `weight`) computed by torch's fused
    rms_norm (online_spec/target.py: `rms_norm`): a draft step runs four of them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, x)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        c = cfg.as_llama_like()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.draft_to_target = torch.arange(self.cfg.draft_vocab_size, device=d2t.device) + self.d2t

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "EagleHead":
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(1, num_slots, c.num_key_value_heads, max_len, c.head_dim,
                       self.fc.weight.dtype, self.fc.weight.device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B,T,H] (the target's embeddings of the next tokens), hidden [B,T,3H|H],
        cos/sin [B,T,hd]; `attend(q, k, v) -> [B,T,nh*hd]` does the cached (or training) attention.
        Returns (draft logits [B,T,V_d], output hidden [B,T,H])."""
        h = self.hidden_out(embeds, hidden, cos, sin, attend)
        return self.logits(h), h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits [.., V_d] of output hidden states h [.., H]."""
        return self.lm_head(self.norm(h))

    def hidden_out(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend) -> torch.Tensor:
        """`forward` without the lm_head: output hidden [B,T,H] (training takes logits only of
        the rows its loss reads: the lm_head is most of a step's work, and padding none of it)."""
        hidden, x = self._attention_input(embeds, hidden)
        layer, a = self.midlayer, self.midlayer.self_attn
        B, T, _ = embeds.shape
        q = a.q_proj(x).view(B, T, a.nh, a.hd).transpose(1, 2)
        k, v = self._rope_kv(x, cos, sin)
        q = _rope(q, cos, sin)
        h = hidden + a.o_proj(attend(q, k, v))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def kv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values rows write into the cache ([B,kvh,T,hd], rope applied), nothing else:
        a row's K/V depend only on its own inputs, so rebuilding a cache (after a swap, for a
        prompt) skips attention, MLP and lm_head for every row but the last. Same math as forward."""
        return self._rope_kv(self._attention_input(embeds, hidden)[1], cos, sin)

    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B,T,H] after fc where needed, attention input [norm(embeds), norm(hidden)] [B,T,2H])."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        return hidden, torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)

    def _rope_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.midlayer.self_attn
        B, T, _ = x.shape
        k = a.k_proj(x).view(B, T, a.kvh, a.hd).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.kvh, a.hd).transpose(1, 2)
        return _rope(k, cos, sin), v

    @torch.inference_mode()
    def fill_cache(self, embeds: torch.Tensor, hidden: torch.Tensor, slot: int, start: int, cache: KVCache,
                   rope) -> None:
        """Write the K/V of rows start..start+T-1 of `slot` (embeds [1,T,H], hidden [1,T,3H|H])."""
        T = embeds.shape[1]
        cos, sin = rope(torch.arange(start, start + T, device=embeds.device)[None])
        k, v = self.kv(embeds, hidden, cos.squeeze(1), sin.squeeze(1))
        cache.k[0][slot, :, start:start + T] = k[0]
        cache.v[0][slot, :, start:start + T] = v[0]

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch, cache: KVCache,
             rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached inference over a slot KV cache; `rope(positions)` gives cos/sin [B,1,T,hd]."""
        cos, sin = rope(batch.positions, batch.rope_bound)
        return self.forward(embeds, hidden, cos.squeeze(1), sin.squeeze(1),
                            lambda q, k, v: batch.attend(cache, 0, q, k, v))

    def greedy_chain(self, embed, rope, cache: KVCache, logits: torch.Tensor, hidden: torch.Tensor, K: int,
                     batch_at) -> tuple[torch.Tensor, torch.Tensor]:
        """K greedy chained draft steps, all on the device: step 0 takes the argmax of `logits`
        [B, Vd] (the head's output at each row's last committed position, `hidden` [B, H] beside
        it); step j >= 1 embeds step j - 1's draft (`embed`: the target's embedding) and runs
        `step` over it with the attention batch `batch_at(j)` (the engine's: rows at their start +
        j - 1). -> (draft target ids [B, K], their probabilities [B, K] float32). The engine runs
        it eagerly, or on a GPU captured as one CUDA graph (serving/cuda_graphs.py)."""
        toks: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for j in range(K):
            if j > 0:
                lg, hid = self.step(embed(toks[-1][:, None]), hidden[:, None], batch_at(j), cache, rope)
                logits, hidden = lg[:, 0], hid[:, 0]
            pr = torch.softmax(logits.float(), -1)
            d = pr.argmax(-1)
            toks.append(self.draft_to_target[d])
            probs.append(pr.gather(1, d[:, None])[:, 0])
        return torch.stack(toks, 1), torch.stack(probs, 1)

    def draft_tree(self, embed, rope, cache: KVCache, logits: torch.Tensor, hidden: torch.Tensor,
                   base: torch.Tensor, root: torch.Tensor, shape, batch_at):
        """A draft tree of `shape` (online_spec/tree.py: `TreeShape`), all on the device with no
        read-back: the `topk` best tokens of `logits` [B, Vd] (the head's output at each row's last
        committed position, `hidden` [B, H] beside it) are depth 1; each later step runs `step` over
        the `topk` frontier nodes of every request, written to the cache's scratch rows base[b] +
        (i - 1) * topk + j past the committed rows (base [B], a device tensor), roped at base + i - 1,
        each seeing the committed rows and its own ancestors (`batch_at(write, positions, visible)`
        gives the attention batch), and keeps the `topk` best children (summed draft
        log-probability) as the next frontier. `select_nodes` keeps the best `num_draft_tokens - 1`
        candidates under root [B] (the last committed token). -> (tokens, parents, depth, probs,
        visible) as `select_nodes` gives them. The engine runs it eagerly, or on a GPU captured as
        one CUDA graph (serving/cuda_tree.py)."""
        B, k, d2t = logits.shape[0], shape.topk, self.draft_to_target
        dev = logits.device
        S = max(shape.scratch_rows, 1)
        top_lp, top_id = torch.log_softmax(logits.float(), -1).topk(k, -1)  # [B, k] depth-1 candidates
        ar_k = torch.arange(k, device=dev)
        toks, pars, scores, lps = [top_id], [torch.full((B, k), -1, dtype=torch.long, device=dev)], [top_lp], [top_lp]
        front_tok, front_score, front_cid = top_id, top_lp, ar_k.expand(B, k)
        front_hidden = hidden[:, None].expand(B, k, hidden.shape[-1])
        front_vis = torch.zeros(B, k, S, dtype=torch.bool, device=dev)
        n_cand = k
        for i in range(1, shape.num_steps):
            w = (i - 1) * k  # the frontier's scratch rows
            # each frontier node sees its own row (a scatter of a scalar: no host tensor in a graph)
            vis = front_vis.scatter(2, (w + ar_k).view(1, k, 1).expand(B, k, 1), True)
            batch = batch_at(base[:, None] + w + ar_k, (base + i - 1)[:, None].expand(B, k), vis)
            lg, hid = self.step(embed(d2t[front_tok]), front_hidden, batch, cache, rope)  # [B,k,Vd], [B,k,H]
            c_lp, c_id = wide_topk(torch.log_softmax(lg.float(), -1), k)  # [B, k, k]
            c_score = (front_score[:, :, None] + c_lp).reshape(B, k * k)
            c_id = c_id.reshape(B, k * k)
            toks.append(c_id)
            pars.append(front_cid[:, :, None].expand(B, k, k).reshape(B, k * k))
            scores.append(c_score)
            lps.append(c_lp.reshape(B, k * k))
            if i + 1 < shape.num_steps:
                front_score, best = c_score.topk(k, -1)  # [B, k] the next frontier
                par = best // k
                front_tok = c_id.gather(1, best)
                front_hidden = hid.gather(1, par[:, :, None].expand(B, k, hid.shape[-1]))
                front_vis = vis.gather(1, par[:, :, None].expand(B, k, vis.shape[-1]))
                front_cid = n_cand + best
            n_cand += k * k
        return select_nodes(d2t[torch.cat(toks, 1)], torch.cat(pars, 1), torch.cat(scores, 1),
                            torch.cat(lps, 1).exp(), root, shape.num_draft_tokens, shape.num_steps)


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int,
                    always: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target tokens (plus `always`, e.g. EOS) -> (d2t, t2d).

    Draft ids are the chosen target ids in increasing order, so d2t[i] = target_id[i] - i.
    """
    vocab = token_counts.numel()
    counts = token_counts.double().clone()
    for t in always:
        counts[t] = float("inf")
    chosen = torch.topk(counts, draft_vocab_size).indices.sort().values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def new_head(target, draft_vocab_size: int = 8192, token_counts: torch.Tensor | None = None,
             seed: int = 0) -> EagleHead:
    """A randomly initialised (day-0) head for `target`, vocab map from token counts."""
    cfg = HeadConfig.for_target(target.info, draft_vocab_size)
    head = EagleHead(cfg).init_weights(seed)
    if token_counts is None:
        token_counts = torch.zeros(cfg.vocab_size)
        token_counts[: cfg.draft_vocab_size] = 1
    d2t, t2d = build_vocab_map(token_counts, cfg.draft_vocab_size, sorted(target.eos_token_ids))
    head.set_vocab_map(d2t, t2d)
    return head.to(dtype=target.dtype, device=target.device)
