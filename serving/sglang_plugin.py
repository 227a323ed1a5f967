"""SGLang plugin: capture, adaptive policy and head re-warm inside an unmodified SGLang server.

Registered under SGLang's general-plugin entry-point group `sglang.srt.plugins` (pyproject.toml,
name `online_spec`). SGLang 0.5.23's `sglang.srt.plugins.load_plugins()` calls `register()` with
no arguments in every process it starts (main, scheduler, detokenizer), then
`HookRegistry.apply_hooks()` patches the dotted targets registered here. Nothing happens unless
`ONLINE_SPEC_SGLANG=1`; an SGLang version not in `KNOWN_SGLANG_VERSIONS` is reported once (log
warning) and the plugin registers nothing.

Hooks (SGLang 0.5.23 names, `TARGETS`):
- `SchedulerBatchResultProcessor.process_batch_result_decode` / `..._prefill` (AROUND): after
  SGLang commits a verify round (or a prefill chunk), one `CaptureRecord` per sampled request
  from `result.logits_output.hidden_states` (EAGLE-3 target features, 3H: the target's verify
  forward captures them for the draft anyway) and `.last_hidden_states` (post-norm hidden, H).
  Rows are copied to CPU here and published by `CapturePublisher`; they never enter
  `req.hidden_states`, so nothing reaches the HTTP response and `--enable-return-hidden-states`
  is not needed. Positions come from SGLang's own bookkeeping: a prefill chunk starts at
  `req.prefix_len` (a prefix-cache hit or a skipped chunk makes first_pos jump: an explicit
  gap), a verify round at the last committed position.
- `LogitsProcessor._get_last_hidden_states_to_store` (AROUND): SGLang keeps the post-norm
  hidden only for `--enable-return-aux-hidden-states`; with capture on it is kept whenever aux
  features are captured in full mode. Chain drafting only (`--speculative-eagle-topk 1`):
  tree compaction moves `hidden_states` but not `last_hidden_states`, so a tree round's rows
  cannot be aligned at the hook; with capture on,
- `Scheduler.__init__` (AFTER) refuses a tree (`--speculative-eagle-topk` > 1) at start-up,
  saying why and what to change: never misaligned rows.
- `adaptive_spec_params.AdaptiveSpeculativeParams` (class REPLACE, `ONLINE_SPEC_SGLANG_POLICY=1`):
  `serving.sglang_adaptive.OnlineSpecAdaptiveParams`, same JSON file.
- `SchedulerWeightUpdaterManager.update_weights_from_tensor` (AFTER): a successful update of the
  draft re-warms every live policy.

Settings (`SglangPluginConfig.from_env`): ONLINE_SPEC_SGLANG, ONLINE_SPEC_SGLANG_POLICY,
ONLINE_SPEC_CAPTURE_ENDPOINT, ONLINE_SPEC_CAPTURE_FRACTION, ONLINE_SPEC_DRAFT_VERSION.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass

from online_spec.config import check, doc
from serving.sglang_adaptive import OnlineSpecAdaptiveParams

log = logging.getLogger(__name__)

KNOWN_SGLANG_VERSIONS = ("0.5.23",)
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
TARGETS = {
    "decode": f"{_BRP}.process_batch_result_decode",
    "prefill": f"{_BRP}.process_batch_result_prefill",
    "final_hidden": "sglang.srt.layers.logits_processor.LogitsProcessor._get_last_hidden_states_to_store",
    "policy": "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams",
    "weights": "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
               ".update_weights_from_tensor",
    "scheduler_init": "sglang.srt.managers.scheduler.Scheduler.__init__",
}


@dataclass
class SglangPluginConfig:
    enabled: bool = doc("ONLINE_SPEC_SGLANG=1: install the hooks; otherwise the plugin is a no-op", False)
    replace_policy: bool = doc("ONLINE_SPEC_SGLANG_POLICY=1: decide K with EmaTierPolicy", False)
    capture: bool = doc("ONLINE_SPEC_CAPTURE (default 1): publish capture records", True)
    endpoint: str = doc("ONLINE_SPEC_CAPTURE_ENDPOINT: ZMQ endpoint the publisher binds", "")
    sample_fraction: float = doc("ONLINE_SPEC_CAPTURE_FRACTION: fraction of requests captured", 1.0)
    draft_version: int = doc("ONLINE_SPEC_DRAFT_VERSION: version of the head SGLang starts with", 0)

    def __post_init__(self) -> None:
        check(0.0 <= self.sample_fraction <= 1.0, "sample_fraction", f"{self.sample_fraction} not in [0, 1]")

    @classmethod
    def from_env(cls, env=os.environ) -> "SglangPluginConfig":
        on = lambda name, default="0": env.get(name, default) == "1"  # noqa: E731
        return cls(enabled=on("ONLINE_SPEC_SGLANG"), replace_policy=on("ONLINE_SPEC_SGLANG_POLICY"),
                   capture=on("ONLINE_SPEC_CAPTURE", "1"), endpoint=env.get("ONLINE_SPEC_CAPTURE_ENDPOINT", ""),
                   sample_fraction=float(env.get("ONLINE_SPEC_CAPTURE_FRACTION", "1.0")),
                   draft_version=int(env.get("ONLINE_SPEC_DRAFT_VERSION", "0")))


def version_problem(version: str | None) -> str | None:
    """Why the plugin must stay off for this SGLang version, or None."""
    if version is None:
        return "sglang is not installed"
    if version not in KNOWN_SGLANG_VERSIONS:
        return (f"sglang {version} is not a version this plugin knows ({', '.join(KNOWN_SGLANG_VERSIONS)}); "
                "its hooks were not installed, the server runs without online-spec")
    return None


def register() -> list[str]:
    """SGLang entry point (`sglang.srt.plugins`). Returns the targets hooked (empty = no-op)."""
    cfg = SglangPluginConfig.from_env()
    if not cfg.enabled:
        return []
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    problem = version_problem(version)
    if problem:
        log.warning("online-spec SGLang plugin disabled: %s", problem)
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # torch comes with the capture hooks: every SGLang process imports this entry point, enabled or not
    from serving.sglang_capture import CaptureHooks

    hooks = CaptureHooks(cfg)
    chosen = []
    if cfg.capture:
        HookRegistry.register(TARGETS["decode"], hooks.around_decode, HookType.AROUND)
        HookRegistry.register(TARGETS["prefill"], hooks.around_prefill, HookType.AROUND)
        HookRegistry.register(TARGETS["final_hidden"], around_last_hidden, HookType.AROUND)
        HookRegistry.register(TARGETS["scheduler_init"], refuse_tree_capture, HookType.AFTER)
        chosen += [TARGETS["decode"], TARGETS["prefill"], TARGETS["final_hidden"], TARGETS["scheduler_init"]]
    if cfg.replace_policy:
        OnlineSpecAdaptiveParams.default_config = staticmethod(_sglang_default_adaptive_config)
        HookRegistry.register(TARGETS["policy"], OnlineSpecAdaptiveParams, HookType.REPLACE)
        chosen.append(TARGETS["policy"])
    HookRegistry.register(TARGETS["weights"], hooks.after_weight_update, HookType.AFTER)
    chosen.append(TARGETS["weights"])
    log.info("online-spec SGLang plugin: hooks on %s", ", ".join(chosen))
    return chosen


class TreeCaptureRefused(RuntimeError):
    """Capture was asked for beside SGLang's tree drafting, whose rows cannot be aligned."""


