"""CUDA graphs for the engine's fixed-shape forwards: target decode (b, 1), target verify
(b, K+1), the head's draft step (b, 1), a greedy batch's K chained draft steps with their
argmaxes in one graph (b, K), and the head's per-round catch-up (b, T <= K+2); the prefill
chunks (serving/cuda_prefill.py) and a tree round's drafting and verify (serving/cuda_tree.py)
are mixed in. The batches the graphs replay over are in serving/static_batch.py.

On a GPU a small model's eager step is launch-bound: each of the ~30 layers launches a dozen
kernels, and HF-style Python around them costs more than the arithmetic. A CUDA graph records a
forward's kernels once and replays them with one launch. What a replay needs, and how it is met:

- Fixed shapes. The batch is padded up to a bucket (1, 2, 4, 8, 16, ..., max_batch); padded rows
  run on the free slots max_batch > b >= B (slots 0..B-1 are the running requests, so rows B..
  write only into slots nobody uses: a new request's prefill and catch-up rewrite them from 0).
  Attention reads every key of the cache (max_len) under a causal mask built from the positions,
  instead of the eager path's keys 0..max(start)+T-1.
- Inputs and outputs at fixed addresses: tokens/embeddings, hidden and positions are copied into
  static buffers before a replay; outputs are cloned after it (graphs share one memory pool, so
  the next replay of any graph may overwrite them).
- No host work inside: positions are device tensors, the rotary table is sized up front
  (`TargetModel.rope(positions, bound)` reads no value back), cache writes are index_put on
  device indices, and the mask is computed inside the graph from the positions.

A graph is captured lazily per (bucket, tokens, input width, model, cache) at its first use,
after two warm-up runs on a side stream with that call's inputs.

Swaps keep the head's graphs. The head graphs are captured against one module the runner owns
(`GraphHead`), never against a version's module: when a head goes live (`bind_head`, called by
the engine at the switch between rounds) its weights are copied into that module in place, one
device copy of a few MB, and every captured graph stays valid. Capturing a new head's graphs in
its first round, as before, stalled that round ~12-19 ms on an H100 (docs/engine.md). The head
graphs are also keyed by the draft cache they write, and the engine rotates two caches (the live
one and the one a staged swap fills): graphs of at most `HEAD_CACHES` caches are kept, the least
recently used dropped beyond that.
Used only on CUDA (`CudaGraphs.for_engine` returns None elsewhere); the CPU path is the eager one.
Greedy output equals eager output token for token in fp32 (scripts/gpu_bench.py checks it): the
same weights and operations, only the attention's masked-out keys differ, and those weigh zero.
"""

from __future__ import annotations

import copy
import gc
import logging

import torch

from online_spec.host_window import upload
from serving.cuda_prefill import PrefillGraphs
from serving.cuda_tree import TreeGraphs
from serving.static_batch import SlotBatch, StaticBatch, StaticTreeBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HEAD_CACHES = 2  # draft caches whose head graphs are kept: the live one and a staged swap's


