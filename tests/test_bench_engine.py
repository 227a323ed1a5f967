"""`bench engine`'s throughput runs: which prompts a run serves (a batch-1 figure must not be
one prompt's), and a run on the tiny model with more prompts than slots."""

import json

import pytest

from online_spec.head import new_head
from bench.engine import grid_best, run_prompts, tokens_per_s


def test_run_prompts_cover_several_prompts_and_rotate_per_repeat():
    prompts = [[i] for i in range(10)]
    first = run_prompts(prompts, 0, batch=1, requests=4)
    second = run_prompts(prompts, 1, batch=1, requests=4)
    assert first == [[0], [1], [2], [3]] and second == [[4], [5], [6], [7]]
    assert run_prompts(prompts, 2, batch=1, requests=4) == [[8], [9], [0], [1]]  # cycles
    assert len(run_prompts(prompts, 0, batch=16, requests=4)) == 16  # at least the batch size


def test_tokens_per_s_serves_more_prompts_than_the_batch(tiny):
    head = new_head(tiny, seed=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    tps, acc = tokens_per_s(tiny, head, prompts, batch=2, K=3, new_tokens=5)
    assert tps > 0 and 1.0 <= acc <= 4.0  # committed per request-round, bonus included


def test_tokens_per_s_of_a_static_tree(tiny):
    from online_spec.tree import TreeShape
    head = new_head(tiny, seed=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    tps, acc = tokens_per_s(tiny, head, prompts, batch=2, K=0, new_tokens=5, tree=TreeShape(3, 2, 5))
    assert tps > 0 and 1.0 <= acc <= 4.0  # at most depth 3 drafts + the bonus per request-round


def test_tree_shapes_are_parsed_and_checked():
    import pytest
    from online_spec.config import ConfigError
    from bench.engine import EngineBenchConfig, shape_name
    cfg = EngineBenchConfig(trees=["5,4,8", "6,8,32"])
    assert [shape_name(t.num_steps, t) for t in cfg.tree_shapes()] == ["tree_5_4_8", "tree_6_8_32"]
    with pytest.raises(ConfigError, match="trees"):
        EngineBenchConfig(trees=["5,4"])
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        EngineBenchConfig(trees=["2,2,9"])  # depth 2, topk 2 drafts at most 6 nodes


def test_prompts_file_replaces_the_datasets(tmp_path):
    """--prompts-file: the grid and the lossless checks read token ids from the file (a machine
    without the datasets); a file lacking a traffic the configuration asks for is refused."""
    from bench.engine import EngineBenchConfig, prompt_sets
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps({"all": [[1, 2, 3]], "chat": [[4, 5]], "code": [[6]]}))
    cfg = EngineBenchConfig(prompts_file=str(f), grid_data=["chat", "code"])
    assert prompt_sets(cfg, target=None) == {"all": [[1, 2, 3]], "chat": [[4, 5]], "code": [[6]]}
    f.write_text(json.dumps({"all": [[1]], "chat": [[4]]}))
    with pytest.raises(ValueError, match=r"no prompts for \['code'\]"):
        prompt_sets(cfg, target=None)


def test_grid_best_picks_the_fastest_shapes_and_prices_the_tree_round():
    """A tree at 3 tokens a round serving 1.5x plain takes 2 plain steps a round: it would serve
    2.5x plain only at 5 tokens a round (the ceiling the aims are read against)."""
    row = {"plain": {"tokens_per_s": 100.0, "accept_length": 1.0},
           "chain_1": {"tokens_per_s": 120.0, "accept_length": 1.6},
           "chain_3": {"tokens_per_s": 125.0, "accept_length": 2.1},
           "tree_4_4_12": {"tokens_per_s": 150.0, "accept_length": 3.0},
           "tree_6_8_32": {"tokens_per_s": 140.0, "accept_length": 3.3}}
    best = grid_best(row)
    assert (best["chain"], best["tree"]) == ("chain_3", "tree_4_4_12")
    assert best["tree_vs_chain"] == pytest.approx(1.2) and best["tree_vs_plain"] == pytest.approx(1.5)
    assert best["chain_vs_plain"] == pytest.approx(1.25)
    assert best["tree_round_in_plain_steps"] == pytest.approx(2.0)
    assert grid_best({"plain": row["plain"], "chain_3": row["chain_3"]})["tree"] is None
