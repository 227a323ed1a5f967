"""A/B in one process: what a plain round (K = 0) costs an engine that holds a head, with the draft
cache kept caught up every K = 0 round or caught up by the next drafting round
(`ChainRounds.catch_up_plain`, serving/chain_round.py).

For each batch size: plain decoding with no head; the head at K = 0 throughout; and a phased
schedule (`--phase` K = 0 rounds, then as many at K = `--k`, over and over: a policy falling back
to plain decoding and probing out of it), each with `catch_up_plain` on and off, the arms
alternating which goes first, after an untimed warm-up of each (bf16, the shipped head, CUDA
graphs where the device has them). Reports each arm's tokens/s (median of --reps), the paired
ratios off / on, and whether each arm's outputs equalled plain decoding's in every repeat: in
fp32 they must (`--dtype float32`: the script fails otherwise); in bf16 a verify of several
tokens may round a near-tie the other way than a one-token step, so there it is only reported.

    python3 scripts/plain_round_ab.py --prompts-file engine_prompts.json --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lossless import CyclingSteps  # noqa: E402
from scripts.keep_drafts_ab import add_common, load, timed  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(ap, 96)
    ap.add_argument("--data", default="code", help="the prompt set (code: where the chat head loses to plain)")
    ap.add_argument("--k", type=int, default=3, help="K of the phased schedule's drafting rounds")
    ap.add_argument("--phase", type=int, default=16, help="rounds a phase of the phased schedule")
    a = ap.parse_args(argv)
    target, cuda, head, sets, sp = load(a)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "dtype": a.dtype, "data": a.data, "k": a.k, "phase": a.phase, "requests": a.requests,
                 "new_tokens": a.new_tokens, "reps": a.reps, "cases": []}
    schedules = {"k0": [0], f"phased_{a.phase}x0_{a.phase}x{a.k}": [0] * a.phase + [a.k] * a.phase}
    for B in [int(x) for x in a.batches.split(",")]:
        prompts = sets[a.data][:max(B, a.requests)]
        plain = Engine(target, None, EngineConfig(max_batch=B, max_len=1024, num_steps=0))
        _, reference = timed(plain, prompts, sp, cuda)  # also the warm-up
        plain_tps, same = [], {}
        arms: dict = {}
        for name, ks in schedules.items():
            for catch_up in (True, False):
                eng = Engine(target, head, EngineConfig(max_batch=B, max_len=1024, num_steps=max(ks), max_steps=7),
                             policy=CyclingSteps(ks))
                eng.catch_up_plain = catch_up
                timed(eng, prompts, sp, cuda)
                arms[name, catch_up] = (eng, [])
                same[name, catch_up] = True
        for r in range(a.reps):
            plain_tps.append(timed(plain, prompts, sp, cuda)[0])
            for name in schedules:
                for catch_up in ((True, False) if r % 2 == 0 else (False, True)):
                    eng, tps = arms[name, catch_up]
                    eng.set_policy(CyclingSteps(schedules[name]))  # each run from the schedule's start
                    t, outs = timed(eng, prompts, sp, cuda)
                    tps.append(t)
                    same[name, catch_up] &= outs == reference
        p = statistics.median(plain_tps)
        for name in schedules:
            on, off = arms[name, True][1], arms[name, False][1]
            ratios = [x / y for x, y in zip(off, on)]
            case = {"batch": B, "schedule": name, "plain_tokens_per_s": round(p, 1),
                    "caught_up_tokens_per_s": round(statistics.median(on), 1),
                    "lazy_tokens_per_s": round(statistics.median(off), 1),
                    "lazy_over_caught_up": round(statistics.median(ratios), 4),
                    "lazy_over_caught_up_range": [round(min(ratios), 4), round(max(ratios), 4)],
                    "caught_up_over_plain": round(statistics.median(on) / p, 4),
                    "lazy_over_plain": round(statistics.median(off) / p, 4),
                    "caught_up_equals_plain": same[name, True], "lazy_equals_plain": same[name, False]}
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    lossless = all(c["caught_up_equals_plain"] and c["lazy_equals_plain"] for c in out["cases"])
    return 0 if lossless or a.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
