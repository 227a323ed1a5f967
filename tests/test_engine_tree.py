"""Draft trees (topk > 1): the tree bookkeeping, the tree attention against a naive reference,
exact acceptance, and the lossless invariant on the real SmolLM2 with the shipped head.

- `select_nodes` keeps a tree (every kept node's parent kept, parents numbered first) and the
  best-scoring candidates, checked against a plain-Python reference on random candidates.
- A tree verify (one forward, `TreeAttentionBatch`) gives every node the logits and features of
  the chain root -> node run on its own (`AttentionBatch`), on a tiny model.
- Tree rejection sampling: the committed tokens' law equals the target's, by chi-square over
  seeded samples on a hand-built tree (a sampler that forgot to remove a rejected child's mass
  fails it: negative control), and through the engine on a tiny model (first sampled token of a
  tree round against the exactly enumerated law).
- fp32 greedy through the engine: token-identical to plain decoding for top-k 2/4/8, 6-32
  draft tokens, batch 1/4/8, the shipped head, a random and a garbage head, and heads swapped
  mid-generation; capture records of tree rounds join like a chain's.
"""

import random

import pytest
import torch

from online_spec.capture import adjacency_error
from online_spec.checkpoint import load_head
from online_spec.config import ConfigError
from online_spec.controller import AdaptiveConfig, EmaTierPolicy
from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch, TreeAttentionBatch
from online_spec.sampling import SamplingParams, probs_from_logits
from online_spec.target import tiny_target
from online_spec.tree import (DraftTree, TreeShape, accept_greedy, accept_sampled, greedy_path, select_nodes,
                               wide_topk)
from serving.engine import Engine, EngineConfig, _SlotView
from bench.heads import SHIPPED_HEAD
from bench.lossless import CyclingSteps, wrong_head
from test_engine_sampling import PROMPT, VOCAB, chi2_quantile_999, chi2_stat, exact_two_token_law

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


# -- tree bookkeeping ---------------------------------------------------------------------------

def _random_candidates(rng, B, k, steps):
    """Candidates as drafting makes them: topk at depth 1, topk children under each of the topk
    best frontier nodes per later step; scores are summed log-probabilities."""
    toks, pars, scores = [], [], []
    for b in range(B):
        t, p, s = [], [], []
        frontier = []
        for j in range(k):
            t.append(rng.randrange(1000)); p.append(-1); s.append(-rng.random() * 3)
            frontier.append(j)
        for _ in range(steps - 1):
            new = []
            for f in frontier:
                for _ in range(k):
                    t.append(rng.randrange(1000)); p.append(f)
                    # ties with the parent happen (a child of probability 1)
                    s.append(s[f] - (0.0 if rng.random() < 0.1 else rng.random() * 2))
                    new.append(len(t) - 1)
            frontier = sorted(new, key=lambda c: -s[c])[:k]
        toks.append(t); pars.append(p); scores.append(s)
    return torch.tensor(toks), torch.tensor(pars), torch.tensor(scores)


def _reference_visible(parents: torch.Tensor) -> torch.Tensor:
    """Node n sees itself and what its parent sees (parents numbered first)."""
    B, N = parents.shape
    vis = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            if n:
                vis[b, n] = vis[b, int(parents[b, n])]
            vis[b, n, n] = True
    return vis


def _select(toks, pars, scores, n, steps) -> tuple[DraftTree, torch.Tensor]:
    tokens, parents, depth, probs, visible = select_nodes(toks, pars, scores, scores.exp(),
                                                          torch.arange(toks.shape[0]), n, steps)
    return DraftTree(tokens, parents, depth, probs), visible


