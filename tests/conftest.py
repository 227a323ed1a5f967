"""Shared fixtures. Tests keep to 2 threads: CI has 2 cores.

`smol_fp32` / `smol_bf16`: the real SmolLM2-135M-Instruct (converted once into the cache).
`smol`: the same model in the serving dtype of this machine (`resolve_dtype("auto")`: bf16 where
the CPU has native bf16, fp32 where bf16 would be emulated and ~2x slower); the tests that do not
check a dtype's own behaviour use it.
`tiny`: a small randomly initialised Llama for the fast cases.
`plain_greedy_fp32`: plain greedy decoding of the first ShareGPT prompts on `smol_fp32`, computed
once for the chain and the tree lossless modules.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests run servers and trainers side by side
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _two_threads():
    """Benches run in-process set their own torch thread count (a bench session's server: 1) and
    leave it: without this, every test after the first such bench would run on one core."""
    yield
    if torch.get_num_threads() != 2:
        torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smol_fp32():
    from online_spec.target import load_target
    return load_target(dtype=torch.float32)


@pytest.fixture(scope="session")
def smol_bf16():
    from online_spec.target import load_target
    return load_target(dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def smol(request):
    from online_spec.target import resolve_dtype
    name = "smol_bf16" if resolve_dtype("auto") == torch.bfloat16 else "smol_fp32"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def tiny():
    from online_spec.target import tiny_target
    return tiny_target()


@pytest.fixture(scope="session")
def sharegpt_prompts(smol_fp32):
    from online_spec.data import sharegpt_conversations
    convs = sharegpt_conversations(limit=80, seed=0, max_prompt_tokens=200, tokenizer=smol_fp32.tokenizer)
    return [smol_fp32.encode_chat(c[:1]) for c in convs]


# the lossless modules compare speculative decoding with these; a greedy output's prefix is the
# greedy output of fewer tokens, so each module takes the tokens it generates (at most these)
PLAIN_PROMPTS, PLAIN_TOKENS = 56, 64


@pytest.fixture(scope="session")
def plain_greedy_fp32(smol_fp32, sharegpt_prompts):
    """(prompts, outputs): plain greedy decoding (K = 0, fp32, ignore_eos) of the first 56 prompts,
    64 new tokens each, all in one batch: a row's tokens do not depend on its batch (the lossless
    tests compare batches of 8, 4 and 1 with it; transformers' generate and the engine at batch 1
    check it), and one batch of 56 takes a third of the time of seven of 8."""
    from online_spec.sampling import SamplingParams
    from serving.engine import Engine, EngineConfig

    assert len(sharegpt_prompts) >= PLAIN_PROMPTS
    prompts = sharegpt_prompts[:PLAIN_PROMPTS]
    eng = Engine(smol_fp32, None, EngineConfig(max_batch=len(prompts), max_len=512, num_steps=0))
    return prompts, eng.generate(prompts, SamplingParams(max_tokens=PLAIN_TOKENS, ignore_eos=True))
