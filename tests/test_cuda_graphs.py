"""CUDA-graph path of the engine (serving/cuda_graphs.py).

On CPU: the capturable forward (StaticBatch: padded batch, whole-cache keys under a mask,
positions in a buffer) computes what the eager AttentionBatch forward does, for the target and
the head, and padding rows touch only free slots. On a GPU (skipped here): the graphed engine's
greedy output equals the eager engine's token for token (scripts/gpu_bench.py does the same
with the real model and the shipped head).

Swaps keep the head graphs (`GraphHead`): on CPU the runner's bookkeeping is exercised with its
captures switched off (`disabled`: each shape then runs its capturable forward eagerly), which
is how it routes a live head's weights into the one module the graphs would replay; that a
replayed graph reads copied weights is checked on a GPU.
"""

import pytest
import torch

from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.cuda_graphs import CudaGraphs, GraphHead, buckets_for
from serving.static_batch import StaticBatch
from serving.engine import Engine, EngineConfig
from serving.requests import Request

MAX_LEN = 64


def test_buckets():
    assert buckets_for(16) == [1, 2, 4, 8, 16]
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    assert buckets_for(1) == [1]


def _prefilled(target, lens, slots=4, seed=0):
    """A cache with slot b holding a random prompt of lens[b] tokens (slots beyond: free)."""
    g = torch.Generator().manual_seed(seed)
    cache = target.new_cache(slots, MAX_LEN)
    for b, n in enumerate(lens):
        ids = torch.randint(1, 500, (1, n), generator=g)
        view = _view(cache, b)
        target.forward(ids, AttentionBatch([0], n), view)
        cache.lengths[b] = n
    return cache


def _view(cache, b):
    from serving.engine import _SlotView
    return _SlotView(cache, b)


def _static(B, Bp, T, starts):
    sb = StaticBatch(Bp, T, MAX_LEN, "cpu")
    pos = torch.zeros(Bp, dtype=torch.long)
    pos[:B] = torch.tensor(starts)
    sb.positions.copy_(pos[:, None] + torch.arange(T)[None])
    sb.build_mask()
    return sb


@pytest.mark.parametrize("T", [1, 4])
def test_static_batch_target_forward_matches_eager(T):
    target = tiny_target()
    lens = [7, 12, 3]
    eager_cache, static_cache = _prefilled(target, lens), _prefilled(target, lens)
    tokens = torch.randint(1, 500, (3, T), generator=torch.Generator().manual_seed(1))
    ref = target.forward(tokens, AttentionBatch(lens, T), eager_cache)
    padded = torch.cat([tokens, torch.zeros(1, T, dtype=torch.long)])  # batch padded to a bucket of 4
    got = target.forward(padded, _static(3, 4, T, lens), static_cache)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g[:3], r, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0][:3].argmax(-1), ref[0].argmax(-1))
    for layer in range(target.info.num_layers):  # the real slots' cache rows are the eager ones
        for b, n in enumerate(lens):
            torch.testing.assert_close(static_cache.k[layer][b, :, :n + T], eager_cache.k[layer][b, :, :n + T])
            torch.testing.assert_close(static_cache.v[layer][b, :, :n + T], eager_cache.v[layer][b, :, :n + T])


def test_static_batch_head_step_matches_eager():
    target = tiny_target()
    head = new_head(target, draft_vocab_size=256, seed=3).float()
    g = torch.Generator().manual_seed(2)
    lens, T, H = [5, 9], 3, target.info.hidden_size
    caches = []
    for _ in range(2):
        c = head.new_cache(4, MAX_LEN)
        for b, n in enumerate(lens):  # same history in both caches
            emb = target.embed_tokens(torch.arange(1, n + 1)[None] * (b + 1))
            feats = torch.linspace(-1, 1, n * 3 * H).view(1, n, 3 * H) * (b + 1)
            head.fill_cache(emb, feats, b, 0, c, target.rope)
        caches.append(c)
    emb = torch.randn(2, T, H, generator=g)
    hid = torch.randn(2, T, H, generator=g)
    ref = head.step(emb, hid, AttentionBatch(lens, T), caches[0], target.rope)
    pad = torch.zeros(2, T, H)
    got = head.step(torch.cat([emb, pad]), torch.cat([hid, pad]), _static(2, 4, T, lens), caches[1], target.rope)
    for r, x in zip(ref, got):
        torch.testing.assert_close(x[:2], r, rtol=1e-5, atol=1e-5)


