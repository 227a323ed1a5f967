"""Adaptive step controller: policies that pick K (draft steps) per speculative round.

- `config`: SGLang's adaptive JSON (batch-size slots of K tiers), read unchanged and validated.
- `ema`: `EmaTierPolicy`, SGLang's EMA tier policy, decision for decision.
- `cost`: `CostModelPolicy`, K maximizing expected committed tokens per predicted second, with
  in-round early stop and per-request verify lengths; it joins
  - `round_time`: `CostModel`, the predicted seconds of a round (calibrated, refined online), and
  - `acceptance`: `AcceptanceEstimate` and `ConfidenceCalibrator`, the expected accepted drafts
    of K (also the swap gate's arithmetic).
- `plan`: `BatchPlan`, the cost policy's decisions for one batch size as an immutable snapshot,
  and the in-round rules both run (`continue_on`, `verify_cut`); serving/policy_planner.py
  builds plans on a worker thread.
- `static`: `StaticSteps`, K fixed (baselines).
- `base`: the `StepPolicy` protocol every policy implements (what the engine and server may call,
  the optional in-round capabilities declared by `early_stop` / `truncates`), `StepPolicyBase`
  (their absent forms), `measure_decision_cost_us` (a hot loop) and `TimedPolicy` (the same calls
  timed inside the engine's rounds).
- `replay`: `online-spec controller replay` and the `TraceRecorder` the engine writes rounds with.

Policies are pure (no I/O, no torch): the engine calls `steps_for` before drafting, `update`
after verify and `rewarm` when a new head goes live. See docs/controller.md.
"""

from online_spec.controller.base import (StepPolicy, StepPolicyBase, TimedPolicy, check_policy,
                                         measure_decision_cost_us)
from online_spec.controller.config import (AdaptiveConfig, SlotConfig, adaptive_config_path, configs_dir,
                                           load_adaptive_config)
from online_spec.controller.cost import CostModelPolicy, CostPolicyConfig
from online_spec.controller.round_time import CostModel, CostModelConfig
from online_spec.controller.ema import EmaTierPolicy
from online_spec.controller.static import StaticSteps

__all__ = ["StaticSteps", "AdaptiveConfig", "SlotConfig", "StepPolicy", "EmaTierPolicy", "CostModel", "CostModelConfig",
           "CostModelPolicy", "CostPolicyConfig", "adaptive_config_path", "configs_dir", "load_adaptive_config",
           "TimedPolicy", "measure_decision_cost_us", "StepPolicyBase", "check_policy"]
