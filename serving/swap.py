"""Versioned head swaps: the one helper that turns a published checkpoint into the live head.

A swap is a versioned publish (the trainer wrote a new directory and recorded its digest); here
it is received, checked and applied in five steps, all off the engine thread except the last:

    1) locate   a checkpoint directory under the allowed roots (resolved, no `..`/symlink
                escape, and no file in it a symlink leading out of them), or tensors sent inline
                with their config, version and digest
    2) verify   the digest; then the codec's own checks (`open_checkpoint`: regular files only,
                bounded reads; `validate_tensors`, `check_compatible` with the target); then the
                version (0..MAX_VERSION, from the request or the checkpoint's metadata)
    3) load     into a spare head module (the one evicted two swaps ago, reused when the shape
                matches), never into the live one, and run it: a probe draft step must give
                finite logits (`serving.head_probe`)
    4) switch   `server.swap(head, version)`: the engine installs it between rounds; we wait
                until it is live
    5) keep     the head it replaced as `previous`, untouched, for `rollback()` (bit-identical)

Any failure before step 4 raises `SwapError` with the reason and leaves serving untouched.

A head comes with its own draft vocabulary map (d2t/t2d): the embedded engine reads
`head.draft_to_target` of the head that drafts, so heads trained for different traffic (the
packaged chat and code heads) swap freely. (An SGLang server keeps the map its worker started
with; there `serving.sglang_client` refuses a head with another map.) The packaged heads'
directory (`online_spec.PRETRAINED_HEADS`) is always an allowed root.

`rollback_broken(reason)` is the server's own rollback when the live head's drafts turn
non-finite: the previous head (or plain decoding if there is none) goes live and the broken
head is dropped, not kept as `previous`.

    swapper = HeadSwapper(server, allowed_roots=[Path("runs/heads")])
    swapper.swap_dir("runs/heads/v7")            # -> {"version": 7, "digest": ..., "landed": True}
    swapper.rollback()                           # previous head back, exactly
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from online_spec.capture import MAX_VERSION
from online_spec.checkpoint import (CHECKPOINT_FILES, CheckpointError, build_head, check_compatible,
                                    head_config_from_json, open_checkpoint, validate_tensors)
from online_spec.head import EagleHead

log = logging.getLogger(__name__)

# dtypes a swap may carry inline (the checkpoint's float weights, d2t, t2d)
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class SwapError(ValueError):
    """A swap or rollback was refused; the message is the reason. Serving is untouched."""


@dataclass
class HeadVersion:
    """One installed (or installable) head and where it came from."""

    head: EagleHead | None
    version: int
    digest: str | None
    source: str

    def describe(self) -> dict:
        return {"version": self.version, "digest": self.digest, "source": self.source}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of inline tensors: for each name in sorted order, name, dtype, shape, raw bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw buffer of a contiguous CPU tensor (bf16 included), without a copy."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def tensor_from_bytes(buf, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """Rebuild a tensor from its raw buffer; checks dtype name and byte count."""
    if dtype_name not in WIRE_DTYPES:
        raise SwapError(f"dtype {dtype_name!r} is not accepted (one of {sorted(WIRE_DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SwapError(f"shape {shape!r} is not a list of non-negative integers")
    dtype = WIRE_DTYPES[dtype_name]
    numel = 1
    for d in shape:
        numel *= d
    size = numel * torch.empty((), dtype=dtype).element_size()
    if len(buf) != size:
        raise SwapError(f"buffer of {len(buf)} bytes for {dtype_name}{shape}, expected {size}")
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)


def resolve_under(path: str, roots: list[Path]) -> Path:
    """`path` resolved (symlinks, `..`), if it lies under one of `roots` and so does every
    checkpoint file in it (a file symlink leading out of the roots is not followed); else SwapError."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SwapError("checkpoint directory must be a non-empty string")
    try:
        resolved = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise SwapError(f"checkpoint directory {path} does not exist") from None
    if not _under(resolved, roots):
        raise SwapError(f"checkpoint directory {resolved} is outside the allowed roots "
                        f"{[str(r) for r in roots]}")
    for name in CHECKPOINT_FILES:
        f = resolved / name
        if f.is_symlink() and not _under(f.resolve(), roots):
            raise SwapError(f"{name} in {resolved} is a symlink to {f.resolve()}, outside the allowed roots")
    return resolved


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(root.resolve()) for root in roots)


