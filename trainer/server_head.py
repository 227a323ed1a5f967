"""The daemon follows the server's live head when the server changed it on its own.

The server's head bank (serving/head_bank.py) swaps a head back in when traffic it drafted best
on returns; an automatic rollback of a broken head changes it too. Either way the trainer's idea
of the live head (what the gate compares candidates with, what the rollback monitor watches, what
training continues from) is then wrong. `ServerHeadWatch.changed` asks the server's live version
(control `info`) every `poll_s` and says when it is neither the daemon's live version nor one it
cannot load; the daemon then adopts it (`TrainerDaemon.watch_server_head`).

The same read gives the tags the server's bank holds another head for (`banked_elsewhere`): the
gate does not refuse a candidate for regressing on those (that traffic gets its own head back
when it returns), so the live head may specialise on the traffic of now.
It also says whether the server is idle (`idle`: no running and no waiting request), which sets
the daemon's duty cycle (`DaemonConfig.idle_duty` against `max_duty`).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

log = logging.getLogger(__name__)

SERVER_HEAD_POLL_S = 2.0  # seconds between the daemon's reads of the server's live version
IDLE_POLL_S = 0.5  # ... while the last read found the server idle (its duty cycle is higher then)


def head_version_of(info) -> int | None:
    """The live head version a control `info` answer gives; None where it gives none or an odd one."""
    v = info.get("head_version") if isinstance(info, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def server_live_version(server_info: Callable[[], dict] | None) -> int:
    """The server's live head version (control `info`); -1 with no server to ask or when it cannot say."""
    if server_info is None:
        return -1
    try:
        v = head_version_of(server_info())
    except Exception as e:  # noqa: BLE001 - unreachable now; the caller's other sources decide
        log.warning("server info unavailable: %s", e)
        return -1
    return -1 if v is None else v


class HeadPublisher(Protocol):
    """The server side of a swap: `serving.control.ControlClient`. Both raise on refusal."""

    def swap_dir(self, path: str, version: int | None = None, digest: str | None = None) -> dict: ...
    def rollback(self, version: int | None = None) -> dict: ...
    # optional: `info() -> {"head_version": N, ...}` (the server's live version), used to number
    # published versions after it; `request("trainer_alert", alert_dict)`, the trainer's own alerts


class ServerHeadWatch:
    def __init__(self, poll_s: float = SERVER_HEAD_POLL_S, idle_poll_s: float = IDLE_POLL_S):
        self.poll_s, self.idle_poll_s = poll_s, idle_poll_s
        self.idle = False  # the last read found no running and no waiting request (False: serving, or unknown)
        self.busy = False  # the last read found requests running or waiting (False: idle, or unknown)
        self._next = 0.0
        self._unknown: set[int] = set()  # versions already said to be unloadable
        self.adopted = 0
        self.banked: dict[str, int] = {}  # tag -> version the server's bank holds for it (last read)

    def refuse(self, version: int) -> None:
        """`version` could not be adopted (an unreadable checkpoint): never offered again."""
        self._unknown.add(version)

    def banked_elsewhere(self, live_version: int) -> set[str]:
        """Tags for which the server's bank holds a head other than the live one."""
        return {t for t, v in self.banked.items() if v != live_version}

    def changed(self, now: float, server_info: Callable[[], dict] | None, live_version: int,
                loadable: Callable[[int], bool]) -> int | None:
        """The server's live version when it is due to be read and differs from `live_version`
        and the daemon can load it (one of its own versions, or the one it started from); None
        otherwise. A version it cannot load (an operator's swap from elsewhere) is logged once.
        `server_info`: the control `info` call (None: no server to ask); a failing or odd answer
        reads as "cannot say"."""
        if server_info is None or now < self._next:
            return None
        self._next = now + self.poll_s
        try:
            info = server_info()
        except Exception as e:  # noqa: BLE001 - unreachable now: asked again at the next poll
            log.debug("server info unavailable: %s", e)
            self.idle = self.busy = False
            return None
        self.idle = isinstance(info, dict) and info.get("running_requests") == 0 and info.get("waiting_requests") == 0
        load = [info.get(k) for k in ("running_requests", "waiting_requests")] if isinstance(info, dict) else []
        self.busy = any(isinstance(n, int) and n > 0 for n in load)
        if self.idle:
            self._next = now + self.idle_poll_s
        v = head_version_of(info)
        bank = info.get("head_bank") if isinstance(info, dict) else None
        banked = bank.get("banked") if isinstance(bank, dict) else None
        self.banked = {str(t): e["version"] for t, e in banked.items()
                       if isinstance(e, dict) and isinstance(e.get("version"), int)} if isinstance(banked, dict) else {}
        if v is None or v == live_version or v in self._unknown:
            return None
        if not loadable(v):
            self._unknown.add(v)
            log.warning("the server's live head is v%d, not one this trainer published or started from: "
                        "training goes on from v%d's line", v, live_version)
            return None
        return v
