"""`online-spec bench engine`: the engine's throughput, the cost ratios speculation lives on, and
a lossless spot check — all measured side by side in one process, medians of repeats.

    online-spec bench engine --json out/engine.json [--quick] [--draft DIR]

Writes: `plain_tokens_per_s` and `hf_generate_tokens_per_s` at batch 1 (the engine's plain
decode against transformers' generate), `verify_cost_ratio` keyed by K (a verify of K+1 tokens
over one plain step, batch 1), `draft_step_cost_ratio` (one draft step over one plain step),
`batch` (tokens/s per batch size 1/4/16, plain and with the head at each K), `lossless` (true
only if the spot check matched) with its details, and the machine. Without `--draft` the head
is a random day-0 head: its drafts are rejected, so speculative tokens/s there measure overhead.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import add_bench_args, median_time, quick_overrides, write_report
from bench.heads import HEAD_CHOICES, resolve_head
from bench.lossless import CyclingSteps, first_divergence, tie_gap, wrong_head
from online_spec.checkpoint import load_head
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.data import humaneval_conversations, sharegpt_conversations
from online_spec.head import new_head
from online_spec.kvcache import AttentionBatch
from online_spec.sampling import SamplingParams
from online_spec.target import load_target
from online_spec.tree import TreeShape
from serving.cuda_graphs import CudaGraphs
from serving.engine import Engine, EngineConfig
from serving.timeline import RoundTimeline

log = logging.getLogger(__name__)


@dataclass
class EngineBenchConfig:
    draft: str = doc("head to measure: " + HEAD_CHOICES + " (default: a random day-0 head, whose drafts are "
                     "rejected: speculative figures then measure overhead)", "")
    new_tokens: int = doc("tokens generated per request in throughput runs", 64)
    repeats: int = doc("repeats per measurement (the median is reported)", 3)
    requests_per_run: int = doc("requests served per throughput run (at least the batch size), so a "
                                "batch-1 figure is not one prompt's; repeat r starts r runs further on", 8)
    batch_sizes: list[int] = doc("batch sizes of the throughput table", lambda: [1, 4, 16])
    steps: list[int] = doc("K values measured", lambda: [1, 3, 5, 7])
    ctx_len: int = doc("context length for the cost ratios", 256)
    lossless_prompts: int = doc("prompts of the fp32 lossless spot check", 8)
    lossless_tokens: int = doc("tokens per prompt in the lossless spot check", 64)
    bf16_tie_tol: float = doc("top-2 logit gap under which a bf16 divergence counts as a near-tie", 0.25)
    device: str = doc("torch device of the target and head ('cuda': the engine replays CUDA graphs, and "
                      "the eager figures are measured beside them)", "cpu")
    trees: list[str] = doc("tree shapes of the shape grid, each 'num_steps,topk,num_draft_tokens' (SGLang's "
                           "default for Llama targets is 5,4,8)", lambda: ["5,4,8", "6,4,16", "6,8,32"])
    grid_chains: list[int] = doc("chain K values of the shape grid", lambda: [1, 2, 3, 5, 7])
    grid_batch_sizes: list[int] = doc("batch sizes of the shape grid", lambda: [1, 4, 16])
    grid_data: list[str] = doc("traffic of the shape grid: chat (held-out ShareGPT chat) and/or code "
                               "(HumanEval tasks the shipped heads did not train on)", lambda: ["chat", "code"])
    only: str = doc("run one part: all | grid (the shape grid and the tree lossless check) | classic "
                    "(everything but the grid) | timeline (where a round's time goes, per stage, per policy)", "all")
    timeline_batch_sizes: list[int] = doc("batch sizes of the timeline part", lambda: [1, 4])
    timeline_k: int = doc("the static K the timeline part compares the cost policy with", 3)
    timeline_tree: str = doc("a static tree 'num_steps,topk,num_draft_tokens' the timeline part runs beside "
                             "the static K (its rounds' stages: draft, verify, accept); empty = none", "")
    prompts_file: str = doc("read the prompts (token ids per traffic) from this JSON file written by "
                            "--save-prompts, instead of the datasets: for a machine without them (a lent GPU)", "")
    save_prompts: str = doc("write the prompts this configuration uses (token ids per traffic) to this JSON file "
                            "and exit", "")

    def __post_init__(self):
        check(self.new_tokens >= 1, "new_tokens", "must be >= 1")
        check(self.repeats >= 1, "repeats", "must be >= 1")
        check(self.requests_per_run >= 1, "requests_per_run", "must be >= 1")
        check(all(b >= 1 for b in self.batch_sizes), "batch_sizes", "must be >= 1")
        check(all(b >= 1 for b in self.grid_batch_sizes), "grid_batch_sizes", "must be >= 1")
        check(set(self.grid_data) <= {"chat", "code"}, "grid_data", f"must be chat and/or code, got {self.grid_data}")
        check(self.only in ("all", "grid", "classic", "timeline"), "only",
              f"must be all, grid, classic or timeline, got {self.only!r}")
        self.tree_shapes()  # raises naming the field
        if self.timeline_tree:
            TreeShape.parse(self.timeline_tree, "timeline_tree")

    def tree_shapes(self) -> list[TreeShape]:
        return [TreeShape.parse(s, "trees") for s in self.trees]


QUICK = dict(new_tokens=32, repeats=3, batch_sizes=[1, 4, 16], steps=[1, 3, 7], lossless_prompts=4,
             lossless_tokens=32, requests_per_run=4, trees=["5,4,8"], grid_chains=[1, 3], grid_batch_sizes=[1],
             grid_data=["chat"])


def _prompts(target, n: int, split: str = "heldout", data: str = "all") -> list[list[int]]:
    """n prompts: held-out ShareGPT (data "all" or "chat": its non-programming part), or "code":
    HumanEval tasks of the split no shipped head trained on."""
    if data == "code":
        convs = humaneval_conversations(limit=n, seed=1, split="heldout")
    else:
        convs = sharegpt_conversations(limit=n, seed=1, split=split, max_prompt_tokens=160, tokenizer=target.tokenizer,
                                       topic="chat" if data == "chat" else "all")
    return [target.encode_chat(c[:1]) for c in convs]


def cost_ratios(target, head, steps: list[int], ctx_len: int, repeats: int, graphs: bool = False) -> dict:
    """Verify of K+1 tokens and one draft step, each over one plain step, batch 1, at ctx_len.
    graphs: through CUDA graph replays (the engine's path on a GPU) instead of eager forwards."""
    dev = target.device
    ids = torch.randint(100, 10_000, (1, ctx_len + 16), device=dev)
    cache = target.new_cache(1, ctx_len + 16)
    target.forward(ids[:, :ctx_len], AttentionBatch([0], ctx_len, dev), cache, slice(-1, None))
    dcache = head.new_cache(1, ctx_len + 16)
    emb = target.embed_tokens(ids[:, 1:ctx_len + 1])
    feats = torch.randn(1, ctx_len, 3 * target.info.hidden_size, dtype=target.dtype, device=dev)
    head.step(emb, feats, AttentionBatch([0], ctx_len, dev), dcache, target.rope)
    hidden = torch.randn(1, 1, head.cfg.hidden_size, dtype=target.dtype, device=dev)
    if graphs:
        cg = CudaGraphs(target, 1, ctx_len + 16)

        def fwd(t):
            return lambda: cg.target_forward(ids[:, ctx_len:ctx_len + t], [ctx_len], cache)

        def draft_step():
            return cg.head_step(head, dcache, emb[:, :1], hidden, [ctx_len])
    else:
        def fwd(t):
            return lambda: target.forward(ids[:, ctx_len:ctx_len + t], AttentionBatch([ctx_len], t, dev), cache)

        def draft_step():
            return head.step(emb[:, :1], hidden, AttentionBatch([ctx_len], 1, dev), dcache, target.rope)

    # interleave so drift in machine load hits every measurement alike
    samples: dict[str, list[float]] = {"plain": [], "draft": [], **{f"v{k}": [] for k in steps}}
    calls = {"plain": fwd(1), "draft": draft_step, **{f"v{k}": fwd(k + 1) for k in steps}}
    for _ in range(repeats):
        for name, fn in calls.items():
            samples[name].append(median_time(fn, 3, warmup=1))
    plain = statistics.median(samples["plain"])
    return {"plain_step_ms": plain * 1e3,
            "verify_cost_ratio": {str(k): statistics.median(samples[f"v{k}"]) / plain for k in steps},
            "draft_step_cost_ratio": statistics.median(samples["draft"]) / plain,
            "draft_step_ms": statistics.median(samples["draft"]) * 1e3}


def run_prompts(prompts: list[list[int]], repeat: int, batch: int, requests: int) -> list[list[int]]:
    """The prompts of one throughput run: max(batch, requests) of them, cycling through `prompts`,
    starting one run further on for each repeat (every K of a repeat serves the same ones)."""
    n = max(batch, requests)
    return [prompts[(repeat * n + i) % len(prompts)] for i in range(n)]


def tree_fields(tree: TreeShape | None) -> dict:
    """The `EngineConfig` fields of a static tree (SGLang's flags); {} for chains."""
    return {} if tree is None else dict(num_steps=tree.num_steps, max_steps=tree.num_steps,
                                        speculative_eagle_topk=tree.topk,
                                        speculative_num_draft_tokens=tree.num_draft_tokens)


def tokens_per_s(target, head, prompts, batch: int, K: int, new_tokens: int,
                 graphs: bool = True, tree: TreeShape | None = None) -> tuple[float, float]:
    """(tokens/s, mean accept length incl. bonus) of the engine serving `prompts` at static K (or
    the static `tree`), at most `batch` at a time (continuous batching). On a GPU (graphs: CUDA
    graphs on, chain and tree rounds) one untimed run first captures the graphs."""
    eng = Engine(target, head if (K > 0 or tree) else None,
                 EngineConfig(max_batch=batch, max_len=1024, cuda_graphs=graphs,
                              **({"num_steps": K} | tree_fields(tree))))
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ps = list(prompts)
    if eng.graphs is not None:
        eng.generate(ps, sp)
    rounds = []
    eng.on_round.append(lambda s, o: rounds.append((s.committed, s.batch_size)) if s.num_steps else None)
    t0 = time.perf_counter()
    outs = eng.generate(ps, sp)
    dt = time.perf_counter() - t0
    acc = sum(c for c, _ in rounds) / max(1, sum(b for _, b in rounds)) if rounds else 1.0
    return sum(len(o) for o in outs) / dt, acc


def timed_rounds(target, head, policy, prompts, batch: int, new_tokens: int, profile: bool,
                 cuts: str = "auto", tree: TreeShape | None = None) -> tuple[dict, list]:
    """One run of `prompts` with a `RoundTimeline` on the engine (after an untimed run that captures
    the CUDA graphs and lets the policy learn); with `profile` (CUDA), the timed run is profiled and
    the GPU's kernel ms per round go into the report; `cuts`: the engine's `in_round_cuts`; `tree`:
    a static tree the engine runs (the policy's K is then its depth). Returns (timeline report, outputs)."""
    eng = Engine(target, head, EngineConfig(**({"max_batch": batch, "max_len": 1024, "max_steps": 7,
                                                "in_round_cuts": cuts} | tree_fields(tree))), policy=policy)
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eng.generate(list(prompts), sp)
    eng.timeline = tl = RoundTimeline(target.device)
    if not profile:
        t0 = time.perf_counter()
        outs = eng.generate(list(prompts), sp)
        report = tl.report()
        report["tokens_per_s"] = sum(len(o) for o in outs) / (time.perf_counter() - t0)
        return report, outs
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        outs = eng.generate(list(prompts), sp)
    torch.cuda.synchronize()
    # the GPU's own events (kernels, copies), not the stage ranges mirrored on its timeline: a
    # range's device time would count its kernels again (a first version summed both: busy > wall)
    busy_us = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("round."))
    return tl.report(busy_us / 1e3 / max(1, len(tl.rounds))), outs


