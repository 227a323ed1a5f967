"""Probe: what a busy Python thread costs a thread of small torch calls, by switch interval.

The engine thread gives the interpreter lock up around every torch call and takes it back after;
when another thread of the same process is running Python (the HTTP side: uvicorn, SSE, the
detokenizer; in `bench e2e` also the clients) the engine waits for it, up to the interpreter's
switch interval (5 ms by default) each time. This times rounds of N tiny in-place adds alone and
beside a thread running json.dumps in bursts, at 5 ms and 0.5 ms. Nothing is written.

    python scripts/switch_interval_probe.py
"""
import json
import statistics
import sys
import threading
import time

import torch

torch.set_num_threads(1)
x = torch.zeros(16)
stop = threading.Event()


def busy() -> None:  # an event loop's pure-Python work in bursts, with short waits on I/O
    d = {"a": list(range(50))}
    while not stop.is_set():
        for _ in range(200):
            json.dumps(d)
        time.sleep(0.0005)


def rounds(n_ops: int, n_rounds: int = 200) -> tuple[float, float]:
    out = []
    for _ in range(n_rounds):
        t = time.perf_counter()
        for _ in range(n_ops):
            x.add_(1)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3, statistics.mean(out) * 1e3


for interval in (0.005, 0.0005):
    sys.setswitchinterval(interval)
    for label, contended in (("alone", False), ("beside a busy thread", True)):
        stop.clear()
        th = threading.Thread(target=busy, daemon=True)
        if contended:
            th.start()
        time.sleep(0.05)
        for n_ops in (20, 200):
            med, mean = rounds(n_ops)
            print(f"switch {interval * 1e3:.1f} ms  {label:<22} {n_ops:3d} ops: median {med:.3f} ms, mean {mean:.3f} ms")
        stop.set()
        if contended:
            th.join()
