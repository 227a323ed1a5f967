"""Probe: what each CUDA graph of an engine round costs on the GPU, kernel by kernel.

Serves held-out prompts at batch B with plain decoding, a static chain K and a static tree (bf16,
CUDA graphs, the shipped head), so that every graph those rounds replay is captured; then, for
each captured graph of batch bucket B: its replay time alone (CUDA events, median of --reps
replays, nothing else queued) and the kernels of one replay (count, summed GPU microseconds, the
kinds that take the time, by kernel name). A round's GPU time is the sum of its graphs' plus what
runs eagerly between them; `bench engine --only timeline` gives the round's stages beside it.

    python3 scripts/gpu_graph_kernels.py --prompts-file engine_prompts.json --tree 6,8,32 --json out.json

On a CPU (no graphs) it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import tree_fields  # noqa: E402
from bench.heads import resolve_head  # noqa: E402
from online_spec.checkpoint import load_head  # noqa: E402
from online_spec.sampling import SamplingParams  # noqa: E402
from online_spec.target import load_target  # noqa: E402
from online_spec.tree import TreeShape  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402


def kernel_kind(name: str) -> str:
    """A kernel's family, from its (mangled or templated) name."""
    n = name.lower()
    for kind, marks in (("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "splitk")),
                        ("attention", ("flash", "fmha", "attention", "efficient")),
                        ("reduce", ("reduce", "softmax", "norm", "topk", "sort", "scan", "radix", "argmax")),
                        ("index", ("index", "gather", "scatter", "masked")),
                        ("copy", ("copy", "cat", "memcpy", "memset", "fill")),
                        ("elementwise", ("elementwise", "vectorized", "unrolled"))):
        if any(m in n for m in marks):
            return kind
    return "other"


def graph_report(g, reps: int) -> dict:
    """Replay time and the kernels of one replay of a captured graph."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    n = 3
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            g.graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / n, e.self_device_time_total / n) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kinds: dict[str, list[float]] = {}
    for name, count, us in rows:
        k = kinds.setdefault(kernel_kind(name), [0.0, 0.0])
        k[0] += count
        k[1] += us
    rows.sort(key=lambda r: -r[2])
    return {"replay_ms": statistics.median(times), "kernels": sum(r[1] for r in rows),
            "kernel_us": sum(r[2] for r in rows),
            "by_kind": {k: {"kernels": round(c, 1), "us": round(u, 1)} for k, (c, u) in
                        sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": name[:120], "per_replay": round(c, 1), "us": round(u, 1)} for name, c, u in rows[:12]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts-file", required=True, help="bench engine --save-prompts JSON (token ids per set)")
    ap.add_argument("--data", default="chat", help="the prompt set to serve")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3, help="the static chain's K")
    ap.add_argument("--tree", default="6,8,32", help="the static tree 'num_steps,topk,num_draft_tokens'")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="prompts served (at most --batch at a time)")
    ap.add_argument("--reps", type=int, default=50, help="replays timed per graph")
    ap.add_argument("--fused-norm", action="store_true",
                    help="what-if: every RMSNorm (target and head) as torch's F.rms_norm instead of HF's composite")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.fused_norm:
        from transformers.models.llama import modeling_llama

        def rms_norm(self, x):
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)

        modeling_llama.LlamaRMSNorm.forward = rms_norm
    if not torch.cuda.is_available():
        print("gpu_graph_kernels: no CUDA device (the probe times CUDA graphs)", file=sys.stderr)
        return 2
    target = load_target(device="cuda")
    head, _ = load_head(resolve_head("shipped", target), target.info, dtype=target.dtype)
    head = head.to(target.device)
    prompts = json.loads(Path(a.prompts_file).read_text())[a.data][:max(a.batch, a.requests)]
    tree = TreeShape.parse(a.tree, "tree")
    sp = SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)
    out: dict = {"device": torch.cuda.get_device_name(), "batch": a.batch, "k": a.k, "tree": a.tree,
                 "torch": torch.__version__, "fused_norm": a.fused_norm, "configs": {}}
    for name, h, fields in (("plain", None, {"num_steps": 0}), (f"chain_{a.k}", head, {"num_steps": a.k}),
                            (f"tree_{a.tree.replace(',', '_')}", head, tree_fields(tree))):
        eng = Engine(target, h, EngineConfig(max_batch=a.batch, max_len=1024, **fields))
        eng.generate(list(prompts), sp)  # captures the graphs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(len(o) for o in eng.generate(list(prompts), sp))
        torch.cuda.synchronize()
        graphs = {"tokens_per_s": n / (time.perf_counter() - t0)}
        print(f"{name}: {graphs['tokens_per_s']:.1f} tokens/s", flush=True)
        for key, g in eng.graphs._graphs.items():
            if g.graph in (None, False) or key[1] != eng.graphs.bucket(a.batch):
                continue
            label = "/".join(str(x) for x in key[:5] if not isinstance(x, int) or x < 10**6)
            graphs[label] = graph_report(g, a.reps)
            r = graphs[label]
            print(f"{name} {label}: {r['replay_ms']:.3f} ms, {r['kernels']:.0f} kernels, "
                  f"{r['kernel_us']:.0f} us in kernels; {json.dumps({k: v['us'] for k, v in r['by_kind'].items()})}",
                  flush=True)
        out["configs"][name] = graphs
        del eng
        torch.cuda.empty_cache()
    Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
