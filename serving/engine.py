"""The embedded speculative engine: continuous batching over draft -> verify -> accept rounds.

In: requests (`Request`: prompt ids, `SamplingParams`, tag; serving/requests.py). Out, per `step()`:
each running request's tokens committed that round (`RequestOutput`), a `RoundStats` (K, batch,
accepted drafts, timings, head version) and the capture records (contract 1) of the requests the
publisher samples, built from the verify forward itself (no extra target forward).

State per request lives in a slot: committed tokens (`tok_buf`), the EAGLE-3 features of every
committed position (`feat_buf`, kept so a new head can rebuild its KV cache after a swap), the
target KV cache and the draft KV cache. A slot's target cache holds positions 0..L-1 and
tok_buf[L] is the last committed token, not yet fed to the target; the draft cache trails the
target's and is caught up (`_extend_draft`) just before drafting.

A round is a chain (topk 1: serving/chain_round.py) or a tree (topk > 1: serving/tree_round.py,
SGLang's `num_steps`, `topk`, `num_draft_tokens`); `step` reads the round top to bottom either
way. A new head is installed with `swap_head` (any thread; serving/head_swap.py); it takes
effect between rounds, never inside one. Whatever head is live, the output equals the target's
(greedy: token-identical; sampling: the same distribution).

    engine = Engine(load_target(), head, EngineConfig())
    outs = engine.generate([ids], SamplingParams(max_tokens=64))
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from online_spec.capture import CaptureRecord
from online_spec.config import ConfigError
from online_spec.controller import StaticSteps, StepPolicy, check_policy
from online_spec.head import EagleHead
from online_spec.host_window import HostWindow, follow, place_capture, upload
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams, probs_from_logits
from online_spec.target import TargetModel
from online_spec.tree import TreeShape
from serving.chain_round import ChainRounds
from serving.cuda_graphs import CudaGraphs
from serving.engine_config import EngineConfig  # re-exported: callers import it from here
from serving.head_swap import HeadSwapping, StagedHead
from serving.requests import CaptureSink, EngineFull, PromptTooLong, Request, RequestOutput, RoundStats
from serving.timeline import NO_TIMELINE, NoTimeline, RoundTimeline
from serving.tree_round import TreeRounds

log = logging.getLogger(__name__)


class Engine(ChainRounds, TreeRounds, HeadSwapping):
    def __init__(self, target: TargetModel, head: EagleHead | None, cfg: EngineConfig | None = None,
                 policy: StepPolicy | None = None, publisher: CaptureSink | None = None,
                 head_version: int = 0):
        self.target, self.cfg = target, cfg or EngineConfig()
        self.policy = policy or StaticSteps(self.cfg.num_steps)
        self._check_policy(self.policy)
        c, info = self.cfg, target.info
        S, L = c.max_batch, c.max_len
        self.tcache = target.new_cache(S, L)
        self.tok_buf = torch.zeros(S, L + 1, dtype=torch.long)
        self.feat_buf = torch.zeros(S, L, 3 * info.hidden_size, dtype=target.dtype, device=target.device)
        self.graphs = CudaGraphs.for_engine(target, S, L, c.cuda_graphs)  # None on CPU
        self.cuts_max = c.cuts_up_to(target.device)  # rounds of up to this batch ask the policy's in-round cuts
        self.cuts = self.cuts_max > 0  # whether this round asks them (set per round in `step`)
        # around the blocking read-backs: the publisher and a planned policy run there (online_spec/host_window.py)
        self.window = HostWindow() if c.windows_on(target.device) else None
        self.cpus = c.cpu_reserve(target.device, owner=self)  # the engine thread's core, from its first round
        self.publisher = publisher
        follow(self.policy, self.window)
        self.head: EagleHead | None = None
        self.dcache = None
        self.head_version = -1
        self._install_head(head, head_version)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending_swap: tuple[EagleHead | None, int] | None = None
        self._pending_policy: StepPolicy | None = None
        self._staged: StagedHead | None = None
        self._spare_cache = None
        self._filled = 0
        self._catchup_s = 0.0  # this round's long catch-ups (RoundStats.catchup_s)
        self._policy_ns = 0  # this round's policy calls on the engine thread (RoundStats.policy_s)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.on_round: list[Callable[[RoundStats, list[RequestOutput]], None]] = []
        self._swap_unreported = False
        self.timeline: RoundTimeline | NoTimeline = NO_TIMELINE  # a bench's RoundTimeline marks round stages

    # -- public API -----------------------------------------------------------------------
    @property
    def publisher(self) -> CaptureSink | None:
        return self._publisher

    @publisher.setter
    def publisher(self, pub: CaptureSink | None) -> None:
        """The capture sink, its work placed where it costs serving least (`place_capture`): a GPU's host windows,
        the engine's thread on a CPU, or pumped by it before each verify read-back (`capture_sender` 'engine')."""
        self._publisher = pub
        self._pump = place_capture(pub, self.window, self.target.device.type, self.cfg.capture_sender)

    def add_request(self, req: Request) -> Request:
        """Queue a request; raises EngineFull / PromptTooLong / ValueError without side effects."""
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_ids) + self.cfg.reserve + 2 >= self.cfg.max_len:
            raise PromptTooLong(f"prompt of {len(req.prompt_ids)} tokens leaves no room within "
                                f"max_len={self.cfg.max_len}")
        vocab = self.target.info.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        with self._lock:
            if len(self.waiting) >= self.cfg.max_queue:
                raise EngineFull(f"queue full ({self.cfg.max_queue} waiting)")
            if not req.request_id:
                req.request_id = f"req-{next(self._ids)}"
            if req.params.seed is not None:
                req.gen = torch.Generator().manual_seed(req.params.seed)
            self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """Finish a request now (client went away); its slot is freed at the end of the round."""
        with self._lock:
            for r in list(self.waiting):
                if r.request_id == request_id:
                    self.waiting.remove(r)
            for r in self.running:
                if r.request_id == request_id and r.finish_reason is None:
                    r.finish_reason = "abort"

    def set_policy(self, policy: StepPolicy) -> None:
        """Install a new step policy before the next round. Thread-safe; a policy lacking a
        `StepPolicy` member is refused here (TypeError), not rounds later."""
        self._check_policy(policy)
        with self._lock:
            self._pending_policy = policy

    def _check_policy(self, policy: StepPolicy) -> None:
        check_policy(policy)
        if self.cfg.tree and not policy.tree_rounds:
            raise ConfigError(f"policy: {policy.name} drives chain rounds only (speculative_eagle_topk "
                              f"{self.cfg.speculative_eagle_topk} asks for trees): serve trees with the static "
                              "policy, as SGLang does (its adaptive mode requires topk 1)")

    @property
    def has_pending(self) -> bool:
        """A swap or policy change is waiting for the next round (the loop runs one even when idle)."""
        return self._pending_swap is not None or self._pending_policy is not None or self._staged is not None

    def warm_graphs(self) -> dict:
        """Capture every CUDA graph a round replays before serving starts (a server's start-up):
        prefill chunks, chain rounds at every K, a static tree's shape (`speculative_eagle_topk`
        > 1) and every tree a tree-choosing policy may pick (`tree_shapes`), for the live draft
        cache and the spare one a swap's staging fills, so no round stalls on a capture: on an
        H200 a capture inside a served round cost tens of ms, and each K an adaptive policy first
        tries cost its own. Call before any request is admitted.
        Returns {"graphs": captured, "seconds": wall}; {} without CUDA graphs (CPU)."""
        if self.graphs is None:
            return {}
        if self.running:
            raise RuntimeError("warm_graphs: requests are running (it writes dummy rows into every slot)")
        t0 = time.perf_counter()
        caches = []
        if self.head is not None:
            if self._spare_cache is None:
                self._spare_cache = self.head.new_cache(self.cfg.max_batch, self.cfg.max_len)
            caches = [self._spare_cache, self.dcache]  # the live cache last: most recently used
        trees = [self.cfg.tree_shape(self.cfg.num_steps)] if self.cfg.tree and self.cfg.num_steps > 0 else []
        if self.head is not None and self.policy.chooses_trees:  # every tree the policy may pick
            trees += [t for t in self.policy.tree_shapes() if t not in trees]
        n = self.graphs.warm_rounds(self.tcache, self.head, caches, self.cfg.max_steps, trees)
        for cache in [self.tcache, *caches]:
            cache.lengths = [0] * self.cfg.max_batch
        return {"graphs": n, "seconds": round(time.perf_counter() - t0, 3)}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 tags: list[str] | None = None) -> list[list[int]]:
        """Run prompts to completion (tests, benches); returns output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [Request(list(p), sp, tag=(tags[i] if tags else "")) for i, (p, sp) in enumerate(zip(prompts, plist))]
        todo = deque(reqs)
        while todo or any(r.finish_reason is None for r in reqs):
            while todo and len(self.waiting) < max(self.cfg.max_queue, 1):
                self.add_request(todo.popleft())
            self.step()
        return [r.output_ids for r in reqs]

    # -- one round --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.cpus is not None:
            self.cpus.hold()
        # a swap that lands while idle is reported with the next round
        swapped = self._apply_pending_swap() or self._swap_unreported
        self._swap_unreported = False
        self._release_finished()
        t_admit = time.perf_counter()
        outs = self._admit()
        admit_s = time.perf_counter() - t_admit  # each prefill reads its first token back: the device is done
        self._release_finished()
        if not self.running:
            self._swap_unreported = swapped
            return outs
        tl = self.timeline  # stage marks (serving/timeline.py): no-ops unless a bench set one
        tl.start()
        reqs = self.running
        B = len(reqs)
        self.cuts = B <= self.cuts_max
        tlen = [self.tcache.lengths[b] for b in range(B)]
        ctx = sum(tlen) // B
        room = self.cfg.max_len - max(tlen) - 2
        tp = time.perf_counter_ns()  # the policy's calls are timed where they are made (RoundStats.policy_s)
        K = 0 if self.head is None else max(0, min(self.policy.steps_for(B, ctx), self.cfg.max_steps, room))
        shape: TreeShape | None = None  # this round's tree, or None for a chain of K
        policy_trees = self.head is not None and self.policy.chooses_trees
        if policy_trees:
            shape = self.policy.tree_for(B, ctx)
            shape = shape if shape is not None and shape.footprint <= room else None
        self._policy_ns = time.perf_counter_ns() - tp
        if not policy_trees and self.cfg.tree:
            while K > 0 and self.cfg.tree_shape(K).footprint > room:  # a tree's cache footprint must fit
                K -= 1
            shape = self.cfg.tree_shape(K) if K > 0 else None
        t1 = time.perf_counter()
        tl.mark("decide")
        captures = [self._captures()]
        self._catchup_s = 0.0
        if shape is not None:
            # 1) draft a tree, 2) verify it in one forward, 3) accept a path, 4) commit, 5) capture (tree_round.py)
            K = shape.num_steps
            tree = self._draft_tree(reqs, tlen, shape)
            t2 = time.perf_counter()
            tl.mark("draft")
            captures.append(self._captures())
            accepted, records, round_outs = self._verify_tree(reqs, tlen, tree, shape)
            lens, drafted, confidences, verified = [K] * B, K, None, shape.num_draft_tokens
        else:
            # 1) draft: catch the draft cache up on committed features, then up to K chained steps
            #    (fewer when the policy predicts the next step does not pay).
            q_full: list[torch.Tensor] | None = None
            if K > 0:  # kept: a greedy chain's drafts still on the device (serving/chain_round.py)
                drafts, draft_probs, q_full, kept = self._draft(reqs, tlen, K, ctx)
                K = drafts.shape[1]
            else:
                drafts, draft_probs, kept = torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0), False
                if self.head is not None and self.graphs is not None and self.catch_up_plain:
                    # keep the draft cache caught up, one graphed head row a request (`catch_up_plain`,
                    # off by default: the round that drafts again catches up in its chunked fills)
                    self._extend_draft(tlen)
            # verify length (confidence-prior verifier): low-confidence tails are not verified. The
            # verify forward is rectangular (every request at K + 1 tokens), so the policy picks one
            # length for the batch: a request cut shorter than the rest would save nothing.
            lens, drafted = [K] * B, K
            if K > 0 and self.policy.truncates and self.cuts:  # the drafts came back (`_draft`)
                tp = time.perf_counter_ns()  # [B, K] on the host: the policy reads it, no copy
                lens = self.policy.verify_lengths(draft_probs.numpy(), ctx, padded=True)
                self._policy_ns += time.perf_counter_ns() - tp
                lens = lens if max(lens) <= K else [min(K, n) for n in lens]  # never more than drafted
                K = max(lens)
                drafts, draft_probs = drafts[:, :K], draft_probs[:, :K]
            t2 = time.perf_counter()
            tl.mark("draft")
            captures.append(self._captures())

            # 2) verify: the last committed token and the K drafts, at positions tlen..tlen+K, in one
            #    target forward over the KV cache. tokens [B, K+1] -> logits [B, K+1, V].
            tokens = self._verify_tokens(tlen, drafts, kept)
            if self.graphs is not None:
                logits, feats, final = self.graphs.target_forward(tokens, tlen, self.tcache)
            else:
                batch = AttentionBatch(tlen, K + 1, self.target.device)
                logits, feats, final = self.target.forward(tokens.to(self.target.device), batch, self.tcache)
            tl.mark("verify")

            # 3) accept, 4) commit, 5) capture
            accepted, records, round_outs, draft_probs = self._accept_chain(reqs, tlen, lens, drafts, draft_probs,
                                                                            q_full, logits, feats, final, kept)
            confidences = draft_probs.numpy()  # [B, K] on the host
            verified = K + 1
        t3 = time.perf_counter()
        tl.mark("accept")
        captures.append(self._captures())
        stats = RoundStats(batch_size=B, num_steps=K, accepted=accepted,
                           committed=sum(len(o.new_token_ids) for o in round_outs),
                           draft_s=t2 - t1, verify_s=t3 - t2, total_s=t3 - t0,
                           head_version=self.head_version, ctx_len=ctx, swapped=swapped,
                           swap_fill_rows=self._filled, catchup_s=self._catchup_s,
                           draft_captures=captures[1] - captures[0], verify_captures=captures[2] - captures[1],
                           drafted_steps=drafted, topk=shape.topk if shape is not None else 1,
                           num_draft_tokens=verified if K > 0 else 1, admitted=len(outs), admit_s=admit_s)
        # every round counts, K=0 too (SGLang's policy probes up from plain decode); the cost policy learns steady
        # round times: one-off work (long catch-ups, graph captures) would hold K at 0 (GPU e2e run).
        if self.head is not None:
            tp = time.perf_counter_ns()
            self.policy.update(B, accepted, num_steps=lens, ctx_len=ctx, draft_s=stats.steady_draft_s,
                               verify_s=stats.steady_verify_s, confidences=confidences, tree=shape)
            self._policy_ns += time.perf_counter_ns() - tp
        stats.policy_s = self._policy_ns * 1e-9
        if self.publisher is not None and records:
            self.publisher.submit(records)
        for hook in self.on_round:
            hook(stats, round_outs)
        self.last_round = stats
        tl.mark("learn")
        tl.end(K, B, stats.catchup_s, stats.draft_captures + stats.verify_captures)
        return outs + round_outs

    # -- pieces of a round ------------------------------------------------------------------
    def _host(self, t: torch.Tensor, long: bool = False) -> torch.Tensor:
        """`t` on the host: a blocking read-back on a GPU, in a host window where the engine has one (`long`: the
        verify's, the round's longest wait; the capture kept for it goes out first: `capture_sender` 'engine')."""
        if long and self._pump is not None:
            self._pump()
        if self.window is None:
            return t.cpu()
        with self.window.waiting(long):
            return t.cpu()

    def _captures(self) -> int:
        return 0 if self.graphs is None else self.graphs.captures

    def _extend_draft(self, tlen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the head every committed row it has not seen: row p reads (embedding of token
        p+1, target features of p). Returns draft logits and hidden of each slot's last row."""
        head, dev = self.head, self.target.device
        B = len(tlen)
        # at least the last committed row is recomputed: its output starts the chain
        dlen = [min(self.dcache.lengths[b], tlen[b] - 1) for b in range(B)]
        need = [t - d for t, d in zip(tlen, dlen)]
        # Long catch-ups (a fresh prompt, rows served at K = 0, or every row after a swap): every
        # row but the last only contributes K/V, filled slot by slot; the last row then joins the
        # per-round ones (<= K+1 rows) in one batch (one graph replay on a GPU), so an admission
        # never sends the other slots down a one-slot eager path. The long fills are timed apart
        # (RoundStats.catchup_s): a one-off cost, not the price of this round's K.
        long = [b for b in range(B) if need[b] > self.cfg.max_steps + 1]
        if long:
            t0 = time.perf_counter()
            for b in long:
                self._fill_rows(head, self.dcache, b, dlen[b], need[b] - 1)
                dlen[b], need[b] = tlen[b] - 1, 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # rare (long catch-ups only): the clock must see the GPU work
            self._catchup_s = time.perf_counter() - t0
        lg, hd = self._head_rows(dlen, max(need))
        idx = upload([n - 1 for n in need], dev)
        ar = torch.arange(B, device=dev)
        out_logits, out_hidden = lg[ar, idx], hd[ar, idx]
        for b in range(B):
            self.dcache.lengths[b] = tlen[b]
        return out_logits, out_hidden

    def _fill_rows(self, head: EagleHead, cache, slot: int, start: int, T: int) -> None:
        """K/V of rows start..start+T-1 of `slot` into `cache` (row p: token p+1, features of p)."""
        if T <= 0:
            return
        dev = self.target.device
        emb = self.target.embed_tokens(self.tok_buf[slot, start + 1:start + T + 1][None].to(dev))
        if self.graphs is not None:  # chunk replays (serving/cuda_prefill.py)
            self.graphs.head_fill(head, cache, emb[0], self.feat_buf[slot, start:start + T], slot, start)
        else:
            head.fill_cache(emb, self.feat_buf[slot, start:start + T][None], slot, start, cache, self.target.rope)
        cache.lengths[slot] = start + T

    def _head_rows(self, starts: list[int], T: int):
        """Head forward over rows starts[b] .. starts[b]+T-1 of slots 0..B-1 (B = len(starts))."""
        dev = self.target.device
        pos = torch.tensor(starts)[:, None] + torch.arange(T)[None]  # [B, T]
        sl = torch.arange(len(starts))[:, None]
        nxt = self.tok_buf[sl, (pos + 1).clamp_max(self.cfg.max_len)]
        hid = self.feat_buf[upload(sl, dev), upload(pos.clamp_max(self.cfg.max_len - 1), dev)]
        emb = self.target.embed_tokens(upload(nxt, dev))
        if self.graphs is not None:
            return self.graphs.head_step(self.head, self.dcache, emb, hid, starts)
        batch = AttentionBatch(starts, T, dev)
        return self.head.step(emb, hid, batch, self.dcache, self.target.rope)

    def _commit_output(self, r: Request, new: list[int], accept_len: int, K: int) -> RequestOutput:
        """Append committed tokens to the request, cutting at its stop conditions."""
        taken: list[int] = []
        eos = self.target.eos_token_ids
        for t in new:
            if r.finish_reason is not None:
                break
            taken.append(t)
            r.output_ids.append(t)
            if t in eos and not r.params.ignore_eos:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
        if r.finish_reason is None and r.params.stop:
            cut = self._check_stop_strings(r)
            if cut:
                del taken[max(0, len(taken) - cut):]
        if r.finish_reason is None and self.tcache.lengths[r.slot] + self.cfg.reserve + 2 >= self.cfg.max_len:
            r.finish_reason = "length"
        return RequestOutput(r.request_id, taken, accept_len, K, r.finish_reason is not None, r.finish_reason)

    def _check_stop_strings(self, r: Request) -> int:
        """Finish `r` at its first stop string; returns how many output tokens were cut."""
        text = self.target.tokenizer.decode(r.output_ids)
        hits = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
        if not hits:
            return 0
        i = min(hits)
        # keep the tokens whose text ends before the stop string
        keep = len(r.output_ids)
        while keep > 0 and len(self.target.tokenizer.decode(r.output_ids[:keep])) > i:
            keep -= 1
        cut = len(r.output_ids) - keep
        del r.output_ids[keep:]
        r.finish_reason = "stop"
        return cut

    # -- admission, release, swap ---------------------------------------------------------------
    def _admit(self) -> list[RequestOutput]:
        """Prefill waiting requests into free slots; each yields its first token."""
        outs = []
        while len(self.running) < self.cfg.max_batch:
            with self._lock:
                if not self.waiting:
                    break
                r = self.waiting.popleft()
            r.slot = len(self.running)
            self.running.append(r)
            r.capture = bool(self.publisher is not None and self.publisher.should_capture(r.request_id))
            outs.append(self._prefill(r))
        return outs

    def _prefill(self, r: Request) -> RequestOutput:
        b, P = r.slot, len(r.prompt_ids)
        ids = torch.tensor(r.prompt_ids)
        if self.graphs is not None:  # chunks of CUDA-graph replays (serving/cuda_prefill.py)
            last, feats, final = self.graphs.prefill(ids, b, self.tcache)
        else:
            view = _SlotView(self.tcache, b)
            view.lengths[0] = 0
            logits, feats, final = self.target.forward(ids[None].to(self.target.device),
                                                       AttentionBatch([0], P, self.target.device), view,
                                                       logits_rows=slice(-1, None))
            last, feats, final = logits[0, -1], feats[0], final[0]
        if r.params.greedy:
            first = int(last.argmax())
        else:
            first = int(torch.multinomial(probs_from_logits(last.cpu(), r.params), 1, generator=r.gen))  # host gen
        self.tok_buf[b, :P] = ids
        self.tok_buf[b, P] = first
        self.feat_buf[b, :P] = feats
        self.tcache.lengths[b] = P
        if self.dcache is not None:
            self.dcache.lengths[b] = 0
        if self._staged is not None:
            self._staged.cache.lengths[b] = 0
        if r.capture:
            self.publisher.submit([CaptureRecord(
                request_id=r.request_id, first_pos=0, tokens=self.tok_buf[b, :P + 1].clone(),
                features=feats, final_hidden=final, batch_size=1,
                draft_version=self.head_version, is_prefill=True, tag=r.tag)])
        return self._commit_output(r, [first], 0, 0)

    def _release_finished(self) -> None:
        """Free the slots of finished requests, keeping running requests in slots 0..B-1."""
        keep = [r for r in self.running if r.finish_reason is None]
        done = [r for r in self.running if r.finish_reason is not None]
        if not done:
            return
        free = sorted(r.slot for r in done if r.slot < len(keep))
        movers = [r for r in keep if r.slot >= len(keep)]
        for r, dst in zip(movers, free):
            self._move_slot(r.slot, dst)
            r.slot = dst
        self.running = sorted(keep, key=lambda r: r.slot)
        for r in done:
            if self.publisher is not None and r.capture:
                self.publisher.end_request(r.request_id)

    def _move_slot(self, src: int, dst: int) -> None:
        n = self.tcache.lengths[src]
        self.tcache.move_slot(src, dst)
        if self.dcache is not None:
            self.dcache.move_slot(src, dst)
        if self._staged is not None:
            self._staged.cache.move_slot(src, dst)
        self.tok_buf[dst, :n + 1] = self.tok_buf[src, :n + 1]
        self.feat_buf[dst, :n] = self.feat_buf[src, :n]

class _SlotView:
    """A one-slot window onto a KVCache, so a single request can run as batch 1."""

    def __init__(self, cache, slot: int):
        self.k = [k[slot:slot + 1] for k in cache.k]
        self.v = [v[slot:slot + 1] for v in cache.v]
        self.lengths = [cache.lengths[slot]]
