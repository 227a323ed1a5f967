"""The server against hostile clients and broken heads (issue 32): every bad input gets a clear
error, nothing else is lost, and the server keeps serving.

A tiny random Llama with SmolLM2's vocabulary and tokenizer behind the real server (HTTP, engine
thread, control endpoint on a real ipc socket): the model does not matter here, the paths do.
- parameters the engine cannot sample with (temperature 1e-40 / 1e308 / Infinity / NaN, seed
  2^64) are 400 at the door, naming the parameter;
- a request that still breaks its round (parameters changed after they were checked) fails
  alone: a request admitted in the same round gets every token, equal to the target's;
- ids and tags over 1,024 characters are 400; tags beyond the cap are served as `other`, so
  /metrics stops growing with the tags clients invent;
- a body over the limit is 413; parsing and tokenization run off the event loop (/health answers
  while a prompt is being tokenized);
- a lone surrogate and 30k-deep nesting are 400 JSON, not a text/plain 500; a failing engine
  round is counted as outcome="error";
- a live head whose drafts turn non-finite is rolled back (sampled traffic: when a round fails;
  greedy traffic: by the periodic check) and alerted, and its requests succeed.
"""

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from online_spec.controller import StaticSteps, StepPolicyBase
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.control import ControlConfig
from serving.engine import Engine, EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread
from serving.server_loop import EngineError

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def tiny_smol(smol):
    return tiny_target(vocab_size=smol.info.vocab_size, hidden_size=64, num_layers=8, tokenizer=smol.tokenizer)


def make_server(target, run_dir, **cfg) -> SpecServer:
    scfg = ServerConfig(engine=EngineConfig(max_batch=4, max_len=256, num_steps=2), max_tags=4,
                        max_body_bytes=LIMIT, head_check_s=0.0, drift_monitor=True,
                        control=ControlConfig(run_dir=str(run_dir)), **cfg)
    return SpecServer(scfg, target, new_head(target, draft_vocab_size=2048, seed=1), head_version=1)


@pytest.fixture(scope="module")
def served(tiny_smol, tmp_path_factory):
    server = make_server(tiny_smol, tmp_path_factory.mktemp("run"))
    server.start()
    http = HttpThread(server).start()
    try:
        yield server, http
    finally:
        http.stop()
        server.close()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


