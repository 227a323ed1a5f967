"""Probe: the capture sender's encoding per record of one engine round, three ways, warm loop.

A `CaptureRound` of B records (H = 576, bf16 rows, 1-4 rows a record, K = 3 drafts) encoded as
record messages (`collector.wire.encode_round` of its built records: the sender before round
messages), as a round message through built records (`encode_messages(list(round))`), and as a
round message straight from its tensors (`encode_messages(round)`, what the publisher runs now).
The ZMQ sends are not timed. Prints the median of 5 x 200 rounds, microseconds a record.

    python scripts/sender_cost_probe.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import time, torch, statistics
from online_spec.capture import CaptureRound, RoundRow
from collector.wire_round import encode_messages
from collector.wire import encode_round
H=576
for B in (1, 4, 16):
    g=torch.Generator().manual_seed(0)
    rows=[RoundRow(f"req-{b}", 50+b, b, list(range(100+b, 100+b+(b%4)+1)), b%4, 3, "chat") for b in range(B)]
    feats=torch.randn(B*4, 3*H, generator=g).bfloat16(); final=torch.randn(B*4, H, generator=g).bfloat16()
    idx=[b*4+j for b,r in enumerate(rows) for j in range(r.accept_len+1)]
    first=torch.arange(B)+7; drafts=torch.randint(0,1000,(B,3)); probs=torch.rand(B,3)
    mk=lambda: CaptureRound(rows, feats, final, row_index=idx, first_tokens=first, drafts=drafts, draft_probs=probs, batch_size=B, timestamp=1.0)
    res={}
    for name, fn in (("record messages", lambda: encode_round(list(mk()))), ("round via records", lambda: encode_messages(list(mk()))), ("round from tensors", lambda: encode_messages(mk()))):
        for _ in range(50): fn()
        ts=[]
        for _ in range(5):
            t=time.perf_counter()
            for _ in range(200): fn()
            ts.append((time.perf_counter()-t)/200/B*1e6)
        res[name]=round(statistics.median(ts),1)
    print(f"B={B} us a record (median of 5 x 200 rounds):", res)
