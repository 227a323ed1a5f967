"""The control endpoint against a real server: real SmolLM2, real ZMQ ipc socket, real HTTP streams.

Every kind of bad swap is refused with its reason while a streaming request is in flight, and
that request still finishes with the target's own greedy output; a good swap lands between
rounds (info and RoundStats show it); rollback reinstalls the previous head bit for bit;
inline tensor swaps, set_adaptive, the token, loopback-only binding, and the `online-spec
swap/rollback/status` commands end to end; the packaged code head (another draft vocabulary than
the live head's) swapped in from where it ships, by the CLI, under a stream that stays lossless.
"""

import json
import os
import stat
import threading

import httpx
import pytest
import torch
from safetensors.torch import save_file

from online_spec.checkpoint import file_digest, head_config_json, head_tensors, save_head
from online_spec.cli import main as cli_main
from online_spec.config import ConfigError
from online_spec import PRETRAINED_HEADS
from online_spec.head import new_head
from online_spec.sampling import SamplingParams
from serving.control import ControlClient, ControlConfig, ControlError
from serving.engine import Engine, EngineConfig
from serving.server import ServerConfig, SpecServer
from serving.server_app import HttpThread

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(max_batch=4, max_len=512, num_steps=3)
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
MAX_NEW = 48


@pytest.fixture(scope="module")
def served(smol_fp32, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = ServerConfig(engine=ENGINE, control=ControlConfig(run_dir=str(run_dir)))
    server = SpecServer(cfg, smol_fp32, new_head(smol_fp32, seed=0), head_version=1)
    rounds = []
    server.round_observers.append(lambda stats, outs, tags: rounds.append(stats))
    server.start()
    http = HttpThread(server).start()
    try:
        yield server, http, run_dir, rounds
    finally:
        http.stop()
        server.close()


@pytest.fixture(scope="module")
def client(served):
    return ControlClient.from_run_dir(served[2])


@pytest.fixture(scope="module")
def plain_output(smol_fp32):
    """The target alone (no head, K = 0), greedy: what every stream must produce."""
    ids = smol_fp32.encode_chat(PROMPT)
    return ids, Engine(smol_fp32, None, EngineConfig(max_batch=1, max_len=512, num_steps=0)).generate(
        [ids], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]


class Stream:
    """A streaming /generate request in a background thread (greedy, ignore_eos)."""

    def __init__(self, url: str, ids: list[int]):
        self.output_ids: list[int] = []
        self.error: Exception | None = None
        self.started = threading.Event()
        self._t = threading.Thread(target=self._run, args=(url, ids), daemon=True)
        self._t.start()
        assert self.started.wait(60), "stream did not start"

    def _run(self, url, ids):
        try:
            body = {"input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
            with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        self.output_ids = json.loads(line[5:])["output_ids"]
                        self.started.set()
        except Exception as e:  # surfaced by join()
            self.error = e
        finally:
            self.started.set()

    def join(self) -> list[int]:
        self._t.join(120)
        assert self.error is None, self.error
        return self.output_ids


def write_ckpt(path, cfg_json: dict, tensors: dict, version: int):
    """A checkpoint directory written by hand (to build invalid ones the codec would not write)."""
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg_json))
    (path / "online_spec.json").write_text(json.dumps({"version": version,
                                                       "digest": file_digest(path / "model.safetensors")}))
    return path


def good_parts(smol, seed: int):
    head = new_head(smol, seed=seed)
    return head_config_json(head.cfg, head.fc.weight.dtype), head_tensors(head)


def test_token_file_and_loopback_rules(served):
    run_dir = served[2]
    assert stat.S_IMODE(os.stat(run_dir / "control.token").st_mode) == 0o600
    assert len((run_dir / "control.token").read_text()) == 64
    with pytest.raises(ConfigError, match="not a loopback address"):
        ControlConfig(run_dir=str(run_dir), control_endpoint="tcp://0.0.0.0:5999")
    with pytest.raises(ConfigError, match="ipc:// or tcp://"):
        ControlConfig(run_dir=str(run_dir), control_endpoint="inproc://x")
    ControlConfig(run_dir=str(run_dir), control_endpoint="tcp://127.0.0.1:5999")  # loopback is fine
    ControlConfig(run_dir=str(run_dir), control_endpoint="tcp://0.0.0.0:5999", control_allow_remote=True)


