"""Second review of the lease store and its embedded server: each test failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest

from kvbridge.lease import EmbeddedRedis

pytestmark = pytest.mark.timeout(30)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    return p.pid


@pytest.fixture
def live() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "pidfd_open"),
                    reason="the sweep stops orphans through /proc and pidfds (Linux)")
def test_sweep_does_not_follow_a_link_to_a_live_servers_folder(live: EmbeddedRedis) -> None:
    """Anyone may create ``kvbridge-redis-<dead pid>-x`` in the shared temp directory. Before: a
    link of that name to a live server's (private) folder made the next sweep -- any
    EmbeddedRedis of this user -- read that server's pid through it and SIGKILL it, as the
    'orphan of a dead owner': every lease of the victim gone. Now only real folders of this
    user are swept."""
    link = os.path.join(tempfile.gettempdir(), f"kvbridge-redis-{_dead_pid()}-link")
    os.symlink(live._dir, link)
    try:
        with EmbeddedRedis():         # its constructor sweeps dead owners' folders
            pass
        assert live.running, "the sweep killed a live server through a link to its folder"
        assert os.path.isdir(live._dir)
    finally:
        os.unlink(link)
