"""`CaptureSpan.from_records` builds its per-row arrays on numpy in one pass (collector/span.py):
they must equal, array by array, what each record's own `row_drafts` and round values give, over
random records of every kind (prefill, K = 0, all drafts accepted, some rejected)."""

import random

import torch

from collector.span import PER_ROW, PER_ROW_DTYPES, CaptureSpan
from online_spec.capture import CaptureRecord


def random_records(rng: random.Random, n: int) -> list[CaptureRecord]:
    records, pos, last = [], 0, 5
    for i in range(n):
        prefill = i == 0 and rng.random() < 0.5
        k = 0 if prefill else rng.choice([0, 1, 3, 5])
        a = rng.randint(0, k)
        rows = rng.randint(1, 6) if prefill else a + 1
        tokens = torch.tensor([last] + [rng.randrange(1000) for _ in range(rows)])
        records.append(CaptureRecord(
            request_id="r", first_pos=pos, tokens=tokens, features=torch.randn(rows, 12),
            final_hidden=torch.randn(rows, 4),
            draft_tokens=torch.tensor([rng.randrange(1000) for _ in range(k)]),
            draft_probs=torch.tensor([rng.random() for _ in range(k)], dtype=torch.float32),
            accept_len=a, num_steps=k, batch_size=rng.randint(1, 16), draft_version=rng.randint(0, 9),
            is_prefill=prefill, timestamp=1000.0 + rng.random()))
        pos, last = pos + rows, int(tokens[-1])
    return records


def test_the_spans_rows_are_each_records_own():
    rng = random.Random(5)
    kinds = set()
    for _ in range(200):
        records = random_records(rng, rng.randint(1, 6))
        span = CaptureSpan.from_records(records)
        expected = {name: [] for name in PER_ROW}
        for r in records:
            accepted, draft_token, draft_prob = r.row_drafts()
            n = r.num_rows
            expected["accepted"].append(accepted)
            expected["draft_token"].append(draft_token)
            expected["draft_prob"].append(draft_prob)
            for name in ("num_steps", "batch_size", "draft_version", "is_prefill", "timestamp"):
                expected[name].append(torch.full((n,), getattr(r, name), dtype=PER_ROW_DTYPES[name]))
            kinds.add("prefill" if r.is_prefill else "plain" if r.num_steps == 0 else
                      "all accepted" if r.accept_len == r.num_steps else "rejected")
        for name in PER_ROW:
            got, want = getattr(span, name), torch.cat(expected[name])
            assert got.dtype == PER_ROW_DTYPES[name] and torch.equal(got, want), name
    assert kinds == {"prefill", "plain", "all accepted", "rejected"}
