"""The cost policy's tree choice (online_spec/controller/tree_choice.py) on fixed sequences, and
through the engine: a tree is chosen where its measured value beats the chain's, its figures
never reach the chain's estimates, and the output stays the target's."""

import pytest

from online_spec.config import ConfigError
from online_spec.controller import AdaptiveConfig, CostModel, CostModelPolicy
from online_spec.controller.tree_choice import TreeChoiceConfig, TreeChooser
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from online_spec.tree import TreeShape
from serving.engine import Engine, EngineConfig

A, B = TreeShape(5, 4, 8), TreeShape(3, 4, 10)


def test_untried_trees_are_tried_in_turn_then_the_best_wins_over_the_chain():
    ch = TreeChooser([[A, B]], TreeChoiceConfig(min_trials=2, probe_interval=0))
    seen = []
    for _ in range(6):
        s = ch.choose(0, chain_tokens_per_s=10.0, plain_round_s=0.1)
        seen.append(s)
        if s is None:
            ch.chain_ran(0)  # run, not measured: the chain's predicted value stands
        else:
            # A: 3 tokens a round at 1.5x plain = 20 tok/s; B: 2 tokens at 1.2x = 16.7 tok/s
            ch.observe(0, s, [2, 2] if s == A else [1, 1], 0.15 if s == A else 0.12, 0.1)
    assert seen == [A, A, B, B, None, None]  # the trees in turn, then the chain
    assert ch.choose(0, 10.0, 0.1) == A  # 20 > 16.7 > 10
    assert ch.choose(0, 25.0, 0.1) is None  # the chain beats both
    assert ch.info(0, 0.1)["1"]["5,4,8"]["tokens_per_s"] == pytest.approx(20.0)


def test_the_least_recently_measured_option_is_probed():
    ch = TreeChooser([[A, B]], TreeChoiceConfig(min_trials=1, probe_interval=5))
    for s in (A, B):
        assert ch.choose(0, 10.0, 0.1) == s
        ch.observe(0, s, [3], 0.1, 0.1)  # both 40 tok/s, beat the chain
    assert ch.choose(0, 10.0, 0.1) is None  # the chain's trial
    ch.chain_ran(0)
    picks = []
    for _ in range(8):
        s = ch.choose(0, 10.0, 0.1)
        picks.append(s)
        if s is not None:
            ch.observe(0, s, [3], 0.1, 0.1)
        else:
            ch.chain_ran(0)
    # decisions 4..11: every 5th (5 and 10) runs the least recently measured option: the tree
    # not run since its trial, then the chain (run at decision 3)
    assert picks[1] == B and picks[6] is None and picks.count(None) == 1 and picks.count(B) == 1


def test_the_chains_measured_rounds_outrank_its_prediction():
    # a CPU e2e run (2026-11-28): the chain predicted at 10 tok/s, a tree measured at 16.7, the
    # chain's own rounds at 22: once the chain has min_trials rounds its measured value decides
    ch = TreeChooser([[B]], TreeChoiceConfig(min_trials=2, probe_interval=0))
    for _ in range(2):
        assert ch.choose(0, 10.0, 0.1, batch_size=4) == B
        ch.observe(0, B, [1, 1, 1, 1], 0.12, 0.1, batch_size=4)  # 2 tokens at 1.2x plain: 16.7 tok/s
    assert ch.choose(0, 10.0, 0.1, batch_size=4) is None  # the chain's first trial
    ch.chain_ran(0, batch_size=4)  # run without its seconds: tried, not measured
    assert ch.choose(0, 10.0, 0.1, batch_size=4) is None  # the second
    ch.chain_ran(0, [1, 1, 1, 1], 0.09, 0.1, batch_size=4)  # 2 tokens at 0.9x: 22.2 tok/s
    assert ch.choose(0, 10.0, 0.1, batch_size=4) == B  # one measured round: the prediction stands
    ch.chain_ran(0, [1, 1, 1, 1], 0.09, 0.1, batch_size=4)
    assert ch.choose(0, 10.0, 0.1, batch_size=4) is None  # measured: 22.2 > 16.7
    assert ch.info(0, 0.1)["4"]["chain"]["tokens_per_s"] == pytest.approx(22.2, abs=0.1)
    assert ch.choose(0, 15.0, 0.1, batch_size=4) is None  # the prediction no longer counts
    # within the margin (5 %) the chain stays: a tree at 1.04x the chain does not run
    near = TreeChooser([[B]], TreeChoiceConfig(min_trials=1, probe_interval=0))
    near.choose(0, 10.0, 0.1)
    near.observe(0, B, [1], 0.1, 0.1)  # 20 tok/s
    near.choose(0, 10.0, 0.1)
    near.chain_ran(0)
    assert near.choose(0, 19.3, 0.1) is None and near.choose(0, 18.8, 0.1) == B


