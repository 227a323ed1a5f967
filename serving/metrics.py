"""Server metrics: Prometheus series and the rolling figures `/server_info` reports.

In: every engine step's outputs (`on_step`, engine thread), every verify round's `RoundStats`
with its outputs and their traffic tags (`on_round`, engine thread), request outcomes and
latencies (`on_request_*`, event loop), swaps. Drift alerts are counted on the same registry by
`online_spec.alerts.PrometheusAlertSink` (serving/server_drift.py). Out: `/metrics` text
(`render()`, a private registry per server so several can live in one process), `summary()`
for `/server_info`, and `round_clock()`: per round shape, the rounds run and their seconds,
cumulative (control `round_clock`: what a colocated trainer's serving budget reads,
trainer/slack.py).

Names (all prefixed `online_spec_`): see docs/server.md. Conventions: `accept_len` = drafts
accepted per request per round, bonus excluded; SGLang's `avg_spec_accept_length` = committed
tokens per verify round = accept_len + 1 (bonus included).

Label cardinality is bounded: traffic tags come from clients, so `TagLabels` gives the first
`max_tags` distinct tags their own name and serves every later one as `other` (the server maps a
request's tag once, at submit: metrics, drift streams and capture records see the same bounded
set). /metrics then grows with the tag cap, not with what clients send.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from online_spec.advice import WarningsCollector
from serving.requests import RequestOutput, RoundStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
OTHER_TAG = "other"


class TagLabels:
    """The bounded set of traffic tags: the first `max_tags` distinct tags, then `other`."""

    def __init__(self, max_tags: int):
        self.max_tags = max_tags
        self._known: set[str] = set()
        self.folded = 0  # requests whose tag was served as `other`
        self._lock = threading.Lock()

    def label(self, tag: str) -> str:
        if not tag:
            return tag
        with self._lock:
            if tag in self._known:
                return tag
            if len(self._known) < self.max_tags:
                self._known.add(tag)
                return tag
            self.folded += 1
            return OTHER_TAG

    def info(self) -> dict:
        with self._lock:
            return {"known": len(self._known), "max_tags": self.max_tags, "folded_into_other": self.folded}


class _PublisherCollector:
    """Reads the capture publisher's counters at scrape time (it keeps its own)."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        sent = CounterMetricFamily("online_spec_capture_records_sent", "capture records sent to the trainer stream")
        sent.add_metric([], float(s.get("sent", 0)))
        dropped = CounterMetricFamily("online_spec_capture_records_dropped",
                                      "capture records dropped (queue full, no subscriber, ...)", labels=["reason"])
        for k, v in s.items():
            if k.startswith("dropped_"):
                dropped.add_metric([k[len("dropped_"):]], float(v))
        depth = GaugeMetricFamily("online_spec_capture_queue_depth", "capture records waiting to be sent")
        depth.add_metric([], float(s.get("queue_depth", 0)))
        yield from (sent, dropped, depth)


