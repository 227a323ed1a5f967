"""Head checkpoint codec (contract 3): SGLang's `LlamaForCausalLMEagle3` directory layout.

    DIR/config.json          architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                             eagle_config.eagle_aux_hidden_state_layer_ids, target_hidden_size,
                             rope fields equal to the target's
    DIR/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
                             (no embeddings: the target's are shared)
    DIR/online_spec.json     our metadata: version, sha256 digest of model.safetensors, parent

One codec for the trainer, the engine, the swap command and the SGLang plugin. Only safetensors
is ever read; a directory holding a pickle-format file is refused. Files are read only if they
are regular files (opened non-blocking and checked on the open descriptor: a FIFO or device
under a checkpoint's name is refused, never waited on) and no larger than `MAX_WEIGHTS_BYTES`
(`MAX_JSON_BYTES` for the JSON files); the digest is of the bytes parsed. `load_head` validates
everything (names, shapes, dtypes, finite values, vocabulary map, compatibility with the
target) before building a module and raises `CheckpointError` naming the first problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from transformers.activations import ACT2FN

from online_spec.head import EagleHead, HeadConfig

ARCH = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
META = "online_spec.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WEIGHTS_BYTES = 4 << 30  # model.safetensors; a 70B target's EAGLE-3 head is ~2 GB in bf16
MAX_JSON_BYTES = 1 << 20  # config.json, online_spec.json


class CheckpointError(ValueError):
    """A head checkpoint is invalid; the message names the problem."""


def head_config_json(cfg: HeadConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                         "use_aux_hidden_state": True},
    }


def head_config_from_json(d: dict) -> HeadConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"config.json must be a JSON object, got a {type(d).__name__}")
    if d.get("architectures") != [ARCH]:
        raise CheckpointError(f"config.json architectures is {d.get('architectures')}, expected [{ARCH!r}]")
    try:
        eagle = d.get("eagle_config") or {}
        cfg = HeadConfig(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
            vocab_size=int(d["vocab_size"]), draft_vocab_size=int(d["draft_vocab_size"]),
            rms_norm_eps=float(d["rms_norm_eps"]), rope_theta=float(d["rope_theta"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            aux_layer_ids=list(eagle.get("eagle_aux_hidden_state_layer_ids", [])),
            hidden_act=d.get("hidden_act", "silu"),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json misses field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise CheckpointError(f"config.json has a bad value: {e}") from None
    if not isinstance(cfg.hidden_act, str) or cfg.hidden_act not in ACT2FN:
        raise CheckpointError(f"config.json hidden_act {str(cfg.hidden_act)[:64]!r} is not an activation "
                              f"transformers knows (e.g. 'silu')")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in cfg.aux_layer_ids):
        raise CheckpointError("config.json eagle_aux_hidden_state_layer_ids must be a list of integers")
    return cfg


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    h, nh, kvh, hd, it = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                          cfg.head_dim, cfg.intermediate_size)
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.mlp.gate_proj.weight": (it, h),
        "midlayer.mlp.up_proj.weight": (it, h),
        "midlayer.mlp.down_proj.weight": (h, it),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def head_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (contiguous, CPU), names exactly as SGLang expects."""
    sd = head.state_dict()
    return {k: sd[k].detach().to("cpu").contiguous() for k in expected_shapes(head.cfg)}


def save_head(head: EagleHead, out: str | Path, version: int = 0, parent: int | None = None,
              extra: dict | None = None) -> str:
    """Write `head` atomically to directory `out` (write to a temp dir, then rename); return digest."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = head_tensors(head)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(head_config_json(head.cfg, head.fc.weight.dtype), indent=2))
    digest = file_digest(tmp / WEIGHTS)
    meta = {"version": version, "digest": digest, "parent": parent, **(extra or {})}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return digest


def validate_tensors(cfg: HeadConfig, tensors: dict[str, torch.Tensor],
                     expect_vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Names, shapes, dtypes, finite values and the vocabulary map; raises CheckpointError."""
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing:
        raise CheckpointError(f"missing tensors: {missing}")
    if extra:
        raise CheckpointError(f"unexpected tensors: {extra}")
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if name == "d2t":
            if t.dtype not in (torch.int64, torch.int32):
                raise CheckpointError(f"d2t has dtype {t.dtype}, expected int64")
        elif name == "t2d":
            if t.dtype != torch.bool:
                raise CheckpointError(f"t2d has dtype {t.dtype}, expected bool")
        else:
            if t.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{name} has dtype {t.dtype}, expected a float dtype")
            if not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{name} has non-finite values")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"]
    ids = torch.arange(cfg.draft_vocab_size) + d2t
    if bool((ids < 0).any()) or bool((ids >= cfg.vocab_size).any()):
        raise CheckpointError("d2t maps draft ids outside the target vocabulary")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[ids].all()):
        raise CheckpointError("t2d does not mark exactly the target ids of d2t")
    if expect_vocab is not None:
        if not same_vocab_map((d2t, t2d), expect_vocab):
            raise CheckpointError("draft vocabulary map differs from the live head's")


