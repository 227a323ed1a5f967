"""Chain rounds of the engine: K chained draft steps, a verify of K + 1 tokens, accept a prefix.

`ChainRounds` is the part of `Engine` (serving/engine.py) that drafts and accepts a chain
(topk 1, today's EAGLE rounds and SGLang's adaptive mode): `_draft` runs up to K head steps
after the draft cache's catch-up, each on the previous step's token and hidden state, and asks
the policy (where it declares `early_stop` and the engine's `in_round_cuts` let it) whether one
more step pays; a greedy batch with no such check keeps its drafts on the device and reads them
back once a round (`_draft_greedy`): on a GPU with no verify cut to choose (`keep_drafts`), that
read-back waits for the verify and comes with its argmax, so the verify is queued behind the draft
chain without the host waiting in between. `_verify_tokens` builds the verify's input [last
committed token, drafts] where the drafts are; `_accept_chain` takes the verify's logits and
commits the accepted prefix and the target's next token. The verify itself, one target forward,
stays in `Engine.step`.
"""

from __future__ import annotations

import time

import torch

from online_spec.capture import CaptureRound, RoundRow
from online_spec.host_window import upload
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import accept_sampled, probs_from_logits
from serving.capture_rows import RowStaging
from serving.requests import Request


class ChainRounds(RowStaging):
    """Drafting and accepting chains; mixed into `Engine`."""

    # whether a greedy chain's drafts stay on the device until the verify's read-back (None: on a
    # CUDA device); a policy that cuts the verify reads them before it, so they come back then
    keep_drafts: bool | None = None
    # whether a K = 0 round keeps the draft cache caught up where graphs replay the head (one head
    # row a request a round), or (the default) the next drafting round catches up every row served
    # at K = 0 in its chunked fills, so a K = 0 round costs a plain step (always so on a CPU; H200:
    # K = 0 rounds 1.24 / 1.19x faster left behind at batch 1 / 4, scripts/plain_round_ab.py)
    catch_up_plain: bool = False

    def _draft(self, reqs: list[Request], tlen: list[int], K: int, ctx: int):
        """K chained draft steps per request -> (drafts [B,K] target ids, their draft probs [B,K],
        full-vocab draft distributions per request (sampling requests only), kept): kept, the
        drafts and probs are still on the device, read back by `_accept_chain`."""
        head, B = self.head, len(reqs)
        logits, hidden = self._extend_draft(tlen)  # [B, Vd], [B, H] at the last committed row
        # the early stop is asked after every step but the last; a policy that cuts the verify too
        # is asked after the last as well (its answer unused), so it can tally every step for its cut
        tally = self.policy.early_stop and self.policy.truncates and self.cuts
        stops = tally or (self.policy.early_stop and self.cuts and K > 1)
        if not stops and all(r.params.greedy for r in reqs):
            keep = self.target.device.type == "cuda" if self.keep_drafts is None else self.keep_drafts
            return self._draft_greedy(tlen, K, logits, hidden, keep and not (self.policy.truncates and self.cuts))
        # per step, each request's draft and its probability as Python values: the drafts are
        # read back once a step anyway (the next step embeds them, the policy reads the
        # probabilities), and [B, K] tensors are built once at the end, not element by element
        tok_steps: list[list[int]] = []
        prob_steps: list[list[float]] = []
        q_full = [torch.zeros(K, self.target.info.vocab_size) for _ in range(B)] \
            if any(not r.params.greedy for r in reqs) else None
        greedy = [r.params.greedy for r in reqs]
        all_greedy = all(greedy)
        d2t = head.draft_to_target
        d2t_host = None if all_greedy else d2t.cpu()  # a no-op on a CPU
        for j in range(K):
            if j > 0:
                # step j+1 reads (embedding of draft j, hidden of step j) at position tlen + j - 1
                emb = self.target.embed_tokens(torch.tensor(tok_steps[-1])[:, None].to(self.target.device))
                starts = [t + j - 1 for t in tlen]
                if self.graphs is not None:
                    lg, hid = self.graphs.head_step(head, self.dcache, emb, hidden[:, None], starts)
                else:
                    batch = AttentionBatch(starts, 1, self.target.device)
                    lg, hid = head.step(emb, hidden[:, None], batch, self.dcache, self.target.rope)
                logits, hidden = lg[:, 0], hid[:, 0]
            lf = logits.float()
            if any(greedy):  # greedy rows: one read-back for the whole batch
                pr = torch.softmax(lf, -1)
                d = pr.argmax(-1)
                g_tok, g_prob = d2t[d].tolist(), pr.gather(1, d[:, None])[:, 0].float().tolist()
            if all_greedy:
                step_tok, step_prob = g_tok, g_prob
            else:
                step_tok, step_prob = [], []
                lf_host = lf.cpu()  # sampled rows draw on the host, where their generators are
                for b, r in enumerate(reqs):
                    if greedy[b]:
                        step_tok.append(g_tok[b])
                        step_prob.append(g_prob[b])
                    else:
                        full = torch.full((self.target.info.vocab_size,), float("-inf"))
                        full[d2t_host] = lf_host[b]
                        q = probs_from_logits(full, r.params)
                        t = int(torch.multinomial(q, 1, generator=r.gen))
                        step_tok.append(t)
                        step_prob.append(float(q[t]))
                        q_full[b][j] = q
            tok_steps.append(step_tok)
            prob_steps.append(step_prob)
            if stops and (j + 1 < K or tally):
                tp = time.perf_counter_ns()
                go = self.policy.should_continue(j + 1, step_prob, B, ctx)
                self._policy_ns += time.perf_counter_ns() - tp
                if not go and j + 1 < K:
                    q_full = [q[:j + 1] for q in q_full] if q_full is not None else None
                    break
        drafts = torch.tensor(tok_steps, dtype=torch.long).T.contiguous()  # [B, steps drafted]
        # float32, as the probabilities were computed: the policy read the same values
        probs = torch.tensor(prob_steps, dtype=torch.float32).T.contiguous()
        for b in range(B):  # speculative rows are dropped; the next extend rewrites them
            self.dcache.lengths[b] = tlen[b]
        return drafts, probs, q_full, False

    def _draft_greedy(self, tlen: list[int], K: int, logits: torch.Tensor, hidden: torch.Tensor, keep: bool):
        """`_draft` for a greedy batch that no early stop interrupts: the K steps' drafts and
        probabilities stay on the device (each step embeds the previous step's argmax where it
        is) and are read back once, together, after the last step; with CUDA graphs the K steps
        are one replay (`CudaGraphs.draft_chain`: on an H100 the step-by-step launches kept the
        draft stage host-bound, ~0.5 ms a step). The same drafts as the step-by-step loop: the
        argmax of the same softmax, its probability gathered alike. keep: no read-back here."""
        head, B, dev = self.head, len(tlen), self.target.device
        if self.graphs is not None:  # all K steps in one graph replay
            toks_k, probs_k = self.graphs.draft_chain(head, self.dcache, logits, hidden, tlen, K)
        else:
            toks_k, probs_k = head.greedy_chain(self.target.embed_tokens, self.target.rope, self.dcache, logits,
                                                hidden, K, lambda j: AttentionBatch([t + j - 1 for t in tlen], 1, dev))
        for b in range(B):  # speculative rows are dropped; the next extend rewrites them
            self.dcache.lengths[b] = tlen[b]
        if keep:
            return toks_k.long(), probs_k.float(), None, True
        # one read-back: target ids (< 2^24, exact in float32) beside their probabilities
        both = self._host(torch.cat([toks_k.float(), probs_k.float()], 1))
        return both[:, :K].long().contiguous(), both[:, K:].contiguous(), None, False

    def _verify_tokens(self, tlen: list[int], drafts: torch.Tensor, kept: bool) -> torch.Tensor:
        """The verify's input [B, K+1]: each slot's last committed token, then its drafts; on the
        device beside kept drafts (the tokens go up without waiting for the device), else on the host."""
        last = self.tok_buf[:len(tlen)].gather(1, torch.tensor(tlen)[:, None])
        if kept:
            return torch.cat([upload(last, drafts.device), drafts], dim=1)
        return torch.cat([last, drafts], dim=1)

    def _accept_chain(self, reqs, tlen, lens, drafts, draft_probs, q_full, logits, feats, final, kept=False):
        """3) accept, 4) commit, 5) capture for a chain. Returns (accepted, records, outputs,
        draft_probs on the host): records, a `CaptureRound` of the sampled requests' committed
        rows, built off this thread. kept: the drafts are on the device (a greedy batch), read back
        with the verify's argmax in one copy."""
        B, T = len(reqs), feats.shape[1]
        accepted, rows, index, round_outs = [], [], [], []
        if kept:  # ids < 2^24 are exact in float32, beside the probabilities
            k = drafts.shape[1]
            host = self._host(torch.cat([logits.argmax(-1).float(), drafts.float(), draft_probs], 1), long=True)
            greedy_choice = host[:, :k + 1].long()
            drafts, draft_probs = host[:, k + 1:2 * k + 1].long().contiguous(), host[:, 2 * k + 1:].contiguous()
        elif any(r.params.greedy for r in reqs):
            greedy_choice = self._host(logits.argmax(-1), long=True)
        else:
            greedy_choice = None
        if greedy_choice is None and self._pump is not None:  # no verify read-back (`_host` pumps before one):
            self._pump()  # the capture kept for this round goes out before the sampled accept
        for b, r in enumerate(reqs):
            n = lens[b]
            if r.params.greedy:
                # Greedy: accept drafts while each equals the target's argmax at its position; the
                # target's argmax after the last accepted draft is committed too (the bonus).
                match = (drafts[b, :n] == greedy_choice[b, :n]).int()
                a = int(match.cumprod(0).sum()) if n else 0
                nxt = int(greedy_choice[b, a])
            else:
                p = probs_from_logits(logits[b, :n + 1].cpu(), r.params)  # drawn on the host, as its generator
                a, nxt = accept_sampled(p, q_full[b][:n], drafts[b, :n], r.gen)
            accepted.append(a)
            L = tlen[b]
            new = drafts[b, :a].tolist() + [nxt]
            if r.capture:  # rows L..L+a: the verify's rows 0..a of slot b; the token at L comes first
                rows.append(RoundRow(r.request_id, L, b, [int(self.tok_buf[b, L])] + new, a, n, r.tag))
                index.extend(range(b * T, b * T + a + 1))
            self.tok_buf[b, L + 1:L + a + 2] = torch.tensor(new)
            self.feat_buf[b, L:L + a + 1] = feats[b, :a + 1]
            self.tcache.lengths[b] = L + a + 1
            round_outs.append(self._commit_output(r, new, a, n))
        records = []
        if rows:
            # 5) capture: the rows stay where the verify left them (CPU) or are copied whole into a
            #    pinned host slot by an async copy (CUDA); the publisher's thread gathers and builds records
            f, h, row_index, ready = self._stage_rows(feats, final, index)
            records = CaptureRound(rows, f, h, row_index=row_index, drafts=drafts, draft_probs=draft_probs,
                                   batch_size=B, draft_version=self.head_version, ready=ready)
        return accepted, records, round_outs, draft_probs