def round_timelines(cfg: EngineBenchConfig, target, head, prompts) -> dict:
    """Per batch size: a static K, the cost policy on the engine thread (the engine's default
    in-round cuts: on for CPU, off for CUDA), the same with the cuts the other way
    (`cost_cuts_on` / `cost_cuts_off`), and the cost policy learning on its worker thread
    (`serve --plan-ahead`), and with `timeline_tree` that static tree, each one timed run of the
    same prompts: the stage timeline of its rounds (and on CUDA the GPU's idle share from a
    profile), its tokens/s, and whether its output equals the static K's (greedy fp32: it must)."""
    from online_spec.controller import StaticSteps
    from serving.calibrate import engine_cost_policy
    from serving.policy_planner import PlannedPolicy

    gpu = target.device.type == "cuda"
    tree = TreeShape.parse(cfg.timeline_tree, "timeline_tree") if cfg.timeline_tree else None
    base, _ = engine_cost_policy(target, head, max(cfg.timeline_batch_sizes), 7, max_len=1024)
    out = {}
    for b in cfg.timeline_batch_sizes:
        ps = run_prompts(prompts, 0, b, cfg.requests_per_run)
        row, ref = {}, None
        other = "on" if gpu else "off"  # the in-round cuts the device's default does not use
        runs = [(f"static_k{cfg.timeline_k}", lambda: StaticSteps(cfg.timeline_k), "auto", None),
                ("cost", lambda: copy.deepcopy(base), "auto", None),
                (f"cost_cuts_{other}", lambda: copy.deepcopy(base), other, None),
                ("cost_planned", lambda: PlannedPolicy(copy.deepcopy(base)), "auto", None)]
        if tree is not None:
            runs.insert(1, (shape_name(tree.num_steps, tree), lambda: StaticSteps(tree.num_steps), "auto", tree))
        for name, make, cuts, shape in runs:
            report, outs = timed_rounds(target, head, make(), ps, b, cfg.new_tokens, profile=False, cuts=cuts,
                                        tree=shape)
            if gpu:
                report["profiled"] = timed_rounds(target, head, make(), ps, b, cfg.new_tokens, profile=True,
                                                  cuts=cuts, tree=shape)[0]
            ref = outs if ref is None else ref
            report["same_tokens_as_static"] = outs == ref  # greedy: fp32 must; bf16 may part at near-ties
            row[name] = report
            log.info("timeline b=%d %s: wall %.2f ms a round, host %s", b, name, report["wall_ms"],
                     {k: round(v, 3) for k, v in report["host_ms"].items() if v is not None})
        out[str(b)] = row
    return out


