"""Self-distilled ShareGPT/HumanEval spans for the recipe probes: the target's own greedy replies.

    PYTHONPATH=. python scripts/gen_selfdistill.py --split train --out /tmp/probe/gen-train --tokens 60000
Spans are saved every --every spans into OUT/part-NNNN (collector span shards), so a probe can
start on what exists while generation continues."""
import argparse, time
import torch
from collector.shards import save_spans
from online_spec.data import humaneval_conversations, sharegpt_conversations
from online_spec.target import load_target
from trainer.data import generate_records

ap = argparse.ArgumentParser()
ap.add_argument("--data", default="sharegpt"); ap.add_argument("--split", default="train")
ap.add_argument("--out", required=True); ap.add_argument("--tokens", type=int, default=60000)
ap.add_argument("--max-new", type=int, default=256); ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--every", type=int, default=16); ap.add_argument("--skip", type=int, default=0)
a = ap.parse_args()
torch.set_num_threads(int(__import__("os").environ.get("THREADS", "1")))
t = load_target(dtype=torch.bfloat16)
if a.data == "sharegpt":
    convs = sharegpt_conversations(split=a.split, max_prompt_tokens=256, tokenizer=t.tokenizer)
else:
    convs = humaneval_conversations(split=a.split)
prompts = [t.encode_chat(c[:1]) for c in convs][a.skip:]
buf, part, n, t0 = [], 0, 0, time.time()
for s in generate_records(t, prompts, a.max_new, tag=a.data, id_prefix=f"{a.data}-{a.split}-gen", max_batch=a.batch,
                          max_tokens=a.tokens):
    buf.append(s); n += s.num_rows
    if len(buf) >= a.every:
        save_spans(buf, f"{a.out}/part-{part:04d}"); part += 1; buf = []
        print(f"{n} rows {time.time()-t0:.0f}s {n/(time.time()-t0):.0f} rows/s", flush=True)
if buf:
    save_spans(buf, f"{a.out}/part-{part:04d}")
print(f"done {n} rows {time.time()-t0:.0f}s", flush=True)
