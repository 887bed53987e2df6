"""Hostile peers on loopback: each attack the servers must survive, bounded in time and memory.

A sender runs in a child process (``_child.py``); the attacks speak raw frames to its port.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import pytest

from kvbridge import BadHandle, KVHandle, KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Timeout
from kvbridge.transports.wire import HEADER, MAX_CONTROL, Kind, decode_error, encode_request, pack

pytestmark = pytest.mark.timeout(90)
HERE = os.path.dirname(os.path.abspath(__file__))


class Child:
    def __init__(self, **cfg: object) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_child.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.url, self.pid = info["url"], info["pid"]
        self.handle = base64.b64decode(info["handle"])

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child(listen="tcp://127.0.0.1:0", transfer=2.0)
    yield c
    c.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _trickle(socks: list[socket.socket]) -> None:
    """One byte to each peer (one the server dropped ignores it)."""
    for s in socks:
        try:
            s.send(b"x")
        except OSError:
            pass


def _reply(s: socket.socket, timeout: float = 5.0) -> object:
    """(Kind, payload) of the next frame, or 'closed'."""
    s.settimeout(timeout)
    head = b""
    try:
        while len(head) < HEADER.size:
            chunk = s.recv(HEADER.size - len(head))
            if not chunk:
                return "closed"
            head += chunk
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    kind, _, length = Kind(head[3]), 0, struct.unpack("!Q", head[8:])[0]
    body = b""
    while len(body) < min(length, 1 << 16) and kind is not Kind.DATA:
        chunk = s.recv(length - len(body))
        if not chunk:
            break
        body += chunk
    return kind, body


def test_declared_huge_frames_and_trickling_peers_are_bounded(child: Child) -> None:
    before = child.rss()
    socks = []
    for _ in range(100):                                # each declares the largest frame ...
        s = _connect(child.url)
        s.sendall(pack(Kind.READ, 1, length=MAX_CONTROL)[:HEADER.size] + b"x")
        socks.append(s)
    t0 = time.monotonic()
    for _ in range(10):                                 # ... and trickles a byte now and then
        _trickle(socks)
        time.sleep(0.1)
    growth = child.rss() - before
    assert growth <= 64 << 20, f"RSS grew {growth >> 20} MiB"
    # every trickler is dropped within the frame deadline (2 s) plus one tick
    for s in socks:
        got = _reply(s, timeout=max(0.1, 5.0 - (time.monotonic() - t0)))
        assert got == "closed" or got[0] is Kind.ERROR, got
        s.close()
    assert time.monotonic() - t0 < 6.0


def test_repeated_indices_refused_before_any_data(child: Child) -> None:
    s = _connect(child.url)
    s.sendall(pack(Kind.READ, 7, encode_request(child.handle, [0] * 1_000_000)))
    kind, body = _reply(s)
    assert kind is Kind.ERROR and isinstance(decode_error(body), ProtocolError), (kind, body[:80])
    s.close()


def test_repeated_or_out_of_range_indices_are_refused_by_the_receiver_before_it_connects() -> None:
    """The receiver's end of the same defence: a fetch naming a block index twice, or one past the
    handle, is refused (PoolError) before any connection is made -- here the sender is gone, so
    a receiver that got as far as connecting would fail otherwise -- and nothing is marked."""
    from kvbridge import PoolError
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    src, dst = KVPool.allocate(L, 4), KVPool.allocate(L, 4)
    snd = KVSender(src, "tcp://127.0.0.1:0", leases=False)
    h = snd.publish("r", src.alloc(2), 8)
    snd.close()
    with KVReceiver(dst, leases=False) as rcv:
        for idx, what in (([0, 0], "repeated"), ([1, 1], "repeated"), ([2, 0], "outside"), ([-1, 0], "outside")):
            with pytest.raises(PoolError, match=what):
                rcv.fetch(h, [0, 1], indices=idx)
        assert dst.landing() == [] and rcv.stats.fetches == 0


def test_ping_is_bounded(child: Child) -> None:
    s = _connect(child.url)
    s.sendall(pack(Kind.PING, 3, b"p" * (1 << 20)))
    kind, _ = _reply(s)
    assert kind is Kind.ERROR
    s.sendall(pack(Kind.PING, 4, b"ok"))
    assert _reply(s) == (Kind.PONG, b"ok")
    s.close()


def test_connection_cap_refuses_clearly() -> None:
    L = KVLayout.vllm_flash(1, 1, 4, block_size=2, dtype="float16")
    with KVSender(KVPool.allocate(L, 2), "tcp://127.0.0.1:0", leases=False) as snd:
        snd.servers[0].max_connections = 20
        socks = [_connect(snd.url) for _ in range(20)]
        time.sleep(0.2)
        extra = _connect(snd.url)
        kind, body = _reply(extra)
        assert kind is Kind.ERROR and "limit" in decode_error(body).message
        for s in socks:
            s.close()


def test_slow_reader_is_dropped_and_blocks_are_freed_on_time() -> None:
    L = KVLayout.vllm_flash(8, 8, 128, block_size=16, dtype="float16")   # 512 KiB a block: a 64 MiB handle,
    pool = KVPool.allocate(L, 128)                                         # more than kernel buffers hold
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=10),
                  on_free=lambda h, r: freed.append(r)) as snd:
        h = snd.publish("slow", pool.alloc(128), 128 * 16)
        host, port = snd.url.removeprefix("tcp://").rsplit(":", 1)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.5:               # read 4 KiB a tenth of a second: ~40 KB/s
            s.settimeout(1)
            try:
                if not s.recv(4096):
                    break
            except OSError:
                break
            time.sleep(0.1)
        # the server gave up on this reader (its read is no longer in flight): a revoke frees at once;
        # a read still in flight would hold the blocks until it drained
        assert snd.revoke(h) and freed == ["revoked"]    # nothing in flight any more: freed at once
        s.close()


def test_handle_dict_visible_fields_are_checked() -> None:
    L = KVLayout.vllm_flash(1, 1, 4, block_size=2, dtype="float16")
    with KVSender(KVPool.allocate(L, 4), "inproc://", leases=False) as snd:
        pool = snd.pool
        h = snd.publish("real", pool.alloc(2), 4)
        d = h.to_dict()
        for field, value in [("request_id", "someone-else"), ("num_blocks", 999), ("urls", ["tcp://evil:1"]),
                             ("num_tokens", 0)]:
            with pytest.raises(BadHandle, match="differs"):
                KVHandle.from_dict({**d, field: value})
        assert KVHandle.from_dict(d) == h


def test_lease_server_refuses_unauthenticated_clients() -> None:
    import redis
    from kvbridge.lease import EmbeddedRedis
    with EmbeddedRedis() as srv:
        assert ":@" not in srv.url and srv.password not in srv.url
        with open(f"/proc/{srv.pid}/cmdline", "rb") as f:
            assert srv.password.encode() not in f.read()          # not on the command line
        anon = redis.Redis(host="127.0.0.1", port=srv.port, socket_timeout=2)
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)) as err:
            anon.keys("*")
        assert "auth" in str(err.value).lower()
        from kvbridge.lease import RedisLeaseStore
        with RedisLeaseStore(srv.url) as store:                   # this user's processes find the password
            assert store.publish("lease-1", "owner", 5).lease_id == "lease-1"


def test_nothing_left_behind_after_kill_9() -> None:
    import glob
    import tempfile
    c = Child(listen="shm://", leases=True, transfer=2.0)
    KVReceiver(KVPool.allocate(KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16"), 8),
               leases=False).close()
    pid = c.pid
    assert c.url.startswith("shm://@")                            # abstract socket: no file to leave
    os.kill(pid, 9)
    c.proc.wait(10)
    from kvbridge.lease import EmbeddedRedis
    from kvbridge.pool import sweep_dead_segments
    with EmbeddedRedis():                                         # the next start sweeps the dead one's folder
        pass
    sweep_dead_segments()
    tmp = tempfile.gettempdir()
    left = (glob.glob(os.path.join(tmp, f"kvb-{pid}-*")) + glob.glob(os.path.join(tmp, f"kvbridge-redis-{pid}-*"))
            + glob.glob(f"/dev/shm/kvb-{pid}-*"))
    assert left == [], left
    # its lease password file is swept too
    from kvbridge.lease.credentials import credentials_dir
    assert not [n for n in os.listdir(credentials_dir()) if n.endswith(f"-{pid}")]


def test_idle_connections_cost_no_threads(child: Child) -> None:
    """2,000 idle connections: the sender's thread count stays bounded and a real fetch still runs."""
    base = child.threads()
    socks = [_connect(child.url) for _ in range(2000)]
    time.sleep(1.0)                                   # past PARK_AFTER: every one parked
    peak = child.threads()
    assert peak - base <= 70, f"{peak - base} threads for 2,000 idle connections"
    L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")
    with KVReceiver(KVPool.allocate(L, 8), leases=False) as rcv:
        h = KVHandle.from_bytes(child.handle)
        res = rcv.fetch(h, list(range(8)), release=False)
        assert res.ok, res.error
    for s in socks:
        s.close()


