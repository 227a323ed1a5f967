"""Server behaviour under load and when clients misbehave, where the model does not matter.

A tiny random Llama with SmolLM2's vocabulary and tokenizer (the real tokenizer: streaming text
is decoded for real) behind the real server: 64 concurrent streaming openai clients with no
failure and real batching, a client disconnect freeing its engine slot (streaming and not), a
full queue answered 503 at once, adaptive K per slot, the capture stream to a real subscriber
counted in /metrics. Plus the incremental detokenizer against full decodes.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest

from online_spec.config import ConfigError
from online_spec.head import new_head
from online_spec.target import tiny_target
from serving.engine import EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread
from serving.server_detok import TextStream


@pytest.fixture(scope="module")
def tiny_smol(smol):
    tok = smol.tokenizer
    return tiny_target(vocab_size=smol.info.vocab_size, hidden_size=64, num_layers=8, tokenizer=tok)


def _serve(target, max_len=256, **engine_kw):
    server = SpecServer(ServerConfig(engine=EngineConfig(max_len=max_len, **engine_kw)), target,
                        new_head(target, draft_vocab_size=2048))
    server.start()
    return server, HttpThread(server).start()


def _wait(cond, timeout_s=20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_64_concurrent_streaming_clients(tiny_smol):
    server, http = _serve(tiny_smol, max_batch=16, num_steps=2)
    batches = []
    server.round_observers.append(lambda stats, outs, tags: batches.append(stats.batch_size))

    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(model="m", prompt=f"request {i}:", max_tokens=6,
                                                 temperature=0.7, seed=i, stream=True)
        async for c in stream:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        return finish

    async def main():
        client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.wait_for(
            asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True), 90)
    try:
        results = asyncio.run(main())
        failures = [r for r in results if isinstance(r, BaseException) or r not in ("length", "stop")]
        assert failures == []
        assert max(batches) >= 8, "requests were not batched together"
        # the engine frees a request's slot just after its last token reaches the stream: soon, not at once
        assert _wait(lambda: server.engine.running == [] and server.loop.num_streams == 0, 10.0), \
            (len(server.engine.running), server.loop.num_streams)
    finally:
        http.stop()
        server.close()


def test_disconnect_frees_slot_and_full_queue_is_503(tiny_smol):
    server, http = _serve(tiny_smol, max_len=1024, max_batch=1, max_queue=1, num_steps=1)
    # the tiny model finishes a long request within a second: slow its rounds to a real model's pace
    server.round_observers.append(lambda stats, outs, tags: time.sleep(0.02))
    long = {"prompt": "go", "max_tokens": 100000, "ignore_eos": True, "temperature": 0}
    try:
        # a streaming client reads one event and goes away: its slot is freed
        with httpx.Client(base_url=http.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())
                assert len(server.engine.running) == 1
        assert _wait(lambda: not server.engine.running and server.loop.num_streams == 0)

        # slot busy + one waiting = the queue is full: the next request is refused at once
        with httpx.Client(base_url=http.url, timeout=30) as c1, httpx.Client(base_url=http.url, timeout=30) as c2:
            with c1.stream("POST", "/v1/completions", json={**long, "stream": True}) as r1:
                lines = r1.iter_lines()  # kept referenced: a dropped iterator closes the response
                next(lines)
                with c2.stream("POST", "/v1/completions", json={**long, "stream": True}) as r2:
                    assert _wait(lambda: len(server.engine.waiting) == 1)
                    t0 = time.monotonic()
                    r3 = httpx.post(http.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                    assert r3.status_code == 503 and "queue full" in r3.json()["error"]["message"]
                    assert time.monotonic() - t0 < 5
                    assert r2.status_code == 200 and len(server.engine.running) == 1
                    assert server.engine.running[0].finish_reason is None
        assert _wait(lambda: not server.engine.running and not server.engine.waiting)

        # a non-streaming client that times out is noticed as disconnected and aborted
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(http.url + "/v1/completions", json=long, timeout=1.0)
        assert _wait(lambda: not server.engine.running and server.loop.num_streams == 0)
        assert httpx.get(http.url + "/health").status_code == 200
        fams = httpx.get(http.url + "/metrics").text
        assert 'online_spec_requests_total{endpoint="completions",outcome="disconnected"} 4.0' in fams
        assert 'online_spec_requests_rejected_total{reason="queue_full"} 1.0' in fams
    finally:
        http.stop()
        server.close()


@pytest.mark.parametrize("text, stop", [
    ("Hello world, naïve café — 日本語のテキスト 🙂 end.", []),
    ("alpha beta STOP gamma", ["STOP"]),
    ("x = 1\n\ny = 2", ["\n\n", "zzz"]),
])
def test_text_stream_matches_full_decode(smol, text, stop):
    tok = smol.tokenizer
    ids = tok.encode(text)
    full = tok.decode(ids)
    for step in (1, 2, 3):
        ts = TextStream(tok, stop)
        out = "".join(ts.push(ids[i:i + step]) for i in range(0, len(ids), step)) + ts.finish()
        expect = min((full[:full.index(s)] for s in stop if s in full), key=len, default=full)
        assert out == expect == ts.final_text()
        assert "\ufffd" not in out


def test_adaptive_policy_steps_down_and_is_reported_per_slot(tiny_smol):
    from serving.server import build_policy

    cfg = ServerConfig(adaptive="sglang_default", engine=EngineConfig(max_len=256, max_batch=2, num_steps=5))
    server = SpecServer(cfg, tiny_smol, new_head(tiny_smol, draft_vocab_size=2048), policy=build_policy(cfg))
    server.start()
    http = HttpThread(server).start()
    try:
        before = server.info()["internal_states"][0]["speculative_num_steps_per_slot"]
        assert before == {"1": 5, "8": 1, "32": 1, "64": 0}  # 5 not a tier of "8": its middle
        r = httpx.post(http.url + "/v1/completions", timeout=60,
                       json={"prompt": "go", "max_tokens": 120, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
        # a random head accepts (almost) nothing: slot 1 walks down its tiers to the lowest
        after = server.info()["internal_states"][0]["speculative_num_steps_per_slot"]
        assert after["1"] == 1 and after["8"] == 1
    finally:
        http.stop()
        server.close()


def test_cost_policy_calibrates_stores_and_reports(tiny_smol, tmp_path):
    """`serve --policy cost`: calibrated on the engine at build, stored in the run directory,
    reused by the next build, and its per-slot K / expected tokens shown in /server_info."""
    from serving.control import ControlConfig
    from serving.server import build_policy

    head = new_head(tiny_smol, draft_vocab_size=2048)
    cfg = ServerConfig(policy="cost", control=ControlConfig(run_dir=str(tmp_path)),
                       engine=EngineConfig(max_len=256, max_batch=2, max_steps=3, num_steps=1))
    policy = build_policy(cfg, tiny_smol, head)
    assert policy.name == "cost_model" and policy.candidate_steps == [0, 1, 2, 3]
    store = json.loads((tmp_path / "cost_model.json").read_text())
    assert store["report"]["source"] == "calibrated" and store["key"]["target"] == tiny_smol.name
    server = SpecServer(cfg, tiny_smol, head, policy=build_policy(cfg, tiny_smol, head))  # from the store
    server.start()
    http = HttpThread(server).start()
    try:
        r = httpx.post(http.url + "/v1/completions", timeout=60,
                       json={"prompt": "go", "max_tokens": 24, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
        state = server.info()["internal_states"][0]
        assert state["policy"]["policy"] == "cost_model"
        assert state["speculative_num_steps_per_slot"]["1"] in (0, 1, 2, 3)
        assert set(state["policy"]["slots"]["1"]["expected_tokens"]) == {"0", "1", "2", "3"}
    finally:
        http.stop()
        server.close()
    with pytest.raises(ConfigError, match="policy"):
        ServerConfig(policy="ema")  # no --adaptive
    with pytest.raises(ConfigError, match="policy"):
        ServerConfig(policy="fastest")


def test_bench_server_runs_the_cost_policy_under_load(tiny_smol):
    """`bench server --policy cost`: the spec mode is served by the calibrated cost policy."""
    from bench.server import ServerBenchConfig, run_mode

    cfg = ServerBenchConfig(clients=8, requests=8, max_tokens=4, max_batch=4, max_len=256, policy="cost")
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(8)]
    out = run_mode(tiny_smol, new_head(tiny_smol, draft_vocab_size=2048), cfg, 3, prompts, policy=cfg.policy)
    assert out["failed_requests"] == 0 and out["completion_tokens"] == 8 * 4
    assert out["policy"] == "cost_model" and set(out["steps_per_slot"]) == {"1"}
    with pytest.raises(ConfigError, match="policy"):
        ServerBenchConfig(policy="fastest")


def test_capture_stream_counted_in_metrics(tiny_smol, tmp_path):
    from collector.publisher import CapturePublisher, PublisherConfig
    from collector.subscriber import CaptureSubscriber, SubscriberConfig

    publisher = CapturePublisher(PublisherConfig(endpoint=f"ipc://{tmp_path}/capture.sock"))
    server = SpecServer(ServerConfig(engine=EngineConfig(max_len=256, max_batch=2, num_steps=2)), tiny_smol,
                        new_head(tiny_smol, draft_vocab_size=2048), publisher=publisher)
    server.start()
    http = HttpThread(server).start()
    spans = []
    try:
        with CaptureSubscriber(SubscriberConfig(endpoint=publisher.endpoint), on_span=spans.append).start():
            assert publisher.wait_for_subscriber(10)
            r = httpx.post(http.url + "/generate", timeout=60, json={"text": "go", "sampling_params": {
                "max_new_tokens": 8, "ignore_eos": True, "temperature": 0}})
            assert r.status_code == 200
            assert _wait(lambda: publisher.stats()["sent"] >= 2)
            assert _wait(lambda: len(spans) == 1)
        text = httpx.get(http.url + "/metrics").text
        sent = [ln for ln in text.splitlines() if ln.startswith("online_spec_capture_records_sent_total ")]
        assert sent and float(sent[0].split()[-1]) == publisher.stats()["sent"]
        assert 'online_spec_capture_records_dropped_total{reason="queue_full"} 0.0' in text
        assert server.info()["capture_publisher"]["sent"] >= 2
    finally:
        http.stop()
        server.close()  # closes the publisher too
