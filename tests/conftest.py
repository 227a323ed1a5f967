"""Shared fixtures. Tests keep to 2 threads: CI has 2 cores.

`smol_fp32` / `smol_bf16`: the real SmolLM2-135M-Instruct (converted once into the cache).
`smol`: the same model in the serving dtype of this machine (`resolve_dtype("auto")`: bf16 where
the CPU has native bf16, fp32 where bf16 would be emulated and ~2x slower); the tests that do not
check a dtype's own behaviour use it.
`tiny`: a small randomly initialised Llama for the fast cases.
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
