"""Shared pools live in sealed memfds, not in /dev/shm: a /dev/shm too small for a pool does not
limit it and nothing is left there (run in a mount namespace with a 16 MiB /dev/shm: needs
unshare and mount rights, skipped where there are none). Their pages are reserved when the pool
is made (``posix_fallocate``), so memory that is not there is a ``ConfigError`` then, with
nothing left behind -- not a SIGBUS at the first write into a page a sparse segment could not get."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from kvbridge import KVLayout, KVPool
from kvbridge.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = KVLayout.vllm_flash(2, 8, 128, block_size=16, dtype="float16")
CHILD = """
import os
from kvbridge import KVLayout, KVPool
L = KVLayout.vllm_flash(2, 8, 128, block_size=16, dtype="float16")
p = KVPool.allocate(L, 256, shared=True)        # 32 MiB, a 16 MiB /dev/shm
for b in p.buffers:
    b.fill_(1)
print("made", sum(b.numel() * b.element_size() for b in p.buffers) >> 20, os.listdir("/dev/shm"))
"""


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, timeout=20)
    return r.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_unshare(),
                    reason="needs a mount namespace (unshare -m, mount rights) to give /dev/shm a small size")
def test_a_pool_larger_than_dev_shm_is_made_and_leaves_nothing_there() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} -c '{CHILD}'"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])   # -7 / 135: SIGBUS
    assert "made 32 []" in r.stdout, r.stdout


@pytest.mark.timeout(60)
def test_a_pools_pages_are_reserved_when_it_is_made() -> None:
    p = KVPool.allocate(L, 16, shared=True)
    try:
        assert p.segment is not None
        st = os.fstat(p.segment.fd)
        assert st.st_blocks * 512 >= p.segment.size > 0        # not sparse
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_no_memory_for_a_pool_is_refused_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="No space"):
        KVPool.allocate(L, 16, shared=True)
    assert sorted(os.listdir("/proc/self/fd")) == before     # the memfd closed: nothing left behind
