"""`OnlineSpecAdaptiveParams`: online-spec's `EmaTierPolicy` behind SGLang's adaptive-params interface.

SGLang 0.5.23's EAGLE worker (`speculative/eagle_worker_v2.py`) builds
`AdaptiveSpeculativeParams(initial_steps=..., cfg_path=...)` and its `AdaptiveController`
(`speculative/adaptive_runtime_state.py`) calls `set_cuda_graph_bs`, `candidate_steps`,
`cuda_graph_bs_for_step`, `get_steps_for_batch` and `on_verify_complete`. This class offers the
same five, reads the same JSON file (SGLang's format, `online_spec.controller.config`) and makes
every decision with `EmaTierPolicy`; routing a batch size to a slot pads it to the CUDA-graph
batch size first, as SGLang does. The plugin installs it with a class REPLACE hook and calls
`rewarm()` on every live instance when a new draft head is loaded. No SGLang import here.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Callable

from online_spec.controller.config import AdaptiveConfig, load_adaptive_config
from online_spec.controller.ema import EmaTierPolicy

# Every instance alive in this process, so a weight update can re-warm them all.
LIVE_POLICIES: "weakref.WeakSet[OnlineSpecAdaptiveParams]" = weakref.WeakSet()


class OnlineSpecAdaptiveParams:
    """SGLang's `AdaptiveSpeculativeParams` interface, decided by `EmaTierPolicy`."""

    # Set by the plugin: SGLang's DEFAULT_ADAPTIVE_CONFIG, used when cfg_path is None (as SGLang does).
    default_config: Callable[[], dict] | None = None

    def __init__(self, initial_steps: int, cfg_path: str | None = None):
        if cfg_path is not None:
            config = load_adaptive_config(cfg_path)
        elif self.default_config is not None:
            config = AdaptiveConfig.from_dict(type(self).default_config())
        else:
            raise ValueError("cfg_path is None and no default adaptive config was provided")
        # SGLang keeps a K outside a slot's tiers per slot (its middle tier); EmaTierPolicy does too.
        self.policy = EmaTierPolicy(config, initial_steps if initial_steps in config.candidate_steps else None)
        self._cuda_graph_bs: list[int] | None = None
        LIVE_POLICIES.add(self)

    @property
    def candidate_steps(self) -> list[int]:
        return self.policy.candidate_steps

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self.policy.steps_for(self._pad(batch_size))

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        """Feed one verify round; the new K if it changed, else None (SGLang's contract)."""
        padded = self._pad(batch_size)
        before = self.policy.steps_for(padded)
        after = self.policy.update(padded, list(num_correct_drafts_per_req))
        return after if after != before else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        if self._cuda_graph_bs is None:
            return None
        cfg = self.policy.config
        return [bs for bs in self._cuda_graph_bs if step in cfg.slot_for(bs).candidate_steps]

    def rewarm(self) -> None:
        """A new head went live: forget its acceptance history (keeps each slot's K)."""
        self.policy.rewarm()

    def _pad(self, batch_size: int) -> int:
        if self._cuda_graph_bs is None:
            return batch_size
        i = bisect.bisect_left(self._cuda_graph_bs, batch_size)
        return self._cuda_graph_bs[i] if i < len(self._cuda_graph_bs) else batch_size