def shape_name(K: int, tree: TreeShape | None) -> str:
    return f"tree_{tree.num_steps}_{tree.topk}_{tree.num_draft_tokens}" if tree else ("plain" if K == 0 else f"chain_{K}")


def prompt_sets(cfg: EngineBenchConfig, target) -> dict[str, list[list[int]]]:
    """Token-id prompts per traffic kind this configuration serves: "all" (the throughput table
    and the lossless checks) and each of `grid_data`; from `prompts_file` when given."""
    if cfg.prompts_file:
        sets = json.loads(Path(cfg.prompts_file).read_text())
        missing = {"all", *cfg.grid_data} - sets.keys()
        if missing:
            raise ValueError(f"--prompts-file {cfg.prompts_file}: no prompts for {sorted(missing)}")
        return sets
    n_grid = cfg.repeats * max([cfg.requests_per_run] + cfg.grid_batch_sizes)
    sets = {"all": _prompts(target, max(cfg.repeats * max([cfg.requests_per_run] + cfg.batch_sizes),
                                        cfg.lossless_prompts))}
    for data in cfg.grid_data:
        sets[data] = _prompts(target, n_grid, data=data)
    return sets


def grid_best(row: dict) -> dict:
    """The fastest chain and tree of one grid row ({shape name: {"tokens_per_s", "accept_length"}},
    plain included) and their ratios; `tree_round_in_plain_steps`: the best tree's round time in
    plain decode steps (accept length x plain tokens/s / its tokens/s), so the tree serves N x
    plain once its accept length reaches N times this (the aims' ceiling, measured in the run)."""
    chains = {n: v for n, v in row.items() if n.startswith("chain_")}
    trees = {n: v for n, v in row.items() if n.startswith("tree_")}
    best_chain = max(chains, key=lambda n: chains[n]["tokens_per_s"]) if chains else None
    best_tree = max(trees, key=lambda n: trees[n]["tokens_per_s"]) if trees else None
    plain = row["plain"]["tokens_per_s"]
    tree = trees[best_tree] if best_tree else None
    return {"chain": best_chain, "tree": best_tree,
            "tree_vs_chain": tree["tokens_per_s"] / chains[best_chain]["tokens_per_s"] if best_chain and tree else None,
            "tree_vs_plain": tree["tokens_per_s"] / plain if tree else None,
            "chain_vs_plain": chains[best_chain]["tokens_per_s"] / plain if best_chain else None,
            "tree_round_in_plain_steps": tree["accept_length"] * plain / tree["tokens_per_s"] if tree else None}


