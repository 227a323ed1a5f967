"""Tree rounds of the engine: draft a tree, verify it in one target forward, accept a path.

`TreeRounds` is the part of `Engine` (serving/engine.py) that runs a round whose shape has
`topk > 1` (online_spec/tree.py: `TreeShape`, SGLang's `num_steps`, `topk`,
`num_draft_tokens`):

1) draft (`_draft_tree`): the draft cache is caught up on committed rows as for a chain; then
   `EagleHead.draft_tree` expands the tree step by step (the `topk` best children of each of the
   `topk` best frontier nodes, frontier rows in the draft cache's scratch region past the
   committed rows, each attending to the committed rows and its own ancestors) and keeps the best
   `num_draft_tokens - 1` candidates under the root, laid out for the verify (depth, visibility),
   all on the device.
2) verify: one target forward over [root, nodes] per request, rows at the target cache's
   positions L..L+N-1, rope at L + depth, a tree attention mask.
3) accept: greedy (a batch of greedy requests: on the device, `verify_greedy`) or exact
   multi-candidate rejection sampling on the host (online_spec/tree.py).
4) commit: the accepted path's target K/V moves to consecutive rows (`KVCache.gather_rows`);
   nothing else of the tree stays in either cache (the draft cache's committed length is reset,
   as after a chain round, and its scratch rows are rewritten next round).
5) capture: the committed path's rows, exactly like a chain round's record (contract 1); its
   drafts are the path's accepted nodes and, at the first rejection, the first child tried.

On CUDA the drafting is one graph replay and a greedy batch's verify, walk and K/V commit one
more (serving/cuda_tree.py); the host reads the round back once (path, bonus and the tree, in a
host window). On a CPU the same functions run eagerly. A policy must declare `tree_rounds`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from online_spec.capture import CaptureRound, RoundRow
from online_spec.host_window import upload
from online_spec.kvcache import TreeAttentionBatch
from online_spec.sampling import probs_from_logits
from online_spec.tree import DraftTree, TreeShape, accept_greedy, accept_sampled, greedy_path
from serving.capture_rows import RowStaging


def verify_greedy(target, cache, tokens: torch.Tensor, batch, base: torch.Tensor, parents: torch.Tensor,
                  depth: torch.Tensor, num_steps: int):
    """A greedy batch's tree verified, walked and committed on the device, no read-back: the
    target's forward over tokens [B, N] (`batch`: the tree's attention layout), its argmax, the
    accepted path (`greedy_path`), the path's K/V moved from its tree rows base + column to
    base + 1.. (`KVCache.gather_rows`; past the path, the root's row onto itself). -> (accepted
    [B], bonus [B], path [B, num_steps] columns, features and final hidden [B, num_steps + 1, .]
    of the committed rows: the root's, then the path's)."""
    logits, feats, final = target.forward(tokens, batch, cache)
    a, path, bonus = greedy_path(tokens, parents, depth, logits.argmax(-1), num_steps)
    j = torch.arange(num_steps, device=tokens.device)
    valid = j[None] < a[:, None]
    on_path = torch.where(valid, path, 0)
    cache.gather_rows(base[:, None] + on_path, base[:, None] + torch.where(valid, j + 1, 0))
    rows = torch.cat([torch.zeros_like(path[:, :1]), on_path], 1)[..., None]
    return (a, bonus, path, feats.gather(1, rows.expand(-1, -1, feats.shape[-1])),
            final.gather(1, rows.expand(-1, -1, final.shape[-1])))


class DeviceTree(NamedTuple):
    """A drafted tree on the device (`select_nodes`' layout), and base [B]: each request's
    committed length, where the tree's rows start in the target cache."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    probs: torch.Tensor
    visible: torch.Tensor
    base: torch.Tensor


class TreeRounds(RowStaging):
    """Drafting, verifying and committing draft trees; mixed into `Engine`."""

    def _draft_tree(self, reqs, tlen: list[int], shape: TreeShape) -> "DeviceTree":
        """1) -> the selected tree on the device."""
        head, dev = self.head, self.target.device
        logits, hidden = self._extend_draft(tlen)  # [B, Vd], [B, H] after the last committed row
        root = upload(self.tok_buf[:len(tlen)].gather(1, torch.tensor(tlen)[:, None])[:, 0], dev)
        base = upload(tlen, dev)
        if self.graphs is not None:
            tree = self.graphs.draft_tree(head, self.dcache, logits, hidden, base, root, shape)
        else:
            def at(write, positions, visible):
                return TreeAttentionBatch(tlen, write.cpu(), positions.cpu(), visible.cpu(), dev)

            tree = head.draft_tree(self.target.embed_tokens, self.target.rope, self.dcache, logits, hidden, base,
                                   root, shape, at)
        for b in range(len(tlen)):  # scratch rows are dropped; the next extend rewrites from tlen
            self.dcache.lengths[b] = tlen[b]
        return DeviceTree(*tree, base)

    def _verify_tree(self, reqs, tlen: list[int], tree, shape: TreeShape):
        """2) verify, 3) accept, 4) commit, 5) capture for a tree. Returns (accepted, records, outputs)."""
        tokens, parents, depth, probs, visible, base = tree
        B, N = tokens.shape
        dev, steps = self.target.device, shape.num_steps
        write, positions = base[:, None] + torch.arange(N, device=dev), base[:, None] + depth
        if self.graphs is None:  # the eager forward's attention batch
            batch = TreeAttentionBatch(tlen, write.cpu(), positions.cpu(), visible.cpu(), dev)
        if all(r.params.greedy for r in reqs):
            if self.graphs is not None:
                out = self.graphs.tree_verify_greedy(tokens, parents, depth, base, write, positions, visible, steps,
                                                     self.tcache)
            else:
                out = verify_greedy(self.target, self.tcache, tokens, batch, base, parents, depth, steps)
            self.timeline.mark("verify")
            a, bonus, path, feats, final = out
            # one read-back (in a host window on a GPU): ids are exact in float32 (below 2^24)
            host = self._host(torch.cat([a[:, None].float(), bonus[:, None].float(), path.float(),
                                         tokens.float(), parents.float(), depth.float(), probs], 1), long=True)
            head_cols = host[:, :2 + steps].long()
            tok_h, par_h, dep_h, prob_h = host[:, 2 + steps:].split(N, 1)
            paths = [head_cols[b, 2:2 + int(head_cols[b, 0])].tolist() for b in range(B)]
            bonus_h = head_cols[:, 1].tolist()
            host_tree = DraftTree(tok_h.long(), par_h.long(), dep_h.long(), prob_h)
        else:
            if self.graphs is not None:
                logits, feats, final = self.graphs.tree_target_forward(tokens, base, write, positions, visible,
                                                                       self.tcache)
            else:
                logits, feats, final = self.target.forward(tokens, batch, self.tcache)  # [B, N, V]
            self.timeline.mark("verify")
            host = self._host(torch.cat([tokens.float(), parents.float(), depth.float(), probs,
                                         logits.argmax(-1).float()], 1), long=True)
            tok_h, par_h, dep_h, prob_h, choice_h = host.split(N, 1)
            host_tree = DraftTree(tok_h.long(), par_h.long(), dep_h.long(), prob_h)
            kids, tok_l, choice_l = host_tree.children(), host_tree.tokens.tolist(), choice_h.long().tolist()
            paths, bonus_h = [], []
            for b, r in enumerate(reqs):
                if r.params.greedy:
                    path, nxt = accept_greedy(tok_l[b], kids[b], choice_l[b])
                else:
                    path, nxt = accept_sampled(tok_l[b], kids[b], probs_from_logits(logits[b].cpu(), r.params), r.gen)
                paths.append(path)
                bonus_h.append(nxt)
            # each request's committed columns: the root's, then its path's (padding: the root's)
            amax = max(len(p) for p in paths)
            cols = torch.tensor([[0] + p + [0] * (amax - len(p)) for p in paths])  # [B, amax + 1]
            if amax:  # the path's target K/V into consecutive rows L+1..L+a (padding: the root onto itself)
                base, j = torch.tensor(tlen)[:, None], torch.arange(1, amax + 1)
                on_path = j[None] <= torch.tensor([len(p) for p in paths])[:, None]
                self.tcache.gather_rows((base + cols[:, 1:]).to(dev), (base + torch.where(on_path, j, 0)).to(dev))
            cols = cols.to(dev)[..., None]  # their features and final hidden in one gather
            feats = feats.gather(1, cols.expand(-1, -1, feats.shape[-1]))
            final = final.gather(1, cols.expand(-1, -1, final.shape[-1]))
        return self._commit_tree(reqs, tlen, host_tree, paths, bonus_h, feats, final, steps)

    def _commit_tree(self, reqs, tlen: list[int], tree: DraftTree, paths: list[list[int]], bonus: list[int],
                     feats: torch.Tensor, final: torch.Tensor, steps: int):
        """4) commit each request's accepted path and bonus (host bookkeeping; the K/V moved
        already), 5) capture. feats / final [B, R, .]: row t of request b is its t-th committed
        row (the root's, then its path's; padding past it), fresh tensors of this round. The
        capture is a chain round's (`CaptureRound`, serving/capture_rows.py: on CUDA the outputs
        copied whole into a reused pinned slot asynchronously, the rows gathered and the records
        built on the publisher's thread); its drafts are the accepted path, then the first child
        rejected."""
        B, R = feats.shape[:2]
        capture = any(r.capture for r in reqs)
        kids = tree.children() if capture else None
        tokens = tree.tokens.tolist()
        drafts = torch.zeros(B, steps + 1, dtype=torch.long) if capture else None
        draft_probs = torch.zeros(B, steps + 1) if capture else None
        accepted, rows, index, outs = [], [], [], []
        for b, r in enumerate(reqs):
            path, a, L = paths[b], len(paths[b]), tlen[b]
            new = [tokens[b][c] for c in path] + [bonus[b]]
            if r.capture:
                u = path[-1] if path else 0
                drafted = path + kids[b][u][:1]
                drafts[b, :len(drafted)] = tree.tokens[b, drafted]
                draft_probs[b, :len(drafted)] = tree.probs[b, drafted]
                rows.append(RoundRow(r.request_id, L, b, [int(self.tok_buf[b, L])] + new, a, len(drafted), r.tag))
                index.extend(range(b * R, b * R + a + 1))
            self.tok_buf[b, L + 1:L + a + 2] = torch.tensor(new)
            self.feat_buf[b, L:L + a + 1] = feats[b, :a + 1]
            self.tcache.lengths[b] = L + a + 1
            accepted.append(a)
            outs.append(self._commit_output(r, new, a, steps))
        records = []
        if rows:
            f, h, row_index, ready = self._stage_rows(feats, final, index)
            records = CaptureRound(rows, f, h, row_index=row_index, drafts=drafts, draft_probs=draft_probs,
                                   batch_size=B, draft_version=self.head_version, ready=ready)
        return accepted, records, outs
