"""`online-spec bench collector`: capture-stream throughput, drops, and serving overhead.

Measures, through a real ZMQ socket (ipc by default) with realistic records (H=576, features
3H, 1..8 rows per record as a verify round makes them, 32 requests per round, bf16 on the wire):

    records_per_s_max, mb_per_s_max
        a subscriber in another process (decode + reassembly, what the trainer runs) receives a
        burst of records queued all at once; rate = records / (last arrival - first arrival),
        MB = 1e6 bytes of frames on the wire
    dropped_when_subscriber_stalled, decode_stall_ms_max_when_subscriber_stalled
        a subscriber connected but never reading; rounds of records are submitted at a steady
        pace as an engine would; reports the records dropped (queue full + HWM) and the longest
        `submit` call in ms (what decode would have waited)
    serving_overhead
        the real engine's decode tokens/s with capture at 100% sampling and a live subscriber
        in another process, against capture off, at batch 1 and 16: each repeat times the two
        arms back to back (off then on, then on then off in the next repeat, so a drift of the
        machine's speed falls on both), each arm `serving_waves` waves of `batch` requests;
        `capture_ratio` = the median over repeats of on / off (the paired ratio),
        `serving_overhead_pct` = 100 x (1 - capture_ratio) per batch size; `reader_cpu_share`:
        the reader process's CPU seconds while connected over the capture-on arm's wall (the
        share of a core it takes from the engine's: on 2 cores, capture's cost beside serving's);
        the reader runs at `serving_reader_nice` (the trainer's `--nice`). `serving_sink` splits
        the cost: 'null' stages the rows as capture does and drops every round (the engine's own
        share), 'wait' adds a thread that waits on each round's ready event as the sender does,
        'encode' has that thread build and encode each round's messages too (the sender's work
        without the socket, and at once: no host windows), 'busy' runs the 'on' arm uncaptured
        beside one busy-spinning process (what a busy neighbour costs the engine's thread).
        `serving_reserve` runs both arms with the engine's thread on a core of its own
        (online_spec/cpu_reserve.py: 'apart', as `serve --reserve-cpu`) or, a diagnostic, every
        other thread and child on the engine's core ('shared'); `cpu_reserve` reports it

    online-spec bench collector --quick --json results/bench_collector.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from bench.capture_sinks import SINKS, split_arm
from bench.common import add_bench_args, quick_overrides, write_report
from collector.process_publisher import open_publisher
from collector.publisher import CapturePublisher, PublisherConfig
from collector.subscriber import CaptureSubscriber, SubscriberConfig
from online_spec.capture import CaptureRecord
from online_spec.config import check, config_from_args, config_to_dict, doc
from online_spec.cpu_reserve import MODES, CpuReserve
from online_spec.data import sharegpt_conversations
from online_spec.sampling import SamplingParams
from online_spec.target import load_target
from serving.engine_config import CAPTURE_SENDERS

@dataclass
class CollectorBenchConfig:
    hidden_size: int = doc("target hidden size H (SmolLM2-135M: 576)", 576)
    max_rows: int = doc("rows per record are drawn from 1..max_rows (accept_len + 1)", 8)
    batch_size: int = doc("requests per round (records per submit call)", 32)
    burst_records: int = doc("records in the throughput burst", 8000)
    stall_rounds: int = doc("rounds submitted while the subscriber is stalled", 400)
    round_ms: float = doc("pause between rounds in the stalled run (an engine's round time)", 5.0)
    wire_dtype: str = doc("wire dtype of hidden states", "bfloat16")
    transport: str = doc("ipc or tcp", "ipc")
    serving_batches: list[int] = doc("batch sizes of the engine-overhead run (empty: skip it)", lambda: [1, 16])
    serving_tokens: int = doc("tokens per request in the engine-overhead run", 48)
    serving_steps: int = doc("K of the engine-overhead run", 3)
    serving_repeats: int = doc("paired repeats of the engine-overhead run (the median ratio reported)", 5)
    serving_waves: int = doc("waves of `batch` requests in one timed arm of the engine-overhead run", 4)
    serving_device: str = doc("device of the engine-overhead run (cpu, cuda)", "cpu")
    serving_head: str = doc("head of the engine-overhead run: 'random' (a fresh head: about one token a round, "
                            "so the most records a token, the worst case) or a --head value of bench.heads "
                            "(e.g. shipped: the tokens a round, and so the records a token, of a trained head)",
                            "random")
    serving_sender: str = doc("where the engine-overhead run's engine sends its capture (EngineConfig.capture_sender): "
                              "thread, engine or process", "thread")
    serving_reader: str = doc("the reader in the engine-overhead run: 'subscriber' (decode and reassembly, what "
                              "the trainer runs, in another process) or 'socket' (frames received and counted, "
                              "nothing decoded: the serving process's side of the cost alone)", "subscriber")
    serving_sink: str = doc("what the engine-overhead run's 'on' arm adds, to split capture's cost: 'publisher' "
                            "(capture to a live reader, the figure), 'null' (the rows staged as for capture, every "
                            "round then dropped: the engine's own share, no sender or reader), 'wait' (as 'null', "
                            "and a thread of the serving process waits on each round's ready event, as the sender "
                            "does), 'encode' (as 'wait', and that thread builds and encodes each round's messages "
                            "as the sender does, no socket) or 'busy' (no capture, one busy-spinning process beside "
                            "the engine: what a busy neighbour costs)",
                            "publisher")
    serving_reader_nice: int = doc("niceness of the reader's process in the engine-overhead run, as the trainer's "
                                   "`--nice` sets it (0: the server's own priority, the stricter case; 19: as "
                                   "docs/trainer.md deploys the trainer and the demo and bench e2e run it)", 0)
    serving_reserve: str = doc("the engine-overhead run's CPU placement: 'off' (the OS's), 'apart' (the engine's "
                               "thread on a core of its own, every other thread and child process off it: "
                               "EngineConfig.reserve_cpu) or 'shared' (every other thread and child on the "
                               "engine's core: what a neighbour there costs)", "off")

    def __post_init__(self) -> None:
        check(self.serving_reader in ("subscriber", "socket"), "serving_reader",
              f"must be 'subscriber' or 'socket', got {self.serving_reader!r}")
        check(self.serving_reserve in ("off",) + MODES, "serving_reserve",
              f"must be off, apart or shared, got {self.serving_reserve!r}")
        check(self.serving_sink in SINKS, "serving_sink", f"must be one of {SINKS}, got {self.serving_sink!r}")
        check(0 <= self.serving_reader_nice <= 19, "serving_reader_nice",
              f"must be in 0..19, got {self.serving_reader_nice!r}")
        check(self.hidden_size >= 1, "hidden_size", f"{self.hidden_size} < 1")
        check(self.serving_sender in CAPTURE_SENDERS, "serving_sender",
              f"must be one of {CAPTURE_SENDERS}, got {self.serving_sender!r}")
        check(self.max_rows >= 1, "max_rows", f"{self.max_rows} < 1")
        check(self.batch_size >= 1, "batch_size", f"{self.batch_size} < 1")
        check(self.burst_records >= self.batch_size, "burst_records", f"{self.burst_records} < batch_size")
        check(self.stall_rounds >= 1, "stall_rounds", f"{self.stall_rounds} < 1")
        check(self.round_ms >= 0, "round_ms", f"{self.round_ms} < 0")
        check(self.transport in ("ipc", "tcp"), "transport", f"{self.transport!r} is not ipc or tcp")


QUICK = dict(burst_records=2000, stall_rounds=120, serving_tokens=24)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser, CollectorBenchConfig, QUICK, "a short run")


def run(args: argparse.Namespace) -> int:
    overrides = quick_overrides(args, QUICK)
    cfg = config_from_args(CollectorBenchConfig, args, **overrides)
    results: dict[str, Any] = {"bench": "collector", "quick": bool(args.quick), "config": config_to_dict(cfg),
                               "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="bench-collector-") as tmp:
        results.update(measure_throughput(cfg, _endpoint(cfg, tmp)))
    with tempfile.TemporaryDirectory(prefix="bench-collector-") as tmp:
        results.update(measure_stalled(cfg, _endpoint(cfg, tmp)))
    if cfg.serving_batches:
        with tempfile.TemporaryDirectory(prefix="bench-collector-") as tmp:
            results["serving_overhead"] = measure_engine_overhead(cfg, f"ipc://{tmp}/serve.sock")
        results["serving_overhead_pct"] = {b: r["overhead_pct"] for b, r in results["serving_overhead"].items()}
    write_report(args.json, results)
    return 0


def make_rounds(cfg: CollectorBenchConfig, num_rounds: int, seed: int = 0) -> list[list[CaptureRecord]]:
    """`num_rounds` rounds of `batch_size` adjacent verify records (one per request each round)."""
    g = torch.Generator().manual_seed(seed)
    h, k = cfg.hidden_size, cfg.max_rows - 1
    # A pool of hidden states reused by slicing: generating 100 MB of randn would dominate.
    pool = torch.randn(cfg.max_rows * 4, 4 * h, generator=g)
    pos = [0] * cfg.batch_size
    last = [1] * cfg.batch_size
    rounds = []
    for r in range(num_rounds):
        records = []
        for b in range(cfg.batch_size):
            a = int(torch.randint(0, k + 1, (1,), generator=g))
            off = int(torch.randint(0, pool.shape[0] - a, (1,), generator=g))
            new = torch.randint(0, 49_152, (a + 1,), generator=g)
            drafts = torch.cat([new[:a], torch.randint(0, 49_152, (k - a,), generator=g)])
            records.append(CaptureRecord(
                request_id=f"bench-{b}", first_pos=pos[b], tokens=torch.cat([torch.tensor([last[b]]), new]),
                features=pool[off:off + a + 1, :3 * h], final_hidden=pool[off:off + a + 1, 3 * h:],
                draft_tokens=drafts, draft_probs=torch.full((k,), 0.5), accept_len=a, num_steps=k,
                batch_size=cfg.batch_size, draft_version=1, timestamp=float(r)))
            pos[b] += a + 1
            last[b] = int(new[-1])
        rounds.append(records)
    return rounds


def measure_throughput(cfg: CollectorBenchConfig, endpoint: str) -> dict[str, Any]:
    """records_per_s_max and mb_per_s_max: a burst through the socket to another process."""
    rounds = make_rounds(cfg, cfg.burst_records // cfg.batch_size)
    total = sum(len(r) for r in rounds)
    pub_cfg = PublisherConfig(endpoint=endpoint, queue_size=total + 1, send_hwm=total + 1,
                              wire_dtype=cfg.wire_dtype)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with CapturePublisher(pub_cfg) as pub:
        proc = ctx.Process(target=_count_records, args=(pub.endpoint, total, child), daemon=True)
        proc.start()
        try:
            if not (parent.poll(120) and parent.recv() == "ready" and pub.wait_for_subscriber(30)):
                raise RuntimeError("bench subscriber did not connect")
            t0 = time.perf_counter()
            for records in rounds:
                pub.submit(records)
            pub.drain(120)
            sender_s = time.perf_counter() - t0
            if not parent.poll(120):
                raise RuntimeError("bench subscriber did not report")
            sub = parent.recv()
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        stats = pub.stats()
    elapsed = max(sub["elapsed_s"], 1e-9)
    return {
        "records_per_s_max": sub["records"] / elapsed,
        "mb_per_s_max": stats["bytes_sent"] * sub["records"] / max(stats["sent"], 1) / 1e6 / elapsed,
        "rows_per_s_max": sub["span_rows"] / elapsed,
        "publisher_records_per_s": stats["sent"] / sender_s,
        "throughput_records_received": sub["records"],
        "throughput_records_sent": stats["sent"],
        "throughput_malformed": sub["malformed"],
        "bytes_per_record_mean": stats["bytes_sent"] / max(stats["sent"], 1),
    }


def measure_stalled(cfg: CollectorBenchConfig, endpoint: str) -> dict[str, Any]:
    """Drops and the longest submit while a subscriber is connected but never reads."""
    rounds = make_rounds(cfg, cfg.stall_rounds, seed=1)
    zctx = zmq.Context()
    stalled = zctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 16)
    stalled.setsockopt(zmq.LINGER, 0)
    durations: list[float] = []
    try:
        with CapturePublisher(PublisherConfig(endpoint=endpoint, wire_dtype=cfg.wire_dtype)) as pub:
            stalled.connect(pub.endpoint)
            stalled.setsockopt(zmq.SUBSCRIBE, b"")
            if not pub.wait_for_subscriber(30):
                raise RuntimeError("stalled subscriber did not connect")
            for records in rounds:
                t0 = time.perf_counter()
                pub.submit(records)
                durations.append(time.perf_counter() - t0)
                time.sleep(cfg.round_ms / 1000)
            pub.drain(120)
            stats = pub.stats()
    finally:
        stalled.close()
        zctx.term()
    dropped = stats["dropped_queue_full"] + stats["dropped_hwm"]
    ms = sorted(d * 1000 for d in durations)
    return {
        "dropped_when_subscriber_stalled": dropped,
        "dropped_fraction_when_subscriber_stalled": dropped / max(stats["submitted"], 1),
        "decode_stall_ms_max_when_subscriber_stalled": ms[-1],
        "submit_ms_p50_when_subscriber_stalled": statistics.median(ms),
        "submit_ms_p99_when_subscriber_stalled": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "stalled_publisher_stats": {k: v for k, v in stats.items() if k != "endpoint"},
    }


def measure_engine_overhead(cfg: CollectorBenchConfig, endpoint: str,
                            prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """The real engine (SmolLM2 bf16, `cfg.serving_head`, K=cfg.serving_steps) with capture at
    100% sampling and a live subscriber in another process, against capture off; per batch size.
    prompts: token ids (default: 16 ShareGPT first turns; a GPU machine has no ShareGPT package)."""
    # transformers comes with these two: the subscriber child processes import this module too
    from bench.heads import resolve_head
    from online_spec.checkpoint import load_head
    from online_spec.head import new_head

    target = load_target(device=cfg.serving_device)
    if cfg.serving_head == "random":
        head = new_head(target)
    else:
        head = load_head(resolve_head(cfg.serving_head, target), target.info, dtype=target.dtype)[0]
    if prompts is None:
        convs = sharegpt_conversations(limit=16, seed=2, max_prompt_tokens=120, tokenizer=target.tokenizer)
        prompts = [target.encode_chat(c[:1]) for c in convs]
    sp = SamplingParams(max_tokens=cfg.serving_tokens, ignore_eos=True)
    pub_cfg = PublisherConfig(endpoint=endpoint, sample_fraction=1.0, queue_size=4096, send_hwm=4096,
                              wire_dtype=cfg.wire_dtype)
    ctx = mp.get_context("spawn")
    reserve = None if cfg.serving_reserve == "off" else CpuReserve(mode=cfg.serving_reserve)
    try:
        if reserve is not None:
            reserve.hold()  # this thread runs the engine: its core from here on
        out = _engine_overhead(cfg, target, head, prompts, sp, pub_cfg, ctx)
    finally:
        if reserve is not None:
            reserve.close()
    if reserve is not None:
        for row in out.values():
            row["cpu_reserve"] = reserve.stats()
    return out


def _engine_overhead(cfg, target, head, prompts, sp, pub_cfg, ctx) -> dict[str, Any]:
    from serving.engine import Engine, EngineConfig

    out = {}
    for batch in cfg.serving_batches:
        n = batch * cfg.serving_waves
        ps = (prompts * (n // len(prompts) + 1))[:n]

        # one engine for both arms, warmed up first: a fresh engine per run would time its own
        # CUDA graph captures (tens of ms each on a GPU) in both arms and drown the difference
        eng = Engine(target, head, EngineConfig(max_batch=batch, max_len=1024, num_steps=cfg.serving_steps,
                                                capture_sender=cfg.serving_sender))

        walls = []  # the capture-on arms' seconds

        def run_decode(pub: CapturePublisher | None) -> float:
            eng.publisher = pub
            t0 = time.perf_counter()
            n = sum(len(o) for o in eng.generate(ps, sp))
            if pub is not None:
                pub.drain(60)
                walls.append(time.perf_counter() - t0)
            eng.publisher = None
            return n / (time.perf_counter() - t0)

        run_decode(None)  # warm-up
        without, with_pub, stats, reader_cpu, received = [], [], {}, [], None
        for i in range(cfg.serving_repeats if cfg.serving_sink != "publisher" else 0):
            if i % 2 == 0:
                without.append(run_decode(None))
            tps, arm = split_arm(cfg.serving_sink, run_decode, ctx, cfg.wire_dtype)
            with_pub.append(tps)
            if i % 2 == 1:
                without.append(run_decode(None))
            stats = {"sink": cfg.serving_sink, **arm}
        for i in range(cfg.serving_repeats if cfg.serving_sink == "publisher" else 0):
            parent, child = ctx.Pipe()
            with open_publisher(pub_cfg, cfg.serving_sender) as pub:
                reader = _live_subscriber if cfg.serving_reader == "subscriber" else _socket_reader
                proc = ctx.Process(target=reader, args=(pub.endpoint, child, cfg.serving_reader_nice), daemon=True)
                proc.start()
                try:
                    if not (parent.poll(120) and parent.recv() == "ready" and pub.wait_for_subscriber(30)):
                        raise RuntimeError("bench subscriber did not connect")
                    # the arms back to back, in turns first: the subscriber waits connected in both
                    if i % 2 == 0:
                        without.append(run_decode(None))
                    with_pub.append(run_decode(pub))
                    if i % 2 == 1:
                        without.append(run_decode(None))
                    stats = pub.stats()
                    parent.send("stop")
                    received = parent.recv() if parent.poll(60) else None
                finally:
                    proc.join(10)
                    if proc.is_alive():
                        proc.kill()
                reader_cpu.append((received or {}).get("cpu_s"))
        ratios = [c / b for b, c in zip(without, with_pub)]
        ratio = statistics.median(ratios)
        # the reader's CPU seconds while connected (its idle polling in the capture-off arm included)
        # over the capture-on arm's wall: the share of a core it took from the engine's cores
        shares = [c / w for c, w in zip(reader_cpu, walls) if c is not None and w > 0]
        out[str(batch)] = {"tokens_per_s_capture_off": statistics.median(without),
                           "tokens_per_s_capture_on": statistics.median(with_pub),
                           "tokens_per_s_off_runs": without, "tokens_per_s_on_runs": with_pub,
                           "capture_ratios": [round(r, 4) for r in ratios], "capture_ratio": ratio,
                           "reader_cpu_share": statistics.median(shares) if shares else None,
                           "reader_cpu_shares": [round(x, 4) for x in shares],
                           "overhead_pct": 100.0 * (1.0 - ratio), "publisher_stats": stats,
                           "subscriber_received": received}
    return out


def _live_subscriber(endpoint: str, conn, nice: int = 0) -> None:
    """Child process: a real subscriber that keeps up until told to stop, at niceness `nice`, on
    one torch thread as `online-spec train` runs by default (`--threads 1`): with torch's default,
    one thread a core, its decoding took 2-4 cores of an H200 host's 16 (2026-11-28)."""
    os.nice(nice)
    torch.set_num_threads(1)
    # the trainer's subscriber as `online-spec train` configures it (its 100 ms polls)
    sub = CaptureSubscriber(SubscriberConfig(endpoint=endpoint, recv_hwm=100_000), on_span=lambda s: None)
    sub.start()
    cpu0 = time.process_time()  # this process's CPU from here: the reader's work on the stream
    conn.send("ready")
    conn.recv()
    stats = sub.stats()
    sub.close(flush=True)
    conn.send({"records": stats["records"], "malformed": stats["malformed"], "cpu_s": time.process_time() - cpu0,
               "nice": os.nice(0)})