def shape_grid(cfg: EngineBenchConfig, target, head, prompt_set: dict[str, list[list[int]]]) -> dict:
    """Tokens/s and accepted drafts per request-round of plain decode, every chain K and every
    tree, per traffic and batch size; shapes interleaved within each repeat (drift in machine
    load hits them alike). `best` at each batch: the fastest chain and tree and their ratios."""
    shapes = [(0, None)] + [(k, None) for k in cfg.grid_chains] + [(t.num_steps, t) for t in cfg.tree_shapes()]
    out = {}
    for data in cfg.grid_data:
        prompts = prompt_set[data]
        per_batch = {}
        for b in cfg.grid_batch_sizes:
            runs: dict[str, list[tuple[float, float]]] = {shape_name(k, t): [] for k, t in shapes}
            for r in range(cfg.repeats):
                ps = run_prompts(prompts, r, b, cfg.requests_per_run)
                for k, t in shapes:
                    runs[shape_name(k, t)].append(tokens_per_s(target, head, ps, b, k, cfg.new_tokens, tree=t))
            row = {name: {"tokens_per_s": statistics.median(x[0] for x in v),
                          "accept_length": statistics.median(x[1] for x in v),
                          "accepted_drafts_per_round": statistics.median(x[1] for x in v) - 1.0}
                   for name, v in runs.items()}
            row["best"] = grid_best(row)
            log.info("grid %s batch %d: %s", data, b, row["best"])
            per_batch[str(b)] = row
        out[data] = per_batch
    return out