class ServerMetrics:
    def __init__(self, max_steps: int, window_rounds: int = 256, rate_window_s: float = 10.0,
                 publisher_stats: Callable[[], dict] | None = None):
        self.registry = r = CollectorRegistry()
        r.register(WarningsCollector())  # online_spec_warnings_total{kind}: the operator warnings raised
        self.max_steps = max_steps
        self.rate_window_s = rate_window_s
        p = "online_spec_"
        self.rounds = Counter(p + "rounds", "verify rounds run", registry=r)
        self.accept_len = Histogram(p + "accept_length", "drafts accepted per request per round (bonus excluded)",
                                    buckets=[i + 0.5 for i in range(max_steps + 1)], registry=r)
        self.tag_accepted = Counter(p + "accepted_drafts", "drafts accepted, by traffic tag", ["tag"], registry=r)
        self.tag_proposed = Counter(p + "proposed_drafts", "drafts proposed, by traffic tag", ["tag"], registry=r)
        self.tag_verify = Counter(p + "verify_request_rounds", "request-rounds verified with K > 0, by tag",
                                  ["tag"], registry=r)
        self.pos_accepted = Counter(p + "position_accepted", "drafts accepted at draft position i (0-based)",
                                    ["position"], registry=r)
        self.pos_proposed = Counter(p + "position_proposed", "drafts reaching verification at position i",
                                    ["position"], registry=r)
        self.tokens = Counter(p + "generated_tokens", "tokens committed to requests (prefill's first included)",
                              registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens admitted", registry=r)
        self.tokens_per_s = Gauge(p + "tokens_per_second", f"tokens committed per second over the last "
                                  f"{rate_window_s:g} s", registry=r)
        self.num_steps = Gauge(p + "num_steps", "K of the last round run at this batch size", ["batch_size"],
                               registry=r)
        self.batch_size = Gauge(p + "batch_size", "requests in the last round", registry=r)
        self.head_version = Gauge(p + "head_version", "version of the live draft head", registry=r)
        self.swaps = Counter(p + "head_swaps", "head swaps applied by the engine", registry=r)
        self.rollbacks = Counter(p + "head_rollbacks", "swaps requested as rollbacks", registry=r)
        self.head_faults = Counter(p + "head_faults", "live heads found drafting non-finite values (and rolled back)",
                                   registry=r)
        self.requests = Counter(p + "requests", "requests finished, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "requests refused before running", ["reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submit to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "mean gap between tokens after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "requests_running", "requests holding an engine slot", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests queued for a slot", registry=r)
        if publisher_stats is not None:
            r.register(_PublisherCollector(publisher_stats))
        self._lock = threading.Lock()
        self._window: deque[tuple[int, int]] = deque(maxlen=window_rounds)  # (accepted, request-rounds)
        self._life_accepted = self._life_request_rounds = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens)
        self._last_k: dict[int, int] = {}
        self._last_round: RoundStats | None = None
        self._rounds = 0
        self._t_start = time.monotonic()
        # (batch size, tokens verified per request, tree branching) -> [rounds, seconds]: steady
        # rounds only (no prefill, graph capture or swap inside), so a shape's mean is its pace
        self._clock: dict[tuple[int, int, int], list] = {}

    # -- engine thread ----------------------------------------------------------------------------
    def on_step(self, outs: list[RequestOutput], elapsed_s: float) -> None:
        n = sum(len(o.new_token_ids) for o in outs)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - self.rate_window_s:
                self._recent.popleft()
        self.tokens.inc(n)

    def on_round(self, stats: RoundStats, outs: list[RequestOutput], tags: list[str]) -> None:
        K, B = stats.num_steps, stats.batch_size
        self.rounds.inc()
        self._rounds += 1
        self.num_steps.labels(str(B)).set(K)
        self.batch_size.set(B)
        self.head_version.set(stats.head_version)
        if stats.swapped:
            self.swaps.inc()
        clocked = not (stats.admitted or stats.draft_captures or stats.verify_captures or stats.swapped
                       or stats.swap_fill_rows)
        with self._lock:
            self._last_k[B] = K
            self._last_round = stats
            if clocked:
                cell = self._clock.get(key := (B, stats.num_draft_tokens or K + 1, stats.topk))
                if cell is None:
                    cell = self._clock[key] = [0, 0.0]
                cell[0] += 1
                cell[1] += stats.total_s - stats.catchup_s
            if K > 0:
                self._window.append((sum(stats.accepted), len(stats.accepted)))
                self._life_accepted += sum(stats.accepted)
                self._life_request_rounds += len(stats.accepted)
        if K == 0:
            return
        for a, tag in zip(stats.accepted, tags):
            self.accept_len.observe(a)
            self.tag_accepted.labels(tag).inc(a)
            self.tag_proposed.labels(tag).inc(K)
            self.tag_verify.labels(tag).inc()
        for i in range(K):
            self.pos_proposed.labels(str(i)).inc(len(stats.accepted))
            self.pos_accepted.labels(str(i)).inc(sum(1 for a in stats.accepted if a > i))

    # -- event loop ---------------------------------------------------------------------------------
    def on_request_done(self, endpoint: str, outcome: str, prompt_tokens: int, ttft_s: float | None,
                        tpot_s: float | None) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def on_rollback(self) -> None:
        self.rollbacks.inc()

    def on_head_fault(self) -> None:
        self.head_faults.inc()

    def rounds_run(self) -> int:
        return self._rounds

    def round_clock(self) -> dict:
        """The steady rounds run so far per shape, cumulative: {"cells": [[batch size, tokens
        verified per request, tree branching, rounds, seconds], ...], "rounds": all rounds}."""
        with self._lock:
            cells = [[*key, n, round(s, 6)] for key, (n, s) in self._clock.items()]
        return {"cells": cells, "rounds": self._rounds}

    # -- readers ----------------------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.rate_window_s]
        span = min(self.rate_window_s, max(now - self._t_start, 1e-3))
        return sum(n for _, n in recent) / span

    def summary(self) -> dict:
        """Acceptance over the recent window and lifetime, K per batch size, throughput."""
        with self._lock:
            wa = sum(a for a, _ in self._window)
            wn = sum(n for _, n in self._window)
            la, ln = self._life_accepted, self._life_request_rounds
            last_k = dict(sorted(self._last_k.items()))
            last = self._last_round
        recent = wa / wn if wn else None
        life = la / ln if ln else None
        return {
            "avg_spec_accept_length": None if recent is None else recent + 1.0,
            "avg_spec_accept_length_lifetime": None if life is None else life + 1.0,
            "avg_accept_len": recent,
            "avg_accept_len_lifetime": life,
            "window_rounds": len(self._window),
            "speculative_num_steps": None if last is None else last.num_steps,
            "speculative_num_steps_per_batch_size": {str(k): v for k, v in last_k.items()},
            "last_gen_throughput": self.tokens_per_second(),
            "last_batch_size": None if last is None else last.batch_size,
        }

    def render(self) -> bytes:
        self.tokens_per_s.set(self.tokens_per_second())
        return generate_latest(self.registry)
