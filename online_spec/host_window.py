"""`HostWindow`: the moments the engine's thread waits on the device, when other threads' Python is free.

On a GPU the engine's thread spends much of a round blocked in a read-back (the draft chain's
tokens, the verify's logits) with the interpreter lock released. The serving process's
background threads (the capture publisher's sender, the cost policy's planner) run their Python
whenever their queue hands them work, which is mostly while the engine's thread runs its own
host work between kernels: both then take turns on the lock, and each turn can hold the engine
up until the other thread's switch interval runs out (H200, 4 clients: the draft stage of the
same K 0.4-0.9 ms slower in each configuration that adds such a thread).

The engine opens the window just before a blocking read-back and closes it just after
(`waiting()`); a background thread calls `wait(timeout_s)` before a piece of work, so it runs it
while the engine waits on the device. The timeout bounds the wait when no window opens (an idle
engine, a CPU engine, which opens none: there the engine's read-backs do not wait). A piece of
work still running when the window closes goes on; a thread with several pieces checks
`is_open()` between them and waits for the next window. Work longer than a draft read-back
waits for a long window (`wait(long=True)`): the verify's read-back, the round's longest wait.

    window = HostWindow()
    with window.waiting():             # engine thread, around `x.cpu()`
        host = x.cpu()
    window.wait()                      # a background thread, before its next piece of work
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Protocol

WAIT_S = 0.02  # the default of `HostWindow.wait_s`


class HostWindow:
    """Open while the engine's thread is blocked on the device; see the module docstring."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.wait_s = wait_s  # how long `wait()` waits for a window, at most
        self._open = threading.Event()
        self._long = threading.Event()  # open, and the wait is the verify's (the round's longest)
        self.opened = 0  # windows opened so far (the engine's thread is the only writer)

    @contextmanager
    def waiting(self, long: bool = False) -> Iterator[None]:
        """The engine's thread is about to block on the device; `long`: on the verify forward, the
        round's longest wait (the draft chain's read-back lasts a fraction of it)."""
        self.opened += 1
        self._open.set()
        if long:
            self._long.set()
        try:
            yield
        finally:
            self._long.clear()
            self._open.clear()

    def wait(self, timeout_s: float | None = None, long: bool = False) -> bool:
        """Until a window (with `long`, a long one) is open (True) or `timeout_s` (default
        `wait_s`) passed (False)."""
        return (self._long if long else self._open).wait(self.wait_s if timeout_s is None else timeout_s)

    def is_open(self) -> bool:
        """Whether the engine's thread is blocked on the device now."""
        return self._open.is_set()


class FollowsHostWindow(Protocol):
    """A part of the serving process that places its background work in the engine's windows."""

    def follow_window(self, window: HostWindow | None) -> None: ...


def follow(part: object, window: HostWindow | None) -> None:
    """Hand `window` to `part` if it can follow one (publisher, policy); others are left as they are."""
    fn = getattr(part, "follow_window", None)
    if callable(fn):
        fn(window)


class SendsInline(Protocol):
    """A part that can do its background work on the engine's own thread (the capture publisher)."""

    def send_inline(self, on: bool = True) -> None: ...


def run_inline(part: object) -> None:
    """Have `part` (the capture publisher) do its work on the engine's own thread if it can: on a
    CPU, where the engine's torch threads fill the cores, a background thread's work preempts a
    torch worker mid-operation and every thread of that operation waits for it; on the engine's
    thread, between forwards, the work costs only its own time (collector/publisher.py:
    `send_inline`)."""
    fn = getattr(part, "send_inline", None)
    if callable(fn):
        fn(True)


class SendsDeferred(Protocol):
    """A part whose work the engine's thread can pump where it waits least (the capture publisher)."""

    def send_deferred(self, on: bool = True) -> None: ...

    def pump(self) -> None: ...


def place_capture(pub: object, window: HostWindow | None, device_type: str, sender: str = "thread"):
    """Where the capture sink (`pub`) does its work: with `sender` 'engine', kept for the engine's
    thread to pump just before its verify read-back (on a GPU, while the device verifies:
    `SendsDeferred`); otherwise, on a CPU without windows, on the engine's thread between forwards
    (`run_inline`), else on its sender thread in the host windows (`follow`). Returns the pump (or None)."""
    follow(pub, window)
    fn = getattr(pub, "send_deferred", None)
    if sender == "engine" and callable(fn):
        fn(True)
        return pub.pump
    if window is None and device_type == "cpu":
        run_inline(pub)
    return None


def upload(t, device):
    """A host tensor (or a list of ints) on `device` without waiting for the device: on a GPU a
    copy from pageable memory first waits for every kernel already queued on the stream (a hidden
    read-back's stall), so the host could not queue the next stage while the device ran this one;
    from pinned memory the copy is queued like a kernel."""
    import torch

    t = torch.as_tensor(t)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

