"""The server's head bank (serving/head_bank.py) and the trainer following it (trainer/server_head.py).

No model: the bank's rules on rounds and admissions built by hand, with a swapper that records
what it was asked; the swapper's spare never reuses a banked module (a real `HeadSwapper` on a
stand-in server, modules as plain objects). The end-to-end figure (a return to earlier traffic)
is `bench e2e --trace-shape return`.
"""

import time
from types import SimpleNamespace

import pytest

from online_spec.config import ConfigError
from serving.head_bank import BankConfig, HeadBank
from serving.swap import HeadSwapper, HeadVersion
from trainer.server_head import ServerHeadWatch


class FakeSwapper:
    def __init__(self, version=0):
        self.live = HeadVersion(object(), version, None, "initial")
        self.asked = []

    def publish(self, version):  # the trainer swapped in a new version
        self.live = HeadVersion(object(), version, None, f"ckpt/v{version}")

    def swap_banked(self, banked):
        self.asked.append(banked.version)
        self.live = banked
        return {"version": banked.version}


def rounds(bank, version, tag, n, hits):
    """n request-rounds of `tag` drafted by `version`, `hits` of them with the first draft accepted."""
    for i in range(n):
        bank.observe(SimpleNamespace(num_steps=3, accepted=[2 if i < hits else 0], head_version=version), [None], [tag])


def admit(bank, tags):
    for t in tags:
        bank.admitted(t)


def bank_with(**kw):
    sw = FakeSwapper()
    return HeadBank(BankConfig(**{"window": 4, "dominance": 0.75, "min_rounds": 10, "min_dwell_s": 0,
                                 "dwell_requests": 0, **kw}), sw), sw


def test_a_returning_tag_gets_back_the_head_that_drafted_best_on_it():
    bank, sw = bank_with()
    admit(bank, ["chat"] * 4)
    rounds(bank, 0, "chat", 20, 14)  # v0 on chat: 0.70
    assert bank.step(1.0) is None  # chat is served by its best head already
    sw.publish(1)
    rounds(bank, 1, "chat", 20, 16)  # v1 on chat: 0.80, now the chat head
    bank.step(2.0)
    admit(bank, ["code"] * 4)
    sw.publish(2)
    rounds(bank, 2, "code", 30, 24)
    assert bank.step(3.0) is None and sw.asked == []  # code has no banked head: the trainer forks one
    admit(bank, ["chat", "chat", "code"])
    assert bank.step(4.0) is None  # 2 of 4 is no dominance
    admit(bank, ["chat"])
    rounds(bank, 2, "chat", 9, 9)
    assert bank.step(5.0) is None  # v2 has drafted too little chat to judge: wait for it
    rounds(bank, 2, "chat", 1, 0)  # 10 rounds of chat, 9 first drafts accepted: as good as v1
    assert bank.step(5.5) is None and sw.asked == []  # the trainer's newest head keeps the chat
    assert bank.info()["serving_tag"] == "chat"

    bank, sw = bank_with()  # again, v2 drafting chat badly this time
    admit(bank, ["chat"] * 4)
    rounds(bank, 0, "chat", 20, 14)
    bank.step(1.0)
    sw.publish(1)
    rounds(bank, 1, "chat", 20, 16)
    bank.step(2.0)
    admit(bank, ["code"] * 4)
    sw.publish(2)
    rounds(bank, 2, "code", 30, 24)
    bank.step(3.0)
    admit(bank, ["chat"] * 3)
    rounds(bank, 2, "chat", 10, 3)  # 0.3 against v1's 0.8
    out = bank.step(5.0)
    assert sw.asked == [1] and out["tag"] == "chat" and out["from"] == 2 and out["to"] == 1
    assert out["rate_banked"] == pytest.approx(0.8) and out["rate_live"] == pytest.approx(0.3)
    info = bank.info()
    assert info["banked"] == {"chat": {"version": 1, "first_draft_acceptance": pytest.approx(0.8)},
                              "code": {"version": 2, "first_draft_acceptance": pytest.approx(0.8)}}
    assert info["swaps"] == 1 and info["serving_tag"] == "chat"


def test_only_a_change_of_traffic_moves_the_head():
    """The trainer's next version for the same traffic is never undone, whatever its measure."""
    bank, sw = bank_with()
    admit(bank, ["chat"] * 4)
    rounds(bank, 0, "chat", 20, 18)
    bank.step(1.0)
    sw.publish(1)  # a new chat version, not yet measured
    rounds(bank, 1, "chat", 5, 0)
    assert bank.step(2.0) is None and sw.asked == []