def check_version(v) -> int:
    """A head version: an integer in 0..MAX_VERSION (what a capture record can carry)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_VERSION:
        raise SwapError(f"version must be an integer in 0..{MAX_VERSION} (2**62), got {str(v)[:40]}")
    return v


class HeadSwapper:
    """Validates, loads and installs heads into a `SpecServer`; keeps live, previous and a spare."""

    def __init__(self, server, allowed_roots: list[Path], land_timeout_s: float = 30.0):
        self.server = server
        self.engine = server.engine
        self.probe = server.head_probe
        self.allowed_roots = [Path(r) for r in allowed_roots]
        self.land_timeout_s = land_timeout_s
        self.live = HeadVersion(self.engine.head, self.engine.head_version, None, "initial")
        self.previous: HeadVersion | None = None
        self._spare: EagleHead | None = None
        self._lock = threading.Lock()  # one swap at a time
        self.swaps = self.rollbacks = self.refused = self.auto_rollbacks = 0
        self.last_swap: dict | None = None
        self.last_fault: dict | None = None
        self.holds: Callable[[EagleHead], bool] = lambda head: False  # a head bank's: never reuse its modules

    # -- commands -------------------------------------------------------------------------------
    def swap_dir(self, path: str, version: int | None = None, digest: str | None = None) -> dict:
        """Swap in the checkpoint directory `path` (under the allowed roots)."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                d = resolve_under(path, self.allowed_roots)
                ck = open_checkpoint(d)  # regular files, bounded; refuses pickles, checks the meta digest
                if digest is not None and digest != ck.digest:
                    raise SwapError(f"digest mismatch: request says {str(digest)[:80]}, model.safetensors "
                                    f"has {ck.digest}")
                validate_tensors(ck.cfg, ck.tensors)  # the head's own faults first, then its version
                head = self._validate_and_load(ck.cfg, ck.tensors)
                try:
                    version = self._version(version, ck.meta.get("version"), "online_spec.json")
                except SwapError:
                    self._spare = head  # unused: reusable by the next swap
                    raise
            except CheckpointError as e:
                self.refused += 1
                raise SwapError(str(e)) from None
            except SwapError:
                self.refused += 1
                raise
            return self._install(HeadVersion(head, version, ck.digest, str(d)), t0)

    def swap_tensors(self, config: dict, tensors: dict[str, torch.Tensor], version: int, digest: str) -> dict:
        """Swap in tensors sent inline, with their config.json dict, version and digest."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                if not isinstance(config, dict):
                    raise SwapError("config must be the checkpoint's config.json object")
                actual = tensors_digest(tensors)
                if digest != actual:
                    raise SwapError(f"digest mismatch: request says {str(digest)[:80]}, tensors hash to {actual}")
                if version is None:
                    raise SwapError("an inline swap needs its version")
                version = check_version(version)
                cfg = head_config_from_json(config)
                validate_tensors(cfg, tensors)
                head = self._validate_and_load(cfg, tensors)
            except CheckpointError as e:
                self.refused += 1
                raise SwapError(str(e)) from None
            except SwapError:
                self.refused += 1
                raise
            return self._install(HeadVersion(head, version, actual, "inline"), t0)

    def swap_banked(self, banked: HeadVersion) -> dict:
        """Reinstall a head the server had live before (serving/head_bank.py), the very module,
        validated when it first came in; live becomes previous."""
        t0 = time.perf_counter()
        with self._lock:
            if banked.head is None or banked.head is self.live.head:
                raise SwapError("the banked head is already live (or none)")
            return self._install(banked, t0)

    def rollback(self, version: int | None = None) -> dict:
        """Reinstall the previous head (the very module, weights untouched); live becomes previous.
        `version`: roll back only while that version is live. A caller that judged version v bad
        must not reinstall v: after another swap (the head bank's, an operator's) the previous
        head may be v itself."""
        t0 = time.perf_counter()
        with self._lock:
            if version is not None and self.live.version != version:
                raise SwapError(f"v{version} is not live (v{self.live.version} is): nothing to roll back")
            if self.previous is None:
                raise SwapError("no previous head to roll back to")
            return self._install(self.previous, t0, rollback=True)

    def rollback_broken(self, reason: str) -> dict:
        """The live head drafts non-finite values: install the last good head and drop the broken
        one (it is never kept as `previous`). The last good head is the previous one when the
        broken head is the one this swapper installed, else (a head installed around it, with
        `server.swap`) this swapper's live one; plain decoding if there is none. Call it off the
        engine thread: it waits for the switch, which the engine thread makes."""
        t0 = time.perf_counter()
        with self._lock:
            broken, version = self.engine.head, self.engine.head_version
            if broken is None:
                return {"skipped": "no head is live"}
            if broken is self.live.head:
                back = self.previous
            else:
                back = self.live
            back = back or HeadVersion(None, version, None, "plain decoding (no previous head)")
            self.auto_rollbacks += 1
            self.last_fault = {"version": version, "reason": reason, "time": time.time(),
                               "replaced_by": back.version, "plain_decoding": back.head is None}
            log.error("head v%d drafts non-finite values (%s): rolling back to %s", version, reason,
                      f"v{back.version}" if back.head is not None else "plain decoding")
            self.live = HeadVersion(broken, version, None, "broken")
            out = self._install(back, t0, rollback=True)
            self.previous = None  # never roll back into the broken head
            return out

    def info(self) -> dict:
        return {"live": self.live.describe(), "previous": None if self.previous is None else self.previous.describe(),
                "swaps": self.swaps, "rollbacks": self.rollbacks, "refused": self.refused,
                "auto_rollbacks": self.auto_rollbacks, "last_fault": self.last_fault,
                "last_swap": self.last_swap, "allowed_roots": [str(r) for r in self.allowed_roots]}

    # -- steps -----------------------------------------------------------------------------------
    @staticmethod
    def _version(requested, from_meta, source: str) -> int:
        if requested is None and from_meta is None:
            raise SwapError(f"no version: the request gives none and the checkpoint has no {source} "
                            "(pass --version)")
        return check_version(requested if requested is not None else from_meta)

    def _validate_and_load(self, cfg, tensors: dict[str, torch.Tensor]) -> EagleHead:
        """Compatibility with the target, then the tensors into a spare module, then a probe
        draft on it. The head keeps its own vocabulary map (the engine drafts through it)."""
        check_compatible(cfg, self.engine.target.info)
        head = self._load_spare(cfg, tensors)
        problem = self.probe.check(head)
        if problem is not None:
            self._spare = head  # unused: reusable by the next swap
            raise SwapError(f"the head cannot draft: {problem}")
        return head

    def _load_spare(self, cfg, tensors: dict[str, torch.Tensor]) -> EagleHead:
        """Copy validated tensors into the spare module (allocating one if none fits)."""
        target = self.engine.target
        spare, self._spare = self._spare, None
        if spare is None or spare.cfg != cfg:
            return build_head(cfg, tensors, target.dtype, target.device)
        with torch.no_grad():
            params = dict(spare.named_parameters())
            for name, t in tensors.items():
                if name in params:
                    params[name].copy_(t)
            spare.set_vocab_map(tensors["d2t"].long().to(target.device), tensors["t2d"].to(target.device))
        return spare

    def _install(self, new: HeadVersion, t0: float, rollback: bool = False) -> dict:
        """Hand `new` to the engine, wait until it is live, rotate live -> previous -> spare."""
        t_ready = time.perf_counter()
        self.server.swap(new.head, new.version, rollback=rollback)
        landed = self._wait_live(new.head)
        old_previous = self.previous
        self.previous, self.live = self.live, new
        if not rollback and old_previous is not None and old_previous.head is not None \
                and old_previous.head is not self.live.head and not self.holds(old_previous.head):
            self._spare = old_previous.head
        if rollback:
            self.rollbacks += 1
        else:
            self.swaps += 1
        self.last_swap = {"version": new.version, "digest": new.digest, "rollback": rollback, "landed": landed,
                          "prepare_s": t_ready - t0, "land_s": time.perf_counter() - t_ready}
        return {**self.last_swap, "previous_version": self.previous.version}

    def _wait_live(self, head: EagleHead | None) -> bool:
        deadline = time.monotonic() + self.land_timeout_s
        while time.monotonic() < deadline:
            if self.engine.head is head and not self.engine.has_pending:
                return True
            time.sleep(0.001)
        return False