def buckets_for(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below max_batch, then max_batch itself."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class GraphHead:
    """The head module the head graphs are captured with; a live head's weights are copied into
    it, so its tensors (the addresses a graph replays) never change across swaps.

        gh = GraphHead()
        gh.load(head_v1)   # -> True: a module was built (graphs of the old one, if any, are stale)
        gh.load(head_v2)   # -> False: v2's weights copied in place, graphs stay valid
    """

    def __init__(self):
        self.module = None
        self.source = None  # the head whose weights the module holds

    def load(self, head) -> bool:
        """Hold `head`'s weights; returns True when the module had to be rebuilt (first use, or
        a head of another config, dtype or device), False when they were copied in place."""
        self.source = head
        # normal tensors, even when called under inference mode (a later in-place copy made
        # outside it must be allowed), and never part of an autograd graph
        with torch.inference_mode(False), torch.no_grad():
            if self.module is None or not self._fits(head):
                self.module = copy.deepcopy(head).eval().requires_grad_(False)
                return True
            own = _tensors(self.module)
            for name, t in _tensors(head).items():
                own[name].copy_(t)
        return False

    def _fits(self, head) -> bool:
        mine, theirs = _tensors(self.module), _tensors(head)
        return head.cfg == self.module.cfg and mine.keys() == theirs.keys() and all(
            mine[n].shape == t.shape and mine[n].dtype == t.dtype and mine[n].device == t.device
            for n, t in theirs.items())


def _tensors(module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class _Graph:
    def __init__(self, graph, inputs: dict, outputs: tuple, batch: StaticBatch, owners: tuple):
        self.graph, self.inputs, self.outputs, self.batch, self.owners = graph, inputs, outputs, batch, owners
        self.fn = None


class CudaGraphs(PrefillGraphs, TreeGraphs):
    """Captures and replays the engine's forwards; one per engine (it holds the target cache's
    graphs; the head's follow the live head)."""

    def __init__(self, target, max_batch: int, max_len: int):
        self.target, self.max_len = target, max_len
        self.buckets = buckets_for(max_batch)
        self.device = target.device
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._stream = None  # one side stream for every warm-up and capture
        self.head = GraphHead()  # the module every head graph replays (the live head's weights)
        self._head_caches: list = []  # draft caches with head graphs, least recently used first
        self.captures = 0  # graphs captured so far (tests, benches)
        self.capture_failures = 0  # failed captures (after one, every new shape runs eagerly)
        self.disabled = False
        # the rotary table must cover every position before any capture (it is never regrown inside one)
        target.rope(torch.zeros(1, 1, dtype=torch.long, device=self.device), max_len + 1)

    @classmethod
    def for_engine(cls, target, max_batch: int, max_len: int, enabled: bool = True) -> "CudaGraphs | None":
        if not enabled or target.device.type != "cuda":
            return None
        return cls(target, max_batch, max_len)

    def _slot_batch(self, T: int) -> SlotBatch:
        return SlotBatch(T, self.max_len, self.device)

    def bucket(self, B: int) -> int:
        return next(b for b in self.buckets if b >= B)

    # -- the forwards -----------------------------------------------------------------------
    @torch.inference_mode()
    def target_forward(self, tokens: torch.Tensor, starts: list[int], cache):
        """tokens [B,T] at positions starts[b].. over slots 0..B-1 -> (logits [B,T,V], features
        [B,T,3H], final hidden [B,T,H]), as `TargetModel.forward(tokens, AttentionBatch(starts, T), cache)`."""
        B, T = tokens.shape
        key = ("target", self.bucket(B), T)
        g = self._get(key, (cache,), lambda Bp: {"tokens": torch.zeros(Bp, T, dtype=torch.long, device=self.device)},
                      lambda ins, sb: self.target.forward(ins["tokens"], sb, cache))
        g.inputs["tokens"][:B].copy_(upload(tokens, self.device))
        return self._replay(g, B, starts)

    @torch.inference_mode()
    def head_step(self, head, cache, embeds: torch.Tensor, hidden: torch.Tensor, starts: list[int]):
        """The head over rows starts[b]..starts[b]+T-1 of slots 0..B-1 (embeds [B,T,H], hidden
        [B,T,3H|H]) -> (draft logits [B,T,Vd], output hidden [B,T,H]), as `head.step`."""
        B, T, W = hidden.shape
        head = self._head_module(head, cache)
        key = ("head", self.bucket(B), T, W)
        rope = self.target.rope

        def make(Bp):
            return {"embeds": torch.zeros(Bp, T, embeds.shape[-1], dtype=embeds.dtype, device=self.device),
                    "hidden": torch.zeros(Bp, T, W, dtype=hidden.dtype, device=self.device)}

        g = self._get(key, (head, cache), make,
                      lambda ins, sb: head.step(ins["embeds"], ins["hidden"], sb, cache, rope))
        g.inputs["embeds"][:B].copy_(embeds)
        g.inputs["hidden"][:B].copy_(hidden)
        return self._replay(g, B, starts)

    @torch.inference_mode()
    def draft_chain(self, head, cache, logits: torch.Tensor, hidden: torch.Tensor, starts: list[int], K: int):
        """K greedy chained draft steps in one replay (`EagleHead.greedy_chain` captured; the
        eager engine runs it step by step): step 0 takes the argmax of `logits` [B, Vd] (the
        catch-up's last row, hidden [B, H] beside it), step j >= 1 runs the head at starts[b] + j - 1.
        -> (draft target ids [B, K], their probabilities [B, K] float32)."""
        B = logits.shape[0]
        head = self._head_module(head, cache)
        key = ("chain", self.bucket(B), K)
        rope, embed = self.target.rope, self.target.embed_tokens

        def make(Bp):
            return {"logits": torch.zeros(Bp, logits.shape[-1], dtype=logits.dtype, device=self.device),
                    "hidden": torch.zeros(Bp, hidden.shape[-1], dtype=hidden.dtype, device=self.device)}

        def chain(ins, sb):
            base = sb.positions.clone()  # [Bp, 1]: the rows' starts

            def at(j):  # step j's rows sit at start + j - 1 of the draft cache
                sb.positions.copy_(base + (j - 1))
                sb.build_mask()
                return sb

            out = head.greedy_chain(embed, rope, cache, ins["logits"], ins["hidden"], K, at)
            sb.positions.copy_(base)  # a warm-up run leaves the starts as it found them
            return out

        g = self._get(key, (head, cache), make, chain)
        g.inputs["logits"][:B].copy_(logits)
        g.inputs["hidden"][:B].copy_(hidden)
        return self._replay(g, B, starts)

    def warm_rounds(self, tcache, head, caches: list, max_steps: int, trees=()) -> int:
        """Capture now every graph a round can replay, so none is captured while serving: the
        prefill chunks and the head's fill chunks (serving/cuda_prefill.py); per batch bucket, the
        target's verify of T = 1..max_steps+1 tokens (T = 1: plain decode) and, with a head, per
        draft cache in `caches`, its catch-up over T = 1..max_steps+1 rows (features in), its
        one-row step over its own hidden (sampling batches) and the greedy chain of K =
        1..max_steps steps; for each tree shape in `trees` (a static tree's, a policy's
        candidates), its drafting (per draft cache) and its two verifies (serving/cuda_tree.py). Dummy rows at positions 0..T-1 of every slot: call it
        while no request is running (a prefill rewrites a slot from row 0). Returns the graphs
        captured."""
        before = self.captures
        dev, dt = self.device, self.target.dtype
        self.warm_prefill(tcache, head, caches)
        H = self.target.info.hidden_size
        for Bp in self.buckets:
            starts = [0] * Bp
            for T in range(1, max_steps + 2):
                self.target_forward(torch.zeros(Bp, T, dtype=torch.long, device=dev), starts, tcache)
            if head is None:
                continue
            for cache in caches:
                for T in range(1, max_steps + 2):
                    self.head_step(head, cache, torch.zeros(Bp, T, H, dtype=dt, device=dev),
                                   torch.zeros(Bp, T, head.cfg.target_hidden_size * 3, dtype=dt, device=dev), starts)
                own = torch.zeros(Bp, 1, head.cfg.hidden_size, dtype=dt, device=dev)
                self.head_step(head, cache, torch.zeros(Bp, 1, H, dtype=dt, device=dev), own, starts)
                logits = torch.zeros(Bp, head.cfg.draft_vocab_size, dtype=dt, device=dev)
                for K in range(1, max_steps + 1):
                    self.draft_chain(head, cache, logits, own[:, 0], starts, K)
            for shape in trees:
                self._warm_tree(shape, Bp, tcache, head, caches)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return self.captures - before

    def bind_head(self, head) -> None:
        """`head` goes live: its weights into the graphs' module (in place: the captured graphs
        stay valid), or a new module when it does not fit, whose graphs are then captured anew.
        Called between rounds, on the serving stream, so no replay reads half-copied weights."""
        if self.head.load(head):
            self.drop_head_graphs()

    def drop_head_graphs(self, cache=None) -> None:
        """Drop the head graphs (of one draft cache only, when given)."""
        for k in [k for k, g in self._graphs.items()
                  if k[0] in ("head", "dtree", "chain", "hfill") and (cache is None or g.owners[1] is cache)]:
            del self._graphs[k]
        self._head_caches = [] if cache is None else [c for c in self._head_caches if c is not cache]

    def _head_module(self, head, cache):
        """The module the head graphs replay, with `head`'s weights (bound here for a caller that
        did not bind at its switch), `cache` marked most recently used."""
        if head is not self.head.source:
            self.bind_head(head)
        self._use_cache(cache)
        return self.head.module

    def _use_cache(self, cache) -> None:
        """Mark `cache` most recently used; beyond HEAD_CACHES caches the oldest one's graphs go."""
        if self._head_caches and self._head_caches[-1] is cache:
            return
        self._head_caches = [c for c in self._head_caches if c is not cache] + [cache]
        while len(self._head_caches) > HEAD_CACHES:
            self.drop_head_graphs(self._head_caches[0])

    # -- capture / replay -------------------------------------------------------------------
    def _positions(self, Bp: int, T: int, starts: list[int]) -> torch.Tensor:
        """[Bp,T] positions: the real rows', then 0..T-1 for the padding rows (free slots)."""
        st = torch.zeros(Bp, dtype=torch.long)
        st[:len(starts)] = torch.tensor(starts, dtype=torch.long)
        return st[:, None] + torch.arange(T)[None]

    def _replay(self, g: _Graph, B: int, starts: list[int]):
        g.batch.positions.copy_(upload(self._positions(g.batch.B, g.batch.T, starts), self.device))
        return self._run(g, B)

    def _run(self, g: _Graph, B: int):
        """Replay `g` (captured now if new) with its inputs in place -> outputs of the real rows."""
        if g.graph is None:
            if self.disabled:
                g.graph = False
            else:
                self._capture(g)  # with this call's inputs in place: the warm-up writes what the replay writes
        if g.graph is False:  # capture failed: this shape runs the same forward eagerly
            g.batch.build_mask()
            return tuple(o[:B] for o in g.fn(g.inputs, g.batch) if o is not None)
        g.graph.replay()
        return tuple(o[:B].clone() for o in g.outputs)

    def _get(self, key: tuple, owners: tuple, make_inputs, fn, scratch: int = 0, batch=None) -> _Graph:
        """The graph for `key` and these owners (model, cache), created uncaptured if new; with a
        `scratch` region, over a `StaticTreeBatch`; over `batch` when given (used if new)."""
        full = key + tuple(id(o) for o in owners)
        g = self._graphs.get(full)
        if g is not None and all(a is b for a, b in zip(g.owners, owners)):
            return g
        inputs = make_inputs(key[1])
        if batch is None:
            batch = (StaticTreeBatch(key[1], key[2], self.max_len, scratch, self.device) if scratch
                     else StaticBatch(key[1], key[2], self.max_len, self.device))
        g = _Graph(None, inputs, (), batch, owners)
        g.fn = fn
        self._graphs[full] = g
        return g

    def _capture(self, g: _Graph) -> None:
        sb, inputs, fn = g.batch, g.inputs, g.fn

        def run():
            sb.build_mask()
            return tuple(o for o in fn(inputs, sb) if o is not None)

        # warm up on the stream the capture records on (cuBLAS sets up its workspace per stream
        # on a shape's first use, which must not happen mid-capture) before recording. The real
        # rows' inputs and positions are in place, so the K/V the warm-up writes are the replay's.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during a capture: collecting a dropped engine's graphs (reference
        # cycles) destroys CUDA graphs, which is illegal mid-capture and invalidated one (seen on
        # the H100 while benches built engine after engine).
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=s, capture_error_mode="thread_local"):
                g.outputs = run()
        except RuntimeError as e:  # reported, and no graph is captured again by this runner
            log.warning("CUDA graph capture failed for B=%d T=%d (running eagerly from now on): %s", sb.B, sb.T, e)
            torch.cuda.synchronize()
            g.graph = False
            self.capture_failures += 1
            self.disabled = True
            return
        finally:
            gc.enable()
        self._pool = graph.pool()
        g.graph = graph
        self.captures += 1
        log.debug("captured CUDA graph B=%d T=%d", sb.B, sb.T)
