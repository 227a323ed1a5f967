"""SGLang's adaptive-speculation JSON config, read unchanged into typed slots.

The file maps batch-size lower bounds (integer keys, strings in JSON) to slot objects; any
other key is a global default for every slot, and a slot may override it:

    {"ema_alpha": 0.2, "warmup_batches": 10, "update_interval": 5,
     "1": {"candidate_steps": [1, 3, 7], "down_hysteresis": -0.25},
     "8": {"candidate_steps": [0, 1, 3], "ceiling_coeff": 3.0}}

`candidate_steps` (K tiers, 0 = plain decode) is required in every slot; the other fields
default as in SGLang (`sglang.srt.speculative.adaptive_spec_params`). A batch of size b is
routed to the slot with the largest key <= b; a batch smaller than every key goes to the
smallest slot, as SGLang does. Validation is stricter than SGLang's (unknown keys, bad types
and out-of-range values are refused) and every error names the bad key or field.

`load_adaptive_config(path)` reads a file, `AdaptiveConfig.from_dict` a parsed object,
`adaptive_config_path("sglang_default")` finds a shipped preset under `configs/adaptive/`.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from online_spec.config import ConfigError, check, doc
from online_spec.tree import TreeShape

DEFAULT_CONFIG_NAME = "sglang_default"


def configs_dir() -> Path:
    """The repository's `configs/` directory (repo-relative, not installed package data)."""
    return Path(__file__).resolve().parents[2] / "configs"