def test_the_chains_prediction_is_worked_out_only_where_it_is_read():
    # the cost policy hands a function (its prediction costs the engine's thread microseconds a
    # round): called in the rounds that compare against it, never once the chain is measured
    calls = []

    def predicted():
        calls.append(1)
        return 10.0

    ch = TreeChooser([[B]], TreeChoiceConfig(min_trials=1, probe_interval=0))
    assert ch.choose(0, predicted, 0.1) == B and not calls  # untried: nothing compared
    ch.observe(0, B, [1], 0.12, 0.1)  # 16.7 tok/s
    assert ch.choose(0, predicted, 0.1) is None and not calls  # the chain's trial
    ch.chain_ran(0)  # tried, not measured: the prediction stands in
    assert ch.choose(0, predicted, 0.1) == B and len(calls) == 1  # 16.7 > 10
    ch.chain_ran(0, [1], 0.09, 0.1)  # measured: 22.2 tok/s
    assert ch.choose(0, predicted, 0.1) is None and len(calls) == 1  # measured: no call
    assert ch.choose(0, 10.0, 0.1) is None  # a plain value still works


def test_each_batch_size_bucket_measures_its_own_trees():
    # on a CPU a tree's verify costs its tokens times the batch: a tree that pays at batch 1 can
    # lose at batch 4; neither bucket's figures reach the other
    ch = TreeChooser([[B]], TreeChoiceConfig(min_trials=1, probe_interval=0))
    for b, round_s in ((1, 0.11), (4, 0.2)):
        assert ch.choose(0, 15.0, 0.1, batch_size=b) == B  # untried in this bucket
        ch.observe(0, B, [1] * b, round_s, 0.1, batch_size=b)
        assert ch.choose(0, 15.0, 0.1, batch_size=b) is None  # the chain's trial
        ch.chain_ran(0, batch_size=b)
    assert ch.choose(0, 15.0, 0.1, batch_size=1) == B  # 2 tokens at 1.1x: 18.2 > 15
    assert ch.choose(0, 15.0, 0.1, batch_size=5) is None  # batch 4-7: 2 tokens at 2x: 10 < 15
    assert ch.choose(0, 15.0, 0.1, batch_size=2) == B  # batch 2-3: untried, tried
    assert sorted(ch.info(0)) == ["1", "2", "4"] and ch.info(0)["2"]["3,4,10"]["rounds"] == 0


def test_a_swap_lets_the_new_heads_rounds_decide_quickly():
    ch = TreeChooser([[A]], TreeChoiceConfig(min_trials=1, probe_interval=0, rewarm_weight=1.0))
    ch.choose(0, 1.0, 0.1)
    for _ in range(30):
        ch.observe(0, A, [4], 0.1, 0.1)  # 5 tokens a round
    ch.rewarm()
    ch.observe(0, A, [0], 0.1, 0.1)  # the new head: 1 token a round
    # the old mean counts as one (decayed) round: the first round of the new head moves it halfway
    assert ch.info(0)["1"]["5,4,8"]["tokens_per_round"] == pytest.approx(3.0, abs=0.05)


def test_tree_candidates_are_validated_and_state_round_trips():
    with pytest.raises(ConfigError, match=r'slots\["1"\].tree_candidates'):
        AdaptiveConfig.from_dict({"1": {"candidate_steps": [1], "tree_candidates": [[5, 4]]}})
    ch = TreeChooser([[A, B]])
    ch.choose(0, 1.0, 0.1)
    ch.observe(0, A, [2, 1], 0.2, 0.1)
    ch.chain_ran(0, [1, 1], 0.1, 0.1, batch_size=3)
    again = TreeChooser([[A, B]])
    again.load_state_dict(ch.state_dict())
    assert again.info(0) == ch.info(0) and sorted(again.info(0)) == ["1", "2"]
    # a state written before the buckets (shape keys at the top) loads into no bucket: re-measured
    old = TreeChooser([[A, B]])
    old.load_state_dict([{"5,4,8": [3.0, 1.0, 2.0, 1.0, 1, 1]}])
    assert old.info(0) == {} and old.choose(0, 1.0, 0.1) == A
    assert again.state_dict() == ch.state_dict()


def _policy(trees):
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 1, 2, 3], "tree_candidates": trees}})
    model = CostModel.with_coefficients([0.004, 0, 0, 0, 0], [0.04, 0, 0.004, 0, 0])
    return CostModelPolicy(adaptive, cost_model=model)


def test_tree_rounds_never_reach_the_chain_estimates():
    p = _policy([[5, 4, 8]])
    assert p.chooses_trees and not _policy([]).chooses_trees
    p.steps_for(1, 100)
    before = (p.info()["slots"]["1"]["accept"], p.cost.observations)
    p.update(1, [5], num_steps=[5], ctx_len=100, draft_s=0.02, verify_s=0.05, tree=A)
    assert (p.info()["slots"]["1"]["accept"], p.cost.observations) == before
    assert p.info()["slots"]["1"]["trees"]["1"]["5,4,8"]["rounds"] == 1
    state = p.state_dict()
    q = _policy([[5, 4, 8]])
    q.load_state_dict(state)
    assert q.info()["slots"]["1"]["trees"] == p.info()["slots"]["1"]["trees"]


