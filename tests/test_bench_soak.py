"""`online-spec bench soak` end to end, short: the real `online-spec serve` (SmolLM2 fp32, the
shipped head) and `online-spec train` child processes, well-formed clients checked against plain
decoding, every hostile input of bench/hostile.py at least once, operator swaps between the
packaged chat and code heads and a rollback, the trainer killed with -9 and restarted, and
SIGTERM at the end. The hour-long figures come from the same command with --duration-s 3600."""

import json

import pytest

from bench.hostile import CONTROL_CASES, HTTP_CASES
from online_spec.cli import main as cli_main

pytestmark = pytest.mark.slow


def test_a_short_soak_holds_every_invariant(tmp_path):
    out = tmp_path / "soak.json"
    # 34 s: two swaps and the rollback by ~20 s (each swap takes a few seconds under this load), the
    # trainer killed at ~12 and ~24 s, the 18 hostile inputs every ~6 s, 11 samples
    rc = cli_main(["bench", "soak", "--duration-s", "34", "--warmup-s", "12", "--clients", "2", "--prompts", "3",
                   "--max-tokens", "12", "--hostile-interval-s", "0.2", "--swap-every-s", "5",
                   "--trainer-restart-every-s", "12", "--sample-every-s", "3", "--max-tags", "2",
                   "--run-dir", str(tmp_path / "run"), "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r["errors"]
    assert r["failed_requests"] == 0 and r["lossless"] and r["greedy_checked"] >= 3, r["errors"]
    assert r["hostile"] >= len(HTTP_CASES) + len(CONTROL_CASES) and r["hostile_unexpected"] == 0, r["errors"]
    assert r["swaps"] >= 2 and r["rollbacks"] >= 1 and r["operator_errors"] == 0, r["errors"]
    assert r["trainer_starts"] >= 2 and r["trainer_kills"] >= 1
    assert r["server"]["rounds_failed"] == 0 and r["server"]["requests_failed"] == 0
    tags = r["server"]["tags"]  # "chat", "code" took the two names; every fresh hostile tag became "other"
    assert tags["known"] == 2 and tags["folded_into_other"] >= 1
    assert r["rss_mb_after_warmup"] > 0 and len(r["samples"]) >= 5
    assert r["server_exit_code"] == 0 and r["run_dir_clean_after_sigterm"]
