"""The trainer daemon's settings (`DaemonConfig`, flags of `online-spec train`): its run
directory, batch and evaluation cadence, duty cycle and drift boost; trainer/daemon.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from online_spec.config import check, doc

GPU_SERVING_BUDGET = 0.03  # `--serving-budget`'s default on a GPU: the issue's "within a few percent"


@dataclass
class DaemonConfig:
    run_dir: str = doc("run directory: state, optimizer, replay buffer, published checkpoints", "runs/trainer")
    init_head: str = doc("head checkpoint to start from (the server's live head); empty = random day-0 head", "")
    batch_tokens: int = doc("rows of traffic per training step", 512)
    min_buffer_tokens: int = doc("rows the buffer must hold before training starts", 256)
    eval_every_steps: int = doc("evaluate the candidate every N optimizer steps", 20)
    eval_every_s: float = doc("... or every T seconds, whichever comes first (not while training is futile: "
                              "then every N steps alone)", 60.0)
    eval_tokens: int = doc("held-out rows the gate evaluates on: the newest held-out requests serving drafted on, "
                           "each with its prompt (the head's context) and at most --eval-generated-rows "
                           "generated rows, whose drafts alone are scored (what serving drafts on; prompt rows "
                           "would count user text the engine never drafts)", 1024)
    eval_generated_rows: int = doc("most generated rows one held-out request gives the gate sample, so that a "
                                   "long generation does not fill it alone", 128)
    eval_max_steps: int = doc("most draft steps simulated by the gate (it scores only as deep as the server's K mix "
                              "drafts, trainer/gate.k_mix_depth)", 7)
    save_every_steps: int = doc("save the resumable state every N steps", 10)
    idle_sleep_s: float = doc("sleep when there is nothing to train on", 0.2)
    max_duty: float = doc("share of wall time spent training and evaluating (1 = back to back): "
                          "after each step it rests busy * (1 / max_duty - 1) seconds, leaving the rest of its "
                          "core or GPU time to the server it shares the machine with", 1.0)
    idle_duty: float = doc("duty while the server is idle; the duty cycle while the server's control `info` (read "
                           "every 0.5-2 s) shows no running or waiting request: lulls go to training; --max-duty "
                           "while it serves", 1.0)
    futile_evals: int = doc("refusals in a row: futile; after this many gate evaluations in a row refused the "
                            "candidate while the server serves, train at --futile-scale of --max-duty: the live head "
                            "is as good as training makes it, so the server gets the core or GPU time back; the full "
                            "duty returns at the next publish, drift alert or head change; 0 = never", 3)
    futile_scale: float = doc("futile duty / --max-duty; the duty while training is futile, as a fraction of "
                              "--max-duty", 0.2)
    serving_budget: float | None = doc("share of serving tokens/s training may cost; the trainer's "
                                       "duty is capped by the server's measured slowdown while it "
                                       "steps (control round_clock, trainer/slack.py); default 0.03 on a GPU, "
                                       "where the two processes time-slice the device, off (0) on a CPU", None)
    drift_boost_s: float = doc("after a drift alert, evaluate every step for this long", 120.0)
    specialise: bool = doc("skip the gate's per-tag check on tags the server's head bank holds another head for, "
                           "so the live head may specialise on the traffic of now (the bank brings the other head "
                           "back when its traffic returns); off: every published head keeps every stored tag's "
                           "acceptance", False)

    def __post_init__(self):
        check(self.batch_tokens >= 1, "batch_tokens", "must be >= 1")
        check(self.eval_every_steps >= 1, "eval_every_steps", "must be >= 1")
        check(self.eval_every_s > 0, "eval_every_s", "must be > 0")
        check(self.eval_tokens >= 1, "eval_tokens", "must be >= 1")
        check(self.eval_generated_rows >= 1, "eval_generated_rows", "must be >= 1")
        check(self.save_every_steps >= 1, "save_every_steps", "must be >= 1")
        check(0.0 < self.max_duty <= 1.0, "max_duty", f"must be in (0, 1], got {self.max_duty!r}")
        check(0.0 < self.idle_duty <= 1.0, "idle_duty", f"must be in (0, 1], got {self.idle_duty!r}")
        check(self.futile_evals >= 0, "futile_evals", f"must be >= 0, got {self.futile_evals!r}")
        check(self.serving_budget is None or 0.0 <= self.serving_budget < 1.0, "serving_budget",
              f"must be in [0, 1), got {self.serving_budget!r}")
        check(0.0 < self.futile_scale <= 1.0, "futile_scale", f"must be in (0, 1], got {self.futile_scale!r}")

    def budget_on(self, device_type: str) -> float:
        """The serving budget on a trainer device of `device_type` ("cuda", "cpu", ...)."""
        if self.serving_budget is not None:
            return self.serving_budget
        return GPU_SERVING_BUDGET if device_type == "cuda" else 0.0