def test_idle_connections_cost_no_buffers(child: Child) -> None:
    """A connection has no frame buffer before its first byte, nor while it is parked empty:
    2,000 silent connections took 64 KiB each (+127 MiB) before any authentication."""
    time.sleep(0.3)
    before = child.rss()
    socks = [_connect(child.url) for _ in range(2000)]
    time.sleep(1.0)
    growth = child.rss() - before
    for s in socks:
        s.close()
    assert growth <= 24 << 20, f"2,000 idle connections took {growth >> 20} MiB"


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://"])
def test_peers_holding_part_of_a_frame_hold_no_worker(listen: str) -> None:
    """64 peers that each send one byte of a header and then nothing held every one of the
    server's 64 worker threads until the frame deadline: a real fetch waited that long (8 s
    here), and peers that reconnect kept it up. A frame begun now waits for its rest parked,
    without a thread: the fetch runs at once, and the 64 are still dropped at their deadline."""
    c = Child(listen=listen, transfer=8.0)
    try:
        if listen.startswith("tcp"):
            def connect() -> socket.socket:
                return _connect(c.url)
        else:
            def connect() -> socket.socket:
                u = socket.socket(socket.AF_UNIX)
                u.connect("\0" + c.url[len("shm://@"):])
                return u
        L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")
        socks = []
        for _ in range(64):
            s = connect()
            s.sendall(b"K")
            socks.append(s)
        time.sleep(0.5)
        with KVReceiver(KVPool.allocate(L, 8, shared=listen.startswith("shm")), leases=False,
                        timeout=Timeout(transfer=60)) as rcv:
            t0 = time.monotonic()
            res = rcv.fetch(KVHandle.from_bytes(c.handle), list(range(8)), release=False)
            took = time.monotonic() - t0
        assert res.ok and took < 2.0, (res.error, took)
        assert c.threads() < 40, c.threads()
        for s in socks:                                  # each dropped at its frame deadline, not before
            s.settimeout(12)
            got = s.recv(64)
            assert time.monotonic() - t0 > 6.5 and (got == b"" or got[3] == Kind.ERROR.value), got
            s.close()
    finally:
        c.close()


