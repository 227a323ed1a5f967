"""Draft trees: the shape of a tree round, which candidates it verifies, what each node may
attend to, and the exact acceptance rules over a tree. Pure tensor bookkeeping: no model.

SGLang's names and meaning (`TreeShape`): `num_steps` = depth, `topk` = branching (1 = chain),
`num_draft_tokens` = tokens verified per request, the root (the last committed token) included.

Drafting (serving/tree_round.py) expands, at each of `num_steps` draft steps, the `topk`
children of each of the `topk` best frontier nodes; every child is a candidate scored by its
path's summed draft log-probability. `select_nodes` keeps the `num_draft_tokens - 1` best
candidates. A child's score never exceeds its parent's and its index is larger, so a stable
sort by score keeps every kept node's parent: the kept set is a tree rooted at the last
committed token. Nodes are numbered in candidate order (depth first, then score), so a
parent's number is always smaller than its child's and siblings stand in their drafting order.

Acceptance (lossless for any head and any tree):
- greedy (`accept_greedy`): walk from the root, at each node follow the child whose token is
  the target's argmax there; stop where none is; the argmax at the last node reached is the
  bonus token. The committed tokens are exactly the target's greedy tokens.
- sampling (`accept_sampled`): at each node its children are tried in order against the
  target's residual distribution r (at first the target's p there): child x is accepted with
  probability r(x) / sum(r); a rejected child's mass is removed from r. When every child is
  rejected (or the node is a leaf) the bonus token is sampled from r. Each committed token is
  then distributed exactly as p: token x_j is committed with probability
  prod_{i<j}(1 - p(x_i)/R_i) * p(x_j)/R_j = p(x_j), any other token y with probability
  (1 - sum_j p(x_j)) * p(y) / (1 - sum_j p(x_j)) = p(y).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from online_spec.config import ConfigError, check


@dataclass(frozen=True)
class TreeShape:
    """One round's tree: depth `num_steps`, branching `topk`, `num_draft_tokens` verified."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        check(isinstance(self.num_steps, int) and self.num_steps >= 1, "num_steps",
              f"must be an int >= 1, got {self.num_steps!r}")
        check(isinstance(self.topk, int) and self.topk >= 1, "topk", f"must be an int >= 1, got {self.topk!r}")
        check(isinstance(self.num_draft_tokens, int) and 2 <= self.num_draft_tokens <= self.max_nodes + 1,
              "num_draft_tokens", f"must be 2..{self.max_nodes + 1} for depth {self.num_steps} and topk "
              f"{self.topk} (root included), got {self.num_draft_tokens!r}")

    @property
    def max_nodes(self) -> int:
        """Candidates a round drafts: topk at depth 1, topk * topk below each later frontier."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def scratch_rows(self) -> int:
        """Draft-cache rows the frontier nodes occupy beyond the committed ones."""
        return (self.num_steps - 1) * self.topk

    @property
    def footprint(self) -> int:
        """Cache rows a round needs beyond the committed ones (target or draft cache)."""
        return max(self.num_draft_tokens, self.scratch_rows + 1)

    @classmethod
    def parse(cls, text: str, field: str = "tree") -> "TreeShape":
        """'num_steps,topk,num_draft_tokens' (a flag's value) -> TreeShape; ConfigError naming `field`."""
        try:
            steps, topk, tokens = (int(x) for x in str(text).split(","))
        except ValueError:
            raise ConfigError(f"{field}: {text!r} is not 'num_steps,topk,num_draft_tokens'") from None
        return cls(steps, topk, tokens)

    @classmethod
    def capped(cls, num_steps: int, topk: int, num_draft_tokens: int) -> "TreeShape":
        """The shape at depth `num_steps` (a policy may pick less than the configured depth), with
        `num_draft_tokens` cut to what that depth can draft."""
        most = topk + (num_steps - 1) * topk * topk + 1
        return cls(num_steps, topk, max(2, min(num_draft_tokens, most)))


@dataclass
class DraftTree:
    """The nodes a round verifies, per request (all requests share N = num_draft_tokens).

    tokens  [B, N] int64  target token ids; column 0 is the root (the last committed token)
    parents [B, N] int64  parent column of each node (-1 for the root); parents[b, n] < n
    depth   [B, N] int64  0 for the root
    probs   [B, N] f32    the head's probability of each node's token given its parent (root: 1)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    probs: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def visible(self) -> torch.Tensor:
        """[B, N, N] bool: node n may attend to node m (m is n or one of its ancestors)."""
        return tree_layout(self.parents, int(self.depth.max()))[1]

    def children(self) -> list[list[list[int]]]:
        """Per request, per node, its children's columns in drafting order."""
        out = []
        for row in self.parents.tolist():
            kids: list[list[int]] = [[] for _ in row]
            for n, p in enumerate(row[1:], 1):
                kids[p].append(n)
            out.append(kids)
        return out


def wide_topk(x: torch.Tensor, k: int, chunks: int = 64, two_pass: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, -1)` over a wide last dimension, on a GPU in two passes: the k best of each of
    `chunks` equal chunks, then the k best of those. The same values, sorted (equal values may
    come in another order, with their own indices). On an H100 one pass over a drafting step's
    [1, 8, 8192] log-probabilities took 41 us (one thread block per row); on a 2-core CPU one pass
    takes 65 us and two 160. two_pass: None = on CUDA tensors only. A dimension too narrow for
    the chunks, or not divisible by them, takes the one pass."""
    n = x.shape[-1]
    if not (x.is_cuda if two_pass is None else two_pass) or n % chunks or n < 4 * chunks * k:
        return x.topk(k, -1)
    v1, i1 = x.unflatten(-1, (chunks, n // chunks)).topk(k, -1)  # [..., chunks, k]
    i1 = i1 + torch.arange(0, n, n // chunks, device=x.device)[:, None]
    v2, i2 = v1.flatten(-2).topk(k, -1)
    return v2, i1.flatten(-2).gather(-1, i2)


def select_nodes(cand_tokens: torch.Tensor, cand_parents: torch.Tensor, cand_scores: torch.Tensor,
                 cand_probs: torch.Tensor, root_tokens: torch.Tensor, num_draft_tokens: int, num_steps: int):
    """The best `num_draft_tokens - 1` candidates of each request, as a tree under its root, on
    the candidates' device with no read-back (it runs inside a CUDA graph).

    cand_* [B, C] in drafting order (a parent before its children): target token ids, parent
    candidate index (-1 = the root), summed draft log-probability of the path, the head's
    probability of the token given its parent. root_tokens [B]. Every kept candidate's parent is
    kept: a child's score never exceeds its parent's, and a stable sort puts the parent (a smaller
    index) first on a tie. -> (tokens, parents, depth, probs, visible) as in `DraftTree`, visible
    [B, N, N]."""
    B, C = cand_tokens.shape
    dev = cand_tokens.device
    n = min(num_draft_tokens - 1, C)
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :n]
    keep = torch.sort(order, dim=1).values  # [B, n] candidate indices in drafting order
    column = torch.full((B, C), -1, dtype=torch.long, device=dev)
    column.scatter_(1, keep, torch.arange(1, n + 1, device=dev).expand(B, n))
    par = cand_parents.gather(1, keep)
    par_col = torch.where(par < 0, torch.zeros_like(par), column.gather(1, par.clamp_min(0)))
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), par_col], dim=1)
    tokens = torch.cat([root_tokens.reshape(B, 1).long(), cand_tokens.gather(1, keep)], dim=1)
    probs = torch.cat([torch.ones(B, 1, device=dev), cand_probs.gather(1, keep).float()], dim=1)
    depth, visible = tree_layout(parents, num_steps)
    return tokens, parents, depth, probs, visible


def tree_layout(parents: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] (-1 at the root, trees at most `num_steps` deep) -> (depth [B, N], visible
    [B, N, N]: node n may attend to node m, m being n or one of its ancestors). A fixed number of
    device ops (one walk up per level), no read-back."""
    B, N = parents.shape
    dev = parents.device
    anc = torch.arange(N, device=dev).expand(B, N).contiguous()
    visible = torch.zeros(B, N, N, dtype=torch.bool, device=dev)
    visible.scatter_(2, anc[..., None], True)
    depth = torch.zeros(B, N, dtype=torch.long, device=dev)
    for _ in range(num_steps):
        up = parents.gather(1, anc)  # -1 once the walk is at the root
        depth += up >= 0
        anc = up.clamp_min(0)
        visible.scatter_(2, anc[..., None], True)
    return depth, visible


def greedy_path(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, choice: torch.Tensor,
                num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_greedy` for a whole batch on the device, no read-back: choice [B, N] the target's
    argmax at each node. A node is on the accepted path when its token and every ancestor's is the
    argmax at its parent; siblings carry distinct tokens (the draft-to-target map is one-to-one),
    so at most one node per depth is, and the deepest is the path's end (were two, either path
    would commit the target's own greedy tokens). -> (accepted length [B], path [B, num_steps] node columns in path
    order (0 past the accepted length), bonus token [B]: the argmax at the path's end)."""
    B, N = tokens.shape
    dev = tokens.device
    par = parents.clamp_min(0)
    ok = tokens == choice.gather(1, par)
    ok[:, 0] = True
    for _ in range(num_steps - 1):
        ok = ok & ok.gather(1, par)
    end = (depth * ok).argmax(1, keepdim=True)  # the root (column 0) when no draft is accepted
    path = torch.zeros(B, num_steps + 1, dtype=torch.long, device=dev)  # column num_steps: a dump
    cur = end
    for _ in range(num_steps):
        d = depth.gather(1, cur)
        path.scatter_(1, torch.where(d > 0, d - 1, num_steps), cur)
        cur = par.gather(1, cur)
    return depth.gather(1, end)[:, 0], path[:, :num_steps], choice.gather(1, end)[:, 0]


def greedy_step(tokens: list[int], children: list[int], choice: int) -> int | None:
    """At one node: the child whose token is the target's argmax `choice` there, or None."""
    return next((c for c in children if tokens[c] == choice), None)


def sampled_step(tokens: list[int], children: list[int], p: torch.Tensor,
                 gen: torch.Generator | None) -> tuple[int | None, int | None]:
    """At one node, with p [V] the target's probabilities there: (the accepted child, None), or
    (None, the bonus token) when every child was rejected (a leaf: at once)."""
    resid = p.clone()
    for c in children:
        x = tokens[c]
        mass = float(resid.sum())
        if mass > 0 and float(torch.rand((), generator=gen)) * mass < float(resid[x]):
            return c, None
        resid[x] = 0.0
    mass = float(resid.sum())
    return None, int(torch.multinomial(resid / mass if mass > 0 else p, 1, generator=gen))


def accept_greedy(tokens: list[int], children: list[list[int]], target_choice: list[int]) -> tuple[list[int], int]:
    """One request's greedy walk: (accepted node columns in path order, bonus token).

    tokens [N] and target_choice [N] (the target's argmax at each node) as lists."""
    path, u = [], 0
    while (c := greedy_step(tokens, children[u], target_choice[u])) is not None:
        path.append(c)
        u = c
    return path, target_choice[u]


def accept_sampled(tokens: list[int], children: list[list[int]], p: torch.Tensor,
                   gen: torch.Generator | None) -> tuple[list[int], int]:
    """One request's exact multi-candidate rejection sampling over its tree: (accepted node
    columns in path order, bonus token). p [N, V]: the target's probabilities at each node
    (temperature, top-k, top-p applied)."""
    path, u = [], 0
    while True:
        c, bonus = sampled_step(tokens, children[u], p[u], gen)
        if c is None:
            return path, bonus
        path.append(c)
        u = c