def test_no_swap_when_the_live_head_is_as_good_there_or_too_soon():
    bank, sw = bank_with(margin=0.05)
    admit(bank, ["chat"] * 4)
    rounds(bank, 0, "chat", 20, 16)  # 0.80
    bank.step(1.0)
    admit(bank, ["code"] * 4)
    sw.publish(1)
    rounds(bank, 1, "code", 20, 10)
    rounds(bank, 1, "chat", 20, 16)  # v1 drafts chat as well as v0 did (a mix in between)
    bank.step(2.0)
    admit(bank, ["chat"] * 4)
    assert bank.step(3.0) is None and sw.asked == []  # within the margin: keep the live head
    dwell, sw2 = bank_with(min_dwell_s=10.0)
    admit(dwell, ["chat"] * 4)
    rounds(dwell, 0, "chat", 20, 16)
    dwell.step(0.0)
    admit(dwell, ["code"] * 4)
    sw2.publish(1)
    rounds(dwell, 1, "code", 20, 10)
    dwell.step(1.0)
    dwell._last_swap_t = 1.0  # as if it had just swapped
    admit(dwell, ["chat"] * 4)
    rounds(dwell, 1, "chat", 20, 2)  # v1 drafts chat badly
    assert dwell.step(5.0) is None and sw2.asked == []
    assert dwell.step(11.5)["to"] == 0 and sw2.asked == [0]  # the change waited, it was not forgotten


def test_the_bank_swaps_at_most_once_per_dwell_of_admitted_requests_however_long_they_take():
    bank, sw = bank_with(dwell_requests=8)
    admit(bank, ["chat"] * 4)
    rounds(bank, 0, "chat", 20, 16)  # v0 drafts chat well
    bank.step(0.0)
    admit(bank, ["code"] * 4)
    sw.publish(1)
    rounds(bank, 1, "code", 20, 18)
    bank.step(1.0)
    admit(bank, ["chat"] * 4)
    rounds(bank, 1, "chat", 20, 2)
    assert bank.step(2.0)["to"] == 0 and sw.asked == [0]  # chat is back: v0
    rounds(bank, 0, "code", 20, 2)  # v0 drafts code badly
    admit(bank, ["code"] * 4)  # 4 requests since the swap
    assert bank.step(1e6) is None and sw.asked == [0]  # hours of wall time are not a dwell of traffic
    admit(bank, ["code"] * 4)  # 8
    assert bank.step(1e6 + 1)["to"] == 1 and sw.asked == [0, 1]


def test_a_difference_within_the_noise_waits_for_more_rounds():
    """A banked head better by the margin on a few dozen request-rounds may be noise (48 rounds
    measure a rate to +-7 %): the bank waits for more of the live head's rounds, swaps once the
    difference is significant, and keeps the live head when it is not after 4 x min_rounds."""
    def returned(v1_chat_rounds, v1_chat_hits):
        bank, sw = bank_with(margin=0.05, min_z=2.0)  # min_rounds 10
        admit(bank, ["chat"] * 4)
        rounds(bank, 0, "chat", 20, 14)  # v0 on chat: 0.70
        bank.step(1.0)
        admit(bank, ["code"] * 4)
        sw.publish(1)
        rounds(bank, 1, "code", 20, 10)
        bank.step(2.0)
        admit(bank, ["chat"] * 4)
        rounds(bank, 1, "chat", v1_chat_rounds, v1_chat_hits)
        return bank, sw

    bank, sw = returned(10, 5)  # 0.50 against 0.70: beyond the margin, 1.1 standard errors
    assert bank.z(0, 1, "chat") == pytest.approx(1.1, abs=0.1)
    assert bank.step(3.0) is None and sw.asked == [] and bank.info()["serving_tag"] == "code"  # waiting
    rounds(bank, 1, "chat", 20, 4)  # 9 of 30: 0.30, now significant
    assert bank.step(4.0)["to"] == 0 and sw.asked == [0]
    bank, sw = returned(10, 5)
    rounds(bank, 1, "chat", 30, 21)  # 26 of 40: 0.65, within the margin
    assert bank.step(4.0) is None and sw.asked == [] and bank.info()["serving_tag"] == "chat"  # kept
    bank, sw = returned(40, 24)  # 0.60 over 4 x min_rounds, 0.8 standard errors: no more waiting
    assert bank.step(3.0) is None and sw.asked == [] and bank.info()["serving_tag"] == "chat"
    assert bank_with(min_z=0.0)[0].cfg.min_z == 0.0  # the margin alone
    with pytest.raises(ConfigError, match="min_z"):
        BankConfig(min_z=-1.0)


