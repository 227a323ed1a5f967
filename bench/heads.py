"""Which draft head a command starts from: the one rule every bench and the demo uses.

`--head` / `--draft` values: those of `online_spec.heads` (`shipped`, the default; `code`; `day0`
or empty; a head checkpoint or pretrain run directory), which `online-spec serve --draft` takes
too, plus
- `sharegpt`: a head pretrained on ShareGPT by `trainer.pretrain` on this machine, built on
  first use into ~/.cache/online-spec/heads/sharegpt-demo-N and reused (the console says how
  long the build takes). The CPU here trains ~100-200 rows/s, far from the 33M row-steps the
  shipped head saw, so a head built on this CPU is much weaker (docs/distill.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from online_spec.config import check, config_to_dict
from online_spec.heads import CODE_HEAD, PACKAGED, SHIPPED_HEAD, resolve_head_dir

__all__ = ["CODE_HEAD", "HEAD_CHOICES", "PACKAGED", "SHIPPED_HEAD", "resolve_head"]

HEAD_CHOICES = "shipped | code | sharegpt | day0 | a head checkpoint or pretrain run directory"


def resolve_head(name: str, target=None, head_tokens: int = 16_000) -> str:
    """Checkpoint directory for a `--head` value ("" = random day-0 head).

    `target` is needed only for `sharegpt`, which builds a head on this machine once."""
    if name == "sharegpt":
        check(target is not None, "head", "building the sharegpt head needs the target model")
        return str(build_sharegpt_head(target, head_tokens))
    return resolve_head_dir(name)


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
