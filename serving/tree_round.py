"""Tree rounds of the engine: draft a tree, verify it in one target forward, accept a path.

`TreeRounds` is the part of `Engine` (serving/engine.py) that runs a round whose shape has
`topk > 1` (online_spec/tree.py: `TreeShape`, SGLang's `num_steps`, `topk`,
`num_draft_tokens`):

1) draft (`_draft_tree`): the draft cache is caught up on committed rows as for a chain; the
   head's distribution after the last committed row gives the `topk` depth-1 candidates. Each
   later step runs the head once over the `topk` frontier nodes of every request (rows written
   to the draft cache's scratch region past the committed rows, each attending to the committed
   rows and its own ancestors: `TreeAttentionBatch`), expands each into its `topk` children and
   keeps the `topk` best children (summed draft log-probability) as the next frontier.
   `select_tree` keeps the best `num_draft_tokens - 1` candidates, a tree under the root.
2) verify (`_verify_tree`): one target forward over [root, nodes] per request, rows at the
   target cache's positions L..L+N-1, rope at L + depth, a tree attention mask.
3) accept: greedy or exact multi-candidate rejection sampling (online_spec/tree.py).
4) commit: the accepted path's target K/V moves to consecutive rows (`KVCache.gather_rows`);
   nothing else of the tree stays in either cache (the draft cache's committed length is reset,
   as after a chain round, and its scratch rows are rewritten next round).
5) capture: the committed path's rows, exactly like a chain round's record (contract 1); its
   drafts are the path's accepted nodes and, at the first rejection, the first child tried.

On CUDA the head's frontier steps and the verify replay CUDA graphs (serving/cuda_graphs.py,
`StaticTreeBatch`), and the candidates stay on the device until the tree is selected (one
device-to-host copy a round); on a CPU both run eagerly. A policy must declare `tree_rounds`.
"""

from __future__ import annotations

import torch

from online_spec.capture import CaptureRecord
from online_spec.kvcache import TreeAttentionBatch
from online_spec.sampling import probs_from_logits
from online_spec.tree import DraftTree, TreeShape, accept_greedy, accept_sampled, select_tree


