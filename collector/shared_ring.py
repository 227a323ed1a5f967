"""Host slots in shared memory: the engine copies a round's verify outputs in, a sender process reads them.

`SharedRing` is a `HostRing` (online_spec/host_ring.py) whose slots are files in /dev/shm (mode
0600: they hold users' text as hidden states), mapped by the serving process and, by name, by
the sender process (`SlotReader`). On CUDA each slot is page-locked in place
(`cudaHostRegister`), so the engine's copies into it stay asynchronous, as into `HostRing`'s
pinned memory. A slot is busy from the round's submit (`mark`) until the sender process has
encoded it (`SlotReader.free`) or the publisher dropped the round (`free`): a byte per slot in a
shared control file, which also carries the sender's counters (`COUNTERS`), so neither side
sends the other a message to learn them. The serving process holds a shared `flock` on its
control file while the ring lives: that lock, not the pid in the files' names, tells a later
ring (`remove_stale`) whether the files' owner is gone, so a serving process in another pid
namespace sharing /dev/shm, or a pid reused since, is judged by what the kernel knows. With
every slot busy a round is copied into a scratch slot that is never sent (`overflow_id` None),
and the publisher counts it dropped: the sender process reads only shared slots, and fresh
pinned memory would cost the decode path an allocation.

    ring = SharedRing(pin=torch.cuda.is_available())
    f, h, ev = ring.stage(feats, final)         # engine; ring.last is the slot
    ring.mark(ring.last); desc = ring.describe(ring.last)   # publisher, then to the sender process
    reader = SlotReader(ring.control_path, ring.max_slots)  # sender process
    f, h = reader.views(desc, n)
    reader.free(desc[0])
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import tempfile
import time

import numpy as np
import torch

from online_spec.host_ring import HostRing

log = logging.getLogger(__name__)
# the sender process's counters in the control file, after the slots' busy bytes
PUB_COUNTERS = ("sent", "messages_sent", "dropped_hwm", "dropped_no_subscriber", "dropped_invalid", "bytes_sent",
                "end_markers_sent", "end_markers_dropped", "send_errors", "dropped_queue_full")  # its publisher's
COUNTERS = ("items_done", "records_done", "subscribed", *PUB_COUNTERS)
PREFIX = "online-spec-capture-"  # then the serving process's pid
NEW_GRACE_S = 60.0  # an unlocked control file under its private name this young may be being made
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _control_bytes(max_slots: int) -> tuple[int, int]:
    """(offset of the counters, total size) of a control file for `max_slots` slots."""
    off = (max_slots + 7) // 8 * 8
    return off, off + 8 * len(COUNTERS)


class _Control:
    """The control file's views: `busy` [max_slots] uint8, `counters` [len(COUNTERS)] int64."""

    def __init__(self, path: str, max_slots: int, create: bool):
        off, size = _control_bytes(max_slots)
        self.lock_fd = None
        if create:  # made under a private name, locked, then renamed: no moment where it is unlocked
            tmp = f"{path}.{os.getpid()}.new"
            self.mm = _map(tmp, size, create=True)
            self.lock_fd = os.open(tmp, os.O_RDONLY)
            fcntl.flock(self.lock_fd, fcntl.LOCK_SH)
            os.rename(tmp, path)
        else:
            self.mm = _map(path, size, create=False)
        self.path = path
        self.busy = np.frombuffer(self.mm, dtype=np.uint8, count=max_slots)
        self.counters = np.frombuffer(self.mm, dtype=np.int64, count=len(COUNTERS), offset=off)

    def counter(self, name: str) -> int:
        return int(self.counters[COUNTERS.index(name)])


