"""Fixtures for end-to-end tests: the tiny model, an in-process lease server, and
``kvbridge up`` clusters run as real processes (started once per module, stopped with
SIGINT, checked for leftover processes)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, Optional

import pytest
import torch

from kvbridge.lease import EmbeddedRedis
from kvbridge.workers.model import CausalLM


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    return CausalLM.from_seed("tiny", seed=0)


@pytest.fixture(scope="session")
def lease_url() -> Iterator[str]:
    with EmbeddedRedis() as r:
        yield r.url


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class UpProcess:
    """``python -m kvbridge up ...`` as a child process of the test."""

    def __init__(self, *args: str, startup: float = 90.0, cwd: Optional[str] = None) -> None:
        for _ in range(3):  # a free port can be taken by another process before `up` binds it
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            # -P: like the console script, the parent does not import from the current folder
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kvbridge", "up", "--port", str(self.port),
                                          "--no-progress", *args], stdin=subprocess.DEVNULL, cwd=cwd,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True)  # its own process group, as in a terminal
            if self._wait_healthy(startup):
                break
        else:
            raise RuntimeError("kvbridge up found no free port in 3 tries")
        self.worker_pids = [int(w["pid"]) for w in self.health["workers"]]

    def _wait_healthy(self, startup: float) -> bool:
        """True once healthy; False if `up` lost its port to another process; raises otherwise."""
        deadline = time.monotonic() + startup
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                if "already in use" in err:
                    return False
                raise RuntimeError(f"kvbridge up exited: {err}")
            try:
                status, body = get(self.url + "/health", timeout=2.0)
                health = json.loads(body)
                if status == 200 and health.get("mode"):
                    self.health = health
                    return True
            except (OSError, ValueError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("kvbridge up did not become healthy")
            time.sleep(0.2)

    def workers(self, role: Optional[str] = None) -> list[dict[str, Any]]:
        _, body = get(self.url + "/health", timeout=10.0)
        return [w for w in json.loads(body)["workers"] if role is None or w.get("role") == role]

    def stop(self, timeout: float = 30.0) -> tuple[int, str]:
        """SIGINT to its process group (a Ctrl-C in its terminal), wait, and return (exit code, stderr)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            for pid in self.worker_pids:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise
        return self.proc.returncode, err


def assert_stopped_cleanly(up: UpProcess) -> None:
    code, err = up.stop()
    assert code == 0, err[-2000:]
    deadline = time.monotonic() + 5.0
    while any(pid_alive(p) for p in up.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in up.worker_pids if pid_alive(p)], "worker processes outlived kvbridge up"