class TreeRounds:
    """Drafting, verifying and committing draft trees; mixed into `Engine`."""

    def _draft_tree(self, reqs, tlen: list[int], shape: TreeShape) -> DraftTree:
        head, dev = self.head, self.target.device
        B, k, S = len(reqs), shape.topk, shape.scratch_rows
        logits, hidden = self._extend_draft(tlen)  # [B, Vd], [B, H] after the last committed row
        d2t = head.draft_to_target
        # the candidates stay on the device until the tree is selected: one device-to-host copy a round
        lp = torch.log_softmax(logits.float(), -1)
        top_lp, top_id = lp.topk(k, -1)  # [B, k] depth-1 candidates
        ar_k = torch.arange(k, device=dev)
        toks, pars, scores, lps = [top_id], [torch.full((B, k), -1, dtype=torch.long, device=dev)], [top_lp], [top_lp]
        front_tok, front_score, front_cid = top_id, top_lp, ar_k.expand(B, k)
        front_hidden = hidden[:, None].expand(B, k, hidden.shape[-1])
        front_vis = torch.zeros(B, k, max(S, 1), dtype=torch.bool, device=dev)
        base = torch.tensor(tlen, device=dev)
        n_cand = k
        for i in range(1, shape.num_steps):
            # step i: the frontier (depth-i nodes) through the head, at rope position tlen + i - 1
            w = (i - 1) * k
            vis = front_vis.clone()
            vis[:, ar_k, w + ar_k] = True
            emb = self.target.embed_tokens(d2t[front_tok.to(d2t.device)].to(dev))  # [B, k, H]
            lg, hid = self._tree_head(emb, front_hidden, tlen, base, base[:, None] + w + ar_k,
                                      (base + i - 1)[:, None].expand(B, k), vis)  # [B,k,Vd], [B,k,H]
            c_lp, c_id = torch.log_softmax(lg.float(), -1).topk(k, -1)  # [B, k, k]
            c_score = (front_score[:, :, None] + c_lp).reshape(B, k * k)
            c_id = c_id.reshape(B, k * k)
            toks.append(c_id)
            pars.append(front_cid[:, :, None].expand(B, k, k).reshape(B, k * k))
            scores.append(c_score)
            lps.append(c_lp.reshape(B, k * k))
            if i + 1 < shape.num_steps:
                front_score, best = c_score.topk(k, -1)  # [B, k] the next frontier
                par = best // k
                front_tok = c_id.gather(1, best)
                front_hidden = hid.gather(1, par[:, :, None].expand(B, k, hid.shape[-1]))
                front_vis = vis.gather(1, par[:, :, None].expand(B, k, vis.shape[-1]))
                front_cid = n_cand + best
            n_cand += k * k
        for b in range(B):  # scratch rows are dropped; the next extend rewrites from tlen
            self.dcache.lengths[b] = tlen[b]
        # one read-back for the whole tree (in a host window on a GPU): the draft ids and parents,
        # exact in float32 (below 2^24), beside the float32 scores and probabilities
        host = self._host(torch.cat([torch.cat(toks, 1).float(), torch.cat(pars, 1).float(),
                                     torch.cat(scores, 1), torch.cat(lps, 1).exp()], 1))
        ids, par, score, prob = host.split(n_cand, 1)
        root = self.tok_buf[:B].gather(1, torch.tensor(tlen)[:, None])[:, 0]
        return select_tree(self._host_map(d2t)[ids.long()], par.long(), score, prob, root, shape.num_draft_tokens)

    def _host_map(self, d2t: torch.Tensor) -> torch.Tensor:
        """The live head's draft-to-target id map on the host, copied once per map, not every round."""
        kept = self._d2t_host
        if kept is None or kept[0] is not d2t:  # the map itself is kept, so its identity is never reused
            kept = self._d2t_host = (d2t, d2t.cpu())
        return kept[1]

    def _tree_head(self, emb, hid, tlen: list[int], base, write, positions, visible):
        """The head over tree nodes (emb [B,T,H], hid [B,T,H]) written at `write`, roped at
        `positions`, seeing `visible` of the scratch rows: a CUDA graph's replay where there are graphs."""
        if self.graphs is not None:
            return self.graphs.tree_head_step(self.head, self.dcache, emb, hid, base, write, positions, visible)
        batch = TreeAttentionBatch(tlen, write.cpu(), positions.cpu(), visible.cpu(), self.target.device)
        return self.head.step(emb, hid, batch, self.dcache, self.target.rope)

    def _verify_tree(self, reqs, tlen: list[int], tree: DraftTree, shape: TreeShape):
        """3) accept, 4) commit, 5) capture for a tree. Returns (accepted, records, outputs)."""
        B, N = tree.tokens.shape
        dev = self.target.device
        base = torch.tensor(tlen)
        write, positions, visible = base[:, None] + torch.arange(N), base[:, None] + tree.depth, tree.visible()
        # one lm_head pass over all N rows: on a CPU it reads the 49k x 576 weights once, where a
        # pass per depth of the walk (only the nodes reached) read them depth + 1 times and was slower
        if self.graphs is not None:
            logits, feats, final = self.graphs.tree_target_forward(
                tree.tokens.to(dev), base.to(dev), write.to(dev), positions.to(dev), visible.to(dev), self.tcache)
        else:
            batch = TreeAttentionBatch(tlen, write, positions, visible, dev)
            logits, feats, final = self.target.forward(tree.tokens.to(dev), batch, self.tcache)  # [B, N, V]
        self.timeline.mark("verify")
        kids = tree.children()
        tokens = tree.tokens.tolist()
        greedy_choice = self._host(logits.argmax(-1)).tolist() if any(r.params.greedy for r in reqs) else None
        paths, bonus = [], []
        for b, r in enumerate(reqs):
            if r.params.greedy:
                path, nxt = accept_greedy(tokens[b], kids[b], greedy_choice[b])
            else:
                path, nxt = accept_sampled(tokens[b], kids[b], probs_from_logits(logits[b], r.params), r.gen)
            paths.append(path)
            bonus.append(nxt)
        # the accepted path's target K/V into consecutive rows L+1..L+a (padding: the root onto itself)
        amax = max(len(p) for p in paths)
        if amax:
            src = torch.tensor([[tlen[b] + c for c in p] + [tlen[b]] * (amax - len(p)) for b, p in enumerate(paths)])
            dst = torch.tensor([[tlen[b] + 1 + j for j in range(len(p))] + [tlen[b]] * (amax - len(p))
                                for b, p in enumerate(paths)])
            self.tcache.gather_rows(src.to(dev), dst.to(dev))
        accepted, records, outs = [], [], []
        for b, r in enumerate(reqs):
            path, a, L = paths[b], len(paths[b]), tlen[b]
            rows = torch.tensor([0] + path)
            new = [tokens[b][c] for c in path] + [bonus[b]]
            self.tok_buf[b, L + 1:L + a + 2] = torch.tensor(new)
            self.feat_buf[b, L:L + a + 1] = feats[b, rows.to(dev)]
            self.tcache.lengths[b] = L + a + 1
            accepted.append(a)
            if r.capture:
                u = path[-1] if path else 0
                drafted = path + kids[b][u][:1]  # the accepted path, then the first child rejected
                records.append(CaptureRecord(
                    request_id=r.request_id, first_pos=L, tokens=self.tok_buf[b, L:L + a + 2].clone(),
                    features=feats[b, rows.to(dev)], final_hidden=final[b, rows.to(dev)],
                    draft_tokens=tree.tokens[b, drafted].clone(), draft_probs=tree.probs[b, drafted].clone(),
                    accept_len=a, num_steps=len(drafted), batch_size=B, draft_version=self.head_version,
                    tag=r.tag))
            outs.append(self._commit_output(r, new, a, shape.num_steps))
        return accepted, records, outs
