"""The sender's tcp server under peers that misbehave: what it answers, and what it keeps."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from kvbridge import KVHandle, KVLayout, KVPool, KVSender, Timeout
from kvbridge.transports.wire import FENCE, HEADER, TRAILER, Kind, decode_error, encode_request, pack

pytestmark = pytest.mark.timeout(60)


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _read_to_end(s: socket.socket, timeout: float = 5.0) -> tuple[bytes, str]:
    """Everything the server sends until it closes, and how it closed ("eof" or the error)."""
    s.settimeout(timeout)
    buf = bytearray()
    try:
        while True:
            d = s.recv(1 << 20)
            if not d:
                return bytes(buf), "eof"
            buf += d
    except OSError as exc:
        return bytes(buf), type(exc).__name__


def test_an_error_reply_and_the_reply_before_it_survive_unread_input_at_close() -> None:
    """A READ, then a malformed frame, then bytes the server never reads: it answers the READ,
    answers the malformed frame with ERROR and closes. Closing with unread input used to reset
    the connection, and the reset dropped what was still queued to send: the peer saw
    ConnectionResetError part-way through the READ's DATA, never the ERROR. Now the server ends
    its side and discards the peer's input (bounded) first: the whole DATA, the ERROR, then EOF."""
    layout = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")   # 64 KiB a block
    pool = KVPool.allocate(layout, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", pool.alloc(2), 32)
        s = socket.create_connection(_addr(snd.url), timeout=5)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)   # the reply waits in the server's queue
            bad = b"KB" + bytes([99]) + bytes(13)                          # a frame of an unknown version
            s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())) + bad + b"x" * (256 << 10))
            time.sleep(0.2)                                                # the server answers and closes meanwhile
            t0 = time.monotonic()
            got, how = _read_to_end(s)
        finally:
            s.close()
        want = HEADER.size + FENCE.size + 2 * layout.block_nbytes + TRAILER.size
        assert how == "eof" and len(got) > want + HEADER.size, (how, len(got), want)
        assert got[3] == Kind.DATA and got[want + 3] == Kind.ERROR
        assert "version 99" in decode_error(got[want + HEADER.size:]).message
        assert time.monotonic() - t0 < 3.0


def _big_read(snd: KVSender, pool: KVPool, nblocks: int, rcvbuf: int = 0) -> tuple[KVHandle, socket.socket]:
    """A raw connection that has asked for the whole of a freshly published ``nblocks`` handle."""
    h = snd.publish("big", pool.alloc(nblocks), nblocks * pool.layout.block_size)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(_addr(snd.url))
    s.settimeout(5)
    s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())))
    return h, s


BIG = KVLayout.vllm_flash(8, 8, 128, block_size=16, dtype="float16")    # 512 KiB a block


@pytest.mark.parametrize("pool_kind", ["host", "staged"])
def test_a_reader_that_pauses_is_not_dropped(pool_kind: str) -> None:
    """A reader that stops taking a 32 MiB reply for 1.5 s (a busy core, a collection) is well
    above the minimum rate: it gets the whole reply. The server's send used to give up at the
    first timeout of its 0.25 s tick once kernel buffers were full, dropping the read. (staged:
    a CPU stand-in for a device pool, served through the staging ring.)"""
    pool = KVPool.allocate(BIG, 64)
    pool._staged = pool_kind == "staged"
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        _, s = _big_read(snd, pool, 64)
        want = HEADER.size + FENCE.size + 64 * BIG.block_nbytes + TRAILER.size
        got, paused, buf = 0, False, bytearray(1 << 20)
        try:
            while got < want:
                k = s.recv_into(buf)
                if not k:
                    break
                got += k
                if not paused and got > want // 8:
                    time.sleep(1.5)
                    paused = True
        finally:
            s.close()
        assert got == want


