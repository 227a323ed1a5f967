"""Probe: does a round at a rarely run K cost more than the same K run every round?

The cost policy learns a time factor per (batch size, K) from the rounds it runs. In a CPU e2e
run (docs/results.md, 2026-11-28) its batch-4 factors for K = 2 and 3 settled at 1.4 and 1.17
while the policy ran K = 1 in 95 % of the rounds, and those rare rounds took 137-176 ms where
static K = 3 took 127. This runs SmolLM2 (bf16 by default, the server's 1 torch thread) at batch
B with the shipped head under fixed K schedules, a few tokens a request, and prints the median
draft and verify milliseconds per K for each schedule:

- `steady K`: every round at K;
- `rare K in BASE`: BASE every round but every EVERY-th, which runs K.

    python scripts/k_switch_probe.py                  # B=4, K=3 in 1, EVERY=8
    B=4 K=2 BASE=1 EVERY=32 TOKENS=200 python scripts/k_switch_probe.py
"""
import collections, os, statistics, sys
import torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from online_spec.target import load_target
from online_spec.checkpoint import load_head
from online_spec.controller import StepPolicyBase
from online_spec.data import sharegpt_conversations
from online_spec.sampling import SamplingParams
from bench.heads import resolve_head
from serving.engine import Engine, EngineConfig

B = int(os.environ.get("B", "4"))
K = int(os.environ.get("K", "3"))
BASE = int(os.environ.get("BASE", "1"))
EVERY = int(os.environ.get("EVERY", "8"))
TOKENS = int(os.environ.get("TOKENS", "160"))
target = load_target(dtype=os.environ.get("DTYPE", "bfloat16"))
head, _ = load_head(resolve_head("shipped", target), target.info, dtype=target.dtype)
convs = sharegpt_conversations(limit=40, seed=3, split="heldout", max_prompt_tokens=160, tokenizer=target.tokenizer)
prompts = [target.encode_chat(c[:1]) for c in convs][:B]


class Schedule(StepPolicyBase):
    """A fixed K per round: `rare` every `every`-th round, `base` otherwise (no early stop, no cut)."""
    name = "schedule"

    def __init__(self, base, rare, every):
        self.base, self.rare, self.every, self.n = base, rare, every, 0

    def steps_for(self, b, ctx=0):
        self.n += 1
        return self.rare if self.every and self.n % self.every == 0 else self.base

    def update(self, b, accepted, **kw):
        return self.base


def run(label, pol):
    eng = Engine(target, head, EngineConfig(max_batch=B, max_len=1024, max_steps=7), policy=pol)
    by_k = collections.defaultdict(list)

    def seen(stats, outs):
        if stats.batch_size == B and not stats.admitted:
            by_k[stats.num_steps].append((stats.draft_s * 1e3, stats.verify_s * 1e3, stats.total_s * 1e3))
    eng.on_round.append(seen)
    eng.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    for k in sorted(by_k):
        rows = by_k[k][2:]  # the first rounds at each K warm its shapes
        med = [statistics.median(c) for c in zip(*rows)] if rows else [float("nan")] * 3
        print(f"{label:18s} B {B} K {k} rounds {len(rows):4d} ms median draft {med[0]:6.1f} verify {med[1]:6.1f} "
              f"round {med[2]:6.1f}", flush=True)


for _ in range(int(os.environ.get("REPEATS", "2"))):
    run(f"steady {K}", Schedule(K, K, 0))
    run(f"rare {K} in {BASE}", Schedule(BASE, K, EVERY))
    run(f"steady {BASE}", Schedule(BASE, BASE, 0))