def test_mixed_traffic_and_plain_rounds_do_not_move_or_measure():
    bank, sw = bank_with()
    admit(bank, ["chat", "code"] * 2)
    assert bank.dominant() is None
    bank.observe(SimpleNamespace(num_steps=0, accepted=[0], head_version=0), [None], ["chat"])
    assert bank.rate(0, "chat") is None and bank.info()["counts"] == {}


def test_the_bank_holds_at_most_max_heads_and_forgets_counts_it_cannot_use():
    bank, sw = bank_with(max_heads=2)
    for v, tag in enumerate(["a", "b", "c"]):
        if v:
            sw.publish(v)
        rounds(bank, v, tag, 10, 5)
        bank.step(float(v))
    assert set(bank._kept) == {1, 2} and bank.info()["banked"].keys() == {"b", "c"}
    assert bank.holds(sw.live.head) and not bank.holds(object())
    sw.publish(3)
    rounds(bank, 2, "z", 3, 1)  # an old version's rounds still landing: kept only while it is banked
    bank.step(4.0)
    assert all(v in (1, 2, 3) for v, _ in bank._counts)


def test_swapper_never_reuses_a_banked_module_as_its_spare():
    class Engine:
        head, head_version, has_pending = None, 0, False

    class Server:
        head_probe = None

        def __init__(self):
            self.engine = Engine()

        def swap(self, head, version, rollback=False):
            self.engine.head, self.engine.head_version = head, version

    server = Server()
    sw = HeadSwapper(server, [])
    a, b, c = object(), object(), object()
    banked = {a}
    sw.holds = lambda h: h in banked
    for head, v in ((a, 1), (b, 2), (c, 3)):
        sw._install(HeadVersion(head, v, None, "x"), 0.0)
    assert sw._spare is None  # a went from previous to spare: banked, so kept out
    banked.clear()
    sw._install(HeadVersion(object(), 4, None, "x"), 0.0)
    assert sw._spare is b  # an unbanked module is reused as before
    assert sw.swap_banked(HeadVersion(a, 1, None, "x"))["version"] == 1 and server.engine.head is a


def test_bank_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="dominance"):
        BankConfig(dominance=0.5)
    with pytest.raises(ConfigError, match="window"):
        BankConfig(window=0)


def test_the_trainer_follows_a_version_the_server_made_live_and_says_so_once_when_it_cannot(caplog):
    watch = ServerHeadWatch(poll_s=2.0)
    server = {"head_version": 3, "head_bank": {"enabled": True, "banked": {"chat": {"version": 2},
                                                                           "code": {"version": 3}}}}
    mine = {0, 2, 3, 5}
    ask = dict(server_info=lambda: server, live_version=3, loadable=mine.__contains__)
    assert watch.changed(0.0, **ask) is None  # the same version
    assert watch.banked == {"chat": 2, "code": 3} and watch.banked_elsewhere(3) == {"chat"}
    server["head_version"] = 2
    assert watch.changed(1.0, **ask) is None  # not due yet
    assert watch.changed(2.0, **ask) == 2
    server["head_version"] = 9  # an operator's head from elsewhere
    assert watch.changed(4.0, **ask) is None and watch.changed(6.0, **ask) is None
    assert sum("v9" in r.message for r in caplog.records) == 1
    t = 8.0
    for odd, want in (({"head_version": -1}, None), ({"head_version": True}, None), ([], None),
                      ({"head_version": 2, "head_bank": None}, 2)):
        t += 2.0  # the server cannot say, or says nonsense: nothing adopted, no bank known
        assert watch.changed(t, server_info=lambda odd=odd: odd, live_version=3, loadable=mine.__contains__) == want
        assert watch.banked == {}

    def down():
        raise ConnectionError("gone")
    assert watch.changed(100.0, server_info=down, live_version=3, loadable=mine.__contains__) is None