def test_frames_within_the_budget_take_no_more_memory_than_the_budget(child: Child) -> None:
    """Eight peers each declare a 16 MiB frame and send all of it but its last byte: four fit the
    64 MiB control budget, the others are refused at their header. The frames grew by doubling
    buffers, whose freed steps the allocator kept: +208 MiB for 64 MiB of frames, kept after the
    peers left. Each frame now lands in one mapping of its size, unmapped when it ends."""
    time.sleep(0.3)
    before = child.rss()
    socks = []
    for _ in range(8):
        s = _connect(child.url)
        s.sendall(pack(Kind.READ, 1, length=MAX_CONTROL)[:HEADER.size])
        try:
            s.settimeout(5)
            s.sendall(b"\0" * (MAX_CONTROL - 1))
        except OSError:                                  # refused at its header: the budget is spent
            pass
        socks.append(s)
    time.sleep(0.5)
    growth = child.rss() - before
    for s in socks:
        s.close()
    assert growth <= (64 + 16) << 20, f"RSS grew {growth >> 20} MiB for 64 MiB of budgeted frames"
    deadline = time.monotonic() + 5
    while child.rss() - before > 16 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child.rss() - before <= 16 << 20, f"{(child.rss() - before) >> 20} MiB kept after the peers left"


def _fake_sender(reply: Callable[[int], bytes]) -> tuple[socket.socket, threading.Thread]:
    """A lying sender on loopback: it takes one request on one connection, answers it with
    ``reply(request id)`` and holds the connection until the receiver closes it."""
    from kvbridge.transports.wire import recv_exact, unpack_header
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            _, rid, length = unpack_header(recv_exact(conn, HEADER.size))
            recv_exact(conn, length)
            conn.sendall(reply(rid))
            try:
                conn.recv(1)                           # until the receiver closes
            except OSError:
                pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lst, t


