"""Hostile checkpoints and control requests (issue 32) against the real control endpoint (ZMQ ipc,
token) of a running server: a tiny random Llama with SmolLM2's tokenizer, heads for it.

Each is refused with its real reason, quickly, and serving goes on (/health answers, the live
head is unchanged): a head of finite but huge weights (~3e38: it cannot draft), a FIFO named
model.safetensors (it would block a reader forever), a checkpoint file that is a symlink out of
the allowed roots, a config.json that is a list or names an unknown activation, non-finite
weights in a head without metadata (the fault, not the missing version), versions beyond 2^62.
The packaged heads' directory is an allowed root, and a head with its own vocabulary map swaps
into the embedded engine (lossless). Closing the endpoint removes its token, endpoint file and
socket.
"""

import json
import os
import threading

import httpx
import pytest
import torch

from online_spec import PRETRAINED_HEADS
from online_spec.checkpoint import CheckpointError, open_checkpoint, save_head
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from online_spec.target import tiny_target
from serving.control import ControlClient, ControlConfig, ControlError
from serving.engine import Engine, EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread


@pytest.fixture(scope="module")
def tiny_smol(smol):
    return tiny_target(vocab_size=smol.info.vocab_size, hidden_size=64, num_layers=8, tokenizer=smol.tokenizer)