def test_the_daemon_adopts_the_servers_head_and_trains_on_from_it(tmp_path):
    """A real daemon (tiny Llama target, DeepSpeed on CPU): it published v1 then v2; the server
    makes v1 live again (its bank). The daemon's live version, the gate's live head and the
    weights it trains on become v1's; the random day-0 head it started from cannot be adopted."""
    import torch

    from tests.distill_helpers import tiny8
    from tests.test_trainer_hostile import make_daemon

    class Server:
        def __init__(self):
            self.version = 0

        def info(self):
            return {"head_version": self.version}

        def swap_dir(self, path, version=None, digest=None):
            self.version = version
            return {"version": version}

    daemon = make_daemon(tiny8(), tmp_path)
    daemon.publisher = server = Server()
    assert daemon.publish() == 1
    v1 = {k: v.clone() for k, v in daemon.distiller.head.state_dict().items()}
    with torch.no_grad():
        for p in daemon.distiller.head.parameters():
            p.add_(0.05)
    assert daemon.publish() == 2 and daemon.watch_server_head(now=0.0) is None  # the server agrees
    server.version = 1
    assert daemon.watch_server_head(now=10.0) == 1
    # the bank's swap stands a dwell before a seed check
    assert daemon.seeds._next >= 10.0 + daemon.seeds.cfg.min_dwell_s
    assert daemon.seeds._dwell_until == daemon.seeds._rows + daemon.seeds.cfg.dwell_rows
    assert (daemon.state["live_version"], daemon.state["previous_version"]) == (1, 2)
    now = daemon.distiller.head.state_dict()
    for name, p in daemon.distiller.head.named_parameters():  # v1 as published (bf16 on disk)
        torch.testing.assert_close(p.detach(), v1[name].to(torch.bfloat16).float())
    live = daemon.live_head.state_dict()
    assert all(torch.allclose(live[n].float(), now[n].float(), atol=1e-2)
               for n, _ in daemon.distiller.head.named_parameters())
    assert daemon.summary()["adopted_server_heads"] == 1
    server.version = 0  # the random head it started from: not on disk
    assert daemon.watch_server_head(now=20.0) is None and daemon.state["live_version"] == 1
    (daemon.run_dir / "ckpt" / "v2" / "model.safetensors").write_bytes(b"torn")  # unreadable now
    server.version = 2
    assert daemon.watch_server_head(now=30.0) is None and daemon.state["live_version"] == 1  # said, not fatal
    assert daemon.watch_server_head(now=40.0) is None and daemon.summary()["adopted_server_heads"] == 1


@pytest.mark.slow
def test_a_real_server_swaps_the_chat_head_back_when_chat_returns(smol_fp32, tmp_path):
    """Real SmolLM2 server with its control endpoint: v1 (the shipped chat head) serves chat, v2
    (a random head, swapped in over the control endpoint as the trainer does) serves code; chat
    comes back, v2 drafts it worse, and the bank makes v1 live again, the very module. Every
    output equals the target's greedy output."""
    import httpx

    from online_spec.checkpoint import save_head
    from online_spec.head import new_head
    from online_spec.heads import load_draft
    from online_spec.sampling import SamplingParams
    from serving.control import ControlClient, ControlConfig
    from serving.engine import Engine, EngineConfig
    from serving.server import ServerConfig, SpecServer
    from serving.server_app import HttpThread

    engine = EngineConfig(max_batch=2, max_len=256, num_steps=3)
    bank = BankConfig(window=2, dominance=1.0, min_rounds=4, min_dwell_s=0.0, poll_s=0.02)
    cfg = ServerConfig(engine=engine, control=ControlConfig(run_dir=str(tmp_path)), bank=bank)
    v1, _, _ = load_draft("shipped", smol_fp32, dtype=smol_fp32.dtype)
    server = SpecServer(cfg, smol_fp32, v1, head_version=1)
    server.start()
    http = HttpThread(server).start()
    prompts = {tag: smol_fp32.encode_chat([{"role": "user", "content": text}]) for tag, text in
               (("chat", "Tell me about the moon."), ("code", "Write a Python function that adds two numbers."))}
    plain = Engine(smol_fp32, None, EngineConfig(max_batch=1, max_len=256, num_steps=0))
    want = {tag: plain.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
            for tag, ids in prompts.items()}
    try:
        def serve(tag):
            body = {"input_ids": prompts[tag], "tag": tag,
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
            r = httpx.post(f"{http.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want[tag]

        for _ in range(2):
            serve("chat")
        save_head(new_head(smol_fp32, seed=1), tmp_path / "v2", version=2)
        ControlClient.from_run_dir(tmp_path).swap_dir(str(tmp_path / "v2"), 2)
        for _ in range(2):
            serve("code")
        assert server.engine.head_version == 2 and server.bank.swaps == []
        for _ in range(2):
            serve("chat")
        deadline = time.monotonic() + 30
        while server.engine.head_version != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.engine.head is v1 and server.engine.head_version == 1
        info = server.info()["head_bank"]
        assert info["swaps"] == 1 and info["last_swap"]["tag"] == "chat" and info["last_swap"]["from"] == 2
        assert info["banked"]["code"]["version"] == 2 and info["banked"]["chat"]["version"] == 1
        assert info["last_swap"]["rate_banked"] > info["last_swap"]["rate_live"] + bank.margin
        serve("chat")  # the swapped-back head stays lossless
    finally:
        http.stop()
        server.close()