@pytest.mark.parametrize("reply", ["no_trailer", "bad_status", "nonzero_pad", "stale", "unsure"])
def test_hostile_sender_data_reply_and_trailer(reply: str) -> None:
    """A sender's DATA reply must declare exactly FENCE + the bytes asked for + TRAILER, and its
    trailer must vouch for them: anything else is refused; the bytes are never reported ok."""
    import dataclasses

    from kvbridge import StaleHandle
    from kvbridge.transports.wire import FENCE, TRAILER, Vouch
    L = KVLayout.vllm_flash(1, 1, 4, block_size=2, dtype="float16")
    with KVSender(KVPool.allocate(L, 4), "inproc://", leases=False) as snd:
        real = snd.publish("real", snd.pool.alloc(2), 4)
    nbytes = 2 * L.block_nbytes
    status, pad = {"bad_status": (9, 0), "nonzero_pad": (0, 1), "stale": (Vouch.STALE, 0),
                   "unsure": (Vouch.UNSURE, 0)}.get(reply, (0, 0))
    body = FENCE.pack(0, 0) + b"\x01" * nbytes
    if reply != "no_trailer":
        body += TRAILER.pack(status, pad, 0)
    lst, t = _fake_sender(lambda rid: pack(Kind.DATA, rid, body))
    h = dataclasses.replace(real, urls=(f"tcp://127.0.0.1:{lst.getsockname()[1]}",))
    dst = KVPool.allocate(L, 4)
    with KVReceiver(dst, leases=False, verify=False) as rcv:
        res = rcv.fetch(h, [0, 1], release=False)
    t.join(5)
    lst.close()
    assert not res.ok
    want = StaleHandle if reply in ("stale", "unsure") else ProtocolError
    assert isinstance(res.error, want), repr(res.error)
    import torch
    # a small read lands in a private buffer first: bytes that were not vouched for never
    # reach the destination blocks
    assert not any(bool(b.view(-1).view(torch.uint8).any()) for b in dst.buffers)


def test_refused_write_bytes_cannot_be_trickled(child: Child) -> None:
    """A WRITE the server refuses (a sender takes none; any forged reservation) has its bytes
    discarded only at the minimum rate: a real fetch runs while 64 peers trickle theirs, and
    each trickler is dropped after the grace; one declaring more than the discard limit is
    answered and dropped at once."""
    from kvbridge.transports.sockets import DISCARD_LIMIT, RATE_GRACE
    big = _connect(child.url)
    big.sendall(pack(Kind.WRITE, 2, encode_request(b"junk", None, None, (0, 1), nbytes=DISCARD_LIMIT + 1)))
    kind, _ = _reply(big)
    assert kind is Kind.ERROR and _reply(big, timeout=2.0) == "closed"
    big.close()
    socks = []
    for _ in range(64):                                 # as many as the server has workers
        s = _connect(child.url)
        s.sendall(pack(Kind.WRITE, 1, encode_request(b"junk", None, None, (0, 1), nbytes=DISCARD_LIMIT)))
        socks.append(s)
    stop = threading.Event()

    def trickle() -> None:                              # ~10 bytes a second each
        while not stop.is_set():
            _trickle(socks)
            time.sleep(0.1)
    t = threading.Thread(target=trickle, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        time.sleep(1.0)
        L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")
        with KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=8)) as rcv:
            res = rcv.fetch(KVHandle.from_bytes(child.handle), list(range(8)), release=False)
            assert res.ok, res.error                    # served once the tricklers' grace ran out
        for s in socks:                                 # each dropped, not still discarding
            try:
                got = _reply(s, timeout=max(0.1, 2 * RATE_GRACE + 4 - (time.monotonic() - t0)))
            except TimeoutError:
                got = "still open"
            assert got == "closed", got
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()