def _register(t: torch.Tensor, path: str) -> bool:
    """Page-lock `t`'s memory (the map of `path`) in place for async copies; False where CUDA cannot
    (then the copies into it wait for the device: correct, slower). On the H200 VM CUDA page-locks
    a map of a file in /dev/shm and refuses one under /tmp (error 1)."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except Exception as e:  # noqa: BLE001 - no CUDA runtime binding: pageable memory
        log.warning("shared capture slots: cannot page-lock (%s); copies into them will wait for the device", e)
        return False
    if int(err) != 0:
        log.warning("shared capture slots: cudaHostRegister failed (error %d) for %s; copies into them will wait "
                    "for the device", int(err), path)
        return False
    return True


def owner_alive(control_path: str) -> bool:
    """Whether a live process holds `control_path`'s lock (a ring's owner, for as long as the ring
    lives). False for a file nobody has locked, or one that is gone."""
    try:
        fd = os.open(control_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock, if it got one
    return False


def remove_stale(directory: str) -> int:
    """Remove this user's slot and control files whose ring's owner is gone (killed before
    `close`): an owner is alive while it holds its control file's lock (`owner_alive`); slot files
    whose control file is missing belong to a ring that closed or died. A control file under its
    private `.new` name is left to its maker while locked or younger than `NEW_GRACE_S`. Returns
    how many files went. Run when a ring is made."""
    names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    alive = {n[:-len(".ctl")] for n in names
             if n.endswith(".ctl") and owner_alive(os.path.join(directory, n))}
    removed = 0
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(".ctl"):
            owner = name[:-len(".ctl")]
        elif name.endswith(".slot"):
            owner = name[:-len(".slot")].rsplit("-", 1)[0]
        elif name.endswith(".new"):  # a control file before its maker renames it: judged by its own lock
            owner = ""
        else:
            continue
        try:
            st = os.stat(path)
            if owner in alive or st.st_uid != os.getuid():
                continue
            if not owner and (time.time() - st.st_mtime < NEW_GRACE_S or owner_alive(path)):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


class SharedRing(HostRing):
    """`HostRing` over shared-memory slots (see the module docstring). `pin`: page-lock them (CUDA).
    A closed ring stages every round into its scratch slot (nothing is sent any more)."""

    def __init__(self, *, pin: bool, max_slots: int = 32, directory: str = ""):
        super().__init__(pin=pin, max_slots=max_slots)
        self.dir = directory or _shm_dir()
        n = remove_stale(self.dir)
        if n:
            log.info("shared capture slots: removed %d files of serving processes that are gone", n)
        self.prefix = f"{PREFIX}{os.getpid()}-{id(self):x}"
        self.control_path = os.path.join(self.dir, self.prefix + ".ctl")
        self.control = _Control(self.control_path, max_slots, create=True)
        self.files: dict[int, tuple[str, int, str, str, int, int]] = {}  # index -> describe() without the index
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor, bool]] = {}  # index -> (map, byte view, registered)
        self._made = 0
        self._scratch = None
        self.closed = False

    def _reusable(self) -> bool:
        return True

    def _is_free(self, j: int) -> bool:
        return not self.control.busy[j]

    def _new_slot(self, rows: int, feats: torch.Tensor, final: torch.Tensor, index: int | None = None):
        if index is None:  # the scratch slot (`_overflow`): private memory, never sent
            return super()._new_slot(rows, feats, final)
        self._release(index)
        fdim, hdim = feats.shape[-1], final.shape[-1]
        fbytes, hbytes = rows * fdim * feats.element_size(), rows * hdim * final.element_size()
        self._made += 1
        path = os.path.join(self.dir, f"{self.prefix}-{self._made}.slot")
        mm = _map(path, fbytes + hbytes, create=True)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        registered = self.pin and feats.is_cuda and _register(raw, path)
        self._maps[index] = (mm, raw, registered)
        fdt, hdt = _dtype_name(feats.dtype), _dtype_name(final.dtype)
        self.files[index] = (path, rows, fdt, hdt, fdim, hdim)
        f, h = _slot_views(raw, rows, fdim, hdim, feats.dtype, final.dtype)
        return f, h, (torch.cuda.Event(blocking=True) if feats.is_cuda else None), 0, 0  # as HostRing's

    def _take(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        if self.closed:  # no slot files any more
            self.last = None
            return self._overflow(n, feats, final)
        return super()._take(n, feats, final)

    def _overflow(self, n: int, feats: torch.Tensor, final: torch.Tensor):
        """Every slot busy: the copies go to one private scratch slot, and the round is not sent."""
        self.unpooled += 1
        s = self._scratch
        if s is None or s[0].shape[0] < n or s[0].shape[1] != feats.shape[-1] or s[1].shape[1] != final.shape[-1] \
                or s[0].dtype != feats.dtype or s[1].dtype != final.dtype:
            s = self._scratch = super()._new_slot(max(n, 32), feats, final)
        return s

    def describe(self, j: int) -> tuple:
        """What the sender process needs to map slot `j`: (index, path, rows, feature dtype, final
        dtype, feature width, final width)."""
        return (j, *self.files[j])

    def mark(self, j: int) -> None:
        self.control.busy[j] = 1

    def free(self, j: int) -> None:
        self.control.busy[j] = 0

    def _release(self, j: int) -> None:
        """Unmap slot `j`'s file (a bigger slot replaces it) once no copy can still target it."""
        old = self._maps.pop(j, None)
        path = self.files.pop(j, (None,))[0]
        ev = self.slots[j][2] if j < len(self.slots) else None
        if j < len(self.slots):
            self.slots[j] = (torch.empty(0), torch.empty(0), None, 0, 0)
        if old is None:
            return
        mm, raw, registered = old
        if registered:
            if ev is not None:
                ev.synchronize()  # the last copies into it (recorded before the event) have landed
            torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())
        del raw
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self) -> None:
        """Remove every slot file and the control file (the sender process keeps its mappings
        until it exits; the memory goes with the last one)."""
        if self.closed:
            return
        self.closed = True
        for j in list(self._maps):
            self._release(j)
        try:
            os.unlink(self.control_path)
        except OSError:
            pass
        if self.control.lock_fd is not None:
            os.close(self.control.lock_fd)
            self.control.lock_fd = None