def test_rope_bound_is_the_same_table():
    target = tiny_target()
    pos = torch.tensor([[3, 4, 5], [40, 41, 42]])
    a = target.rope(pos)
    b = target.rope(pos, 43)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_graphs_on_cpu():
    target = tiny_target()
    assert CudaGraphs.for_engine(target, 4, 128) is None
    eng = Engine(target, None, EngineConfig(max_batch=2, max_len=128, num_steps=0))
    assert eng.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_engine_equals_eager_on_gpu():
    target = tiny_target().to("cuda")
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6, [8, 16, 24]]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for K in (0, 3):
        outs = []
        for graphs in (False, True):
            eng = Engine(target, head if K else None,
                         EngineConfig(max_batch=4, max_len=128, num_steps=K, cuda_graphs=graphs))
            outs.append(eng.generate(prompts, sp))
            assert (eng.graphs is not None) == graphs and (not graphs or eng.graphs.captures > 0)
        assert outs[0] == outs[1]


def test_graph_head_copies_a_live_head_into_one_module():
    target = tiny_target()
    a, b = new_head(target, draft_vocab_size=256, seed=1), new_head(target, draft_vocab_size=256, seed=2)
    gh = GraphHead()
    assert gh.load(a) is True and gh.module is not a
    ptrs = {n: p.data_ptr() for n, p in gh.module.named_parameters()}
    assert gh.load(b) is False  # same config: copied in place
    assert {n: p.data_ptr() for n, p in gh.module.named_parameters()} == ptrs
    for (n, mine), (_, theirs) in zip(gh.module.state_dict().items(), b.state_dict().items()):
        assert torch.equal(mine, theirs), n
    assert not torch.equal(gh.module.fc.weight, a.fc.weight)
    with torch.no_grad():
        b.fc.weight.add_(1.0)  # the source changing later does not reach the module
    assert not torch.equal(gh.module.fc.weight, b.fc.weight)
    other = new_head(target, draft_vocab_size=128, seed=3)
    assert gh.load(other) is True and gh.module.lm_head.weight.shape[0] == 128


class _Drafts:
    """Capture sink keeping each round's drafts (what the live head proposed)."""

    def __init__(self):
        self.rounds = []

    def should_capture(self, request_id):
        return True

    def submit(self, records):
        self.rounds += [(r.draft_version, r.request_id, r.first_pos, r.draft_tokens.tolist())
                        for r in records if not r.is_prefill]

    def end_request(self, request_id):
        pass


def _swap_sequence(graphs: bool, device: str = "cpu"):
    """Serve prompts while heads swap: staged under load (v1), idle (v2), and back to a module
    whose weights were replaced in place while it was not live (v3, as HeadSwapper reuses its
    spare). Returns the drafts of every round, the runner (or None) and its head graphs seen
    before each swap."""
    target = tiny_target().to(device)
    h0, h1 = new_head(target, draft_vocab_size=256, seed=1), new_head(target, draft_vocab_size=256, seed=2)
    sink = _Drafts()
    eng = Engine(target, h0, EngineConfig(max_batch=4, max_len=MAX_LEN, num_steps=3, swap_fill_rows=32,
                                          cuda_graphs=graphs), publisher=sink)
    if graphs and device == "cpu":  # the GPU path's bookkeeping, each shape's forward run eagerly
        eng.graphs = CudaGraphs(target, 4, MAX_LEN)
        eng.graphs.disabled = True
    seen = []

    def head_graphs():
        return set() if eng.graphs is None else {id(g) for k, g in eng.graphs._graphs.items() if k[0] == "head"}

    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    for i, p in enumerate([[5, 9, 33, 7], [1, 2, 3, 4, 5, 6], [100, 200], [42] * 5]):
        eng.add_request(Request(p, sp, request_id=f"a{i}"))
    for rnd in range(40):
        if rnd == 3:
            seen.append(head_graphs())
            eng.swap_head(h1, 1)  # staged: requests are running
        eng.step()
    assert not eng.has_work() and eng.head is h1
    seen.append(head_graphs())
    eng.swap_head(h0, 2)
    eng.step()  # idle: installed at once, nothing drafted with it
    with torch.no_grad():  # h1 is not live now: load other weights into it, then swap it back
        h1.load_state_dict(new_head(target, draft_vocab_size=256, seed=3).state_dict())
    seen.append(head_graphs())
    eng.swap_head(h1, 3)
    eng.generate([[7, 7, 8], [60, 61, 62, 63]], sp)
    seen.append(head_graphs())
    return sink.rounds, eng.graphs, seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_swaps_keep_the_head_graphs_and_draft_with_the_live_head(device):
    eager, _, _ = _swap_sequence(graphs=False, device=device)
    graphed, runner, seen = _swap_sequence(graphs=True, device=device)
    if device == "cuda":  # real graphs: the swaps to v2 and v3 reused every one of them
        assert runner.captures > 0 and runner.capture_failures == 0
    assert {v for v, *_ in eager} == {0, 1, 3}  # v1 went live under load and drafted, v2 drafted nothing
    assert graphed == eager  # every round drafted by the head that was live, its current weights
    module = runner.head.module
    assert module is not None and all(a <= b for a, b in zip(seen, seen[1:]))  # no head graph dropped
    assert seen[0] and len(runner._head_caches) <= 2
    # a head of another config gets its own module, and the old module's graphs go
    other = new_head(runner.target, draft_vocab_size=128, seed=4)
    runner.bind_head(other)
    assert runner.head.module is not module
    assert not [k for k in runner._graphs if k[0] == "head"]


