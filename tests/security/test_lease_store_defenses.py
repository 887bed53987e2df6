"""The embedded lease server against local squatters, orphaning and a lease server that lies.

Each test runs real servers (the embedded valkey, or a hostile listener) on loopback ports
of its own and is bounded in time. A squatter is a socket that records what it receives:
the embedded server's password must never reach one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Iterator, Optional

import pytest
from loopback import Listener

from kvbridge import KVBridgeError, KVLayout, KVPool, KVReceiver, ProtocolError
from kvbridge.errors import LeaseStoreUnavailable
from kvbridge.handle import KVHandle
from kvbridge.lease import EmbeddedRedis, RedisLeaseStore
from kvbridge.lease.credentials import with_password
from kvbridge.lease.embedded import find_server_binary
from kvbridge.policy import Retry

pytestmark = pytest.mark.timeout(30)
ONE_TRY = Retry(attempts=1, deadline=2.0)


def _binary() -> str:
    try:
        return find_server_binary()
    except KVBridgeError as exc:
        pytest.skip(f"no Redis-protocol server binary: {exc}")


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    _binary()
    with EmbeddedRedis() as srv:
        yield srv


class Squatter(Listener):
    """A listener that records every byte it receives; ``answer`` (if any) is sent back per chunk,
    and a connection is dropped after ``idle_s`` of silence."""

    def __init__(self, sock: socket.socket, answer: bytes = b"", idle_s: float = 0.5) -> None:
        self.answer, self.idle_s = answer, idle_s
        self.got: list[bytes] = []
        super().__init__(sock)

    @classmethod
    def on(cls, family: socket.AddressFamily, host: str, port: int, answer: bytes = b"") -> "Squatter":
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return cls(s, answer)

    def _conn(self, c: socket.socket) -> None:
        c.settimeout(self.idle_s)
        with c:
            while True:
                try:
                    chunk = c.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                self.got.append(chunk)
                if self.answer:
                    c.sendall(self.answer)

    def received(self, secret: str) -> bool:
        return secret.encode() in b"".join(self.got)


# -- 1. the password goes only to 127.0.0.1:<port>, never to [::1] or localhost ---------------

def test_password_never_sent_to_ipv6_or_localhost_on_the_same_port(server: EmbeddedRedis) -> None:
    """The embedded server binds 127.0.0.1 only: [::1]:<same port> is free for any local user,
    and ``localhost`` may resolve there. A store on such a URL -- as a forged handle's lease_url
    makes a receiver open -- must not authenticate with the embedded server's password."""
    try:
        squat = Squatter.on(socket.AF_INET6, "::1", server.port)
    except OSError as exc:
        pytest.skip(f"cannot listen on [::1]:{server.port} (no IPv6 on loopback?): {exc}")
    try:
        assert server.password in with_password(server.url)         # the lookup itself works
        for url in (f"redis://[::1]:{server.port}/0", f"redis://localhost:{server.port}/0",
                    f"rediss://127.0.0.1:{server.port}/0"):
            assert with_password(url) == url, url
        store = RedisLeaseStore(f"redis://[::1]:{server.port}/0", retry=ONE_TRY, socket_timeout=1.0,
                                connect_timeout=1.0)
        with pytest.raises(KVBridgeError):
            store.get("x")
        store.close()
        deadline = time.monotonic() + 2.0
        while not squat.got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert squat.got, "the client never reached [::1]: the test proves nothing"
        assert not squat.received(server.password), "the password was sent to [::1]"
    finally:
        squat.close()


# -- 2. startup never sends the password to whoever holds the TCP port ------------------------

def test_start_on_a_squatted_port_fails_without_sending_the_password() -> None:
    """A listener that answers +OK/+PONG to anything holds the port: start() must not AUTH to
    it, must not report running, and must not record the password for that address."""
    _binary()
    squat = Squatter.on(socket.AF_INET, "127.0.0.1", 0, answer=b"+OK\r\n+PONG\r\n")
    port = squat.sock.getsockname()[1]
    srv = EmbeddedRedis(port=port)
    try:
        with pytest.raises(LeaseStoreUnavailable, match="taken"):
            srv.start()
        assert not srv.running
        assert with_password(srv.url) == srv.url
        assert not squat.received(srv.password)
    finally:
        srv.close()
        squat.close()


def test_restart_on_a_squatted_port_fails_without_sending_the_password(server: EmbeddedRedis) -> None:
    """restart() reuses port and password: once stopped, the port is anyone's, so the password
    is no longer offered for it, and the new start must not hand it to the squatter."""
    assert server.password in with_password(server.url)
    server.stop()
    assert with_password(server.url) == server.url          # forgotten with the server
    squat = Squatter.on(socket.AF_INET, "127.0.0.1", server.port, answer=b"+OK\r\n+PONG\r\n")
    try:
        with pytest.raises(LeaseStoreUnavailable):
            server.restart()
        assert not server.running
        assert not squat.received(server.password)
        assert with_password(server.url) == server.url
    finally:
        squat.close()


# -- 3. the server dies with its owner, whichever thread started it ---------------------------

