"""A new user's first commands do the useful thing by default and say what they do.

- `online-spec serve` with no `--draft` serves the shipped chat head and logs which (path,
  version); `--draft day0` serves a random head and says so.
- every bench resolves heads by the one rule (`shipped`, `code`, `day0`, a path): no default
  depends on a cache an earlier run creates.
- `serve --help` and `train --help` come in one group per config dataclass, one short line per
  flag; docs/flags.md keeps every flag's whole text.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from online_spec.cli import BENCHES, _build_parser
from online_spec.config import short_help
from online_spec.heads import CODE_HEAD, SHIPPED_HEAD, describe_head, resolve_head_dir

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_up(extra: list[str], run_dir: Path, timeout_s: float = 180.0) -> str:
    """Start the real `online-spec serve`, return its log up to the 'serving ... on http' line, stop it."""
    cmd = [sys.executable, "-m", "online_spec.cli", "serve", "--port", str(_free_port()), "--run-dir", str(run_dir),
           "--no-drift-monitor", "--threads", "1", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    up = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "serving " in line and " on http" in line:
                up.set()
        up.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    try:
        up.wait(timeout_s)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return "".join(lines)


def test_serve_without_draft_serves_the_shipped_head_and_day0_says_so(tmp_path):
    logs = {}

    def run(name, extra):
        logs[name] = _serve_until_up(extra, tmp_path / name)

    threads = [threading.Thread(target=run, args=("default", [])),
               threading.Thread(target=run, args=("day0", ["--draft", "day0"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    default, day0 = logs["default"], logs["day0"]
    assert " on http" in default and " on http" in day0, (default[-2000:], day0[-2000:])
    assert f"draft head: shipped chat head {SHIPPED_HEAD} (version 0" in default
    assert "random day-0 head" not in default
    assert "draft head: a random day-0 head (--draft day0)" in day0 and str(SHIPPED_HEAD) in day0


def test_head_names_resolve_without_bench(tmp_path):
    assert resolve_head_dir("shipped") == str(SHIPPED_HEAD)
    assert resolve_head_dir("code") == str(CODE_HEAD)
    assert resolve_head_dir("day0") == "" and resolve_head_dir("") == ""
    from online_spec.config import ConfigError
    with pytest.raises(ConfigError, match="^draft: 'nowhere' is none of"):
        resolve_head_dir("nowhere", "draft")
    assert describe_head(str(CODE_HEAD), {"version": 3}).startswith(f"packaged code head {CODE_HEAD} (version 3")
    # serving resolves heads without climbing to bench/ (layers import only downward)
    src = (REPO / "serving" / "server.py").read_text()
    assert "from online_spec.heads import" in src and not re.search(r"^\s*(from|import) bench\b", src, re.M)


def _bench_parser(name: str) -> argparse.ArgumentParser:
    parser = _build_parser(["bench", name])
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_head_default_resolves_on_a_fresh_machine(name, tmp_path, monkeypatch):
    """No bench's default head may be a cache directory an earlier run creates: with an empty
    cache, each default resolves by the one rule (bench distill's used to be ~/.cache/.../sharegpt-100k)."""
    from bench.heads import resolve_head

    monkeypatch.setenv("ONLINE_SPEC_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    parser = _bench_parser(name)
    # a flag from a config dataclass keeps its default on the action (argparse's is SUPPRESS)
    heads = {a.dest: getattr(a, "doc_default", a.default) for a in parser._actions
             if a.dest in ("head", "draft", "reference")}
    for dest, default in heads.items():
        resolved = resolve_head("" if default is None else str(default))  # ConfigError for a missing directory
        assert str(tmp_path) not in resolved, (dest, resolved)
    if name == "distill":
        assert heads == {"head": "shipped"} and resolve_head(heads["head"]) == str(SHIPPED_HEAD)


def test_short_help_keeps_the_first_clause():
    assert short_help("TCP port") == "TCP port"
    assert short_help("K policy: auto (ema with --adaptive, else static), static (K = --num-steps), ema (SGLang's "
                      "EMA tiers over --adaptive), cost (the cost-model policy; calibrated at start)") == \
        "K policy: auto, static, ema, cost"
    long = "rounds per block of the batch-means dispersion: consecutive rounds share their requests " * 2
    assert short_help(long) == "rounds per block of the batch-means dispersion"
    assert len(short_help("word " * 40)) <= 72 and short_help("word " * 40).endswith("…")


def _help(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "online_spec.cli", command, "--help"], capture_output=True,
                          text=True, env=env, cwd=REPO, check=True, timeout=300).stdout


def _flag_blocks(text: str) -> dict[str, int]:
    """flag -> lines its entry takes in --help."""
    blocks: dict[str, int] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"^  (--[\w-]+)", line)
        if m:
            flag = m.group(1)
            blocks[flag] = 1
        elif flag and line.startswith("      "):
            blocks[flag] += 1
        else:
            flag = None
    return blocks


def test_serve_and_train_help_are_grouped_and_short():
    out = {}
    threads = [threading.Thread(target=lambda c=c: out.__setitem__(c, _help(c))) for c in ("serve", "train")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    serve, train = out["serve"], out["train"]
    for group in ("server (ServerConfig):", "engine (EngineConfig):", "drift (DriftConfig, --drift-*):",
                  "publisher (PublisherConfig, --capture-*):", "control (ControlConfig):"):
        assert f"\n{group}\n" in serve, group
    for group in ("daemon (DaemonConfig):", "gate (GateConfig, --gate-*):", "distill (DistillConfig, --distill-*):",
                  "replay (ReplayConfig, --replay-*):"):
        assert f"\n{group}\n" in train, group
    for text in (serve, train):
        assert text.splitlines()[0].endswith("[-h] [options]")  # not a page of usage
        assert "docs/flags.md" in text
        blocks = _flag_blocks(text)
        assert len(blocks) > 40
        assert max(blocks.values()) <= 3, [f for f, n in blocks.items() if n > 3]
    assert len(serve.splitlines()) < 180 and len(train.splitlines()) < 200
    assert "--engine " not in serve  # a nested config gets its own group, not a JSON flag
    flags_doc = (REPO / "docs" / "flags.md").read_text()
    for flag in set(_flag_blocks(serve)) | set(_flag_blocks(train)):
        assert f"`{flag}`" in flags_doc, f"{flag} missing from docs/flags.md: run python scripts/flag_docs.py"
    assert "reused while target, dtype, device, CPU and threads match" in flags_doc  # the whole --policy text
    assert "reused while" not in serve



def test_load_draft_gives_day0_and_says_what_to_do_when_a_packaged_head_does_not_fit(tiny):
    from online_spec.config import ConfigError
    from online_spec.heads import load_draft

    head, meta, path = load_draft("day0", tiny)
    assert path == "" and meta == {} and head is not None
    with pytest.raises(ConfigError, match=r"^draft: the shipped head was trained for SmolLM2-135M-Instruct and does "
                                          r"not fit this target .*; pass --draft with a head of this target, or "
                                          r"--draft day0$"):
        load_draft("shipped", tiny)