def test_static_tree_batch_matches_eager_tree_attention():
    """A tree verify through `StaticTreeBatch` (padded to a bucket, whole-cache keys under the
    tree mask built from device buffers) computes what `TreeAttentionBatch` does, and padding
    rows write only into their own free slot."""
    from online_spec.kvcache import TreeAttentionBatch
    from serving.static_batch import StaticTreeBatch
    target = tiny_target()
    lens, N = [7, 12, 3], 5
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0]])
    depth = torch.zeros(3, N, dtype=torch.long)
    vis = torch.zeros(3, N, N, dtype=torch.bool)
    vis[:, 0, 0] = True
    for n in range(1, N):
        depth[:, n] = depth[torch.arange(3), parents[:, n]] + 1
        vis[:, n] = vis[torch.arange(3), parents[:, n]]
        vis[:, n, n] = True
    base = torch.tensor(lens)
    write, positions = base[:, None] + torch.arange(N), base[:, None] + depth
    eager_cache, static_cache = _prefilled(target, lens), _prefilled(target, lens)
    before = [k.clone() for k in static_cache.k]
    tokens = torch.randint(1, 500, (3, N), generator=torch.Generator().manual_seed(4))
    ref = target.forward(tokens, TreeAttentionBatch(lens, write, positions, vis), eager_cache)
    sb = StaticTreeBatch(4, N, MAX_LEN, N, "cpu")
    sb.fill(3, base, write, positions, vis)
    sb.build_mask()
    got = target.forward(torch.cat([tokens, torch.zeros(1, N, dtype=torch.long)]), sb, static_cache)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g[:3], r, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[0][3]).all()  # the padding row sees itself: no empty softmax
    for layer in range(target.info.num_layers):
        for b, n in enumerate(lens):
            torch.testing.assert_close(static_cache.k[layer][b, :, :n + N], eager_cache.k[layer][b, :, :n + N])
        assert torch.equal(static_cache.k[layer][:3, :, MAX_LEN - 8:], before[layer][:3, :, MAX_LEN - 8:])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("steps,topk,n", [(3, 2, 6), (4, 4, 12)])
