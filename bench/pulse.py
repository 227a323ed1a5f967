"""The machine's speed before each of a long bench's configurations: a fixed plain-decode workload.

`bench e2e` serves its configurations one after another, 3-6 minutes each on a 2-core CPU, and
compares their tokens per second. On the 2-core VM those minutes are not alike: in one run of
2026-11-28 static K = 2 served 79.8 tok/s and SGLang's EMA tiers over the same K 57.5 minutes
later, and the same configuration of the same code served 68.2 and 58.7 in two sessions 20
minutes apart (docs/results.md). A pulse measures the machine, not the configuration: the
target alone decoding a fixed batch of fixed prompts on the server's threads, a few seconds,
before each configuration. Its spread over a run says how much of the ratios between
configurations is the machine's: a run whose pulses spread by 30 % cannot resolve a 10 % gain.
The pulse has a floor of its own: four back to back on that VM read 39.2-45.1 tok/s (15 %), so
only a spread well above it says the machine moved.

    tps = machine_pulse(target, threads=1)          # tokens a second of the fixed workload
    figs = pulse_figures({"plain": 61.2, "static": 60.8, ...})
"""

from __future__ import annotations

import time

import torch

PULSE_BATCH, PULSE_PROMPT_TOKENS, PULSE_STEPS, PULSE_REPEATS = 4, 96, 16, 3


def machine_pulse(target, threads: int, *, batch: int = PULSE_BATCH, prompt_tokens: int = PULSE_PROMPT_TOKENS,
                  steps: int = PULSE_STEPS, repeats: int = PULSE_REPEATS) -> float | None:
    """Tokens a second of plain decoding on the CPU: `batch` requests of `prompt_tokens` fixed
    token ids, `steps` new tokens each, prefill included, on `threads` torch threads (given back
    after); the best of `repeats`. None for a target off the CPU (a GPU's speed does not drift
    with a neighbour's load as a shared CPU's does; not measured)."""
    from online_spec.sampling import SamplingParams  # the engine brings transformers: bench --help stays fast
    from serving.engine import Engine, EngineConfig

    if target.device.type != "cpu":
        return None
    vocab = target.info.vocab_size
    prompts = [[(101 + 7 * i + 131 * b) % vocab for i in range(prompt_tokens)] for b in range(batch)]
    sp = SamplingParams(max_tokens=steps, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for _ in range(max(1, repeats)):
            engine = Engine(target, None, EngineConfig(max_batch=batch, max_len=prompt_tokens + steps + 8,
                                                       num_steps=0))
            t0 = time.perf_counter()
            out = engine.generate(prompts, sp)
            best = max(best, sum(map(len, out)) / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


def pulse_figures(pulses: dict[str, float | None]) -> dict:
    """Each configuration's pulse (tokens/s) and their spread (the fastest over the slowest)."""
    seen = {k: round(v, 2) for k, v in pulses.items() if v}
    return {"tokens_per_s": seen,
            "spread": round(max(seen.values()) / min(seen.values()), 3) if seen else None,
            "workload": f"plain decoding, batch {PULSE_BATCH}, {PULSE_PROMPT_TOKENS} prompt tokens, {PULSE_STEPS} "
                        f"new tokens each, prefill included, best of {PULSE_REPEATS}, before each configuration"}
