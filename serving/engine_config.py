"""The embedded engine's settings (`EngineConfig`): batch and length limits, K, the tree shape
(SGLang's flags), CUDA graphs, the queue, staged swaps, the policy's in-round cuts and the
engine thread's CPU core. `serve` derives its engine flags from these fields; serving/engine.py
runs them.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from online_spec.config import ConfigError, check, doc
from online_spec.cpu_reserve import CpuReserve
from online_spec.tree import TreeShape


CAPTURE_SENDERS = ("thread", "engine", "process")  # `capture_sender`: where the capture is encoded and sent


@dataclass
class EngineConfig:
    max_batch: int = doc("requests decoded together; more wait in the queue", 16)
    max_len: int = doc("longest sequence (prompt + output) per request, in tokens", 2048)
    max_steps: int = doc("largest number of draft steps K per round", 7)
    num_steps: int = doc("K per round when no adaptive policy is attached (0 = plain decode); with "
                         "speculative_eagle_topk > 1, the tree's depth", 3)
    speculative_eagle_topk: int = doc("branching of the draft tree (SGLang's --speculative-eagle-topk); "
                                      "1 = a chain", 1)
    speculative_num_draft_tokens: int = doc("tokens verified per request in a tree round, the root included "
                                            "(SGLang's --speculative-num-draft-tokens); 0 = num_steps + 1, "
                                            "the chain's", 0)
    cuda_graphs: bool = doc("on a CUDA device, replay CUDA graphs for the decode/verify/draft shapes "
                            "(serving/cuda_graphs.py); ignored on CPU", True)
    graph_warmup: bool = doc("with cuda_graphs on a CUDA device, the server captures every chain round's graphs "
                             "(each batch bucket, K = 0..max_steps, the live and the spare draft cache) when it "
                             "starts, before serving, instead of inside the first rounds that need them", True)
    max_queue: int = doc("requests waiting beyond max_batch before add_request refuses", 1024)
    swap_fill_rows: int = doc("rows of a new head's draft cache rebuilt per round before a swap switches "
                              "(0 = switch at once and rebuild every row on the next draft)", 48)
    swap_fill_share: float = doc("on a CPU, a round's fill may rebuild more than swap_fill_rows rows: as many "
                                 "as take this share of a round, by the fill's measured seconds a row and the "
                                 "last round's (a CPU round takes 100-400 ms, a row ~30 us: a swap lands in a "
                                 "round or two, not in tens); 0 = swap_fill_rows alone (on a GPU always)", 0.1)
    in_round_cuts: str = doc("the policy's in-round early stop and verify-length cut (where it has them): on, "
                             "off, or auto = on a CPU in rounds of up to cuts_max_batch requests, off on a CUDA "
                             "device. Each early-stop check reads the step's draft back to the host; without them a "
                             "greedy batch drafts its K steps on the device, read back once a round (with CUDA "
                             "graphs: one graph). On an H100 a verify of 2-6 tokens costs about one of 1, so the "
                             "cuts save little there: the cost policy served 303 tok/s at batch 1 with them off, "
                             "251 with them on", "auto")
    cuts_max_batch: int = doc("under in_round_cuts auto on a CPU, the largest batch whose rounds ask the cuts. On "
                              "three CPUs (`bench cuts`) they paid at batch 1 or 4 in some runs and never at 16 "
                              "(on / off 0.89-1.02), where they cost the engine's thread ~65 us a round", 4)
    host_windows: str = doc("place the capture sender's and the cost policy planner's Python in the moments the "
                            "engine's thread waits on the device (online_spec/host_window.py): on, off, or auto = "
                            "on a CUDA device only (a CPU engine's read-backs do not wait)", "auto")
    capture_sender: str = doc("where the engine's capture is encoded and sent: 'thread' (on a GPU the "
                              "publisher's sender thread, in the host windows; on a CPU the engine's thread between "
                              "forwards) or 'engine' (the engine's own thread just before its verify read-back, on a "
                              "GPU while the device verifies: no second thread takes turns with it on the "
                              "interpreter lock) or 'process' (a child process encodes and sends, reading the rows "
                              "from shared host slots the engine copies into: collector/process_publisher.py)",
                              "thread")
    reserve_cpu: str = doc("keep one CPU core for the engine's thread (online_spec/cpu_reserve.py): its thread "
                           "pinned to one CPU, every other thread of the server and its child processes (capture "
                           "sender, ZMQ I/O, planner) moved off that core every 0.2 s: off, a CPU number, or "
                           "auto = the highest-numbered CPU on a CUDA device when the process may use 4 CPUs or "
                           "more, else off (a CPU engine's torch threads need every core). Off by default: on an "
                           "H200 the OS already kept busy threads off the engine's CPU, and capture cost the same "
                           "with the reserve as without (docs/engine.md)", "off")

    def __post_init__(self):
        check(self.max_batch >= 1, "max_batch", "must be >= 1")
        check(self.max_steps >= 0, "max_steps", "must be >= 0")
        check(0 <= self.num_steps <= self.max_steps, "num_steps", f"must be in 0..max_steps={self.max_steps}")
        check(self.max_len >= 16, "max_len", "must be >= 16")
        check(self.max_queue >= 0, "max_queue", "must be >= 0")
        check(self.swap_fill_rows >= 0, "swap_fill_rows", "must be >= 0")
        check(0.0 <= self.swap_fill_share < 1.0, "swap_fill_share", f"must be in [0, 1), got {self.swap_fill_share!r}")
        check(self.in_round_cuts in ("auto", "on", "off"), "in_round_cuts",
              f"must be auto, on or off, got {self.in_round_cuts!r}")
        check(isinstance(self.cuts_max_batch, int) and self.cuts_max_batch >= 0, "cuts_max_batch",
              f"must be an int >= 0, got {self.cuts_max_batch!r}")
        check(self.host_windows in ("auto", "on", "off"), "host_windows",
              f"must be auto, on or off, got {self.host_windows!r}")
        check(self.capture_sender in CAPTURE_SENDERS, "capture_sender",
              f"must be one of {CAPTURE_SENDERS}, got {self.capture_sender!r}")
        check(self.reserve_cpu in ("off", "auto") or self.reserve_cpu.isdigit(), "reserve_cpu",
              f"must be off, auto or a CPU number, got {self.reserve_cpu!r}")
        check(isinstance(self.speculative_eagle_topk, int) and self.speculative_eagle_topk >= 1,
              "speculative_eagle_topk", f"must be an int >= 1, got {self.speculative_eagle_topk!r}")
        check(self.speculative_num_draft_tokens >= 0, "speculative_num_draft_tokens", "must be >= 0")
        if self.speculative_eagle_topk == 1:
            check(self.speculative_num_draft_tokens in (0, self.num_steps + 1), "speculative_num_draft_tokens",
                  f"a chain (speculative_eagle_topk 1) verifies num_steps + 1 = {self.num_steps + 1} tokens, "
                  f"got {self.speculative_num_draft_tokens}")
        elif self.max_steps > 0:
            self.tree_shape(self.max_steps)  # raises naming the bad field

    @property
    def tree(self) -> bool:
        """Rounds draft trees (topk > 1), not chains."""
        return self.speculative_eagle_topk > 1

    def tree_shape(self, num_steps: int) -> TreeShape:
        """The tree of a round at depth `num_steps` (num_draft_tokens cut to what it can draft)."""
        n = self.speculative_num_draft_tokens or num_steps + 1
        return TreeShape.capped(num_steps, self.speculative_eagle_topk, n)

    @property
    def reserve(self) -> int:
        """Cache rows a round may need beyond a request's committed ones (its largest shape)."""
        if self.tree and self.max_steps > 0:
            return max(self.max_steps, self.tree_shape(self.max_steps).footprint)
        return self.max_steps

    def windows_on(self, device: torch.device) -> bool:
        """Whether an engine on `device` opens host windows (`host_windows`)."""
        return self.host_windows == "on" or (self.host_windows == "auto" and device.type == "cuda")

    def cuts_up_to(self, device: torch.device) -> int:
        """The largest batch whose rounds on `device` ask the policy's in-round cuts (`in_round_cuts`,
        `cuts_max_batch`): 0 for none."""
        if self.in_round_cuts == "auto":
            return 0 if device.type == "cuda" else self.cuts_max_batch
        return self.max_batch if self.in_round_cuts == "on" else 0

    def cpu_reserve(self, device: torch.device, owner: object = None) -> CpuReserve | None:
        """The engine thread's `CpuReserve` on `device` (`reserve_cpu`), or None; closed when `owner`
        (the engine) is collected, if given."""
        if self.reserve_cpu == "off":
            return None
        if self.reserve_cpu == "auto":
            if device.type != "cuda" or len(os.sched_getaffinity(0)) < 4:
                return None
            reserve = CpuReserve()
        else:
            try:
                reserve = CpuReserve(int(self.reserve_cpu))
            except ValueError as e:
                raise ConfigError(f"reserve_cpu: {e}") from None
        if owner is not None:
            weakref.finalize(owner, reserve.close)
        return reserve
