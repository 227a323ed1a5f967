"""CUDA graphs of a tree round (serving/tree_round.py): the whole drafting in one replay and the
verify in one more, mixed into `CudaGraphs` (serving/cuda_graphs.py), whose capture, replay and
memory pool they share.

- `draft_tree` (b, topk): from the catch-up's last row, every draft step of the tree and the
  selection of its `num_draft_tokens` nodes (`EagleHead.draft_tree`), the verify's layout (depth,
  visibility) included. Before, each step was a replay of the head plus ~15 eager ops, and the
  selection and the layout ran on the host after a read-back: on an H200 a tree round cost ~1.9x
  a chain round. The per-step layout (rows written, rope positions, what each node sees) is set
  inside the graph into its `StaticTreeBatch`'s buffers from the base rows, a device input.
- `tree_verify_greedy` (b, num_draft_tokens): the target's forward over the tree, its argmax,
  the greedy walk (`greedy_path`) and the commit of the accepted path's K/V to consecutive rows,
  for a batch of greedy requests: what the host reads back is the path, not the logits.
- `tree_target_forward`: the verify alone (logits out), for batches with sampling requests,
  whose acceptance draws on the host.

Graphs are keyed per (bucket, shape); a swap keeps them (the head's graphs replay `GraphHead`'s
module). Reads the runner's target, device, max_len, _head_module, _get, _run, bucket.
"""

from __future__ import annotations

import torch

from serving.tree_round import verify_greedy


class TreeGraphs:
    """`CudaGraphs.draft_tree`, `tree_verify_greedy`, `tree_target_forward` and their warm-up."""

    @torch.inference_mode()
    def draft_tree(self, head, cache, logits: torch.Tensor, hidden: torch.Tensor, base: torch.Tensor,
                   root: torch.Tensor, shape):
        """`EagleHead.draft_tree` in one replay: logits [B, Vd] and hidden [B, H] of each row's
        last committed position, base [B] its committed length, root [B] its last committed token
        (device tensors) -> (tokens, parents, depth, probs, visible) of the selected tree."""
        B = logits.shape[0]
        head = self._head_module(head, cache)
        k, S = shape.topk, max(shape.scratch_rows, 1)
        key = ("dtree", self.bucket(B), k, shape.num_steps, shape.num_draft_tokens)
        rope, embed, dev = self.target.rope, self.target.embed_tokens, self.device

        def make(Bp):
            return {"logits": torch.zeros(Bp, logits.shape[-1], dtype=logits.dtype, device=dev),
                    "hidden": torch.zeros(Bp, hidden.shape[-1], dtype=hidden.dtype, device=dev),
                    "base": torch.zeros(Bp, dtype=torch.long, device=dev),
                    "root": torch.zeros(Bp, dtype=torch.long, device=dev)}

        def draft(ins, sb):
            sb.base.copy_(ins["base"])

            def at(write, positions, visible):  # a step's layout into the batch's buffers, in the graph
                sb.write.copy_(write)
                sb.positions.copy_(positions)
                sb.visible.copy_(visible)
                sb.build_mask()
                return sb

            return head.draft_tree(embed, rope, cache, ins["logits"], ins["hidden"], ins["base"], ins["root"],
                                   shape, at)

        g = self._get(key, (head, cache), make, draft, scratch=S)
        g.inputs["logits"][:B].copy_(logits)
        g.inputs["hidden"][:B].copy_(hidden)
        g.inputs["base"].zero_()  # padding rows (free slots) draft at rows 0.. of their own slot
        g.inputs["base"][:B].copy_(base)
        g.inputs["root"][:B].copy_(root)
        return self._run(g, B)

    @torch.inference_mode()
    def tree_target_forward(self, tokens: torch.Tensor, base: torch.Tensor, write: torch.Tensor,
                            positions: torch.Tensor, visible: torch.Tensor, cache):
        """A target forward over draft-tree nodes (tokens [B,N]; `TreeAttentionBatch`'s layout as
        device tensors: base [B], write/positions [B,N], visible [B,N,S]) -> (logits, features,
        final hidden), as `TargetModel.forward(tokens, TreeAttentionBatch(...), cache)`."""
        B, T = tokens.shape
        S = visible.shape[-1]
        key = ("ttarget", self.bucket(B), T, S)
        g = self._get(key, (cache,), lambda Bp: {"tokens": torch.zeros(Bp, T, dtype=torch.long, device=self.device)},
                      lambda ins, sb: self.target.forward(ins["tokens"], sb, cache), scratch=S)
        g.inputs["tokens"][:B].copy_(tokens)
        g.batch.fill(B, base, write, positions, visible)
        return self._run(g, B)

    @torch.inference_mode()
    def tree_verify_greedy(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                           base: torch.Tensor, write: torch.Tensor, positions: torch.Tensor,
                           visible: torch.Tensor, num_steps: int, cache):
        """`verify_greedy` (serving/tree_round.py) in one replay: the tree (tokens, parents,
        depth [B, N]; its layout as in `tree_target_forward`, device tensors) verified, walked and
        its path's K/V committed -> (accepted [B], bonus [B], path [B, num_steps], features and
        final hidden of the committed rows [B, num_steps + 1, .])."""
        B, N = tokens.shape
        key = ("tgreedy", self.bucket(B), N, num_steps)
        dev = self.device

        def make(Bp):
            return {"tokens": torch.zeros(Bp, N, dtype=torch.long, device=dev),
                    "parents": torch.zeros(Bp, N, dtype=torch.long, device=dev),
                    "depth": torch.zeros(Bp, N, dtype=torch.long, device=dev)}

        g = self._get(key, (cache,), make, lambda ins, sb: verify_greedy(
            self.target, cache, ins["tokens"], sb, sb.base, ins["parents"], ins["depth"], num_steps), scratch=N)
        g.inputs["tokens"][:B].copy_(tokens)
        g.inputs["parents"].fill_(-1)  # padding rows (free slots): roots only, at depth 0, accept nothing
        g.inputs["parents"][:B].copy_(parents)
        g.inputs["depth"].zero_()
        g.inputs["depth"][:B].copy_(depth)
        g.batch.fill(B, base, write, positions, visible)
        return self._run(g, B)

    def _warm_tree(self, shape, Bp: int, tcache, head, caches: list) -> None:
        """A tree shape's graphs at bucket Bp: its drafting per draft cache, its verifies."""
        dev, dt = self.device, self.target.dtype
        base = torch.zeros(Bp, dtype=torch.long, device=dev)
        for cache in caches:
            self.draft_tree(head, cache, torch.zeros(Bp, head.cfg.draft_vocab_size, dtype=dt, device=dev),
                            torch.zeros(Bp, head.cfg.hidden_size, dtype=dt, device=dev), base, base, shape)
        N = shape.num_draft_tokens
        zeros = torch.zeros(Bp, N, dtype=torch.long, device=dev)  # the tokens, and every node's depth
        eye = torch.eye(N, dtype=torch.bool, device=dev).expand(Bp, N, N)
        self.tree_target_forward(zeros, base, torch.arange(N, device=dev).expand(Bp, N), zeros, eye, tcache)
        parents = torch.full((Bp, N), -1, dtype=torch.long, device=dev)
        self.tree_verify_greedy(zeros, parents, zeros, base, torch.arange(N, device=dev).expand(Bp, N), zeros, eye,
                                shape.num_steps, tcache)
