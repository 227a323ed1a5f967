"""Head swaps inside the engine: a new head goes live between rounds, never inside one.

`HeadSwapping` is the part of `Engine` (serving/engine.py) that installs heads. `swap_head`
(any thread) prepares the head in the engine's dtype and device and an empty draft cache; the
engine thread applies it at the start of its next round (`_apply_pending_swap`). With requests
running and `swap_fill_rows` > 0 the swap is staged: the new head's draft cache is rebuilt from
the stored features a bounded number of rows per round (K/V only, every slot's rows in one
call) while the old head keeps drafting, and the switch happens once every running slot is
within one round's catch-up. The bound is `swap_fill_rows`, or on a CPU, where the fill's time is
its host time, as many rows as take `swap_fill_share` of a round (`fill_budget`: the last fill's
seconds a row against the last round's seconds); on a GPU the fill's kernels run after their
launch, so its host time says nothing of its cost and the rows alone bound it. Drafts never
affect the output, so whichever head drafts a round, the output is the target's. The replaced
head's cache is kept as the spare for the next swap.

It reads the engine's state: `cfg`, `target`, `running`, `tcache`, `tok_buf`, `feat_buf`,
`graphs`, `policy`, `_lock`, and owns `head`, `head_version`, `dcache`, `_pending_swap`,
`_pending_policy`, `_staged`, `_spare_cache`, `_filled`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from online_spec.head import EagleHead
from online_spec.host_window import follow


@dataclass
class StagedHead:
    """A head waiting to go live while its draft cache is rebuilt."""

    head: EagleHead
    version: int
    cache: object
    row_s: float | None = None  # the last fill's host seconds a row
    last_t: float | None = None  # perf_counter at the last fill's round: the round's seconds are since then


def fill_budget(rows: int, share: float, round_s: float | None, row_s: float | None) -> int:
    """Rows a staged fill may rebuild this round: `rows`, or more where `share` of the last round's
    seconds `round_s` holds more at `row_s` seconds a row (both measured; None: not yet)."""
    if share <= 0 or not round_s or not row_s:
        return rows
    return max(rows, int(share * round_s / row_s))


class HeadSwapping:
    """Installing, staging and switching draft heads; mixed into `Engine`."""

    def swap_head(self, head: EagleHead | None, version: int) -> None:
        """Install `head` (already validated) before the next round. Thread-safe. Everything a
        staged swap needs (the head in the engine's dtype and device, an empty draft cache) is
        prepared here, on the caller's thread, so the engine thread only starts filling it."""
        staged = None
        if head is not None:
            head = head.to(dtype=self.target.dtype, device=self.target.device).eval()
            staged = StagedHead(head, version, self._staging_cache(head))
        with self._lock:
            replaced, self._pending_swap = self._pending_swap, (head, version, staged)
        if replaced is not None and replaced[2] is not None:
            self._recycle_cache(replaced[2].cache)

    def _apply_pending_swap(self) -> bool:
        with self._lock:
            pending, self._pending_swap = self._pending_swap, None
            policy, self._pending_policy = self._pending_policy, None
        if policy is not None:
            self.policy = policy
            follow(policy, self.window)
        self._filled = 0
        if pending is not None:
            head, version, staged = pending
            if self._staged is not None:  # superseded before it went live
                self._recycle_cache(self._staged.cache)
                self._staged = None
            if head is None or not self.running or self.cfg.swap_fill_rows == 0:
                if staged is not None:
                    self._recycle_cache(staged.cache)
                self._install_head(head, version)
                self.policy.rewarm()
                return True
            self._staged = staged
        return self._advance_staged()

    def _staging_cache(self, head: EagleHead):
        """An empty draft cache for a staged head: the spare (the cache of the head replaced by
        the last switch) when its shape fits, else a new one. Any thread."""
        with self._lock:
            cache, self._spare_cache = self._spare_cache, None
        c = head.cfg
        if cache is None or cache.k[0].dtype != self.target.dtype or tuple(cache.k[0].shape) != \
                (self.cfg.max_batch, c.num_key_value_heads, self.cfg.max_len, c.head_dim):
            cache = head.new_cache(self.cfg.max_batch, self.cfg.max_len)
        cache.lengths = [0] * self.cfg.max_batch
        return cache

    def _recycle_cache(self, cache) -> None:
        with self._lock:
            if self._spare_cache is None:
                self._spare_cache = cache

    def _advance_staged(self) -> bool:
        """Rebuild up to `fill_budget` rows of the staged cache; switch when it is caught up."""
        st = self._staged
        if st is None:
            return False
        now, timed = time.perf_counter(), self.target.device.type == "cpu"
        budget = fill_budget(self.cfg.swap_fill_rows, self.cfg.swap_fill_share if timed else 0.0,
                             None if st.last_t is None else now - st.last_t, st.row_s)
        st.last_t = now
        behind = False
        plan = []
        for b in range(len(self.running)):
            goal = self.tcache.lengths[b] - 1  # the last committed row is always recomputed
            have = st.cache.lengths[b]
            n = max(0, min(budget, goal - have))
            if n:
                plan.append((b, have, n))
                budget -= n
            behind = behind or goal - (have + n) > self.cfg.max_steps
        if plan:
            self._fill_slots(st.head, st.cache, plan)
            rows = sum(n for _, _, n in plan)
            self._filled += rows
            st.row_s = (time.perf_counter() - now) / rows
        if behind:
            return False
        self._staged = None
        old = self.dcache
        self.head, self.head_version, self.dcache = st.head, st.version, st.cache
        if self.graphs is not None:
            self.graphs.bind_head(st.head)  # weights into the captured graphs' module, in place
        self._recycle_cache(old)
        self.policy.rewarm()
        return True

    def _fill_slots(self, head: EagleHead, cache, plan: list[tuple[int, int, int]]) -> None:
        """K/V of rows start..start+n-1 of each (slot, start, n) in `plan` into `cache`, all in
        one head call: the rows of every slot are gathered into one sequence (a row's K/V depend
        only on its own inputs and position: `EagleHead.kv`) and scattered back."""
        dev = self.target.device
        slots = torch.tensor([b for b, _, n in plan for _ in range(n)])
        pos = torch.cat([torch.arange(start, start + n) for _, start, n in plan])
        emb = self.target.embed_tokens(self.tok_buf[slots, pos + 1][None].to(dev))  # row p reads token p+1
        hid = self.feat_buf[slots.to(dev), pos.to(dev)][None]  # ... and the features of p
        cos, sin = self.target.rope(pos[None].to(dev))
        with torch.inference_mode():
            k, v = head.kv(emb, hid, cos.squeeze(1), sin.squeeze(1))  # [1, kvh, N, hd]
        s_dev, p_dev = slots.to(dev), pos.to(dev)
        cache.k[0][s_dev, :, p_dev] = k[0].transpose(0, 1)
        cache.v[0][s_dev, :, p_dev] = v[0].transpose(0, 1)
        for b, start, n in plan:
            cache.lengths[b] = start + n

    def _install_head(self, head: EagleHead | None, version: int) -> None:
        """Switch the live head. The new head has not seen any row: its cache restarts at 0 and
        is rebuilt from the stored features on the next draft."""
        if head is not None:
            head = head.to(dtype=self.target.dtype, device=self.target.device).eval()
            if self.dcache is None or self.head is None or self.head.cfg != head.cfg:
                self.dcache = head.new_cache(self.cfg.max_batch, self.cfg.max_len)
            self.dcache.lengths = [0] * self.cfg.max_batch
            if self.graphs is not None:
                self.graphs.bind_head(head)
        self.head, self.head_version = head, version
