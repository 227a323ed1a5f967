"""`online-spec train --ranks 2` on CPU (gloo), the multi-GPU layout with real parts: the real
launcher, real DeepSpeed (ZeRO-1), a real ZMQ capture stream from a real `CapturePublisher`, the
real server's control endpoint (a tiny target, in this process) taking the swaps.

One run, then a restart:
- both ranks step; what each rank trained on each step is exactly what rank 0 dealt it, and the
  ranks' rows add up to the step's; every published request reaches rank 0's buffer once
- rank 0 alone publishes: the server's swaps are the versions rank 0 journaled, one each
- the weights stay identical across ranks (their digests at every step)
- kill -9 of rank 1: the launcher stops rank 0 and exits 1; the same command again resumes at
  the committed step (both ranks) and trains on
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from collector.publisher import CapturePublisher, PublisherConfig
from online_spec.capture import CaptureRecord
from online_spec.head import new_head
from online_spec.target import load_target
from serving.control import ControlClient, ControlConfig
from serving.engine import EngineConfig
from serving.server import ServerConfig, SpecServer
from tests.distill_helpers import greedy_records, tiny8

REPO = Path(__file__).resolve().parents[1]
NUM_REQUESTS = 12
PROMPT_ROWS = 8


def save_target_dir(target, path: Path) -> Path:
    """The tiny target as a Hugging Face model directory (`--target`), with a word-level
    tokenizer over its vocabulary (the trainer never tokenizes; loading wants one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target.hf.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(target.info.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    last = f"t{target.info.vocab_size - 1}"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=last, pad_token=last).save_pretrained(path)
    return path


def served_records(rec: CaptureRecord, num_steps: int = 3) -> list[CaptureRecord]:
    """A teacher-forced sequence as the engine streams it: a prefill record of its prompt, then
    verify rounds in which the head drafted the target's own tokens (all K accepted; the last,
    shorter round rejects its last draft)."""
    out = [CaptureRecord(request_id=rec.request_id, first_pos=0, tokens=rec.tokens[:PROMPT_ROWS + 1],
                         features=rec.features[:PROMPT_ROWS], final_hidden=rec.final_hidden[:PROMPT_ROWS],
                         is_prefill=True)]
    lo = PROMPT_ROWS
    while lo < rec.num_rows:
        hi = min(lo + num_steps + 1, rec.num_rows)
        accept = hi - lo - 1
        drafts = rec.tokens[lo + 1:lo + 1 + num_steps].clone()
        if accept < num_steps:
            drafts = torch.cat([rec.tokens[lo + 1:hi], torch.zeros(num_steps - accept, dtype=torch.long)])
            drafts[accept] = (int(rec.tokens[hi]) + 1) % 512  # the rejected draft
        out.append(CaptureRecord(request_id=rec.request_id, first_pos=lo, tokens=rec.tokens[lo:hi + 1],
                                 features=rec.features[lo:hi], final_hidden=rec.final_hidden[lo:hi],
                                 draft_tokens=drafts, draft_probs=torch.full((num_steps,), 0.5),
                                 accept_len=accept, num_steps=num_steps, batch_size=1))
        lo = hi
    return out


def read_journal(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / "ranks" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def state_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not running
    return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower() if Path(f"/proc/{pid}").exists() else False


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs: the ranks on cuda:0 and cuda:1, NCCL")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_two_ranks_one_stream_one_publisher_kill_9_and_resume(tmp_path, device):
    """On CPU: gloo. On 2 GPUs: NCCL for the gradients (the micro-batches over gloo, pinned on arrival)."""
    target = tiny8()
    target_dir = save_target_dir(target, tmp_path / "target")
    recs, _ = greedy_records(target, num=NUM_REQUESTS, prompt_len=PROMPT_ROWS, new_tokens=40)
    server = SpecServer(ServerConfig(engine=EngineConfig(max_batch=2, max_len=256, num_steps=3),
                                     control=ControlConfig(run_dir=str(tmp_path / "serve"),
                                                           allowed_roots=str(tmp_path))),
                        load_target(target_dir, dtype=torch.float32), new_head(target, seed=5), head_version=0)
    server.start()
    endpoint = f"ipc://{tmp_path}/capture.sock"
    pub = CapturePublisher(PublisherConfig(endpoint=endpoint, queue_size=10_000))
    run_dir = tmp_path / "trainer"
    cmd = [sys.executable, "-m", "online_spec.cli", "train", "--ranks", "2", "--target", str(target_dir),
           "--run-dir", str(run_dir), "--capture-endpoint", endpoint, "--capture-idle-timeout-s", "2",
           "--control-run-dir", str(tmp_path / "serve"), "--distill-deepspeed-config", "configs/deepspeed/zero1.json",
           "--distill-lr", "3e-3", "--distill-warmup-steps", "0", "--loss-ttt-steps", "2",
           "--batch-tokens", "96", "--min-buffer-tokens", "48", "--save-every-steps", "1",
           "--eval-every-steps", "2", "--eval-every-s", "1000", "--eval-tokens", "200", "--eval-max-steps", "2",
           "--gate-margin-rel", "0", "--gate-margin-abs", "0", "--gate-min-anchors", "8",
           "--replay-heldout-every", "3", "--replay-flush-interval-s", "0.1",
           "--rank-check-every", "1", "--rank-journal", "--rank-stop-grace-s", "5",
           "--wandb-mode", "disabled", "--threads", "1", "--device", device]
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | {
        "PYTHONPATH": os.pathsep.join([str(REPO)] + [x for x in [os.environ.get("PYTHONPATH")] if x]),
        "OMP_NUM_THREADS": "1"} | ({"DS_ACCELERATOR": "cpu"} if device == "cpu" else {})
    proc = None
    try:
        # 1) the first run: records published once the subscriber (rank 0) is connected
        log1 = open(tmp_path / "run1.log", "w")
        proc = subprocess.Popen(cmd + ["--max-seconds", "300"], cwd=REPO, env=env, stdout=log1,
                                stderr=subprocess.STDOUT)
        assert pub.wait_for_subscriber(180), (tmp_path / "run1.log").read_text()[-3000:]
        for rec in recs:
            pub.submit(served_records(rec))
            pub.end_request(rec.request_id)
        assert pub.drain(30)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (state_step(run_dir) >= 6 and read_journal(run_dir, 1)
                                                   and any("published" in x for x in read_journal(run_dir, 0))):
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            time.sleep(0.5)
        pids = json.loads((run_dir / "ranks" / "launch.json").read_text())["pids"]
        os.kill(pids[1], signal.SIGKILL)
        rc = proc.wait(60)
        log_text = (tmp_path / "run1.log").read_text()
        assert rc == 1, log_text[-3000:]
        assert "rank 1 was killed by signal 9" in log_text
        time.sleep(0.5)
        assert not alive(pids[0]), "rank 0 outlived the run"
        before = json.loads((run_dir / "state.json").read_text())
        j0, j1 = read_journal(run_dir, 0), read_journal(run_dir, 1)
        tokens = {r.request_id: r.tokens for r in recs}

        # both ranks stepped, in step: the same steps, the same weights after each
        assert before["step"] >= 6, log_text[-3000:]
        steps1 = {line["step"]: line for line in j1}
        assert len(steps1) >= 5
        for line in j0:
            if line["step"] not in steps1:  # rank 1 was killed before it wrote this step
                assert line["step"] == j0[-1]["step"]
                continue
            other = steps1[line["step"]]
            assert line["digest"] == other["digest"], line["step"]
            # what each rank trained on is what rank 0 dealt it, nothing dropped, nothing twice
            assert line["dealt"] == [line["spans"], other["spans"]]
            assert set(line["pipe"]) == {"draw", "read", "pack", "send", "own"}
            assert set(other["pipe"]) == {"recv", "read", "build"} and line["named"] == other["named"]
            assert other["rows"] == sum(n for _, _, n in other["spans"]) and other["rows"] > 0
            assert line["rows"] == sum(n for _, _, n in line["spans"]) and line["rows"] > 0
            # ... and the tensors each rank trained on are those spans' rows
            for j in (line, other):
                assert j["token_sums"] == [int(tokens[rid][pos:pos + n].sum()) for rid, pos, n in j["spans"]]
        assert len({line["digest"] for line in j0}) == len(j0)  # the weights moved every step
        # rank 1 shares rank 0's disk: it reads stored spans by name (those still pending travel:
        # tests/test_trainer_rank_data.py)
        assert "ranks reading the buffer by name: [1]" in log_text
        assert any(x["named"] for x in j1)
        ids = {r.request_id for r in recs}
        trained = [s for line in j0 for part in line["dealt"] for s in part]
        assert {rid for rid, _, _ in trained} <= ids
        assert all(0 <= pos and pos + n <= 47 for _, pos, n in trained)
        # the stream fanned in once: every request is one span in rank 0's buffer
        counters = before["buffer"]["counters"]
        assert counters["received"] == NUM_REQUESTS and counters["malformed"] == 0, counters
        assert pub.stats()["dropped_no_subscriber"] == 0

        # rank 0 alone published, each version once; the server took each of them
        published = [line["published"] for line in j0 if "published" in line]
        assert published and all("published" not in line for line in j1)
        assert published == [p["version"] for p in before["published"]]
        assert server.engine.head_version == before["live_version"] == published[-1]
        info = ControlClient.from_run_dir(tmp_path / "serve").info()
        assert info["control"]["swaps"] == len(published) and info["control"]["refused"] == 0, info["control"]

        # 2) the same command again: both ranks resume at the committed step and train on
        log2 = open(tmp_path / "run2.log", "w")
        proc = subprocess.Popen(cmd + ["--max-steps", str(before["step"] + 2)], cwd=REPO, env=env, stdout=log2,
                                stderr=subprocess.STDOUT)
        assert proc.wait(150) == 0, (tmp_path / "run2.log").read_text()[-3000:]
        log_text = (tmp_path / "run2.log").read_text()
        resumed = {int(r): int(s) for r, s in re.findall(r"trainer\[rank (\d)\] resumed at step (\d+)", log_text)}
        assert resumed == {0: before["step"], 1: before["step"]}, log_text[-3000:]
        after = json.loads((run_dir / "state.json").read_text())
        assert after["step"] == before["step"] + 2
        assert after["buffer"]["counters"]["received"] == NUM_REQUESTS  # the buffer came back from disk
        new0 = [line for line in read_journal(run_dir, 0) if line["time"] > j0[-1]["time"]]
        new1 = [line for line in read_journal(run_dir, 1) if line["time"] > j1[-1]["time"]]
        assert [line["step"] for line in new0] == [line["step"] for line in new1] == \
            [before["step"] + 1, before["step"] + 2]
        assert [line["digest"] for line in new0] == [line["digest"] for line in new1]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pub.close()
        server.close()
