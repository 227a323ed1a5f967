"""Adaptive step controller: policies that pick K (draft steps) per speculative round.

- `config`: SGLang's adaptive JSON (batch-size slots of K tiers), read unchanged and validated.
- `ema`: `EmaTierPolicy`, SGLang's EMA tier policy, decision for decision.
- `cost`: `CostModelPolicy`, K maximizing expected committed tokens per predicted second, with
  in-round early stop and per-request verify lengths.
- `base`: the `StepPolicy` protocol both implement and `measure_decision_cost_us`.
- `replay`: `online-spec controller replay` and the `TraceRecorder` the engine writes rounds with.

Policies are pure (no I/O, no torch): the engine calls `steps_for` before drafting, `update`
after verify and `rewarm` when a new head goes live. See docs/controller.md.
"""

from online_spec.controller.base import StepPolicy, measure_decision_cost_us
from online_spec.controller.config import (AdaptiveConfig, SlotConfig, adaptive_config_path, configs_dir,
                                           load_adaptive_config)
from online_spec.controller.cost import CostModel, CostModelConfig, CostModelPolicy, CostPolicyConfig
from online_spec.controller.ema import EmaTierPolicy

__all__ = ["AdaptiveConfig", "SlotConfig", "StepPolicy", "EmaTierPolicy", "CostModel", "CostModelConfig",
           "CostModelPolicy", "CostPolicyConfig", "adaptive_config_path", "configs_dir", "load_adaptive_config",
           "measure_decision_cost_us"]