def test_a_slow_reader_of_a_device_pool_is_dropped() -> None:
    """A reader taking a device pool's reply at ~40 KB/s is held to the minimum rate (1 MiB/s
    after the 2 s grace) like one of a host pool: dropped, its read no longer in flight, so a
    revoke frees at once. The staged path had no rate guard: the read, and its blocks, stayed in
    flight for as long as the trickle lasted. (A CPU stand-in for a device pool.)"""
    pool = KVPool.allocate(BIG, 128)
    pool._staged = True
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=10),
                  on_free=lambda h, why: freed.append(why)) as snd:
        h, s = _big_read(snd, pool, 128, rcvbuf=4096)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 4.5:                  # 4 KiB a tenth of a second
                try:
                    if not s.recv(4096):
                        break
                except OSError:
                    break
                time.sleep(0.1)
            assert snd.revoke(h) and freed == ["revoked"]      # nothing in flight any more: freed at once
        finally:
            s.close()


_FD_FLOOD = r"""
import os, resource, socket, sys, time
from kvbridge import KVLayout, KVPool, KVSender
from kvbridge.transports.wire import HEADER, Kind, pack, unpack_header
pool = KVPool.allocate(KVLayout.vllm_flash(1, 1, 8, block_size=4, dtype="float16"), 4)
snd = KVSender(pool, "tcp://127.0.0.1:0", leases=False)
host, port = snd.url.removeprefix("tcp://").rsplit(":", 1)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
socks = []
try:
    for _ in range(100):                 # both ends live here: the process runs out of fds
        socks.append(socket.create_connection((host, int(port)), timeout=2))
except OSError:
    pass
time.sleep(0.5)                          # the server's accepts fail meanwhile
for s in socks:
    s.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
s = socket.create_connection((host, int(port)), timeout=2)
s.sendall(pack(Kind.PING, 7, b"hi"))
try:
    kind, rid, n = unpack_header(s.recv(HEADER.size, socket.MSG_WAITALL))
    print("PONG" if kind is Kind.PONG and rid == 7 else kind.name)
except OSError as exc:
    print("no answer:", exc)
"""


def test_the_server_goes_on_accepting_after_running_out_of_file_descriptors() -> None:
    """Peers holding as many connections as the process has file descriptors make accept() fail
    (EMFILE). The accept loop used to end on any error: once they left, the server never took a
    connection again (receivers connected to the backlog and waited out their timeouts). Now it
    waits a moment and goes on: a new connection is served once descriptors are back."""
    out = subprocess.run([sys.executable, "-c", _FD_FLOOD], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "PONG", (out.stdout, out.stderr[-2000:])


_FD_SHORT = r"""
import json, os, resource, threading, time
from kvbridge import KVBridgeError, KVLayout, KVPool, KVSender
out = []
for url in ("tcp://127.0.0.1:0", "shm://"):
    pool = KVPool.allocate(KVLayout.vllm_flash(1, 1, 8, block_size=4, dtype="float16"), 4, shared=url == "shm://")
    KVSender(pool, url, leases=False).close()             # imports and lazy state settled
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for extra in range(8):
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds + extra, hard))
        try:
            KVSender(pool, url, leases=False).close()
            what = "ok"
        except KVBridgeError as exc:
            what = type(exc).__name__
        except OSError as exc:
            what = "raw " + repr(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(0.3)                                    # threads of a closed server end
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvb-{os.getpid()}-")
                and n != pool.segment.name]
        out.append([url, extra, what, len(os.listdir("/proc/self/fd")) - fds,
                    threading.active_count() - threads, left])
    pool.close()
print(json.dumps(out))
"""


def test_a_sender_that_cannot_open_its_server_leaves_nothing_and_raises_a_mapped_error() -> None:
    """KVSender() with the process out of file descriptors, at each point its servers open one:
    it works, or raises a kvbridge error and leaves no descriptor, thread or shared-memory segment.
    It used to raise a raw OSError (a selector's or socketpair's, an mmap's dup of the table
    segment's descriptor), leaving the listener's descriptor, or a /dev/shm segment, behind."""
    got = subprocess.run([sys.executable, "-c", _FD_SHORT], capture_output=True, text=True, timeout=60)
    rows = json.loads(got.stdout.strip().splitlines()[-1])
    bad = [r for r in rows if not (r[2] == "ok" or r[2] == "ConfigError") or r[3] or r[4] > 0 or r[5]]
    assert not bad and any(r[2] == "ok" for r in rows), rows