def refuse_tree_capture(result, self, server_args, *args, **kwargs):
    """After SGLang's scheduler is built: capture with a draft tree (topk > 1) is refused, since
    SGLang's tree verify compacts the accepted path in `hidden_states` but not in
    `last_hidden_states`, and a record of misaligned rows would teach the head wrong targets."""
    topk = getattr(server_args, "speculative_eagle_topk", None)  # SGLang's own optional field
    if topk not in (None, 1):
        raise TreeCaptureRefused(
            f"online-spec capture needs chain drafting (--speculative-eagle-topk 1), got {topk}: SGLang's tree "
            "verify keeps the accepted path's target features but not its post-norm hidden states, so captured "
            "rows would be misaligned. Serve with --speculative-eagle-topk 1, or set ONLINE_SPEC_CAPTURE=0 to "
            "keep the tree without capture.")
    return result


def around_last_hidden(original, self, hidden_states, aux_hidden_states, logits_metadata):
    """Keep the post-norm hidden (H) beside the aux features whenever those are captured in full."""
    out = original(self, hidden_states, aux_hidden_states, logits_metadata)
    if out is None and aux_hidden_states is not None and logits_metadata.capture_hidden_mode.is_full():
        return hidden_states
    return out


def _sglang_default_adaptive_config() -> dict:
    from sglang.srt.speculative.adaptive_spec_params import DEFAULT_ADAPTIVE_CONFIG

    return DEFAULT_ADAPTIVE_CONFIG
