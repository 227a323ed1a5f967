"""`SpanAssembler`: joins the stream's records, request by request, into contiguous spans.

A plain object with no I/O (the subscriber feeds it and applies what it returns), so its rules
can be tested on fixed sequences:

- a record continues the open span of its request only if it is adjacent: it starts at the
  span's `end_pos` and its first token equals the span's last token. Anything else (a record
  was dropped on the way, a duplicate, a restarted publisher reusing ids) closes the open span
  and starts a new one, so rows that were not adjacent in the request are never joined;
- a span is handed over when its request ends (end-of-request marker), when a gap closes it,
  when the request has been idle for `idle_timeout_s` (the marker itself may be dropped), when
  it reaches `max_span_rows` (the next record starts a new span), or when more than
  `max_open_requests` requests are open (the least recently seen one is closed).

    asm = SpanAssembler(idle_timeout_s=30, max_open_requests=4096, max_span_rows=8192)
    spans = asm.add(record, now) + asm.end(request_id) + asm.expire(now)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from collector.span import CaptureSpan
from online_spec.capture import CaptureRecord, adjacency_error

CLOSE_REASONS = ("end", "gap", "idle", "limit", "evict", "flush")


@dataclass
class _OpenSpan:
    records: list[CaptureRecord] = field(default_factory=list)
    rows: int = 0
    last_seen: float = 0.0


def is_adjacent(prev: CaptureRecord, rec: CaptureRecord) -> bool:
    """Whether `rec` directly continues `prev` (`online_spec.capture.adjacency_error`)."""
    return adjacency_error(prev, rec) is None


class SpanAssembler:
    def __init__(self, idle_timeout_s: float, max_open_requests: int, max_span_rows: int):
        self.idle_timeout_s = idle_timeout_s
        self.max_open_requests = max_open_requests
        self.max_span_rows = max_span_rows
        self._open: OrderedDict[str, _OpenSpan] = OrderedDict()  # least recently seen first
        self.closed = {reason: 0 for reason in CLOSE_REASONS}
        self.gaps = 0

    @property
    def num_open(self) -> int:
        return len(self._open)

    def add(self, record: CaptureRecord, now: float) -> list[CaptureSpan]:
        """Take one record; return the spans it closes (possibly none)."""
        out: list[CaptureSpan] = []
        rid = record.request_id
        span = self._open.get(rid)
        if span is not None and not is_adjacent(span.records[-1], record):
            self.gaps += 1
            out.append(self._close(rid, "gap"))
            span = None
        if span is None:
            if len(self._open) >= self.max_open_requests:
                out.append(self._close(next(iter(self._open)), "evict"))
            span = self._open[rid] = _OpenSpan()
        self._open.move_to_end(rid)
        span.records.append(record)
        span.rows += record.num_rows
        span.last_seen = now
        if span.rows >= self.max_span_rows:
            out.append(self._close(rid, "limit"))
        return out

    def end(self, request_id: str) -> list[CaptureSpan]:
        """The request finished: hand over its open span, if any."""
        return [self._close(request_id, "end")] if request_id in self._open else []

    def expire(self, now: float) -> list[CaptureSpan]:
        """Close the spans of requests idle for longer than `idle_timeout_s`."""
        out = []
        while self._open:
            rid, span = next(iter(self._open.items()))
            if now - span.last_seen < self.idle_timeout_s:
                break
            out.append(self._close(rid, "idle"))
        return out

    def flush(self) -> list[CaptureSpan]:
        """Close every open span (shutdown)."""
        return [self._close(rid, "flush") for rid in list(self._open)]

    def _close(self, request_id: str, reason: str) -> CaptureSpan:
        span = self._open.pop(request_id)
        self.closed[reason] += 1
        return CaptureSpan.from_records(span.records)
