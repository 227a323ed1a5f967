"""The round timeline (serving/timeline.py) and `bench engine --only timeline`, on a tiny random
Llama (CPU: host clocks only; the CUDA events and the profile run on a GPU, docs/results.md)."""

import pytest

from online_spec.config import ConfigError
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.engine import Engine, EngineConfig
from serving.timeline import NO_TIMELINE, STAGES, RoundTimeline


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(num_layers=4)
    return target, new_head(target, seed=3)


def test_every_round_is_marked_stage_by_stage(tiny):
    target, head = tiny
    eng = Engine(target, head, EngineConfig(max_batch=2, max_len=256, num_steps=3))
    assert eng.timeline is NO_TIMELINE
    prompts = [list(range(5, 30)), list(range(9, 41)), list(range(3, 20))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    rounds = []
    eng.on_round.append(lambda stats, outs: rounds.append(stats))
    eng.timeline = tl = RoundTimeline("cpu")
    eng.generate(prompts, sp)
    rows = tl.per_round()
    assert len(rows) == len(rounds) > 5
    for row, stats in zip(rows, rounds):
        assert list(row["host_ms"]) == list(STAGES) and all(v >= 0 for v in row["host_ms"].values())
        assert row["k"] == stats.num_steps and row["batch_size"] == stats.batch_size
        # the stages tile the round: their sum is the round's wall time
        assert sum(row["host_ms"].values()) == pytest.approx(row["wall_ms"])
        assert row["host_ms"]["verify"] > 0 and not row["device_ms"]  # no CUDA events on a CPU
    rep = tl.report(busy_ms_per_round=0.5 * tl.report()["mean_wall_ms"])
    assert rep["rounds"] == len(rounds) and rep["k_histogram"] == {"3": len(rounds)}
    assert rep["gpu_idle_share"] == pytest.approx(0.5)


def test_bench_timeline_part_compares_static_cost_cuts_planned_and_a_tree(tiny):
    """The timeline part runs a static K, the cost policy (cuts both ways, planned) and, given
    `timeline_tree`, a static tree, whose rounds' verify is marked apart from their accept."""
    from bench.engine import EngineBenchConfig, round_timelines

    target, head = tiny
    cfg = EngineBenchConfig(only="timeline", timeline_batch_sizes=[1, 2], timeline_k=2, new_tokens=8,
                            requests_per_run=3, timeline_tree="2,2,4")
    prompts = [list(range(4 + i, 30 + 3 * i)) for i in range(4)]
    out = round_timelines(cfg, target, head, prompts)
    assert set(out) == {"1", "2"}
    for row in out.values():
        assert set(row) == {"static_k2", "tree_2_2_4", "cost", "cost_cuts_off", "cost_planned"}
        for rep in row.values():
            assert rep["same_tokens_as_static"] and rep["tokens_per_s"] > 0 and rep["rounds"] > 0
            assert rep["host_ms"]["decide"] is not None and rep["host_ms"]["learn"] is not None
        tree = row["tree_2_2_4"]
        assert tree["k_histogram"] == {"2": tree["rounds"]} and tree["host_ms"]["verify"] > 0
    with pytest.raises(ConfigError, match="timeline_tree"):
        EngineBenchConfig(timeline_tree="5,4")


def test_slow_rounds_say_what_they_had():
    from serving.timeline import slow_rounds

    def row(k, wall, catchup=0.0, captures=0):
        return {"k": k, "wall_ms": wall, "catchup_ms": catchup, "captures": captures}

    rows = [row(0, 5), row(0, 5), row(1, 20, catchup=12), row(1, 5), row(3, 11, captures=1), row(3, 10)]
    out = slow_rounds(rows, 5.0)
    assert out["count"] == 2  # 20 and 11 are over twice the median; 10 is not
    assert out["share_of_wall"] == pytest.approx((15 + 6) / 56)
    assert (out["with_catchup"], out["with_capture"]) == (1, 1)
    assert out["k_transitions"] == {"0->1": 1, "1->3": 1}
    assert out["catchup_ms_total"] == 12 and out["captures_total"] == 1