def test_bad_swaps_refused_while_a_stream_completes(served, client, smol_fp32, plain_output, tmp_path):
    server, http, run_dir, _ = served
    ids, expected = plain_output
    live_head, live_version = server.engine.head, server.engine.head_version
    cfg, good = good_parts(smol_fp32, seed=3)
    heads = run_dir / "bad"
    bad: dict[str, tuple] = {}

    def case(name, reason, cfg_json=cfg, **edits):
        t = {k: v.clone() for k, v in good.items()}
        for k, v in edits.items():
            if v is None:
                del t[k]
            else:
                t[k] = v
        bad[name] = (write_ckpt(heads / name, cfg_json, t, 9), reason)

    case("missing", r"missing tensors: \['norm.weight'\]", **{"norm.weight": None})
    case("extra", r"unexpected tensors: \['embed_tokens.weight'\]",
         **{"embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    case("shape", r"fc.weight has shape", **{"fc.weight": good["fc.weight"][:, :-1].contiguous()})
    case("dtype", r"fc.weight has dtype torch.float64", **{"fc.weight": good["fc.weight"].double()})
    nan = good["lm_head.weight"].clone()
    nan[3, 5] = float("nan")
    case("nan", r"lm_head.weight has non-finite values", **{"lm_head.weight": nan})
    wide = dict(cfg, target_hidden_size=cfg["target_hidden_size"] * 2)
    case("hidden", r"target_hidden_size 1152 != target hidden 576", cfg_json=wide,
         **{"fc.weight": torch.zeros(cfg["hidden_size"], 6 * cfg["target_hidden_size"], dtype=torch.bfloat16)})
    case("pickle", r"refusing pickle-format files \['extra.bin'\]")
    (bad["pickle"][0] / "extra.bin").write_bytes(b"\x80\x04not really")
    outside = write_ckpt(tmp_path / "outside", cfg, good, 9)
    good_dir = run_dir / "good3"
    write_ckpt(good_dir, cfg, good, 9)

    stream = Stream(http.url, ids)
    for name, (path, reason) in bad.items():
        with pytest.raises(ControlError, match=reason):
            client.swap_dir(path)
    with pytest.raises(ControlError, match="outside the allowed roots"):
        client.swap_dir(outside)
    with pytest.raises(ControlError, match="outside the allowed roots"):  # `..` escape, not resolved client-side
        client.request("swap", {"dir": f"{run_dir}/../{outside.parent.name}/outside"})
    with pytest.raises(ControlError, match="digest mismatch"):
        client.swap_dir(good_dir, digest="0" * 64)
    with pytest.raises(ControlError, match="version must be an integer in 0.."):
        client.request("swap", {"dir": str(good_dir), "version": "7"})
    with pytest.raises(ControlError, match="missing or wrong token"):
        ControlClient(client.endpoint, "f" * 64).swap_dir(good_dir)
    reply = client.send_raw([json.dumps({"command": "swap", "args": {"dir": str(good_dir)}}).encode()])
    assert reply == {"ok": False, "error": "refused: missing or wrong token"}
    assert "malformed request" in client.send_raw([b"{not json"])["error"]
    assert "must be a JSON object" in client.send_raw([b"[1, 2]"])["error"]
    with pytest.raises(ControlError, match="unknown command 'explode'"):
        client.request("explode")
    with pytest.raises(ControlError, match="args must be a JSON object"):
        client.request("swap", [1])  # type: ignore[arg-type]
    with pytest.raises(ControlError, match="2 tensor specs but 1 buffers"):
        client.request("swap", {"tensors": [{"name": "a"}, {"name": "b"}], "config": {}, "version": 1,
                                "digest": "x"}, [b"\0"])

    assert stream.join() == expected
    assert server.engine.head is live_head and server.engine.head_version == live_version
    info = client.info()
    assert info["head_version"] == live_version and info["control"]["refused"] >= len(bad) + 3
    assert info["rounds_failed"] == 0


def test_good_swap_lands_between_rounds_and_rollback_is_exact(served, client, smol_fp32, plain_output):
    server, http, run_dir, rounds = served
    ids, expected = plain_output
    old_head, old_version = server.engine.head, server.engine.head_version
    old_weights = {k: v.clone() for k, v in head_tensors(old_head).items()}
    new = new_head(smol_fp32, seed=5)
    digest = save_head(new, run_dir / "heads" / "v5", version=5, parent=old_version)

    stream = Stream(http.url, ids)
    n_before = len(rounds)
    reply = client.swap_dir(run_dir / "heads" / "v5", digest=digest)
    assert reply["landed"] and reply["version"] == 5 and reply["previous_version"] == old_version
    assert stream.join() == expected  # the stream spanned the swap, output unchanged
    assert client.info()["head_version"] == 5
    after = rounds[n_before:]
    swapped = [r for r in after if r.swapped]
    assert len(swapped) == 1 and swapped[0].head_version == 5
    i = after.index(swapped[0])
    assert all(r.head_version == old_version for r in after[:i])
    assert all(r.head_version == 5 for r in after[i:])
    live = head_tensors(server.engine.head)
    assert all(torch.equal(live[k], v) for k, v in head_tensors(new).items())

    # a rollback that names a version acts only while that version is live: a trainer that judged
    # v5 bad after another swap replaced it must not reinstall v5 (the previous head by then)
    for bad in (4, -1, True, "5"):
        with pytest.raises(ControlError, match="not live|non-negative integer"):
            client.rollback(bad)
    assert server.engine.head_version == 5
    back = client.rollback(5)
    assert back["version"] == old_version and back["rollback"] and back["landed"]
    assert server.engine.head is old_head and server.engine.head_version == old_version
    restored = head_tensors(server.engine.head)
    assert all(torch.equal(restored[k], v) for k, v in old_weights.items())
    with pytest.raises(ControlError, match="v5 is not live"):
        client.rollback(5)  # v5 is the previous head now: named, it is not brought back
    assert server.engine.head is old_head


def test_round_clock_counts_the_steady_rounds_per_shape(served, client, plain_output):
    """What a colocated trainer's serving budget reads (trainer/slack.py): every steady round (no
    prefill, capture or swap inside) counted under its shape, with its seconds; cumulative."""
    server, http, run_dir, rounds = served
    ids, expected = plain_output
    before = client.round_clock()
    n_before = len(rounds)
    assert Stream(http.url, ids).join() == expected
    after = client.round_clock()
    assert after["rounds"] - before["rounds"] == len(rounds) - n_before  # idle now: every round observed
    steady: dict = {}
    for r in rounds[n_before:]:
        if not (r.admitted or r.draft_captures or r.verify_captures or r.swapped or r.swap_fill_rows):
            cell = steady.setdefault((r.batch_size, r.num_draft_tokens or r.num_steps + 1, r.topk), [0, 0.0])
            cell[0] += 1
            cell[1] += r.total_s - r.catchup_s
    was = {tuple(c[:3]): c[3:] for c in before["cells"]}
    grown = {tuple(c[:3]): [c[3] - was.get(tuple(c[:3]), [0, 0.0])[0], c[4] - was.get(tuple(c[:3]), [0, 0.0])[1]]
             for c in after["cells"]}
    grown = {k: v for k, v in grown.items() if v[0]}
    assert steady and grown.keys() == steady.keys()
    for key, (n, secs) in steady.items():
        assert grown[key][0] == n and grown[key][1] == pytest.approx(secs, abs=1e-5)
    assert sum(n for n, _ in steady.values()) < len(rounds) - n_before  # the prefill round is left out


def test_inline_tensor_swap_and_set_adaptive(served, client, smol_fp32):
    server = served[0]
    cfg, tensors = good_parts(smol_fp32, seed=8)
    with pytest.raises(ControlError, match="digest mismatch"):
        client.request("swap", {"config": cfg, "tensors": [{"name": "fc.weight", "dtype": "float32",
                                                            "shape": list(tensors["fc.weight"].shape)}],
                                "version": 8, "digest": "0" * 64}, [tensors["fc.weight"].view(torch.uint8).numpy()])
    reply = client.swap_tensors(tensors, cfg, version=8)
    assert reply["landed"] and server.engine.head_version == 8
    live = head_tensors(server.engine.head)
    assert all(torch.equal(live[k], v) for k, v in tensors.items())

    with pytest.raises(ControlError, match="candidate_steps"):
        client.set_adaptive({"1": {"up_hysteresis": 0}})
    with pytest.raises(ControlError, match="max_steps is 7"):
        client.set_adaptive({"1": {"candidate_steps": [1, 9]}})
    assert type(server.engine.policy).__name__ == "StaticSteps"
    res = client.set_adaptive({"1": {"candidate_steps": [1, 2, 3]}, "ema_alpha": 0.3})
    assert res["config"]["1"]["candidate_steps"] == [1, 2, 3]
    for _ in range(1000):
        if not server.engine.has_pending:
            break
        threading.Event().wait(0.005)
    assert type(server.engine.policy).__name__ == "EmaTierPolicy"
    assert server.engine.policy.config.slots[0].ema_alpha == 0.3


def test_cli_swap_rollback_status_end_to_end(served, smol_fp32, capsys):
    server, _, run_dir, _ = served
    save_head(new_head(smol_fp32, seed=11), run_dir / "heads" / "v11", version=11)
    before = server.engine.head_version
    assert cli_main(["swap", str(run_dir / "heads" / "v11"), "--run-dir", str(run_dir)]) == 0
    assert "swapped in version 11" in capsys.readouterr().out
    assert server.engine.head_version == 11
    assert cli_main(["status", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "head version      11" in out and f"(previous {before})" in out
    assert cli_main(["status", "--run-dir", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["control"]["live"]["version"] == 11
    assert cli_main(["rollback", "--run-dir", str(run_dir)]) == 0
    assert f"rolled back to version {before}" in capsys.readouterr().out
    assert server.engine.head_version == before
    assert cli_main(["swap", "/etc", "--run-dir", str(run_dir)]) == 1
    assert "outside the allowed roots" in capsys.readouterr().err
    bad_token = run_dir / "wrong.token"
    bad_token.write_text("0" * 64)
    assert cli_main(["status", "--run-dir", str(run_dir), "--token-file", str(bad_token)]) == 1
    assert "wrong token" in capsys.readouterr().err
    # --sglang drives an SGLang server instead (serving.sglang_client); nothing listens on port 9
    assert cli_main(["swap", str(run_dir / "heads" / "v11"), "--sglang", "--server", "http://127.0.0.1:9"]) == 1
    assert "error:" in capsys.readouterr().err


def test_cli_swaps_the_packaged_code_head_and_rolls_back_losslessly(served, plain_output, capsys):
    """Issue 31: `online-spec swap online_spec/pretrained/code-h100` on the embedded server. The
    packaged heads' directory is an allowed root, and the code head brings its own draft
    vocabulary map (it differs from the live head's), which the engine drafts through."""
    server, http, run_dir, _ = served
    ids, expected = plain_output
    before, before_version = server.engine.head, server.engine.head_version
    code = PRETRAINED_HEADS / "code-h100"
    stream = Stream(http.url, ids)
    assert cli_main(["swap", str(code), "--run-dir", str(run_dir)]) == 0
    assert "swapped in version 0" in capsys.readouterr().out
    live = server.engine.head
    assert live is not before and not torch.equal(live.d2t.cpu(), before.d2t.cpu())
    assert stream.join() == expected
    assert Stream(http.url, ids).join() == expected  # drafted by the code head from its first round
    assert server.info()["internal_states"][0]["head_version"] == 0
    assert cli_main(["rollback", "--run-dir", str(run_dir)]) == 0
    assert f"rolled back to version {before_version}" in capsys.readouterr().out
    assert server.engine.head is before and Stream(http.url, ids).join() == expected
