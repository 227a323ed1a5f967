"""The device option of the e2e path: flags and the trainer child's command line (CPU), and the
Distiller on a GPU where one exists."""

import argparse

import pytest
import torch

from bench.e2e import E2EConfig
from bench.session import SessionConfig, _start_trainer
from trainer.train_cli import add_arguments


def test_train_cli_device_flag_defaults_to_cpu():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).device == "cpu"
    assert p.parse_args(["--device", "cuda"]).device == "cuda"
    assert E2EConfig().device == "cpu" and SessionConfig().device == "cpu"


@pytest.mark.parametrize("device,trainer_device,want", [("cpu", "", None), ("cuda", "", "cuda"),
                                                         ("cuda", "cuda:1", "cuda:1"), ("cpu", "cuda:0", "cuda:0")])
def test_trainer_child_gets_the_device_only_off_cpu(tmp_path, monkeypatch, device, trainer_device, want):
    seen = {}

    class FakePopen:
        def __init__(self, args, **kw):
            seen["args"], seen["env"] = args, kw["env"]

    monkeypatch.setattr("bench.session.subprocess.Popen", FakePopen)
    monkeypatch.setenv("MASTER_PORT", "1234")
    proc = _start_trainer(SessionConfig(device=device, trainer_device=trainer_device,
                                        trainer_args=["--eval-every-s", "5"]), tmp_path, tmp_path, "http://127.0.0.1:1")
    proc._logf.close()
    args = seen["args"]
    if want is None:  # on the server's CPU
        assert "--device" not in args
    else:  # the server's GPU, or the trainer's own device (disaggregated)
        assert args[args.index("--device") + 1] == want
    assert args[-2:] == ["--eval-every-s", "5"]
    assert args[args.index("--control-run-dir") + 1] == str(tmp_path)  # swaps through the server's own endpoint
    assert "MASTER_PORT" not in seen["env"]


def test_e2e_trainer_args_are_appended_to_the_demo_flags():
    from bench.demo import DEMO_TRAINER_ARGS

    cfg = E2EConfig(trainer_args="--eval-every-s 5")
    assert (DEMO_TRAINER_ARGS + cfg.trainer_args.split())[-2:] == ["--eval-every-s", "5"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_distiller_trains_on_the_gpu():
    from online_spec.head import new_head
    from tests.distill_helpers import greedy_records, tiny8
    from trainer.batch import collate
    from trainer.distill import DistillConfig, Distiller
    from trainer.loss import LossConfig

    target = tiny8()
    recs, _ = greedy_records(target, num=2, new_tokens=16)
    target.hf.to("cuda")
    target._rope_len = 0  # the rope table was built on the CPU by greedy_records
    d = Distiller(target, new_head(target, 128, seed=0).float(), DistillConfig(warmup_steps=1, total_steps=10),
                  LossConfig(ttt_steps=2))
    m = [d.train_step(collate(recs)) for _ in range(3)]
    assert d.head.fc.weight.device.type == "cuda"
    assert m[-1]["loss"] < m[0]["loss"]


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16\n"


def test_dtype_auto_follows_the_cpu(monkeypatch):
    from online_spec import target as t

    assert not t.cpu_has_native_bf16(AVX2_ONLY) and t.cpu_has_native_bf16(AVX512_BF16)
    assert t.cpu_has_native_bf16("flags : avx2 amx_bf16 amx_tile")
    monkeypatch.delenv("ONLINE_SPEC_DTYPE", raising=False)
    for info, want in ((AVX2_ONLY, torch.float32), (AVX512_BF16, torch.bfloat16)):
        monkeypatch.setattr(t, "cpu_has_native_bf16", lambda cpuinfo=None, info=info: "avx512_bf16" in info)
        assert t.resolve_dtype("auto") == want
    monkeypatch.setenv("ONLINE_SPEC_DTYPE", "bfloat16")
    assert t.resolve_dtype("auto") == torch.bfloat16  # the operator's override wins
    assert t.resolve_dtype("float32") == torch.float32 and t.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype must be auto"):
        t.resolve_dtype("fp8")


def test_server_config_dtype_values():
    from online_spec.config import ConfigError
    from serving.server import ServerConfig

    assert ServerConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype"):
        ServerConfig(dtype="half")
