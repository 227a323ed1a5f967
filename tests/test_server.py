"""The HTTP server with the real SmolLM2 and the official `openai` client, on a loopback port.

Lossless through the API (greedy text and ids equal `engine.generate`'s), streaming equals
non-streaming, stop strings, SGLang's /generate fields, 4xx with a message for what we refuse,
/server_info and /metrics (parsed with prometheus_client's parser), traffic tags.
"""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from serving.engine import Engine, EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(max_batch=4, max_len=512, num_steps=3)
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def served(smol):
    server = SpecServer(ServerConfig(engine=ENGINE), smol, new_head(smol))
    server.start()
    http = HttpThread(server).start()
    try:
        yield server, http
    finally:
        http.stop()
        server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(url: str) -> dict:
    fams = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_greedy_through_api_equals_engine_generate(served, smol):
    server, http = served
    ids = smol.encode_chat(CHAT)
    ref_engine = Engine(smol, new_head(smol), ENGINE)
    ref = ref_engine.generate([ids], SamplingParams(max_tokens=12))[0]
    r = httpx.post(http.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0}}, timeout=120).json()
    assert r["output_ids"] == ref
    assert r["text"] == smol.tokenizer.decode(ref, skip_special_tokens=True)
    meta = r["meta_info"]
    assert meta["completion_tokens"] == len(ref) and meta["prompt_tokens"] == len(ids)
    assert meta["spec_verify_ct"] >= 1 and meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_verify_ct"] + 1)
    assert meta["finish_reason"]["type"] in ("length", "stop")


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model="m", messages=CHAT, max_tokens=10, temperature=0)
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 5
    assert full.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_streaming_and_stop_string(client):
    full = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
    # stop at the first "6": the text ends before it, finish_reason is "stop"
    assert "6" in text, text
    cut = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["6"])
    assert cut.choices[0].text == text[:text.index("6")]
    assert cut.choices[0].finish_reason == "stop"
    cut_s = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["6"], stream=True))
    assert cut_s == cut.choices[0].text


def test_seeded_sampling_repeats(client):
    a = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7)
    b = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n=2), "n=2"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=1.0), "presence_penalty"),
])
def test_bad_parameters_are_400_with_message(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hi", **kwargs)
    assert needle in e.value.message


def test_malformed_and_oversized_requests(served):
    url = served[1].url
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 600, "max_tokens": 4})
    assert r.status_code == 400 and "max_len" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [10 ** 7], "max_tokens": 4})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = httpx.post(url + "/generate", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = httpx.post(url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # '*' names the drift monitor's all-traffic stream: refused as a tag, in the body or the header
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "tag": "*"})
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    r = httpx.post(url + "/generate", json={"text": "x"}, headers={"X-Traffic-Tag": "*"})
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    # curl -d sends a form content type: the JSON body is still read
    r = httpx.post(url + "/generate", content=b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2}}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_server_info_metrics_and_tags(served, client):
    server, http = served
    client.completions.create(model="m", prompt="def add(a, b):", max_tokens=6, temperature=0,
                              extra_headers={"X-Traffic-Tag": "code"})
    client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, extra_body={"tag": "chat"})
    info = httpx.get(http.url + "/server_info").json()
    st = info["internal_states"][0]
    assert st["speculative_num_steps"] == 3 and st["speculative_num_steps_per_batch_size"]["1"] == 3
    assert st["avg_spec_accept_length"] >= 1.0 and st["avg_spec_accept_length_lifetime"] >= 1.0
    assert info["head_version"] == 0 and info["speculative_algorithm"] == "EAGLE3"
    m = _metrics(http.url)
    assert m[("online_spec_proposed_drafts_total", (("tag", "code"),))] >= 3
    assert m[("online_spec_proposed_drafts_total", (("tag", "chat"),))] >= 3
    assert m[("online_spec_position_proposed_total", (("position", "2"),))] >= 2
    assert m[("online_spec_num_steps", (("batch_size", "1"),))] == 3
    assert m[("online_spec_rounds_total", ())] >= 2
    assert m[("online_spec_head_version", ())] == 0
    assert m[("online_spec_requests_total", (("endpoint", "completions"), ("outcome", "length")))] >= 2
    assert m[("online_spec_time_to_first_token_seconds_count", ())] >= 2
    assert m[("online_spec_requests_running", ())] == 0 and m[("online_spec_generated_tokens_total", ())] >= 12
    assert httpx.get(http.url + "/health").json() == {"status": "ok"}


def test_swap_hook_bumps_version(served, smol, client):
    server, http = served
    server.swap(new_head(smol, seed=1), version=5)
    r = client.completions.create(model="m", prompt="Hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert server.info()["head_version"] == 5
    m = _metrics(http.url)
    assert m[("online_spec_head_swaps_total", ())] == 1 and m[("online_spec_head_version", ())] == 5


def test_switch_interval_is_set_while_serving_and_restored_at_close(smol):
    """`switch_interval_ms` holds while the server runs (the engine thread waits at most that
    long for the interpreter lock the HTTP side's Python holds) and the caller's comes back."""
    import sys

    from online_spec.config import ConfigError

    before = sys.getswitchinterval()
    server = SpecServer(ServerConfig(engine=ENGINE, switch_interval_ms=0.25, drift_monitor=False), smol, new_head(smol))
    server.start()
    try:
        assert abs(sys.getswitchinterval() - 0.00025) < 1e-9
    finally:
        server.close()
    assert sys.getswitchinterval() == before
    server = SpecServer(ServerConfig(engine=ENGINE, drift_monitor=False), smol, new_head(smol))  # 0: Python's own
    server.start()
    try:
        assert sys.getswitchinterval() == before
    finally:
        server.close()
    with pytest.raises(ConfigError, match="switch_interval_ms"):
        ServerConfig(switch_interval_ms=-1)