def tree_lossless_check(prompts, n_tokens: int, head_path: str, shapes: list[TreeShape], device: str = "cpu") -> dict:
    """fp32 greedy through tree rounds (each grid shape and top-k 2/8, batch 1 and 8, the
    measured head and a random one) token-identical to plain decoding."""
    t32 = load_target(dtype=torch.float32, device=device)
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    ref = Engine(t32, None, EngineConfig(max_batch=8, max_len=1024, num_steps=0)).generate(prompts, sp)
    heads = {"random": new_head(t32, seed=7)}
    if head_path:
        heads["measured"] = load_head(head_path, t32.info, dtype=torch.float32)[0].to(t32.device)
    cases, ok = [], True
    for kind, head in heads.items():
        for tree in shapes + [TreeShape(3, 2, 6), TreeShape(4, 8, 24)]:
            for batch in (1, 8):
                ps = prompts[:2] if batch == 1 else prompts
                cfg = EngineConfig(max_batch=batch, max_len=1024, num_steps=tree.num_steps, max_steps=tree.num_steps,
                                   speculative_eagle_topk=tree.topk, speculative_num_draft_tokens=tree.num_draft_tokens)
                same = Engine(t32, head, cfg).generate(ps, sp) == ref[:len(ps)]
                ok &= same
                cases.append({"head": kind, "tree": shape_name(tree.num_steps, tree), "batch": batch, "identical": same})
    return {"tree_lossless": bool(ok), "tree_fp32_cases": cases}