def same_vocab_map(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two (d2t, t2d) vocabulary maps are the same map."""
    return (a[0].shape == b[0].shape and a[1].shape == b[1].shape
            and torch.equal(a[0].long().cpu(), b[0].long().cpu()) and torch.equal(a[1].cpu(), b[1].cpu()))


def check_compatible(cfg: HeadConfig, target_info) -> None:
    """The head fits this target: hidden size, vocab, rope, captured layers."""
    t = target_info
    problems = []
    if cfg.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden {t.hidden_size}")
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab {t.vocab_size}")
    if abs(cfg.rope_theta - t.rope_theta) > 1e-6 * t.rope_theta:
        problems.append(f"rope_theta {cfg.rope_theta} != target's {t.rope_theta}")
    if list(cfg.aux_layer_ids) != list(t.aux_layer_ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} != {list(t.aux_layer_ids)}")
    if cfg.head_dim != t.head_dim:
        problems.append(f"head_dim {cfg.head_dim} != target head_dim {t.head_dim}")
    if problems:
        raise CheckpointError("; ".join(problems))


@dataclass
class Checkpoint:
    """What `open_checkpoint` read: config, tensors, metadata and the sha256 of the weights' bytes."""

    cfg: HeadConfig
    tensors: dict[str, torch.Tensor]
    meta: dict
    digest: str


CHECKPOINT_FILES = ("config.json", WEIGHTS, META)


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `max_bytes`, else CheckpointError.
    Opened non-blocking and checked on the descriptor, so a FIFO, socket or device under that name
    is refused at once (a blocking open of a FIFO waits for a writer forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"cannot open {path.name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path.name} is not a regular file")
        if st.st_size > max_bytes:
            raise CheckpointError(f"{path.name} is {st.st_size} bytes, more than the {max_bytes} allowed")
        chunks, got = [], 0
        while got <= max_bytes:  # to the end of the file, even if it grew since fstat
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise CheckpointError(f"{path.name} grew past the {max_bytes} bytes allowed while being read")
        return b"".join(chunks)
    except OSError as e:
        raise CheckpointError(f"cannot read {path.name}: {e.strerror}") from None
    finally:
        os.close(fd)


def _read_json(path: Path) -> object:
    try:
        return json.loads(read_regular_file(path, MAX_JSON_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}") from None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read config, tensors and metadata of a checkpoint directory without trusting them."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"refusing pickle-format files {pickles}: only safetensors is read")
    cfg_path, w_path = path / "config.json", path / WEIGHTS
    if not cfg_path.exists():
        raise CheckpointError(f"{path} has no config.json")
    if not w_path.exists():
        raise CheckpointError(f"{path} has no {WEIGHTS}")
    cfg = head_config_from_json(_read_json(cfg_path))
    blob = read_regular_file(w_path, MAX_WEIGHTS_BYTES)
    try:
        tensors = load_safetensors(blob)
    except Exception as e:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"{WEIGHTS} is not a valid safetensors file: {e}") from None
    digest = hashlib.sha256(blob).hexdigest()
    meta = {}
    if (path / META).exists():
        meta = _read_json(path / META)
        if not isinstance(meta, dict):
            raise CheckpointError(f"{META} must be a JSON object, got a {type(meta).__name__}")
        if "digest" in meta and meta["digest"] != digest:
            raise CheckpointError(f"digest mismatch: {WEIGHTS} does not match {META}")
    return Checkpoint(cfg, tensors, meta, digest)


def read_checkpoint(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor], dict]:
    """(config, tensors, metadata) of a checkpoint directory (`open_checkpoint`)."""
    ck = open_checkpoint(path)
    return ck.cfg, ck.tensors, ck.meta


def build_head(cfg: HeadConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               device: str | torch.device = "cpu") -> EagleHead:
    head = EagleHead(cfg)
    sd = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    head.load_state_dict(sd, strict=False)
    head.set_vocab_map(tensors["d2t"].long(), tensors["t2d"])
    return head.to(dtype=dtype, device=device).eval()


def load_head(path: str | Path, target_info=None, dtype: torch.dtype | None = None,
              device: str | torch.device = "cpu",
              expect_vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[EagleHead, dict]:
    """Validate and load a checkpoint directory -> (head, metadata). Raises CheckpointError."""
    cfg, tensors, meta = read_checkpoint(path)
    validate_tensors(cfg, tensors, expect_vocab)
    if target_info is not None:
        check_compatible(cfg, target_info)
    dtype = dtype or tensors["fc.weight"].dtype
    return build_head(cfg, tensors, dtype, device), meta


def config_dict(cfg: HeadConfig) -> dict:
    return asdict(cfg)
