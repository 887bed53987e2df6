"""``kvbridge up`` keeps its state and default logs in this user's private folder only, removes
the states of deployments that were killed, and reports an embedded lease server that dies."""

from __future__ import annotations

import io
import json
import os
import signal
import tempfile
import threading
import time

import pytest

from kvbridge import ConfigError
from kvbridge.lease import EmbeddedRedis
from kvbridge.workers import launch
from kvbridge.workers.launch import Cluster, UpConfig, running_states, state_path

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tmp(monkeypatch: pytest.MonkeyPatch, tmp_path) -> str:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return str(tmp_path)


def _user_dir(tmp: str) -> str:
    return os.path.join(tmp, f"kvbridge-{os.getuid()}")


@pytest.mark.parametrize("how", ["open to others", "a link"])
def test_up_refuses_a_state_folder_others_could_use(tmp: str, how: str) -> None:
    """In a shared temp directory anyone may make ``kvbridge-<uid>`` first (and read the logs, or
    plant links where they are written): ``start`` refuses it before anything starts."""
    folder = _user_dir(tmp)
    if how == "a link":
        os.mkdir(folder + "-elsewhere", 0o700)
        os.symlink(folder + "-elsewhere", folder)
    else:
        os.mkdir(folder)
        os.chmod(folder, 0o777)
    c = Cluster(UpConfig(port=0), out=io.StringIO())
    with pytest.raises(ConfigError, match="mode 0700"):
        c.start()
    assert not c.children and c.redis is None
    assert running_states() == []                    # nor is a state read from it


def test_a_folder_of_ours_that_others_could_only_read_is_closed(tmp: str) -> None:
    folder = _user_dir(tmp)
    os.mkdir(folder)
    os.chmod(folder, 0o755)                          # as makedirs with the usual umask left it
    with open(state_path(), "w") as f:
        json.dump({"parent_pid": os.getpid(), "proxy": "http://live", "leases": "redis://live"}, f)
    assert [s["proxy"] for s in running_states()] == ["http://live"]
    assert os.stat(folder).st_mode & 0o777 == 0o700


def test_states_of_killed_deployments_are_swept(tmp: str) -> None:
    folder = _user_dir(tmp)
    os.mkdir(folder, 0o700)
    dead = os.path.join(folder, "up-999999999.json")
    with open(dead, "w") as f:
        json.dump({"parent_pid": 2 ** 22 + 12345, "proxy": "http://x", "leases": "redis://x"}, f)
    with open(state_path(), "w") as f:
        json.dump({"parent_pid": os.getpid(), "proxy": "http://live", "leases": "redis://live"}, f)
    assert [s["proxy"] for s in running_states()] == ["http://live"]
    assert not os.path.exists(dead) and os.path.exists(state_path())


def test_a_lease_server_that_dies_is_reported(tmp: str) -> None:
    out = io.StringIO()
    c = Cluster(UpConfig(port=0), out=out)
    c.redis = EmbeddedRedis().start()
    try:
        def kill_then_stop() -> None:
            assert c.redis is not None and c.redis.pid is not None
            os.kill(c.redis.pid, signal.SIGKILL)
            end = time.monotonic() + 20
            while "lease server exited" not in out.getvalue() and time.monotonic() < end:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGHUP)      # wait()'s handler takes it
        t = threading.Thread(target=kill_then_stop)
        t.start()
        c.wait(progress=False)
        t.join(5)
        assert "lease server exited" in out.getvalue()
        assert not c.clean
    finally:
        c.redis.close()
    assert launch.state_path() == os.path.join(_user_dir(tmp), f"up-{os.getpid()}.json")