def _alive(pid: int) -> bool:
    """Running (a zombie is dead, only not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


_OWNER = """
import sys, threading, time
from kvbridge.lease import EmbeddedRedis
srv = EmbeddedRedis()
t = threading.Thread(target=srv.start)      # e.g. a connector building its sender on a worker thread
t.start(); t.join()
print(srv.pid, srv._dir, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux only")
def test_server_started_off_the_main_thread_dies_with_a_killed_owner() -> None:
    _binary()
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    spid_s, folder = owner.stdout.readline().split()
    spid = int(spid_s)
    try:
        assert _alive(spid)
        time.sleep(0.3)                       # the starting worker thread has ended by now
        assert _alive(spid), "the server died with the thread that started it"
        owner.kill()
        owner.wait(10)
        assert _wait_dead(spid, 5.0), "the embedded server outlived its kill -9'd owner"
    finally:
        if _alive(spid):
            os.kill(spid, signal.SIGKILL)
        owner.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    return p.pid


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "pidfd_open"),
                    reason="the sweep stops orphans through /proc and pidfds (Linux)")
def test_sweep_stops_a_dead_owners_server_and_nothing_else() -> None:
    """A server whose owner died without taking it along (no PDEATHSIG) is stopped by the next
    sweep; a process of ours that its folder merely names, running elsewhere, is left alone."""
    binary = _binary()
    dead = _dead_pid()
    orphan_dir = tempfile.mkdtemp(prefix=f"kvbridge-redis-{dead}-")
    decoy_dir = tempfile.mkdtemp(prefix=f"kvbridge-redis-{dead}-")
    orphan = subprocess.Popen([binary, "--port", "0", "--save", "", "--appendonly", "no", "--dir", orphan_dir,
                               "--unixsocket", os.path.join(orphan_dir, "s.sock")],
                              cwd=orphan_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    decoy = subprocess.Popen(["sleep", "30"], cwd=tempfile.gettempdir(), start_new_session=True)
    srv: Optional[EmbeddedRedis] = None
    try:
        with open(os.path.join(orphan_dir, "server.pid"), "w") as f:
            f.write(str(orphan.pid))
        with open(os.path.join(decoy_dir, "server.pid"), "w") as f:
            f.write(str(decoy.pid))
        deadline = time.monotonic() + 5.0
        while not os.path.exists(os.path.join(orphan_dir, "s.sock")) and time.monotonic() < deadline:
            time.sleep(0.01)                  # let it chdir into its folder
        srv = EmbeddedRedis()                 # sweeps dead owners' folders
        assert orphan.wait(5) == -signal.SIGKILL
        assert decoy.poll() is None, "the sweep killed a process that was not the orphaned server"
        assert not os.path.exists(orphan_dir) and not os.path.exists(decoy_dir)
    finally:
        if srv is not None:
            srv.close()
        for p in (orphan, decoy):
            if p.poll() is None:
                p.kill()
                p.wait(5)
        shutil.rmtree(orphan_dir, ignore_errors=True)
        shutil.rmtree(decoy_dir, ignore_errors=True)


# -- 4. a lease server that answers garbage ---------------------------------------------------

class LyingServer(Listener):
    """Speaks RESP on 127.0.0.1: +OK to connection setup, ``reply`` to every script call."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        super().__init__(sock)

    def _conn(self, c: socket.socket) -> None:
        c.settimeout(5)
        with c, c.makefile("rb") as f:
            try:
                while (head := f.readline()).startswith(b"*"):
                    args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(head[1:]))]
                    c.sendall(self.reply if args[0].upper() in (b"EVALSHA", b"EVAL") else b"+OK\r\n")
            except (OSError, ValueError):
                return


@pytest.mark.parametrize("reply", [b"$8\r\nnot json\r\n", b"$2\r\n[]\r\n", b"*0\r\n", b":7\r\n"],
                         ids=["not-json", "short-view", "empty-array", "integer"])
def test_malformed_lease_reply_is_a_protocol_error(reply: bytes) -> None:
    """Script replies that no kvbridge script returns are a ProtocolError naming the server,
    never a raw JSONDecodeError, ValueError or IndexError (get takes a non-string as 'none')."""
    liar = LyingServer(reply)
    try:
        store = RedisLeaseStore(f"redis://127.0.0.1:{liar.port}/0", retry=ONE_TRY)
        calls = [lambda: store.claim("x", "dec", 5), lambda: store.claim_many("dec", ["x", "y"], 5)]
        if reply.startswith(b"$"):
            calls.append(lambda: store.get("x"))
        for call in calls:
            with pytest.raises(ProtocolError, match="malformed reply"):
                call()
        store.close()
    finally:
        liar.close()


def test_fetch_with_a_lying_lease_server_returns_a_failed_result() -> None:
    """A forged handle names the lying server as its lease server: fetch must return a failed
    result carrying a kvbridge error, not raise a raw JSONDecodeError."""
    liar = LyingServer(b"$8\r\nnot json\r\n")
    try:
        layout = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
        h = KVHandle(handle_id=os.urandom(16), request_id="forged", layout_hash=layout.compat_hash,
                     urls=("tcp://127.0.0.1:9",), block_ids=(0,), generations=(0,), checksums=(),
                     num_tokens=4, token=os.urandom(16), mac=os.urandom(16))
        h = replace(h, lease_id=h.lease_digest(), lease_url=f"redis://127.0.0.1:{liar.port}/0")
        with KVReceiver(KVPool.allocate(layout, 4), retry=ONE_TRY) as rcv:
            res = rcv.fetch(h, [0])
        assert not res.ok and isinstance(res.error, KVBridgeError), res.error
    finally:
        liar.close()