def hf_generate_tokens_per_s(target, prompt, new_tokens: int) -> float:
    x = torch.tensor([prompt], device=target.device)
    dt = median_time(lambda: target.hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=False), 1, warmup=0)
    return new_tokens / dt


def lossless_spot_check(prompts, n_tokens: int, tie_tol: float, device: str = "cpu") -> dict:
    """fp32: the full matrix (random and wrong heads, K 1/3/7, batch 1 and 8, heads swapped
    mid-generation with K cycling) token-identical to plain decoding. bf16: divergences only
    at near-ties of the target. On a GPU every engine here replays CUDA graphs."""
    t32 = load_target(dtype=torch.float32, device=device)
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    ref = Engine(t32, None, EngineConfig(max_batch=8, max_len=1024, num_steps=0)).generate(prompts, sp)
    cases, ok = [], True
    for kind in ("random", "wrong"):
        for K in (1, 3, 7):
            for batch in (1, 8):
                head = new_head(t32, seed=K) if kind == "random" else wrong_head(t32)
                ps = prompts[:2] if batch == 1 else prompts
                out = Engine(t32, head, EngineConfig(max_batch=batch, max_len=1024, num_steps=K)).generate(ps, sp)
                same = out == ref[:len(ps)]
                ok &= same
                cases.append({"head": kind, "K": K, "batch": batch, "prompts": len(ps), "identical": same})
    heads = [new_head(t32, seed=21), wrong_head(t32), None]
    eng = Engine(t32, heads[0], EngineConfig(max_batch=8, max_len=1024, max_steps=7), policy=CyclingSteps())
    n_swaps = []

    def swap(stats, outs):
        v = len(n_swaps) + 1
        eng.swap_head(heads[v % 3], v)
        n_swaps.append(v)

    eng.on_round.append(swap)
    same = eng.generate(prompts, sp) == ref
    ok &= same
    cases.append({"head": "swapped every round", "K": "cycling 0/1/3/7", "batch": 8, "prompts": len(prompts),
                  "swaps": len(n_swaps), "identical": same})

    t16 = load_target(dtype=torch.bfloat16, device=device)
    plain = Engine(t16, None, EngineConfig(max_batch=8, max_len=1024, num_steps=0)).generate(prompts, sp)
    spec = Engine(t16, new_head(t16, seed=3), EngineConfig(max_batch=8, max_len=1024, num_steps=3)).generate(prompts, sp)
    gaps = []
    for p, a, b in zip(prompts, plain, spec):
        i = first_divergence(a, b)
        if i is not None:
            gap = tie_gap(t16, p + a[:i], (a[i], b[i]))
            gaps.append(gap)
            ok &= gap <= tie_tol
    return {"lossless": bool(ok), "fp32_cases": cases, "bf16_divergences": len(gaps), "bf16_gaps": gaps,
            "bf16_tie_tol": tie_tol, "tokens_per_prompt": n_tokens}


