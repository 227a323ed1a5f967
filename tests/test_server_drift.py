"""Drift wiring in the server: real rounds -> DriftDetector -> every sink.

A random day-0 head on a tiny random target accepts (almost) nothing, which the detector's
collapse rule reports after `collapse_window` rounds with no warm-up. The alert must reach the
log, the server's /metrics (PrometheusAlertSink on its registry), /server_info, a callback and
a real offline W&B run.
"""

import logging
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from online_spec.alerts import read_alerts_from_offline_run
from online_spec.drift import DriftConfig
from online_spec.head import new_head
from online_spec.target import tiny_target
from online_spec.wandb_run import init_wandb
from serving.engine import EngineConfig
from serving.head_bank import BankConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread
from serving.server_drift import CallbackAlertSink, ServerDrift


@contextmanager
def serving(cfg, target, policy=None, wandb_run=None):
    """A started server with a random day-0 head, its HTTP thread, and the list its alerts go to;
    both stopped (and a W&B run finished) on leaving."""
    server = SpecServer(cfg, target, new_head(target, draft_vocab_size=2048), policy=policy, wandb_run=wandb_run)
    got = []
    server.drift.sinks.append(CallbackAlertSink(got.append))
    server.start()
    http = HttpThread(server).start()
    try:
        yield server, http, got
    finally:
        http.stop()
        server.close()


def test_collapse_alert_reaches_every_sink(smol, tmp_path, caplog):
    target = tiny_target(vocab_size=smol.info.vocab_size, num_layers=8, tokenizer=smol.tokenizer)
    run = init_wandb("online-spec-test", None, tmp_path, mode="offline")
    assert run is not None
    cfg = ServerConfig(engine=EngineConfig(max_batch=4, max_len=256, num_steps=3),
                       drift=DriftConfig(collapse_window=10))
    with serving(cfg, target, wandb_run=run) as (server, http, got):
        with caplog.at_level(logging.ERROR, logger="online_spec.alerts"):
            # three requests: the collapse window must span collapse_min_requests (3) of them
            for _ in range(3):
                r = httpx.post(http.url + "/v1/completions", headers={"X-Traffic-Tag": "code"}, timeout=60,
                               json={"prompt": "go", "max_tokens": 40, "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200
        collapses = [a for a in got if a.kind == "collapse"]
        assert len(collapses) == 1 and collapses[0].tag == "code" and collapses[0].slot == 1
        assert any("[drift collapse]" in rec.getMessage() for rec in caplog.records)
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(http.url + "/metrics").text)}
        samples = {tuple(sorted(s.labels.items())): s.value for s in fams["online_spec_drift_alerts"].samples
                   if s.name.endswith("_total")}
        assert samples[(("kind", "collapse"), ("slot", "1"), ("tag", "code"))] == 1
        info = httpx.get(http.url + "/server_info").json()["drift"]
        assert info["alerts_total"] >= 1 and info["recent_alerts"][0]["kind"] == "collapse"
    rows = read_alerts_from_offline_run(tmp_path, wait_s=30)
    assert [row["kind"] for row in rows][:1] == ["collapse"]


def test_drift_monitor_off_and_tokenizer_required(smol, tiny):
    target = tiny_target(vocab_size=smol.info.vocab_size, num_layers=8, tokenizer=smol.tokenizer)
    server = SpecServer(ServerConfig(drift_monitor=False, engine=EngineConfig(max_len=64)), target, None)
    assert server.drift is None and server.info()["drift"] is None
    assert server.round_observers == [server.bank.observe]  # the head bank's alone
    server = SpecServer(ServerConfig(drift_monitor=False, engine=EngineConfig(max_len=64),
                                     bank=BankConfig(enabled=False)), target, None)
    assert server.round_observers == [] and server.bank is None and server.info()["head_bank"] is None
    assert server.info()["speculative_algorithm"] is None
    with pytest.raises(ValueError, match="tokenizer"):
        SpecServer(ServerConfig(), tiny, None)


@pytest.mark.parametrize("plain_round_s, losing", [(1e-5, True), (100.0, False)])
def test_losing_rule_compares_with_the_cost_models_plain_round(smol, plain_round_s, losing):
    """The server feeds the "losing" rule plain decoding's tokens/s as the cost-model policy's
    round-time model predicts it. Here the model is pinned (no refit) to a plain round of 10 us
    (every speculative round loses to it) or of 100 s (none does); one tier, K = 3, so every round
    drafts. A random head on a tiny target: what is compared is speed, not acceptance."""
    from online_spec.controller import AdaptiveConfig
    from online_spec.controller.cost import CostModelPolicy
    from online_spec.controller.round_time import CostModel, CostModelConfig

    target = tiny_target(vocab_size=smol.info.vocab_size, num_layers=8, tokenizer=smol.tokenizer)
    model = CostModel.with_coefficients([1e-7, 0, 0, 0, 0], [plain_round_s, 0, 0, 0, 0],
                                        CostModelConfig(refit_interval=10**6))
    policy = CostModelPolicy(AdaptiveConfig.from_dict({"1": {"candidate_steps": [3]}}), cost_model=model)
    cfg = ServerConfig(engine=EngineConfig(max_batch=4, max_len=256, num_steps=3, max_steps=3),
                       drift=DriftConfig(losing_window=10, collapse_accept_len=0.0))
    with serving(cfg, target, policy=policy) as (_, http, got):
        r = httpx.post(http.url + "/v1/completions", timeout=60,
                       json={"prompt": "go", "max_tokens": 30, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
    kinds = [a.kind for a in got]
    assert kinds.count("losing") == (1 if losing else 0), kinds
    if losing:
        a = next(a for a in got if a.kind == "losing")
        assert "vs plain 100000.0 tok/s" in a.text


def test_a_shift_between_tags_is_alerted_on_the_slots_mix_stream():
    """ServerDrift as the server drives it (RoundStats, outputs, each request's tag): chat traffic
    tagged `chat` turns into code tagged `code` and acceptance falls (1.26 -> 0.39 drafts, requests
    of 48 rounds at batch 8, tests/test_drift.py's traffic). No tag's own stream can see that;
    the slot's mix stream raises the drop, named "all traffic", and /server_info lists it."""
    import numpy as np

    from serving.requests import RequestOutput, RoundStats
    from tests.test_drift import chat_then_code

    drift = ServerDrift(DriftConfig())
    raised = []
    for i, (ids, acc) in enumerate(chat_then_code(0)):
        tag = "chat" if i < 1000 else "code"
        stats = RoundStats(batch_size=len(ids), num_steps=5, accepted=[int(a) for a in acc],
                           committed=int(np.sum(acc)) + len(ids), draft_s=0.01, verify_s=0.02, total_s=0.03,
                           head_version=0, ctx_len=200)
        outs = [RequestOutput(request_id=r, new_token_ids=[], accept_len=int(a), num_steps=5, finished=False,
                              finish_reason=None) for r, a in zip(ids, acc)]
        raised += [(i, a) for a in drift.observe(stats, outs, [tag] * len(ids))]
    drops = [(i, a) for i, a in raised if a.kind == "drop"]
    assert drops and drops[0][0] >= 1000 and drops[0][1].tag == "*" and "all traffic" in drops[0][1].text
    assert any(a["kind"] == "drop" and a["tag"] == "*" for a in drift.info()["recent_alerts"])
