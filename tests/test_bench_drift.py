"""`online-spec bench drift-alerts` end to end, in a tiny configuration.

The real SmolLM2 behind the real server over HTTP, real ShareGPT then HumanEval prompts, a real
offline W&B run read back from its files. The one stand-in is the head: no trained head exists
in tests, and a random one accepts nothing on either phase, so no drop could be seen.
`BigramHead` drafts, for the token it is given, the successor that token had in the target's
own greedy answers to the stationary phase's prompts — a head that is good on that traffic and
poor on code, which is the shape of a ShareGPT-trained head meeting HumanEval.
"""

import json
from collections import Counter, defaultdict

import torch

from bench.common import write_report
from online_spec.drift import DriftConfig
from online_spec.head import EagleHead, new_head
from online_spec.sampling import SamplingParams
from bench.drift_alerts import REPORT_KEYS, DriftBenchConfig, load_prompts, measure
from serving.engine import Engine, EngineConfig


class BigramHead(EagleHead):
    """Drafts table[token] for each token whose embedding it is given; other tokens get draft id 0."""

    def set_table(self, target, table: dict[int, int]) -> "BigramHead":
        keys = torch.tensor(sorted(table))
        draft_index = self.t2d.long().cumsum(0) - 1  # target id -> draft id (for ids in the draft vocab)
        self.register_buffer("keys", target.embed_tokens(keys).detach().float().clone())
        self.register_buffer("next_draft", draft_index[torch.tensor([table[k] for k in keys.tolist()])])
        return self

    def forward(self, embeds, hidden, cos, sin, attend):
        B, T, H = embeds.shape
        # exact distances: cdist's default matrix-product path puts equal rows ~1e-3 apart
        # (sqrt of the rounding error of |a|^2 + |b|^2 - 2ab), which is what the old 1e-3 match
        # missed; the engine hands the head the embedding rows exactly
        dist, idx = torch.cdist(embeds.float().reshape(B * T, H), self.keys.float(),
                                compute_mode="donot_use_mm_for_euclid_dist").min(-1)
        hit = dist < 1e-4
        logits = torch.zeros(B * T, self.cfg.draft_vocab_size, dtype=embeds.dtype, device=embeds.device)
        logits[hit.nonzero()[:, 0], self.next_draft[idx[hit]]] = 10.0
        return logits.view(B, T, -1), torch.zeros(B, T, self.cfg.hidden_size, dtype=embeds.dtype)


def bigram_head(target, prompts: list[list[int]], max_tokens: int) -> BigramHead:
    outs = Engine(target, None, EngineConfig(max_batch=len(prompts), max_len=512, num_steps=0, max_steps=0)) \
        .generate(prompts, SamplingParams(max_tokens=max_tokens))
    successors = defaultdict(Counter)
    for p, out in zip(prompts, outs):
        seq = [p[-1]] + out
        for a, b in zip(seq, seq[1:]):
            successors[a][b] += 1
    table = {a: c.most_common(1)[0][0] for a, c in successors.items()}
    counts = torch.zeros(target.info.vocab_size)
    counts[:2048] = 1
    counts[list(table.values())] = 2  # every successor is in the draft vocabulary
    base = new_head(target, draft_vocab_size=2048, token_counts=counts)
    head = BigramHead(base.cfg)
    head.load_state_dict(base.state_dict())
    head.set_vocab_map(base.d2t, base.t2d)
    return head.set_table(target, table).to(target.dtype)


def test_bench_runs_end_to_end_and_reads_the_alert_back(smol_fp32, tmp_path):
    cfg = DriftBenchConfig(clients=2, num_steps=3, stationary_rounds=16, min_switch_rounds=4, max_switch_rounds=100,
                           max_tokens=16, max_prompt_tokens=128, prompts=4, max_len=512, time_limit_s=120,
                           work_dir=str(tmp_path))
    # a short warm-up, a low threshold and no cooldown (a chance change alert in 16 stationary
    # rounds must not mute the drop): tiny settings for speed, not the calibrated defaults
    drift = DriftConfig(warmup_rounds=6, warmup_requests=10, reference_requests=30, threshold=6.0, cooldown_rounds=0,
                        block_rounds=3)
    chat, _ = load_prompts(cfg, smol_fp32.tokenizer)
    head = bigram_head(smol_fp32, [smol_fp32.encode_chat(m) for m in chat], cfg.max_tokens)

    figures = measure(cfg, drift, smol_fp32, head, rounds_out=tmp_path / "drift.rounds.jsonl")
    report = write_report(tmp_path / "drift.json", {**figures, "head": "bigram stand-in", "quick": True,
                                                    "note": "test"})

    written = json.loads((tmp_path / "drift.json").read_text())
    assert written == json.loads(json.dumps(report, default=str))
    assert set(REPORT_KEYS) <= set(written), set(REPORT_KEYS) - set(written)
    assert written["failed_requests"] == 0
    assert written["stationary_rounds"] >= cfg.stationary_rounds and written["switch_round"] == written["stationary_rounds"]
    assert written["meets_stationary_round_requirement"] is False
    assert written["accept_len_before"] > written["accept_len_after"] + 0.5  # the stand-in is good on A only
    refs = written["detector_references_at_switch"]
    assert refs and all(0 < r["reference_accept_len"] <= cfg.num_steps and r["min_effect_drafts"] >= 0.1
                        for r in refs.values())
    busiest = max(refs.values(), key=lambda r: r["rounds"])  # learned on the stationary traffic
    assert abs(busiest["reference_accept_len"] - written["accept_len_before"]) < 0.5
    # the drop is found, counted from the switch, and read back from the offline W&B run
    first = written["first_drop_alert"]
    assert first is not None and first["phase"] == "switched"
    assert written["rounds_to_alert"] == first["round_index"] - written["switch_round"] + 1 >= 1
    assert written["rounds_to_alert"] <= cfg.max_switch_rounds
    assert written["alert_in_wandb_offline_run"] is True
    row = written["wandb_alert"]
    assert row["kind"] == "drop" and row["round"] == first["round"] and row["before"] > row["after"]
    assert written["false_alerts"] == len(written["phases"]["stationary"]["alerts"])
    # every round the detector saw is in the trace, and replaying it offline raises the live alerts
    lines = [json.loads(x) for x in (tmp_path / "drift.rounds.jsonl").read_text().splitlines()]
    assert len(lines) == written["stationary_rounds"] + written["switched_rounds"]
    assert [x["phase"] for x in lines].count("switched") == written["switched_rounds"]
    assert all(len(x["request_ids"]) == len(x["accepted"]) == x["batch_size"] for x in lines)
    assert written["rounds_trace_replay"] == {"alerts": len(written["phases"]["stationary"]["alerts"]) +
                                              len(written["phases"]["switched"]["alerts"]), "matches_live": True}


def test_shift_is_checked():
    import pytest
    from online_spec.config import ConfigError

    assert DriftBenchConfig().shift == "sharegpt-humaneval"
    DriftBenchConfig(shift="humaneval-sharegpt")
    with pytest.raises(ConfigError, match="shift"):
        DriftBenchConfig(shift="chat-code")
