"""The draft heads that ship with the package, and the rule that turns a head name into a directory.

Names (`online-spec serve --draft`, and every bench's and the demo's `--head` through bench/heads.py):
- `shipped`: the ShareGPT chat head, online_spec/pretrained/sharegpt-chat-h100 (trained on an H100
  by scripts/gpu_pretrain.py on ShareGPT's chat conversations; its online_spec.json and README.md
  say how). The default of `serve`, the benches and the demo.
- `code`: the code head, online_spec/pretrained/code-h100 (ShareGPT's code conversations and
  HumanEval's train tasks).
- `day0` (or empty): a random day-0 head, returned as "" (it accepts almost nothing).
- a directory: a head checkpoint (SGLang layout), or a pretrain run directory (its `head/`).
Both packaged heads fit SmolLM2-135M-Instruct, the default target.

    resolve_head_dir("shipped")   # -> ".../online_spec/pretrained/sharegpt-chat-h100"
    head, meta, path = load_draft("shipped", target)
    describe_head(path, meta)     # -> "shipped chat head .../sharegpt-chat-h100 (version 0, ...)"
"""

from __future__ import annotations

from pathlib import Path

from online_spec import PRETRAINED_HEADS
from online_spec.config import ConfigError, check

SHIPPED_HEAD = PRETRAINED_HEADS / "sharegpt-chat-h100"
CODE_HEAD = PRETRAINED_HEADS / "code-h100"
PACKAGED = {"shipped": SHIPPED_HEAD, "code": CODE_HEAD}
DAY0 = ("", "day0")
HEAD_NAMES = "shipped | code | day0 | a head checkpoint or pretrain run directory"


def resolve_head_dir(name: str, field: str = "head") -> str:
    """Checkpoint directory for a head name ("" = a random day-0 head); ConfigError naming
    `field` when the name is none of HEAD_NAMES."""
    if name in DAY0:
        return ""
    if name in PACKAGED:
        if not (PACKAGED[name] / "config.json").exists():
            raise ConfigError(f"{field}: the {name} head is missing from {PACKAGED[name]} (a broken install?)")
        return str(PACKAGED[name])
    p = Path(name).expanduser()
    if (p / "head" / "config.json").exists():
        return str(p / "head")
    check((p / "config.json").exists(), field, f"{name!r} is none of {HEAD_NAMES} ({p} holds no config.json)")
    return str(p)


def load_draft(name: str, target, dtype=None, field: str = "draft"):
    """(head, metadata, directory) for a head name on `target`: a random day-0 head (directory "")
    for `day0`. A packaged head that does not fit the target raises ConfigError saying what to
    pass instead."""
    # torch comes with these; resolving a name (every bench's --help) needs neither
    from online_spec.checkpoint import CheckpointError, load_head
    from online_spec.head import new_head

    path = resolve_head_dir(name, field)
    if not path:
        return new_head(target), {}, ""
    try:
        head, meta = load_head(path, target.info, dtype=dtype)
    except CheckpointError as e:
        if name not in PACKAGED:
            raise
        raise ConfigError(f"{field}: the {name} head was trained for SmolLM2-135M-Instruct and does not fit this "
                          f"target ({e}); pass --{field} with a head of this target, or --{field} day0") from None
    return head, meta, path


def describe_head(path: str, meta: dict | None = None) -> str:
    """One line for a start-up log: which head, where it lives, its version and provenance."""
    if not path:
        return ("a random day-0 head (--draft day0): it accepts almost nothing until a trained head is "
                f"swapped in; the shipped chat head is {SHIPPED_HEAD}")
    meta = meta or {}
    names = {p.resolve(): n for n, p in PACKAGED.items()}
    kind = {"shipped": "shipped chat head ", "code": "packaged code head "}.get(names.get(Path(path).resolve()), "")
    extra = f", {meta['trained_on']}" if meta.get("trained_on") else ""
    return f"{kind}{path} (version {meta.get('version', 0)}{extra})"
