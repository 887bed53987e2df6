"""Shared pools live in sealed memfds, not in /dev/shm: a /dev/shm too small for a pool does not
limit it and nothing is left there (run in a mount namespace with a 16 MiB /dev/shm: needs
unshare and mount rights, skipped where there are none). Their pages are reserved when the pool
is made (``posix_fallocate``), so memory that is not there is a ``PoolError`` then, with
nothing left behind -- not a SIGBUS at the first write into a page a sparse segment could not get;
a pool larger than the memory left to the process is refused before any of it is reserved (a
memfd has no size limit: the kernel's OOM killer ended the process instead)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

from typing import Any

import pytest

from kvbridge import KVLayout, KVPool
from kvbridge.errors import PoolError

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
    with pytest.raises(PoolError, match="No space"):
        KVPool.allocate(L, 16, shared=True)
    assert sorted(os.listdir("/proc/self/fd")) == before     # the memfd closed: nothing left behind


@pytest.mark.timeout(60)
def test_a_shared_pool_larger_than_the_memory_left_is_refused_before_any_is_taken() -> None:
    from kvbridge.hostlimits import memory_available
    left = memory_available()
    assert left is not None and left > 0
    blocks = left // L.block_nbytes + 1      # just past it (a 100 TB pool was OOM-killed before)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(PoolError, match="left to this process"):
        KVPool.allocate(L, blocks, shared=True)
    with pytest.raises(PoolError, match="shared memory"):
        KVPool.allocate(L, 10**15, shared=True)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_the_memory_left_is_read_from_meminfo_and_cgroups_v2_and_v1(tmp_path: Any) -> None:
    from kvbridge.hostlimits import memory_available

    def tree(name: str, files: dict[str, str], cgroup: str) -> tuple[str, str, str]:
        d = tmp_path / name
        for rel, text in {**files, "meminfo": "MemTotal: 100 kB\nMemAvailable:  4000 kB\nSwapFree: 1000 kB\n",
                          "cgroup": cgroup}.items():
            (d / "sys" / rel if rel not in ("meminfo", "cgroup") else d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / "sys" / rel if rel not in ("meminfo", "cgroup") else d / rel).write_text(text)
        return str(d / "meminfo"), str(d / "cgroup"), str(d / "sys")
    assert memory_available(*tree("none", {"cgroup.controllers": ""}, "0::/\n")) == 5000 * 1024
    v2 = {"cgroup.controllers": "memory", "pod/memory.max": "3000000\n", "pod/memory.current": "1000000\n",
          "pod/c/memory.max": "max\n", "pod/c/memory.current": "900000\n"}
    assert memory_available(*tree("v2", v2, "0::/pod/c\n")) == 2000000
    v1 = {"memory/docker/x/memory.limit_in_bytes": "1500000\n", "memory/docker/x/memory.usage_in_bytes": "500000\n",
          "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "7\n"}
    assert memory_available(*tree("v1", v1, "4:memory:/docker/x\n0::/\n")) == 1000000
    assert memory_available(str(tmp_path / "no"), str(tmp_path / "no"), str(tmp_path)) is None