def test_tree_rounds_through_the_graph_path_equal_plain_decoding(device, steps, topk, n):
    """Tree rounds through the graph runner (on CPU its capturable forwards run eagerly; on a
    GPU they are captured and replayed) give the target's own greedy output, fp32."""
    target = tiny_target().to(device)
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6, [8, 16, 24]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, num_steps=steps, speculative_eagle_topk=topk,
                                            speculative_num_draft_tokens=n))
    if device == "cpu":
        eng.graphs = CudaGraphs(target, 4, 128)
        eng.graphs.disabled = True
    assert eng.generate(prompts, sp) == plain
    kinds = {k[0] for k in eng.graphs._graphs}
    assert {"dtree", "tgreedy"} <= kinds
    if device == "cuda":
        assert eng.graphs.captures > 0 and eng.graphs.capture_failures == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_draft_chain_graph_drafts_what_the_step_by_step_loop_drafts(device):
    """A greedy batch's K draft steps as one graph (`CudaGraphs.draft_chain`; on CPU its forward
    runs eagerly through the same runner) draft exactly the eager loop's tokens: every round
    drafts the same tokens with the same probabilities, and the output is the target's own (fp32)."""
    target = tiny_target().to(device)
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6, [8, 16, 24]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    runs = []
    for graphs in (False, True):
        for K in (1, 3, 5):
            eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, num_steps=K, cuda_graphs=graphs))
            if graphs and device == "cpu":
                eng.graphs = CudaGraphs(target, 4, 128)
                eng.graphs.disabled = True
            drafted, draft = [], eng._draft

            def record(*a, draft=draft, drafted=drafted):
                out = draft(*a)
                drafted.append((out[0].tolist(), out[1].tolist()))
                return out

            eng._draft = record
            assert eng.generate(prompts, sp) == plain
            runs.append(drafted)
            if graphs:
                assert any(k[0] == "chain" and k[2] == K for k in eng.graphs._graphs)
    for eager, graphed in zip(runs[:3], runs[3:]):  # the same draft tokens, the same probabilities
        assert [t for t, _ in eager] == [t for t, _ in graphed] and len(eager) > 5
        for (_, pe), (_, pg) in zip(eager, graphed):
            torch.testing.assert_close(torch.tensor(pg), torch.tensor(pe))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_plain_rounds_keep_the_draft_cache_caught_up_with_graphs(device):
    """With the graph runner and `catch_up_plain` on, rounds at K = 0 extend the draft cache by
    their committed rows, so a round that drafts after a stretch of plain rounds has no long
    catch-up; with it off (the default), or without graphs, the drafting round catches up the rows
    served at K = 0. Output stays the target's own either way."""
    from bench.lossless import CyclingSteps

    target = tiny_target().to(device)
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200]]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    ks = (0,) * 12 + (2,)  # long plain stretches (more rows than max_steps + 1), then one drafting round
    for graphs, catch_up in ((False, True), (True, True), (True, None)):
        eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, max_steps=3, cuda_graphs=graphs),
                     policy=CyclingSteps(ks))
        if graphs and device == "cpu":
            eng.graphs = CudaGraphs(target, 4, 128)
            eng.graphs.disabled = True
        if catch_up is not None:
            eng.catch_up_plain = catch_up
        rounds = []
        eng.on_round.append(lambda s, o: rounds.append(s))
        assert eng.generate(prompts, sp) == plain
        late = [s.catchup_s for s in rounds[1:] if s.num_steps > 0]
        assert late
        if graphs and catch_up:
            assert all(c == 0 for c in late)
        else:  # the rows served at K = 0 are caught up when drafting resumes
            assert any(c > 0 for c in late)


def test_warm_graphs_covers_every_shape_chain_serving_uses():
    """`Engine.warm_graphs` (a server's start-up) creates every graph a chain round replays, so
    none is captured while serving: after it, greedy and sampled batches of 1-4 requests at
    K = 0..max_steps, with a swap staged through the spare draft cache mid-generation, add no
    graph. On CPU the runner's captures are off (each shape's capturable forward runs eagerly),
    which is how its shapes are counted here; the dummy rows it writes leak into no output."""
    from online_spec.controller import StaticSteps

    target = tiny_target()
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6, [8, 16, 24]]
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, max_steps=4, num_steps=2, swap_fill_rows=16))
    eng.graphs = CudaGraphs(target, 4, 128)
    eng.graphs.disabled = True
    eng.graphs.bind_head(head)
    info = eng.warm_graphs()
    assert info["graphs"] == 0 and info["seconds"] >= 0  # nothing captured on CPU
    warmed = set(eng.graphs._graphs)
    # prefill and head-fill chunks; per bucket (1, 2, 4): verify T = 1..5; per draft cache (2): catch-up T = 1..5, one own-hidden step, chains K = 1..4
    assert len(warmed) == 4 * (1 + 2) + 3 * 5 + 3 * 2 * (5 + 1 + 4)  # chunks of 16..128: prefill, 2 head fills
    for k in range(5):
        eng.set_policy(StaticSteps(k))
        for n in (1, 2, 4, 5):
            assert eng.generate(prompts[:n], sp) == plain[:n], (k, n)
    sampled = SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, seed=3)
    eng.generate(prompts[:3], [sp, sampled, sp])
    # a swap mid-generation: staged through the spare cache, then live on it
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    plain_long = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts[:4], long)
    reqs = [eng.add_request(Request(list(p), long)) for p in prompts[:4]]
    eng.step()
    eng.swap_head(new_head(target, draft_vocab_size=256, seed=2), 1)
    versions = []
    while eng.has_work():
        eng.step()
        versions.append(eng.head_version)
    assert [r.output_ids for r in reqs] == plain_long and versions[0] == 0 and versions[-1] == 1
    assert set(eng.graphs._graphs) == warmed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("P", [1, 16, 37, 600, 1010])
