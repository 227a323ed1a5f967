"""`online-spec bench adapt`: the token labelling and window arithmetic on a fixed round log, and
the bench end to end on a few tokens (structure and consistency, not speed)."""

import json

import pytest

from bench.session import SessionResult
from bench.traffic import RequestResult
from bench.adapt import (ACCEPTED, CLOSED, UNDRAFTED, accept_len, blocks, swaps_in_tokens, token_stream,
                                 tokens_to, window_ratios)


def fake_result():
    """Two HumanEval requests (a: 6 tokens, b: 4 tokens) and a ShareGPT one (ignored), K = 2."""
    res = SessionResult("x", t0=0.0)
    res.requests = [RequestResult(0, "sharegpt", "chat", "c", completion_tokens=5),
                    RequestResult(1, "humaneval", "code", "a", completion_tokens=6),
                    RequestResult(2, "humaneval", "code", "b", completion_tokens=4)]

    def rd(t, ids, acc, k=2, v=0):
        return {"t": t, "num_steps": k, "accepted": acc, "request_ids": ids, "head_version": v}
    res.rounds = [rd(1.0, ["c", "a"], [2, 0]),  # a: prefill token + 1 closed
                  rd(2.0, ["a", "b"], [2, 1], v=1),  # a: 2 acc + closed; b: prefill + 1 acc + closed
                  rd(3.0, ["a", "b"], [1, 2], k=2, v=1),  # a: 1 acc (cut at 6 tokens); b: 1 acc (cut at 4)
                  rd(4.0, ["b"], [0], k=0, v=1)]  # past b's end: dropped
    res.swaps = [{"t": 1.5, "from": 0, "to": 1, "rollback": False}]
    return res


def test_token_stream_labels_each_served_token():
    s = token_stream(fake_result())
    assert [(i, p, lab) for i, p, lab, _, _ in s] == [
        (1, 0, UNDRAFTED), (1, 1, CLOSED),
        (1, 2, ACCEPTED), (1, 3, ACCEPTED), (1, 4, CLOSED), (2, 0, UNDRAFTED), (2, 1, ACCEPTED), (2, 2, CLOSED),
        (1, 5, ACCEPTED), (2, 3, ACCEPTED)]
    assert len(s) == 6 + 4  # every completion token of the two requests, nothing past them
    assert accept_len(t[2] for t in s) == pytest.approx(5 / 3)
    assert [v for *_, v in s] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert swaps_in_tokens(fake_result(), s) == [{"tokens": 2, "t_after_shift_s": 0.5, "from": 0, "to": 1,
                                                  "rollback": False}]


def test_windows_blocks_and_thresholds():
    s = token_stream(fake_result())
    assert blocks(s, 5) == [pytest.approx(1.0), pytest.approx(3.0)]
    # the reference labels the same tokens: every closing token of a request's output accepted instead
    ref = {(i, p): (ACCEPTED if lab == CLOSED else lab) for i, p, lab, _, _ in s}
    ref[(1, 1)] = CLOSED
    ratios = window_ratios(s, 4, ref)
    assert [n for n, _, _ in ratios] == list(range(4, 11))  # from the first full window on
    n4 = ratios[0]  # tokens 0..3: own 2 acc / 1 round; reference 2 acc / 1 round
    assert n4[1] == pytest.approx(2.0) and n4[2] == pytest.approx(2.0)
    # later windows hold no closing token of the reference: no figure, not a pass
    assert tokens_to(ratios, 0.9) == {"first": 4, "sustained": None}
    # own windows (n = 4..10): 2, 1, 2, 2, 0.5, 2, 3 against a fixed 1.0
    assert [round(own, 2) for _, own, _ in ratios] == [2.0, 1.0, 2.0, 2.0, 0.5, 2.0, 3.0]
    assert tokens_to(ratios, 0.9, fixed_ref=1.0) == {"first": 4, "sustained": 9}
    assert tokens_to(ratios, 0.9, fixed_ref=100.0) == {"first": None, "sustained": None}
    assert tokens_to([], 0.9) == {"first": None, "sustained": None}


def test_bench_adapt_quick_end_to_end(tmp_path):
    """The real bench on a few tokens: SmolLM2 server, the trainer daemon in its child process, the
    control, and the shipped head as its own 'reference' (so on the same tokens, the control and
    the reference must label identically: batch 1 makes both runs compute the same)."""
    from online_spec.cli import main
    from bench.heads import SHIPPED_HEAD

    path = tmp_path / "adapt.json"
    assert main(["bench", "adapt", "--quick", "--reference", str(SHIPPED_HEAD), "--sharegpt-requests", "1",
                 "--humaneval-requests", "3", "--max-tokens", "12", "--window-tokens", "10", "--concurrency", "1",
                 "--out", str(tmp_path / "runs"), "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    for key in ("tokens_to_90pct_of_indomain", "control_tokens_to_90pct_of_indomain", "aim_tokens", "met",
                "thresholds", "humaneval_accept_len", "accept_len_per_500_tokens", "swaps", "trainer", "sessions",
                "online_by_head_version", "reference", "machine", "date", "command"):
        assert key in rep, key
    s = rep["sessions"]
    for name in ("online", "control", "reference"):
        assert s[name]["failed"] == 0 and s[name]["humaneval_tokens"] > 0, (name, s[name])
    assert s["online"]["requests"] == s["control"]["requests"] == 4 and s["reference"]["requests"] == 3
    n = s["online"]["humaneval_tokens"]
    curve = rep["accept_len_per_500_tokens"]
    assert curve["block_tokens"] == 10 and len(curve["online"]) == len(curve["reference_on_online_tokens"])
    assert len(curve["online"]) in (n // 10, n // 10 + 1)
    assert sum(v["tokens"] for v in rep["online_by_head_version"].values()) == n
    assert curve["control_on_online_tokens"] is not None and len(curve["control_on_online_tokens"]) == len(curve["online"])
    assert rep["trivially_met"] is True  # the "reference" is the starting head itself
    # the control and the reference are the same head on the same tokens: identical figures
    assert rep["humaneval_accept_len"]["control"] == rep["humaneval_accept_len"]["reference"]
    assert curve["control"] == curve["reference"]
    assert rep["control_over_reference"] == 1.0
    ctrl = rep["thresholds"]["0.9"]["control"]["same_tokens"]
    assert ctrl["first"] == 10 and ctrl["sustained"] == 10  # at the first full window, and for good
    assert rep["control_tokens_to_90pct_of_indomain"] == 10
    first = rep["tokens_to_90pct_of_indomain"]
    assert first is None or 10 <= first <= n
    assert rep["met"] == (first is not None and first <= rep["aim_tokens"])
    assert rep["trainer"]["returncode"] == 0
