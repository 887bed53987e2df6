"""A shared-memory pool that /dev/shm cannot hold is refused when it is made (ConfigError,
nothing left behind), not a SIGBUS that kills the process at its first write into the pages
tmpfs could not give (the segment was sparse). Run in a mount namespace with a 16 MiB
/dev/shm (needs unshare and mount rights: skipped where there are none)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = """
import os, sys
from kvbridge import KVLayout, KVPool
from kvbridge.errors import ConfigError
L = KVLayout.vllm_flash(2, 8, 128, block_size=16, dtype="float16")
try:
    p = KVPool.allocate(L, 256, shared=True)        # 32 MiB in a 16 MiB /dev/shm
    for b in p.buffers:
        b.fill_(1)
    print("no refusal")
except ConfigError as e:
    print("refused", "No space" in str(e), os.listdir("/dev/shm"))
small = KVPool.allocate(L, 16, shared=True)          # 2 MiB fits
for b in small.buffers:
    b.fill_(1)
print("small ok")
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
def test_a_pool_larger_than_dev_shm_is_refused_not_a_sigbus() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} -c '{CHILD}'"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])   # -7 / 135: SIGBUS
    assert "refused True []" in r.stdout and "small ok" in r.stdout, r.stdout
