"""`online-spec pretrain`: build records, distill a head offline, evaluate, write a checkpoint.

    online-spec pretrain --data sharegpt --out runs/sharegpt      # self-distilled, the recipe of docs/distill.md
    online-spec pretrain --data humaneval --tokens 20000 --out runs/humaneval
    online-spec pretrain --data sharegpt --source teacher --out runs/tf   # conversations as written
    online-spec pretrain --data PATH --out DIR      # PATH: records written by save_records

The run directory is resumable — rerunning the same command picks up where it stopped:

    DIR/run.json               the configs of the run
    DIR/records/{train,heldout}  capture spans (HF datasets shards, bf16): the target's own greedy
                               replies (--source generate) or teacher-forced conversations
    DIR/state.pt               Distiller state (weights, AdamW, schedule, counters), every save_every steps
    DIR/metrics.jsonl          one line of metrics per logged step
    DIR/head/                  the head checkpoint (SGLang layout), written when training ends
    DIR/eval.json              simulated and real accept lengths (the run is done once it exists)

Draft vocabulary: the `draft_vocab_size` most frequent token ids of the training records
(`online_spec.data.token_frequencies` counted on the chat-templated training text), EOS always in.
Hyper-parameters: `--config configs/distill/default.json` (sections "distill", "loss"), each
field overridable by its own flag. Multi-rank: `torchrun --nproc_per_node N -m online_spec.cli
pretrain ...` (every rank builds the same batches and trains on its share; rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from online_spec.checkpoint import load_head
from online_spec.config import add_config_args, check, config_to_dict, doc
from online_spec.data import humaneval_conversations, is_heldout, sharegpt_conversations
from online_spec.head import new_head
from online_spec.jsonl import json_line, open_text
from online_spec.target import load_target
from trainer.batch import collate
from trainer.data import capture_conversations, generate_records, load_records, records_complete, save_records
from trainer.distill import REPO, DistillConfig, Distiller, init_from_target
from trainer.evaluate import engine_accept_length, simulate_acceptance
from trainer.loss import LossConfig

log = logging.getLogger(__name__)


@dataclass
class PretrainConfig:
    data: str = doc("sharegpt | humaneval | a directory of saved records", "sharegpt")
    source: str = doc("generate: the target's own greedy replies to each conversation's first user turn "
                      "(self-distillation: what the head drafts against when serving) | teacher: the "
                      "conversations teacher-forced as written", "generate")
    max_new_tokens: int = doc("generate: tokens generated per prompt", 256)
    max_prompt_tokens: int = doc("generate: prompts longer than this are skipped", 256)
    gen_batch: int = doc("generate: requests decoded together (a [64,576] matmul costs about what a "
                         "[16,576] one does here)", 64)
    init_norm: str = doc("head's final norm at start: one | target (the target's final norm)", "one")
    init_fc: str = doc("fc at start: random | last_layer (identity on the last captured layer)", "last_layer")
    tokens: int = doc("training rows (tokens) to capture", 40_000)
    heldout_tokens: int = doc("held-out rows to capture for evaluation", 4_000)
    out: str = doc("run directory (rerun to resume)", "")
    max_len: int = doc("conversation truncation, tokens", 1024)
    draft_vocab_size: int = doc("draft vocabulary size (most frequent training tokens)", 8192)
    epochs: float = doc("passes over the training records", 3.0)
    batch_tokens: int = doc("rows per optimizer step, all ranks together (a longer record is a step alone)", 256)
    save_every: int = doc("steps between resumable state saves", 25)
    eval_prompts: int = doc("held-out prompts decoded through the engine", 8)
    eval_max_tokens: int = doc("tokens generated per held-out prompt", 96)
    eval_steps: int = doc("K for the engine accept-length measurement", 5)
    config: str = doc("distillation config JSON (sections distill, loss)", "configs/distill/default.json")
    threads: int = doc("torch CPU threads; 1 on a shared CPU: with 2 threads every op waits for both "
                       "(under load 10 on 2 cores a [16,576]x[576,1536] bf16 matmul takes 10 ms with 2 "
                       "threads, 0.55 ms with 1)", 1)

    def __post_init__(self):
        check(self.tokens >= 1, "tokens", "must be >= 1")
        check(self.heldout_tokens >= 0, "heldout_tokens", "must be >= 0")
        check(self.max_len >= 8, "max_len", "must be >= 8")
        check(self.draft_vocab_size >= 16, "draft_vocab_size", "must be >= 16")
        check(self.epochs > 0, "epochs", "must be > 0")
        check(self.batch_tokens >= 1, "batch_tokens", "must be >= 1")
        check(self.save_every >= 1, "save_every", "must be >= 1")
        check(self.source in ("generate", "teacher"), "source", "must be generate or teacher")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.gen_batch >= 1, "gen_batch", "must be >= 1")
        check(self.threads >= 1, "threads", "must be >= 1")


def load_configs(path: str, ns: argparse.Namespace | None = None) -> tuple[DistillConfig, LossConfig]:
    """Dataclass defaults < the JSON file < flags given on the command line."""
    p = Path(path)
    raw = json.loads((p if p.is_absolute() else REPO / p).read_text())
    out = []
    for cls, section, prefix in ((DistillConfig, "distill", ""), (LossConfig, "loss", "loss_")):
        kw = dict(raw.get(section, {}))
        if ns is not None:
            for f in cls.__dataclass_fields__:
                if hasattr(ns, prefix + f):
                    kw[f] = getattr(ns, prefix + f)
        out.append(cls(**kw))
    return out[0], out[1]


def source_conversations(name: str, split: str, tokenizer):
    if name == "sharegpt":
        return sharegpt_conversations(split=split, seed=0)
    if name == "humaneval":
        return humaneval_conversations(split=split, seed=0)
    raise ValueError(f"unknown data source {name!r}")


def build_records(target, cfg: PretrainConfig, run: Path) -> tuple[list, list]:
    """Capture (or reload) train and held-out records into run/records."""
    if cfg.data not in ("sharegpt", "humaneval"):
        recs = load_records(cfg.data)
        train = [r for r in recs if not is_heldout(r.request_id)]
        return train, [r for r in recs if is_heldout(r.request_id)]
    out = {}
    for split, budget in (("train", cfg.tokens), ("heldout", cfg.heldout_tokens)):
        d = run / "records" / split
        if not records_complete(d) and budget > 0:
            convs = source_conversations(cfg.data, split, target.tokenizer)
            t0 = time.time()
            if cfg.source == "generate":
                prompts = (p for p in (target.encode_chat(c[:1]) for c in convs) if len(p) <= cfg.max_prompt_tokens)
                gen = generate_records(target, prompts, cfg.max_new_tokens, tag=cfg.data,
                                       id_prefix=f"{cfg.data}-{split}-gen", max_batch=cfg.gen_batch, max_tokens=budget)
            else:
                gen = capture_conversations(target, convs, cfg.max_len, tag=cfg.data, id_prefix=f"{cfg.data}-{split}",
                                            max_tokens=budget)
            from tqdm import tqdm
            bar = tqdm(desc=f"capture {split}", total=budget, unit="tok")

            def counted(g):
                for r in g:
                    bar.update(r.num_rows)
                    yield r
            stats = save_records(counted(gen), d)
            bar.close()
            log.info("captured %d %s rows in %.0fs", stats["tokens"], split, time.time() - t0)
        out[split] = load_records(d) if budget > 0 else []
    return out["train"], out["heldout"]


def plan_batches(records: list, batch_tokens: int, epochs: float, seed: int) -> list[list[int]]:
    """Indices of the records of every step, all epochs: shuffled, then grouped by length so
    little padding is wasted; deterministic, so a resumed run continues the same sequence."""
    steps: list[list[int]] = []
    total = math.ceil(epochs * sum(r.num_rows for r in records) / batch_tokens)
    epoch = 0
    while len(steps) < total:
        idx = list(range(len(records)))
        random.Random(seed + epoch).shuffle(idx)
        chunks = [sorted(idx[i:i + 64], key=lambda j: records[j].num_rows) for i in range(0, len(idx), 64)]
        epoch_steps = []
        for ch in chunks:
            cur: list[int] = []
            for j in ch:
                longest = max([records[x].num_rows for x in cur] + [records[j].num_rows])
                if cur and longest * (len(cur) + 1) > batch_tokens:
                    epoch_steps.append(cur)
                    cur = []
                cur.append(j)
            if cur:
                epoch_steps.append(cur)
        random.Random(seed + 1000 + epoch).shuffle(epoch_steps)
        steps.extend(epoch_steps)
        epoch += 1
    return steps[:total]


def draft_vocab_counts(records: list, vocab_size: int) -> torch.Tensor:
    """Token frequencies of the training text (the records' tokens are that text, chat-templated)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts += torch.bincount(r.tokens, minlength=vocab_size)
    return counts


def heldout_prompts(name: str, tokenizer, encode, n: int) -> list[list[int]]:
    if name == "humaneval":
        convs = humaneval_conversations(limit=n, split="heldout")
    else:
        convs = sharegpt_conversations(limit=n, split="heldout", max_prompt_tokens=200, tokenizer=tokenizer)
    return [encode(c[:1]) for c in convs]


def train(target, train_recs: list, cfg: PretrainConfig, dcfg: DistillConfig, lcfg: LossConfig,
          run: Path) -> Distiller:
    from tqdm import tqdm

    steps = plan_batches(train_recs, cfg.batch_tokens, cfg.epochs, dcfg.seed)
    dcfg = DistillConfig(**{**config_to_dict(dcfg), "total_steps": max(len(steps), 1)})
    counts = draft_vocab_counts(train_recs, target.info.vocab_size)
    head = init_from_target(new_head(target, cfg.draft_vocab_size, counts, seed=dcfg.seed).float(), target,
                            norm=cfg.init_norm, fc=cfg.init_fc)
    coverage = float(counts[head.t2d.cpu()].sum()) / max(int(counts.sum()), 1)
    d = Distiller(target, head, dcfg, lcfg)
    state = run / "state.pt"
    if state.exists():
        d.load_state(state)
        log.info("resumed at step %d (%d tokens)", d.step, d.tokens)
    t0, tok0 = time.time(), d.tokens
    bar = tqdm(total=len(steps), initial=d.step, desc="distill", unit="step", disable=d.rank != 0)
    with open_text(run / "metrics.jsonl", "a") as mf:
        while d.step < len(steps):
            items = [train_recs[j] for j in steps[d.step]][d.rank::d.world_size] or [train_recs[steps[d.step][0]]]
            m = d.train_step(collate(items))
            m["tokens_per_s"] = (d.tokens - tok0) / (time.time() - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_0']:.2f}", tok_s=f"{m['tokens_per_s']:.0f}")
            if d.rank == 0:
                mf.write(json_line(m))
                mf.flush()
            if d.step % cfg.save_every == 0 or d.step == len(steps):
                d.save_state(state)
    bar.close()
    d.train_seconds = time.time() - t0
    d.vocab_coverage = coverage
    return d


def evaluate_run(target, head, heldout: list, cfg: PretrainConfig) -> dict:
    head = head.to(target.dtype).eval()
    gen = cfg.source == "generate" and cfg.data in ("sharegpt", "humaneval")
    out = {"simulated": simulate_acceptance(head, target, heldout, generated_only=gen) if heldout else None}
    if cfg.eval_prompts > 0 and cfg.data in ("sharegpt", "humaneval"):
        prompts = heldout_prompts(cfg.data, target.tokenizer, target.encode_chat, cfg.eval_prompts)
        real = engine_accept_length(target, head, prompts, cfg.eval_steps, cfg.eval_max_tokens)
        real.pop("outputs")
        out["engine"] = {"num_steps": cfg.eval_steps, **real}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, PretrainConfig)
    add_config_args(parser, DistillConfig)
    add_config_args(parser, LossConfig, prefix="loss_")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kw = {f: getattr(args, f) for f in PretrainConfig.__dataclass_fields__ if hasattr(args, f)}
    cfg = PretrainConfig(**kw)
    torch.set_num_threads(cfg.threads)
    check(bool(cfg.out), "out", "a run directory is required")
    dcfg, lcfg = load_configs(cfg.config, args)
    result = pretrain(cfg, dcfg, lcfg)
    print(json.dumps(result, indent=2))
    return 0


def pretrain(cfg: PretrainConfig, dcfg: DistillConfig, lcfg: LossConfig, target=None) -> dict:
    """The whole run; returns (and writes) DIR/eval.json. Resumes from what DIR holds."""
    run = Path(cfg.out).expanduser()
    run.mkdir(parents=True, exist_ok=True)
    if (run / "eval.json").exists():
        return json.loads((run / "eval.json").read_text())
    conf = {"pretrain": config_to_dict(cfg), "distill": config_to_dict(dcfg), "loss": config_to_dict(lcfg)}
    if (run / "run.json").exists() and json.loads((run / "run.json").read_text()) != conf:
        log.warning("%s was started with other settings (run.json); resuming with the new ones", run)
    (run / "run.json").write_text(json.dumps(conf, indent=2))
    target = target or load_target()
    t0 = time.time()
    train_recs, heldout = build_records(target, cfg, run)
    capture_s = time.time() - t0
    d = train(target, train_recs, cfg, dcfg, lcfg, run)
    d.save(run / "head", version=1)
    if d.rank != 0:
        return {}
    head, _ = load_head(run / "head", target.info)
    result = {"trained_tokens": d.tokens, "train_rows_unique": sum(r.num_rows for r in train_recs),
              "steps": d.step, "draft_vocab_size": cfg.draft_vocab_size,
              "draft_vocab_coverage": d.vocab_coverage, "capture_seconds": capture_s,
              "train_seconds_this_session": d.train_seconds, "head": str(run / "head"),
              **evaluate_run(target, head, heldout, cfg)}
    (run / "eval.json").write_text(json.dumps(result, indent=2))
    return result