@pytest.fixture(scope="module")
def served(tiny_smol, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = ServerConfig(engine=EngineConfig(max_batch=4, max_len=256, num_steps=3), head_check_s=0.0,
                       control=ControlConfig(run_dir=str(run_dir)))
    server = SpecServer(cfg, tiny_smol, new_head(tiny_smol, draft_vocab_size=2048, seed=1), head_version=1)
    server.start()
    http = HttpThread(server).start()
    try:
        yield server, http, run_dir, ControlClient.from_run_dir(run_dir, timeout_s=30)
    finally:
        http.stop()
        server.close()


def write_head(target, path, version=9, seed=2, token_counts=None, edit=None, meta=True):
    head = new_head(target, draft_vocab_size=2048, seed=seed, token_counts=token_counts)
    if edit is not None:
        with torch.no_grad():
            edit(head)
    save_head(head, path, version=version)
    if not meta:
        (path / "online_spec.json").unlink()
    return path


def unchanged(served, version=None):
    server, http = served[0], served[1]
    assert httpx.get(http.url + "/health", timeout=10).status_code == 200
    if version is not None:
        assert server.engine.head_version == version


def test_huge_but_finite_weights_are_refused_by_a_probe_draft(served, tiny_smol):
    server, _, run_dir, client = served
    live, version = server.engine.head, server.engine.head_version
    path = write_head(tiny_smol, run_dir / "huge", edit=lambda h: h.fc.weight.fill_(3e38))
    with pytest.raises(ControlError, match="the head cannot draft: .*not finite"):
        client.swap_dir(path)
    assert server.engine.head is live
    unchanged(served, version)


def test_a_fifo_is_refused_at_once_and_nothing_waits_on_it(served, tiny_smol):
    server, _, run_dir, client = served
    d = write_head(tiny_smol, run_dir / "fifo")
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    result = {}
    t = threading.Thread(target=lambda: result.update(err=pytest.raises(ControlError, client.swap_dir, d)), daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), "the swap of a FIFO did not return"
        assert "model.safetensors is not a regular file" in str(result["err"].value)
        unchanged(served, 1)
        assert client.info()["head_version"] == 1  # the control endpoint still answers
    finally:
        if t.is_alive():  # unblock a reader stuck on the FIFO so the process can end
            fd = os.open(d / "model.safetensors", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)


def test_the_codec_reads_only_regular_files(tiny_smol, tmp_path):
    d = write_head(tiny_smol, tmp_path / "h")
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    out = {}
    t = threading.Thread(target=lambda: out.update(e=pytest.raises(CheckpointError, open_checkpoint, d)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and "config.json is not a regular file" in str(out["e"].value)


def test_a_file_symlink_out_of_the_roots_is_not_followed(served, tiny_smol, tmp_path):
    server, _, run_dir, client = served
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    d = write_head(tiny_smol, run_dir / "link")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(outside)
    with pytest.raises(ControlError, match="config.json in .* is a symlink to .*outside the allowed roots"):
        client.swap_dir(d)
    unchanged(served, 1)


def test_a_config_that_is_a_list_or_names_an_unknown_activation_is_refused(served, tiny_smol):
    server, _, run_dir, client = served
    cfg = json.loads((write_head(tiny_smol, run_dir / "as-list") / "config.json").read_text())
    (run_dir / "as-list" / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(ControlError, match="config.json must be a JSON object, got a list"):
        client.swap_dir(run_dir / "as-list")
    write_head(tiny_smol, run_dir / "act")
    (run_dir / "act" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "os.system"}))
    with pytest.raises(ControlError, match="hidden_act 'os.system' is not an activation"):
        client.swap_dir(run_dir / "act")
    unchanged(served, 1)


def test_the_real_fault_comes_before_the_missing_version_and_versions_are_bounded(served, tiny_smol):
    server, _, run_dir, client = served
    nan = write_head(tiny_smol, run_dir / "nan-nometa", meta=False,
                     edit=lambda h: h.lm_head.weight.__setitem__((0, 0), float("nan")))
    with pytest.raises(ControlError, match="lm_head.weight has non-finite values"):
        client.swap_dir(nan)
    nometa = write_head(tiny_smol, run_dir / "nometa", meta=False)
    with pytest.raises(ControlError, match=r"no version: .*\(pass --version\)"):
        client.swap_dir(nometa)
    for v in (10**30, 2**62 + 1, -1):
        with pytest.raises(ControlError, match=r"version must be an integer in 0\.\.4611686018427387904"):
            client.swap_dir(nometa, version=v)
    huge_meta = write_head(tiny_smol, run_dir / "v-huge", version=10**30)
    with pytest.raises(ControlError, match="version must be an integer"):
        client.swap_dir(huge_meta)
    unchanged(served, 1)


def test_packaged_heads_root_and_a_head_with_its_own_vocabulary_map(served, tiny_smol):
    server, http, run_dir, client = served
    # the packaged heads are under an allowed root: refused here only because they fit SmolLM2, not this target
    with pytest.raises(ControlError, match="target_hidden_size 576 != target hidden 64"):
        client.swap_dir(PRETRAINED_HEADS / "code-h100")
    counts = torch.arange(tiny_smol.info.vocab_size, 0, -1).float()  # another draft vocabulary
    other = write_head(tiny_smol, run_dir / "other-map", version=12, seed=5, token_counts=counts)
    assert not torch.equal(server.engine.head.d2t, open_checkpoint(other).tensors["d2t"])
    reply = client.swap_dir(other)
    assert reply["landed"] and server.engine.head_version == 12
    assert torch.equal(server.engine.head.d2t.cpu(), open_checkpoint(other).tensors["d2t"])
    ids = tiny_smol.tokenizer.encode("Hello there")
    r = httpx.post(http.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=120)
    plain = Engine(tiny_smol, None, EngineConfig(max_batch=1, max_len=256, num_steps=0)).generate(
        [ids], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert r.json()["output_ids"] == plain
    assert client.rollback()["version"] == 1


def test_closing_removes_the_token_endpoint_and_socket(tiny_smol, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)  # a run directory someone made readable: tightened before the token goes in
    server = SpecServer(ServerConfig(control=ControlConfig(run_dir=str(run_dir))), tiny_smol,
                        new_head(tiny_smol, draft_vocab_size=2048))
    server.start()
    try:
        assert oct(os.stat(run_dir).st_mode & 0o777) == "0o700"
        names = {"control.token", "control.endpoint", "control.sock"}
        assert names <= set(os.listdir(run_dir))
        assert ControlClient.from_run_dir(run_dir).info()["head_version"] == 0
    finally:
        server.close()
    assert not names & set(os.listdir(run_dir))


def test_trainer_alerts_reach_server_info_metrics_and_refuse_garbage(served):
    """The trainer's own alert (online_spec/starvation.py) over the control endpoint: in
    /server_info (its list and the drift list), counted in Prometheus by kind; malformed ones and
    a caller without the token are refused, and the server serves on."""
    from online_spec.starvation import StarvationConfig, StarvationDetector

    server, http, run_dir, client = served
    det = StarvationDetector(StarvationConfig(window_s=10))
    det.update(0.0, 0, True, 0)
    alert = det.update(10.0, 0, True, 0, head_version=1, wall_time=123.0)[0]
    assert client.request("trainer_alert", alert.to_dict()) == {"taken": "trainer_starved"}
    info = httpx.get(http.url + "/server_info").json()
    assert info["trainer_alerts"][-1]["kind"] == "trainer_starved" and info["trainer_alerts"][-1]["time"] == 123.0
    assert info["drift"]["recent_alerts"][-1]["title"] == alert.title
    metrics = httpx.get(http.url + "/metrics").text
    assert 'kind="trainer_starved"' in metrics
    good = alert.to_dict()
    for bad, why in (({"kind": "drop"}, "kind"), ({"before": float("nan")}, "before"), ({"text": "x" * 3000}, "text"),
                     ({"round": -1}, "round"), ({"head_version": True}, "head_version")):
        with pytest.raises(ControlError, match=why):
            client.request("trainer_alert", {**good, **bad})
    stranger = ControlClient(client.endpoint, "wrong-token", timeout_s=10)
    with pytest.raises(ControlError, match="token"):
        stranger.request("trainer_alert", good)
    assert len(httpx.get(http.url + "/server_info").json()["trainer_alerts"]) == len(info["trainer_alerts"])
    assert httpx.get(http.url + "/health").status_code == 200