def _socket_reader(endpoint: str, conn, nice: int = 0) -> None:
    """Child process: a bare SUB socket that receives every message and counts it, decoding
    nothing (`serving_reader` 'socket'), at niceness `nice`."""
    os.nice(nice)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    conn.send("ready")
    messages, stopping = 0, False
    cpu0 = time.process_time()
    while True:
        if sock.poll(200 if stopping else 10):
            sock.recv_multipart(copy=False)
            messages += 1
        elif stopping:  # told to stop, and nothing more in flight
            break
        stopping = stopping or conn.poll(0)
    conn.recv()
    sock.close(0)
    ctx.term()
    conn.send({"records": messages, "malformed": 0, "messages": messages, "cpu_s": time.process_time() - cpu0,
               "nice": os.nice(0)})


def _endpoint(cfg: CollectorBenchConfig, tmp: str) -> str:
    return f"ipc://{tmp}/capture.sock" if cfg.transport == "ipc" else "tcp://127.0.0.1:*"


def _count_records(endpoint: str, expected: int, conn) -> None:
    """Child process: a real subscriber (decode + reassembly) timing the burst's arrival."""
    rows = [0]
    sub = CaptureSubscriber(SubscriberConfig(endpoint=endpoint, recv_hwm=expected + 1, poll_ms=10),
                            on_span=lambda span: rows.__setitem__(0, rows[0] + span.num_rows))
    sub.start()
    conn.send("ready")
    t_first = t_last = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        n = sub.records
        now = time.perf_counter()
        if n and t_first is None:
            t_first = now
        if n >= expected:
            t_last = now
            break
        time.sleep(0.0005)
    stats = sub.stats()
    sub.close(flush=True)
    conn.send({"records": stats["records"], "malformed": stats["malformed"], "span_rows": rows[0],
               "elapsed_s": (t_last or time.perf_counter()) - (t_first or 0.0)})