def test_the_reference_plain_round_is_the_calibrations_line_and_stays_put():
    points = [(b, k, 300, 0.001 * k * b, 0.002 + 0.0005 * b * (k + 1)) for b in (1, 4, 8) for k in (0, 1, 3)]
    model = CostModel().fit(points)
    ref = model.reference_round_s(4, 300)
    assert ref == pytest.approx(model.predict_round_s(4, 0, 300, factors=False), rel=1e-6)
    assert ref == pytest.approx(0.002 + 0.0005 * 4, rel=0.02)
    for _ in range(64):  # slow rounds refit the live line; the reference keeps the calibration's
        model.observe(4, 0, 300, None, 0.009)
    assert model.predict_round_s(4, 0, 300, factors=False) > 1.5 * ref
    assert model.reference_round_s(4, 300) == ref
    again = CostModel()
    again.load_state_dict(model.state_dict())
    assert again.reference_round_s(4, 300) == ref
    old = {k: v for k, v in model.state_dict().items() if k != "reference_coef"}  # written before it
    again.load_state_dict(old)
    assert again.reference_round_s(4, 300) == pytest.approx(model.predict_round_s(4, 0, 300, factors=False))
    # a negative context slope is not followed, and a line at or below zero gives the prior's seconds
    assert CostModel.with_coefficients([0.001] * 5, [0.003, 0, 0, -0.01, 0]).reference_round_s(4, 2000) == 0.003
    assert CostModel.with_coefficients([0.001] * 5, [-0.01, 0, 0, 0, 0]).reference_round_s(4) == \
        CostModel().config.prior_verify_s


def test_tree_choice_compares_rounds_measured_apart_while_the_live_line_drifts():
    """A tree measured first, then the chain while slower rounds refit the live line (a trainer
    beside the server, the H100 run of 2026-12-07): the tree's rounds take 8.8 ms for 2.95 tokens a
    request, the chain's 6.6 ms for 1.87, so the tree serves more (335 against 283 tokens/s a
    request); against the drifting live prediction the chain read the better."""
    tree = TreeShape(6, 8, 64)
    adaptive = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0, 3], "tree_candidates": [[6, 8, 64]]}})
    points = [(b, k, 300, 0.0003 * k * b, 0.002 + 0.0001 * b * (k + 1)) for b in (1, 4, 8) for k in (0, 1, 3, 7)]
    p = CostModelPolicy(adaptive, cost_model=CostModel().fit(points))
    for _ in range(40):
        p.update(4, [2, 2, 2, 1.8], num_steps=[6] * 4, ctx_len=300, draft_s=0.0028, verify_s=0.006, tree=tree)
    for i in range(400):
        p.steps_for(4, 300)
        if i % 4 == 0:  # plain rounds slowed by the trainer's spells
            p.update(4, [0] * 4, num_steps=0, ctx_len=300, draft_s=0.0, verify_s=0.006)
        else:
            p.update(4, [1, 1, 1, 0.48], num_steps=3, ctx_len=300, draft_s=0.0016, verify_s=0.005)
    assert p.cost.predict_round_s(4, 0, 300) > 1.3 * p.cost.reference_round_s(4, 300)  # the line drifted
    trees = p.info()["slots"]["1"]["trees"]["4"]
    assert trees["chain"]["rounds"] >= 300 and trees["6,8,64"]["rounds"] == 40
    assert p.tree_for(4, 300) == tree


def test_engine_runs_the_trees_the_cost_policy_picks_and_stays_lossless():
    t = tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=3).float()
    head = new_head(t, draft_vocab_size=48, seed=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(t, None, EngineConfig(max_batch=4, max_len=128, num_steps=0)).generate(prompts, sp)
    policy = _policy([[3, 2, 6], [2, 4, 5]])
    eng = Engine(t, head, EngineConfig(max_batch=4, max_len=128, max_steps=3), policy=policy)
    rounds = []
    eng.on_round.append(lambda s, o: rounds.append((s.topk, s.num_draft_tokens)))
    assert eng.generate(prompts, sp) == ref
    assert (2, 6) in rounds and (4, 5) in rounds  # both trees were run (tried in turn, at least)
    info = policy.info()["slots"]["1"]["trees"]
    # each batch-size bucket the engine served (3 requests, then fewer) tries both trees
    assert all(b["3,2,6"]["rounds"] + b["2,4,5"]["rounds"] > 0 for b in info.values())
    assert info["2"]["3,2,6"]["rounds"] >= 3 and info["2"]["2,4,5"]["rounds"] >= 3
