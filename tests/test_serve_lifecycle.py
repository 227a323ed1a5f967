"""`online-spec serve` as a user runs it, in a subprocess: control commands answer fast and load
no torch, and SIGTERM leaves nothing behind (issues 31 and 32).

The served model is a tiny random Llama saved as a Hugging Face directory with SmolLM2's
tokenizer (`--target DIR`); everything else is the real command: uvicorn, the engine thread, the
control endpoint, the capture publisher on its default socket in the run directory.
- `online-spec status | swap | rollback` answer in well under a second (asserted loosely: < 3 s
  each) and `python -X importtime` shows that the command imports neither torch nor the model;
- the run directory is 0700 and the capture socket 0600; after SIGTERM the server exits 0 and
  control.token, control.endpoint, control.sock and capture.sock are gone.
"""

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from online_spec.checkpoint import save_head
from online_spec.head import new_head
from online_spec.target import tiny_target

REPO = Path(__file__).resolve().parents[1]
CONTROL_BOUND_S = 3.0  # loose bound for a control command (issue 31: "well under a second")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, importtime=False) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-m", "online_spec.cli", *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return out, time.perf_counter() - t0


def imported_modules(importtime_stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.fixture(scope="module")
def tiny_dir(smol, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    target = tiny_target(vocab_size=smol.info.vocab_size, hidden_size=64, num_layers=4, tokenizer=smol.tokenizer)
    target.hf.save_pretrained(d)
    smol.tokenizer.save_pretrained(d)
    return d, target


def test_control_commands_are_fast_and_sigterm_leaves_nothing_behind(tiny_dir, tmp_path):
    model_dir, target = tiny_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "online_spec.cli", "serve", "--target", str(model_dir),
                             "--port", str(port), "--run-dir", str(run_dir), "--draft", "day0", "--capture", "--dtype", "float32",
                             "--max-len", "256", "--max-batch", "4", "--log-level", "warning", "--threads", "1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        files = {"control.token", "control.endpoint", "control.sock", "capture.sock"}
        assert files <= set(os.listdir(run_dir))
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run_dir / "capture.sock").st_mode) == 0o600

        out, took = cli("status", "--run-dir", str(run_dir))
        assert out.returncode == 0 and "head version      0" in out.stdout, out.stderr
        assert took < CONTROL_BOUND_S, took
        out, _ = cli("status", "--run-dir", str(run_dir), importtime=True)
        mods = imported_modules(out.stderr)
        assert "serving.control_client" in mods  # the listing is real
        assert not {m for m in mods if m == "torch" or m.startswith(("torch.", "transformers"))}

        save_head(new_head(target, draft_vocab_size=2048, seed=4), run_dir / "heads" / "v5", version=5)
        out, took = cli("swap", str(run_dir / "heads" / "v5"), "--run-dir", str(run_dir))
        assert out.returncode == 0 and "swapped in version 5 (previous 0)" in out.stdout, out.stderr
        assert took < CONTROL_BOUND_S, took
        out, took = cli("rollback", "--run-dir", str(run_dir))
        assert out.returncode == 0 and "rolled back to version 0" in out.stdout, out.stderr
        assert took < CONTROL_BOUND_S, took

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not files & set(os.listdir(run_dir)), os.listdir(run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