def plain(target, ids, n) -> list[int]:
    """The target alone, greedy: what every greedy request must get."""
    return Engine(target, None, EngineConfig(max_batch=1, max_len=256, num_steps=0)).generate(
        [ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]


@pytest.mark.parametrize("raw, param", [
    ('"temperature": 1e-40', "temperature"), ('"temperature": 1e308', "temperature"),
    ('"temperature": Infinity', "temperature"), ('"temperature": NaN', "temperature"),
    ('"seed": 18446744073709551616', "seed"), ('"seed": -9223372036854775809', "seed"),
])
def test_unsampleable_parameters_are_400_at_the_door(served, raw, param):
    url = served[1].url
    bodies = {"/v1/completions": '{"prompt": "hi", "max_tokens": 4, %s}' % raw,
              "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, %s}' % raw,
              "/generate": '{"text": "hi", "sampling_params": {"max_new_tokens": 4, %s}}'
                           % raw.replace('"seed"', '"sampling_seed"')}
    for path, body in bodies.items():
        r = httpx.post(url + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (path, err)
    assert served[0].loop.rounds_failed == 0


def test_a_request_that_breaks_its_round_fails_alone(tiny_smol, tmp_path):
    """Both requests are queued before the engine thread starts, so one round admits the good
    request first (its prefill commits its first token) and then fails on the bad one's."""
    server = make_server(tiny_smol, tmp_path / "run")
    ids_good, ids_bad = tiny_smol.tokenizer.encode("The sea is"), tiny_smol.tokenizer.encode("A poem:")
    expected = plain(tiny_smol, ids_good, 12)

    async def run():
        good = server.submit(ids_good, SamplingParams(max_tokens=12, ignore_eos=True), "", "good")
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
        params.temperature = 1e-40  # changed after validation: the engine's sampling overflows
        bad = server.submit(ids_bad, params, "", "bad")
        server.start()
        return await drain(good), await drain(bad)

    async def drain(stream):
        tokens = []
        while True:
            item = await asyncio.wait_for(stream.queue.get(), 120)
            if isinstance(item, EngineError):
                return item
            tokens += item.new_token_ids
            if item.finished:
                return tokens

    try:
        got_good, got_bad = asyncio.run(run())
    finally:
        server.close()
    assert got_good == expected  # every token, the first one included, the target's own
    assert isinstance(got_bad, EngineError) and got_bad.status == 400 and "temperature" in got_bad.message
    assert server.loop.rounds_failed >= 1 and server.loop.requests_failed == 1


def test_ids_and_tags_are_bounded_and_tag_labels_capped(served):
    server, http = served
    long = "x" * 1025
    r = httpx.post(http.url + "/generate", json={"text": "hi", "rid": long, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "tag": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tag"
    r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Traffic-Tag": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tag"
    for i in range(12):  # 12 distinct tags; the cap is 4
        r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                           "tag": f"tag-{i}"}, timeout=60)
        assert r.status_code == 200
    labels = {line.split('tag="')[1].split('"')[0] for line in metrics(http.url).splitlines()
              if line.startswith("online_spec_proposed_drafts_total{")}
    assert labels == {"tag-0", "tag-1", "tag-2", "tag-3", "other"}
    assert server.info()["tags"] == {"known": 4, "max_tags": 4, "folded_into_other": 8}


class BlockingTokenizer:
    """The real tokenizer, except that encoding a prompt starting with BLOCK waits for `release`."""

    def __init__(self, real):
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()

    def encode(self, text, *a, **kw):
        if text.startswith("BLOCK"):
            self.entered.set()
            assert self.release.wait(60)
        return self.real.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_body_limit_and_tokenization_off_the_event_loop(served):
    server, http = served
    big = json.dumps({"prompt": "a" * (LIMIT + 1), "max_tokens": 2}).encode()
    r = httpx.post(http.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b" " * (LIMIT // 4)
    r = httpx.post(http.url + "/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(http.url + "/health").status_code == 200

    tok = BlockingTokenizer(server.tokenizer)
    server.tokenizer = tok
    result = {}
    try:
        t = threading.Thread(target=lambda: result.update(r=httpx.post(
            http.url + "/v1/completions", json={"prompt": "BLOCK here", "max_tokens": 2}, timeout=120)))
        t.start()
        assert tok.entered.wait(60)
        h = httpx.get(http.url + "/health", timeout=10)  # the event loop is free while the prompt is tokenized
        assert h.status_code == 200
        tok.release.set()
        t.join(120)
    finally:
        tok.release.set()
        server.tokenizer = tok.real
    assert result["r"].status_code == 200


def test_lone_surrogates_and_deep_nesting_are_400_json(served):
    url = served[1].url
    cases = [b'{"prompt": "\\ud800", "max_tokens": 2}',
             b'{"messages": [{"role": "user", "content": "a\\udfff"}]}',
             b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b', "max_tokens": 2}']
    for path, body in zip(("/v1/completions", "/v1/chat/completions", "/v1/completions"), cases):
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), (path, r.text[:200])
        assert r.json()["error"]["message"]


class FailingPolicy(StepPolicyBase):
    """A policy that raises every round: an engine fault no request caused."""

    name = "failing"

    def steps_for(self, batch_size, ctx_len=0):
        raise RuntimeError("policy broke")

    def update(self, *a, **kw):
        return 0


def test_an_engine_fault_is_500_and_counted_as_error(served):
    server, http = served
    server.engine.set_policy(FailingPolicy())
    try:
        r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    finally:
        server.engine.set_policy(StaticSteps(2))
    assert r.status_code == 500 and "policy broke" in r.json()["error"]["message"]
    text = metrics(http.url)
    assert 'online_spec_requests_total{endpoint="completions",outcome="error"} 1.0' in text
    assert 'outcome="disconnected"' not in text
    r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200  # and serving goes on


def broken_copy(head):
    """The head with weights near fp32's largest value: finite, and useless (its drafts overflow)."""
    import copy
    bad = copy.deepcopy(head)
    with torch.no_grad():
        bad.fc.weight.fill_(3e38)
    return bad


def wait(cond, timeout_s=60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_live_head_drafting_non_finite_values_is_rolled_back_and_alerted(tiny_smol, tmp_path):
    server = make_server(tiny_smol, tmp_path / "run")
    server.start()
    http = HttpThread(server).start()
    good = server.engine.head
    try:
        # sampled traffic: the round fails (NaN draft probabilities), the server finds the head
        # broken, rolls back, and the retried round serves every request
        server.swap(broken_copy(good), 2)  # around the validated path (it would be refused there)
        assert wait(lambda: server.engine.head_version == 2 and not server.engine.has_pending)
        for i in range(3):
            r = httpx.post(http.url + "/v1/completions", json={"prompt": f"story {i}:", "max_tokens": 8,
                                                               "temperature": 0.8, "seed": i}, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert server.loop.rounds_failed >= 1 and server.loop.requests_failed == 0
        assert server.engine.head is good and server.engine.head_version == 1
        assert [f["version"] for f in server.head_faults] == [2]
        assert server.control.swapper.info()["auto_rollbacks"] == 1
        assert server.control.swapper.previous is None  # the broken head is not kept to roll back into
        alerts = server.info()["drift"]["recent_alerts"]
        assert [a["kind"] for a in alerts if a["kind"] == "head_fault"] == ["head_fault"]
        assert "online_spec_head_faults_total 1.0" in metrics(http.url)

        # greedy traffic never fails a round: the periodic check on live rows finds the head
        server.cfg.head_check_s = 0.05
        server.swap(broken_copy(good), 3)
        assert wait(lambda: server.engine.head_version == 3 and not server.engine.has_pending)
        ids = tiny_smol.tokenizer.encode("Once upon")
        r = httpx.post(http.url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200 and r.json()["output_ids"] == plain(tiny_smol, ids, 40)
        assert wait(lambda: server.engine.head is good, 30)
        assert [f["version"] for f in server.head_faults] == [2, 3]
    finally:
        http.stop()
        server.close()