@pytest.mark.parametrize("k, steps, n", [(2, 3, 6), (4, 5, 8), (4, 4, 16), (8, 6, 32), (3, 2, 12)])
def test_select_nodes_keeps_a_tree_of_the_best_candidates(k, steps, n):
    """`select_nodes` (what a graphed round runs: no read-back) keeps the best candidates as a
    tree under the root, with each node's depth and a visibility that of a node-by-node walk."""
    rng = random.Random(k * 100 + steps)
    toks, pars, scores = _random_candidates(rng, 4, k, steps)
    tree, visible = _select(toks, pars, scores, n, steps)
    C = toks.shape[1]
    assert tree.tokens.shape == (4, min(n, C + 1))
    for b in range(4):
        # reference: the best n-1 by score, ties to the earlier candidate
        want = sorted(sorted(range(C), key=lambda c: (-float(scores[b, c]), c))[:n - 1])
        assert tree.tokens[b, 1:].tolist() == [int(toks[b, c]) for c in want]
        for col, c in enumerate(want, 1):
            p = int(pars[b, c])
            pcol = int(tree.parents[b, col])
            assert pcol < col
            assert (p < 0 and pcol == 0) or (pcol > 0 and want[pcol - 1] == p)
            assert int(tree.depth[b, col]) == int(tree.depth[b, pcol]) + 1
    assert torch.equal(visible, _reference_visible(tree.parents))
    assert torch.equal(tree.visible(), visible)


@pytest.mark.parametrize("shape, k", [((1, 8, 8192), 8), ((3, 4, 8192), 4), ((2, 8192), 1), ((5, 1000), 8),
                                      ((2, 3, 4096), 16)])
def test_wide_topk_gives_topks_values_and_their_indices(shape, k):
    """The drafting step's two-pass top-k: the values `topk` gives, in order, and indices that
    point at them; the best of a row may sit in any chunk (a planted maximum in the last chunk).
    Duplicated values (bf16 log-probabilities tie) keep their count."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=g).mul(4).round()  # many ties
    x[..., -1] = 100.0
    v, i = wide_topk(x, k, two_pass=True)  # the GPU's path, here on the CPU
    want_v, _ = x.topk(k, -1)
    assert torch.equal(v, want_v)
    assert torch.equal(x.gather(-1, i), v)
    assert bool((i[..., 0] == shape[-1] - 1).all())
    assert all(len(set(row)) == k for row in i.reshape(-1, k).tolist())  # k distinct entries a row


@pytest.mark.parametrize("k, steps, n", [(2, 3, 6), (4, 5, 8), (4, 4, 16), (8, 6, 32)])
def test_greedy_path_matches_the_host_walk(k, steps, n):
    """`greedy_path` (a greedy batch's walk on the device) accepts what `accept_greedy` accepts,
    on random target choices that follow the tree for a random number of levels."""
    rng = random.Random(k * 10 + steps)
    B = 6
    toks, pars, scores = _random_candidates(rng, B, k, steps)
    tree, _ = _select(toks, pars, scores, n, steps)
    tokens, parents, depth = tree.tokens, tree.parents, tree.depth
    kids = tree.children()
    seen = set()
    for trial in range(40):
        # the target agrees along a random branch for a random number of levels, then disagrees;
        # off that branch it often agrees with a child of a node the walk never reaches (only a
        # walk that checks every ancestor ignores those)
        choice = torch.randint(1000, 2000, (B, tokens.shape[1]))
        for b in range(B):
            for u in range(tokens.shape[1]):
                if kids[b][u] and rng.random() < 0.5:
                    choice[b, u] = tokens[b, rng.choice(kids[b][u])]
            u, levels = 0, rng.randrange(steps + 1)
            for _ in range(levels):
                if not kids[b][u]:
                    break
                c = rng.choice(kids[b][u])
                choice[b, u] = tokens[b, c]
                u = c
        a, path, bonus = greedy_path(tokens, parents, depth, choice, steps)
        for b in range(B):
            want_path, want_bonus = accept_greedy(tokens[b].tolist(), kids[b], choice[b].tolist())
            assert path[b, :int(a[b])].tolist() == want_path and int(bonus[b]) == want_bonus
            assert not path[b, int(a[b]):].any()
            seen.add(int(a[b]))
    assert len(seen) >= 3  # the trials reached several path lengths, the empty path included
    assert 0 in seen


def test_tree_shape_validates_and_caps():
    assert TreeShape(5, 4, 8).footprint == 17 and TreeShape(5, 4, 8).max_nodes == 68  # 16 scratch rows + 1
    assert TreeShape.capped(1, 4, 8).num_draft_tokens == 5  # depth 1 drafts 4 nodes
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        TreeShape(2, 2, 9)
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        EngineConfig(num_steps=3, speculative_num_draft_tokens=6)  # a chain verifies num_steps + 1
    with pytest.raises(ConfigError, match="speculative_eagle_topk"):
        EngineConfig(speculative_eagle_topk=0)


def test_chain_only_policies_are_refused_with_trees():
    t = tiny_target(vocab_size=64, hidden_size=32, num_layers=2)
    ema = EmaTierPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3]}}), initial_steps=1)
    with pytest.raises(ConfigError, match="chain rounds only"):
        Engine(t, new_head(t, draft_vocab_size=32), EngineConfig(max_len=64, speculative_eagle_topk=2), policy=ema)
    eng = Engine(t, new_head(t, draft_vocab_size=32), EngineConfig(max_len=64, speculative_eagle_topk=2))
    with pytest.raises(ConfigError, match="chain rounds only"):
        eng.set_policy(ema)


# -- tree attention against the chain reference -----------------------------------------------

def test_tree_verify_equals_each_path_run_as_a_chain():
    t = tiny_target(vocab_size=64, hidden_size=32, num_layers=3, seed=4).float()
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [10, 11, 12, 13, 14, 15, 16]]
    B = len(prompts)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3]  # root; two children; grandchildren; depth 3
    N = len(parents)
    cache = t.new_cache(B, 64)
    base = []
    for b, p in enumerate(prompts):
        view = _SlotView(cache, b)
        t.forward(torch.tensor([p[:-1]]), AttentionBatch([0], len(p) - 1), view)
        base.append(len(p) - 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (B, N), generator=g)
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    depth = [0] * N
    for n in range(1, N):
        depth[n] = depth[parents[n]] + 1
    tree = DraftTree(tokens, torch.tensor([parents] * B), torch.tensor([depth] * B), torch.ones(B, N))
    b0 = torch.tensor(base)
    batch = TreeAttentionBatch(base, b0[:, None] + torch.arange(N), b0[:, None] + tree.depth, tree.visible())
    logits, feats, _ = t.forward(tokens, batch, cache)
    for b, p in enumerate(prompts):
        for n in range(N):
            path, u = [], n
            while u >= 0:
                path.append(u)
                u = parents[u]
            path.reverse()
            ids = torch.tensor([p[:-1] + [int(tokens[b, c]) for c in path]])
            ref_cache = t.new_cache(1, 64)
            ref_logits, ref_feats, _ = t.forward(ids, AttentionBatch([0], ids.shape[1]), ref_cache)
            assert torch.allclose(logits[b, n], ref_logits[0, -1], atol=1e-4), (b, n)
            assert torch.allclose(feats[b, n], ref_feats[0, -1], atol=1e-4), (b, n)


# -- exact acceptance ---------------------------------------------------------------------------

def _hand_tree():
    """Root children a=1, b=2 (in that order); a's children c=3, d=0; b a leaf. V = 5."""
    tokens = [4, 1, 2, 3, 0]
    children = [[1, 2], [3, 4], [], [], []]
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(5, 5, generator=g) * 1.2, -1)
    return tokens, children, p


