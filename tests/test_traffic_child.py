"""The benches' clients in a process of their own (`bench.traffic.replay_in_child`), against the
real server on SmolLM2: the same results as in-process `replay`, `on_done` for each finished
request as it finishes, the deadline's cancelled requests returned without it, and a child that
fails raises with its stderr."""

import asyncio
import sys

import pytest

from bench.trace import TraceItem
from bench.traffic import CANCELLED, replay, replay_in_child
from online_spec.head import new_head
from serving.engine import EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(smol):
    server = SpecServer(ServerConfig(engine=EngineConfig(max_batch=4, max_len=512, num_steps=2)), smol,
                        new_head(smol))
    server.start()
    http = HttpThread(server).start()
    try:
        yield http.url
    finally:
        http.stop()
        server.close()


def _items(n: int, max_tokens: int | None = None) -> list[TraceItem]:
    return [TraceItem(i, [{"role": "user", "content": f"Count to {i + 3}."}], None, "chat" if i % 2 else "code",
                      "p0" if i < n // 2 else "p1", max_tokens) for i in range(n)]


def test_the_child_replays_as_the_in_process_clients_do(url):
    items = _items(6)
    here = asyncio.run(replay(url, items, concurrency=3, max_tokens=12))
    seen = []
    there = replay_in_child(url, items, concurrency=3, max_tokens=12, on_done=seen.append)
    assert [r.index for r in there] == [r.index for r in here] == list(range(6))
    assert all(r.ok and r.request_id for r in there)
    # greedy: the same prompts give the same tokens wherever the clients run
    assert [r.completion_tokens for r in there] == [r.completion_tokens for r in here]
    assert [(r.phase, r.tag) for r in there] == [(it.phase, it.tag) for it in items]
    assert sorted(r.index for r in seen) == list(range(6))  # on_done once per finished request
    assert all(r.t_submit <= r.t_first <= r.t_last for r in there)


def test_requests_cancelled_at_the_deadline_come_back_without_on_done(url):
    seen = []
    out = replay_in_child(url, _items(3, max_tokens=400), concurrency=3, max_tokens=400, deadline_s=0.5,
                          on_done=seen.append)
    cancelled = [r for r in out if r.error == CANCELLED]
    assert cancelled, [r.error for r in out]
    assert not {r.index for r in cancelled} & {r.index for r in seen}


def test_a_child_that_fails_raises_with_its_stderr(url, monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no traffic today' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(RuntimeError, match="exited 3: no traffic today"):
        replay_in_child(url, _items(1), concurrency=1, max_tokens=4)
