"""Pretrain EAGLE-3 heads for SmolLM2 on one GPU with the project's own loss and data path.

The CPU here trains ~100-200 rows/s, far from the millions of token-steps a head needs, so the
heads the benchmarks use are pretrained on a lent H100/H200 with this script (docs/distill.md
says which figures used them). Same pieces as `online-spec pretrain`: self-distillation (the
target's own greedy replies to training prompts), `trainer.data.capture_tokens` for the
features, `trainer.loss.ttt_loss`, `trainer.evaluate.simulate_acceptance` on held-out
conversations, `online_spec.checkpoint.save_head`. What differs: generation runs through HF
`generate` batched on the GPU, and the optimizer is plain AdamW (no DeepSpeed on that machine).

    python scripts/gpu_pretrain.py --gguf-dir /tmp/gguf --prompts .gpu/prompts.json --out $OUT/heads

A device call lasts at most 10 minutes, so generation and training can run as two calls on the
warm machine: `--seqs /tmp/seqs.json --gen-only` generates and writes the self-distilled
sequences; a second call with the same `--seqs` finds them and only captures and trains.
`--make-prompts PATH` (here, on the CPU) writes the prompts file from the installed datasets.
`--heads` names the heads and the prompt sets each trains on (ShareGPT whole, its chat or its code
conversations, HumanEval); every head, and any `--eval-heads`, is then scored on every held-out
set (simulated accept length over the generated positions).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from collector.span import CaptureSpan
from online_spec.checkpoint import load_head, save_head
from online_spec.head import new_head
from online_spec.target import load_target, prepare_smollm2
from trainer.batch import collate
from trainer.data import capture_tokens
from trainer.evaluate import simulate_acceptance
from trainer.loss import LossConfig, SharedTarget, ttt_loss


def generate(target, prompts: list[list[int]], new_tokens: int, batch: int, seconds: float) -> list[list[int]]:
    """Greedy continuations (prompt + reply) of as many prompts as fit in `seconds`."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 2
    out, t0 = [], time.time()
    for i in range(0, len(prompts), batch):
        if time.time() - t0 > seconds:
            break
        chunk = prompts[i:i + batch]
        T = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, p in enumerate(chunk):  # left padding
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        with torch.inference_mode():
            gen = target.hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=pad)
        for b, p in enumerate(chunk):
            reply = gen[b, T:].tolist()
            if 2 in reply:
                reply = reply[:reply.index(2) + 1]
            out.append(p + reply)
        print(f"generated {len(out)} sequences, {sum(map(len, out))} tokens, {time.time() - t0:.0f}s", flush=True)
    return out


def records_of(target, seqs: list[list[int]], prefix: str, max_len: int = 768,
               prompt_lens: list[int] | None = None):
    """Teacher-forced records of the sequences; with prompt_lens, spans whose rows past the prompt
    are marked generated (what `simulate_acceptance(..., generated_only=True)` anchors on)."""
    recs = []
    for i in range(0, len(seqs), 32):
        chunk = [s[:max_len] for s in seqs[i:i + 32]]
        recs += capture_tokens(target, chunk, [f"{prefix}-{i + j}" for j in range(len(chunk))])
    if prompt_lens is None:
        return recs
    spans = []
    for r, n in zip(recs, prompt_lens):
        span = CaptureSpan.from_records([r])
        span.is_prefill = torch.arange(span.num_rows) < n  # row n holds the first generated token
        spans.append(span)
    return spans


