"""The engine thread's CPU core (online_spec/cpu_reserve.py, EngineConfig.reserve_cpu).

Real threads, a real child process and the kernel's own affinity calls on this machine (two
CPUs at least: CI has two); the topology parsing on a made-up /sys tree. An engine with the
reserve on produces the same tokens as one without.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from online_spec.config import ConfigError
from online_spec.cpu_reserve import CpuReserve, core_siblings, parse_cpu_list
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a reserve needs two CPUs")


def test_cpu_lists_and_topology(tmp_path):
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError, match="bad entry 'x'"):
        parse_cpu_list("1,x")
    topo = tmp_path / "cpu3" / "topology"
    topo.mkdir(parents=True)
    (topo / "thread_siblings_list").write_text("3,11\n")
    assert core_siblings(3, str(tmp_path)) == {3, 11}
    assert core_siblings(4, str(tmp_path)) == {4}  # no topology exposed: the CPU alone


@two_cpus
def test_reserve_moves_threads_and_children_off_the_engine_core_and_back():
    engine_cpu, rest = CPUS[-1], set(CPUS) - core_siblings(CPUS[-1]) or set(CPUS[:-1])
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    seen = {}
    reserve = CpuReserve(engine_cpu, sweep_s=0.05)

    def engine_thread():
        reserve.hold()
        seen["engine"] = os.sched_getaffinity(0)
        reserve.hold()  # a second call on the same thread changes nothing
        time.sleep(0.3)  # a few sweeps
        seen["other"] = os.sched_getaffinity(other.native_id)
        seen["child"] = os.sched_getaffinity(child.pid)
        late = threading.Thread(target=time.sleep, args=(0.5,))  # started on the engine's CPU...
        late.start()
        time.sleep(0.3)
        seen["late"] = os.sched_getaffinity(late.native_id)  # ...and moved off it by a sweep
        late.join()

    try:
        t = threading.Thread(target=engine_thread)
        t.start()
        t.join(10)
        assert seen["engine"] == {engine_cpu}
        assert seen["other"] == rest and seen["child"] == rest and seen["late"] == rest
        stats = reserve.stats()
        assert stats["engine_cpu"] == engine_cpu and stats["sweeps"] >= 3 and stats["moved"] >= 3
    finally:
        reserve.close()
        stop.set()
    try:
        assert os.sched_getaffinity(other.native_id) == set(CPUS)
        assert os.sched_getaffinity(child.pid) == set(CPUS)
    finally:
        child.kill()
        child.wait()


@two_cpus
def test_shared_mode_puts_the_others_on_the_engine_core():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    reserve = CpuReserve(CPUS[0], mode="shared", sweep_s=0.05)
    try:
        t = threading.Thread(target=reserve.hold)
        t.start()
        t.join(5)
        assert os.sched_getaffinity(other.native_id) == core_siblings(CPUS[0]) & set(CPUS)
    finally:
        reserve.close()
        stop.set()
    assert os.sched_getaffinity(other.native_id) == set(CPUS)


@two_cpus
def test_bad_reserves_say_why():
    with pytest.raises(ValueError, match="is not one this process may use"):
        CpuReserve(max(CPUS) + 64)
    with pytest.raises(ValueError, match="mode"):
        CpuReserve(mode="nearby")
    with pytest.raises(ValueError, match="sweep_s"):
        CpuReserve(sweep_s=0)
    before = os.sched_getaffinity(0)
    result = {}

    def one_cpu():  # a thread that may use one CPU only: reserving it leaves nothing
        os.sched_setaffinity(0, {CPUS[0]})
        try:
            CpuReserve()
        except ValueError as e:
            result["error"] = str(e)

    t = threading.Thread(target=one_cpu)
    t.start()
    t.join(5)
    assert "leaves no CPU for the rest" in result["error"]
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ConfigError, match="reserve_cpu"):
        EngineConfig(reserve_cpu="fast")
    with pytest.raises(ConfigError, match="reserve_cpu: cpu: 999"):
        EngineConfig(reserve_cpu="999").cpu_reserve(__import__("torch").device("cpu"))


@two_cpus
def test_engine_with_a_reserved_core_serves_the_same_tokens():
    import torch

    t = tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=2).float()
    head = new_head(t, draft_vocab_size=32)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 4]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert EngineConfig(reserve_cpu="auto").cpu_reserve(torch.device("cpu")) is None  # auto: CUDA only
    plain = Engine(t, head, EngineConfig(max_len=64, num_steps=2)).generate(prompts, sp)
    eng = Engine(t, head, EngineConfig(max_len=64, num_steps=2, reserve_cpu=str(CPUS[-1])))
    seen = {}

    def run():
        seen["out"] = eng.generate(prompts, sp)
        seen["mask"] = os.sched_getaffinity(0)

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    try:
        assert seen["out"] == plain
        assert seen["mask"] == {CPUS[-1]}
        assert eng.cpus.stats()["sweeps"] >= 1
        assert os.sched_getaffinity(0) == set(CPUS) - {CPUS[-1]}  # this thread was moved off the engine's core
    finally:
        eng.cpus.close()
    assert os.sched_getaffinity(0) == set(CPUS)