def test_graphed_prefill_chunks_compute_the_eager_prefill(P, device):
    """`CudaGraphs.prefill` (chunks of fixed sizes, the slot a device buffer; on CPU its
    capturable forward runs eagerly) gives the eager prefill's last logits, features and final
    hidden, writes the slot's rows 0..P-1 as the eager forward does, and leaves the other slots'
    rows alone: 600 tokens run as 512 + 88 padded to 128; 1010 in a cache of 1024 rows pads its
    last chunk past the cache's end (those rows clamp to the last row)."""
    from serving.cuda_prefill import chunk_plan

    target = tiny_target().to(device)
    max_len = 1024
    ids = torch.randint(1, 500, (P,), generator=torch.Generator().manual_seed(P))
    eager = target.new_cache(3, max_len)
    logits, feats, final = target.forward(ids[None].to(device), AttentionBatch([0], P, device), _view(eager, 1),
                                          logits_rows=slice(-1, None))
    graphs = CudaGraphs(target, 3, max_len)
    graphs.disabled = device == "cpu"
    cache = target.new_cache(3, max_len)
    before = [c.clone() for c in cache.k]
    last, f, h = graphs.prefill(ids, 1, cache)
    assert torch.allclose(last, logits[0, -1], atol=1e-4) and torch.allclose(f, feats[0], atol=1e-4)
    assert torch.allclose(h, final[0], atol=1e-4) and f.shape[0] == P
    for layer in range(len(cache.k)):
        assert torch.allclose(cache.k[layer][1, :, :P], eager.k[layer][1, :, :P], atol=1e-4)
        assert torch.equal(cache.k[layer][[0, 2]], before[layer][[0, 2]])
    sizes = {c for _, _, c in chunk_plan(P)}
    assert sum(n for _, n, _ in chunk_plan(P)) == P and len(graphs._graphs) == len(sizes)
    assert graphs.captures == (len(sizes) if device == "cuda" else 0) and graphs.capture_failures == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_graphed_head_fill_writes_the_eager_fill_cache_rows(device):
    """`CudaGraphs.head_fill` (the head's catch-up over a new prompt in chunk replays) writes
    the draft cache rows `EagleHead.fill_cache` writes, into its slot only: 300 rows from row 5
    run as 256 + 44 padded to 64."""
    target = tiny_target().to(device)
    head = new_head(target, draft_vocab_size=256, seed=1).to(device)
    T, start, slot = 300, 5, 2
    g = torch.Generator().manual_seed(0)
    emb = target.embed_tokens(torch.randint(1, 500, (1, T), generator=g).to(device))
    hid = torch.randn(1, T, 3 * target.info.hidden_size, generator=g).to(device)
    eager = head.new_cache(3, 1024)
    head.fill_cache(emb, hid, slot, start, eager, target.rope)
    graphs = CudaGraphs(target, 3, 1024)
    graphs.disabled = device == "cpu"
    cache = head.new_cache(3, 1024)
    graphs.head_fill(head, cache, emb[0], hid[0], slot, start)
    for a, b in ((cache.k[0], eager.k[0]), (cache.v[0], eager.v[0])):
        assert torch.allclose(a[slot, :, start:start + T], b[slot, :, start:start + T], atol=1e-4)
        assert not a[[0, 1]].any() and not a[slot, :, :start].any()