def _sample_law(sampler, n=30000):
    tokens, children, p = _hand_tree()
    gen = torch.Generator().manual_seed(123)
    first, second_a, second_b = {}, {}, {}
    for _ in range(n):
        path, bonus = sampler(tokens, children, p, gen)
        seq = [tokens[c] for c in path] + [bonus]
        first[(seq[0],)] = first.get((seq[0],), 0) + 1
        if len(seq) > 1 and seq[0] == 1:
            second_a[(seq[1],)] = second_a.get((seq[1],), 0) + 1
        if len(seq) > 1 and seq[0] == 2:
            second_b[(seq[1],)] = second_b.get((seq[1],), 0) + 1
    return p, first, second_a, second_b


def test_tree_rejection_sampling_commits_the_target_law():
    p, first, second_a, second_b = _sample_law(accept_sampled)
    for counts, law in ((first, p[0]), (second_a, p[1]), (second_b, p[2])):
        n = sum(counts.values())
        stat, df = chi2_stat(counts, {(t,): float(law[t]) for t in range(5)}, n)
        assert stat < chi2_quantile_999(df), (stat, df, counts)
    assert sum(second_a.values()) > 1000 and sum(second_b.values()) > 1000  # both branches were walked


def _forgetful_sampler(tokens, children, p, gen):
    """A broken sampler: tries children against p without removing a rejected child's mass."""
    path, u = [], 0
    while True:
        taken = next((c for c in children[u] if float(torch.rand((), generator=gen)) < float(p[u, tokens[c]])), None)
        if taken is None:
            return path, int(torch.multinomial(p[u], 1, generator=gen))
        path.append(taken)
        u = taken


