"""Probe: the cost policy's calls timed inside the engine, bare and learning on its worker thread.

Runs SmolLM2 (fp32, 2 threads) with the shipped head at batch B (env B, default 1), 48 tokens of
held-out ShareGPT prompts, with the cost policy (fixed round-time coefficients of this CPU's order;
the decisions matter less than their cost) bare and behind `PlannedPolicy`, twice each,
alternating; prints per round the engine's own timing of the policy's calls (`RoundStats.policy_s`,
mean and median), then, through a per-call wrapper, each call's median microseconds. Nothing is
written.

    python scripts/policy_call_costs.py          # batch 1
    NULL=1 TOKENS=160 REPEATS=3 B=16 python scripts/policy_call_costs.py   # the planned policy beside
                                                 # the calls' floor (a policy doing nothing), longer runs
    NULL=2 ...                                   # also the floor with the planner's worker learning
                                                 # every round beside it (NullWithWorker)
    B=4 python scripts/policy_call_costs.py
    DTYPE=bfloat16 python scripts/policy_call_costs.py   # the serving dtype of a CPU with native bf16
"""
import collections, statistics, sys, time, os
import torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)
from online_spec.target import load_target
from online_spec.checkpoint import load_head
from online_spec.controller import AdaptiveConfig, CostModel, CostModelPolicy
from online_spec.data import sharegpt_conversations
from online_spec.sampling import SamplingParams
from bench.heads import resolve_head
from serving.engine import Engine, EngineConfig
from serving.policy_planner import PlannedPolicy

B = int(os.environ.get("B", "1"))
TOKENS = int(os.environ.get("TOKENS", "48"))  # tokens a request: more rounds a run
target = load_target(dtype=os.environ.get("DTYPE", "float32"))
head, _ = load_head(os.environ.get("HEAD_DIR") or resolve_head("shipped", target), target.info, dtype=target.dtype)
convs = sharegpt_conversations(limit=40, seed=3, split="heldout", max_prompt_tokens=160, tokenizer=target.tokenizer)
prompts = [target.encode_chat(c[:1]) for c in convs][:max(4, B)]

class Rec:
    def __init__(self, p):
        self.p = p; self.ns = collections.defaultdict(list)
        for a in ("name", "early_stop", "truncates", "tree_rounds", "chooses_trees"):
            setattr(self, a, getattr(p, a))
    def _t(self, n, *a, **k):
        t = time.perf_counter_ns(); out = getattr(self.p, n)(*a, **k); self.ns[n].append(time.perf_counter_ns() - t); return out
    def steps_for(self, *a): return self._t("steps_for", *a)
    def should_continue(self, *a): return self._t("should_continue", *a)
    def verify_lengths(self, *a, **k): return self._t("verify_lengths", *a, **k)
    def update(self, *a, **k): return self._t("update", *a, **k)
    def predict_round_s(self, *a): return self.p.predict_round_s(*a)
    def tree_for(self, *a): return None
    def tree_shapes(self): return []
    def rewarm(self): self.p.rewarm()
    def info(self): return self.p.info()
    def state_dict(self): return self.p.state_dict()
    def load_state_dict(self, s): self.p.load_state_dict(s)

class NullPolicy:
    """The floor: the engine's policy calls (K = 3, every step continued, every draft verified)
    doing no work, so their engine-timed cost is the calls' own on the engine's caches."""
    name, early_stop, truncates, tree_rounds, chooses_trees = "null", True, True, False, False
    def steps_for(self, b, ctx=0): return 3
    def should_continue(self, s, conf, b, ctx=0): return True
    def verify_lengths(self, conf, ctx=0, *, padded=False): return [conf.shape[1]] * conf.shape[0]
    def update(self, b, accepted, **kw): return 3
    def predict_round_s(self, *a): return None
    def tree_for(self, *a): return None
    def tree_shapes(self): return []
    def rewarm(self): pass
    def info(self): return {}
    def state_dict(self): return {}
    def load_state_dict(self, s): pass

class NullWithWorker(NullPolicy):
    """The floor's calls with the planner's worker learning beside them: each round goes to a real
    `PlannedPolicy`'s worker (which learns and plans from it on its own thread, as the planned
    policy's does), while the engine's calls do nothing. Against `NullPolicy` it measures what the
    worker's presence on the other core costs the engine thread's calls."""
    name = "null+worker"

    def __init__(self):
        self.planned = PlannedPolicy(make())

    def update(self, b, accepted, **kw):
        self.planned.update(b, accepted, **kw)
        return 3


def make():
    ad = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3, 5]}})
    return CostModelPolicy(ad, cost_model=CostModel.with_coefficients((0.006, 0.0005, 0, 0.004, 0), (0.05, 0.002, 0.0006, 0, 0.002)))

def run(label, pol, wrapped):
    rec = Rec(pol) if wrapped else pol
    eng = Engine(target, head, EngineConfig(max_batch=B, max_len=512, max_steps=5), policy=rec)
    own = []  # the engine's own timing of the policy's calls (`RoundStats.policy_s`), no wrapper
    eng.on_round.append(lambda stats, outs: own.append(stats.policy_s * 1e6))
    eng.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    line = f"{label} {'wrapped' if wrapped else 'engine'} B {B} rounds {len(own)} engine-timed us a round: " \
           f"mean {statistics.fmean(own):.1f} median {statistics.median(own):.1f}"
    if wrapped:
        n = len(rec.ns["update"])
        per = {k: round(statistics.median(v) / 1000, 1) for k, v in rec.ns.items()}
        tot = {k: round(sum(v) / 1000 / n, 1) for k, v in rec.ns.items()}
        line += f" | wrapper: median us per call {per} per round (mean) {tot} sum {round(sum(tot.values()), 1)}"
    print(line, flush=True)

# the engine's own timing, unwrapped, alternating bare / planned; then once each through the
# per-call wrapper (its own frames cost ~5 us a call on the engine's cold caches)
arms = (("bare", make), ("planned", lambda: PlannedPolicy(make())))
if os.environ.get("NULL", "0") == "1":  # the floor beside the planned policy (bare left out)
    arms = (("null", NullPolicy), ("planned", lambda: PlannedPolicy(make())))
if os.environ.get("NULL", "0") == "2":  # ... and the floor with the planner's worker learning beside it
    arms = (("null", NullPolicy), ("null+worker", NullWithWorker), ("planned", lambda: PlannedPolicy(make())))
for label, make_pol in arms * int(os.environ.get("REPEATS", "2")):
    run(label, make_pol(), wrapped=False)
if os.environ.get("PER_CALL", "1") == "1":
    for label, make_pol in arms:
        run(label, make_pol(), wrapped=True)
