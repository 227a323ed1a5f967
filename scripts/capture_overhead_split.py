"""Probe: where capture's cost on a CPU engine goes, arm by arm, side by side.

The real engine (SmolLM2, random head, K = 3, 48 tokens of ShareGPT first turns, batch B) serves
the same prompts with capture off and with capture at 100 % to a subscriber in another process:
- `threaded`: the publisher's sender thread encodes and sends (the engine's placement undone
  with `send_inline(False)` after the hand-over);
- `inline`: the engine's thread does (what a CPU engine does);
- each against a real subscriber (decode + reassembly, as `bench collector`) and a receive-only
  one (`_raw`). Arms alternate; prints the median tokens/s of each and its ratio to `off`.
Nothing is written.

    python scripts/capture_overhead_split.py 1 3      # batch 1, 3 repeats
    OMP_WAIT_POLICY=PASSIVE python scripts/capture_overhead_split.py 1 3
"""
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from bench import collector as bc  # noqa: E402
from collector.publisher import CapturePublisher, PublisherConfig  # noqa: E402
from online_spec.data import sharegpt_conversations  # noqa: E402
from online_spec.head import new_head  # noqa: E402
from online_spec.sampling import SamplingParams  # noqa: E402
from online_spec.target import load_target  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402


def receive_only(endpoint: str, conn) -> None:
    """Child process: a subscriber that receives every message and decodes none."""
    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    conn.send("ready")
    n = 0
    while not conn.poll(0):
        if sock.poll(10):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    n += 1
                except zmq.Again:
                    break
    conn.recv()
    conn.send({"records": n, "malformed": 0})


def main() -> None:
    batch, repeats = int(sys.argv[1]), int(sys.argv[2])
    target = load_target()
    convs = sharegpt_conversations(limit=16, seed=2, max_prompt_tokens=120, tokenizer=target.tokenizer)
    prompts = [target.encode_chat(c[:1]) for c in convs]
    ps = (prompts * (batch // len(prompts) + 1))[:batch]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    eng = Engine(target, new_head(target), EngineConfig(max_batch=batch, max_len=1024, num_steps=3))
    tmp = tempfile.mkdtemp()
    ctx = mp.get_context("spawn")

    def run(pub) -> float:
        t0 = time.perf_counter()
        n = sum(len(o) for o in eng.generate(ps, sp))
        if pub is not None:
            pub.drain(60)
        return n / (time.perf_counter() - t0)

    run(None)
    arms = ("off", "threaded", "threaded_raw", "inline", "inline_raw")
    res: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(repeats):
        for arm in arms:
            eng.publisher = None
            if arm == "off":
                res[arm].append(run(None))
                continue
            cfg = PublisherConfig(endpoint=f"ipc://{tmp}/c{r}{arm}.sock", sample_fraction=1.0, queue_size=4096,
                                  send_hwm=4096)
            parent, child = ctx.Pipe()
            with CapturePublisher(cfg) as pub:
                sub = receive_only if arm.endswith("_raw") else bc._live_subscriber
                proc = ctx.Process(target=sub, args=(pub.endpoint, child), daemon=True)
                proc.start()
                assert parent.poll(120) and parent.recv() == "ready" and pub.wait_for_subscriber(30)
                eng.publisher = pub  # a CPU engine has it send inline
                if arm.startswith("threaded"):
                    pub.send_inline(False)
                res[arm].append(run(pub))
                eng.publisher = None
                parent.send("stop")
                if parent.poll(60):
                    parent.recv()
                proc.join(10)
    base = statistics.median(res["off"])
    print(f"batch {batch}, {repeats} repeats:",
          {a: (round(statistics.median(v), 2), round(statistics.median(v) / base, 3)) for a, v in res.items()})


if __name__ == "__main__":
    main()