def test_tree_sampling_test_sees_a_broken_sampler():
    p, first, _, _ = _sample_law(_forgetful_sampler)
    stat, df = chi2_stat(first, {(t,): float(p[0, t]) for t in range(5)}, sum(first.values()))
    assert stat > chi2_quantile_999(df)


def test_greedy_walk_follows_the_target_argmax():
    tokens, children, _ = _hand_tree()
    assert accept_greedy(tokens, children, [1, 0, 9, 9, 7]) == ([1, 4], 7)  # a -> d, bonus 7
    assert accept_greedy(tokens, children, [2, 0, 6, 9, 9]) == ([2], 6)  # b (a leaf), bonus 6
    assert accept_greedy(tokens, children, [3, 0, 0, 0, 0]) == ([], 3)  # nothing drafted matched


@pytest.mark.parametrize("topk, n", [(2, 6), (4, 10)])
def test_tree_engine_sampling_matches_target_distribution(topk, n):
    m = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=1)
    with torch.no_grad():
        m.hf.lm_head.weight.mul_(0.3)
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    head = new_head(m, draft_vocab_size=9, seed=2)
    with torch.no_grad():
        head.lm_head.weight.mul_(40.0)
    law = exact_two_token_law(m, params)
    N = 3000
    eng = Engine(m, head, EngineConfig(max_batch=64, max_len=32, num_steps=3, speculative_eagle_topk=topk,
                                       speculative_num_draft_tokens=n))
    accepted = []
    eng.on_round.append(lambda s, o: accepted.extend(s.accepted if s.num_steps else []))
    outs = eng.generate([PROMPT] * N, [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(N)])
    counts = {}
    for o in outs:
        counts[tuple(o[:2])] = counts.get(tuple(o[:2]), 0) + 1
    stat, df = chi2_stat(counts, law, N)
    assert stat < chi2_quantile_999(df), (stat, df)
    assert sum(accepted) > 0


# -- lossless on the real model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(plain_greedy_fp32):
    return plain_greedy_fp32[0][:16]


@pytest.fixture(scope="module")
def reference(plain_greedy_fp32):
    """Plain greedy decoding, the first 32 tokens of the chain module's (conftest.plain_greedy_fp32)."""
    outs = plain_greedy_fp32[1][:16]
    assert all(len(o) >= GREEDY.max_tokens for o in outs)
    return [o[:GREEDY.max_tokens] for o in outs]


@pytest.fixture(scope="module")
def shipped(smol_fp32):
    return load_head(str(SHIPPED_HEAD), smol_fp32.info, dtype=torch.float32)[0]


@pytest.mark.slow
@pytest.mark.parametrize("steps, topk, n, batch, head_kind", [
    (5, 4, 8, 4, "shipped"), (3, 2, 6, 8, "shipped"), (6, 8, 32, 1, "shipped"), (4, 4, 16, 8, "random"),
    (5, 4, 8, 4, "wrong"),
])
def test_tree_greedy_fp32_token_identical(smol_fp32, shipped, prompts, reference, steps, topk, n, batch, head_kind):
    head = {"shipped": shipped, "random": new_head(smol_fp32, seed=steps), "wrong": wrong_head(smol_fp32)}[head_kind]
    cfg = EngineConfig(max_batch=batch, max_len=512, num_steps=steps, max_steps=7, speculative_eagle_topk=topk,
                       speculative_num_draft_tokens=n)
    records = []
    sink = type("Sink", (), {"should_capture": lambda self, rid: True, "submit": lambda self, r: records.extend(r),
                             "end_request": lambda self, rid: None})()
    eng = Engine(smol_fp32, head, cfg, publisher=sink)
    rounds = []
    eng.on_round.append(lambda s, o: rounds.append(s))
    k = 4 if batch > 1 else 2
    assert eng.generate(prompts[:k], GREEDY) == reference[:k]
    assert {(s.topk, s.num_draft_tokens) for s in rounds} == {(topk, n)}
    if head_kind == "shipped":
        assert sum(sum(s.accepted) for s in rounds) / sum(len(s.accepted) for s in rounds) > 1.0
    # capture: per request, the records continue each other and spell the output
    by_req = {}
    for r in records:
        by_req.setdefault(r.request_id, []).append(r)
    assert len(by_req) == k
    for recs in by_req.values():
        for prev, rec in zip(recs, recs[1:]):
            assert adjacency_error(prev, rec) is None
            assert 0 <= rec.accept_len <= rec.num_steps == len(rec.draft_tokens)
            assert rec.draft_tokens[:rec.accept_len].tolist() == rec.tokens[1:rec.accept_len + 1].tolist()