def run_bench(cfg: EngineBenchConfig, prompts: list[list[int]] | None = None) -> dict:
    """All figures; `prompts` (token ids) replace the held-out ShareGPT prompts where that
    package is missing (the GPU machine)."""
    target = load_target(device=cfg.device)
    draft = resolve_head(cfg.draft, target) if cfg.draft else ""
    if draft:
        head, _ = load_head(draft, target.info, dtype=target.dtype)
        head = head.to(target.device)
    else:
        head = new_head(target)
    sets = prompt_sets(cfg, target)
    prompts = prompts or sets["all"]
    gpu = target.device.type == "cuda"
    out: dict = {"config": config_to_dict(cfg), "head": cfg.draft or "random day-0 head", "dtype": str(target.dtype).removeprefix("torch."),
                 "cuda_graphs": gpu, "distinct_prompts": len({tuple(p) for p in prompts})}
    if cfg.only == "timeline":
        out["timeline"] = round_timelines(cfg, target, head, prompts)
        same = all(rep["same_tokens_as_static"] for row in out["timeline"].values() for rep in row.values())
        # the lossless contract is fp32 token identity; bf16 outputs may part at near-ties (docs/engine.md)
        out["lossless"] = same if target.dtype == torch.float32 else None
        return out
    if cfg.only in ("all", "grid"):
        log.info("shape grid: plain, chains %s, trees %s", cfg.grid_chains, cfg.trees)
        out["shape_grid"] = shape_grid(cfg, target, head, sets)
        out.update(tree_lossless_check(prompts[:cfg.lossless_prompts], cfg.lossless_tokens, draft,
                                       cfg.tree_shapes(), cfg.device))
        if cfg.only == "grid":
            out["lossless"] = out["tree_lossless"]
            return out
    log.info("cost ratios")
    out.update(cost_ratios(target, head, cfg.steps, cfg.ctx_len, cfg.repeats, graphs=gpu))
    if gpu:  # the same ratios without graphs: what the graphs buy per forward
        eager = cost_ratios(target, head, cfg.steps, cfg.ctx_len, cfg.repeats, graphs=False)
        out["eager"] = {k: eager[k] for k in ("plain_step_ms", "draft_step_ms", "verify_cost_ratio")}
    log.info("batch 1: engine plain decode vs transformers' generate")
    plain = [tokens_per_s(target, None, prompts[:1], 1, 0, cfg.new_tokens)[0] for _ in range(cfg.repeats)]
    out["plain_tokens_per_s"] = statistics.median(plain)
    if gpu:
        eager = [tokens_per_s(target, None, prompts[:1], 1, 0, cfg.new_tokens, graphs=False)[0]
                 for _ in range(cfg.repeats)]
        out["plain_eager_tokens_per_s"] = statistics.median(eager)
        out["graphs_speedup_plain"] = out["plain_tokens_per_s"] / out["plain_eager_tokens_per_s"]
    out["hf_generate_tokens_per_s"] = hf_generate_tokens_per_s(target, prompts[0], min(cfg.new_tokens, 32))
    out["plain_vs_hf_generate"] = out["plain_tokens_per_s"] / out["hf_generate_tokens_per_s"]
    table = {}
    for b in cfg.batch_sizes:
        row = {}
        for K in [0] + cfg.steps:
            runs = [tokens_per_s(target, head, run_prompts(prompts, r, b, cfg.requests_per_run), b, K,
                                 cfg.new_tokens) for r in range(cfg.repeats)]
            row[str(K)] = {"tokens_per_s": statistics.median(r[0] for r in runs),
                           "accept_length": statistics.median(r[1] for r in runs)}
            log.info("batch %d K=%d: %.1f tok/s", b, K, row[str(K)]["tokens_per_s"])
        table[str(b)] = row
    out["batch"] = table
    log.info("lossless spot check")
    out.update(lossless_spot_check(prompts[:cfg.lossless_prompts], cfg.lossless_tokens, cfg.bf16_tie_tol,
                                   cfg.device))
    out["lossless"] = out["lossless"] and out.get("tree_lossless", True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, EngineBenchConfig, QUICK, "a few-minute version")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = config_from_args(EngineBenchConfig, args, **quick_overrides(args, QUICK))
    if cfg.save_prompts:
        sets = prompt_sets(cfg, load_target())
        Path(cfg.save_prompts).write_text(json.dumps(sets))
        log.info("wrote %s: %s", cfg.save_prompts, {k: len(v) for k, v in sets.items()})
        return 0
    report = write_report(args.json, run_bench(cfg))
    return 1 if report["lossless"] is False else 0  # None: not checked (bf16)
