"""Which draft head a command starts from: the one rule every command and bench uses.

`--head` / `--draft` values:
- `shipped` (default of the benches and the demo): the ShareGPT chat head that ships with the
  package (online_spec/pretrained/sharegpt-chat-h100, trained on an H100 by scripts/gpu_pretrain.py
  with the project's own loss and data path on ShareGPT's chat conversations; its online_spec.json
  and README.md say how). The CPU here trains ~100-200 rows/s, far from the 33M row-steps that head
  saw, so a head built on this CPU is much weaker (docs/distill.md).
- `code`: the code head that ships with the package (online_spec/pretrained/code-h100: ShareGPT's
  code conversations and HumanEval's train tasks), the in-domain reference of `bench adapt`.
- `sharegpt`: a head pretrained on ShareGPT by `trainer.pretrain` on this machine, built on
  first use into ~/.cache/online-spec/heads/sharegpt-demo-N and reused (the console says how
  long the build takes).
- `day0` or empty: a random day-0 head (returned as "").
- a directory: a head checkpoint, or a pretrain run directory (its `head/`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import online_spec
from online_spec.config import ConfigError, check, config_to_dict

PRETRAINED = Path(online_spec.__file__).resolve().parent / "pretrained"  # the heads that ship with the package
SHIPPED_HEAD = PRETRAINED / "sharegpt-chat-h100"
CODE_HEAD = PRETRAINED / "code-h100"
PACKAGED = {"shipped": SHIPPED_HEAD, "code": CODE_HEAD}
HEAD_CHOICES = "shipped | code | sharegpt | day0 | a head checkpoint or pretrain run directory"


def resolve_head(name: str, target=None, head_tokens: int = 16_000) -> str:
    """Checkpoint directory for a `--head` value ("" = random day-0 head).

    `target` is needed only for `sharegpt`, which builds a head on this machine once."""
    if name in ("", "day0"):
        return ""
    if name in PACKAGED:
        if not (PACKAGED[name] / "config.json").exists():
            raise ConfigError(f"head: the {name} head is missing from {PACKAGED[name]} (a broken install?)")
        return str(PACKAGED[name])
    if name == "sharegpt":
        check(target is not None, "head", "building the sharegpt head needs the target model")
        return str(build_sharegpt_head(target, head_tokens))
    p = Path(name).expanduser()
    if (p / "head" / "config.json").exists():
        return str(p / "head")
    check((p / "config.json").exists(), "head",
          f"{name!r} is none of {HEAD_CHOICES} ({p} holds no config.json)")
    return str(p)


def cached_sharegpt_heads(min_tokens: int) -> list[tuple[int, Path]]:
    """Finished ShareGPT pretrain runs in the cache with at least `min_tokens`: [(tokens, head dir)]."""
    # torch comes with online_spec.target (and transformers with the trainer): resolving a packaged
    # head, what most commands do, needs neither
    from online_spec.target import cache_dir

    found = []
    for run in (cache_dir() / "heads").glob("sharegpt-*"):
        try:
            conf = json.loads((run / "run.json").read_text())["pretrain"]
        except (OSError, ValueError, KeyError):
            continue
        if (run / "eval.json").exists() and (run / "head" / "config.json").exists() and conf.get("data") == "sharegpt" \
                and conf.get("tokens", 0) >= min_tokens:
            found.append((int(conf["tokens"]), run / "head"))
    return sorted(found)


def build_sharegpt_head(target, tokens: int) -> Path:
    """The best finished ShareGPT head in ~/.cache/online-spec/heads with >= `tokens` training
    tokens; if none, pretrain ~/.cache/online-spec/heads/sharegpt-demo-N once (resumable)."""
    from online_spec.target import cache_dir
    from trainer.distill import DistillConfig
    from trainer.pretrain import PretrainConfig, load_configs, pretrain

    cached = cached_sharegpt_heads(tokens)
    if cached:
        print(f"head: {cached[-1][1]} ({cached[-1][0]} ShareGPT tokens, cached)", flush=True)
        return cached[-1][1]
    run = cache_dir() / "heads" / f"sharegpt-demo-{tokens}"
    print(f"head: pretraining a ShareGPT head on {tokens} tokens into {run} (once; about "
          f"{max(1, round(tokens / 4000))} min on 2 cores, rerun resumes) ...", flush=True)
    t0 = time.time()
    cfg = PretrainConfig(data="sharegpt", tokens=tokens, heldout_tokens=min(2000, tokens // 8), out=str(run),
                         batch_tokens=1024, eval_prompts=0)
    dcfg, lcfg = load_configs(cfg.config)
    # a short run: the default warmup (20 steps) would outlast it; a higher peak rate learns faster
    steps = max(1, tokens // cfg.batch_tokens)
    dcfg = DistillConfig(**{**config_to_dict(dcfg), "lr": 1e-3, "warmup_steps": max(1, steps // 10)})
    result = pretrain(cfg, dcfg, lcfg, target)
    sim = (result.get("simulated") or {}).get("accept_length")
    print(f"head: built in {time.time() - t0:.0f}s (simulated held-out accept length by K: {sim})", flush=True)
    return run / "head"