def test_hostile_sender_layer_reply_checksum_count() -> None:
    """A layer reply's checksum count is held to the layers and blocks asked for before a byte
    of them is received: a count of 2**32 - 1 in a reply declaring a terabyte is a ProtocolError
    in the fetch's result, not a 32 GiB allocation."""
    import dataclasses

    from kvbridge.transports.wire import FENCE, LAYERS
    L = KVLayout.vllm_flash(2, 1, 4, block_size=2, dtype="float16")
    with KVSender(KVPool.allocate(L, 4), "inproc://", leases=False) as snd:
        real = snd.publish("real", snd.pool.alloc(2), 4, layers_ready=2)
    lst, t = _fake_sender(lambda rid: pack(Kind.LDATA, rid, FENCE.pack(0, 0) + LAYERS.pack(0, 1, 0xFFFFFFFF),
                                           length=1 << 40))
    h = dataclasses.replace(real, urls=(f"tcp://127.0.0.1:{lst.getsockname()[1]}",))
    with KVReceiver(KVPool.allocate(L, 4), leases=False, verify=False) as rcv:
        res = rcv.fetch(h, [0, 1], release=False)
    t.join(5)
    lst.close()
    assert not res.ok and isinstance(res.error, ProtocolError) and "checksums" in str(res.error), repr(res.error)


def _shm_frame(s: socket.socket) -> Kind:
    head = b""
    while len(head) < HEADER.size:
        chunk = s.recv(HEADER.size - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    kind, length = Kind(head[3]), struct.unpack("!Q", head[8:])[0]
    while length:
        length -= len(s.recv(length))
    return kind


def _shm_mapped(path: str, h: KVHandle, req_id: int) -> socket.socket:
    """A control connection to the shm sender at ``path`` holding a MAP of ``h`` under ``req_id``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(5)
    s.sendall(pack(Kind.MAP, req_id, encode_request(h.to_bytes())))
    assert _shm_frame(s) is Kind.MAPPED
    return s


def test_shm_mappings_are_bounded_per_request_and_in_time() -> None:
    """shm://'s MAP holds the blocks until its DONE: a second MAP under the same request id is
    refused (it would orphan the first, which then held the blocks for good), and a peer that
    keeps talking but never sends DONE loses the connection -- and the mapping -- at the transfer
    timeout of its MAP, so a revoke during it frees the blocks then."""
    L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")
    pool = KVPool.allocate(L, 8, shared=True)
    freed: list[str] = []
    with KVSender(pool, "shm://", leases=False, timeout=Timeout(transfer=1.5),
                  on_free=lambda h, r: freed.append(r)) as snd:
        path = "\0" + snd.url.removeprefix("shm://@")
        h = snd.publish("victim", pool.alloc(4), 64)
        s = _shm_mapped(path, h, 5)
        s.sendall(pack(Kind.MAP, 5, encode_request(h.to_bytes())))
        assert _shm_frame(s) is Kind.ERROR                  # refused: the first still holds
        s.sendall(pack(Kind.DONE, 5))
        assert _shm_frame(s) is Kind.OK
        s.close()
        assert snd.revoke(h) and freed == ["revoked"]       # nothing left in flight: freed at once
        h = snd.publish("held", pool.alloc(4), 64)
        s = _shm_mapped(path, h, 1)
        t0 = time.monotonic()
        assert snd.revoke(h) and freed == ["revoked"]       # in flight: the blocks wait for the read
        dropped = None
        while time.monotonic() - t0 < 6:
            try:
                s.sendall(pack(Kind.PING, 2, b""))
                assert _shm_frame(s) in (Kind.PONG, Kind.ERROR)
            except (ConnectionError, OSError):
                dropped = time.monotonic() - t0
                break
            time.sleep(0.2)
        assert dropped is not None and dropped < 1.5 + 1.0, dropped
        deadline = time.monotonic() + 2
        while len(freed) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert freed == ["revoked", "revoked"]
        s.close()


def test_shm_one_connection_holds_at_most_16_mappings() -> None:
    """A peer that MAPs one handle under ever new request ids without a DONE gets 16 mappings,
    then a clear refusal (each held mapping pins the blocks); its DONEs give them back."""
    from kvbridge.transports.shm import MAX_GRANTS
    from kvbridge.transports.wire import recv_exact, unpack_header
    L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")
    pool = KVPool.allocate(L, 8, shared=True)
    freed: list[str] = []
    with KVSender(pool, "shm://", leases=False, on_free=lambda h, r: freed.append(r)) as snd:
        path = "\0" + snd.url.removeprefix("shm://@")
        h = snd.publish("pinned", pool.alloc(4), 64)
        s = _shm_mapped(path, h, 1)
        for rid in range(2, MAX_GRANTS + 1):
            s.sendall(pack(Kind.MAP, rid, encode_request(h.to_bytes())))
            assert _shm_frame(s) is Kind.MAPPED
        s.sendall(pack(Kind.MAP, 99, encode_request(h.to_bytes())))
        kind, _, n = unpack_header(recv_exact(s, HEADER.size))
        assert kind is Kind.ERROR and f"{MAX_GRANTS} mappings" in str(decode_error(recv_exact(s, n)))
        assert snd.revoke(h) and freed == []                 # mapped: the blocks wait for the reads
        for rid in range(1, MAX_GRANTS + 1):
            s.sendall(pack(Kind.DONE, rid))
            assert _shm_frame(s) in (Kind.OK, Kind.ERROR)    # ERROR: revoked meanwhile
        deadline = time.monotonic() + 2
        while not freed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert freed == ["revoked"]
        s.close()


def test_a_small_reply_whose_send_times_out_is_not_taken_for_an_idle_peer() -> None:
    """The C fast path answers a READ in one call; when the peer stops taking the reply, the
    send's timeout must read as a dead peer (the connection is dropped), never as "no frame
    yet" (BlockingIOError): the server then kept the connection with a cut-off DATA frame in
    it, and spliced the next reply into that frame's body."""
    from kvbridge.transports.wire import FrameReader, set_os_timeouts
    layout = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB a block
    pool = KVPool.allocate(layout, 1)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", pool.alloc(1), 16)                          # 64 KiB: answered in C
        a, b = socket.socketpair()
        try:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            set_os_timeouts(a, 0.1)
            b.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes(), None, None)))
            with pytest.raises(OSError) as err:                         # b never reads
                snd.serve_next(a.fileno(), FrameReader(a))
            assert not isinstance(err.value, BlockingIOError), err.value
        finally:
            a.close()
            b.close()


