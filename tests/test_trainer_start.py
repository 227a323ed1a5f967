"""The trainer's start-up after a trainer was killed while DeepSpeed built its op (issue 32).

torch's JIT extension loader guards a build with a lock file it holds open; a process killed
there leaves the file, and every later `online-spec train` waited on it forever, silently. Now
the stale lock (no live process holds it) is cleared and said, a live one is waited on while
saying so, and the op is then loaded from its cache. Real DeepSpeed and torch loader, in a
subprocess with its own TORCH_EXTENSIONS_DIR (a copy of the built op, so nothing is rebuilt and
the shared cache is never locked).
"""

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from trainer.ds_ops import clear_stale_lock

REPO = Path(__file__).resolve().parents[1]
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")  # this process's group, not the child's
START = textwrap.dedent("""
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    from trainer.distill import ensure_distributed
    ensure_distributed()
    print("process group ready")
""")


def built_op_dir() -> Path:
    code = ("from deepspeed.accelerator import get_accelerator; from torch.utils.cpp_extension import "
            "_get_build_directory as g; print(g(get_accelerator().create_op_builder('ShareMemCommBuilder').NAME, False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    return Path(out.stdout.strip().splitlines()[-1])


def test_a_stale_build_lock_is_cleared_and_said(tmp_path):
    src = built_op_dir()
    ext = tmp_path / "ext"
    ext.mkdir()
    if src.is_dir():  # the op as built on this machine (copied with its timestamps: ninja has nothing to do)
        shutil.copytree(src, ext / src.name, symlinks=True)
    build = ext / src.name
    build.mkdir(exist_ok=True)
    (build / "lock").touch()  # what a trainer killed mid-build leaves
    out = subprocess.run([sys.executable, "-c", START], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS},
                              "TORCH_EXTENSIONS_DIR": str(ext)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "process group ready" in out.stdout
    assert f"removed a stale build lock {build / 'lock'}" in out.stderr
    assert "DeepSpeed op deepspeed_shm_comm ready" in out.stderr
    assert not (build / "lock").exists()


def test_a_live_lock_is_waited_on_saying_so(tmp_path, caplog):
    build = tmp_path / "op"
    build.mkdir()
    lock = build / "lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)   # as torch's FileBaton does
        print("holding", flush=True)
        time.sleep(1.5)
        os.close(fd)
        os.remove({str(lock)!r})
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with caplog.at_level(logging.INFO, logger="trainer.ds_ops"):
            clear_stale_lock(build, poll_s=0.05)  # returns once the owner released it
        assert f"waiting for pid {holder.pid} to finish building in {build}" in caplog.text
    finally:
        holder.wait(30)
    assert not lock.exists()