@pytest.mark.slow
def test_tree_host_path_keeps_a_greedy_request_beside_a_sampled_one(smol_fp32, shipped, prompts, reference):
    """A batch with a sampling request verifies on the host path (acceptance, K/V commit, rows
    gathered there): the greedy requests beside it still get the target's greedy tokens."""
    eng = Engine(smol_fp32, shipped, EngineConfig(max_batch=4, max_len=512, num_steps=5, max_steps=7,
                                                  speculative_eagle_topk=4, speculative_num_draft_tokens=8))
    rounds = []
    eng.on_round.append(lambda s, o: rounds.append(s))
    sampled = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=11)
    outs = eng.generate(prompts[:3], [GREEDY, sampled, GREEDY])
    assert [outs[0], outs[2]] == [reference[0], reference[2]]
    assert sum(sum(s.accepted) for s in rounds) > len(rounds)  # paths were accepted and committed


@pytest.mark.slow
def test_tree_heads_swapped_mid_generation_keep_output(smol_fp32, shipped, prompts, reference):
    heads = [shipped, wrong_head(smol_fp32), None, new_head(smol_fp32, seed=12)]
    eng = Engine(smol_fp32, heads[0], EngineConfig(max_batch=8, max_len=512, max_steps=6, swap_fill_rows=0,
                                                   speculative_eagle_topk=4, speculative_num_draft_tokens=12),
                 policy=CyclingSteps((1, 3, 6, 2)))
    swaps, rounds = [], []

    def swap_every_4(stats, outs):
        if len(swaps) * 4 <= len(rounds):
            v = len(swaps) + 1
            eng.swap_head(heads[v % len(heads)], v)
            swaps.append(v)
        rounds.append(stats.swapped)

    eng.on_round.append(swap_every_4)
    assert eng.generate(prompts[8:16], GREEDY) == reference[8:16]
    # swaps really landed between rounds: 7 in 26 rounds at 32 tokens (2026-11-27, AVX2 CPU), every
    # head of the cycle live at least once
    assert sum(rounds) >= 6


def test_a_tree_round_maps_drafts_through_the_live_heads_map():
    """A swapped-in head with another draft-to-target map is drafted through its own: every
    drafted target id of a tree round lies in the live head's map (a stale map would draft other
    ids, and the output would stay lossless)."""
    t = tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=3).float()
    first, second = new_head(t, draft_vocab_size=16, seed=1), new_head(t, draft_vocab_size=16, seed=2)
    second.draft_to_target.copy_(torch.arange(40, 56))  # ids the first head never drafts
    assert not set(first.draft_to_target.tolist()) & set(second.draft_to_target.tolist())
    eng = Engine(t, first, EngineConfig(max_batch=2, max_len=128, max_steps=3, num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=6))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for head in (first, second):
        eng.swap_head(head, 2 if head is second else 1)
        drafted = []
        original = eng._draft_tree

        def spy(reqs, tlen, shape):
            tree = original(reqs, tlen, shape)
            drafted.extend(tree[0][:, 1:].flatten().tolist())  # (tokens, parents, depth, probs, visible)
            return tree

        eng._draft_tree = spy
        eng.generate([[1, 2, 3, 4], [5, 6, 7]], sp)
        del eng._draft_tree
        assert drafted and set(drafted) <= set(head.draft_to_target.tolist())