def test_an_open_reply_with_misaligned_generations_or_an_empty_table_is_refused() -> None:
    """An shm OPEN reply is the peer's word on where its generations and handle table are: a
    generations offset off the 4-byte grid (the C reader loads them as aligned 32-bit words)
    or a table of zero slots is refused."""
    import json as _json
    from kvbridge.segments import SharedSegment
    from kvbridge.transports.shmtable import HEAD, HandleTable, SenderMap, open_info
    layout = KVLayout.vllm_flash(2, 1, 8, block_size=2, dtype="float16")
    pool = KVPool.allocate(layout, 4, shared=True)
    table = HandleTable(4)
    assert pool.segment is not None
    def adopted(seg: SharedSegment) -> SharedSegment:      # as a reader maps the descriptor SEGFD passes
        return SharedSegment.adopt(seg.peer_fd(False), seg.name, False)

    def mapped(info: dict[str, object]) -> SenderMap:     # the reader maps both afresh, as OPEN does
        assert pool.segment is not None
        return SenderMap(_json.dumps(info).encode(), adopted(pool.segment), adopted(table.segment))
    try:
        info = _json.loads(open_info(pool, table))
        mapped(info).close()                                       # as sent: fine
        info["gen_offset"] += 1
        with pytest.raises(ProtocolError, match="outside the segment"):
            mapped(info)
        info["gen_offset"] -= 1
        HEAD.pack_into(table.segment.view, 0, HEAD.unpack_from(table.segment.view, 0)[0], 0)   # zero slots
        with pytest.raises(ProtocolError, match="malformed"):
            mapped(info)
    finally:
        table.close()
        pool.close()