def _dtype_name(dt: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"shared capture slots: unsupported dtype {dt}")


def _slot_views(raw: torch.Tensor, rows: int, fdim: int, hdim: int, fdt: torch.dtype, hdt: torch.dtype):
    fbytes = rows * fdim * torch.empty(0, dtype=fdt).element_size()
    f = raw[:fbytes].view(fdt).view(rows, fdim)
    h = raw[fbytes:].view(hdt).view(rows, hdim)
    return f, h


class SlotReader:
    """The sender process's side: maps slots by their description and frees them."""

    def __init__(self, control_path: str, max_slots: int):
        self.control = _Control(control_path, max_slots, create=False)
        self._maps: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # index -> (path, f, h)

    def views(self, desc: tuple, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` rows of slot `desc[0]` (features, final hidden), mapping its file if new."""
        j, path, rows, fdt, hdt, fdim, hdim = desc
        got = self._maps.get(j)
        if got is None or got[0] != path:
            mm = _map(path, rows * fdim * _DTYPES[fdt].itemsize + rows * hdim * _DTYPES[hdt].itemsize, create=False)
            f, h = _slot_views(torch.frombuffer(mm, dtype=torch.uint8), rows, fdim, hdim, _DTYPES[fdt], _DTYPES[hdt])
            got = self._maps[j] = (path, f, h)
        if not 0 < n <= got[1].shape[0]:
            raise ValueError(f"slot {j}: {n} rows asked of {got[1].shape[0]}")
        return got[1][:n], got[2][:n]

    def free(self, j: int) -> None:
        self.control.busy[j] = 0

    def set(self, name: str, value: int) -> None:
        self.control.counters[COUNTERS.index(name)] = value