def token_counts(target, seqs: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(target.info.vocab_size)
    for q in seqs:
        counts += torch.bincount(torch.tensor(q), minlength=target.info.vocab_size).float()
    return counts


def train_head(target, train, heldout, minutes: float, lr: float, batch_seqs: int, ttt_steps: int, name: str,
               counts: torch.Tensor):
    """counts: token frequencies the draft vocabulary (the 8192 most frequent) is chosen from."""
    head = new_head(target, 8192, counts).float()
    with torch.no_grad():  # the target's lm_head rows of the draft vocabulary; norm left at 1
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target].float())
    head.train()
    shared = SharedTarget.build(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    cfg = LossConfig(ttt_steps=ttt_steps)
    t0, step, rows = time.time(), 0, 0
    order = list(range(len(train)))
    budget = minutes * 60
    while time.time() - t0 < budget:
        random.shuffle(order)
        for i in range(0, len(order) - batch_seqs + 1, batch_seqs):
            frac = (time.time() - t0) / budget
            if frac >= 1:
                break
            for g in opt.param_groups:  # warmup, then cosine to 10%
                g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            batch = collate([train[j] for j in order[i:i + batch_seqs]]).to("cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, m = ttt_loss(head, batch, shared, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            rows += batch.num_rows
            if step % 100 == 0:
                print(f"[{name}] step {step} rows {rows} loss {m['loss']:.3f} acc0 {m.get('acc_0', 0):.3f} "
                      f"acc1 {m.get('acc_1', 0):.3f} {time.time() - t0:.0f}s", flush=True)
    head.eval()
    sim = simulate_acceptance(head, target, heldout, max_steps=7, ks=(1, 3, 5, 7))
    return head, {"steps": step, "rows_trained": rows, "train_s": time.time() - t0, "simulated": sim}


PROMPT_SETS = ("sharegpt", "sharegpt_chat", "sharegpt_code", "humaneval")


def make_prompts(path: Path, sharegpt_train: int = 12000, sharegpt_heldout: int = 128) -> None:
    """The prompts file: first turns of ShareGPT train/held-out conversations (the project's hash
    split) — all of them, the chat ones and the code ones (`online_spec.data.is_code_conversation`)
    — and HumanEval tasks split the same way (needs the dataset packages)."""
    from online_spec.data import humaneval_conversations, sharegpt_conversations
    from online_spec.target import load_target

    tok = load_target().tokenizer
    out = {}
    for name, topic in (("sharegpt", "all"), ("sharegpt_chat", "chat"), ("sharegpt_code", "code")):
        out[name] = {split: [c[:1] for c in sharegpt_conversations(limit=n, split=split, max_prompt_tokens=300,
                                                                   tokenizer=tok, topic=topic)]
                     for split, n in (("train", sharegpt_train), ("heldout", sharegpt_heldout))}
    out["humaneval"] = {split: [c[:1] for c in humaneval_conversations(split=split)] for split in ("train", "heldout")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print({k: {s: len(v) for s, v in d.items()} for k, d in out.items()})


def parse_heads(spec: str) -> list[tuple[str, list[str], float, list[str]]]:
    """"chat=sharegpt_chat:6:sharegpt,code=sharegpt_code+humaneval:4" -> [(name, prompt sets, minutes,
    vocabulary sets)]: the draft vocabulary comes from the third field's sets (default: the training
    sets). The vocabulary is the one thing the online trainer cannot change (a swap keeps it), so a
    head meant to follow drifting traffic may take it from a broader set than it trains on."""
    heads = []
    for item in filter(None, spec.split(",")):
        name, rest = item.split("=")
        sets, minutes, *vocab = rest.split(":")
        vocab = vocab[0] if vocab else sets
        unknown = (set(sets.split("+")) | set(vocab.split("+"))) - set(PROMPT_SETS)
        if unknown:
            raise SystemExit(f"--heads: unknown prompt sets {sorted(unknown)} (known: {PROMPT_SETS})")
        heads.append((name, sets.split("+"), float(minutes), vocab.split("+")))
    return heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-prompts", type=Path, default=None)
    ap.add_argument("--gguf-dir", type=Path)
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gen-seconds", type=float, default=240, help="per training prompt set")
    ap.add_argument("--heldout-seconds", type=float, default=60, help="per held-out prompt set")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seqs", type=Path, default=None, help="generated sequences: read if present, else written")
    ap.add_argument("--gen-only", action="store_true")
    ap.add_argument("--heads", default="sharegpt=sharegpt:6,humaneval=humaneval:2",
                    help="NAME=SET[+SET...]:MINUTES,... heads to train, each on the train splits of its prompt sets")
    ap.add_argument("--eval-heads", default="", help="NAME=DIR,... existing heads to evaluate beside the new ones")
    ap.add_argument("--batch-seqs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    if args.make_prompts:
        return make_prompts(args.make_prompts)
    heads = parse_heads(args.heads)
    torch.manual_seed(0)
    random.seed(0)
    model_dir = prepare_smollm2(Path("/tmp/smollm2-bf16"), src=args.gguf_dir)
    target = load_target(model_dir, dtype=torch.bfloat16, device="cuda")
    data = json.loads(args.prompts.read_text())
    report = {"gpu": torch.cuda.get_device_name(0), "args": {k: str(v) for k, v in vars(args).items()}}
    seqs = json.loads(args.seqs.read_text()) if args.seqs and args.seqs.exists() else {}
    train_sets = {s for _, sets, _, vocab in heads for s in sets + vocab}
    for name in PROMPT_SETS:  # every set's held-out split (the evaluation matrix), train splits where trained on
        if name not in data:
            continue
        seqs.setdefault(name, {})
        for split, seconds in (("train", args.gen_seconds), ("heldout", args.heldout_seconds)):
            if split not in seqs[name] and (split == "heldout" or name in train_sets):
                seqs[name][split] = generate(target, [target.encode_chat(m) for m in data[name][split]],
                                             args.new_tokens, args.gen_batch, seconds)
    if args.seqs:
        args.seqs.write_text(json.dumps(seqs))
    report["sequences"] = {k: {s: len(v) for s, v in d.items()} for k, d in seqs.items()}
    print(report["sequences"], flush=True)
    if args.gen_only:
        return
    heldout = {name: records_of(target, d["heldout"], name + "-h",
                                prompt_lens=[len(target.encode_chat(m)) for m in data[name]["heldout"]])
               for name, d in seqs.items() if d.get("heldout")}
    trained = {}
    for name, sets, minutes, vocab in heads:
        train_seqs = [q for s in sets for q in seqs[s]["train"]]
        train = records_of(target, train_seqs, name)
        held = [r for s in sets for r in heldout[s]]
        counts = token_counts(target, [q for s in vocab for q in seqs[s]["train"]])
        head, rep = train_head(target, train, held, minutes, lr=args.lr, batch_seqs=args.batch_seqs, ttt_steps=5,
                               name=name, counts=counts)
        del train
        rep.update(prompt_sets=sets, vocab_sets=vocab, train_sequences=len(train_seqs), heldout_sequences=len(held))
        save_head(head.to(torch.bfloat16).cpu(), args.out / name, version=0,
                  extra={"trained_on": f"{'+'.join(sets)} self-distilled on {report['gpu']}",
                         "draft_vocab_from": "+".join(vocab),
                         **{k: rep[k] for k in ("steps", "rows_trained")}})
        trained[name] = head.to(torch.bfloat16)
        report[name] = rep
        print(json.dumps({name: rep}, default=str), flush=True)
    for item in filter(None, args.eval_heads.split(",")):
        name, path = item.split("=")
        trained[name] = load_head(path, target.info, dtype=torch.bfloat16, device="cuda")[0]
    # every head on every held-out set: simulated accept length on the target's own replies
    report["matrix"] = {name: {s: simulate_acceptance(head.cuda(), target, recs, max_steps=7, ks=(1, 3, 5, 7),
                                                      generated_only=True)["accept_length"]
                               for s, recs in heldout.items()} for name, head in trained.items()}
    print(json.dumps({"matrix": report["matrix"]}), flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