def adaptive_config_path(name: str = DEFAULT_CONFIG_NAME) -> Path:
    """Path of a shipped adaptive preset, e.g. "sglang_default" or "aggressive"."""
    return configs_dir() / "adaptive" / f"{name}.json"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size slot: its K tiers and the EMA policy's knobs (SGLang's defaults)."""

    min_batch_size: int = doc("smallest batch size routed to this slot (the JSON key)")
    candidate_steps: tuple[int, ...] = doc("K tiers to choose from, sorted and unique; 0 = plain decode")
    ema_alpha: float = doc("EMA smoothing factor for accepted drafts per request", 0.2)
    warmup_batches: int = doc("verify rounds observed before the first decision", 10)
    update_interval: int = doc("rounds between decisions after warmup", 5)
    down_hysteresis: float = doc("margin added to the step-down threshold (negative = stickier)", -0.25)
    up_hysteresis: float = doc("margin added to the step-up threshold (positive = stickier)", 0.0)
    ceiling_coeff: float = doc("cap holds and down-moves at ceil(EMA * coeff); 0 = off", 0.0)
    tree_candidates: tuple = doc("our extension (SGLang's parser ignores it): draft trees "
                                 "[num_steps, topk, num_draft_tokens] the cost policy may run instead of a chain", ())

    def __post_init__(self) -> None:
        name = f'slots["{self.min_batch_size}"]'
        check(_is_int(self.min_batch_size) and self.min_batch_size >= 0, f"{name}",
              f"batch-size key must be a non-negative integer, got {self.min_batch_size!r}")
        steps = self.candidate_steps
        check(isinstance(steps, (list, tuple)) and len(steps) > 0
              and all(_is_int(s) and s >= 0 for s in steps),
              f"{name}.candidate_steps", f"must be a non-empty list of non-negative ints, got {steps!r}")
        object.__setattr__(self, "candidate_steps", tuple(sorted(set(steps))))
        check(_is_number(self.ema_alpha) and 0 < self.ema_alpha <= 1, f"{name}.ema_alpha",
              f"must be a number in (0, 1], got {self.ema_alpha!r}")
        check(_is_int(self.warmup_batches) and self.warmup_batches >= 0, f"{name}.warmup_batches",
              f"must be a non-negative int, got {self.warmup_batches!r}")
        check(_is_int(self.update_interval) and self.update_interval >= 1, f"{name}.update_interval",
              f"must be an int >= 1, got {self.update_interval!r}")
        for f in ("down_hysteresis", "up_hysteresis"):
            check(_is_number(getattr(self, f)), f"{name}.{f}", f"must be a finite number, got {getattr(self, f)!r}")
        check(_is_number(self.ceiling_coeff) and self.ceiling_coeff >= 0, f"{name}.ceiling_coeff",
              f"must be a number >= 0 (0 = off), got {self.ceiling_coeff!r}")
        trees = self.tree_candidates
        check(isinstance(trees, (list, tuple)) and all(isinstance(t, (list, tuple)) and len(t) == 3
                                                       and all(_is_int(x) for x in t) for t in trees),
              f"{name}.tree_candidates", f"must be a list of [num_steps, topk, num_draft_tokens], got {trees!r}")
        for t in trees:
            try:
                TreeShape(*t)
            except ConfigError as e:
                raise ConfigError(f"{name}.tree_candidates: {list(t)}: {e}") from None
        object.__setattr__(self, "tree_candidates", tuple(tuple(t) for t in trees))

    @property
    def trees(self) -> list[TreeShape]:
        return [TreeShape(*t) for t in self.tree_candidates]


# Keys a slot may set, and the subset that may also appear at top level as a global default.
SLOT_KEYS = tuple(f.name for f in fields(SlotConfig) if f.name != "min_batch_size")
GLOBAL_KEYS = tuple(k for k in SLOT_KEYS if k != "candidate_steps")


def _is_slot_key(key: str) -> bool:
    return key.isascii() and key.isdigit()


@dataclass(frozen=True)
class AdaptiveConfig:
    """All slots of one adaptive config, sorted by `min_batch_size`."""

    slots: tuple[SlotConfig, ...] = doc("the batch-size slots, ascending by key")

    def __post_init__(self) -> None:
        check(len(self.slots) > 0, "slots",
              'needs at least one integer batch-size key, e.g. {"1": {"candidate_steps": [1, 3, 7]}}')
        keys = [s.min_batch_size for s in self.slots]
        check(keys == sorted(set(keys)), "slots", f"batch-size keys must be unique and ascending, got {keys}")
        object.__setattr__(self, "_keys", keys)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "AdaptiveConfig":
        """Parse SGLang's JSON object (integer-string slot keys plus global defaults)."""
        check(isinstance(raw, Mapping), "adaptive config", f"must be a JSON object, got {type(raw).__name__}")
        globals_: dict[str, Any] = {}
        entries: dict[int, tuple[str, Mapping]] = {}
        for key, value in raw.items():
            if _is_slot_key(key):
                bs = int(key)
                if bs in entries:
                    raise ConfigError(f'slots["{key}"]: same batch size as slots["{entries[bs][0]}"]')
                check(isinstance(value, Mapping), f'slots["{key}"]', f"must be an object, got {value!r}")
                entries[bs] = (key, value)
            elif key == "candidate_steps":
                raise ConfigError("candidate_steps: belongs inside each integer batch-size slot "
                                  '(e.g. {"1": {"candidate_steps": [1, 3, 7]}}), not at top level')
            else:
                check(key in GLOBAL_KEYS, key, f"unknown key (globals: {', '.join(GLOBAL_KEYS)}; "
                      "slots: integer batch-size keys)")
                globals_[key] = value
        slots = []
        for bs, (key, entry) in sorted(entries.items()):
            for k in entry:
                check(k in SLOT_KEYS, f'slots["{key}"].{k}', f"unknown key (allowed: {', '.join(SLOT_KEYS)})")
            check("candidate_steps" in entry, f'slots["{key}"].candidate_steps', "is required in every slot")
            slots.append(SlotConfig(min_batch_size=bs, **{**globals_, **entry}))
        return cls(slots=tuple(slots))

    def to_dict(self) -> dict[str, dict]:
        """SGLang's JSON format, every field written out per slot."""
        def value(s, k):
            v = getattr(s, k)
            return list(v) if k == "candidate_steps" else [list(t) for t in v] if k == "tree_candidates" else v
        return {str(s.min_batch_size): {k: value(s, k) for k in SLOT_KEYS if k != "tree_candidates" or s.tree_candidates}
                for s in self.slots}

    @property
    def keys(self) -> list[int]:
        """Slot keys (batch-size lower bounds), ascending."""
        return list(self._keys)

    @property
    def candidate_steps(self) -> list[int]:
        """Union of every slot's tiers: the K values the engine must be able to run."""
        return sorted({k for s in self.slots for k in s.candidate_steps})

    def slot_index(self, batch_size: int) -> int:
        """Index of the slot with the largest key <= batch_size (the smallest slot if none)."""
        return max(0, bisect.bisect_right(self._keys, batch_size) - 1)

    def slot_for(self, batch_size: int) -> SlotConfig:
        return self.slots[self.slot_index(batch_size)]


def load_adaptive_config(path: str | Path) -> AdaptiveConfig:
    """Read and validate an adaptive JSON file; errors name the file and the bad key."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read adaptive config ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    try:
        return AdaptiveConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