def test_warm_graphs_covers_a_static_tree():
    """With a static tree (SGLang's flags: topk 2, depth 3, 6 draft tokens) the start-up warm-up
    also creates the tree's frontier-step and verify graphs: serving greedy batches of 1-4 adds
    none, and the output is the target's (on CPU with captures off, as above)."""
    target = tiny_target()
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, max_steps=3, num_steps=3,
                                            speculative_eagle_topk=2, speculative_num_draft_tokens=6))
    eng.graphs = CudaGraphs(target, 4, 128)
    eng.graphs.disabled = True
    eng.graphs.bind_head(head)
    eng.warm_graphs()
    warmed = set(eng.graphs._graphs)
    assert {k[0] for k in warmed} >= {"dtree", "ttarget", "tgreedy"}
    for n in (1, 2, 4):
        assert eng.generate(prompts[:n], sp) == plain[:n]
    assert set(eng.graphs._graphs) == warmed


def test_warm_graphs_covers_the_trees_a_policy_may_pick():
    """A cost policy that picks trees round by round (candidates [3, 2, 6] and [2, 4, 5]): the
    start-up warm-up creates every candidate's graphs, so serving batches of 1-4 while the policy
    tries both adds none, and the output is the target's (on CPU with captures off, as above)."""
    from online_spec.controller import AdaptiveConfig, CostModel, CostModelPolicy
    from online_spec.tree import TreeShape

    target = tiny_target()
    head = new_head(target, draft_vocab_size=256, seed=1)
    prompts = [[5, 9, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200], [42] * 6]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3],
                                               "tree_candidates": [[3, 2, 6], [2, 4, 5]]}})
    policy = CostModelPolicy(adaptive, cost_model=CostModel.with_coefficients([0.004, 0, 0, 0, 0],
                                                                              [0.04, 0, 0.004, 0, 0]))
    assert policy.tree_shapes() == [TreeShape(3, 2, 6), TreeShape(2, 4, 5)]
    eng = Engine(target, head, EngineConfig(max_batch=4, max_len=128, max_steps=3), policy=policy)
    eng.graphs = CudaGraphs(target, 4, 128)
    eng.graphs.disabled = True
    eng.graphs.bind_head(head)
    eng.warm_graphs()
    warmed = set(eng.graphs._graphs)
    for n in (1, 2, 4):
        assert eng.generate(prompts[:n], sp) == plain[:n]
    trees = policy.info()["slots"]["1"]["trees"]  # per batch-size bucket: 1, 2-3, 4-7
    assert all(trees[b]["3,2,6"]["rounds"] > 0 and trees[b]["2,4,5"]["rounds"] > 0 for b in ("1", "2", "4"))
    assert set(eng.graphs._graphs) == warmed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (on a CPU no K = 0 round catches up)")
def test_plain_rounds_left_to_the_next_drafting_round_draft_the_same():
    """`catch_up_plain` off: K = 0 rounds leave the draft cache behind and the next drafting round
    catches it up in chunk replays. Its drafts are those of the engine that caught up every K = 0
    round (the same rows of the draft cache, written by other kernels: equal up to fp32 rounding,
    so the argmaxes agree), and the output is plain decoding's."""
    from bench.lossless import CyclingSteps

    torch.manual_seed(0)
    target = tiny_target().to("cuda")
    head = new_head(target, draft_vocab_size=256, seed=4).to("cuda")
    prompts = [[5, 9, 33, 7, 2], [1, 2, 3, 4, 5, 6, 7], [100, 200, 300], [8, 8, 9]]
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = Engine(target, None, EngineConfig(max_batch=4, max_len=256, num_steps=0)).generate(prompts, sp)
    drafts = {}
    for catch_up in (True, False):
        eng = Engine(target, head, EngineConfig(max_batch=4, max_len=256, num_steps=3, max_steps=7),
                     policy=CyclingSteps([0] * 12 + [3] * 4))
        eng.catch_up_plain = catch_up
        seen, draft = [], eng._draft
        eng._draft = lambda *a: (lambda out: seen.append(out[0].cpu().tolist()) or out)(draft(*a))
        assert eng.generate(prompts, sp) == plain
        drafts[catch_up] = seen
    assert len(drafts[True]) >= 3 and drafts[True] == drafts[False]
