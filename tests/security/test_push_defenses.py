"""Push mode against hostile peers: a writer holding (or only having seen) a reservation,
and a receiver that lies to the sender pushing into it. Loopback only, bounded in time."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import tempfile
import threading
import time
from typing import Callable, Iterator, Optional, Union

import pytest
from loopback import Listener
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Timeout, TransferCancelled
from kvbridge.integrity import layer_checksums, pack_sums
from kvbridge.transfer import FetchResult, Transfer, Workers
from kvbridge.transports import socket_server
from kvbridge.transports.base import Spans
from kvbridge.transports.wire import (FENCE, HEADER, Kind, decode_error, decode_request, encode_layers, send_with_fd,
                                      encode_request, pack, recv_exact, unpack_header)

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 1, 4, block_size=2, dtype="float16")


def _pool(fill: int, shared: bool = False) -> KVPool:
    p = KVPool.allocate(L, 4, shared=shared)
    for b in p.buffers:
        b.view(-1).view(torch.uint8).fill_(fill)
    return p


def _bytes(pool: KVPool, ids: list[int], lo: int, hi: int) -> bytes:
    staged, pool._staged = pool._staged, False     # read a staged pool's host memory directly
    try:
        return b"".join(bytes(v) for v in Spans.of_blocks(pool, ids, range(lo, hi)).views())
    finally:
        pool._staged = staged


def _sums(pool: KVPool, ids: list[int], lo: int, hi: int) -> bytes:
    return pack_sums(layer_checksums(pool, ids, range(lo, hi)))


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _reply(s: socket.socket) -> object:
    """('OK',) / ('ERROR', the error) / 'closed'."""
    try:
        kind, _, n = unpack_header(recv_exact(s, HEADER.size))
        body = recv_exact(s, n) if n else b""
    except (OSError, Exception):
        return "closed"
    return ("ERROR", decode_error(body)) if kind is Kind.ERROR else (kind.name,)


def _write_head(ticket: bytes, lo: int, hi: int, nbytes: int, sums: bytes, last: bool, rid: int = 1,
                claim: object = None) -> bytes:
    return pack(Kind.WRITE, rid, encode_request(ticket, None, claim, (lo, hi), last=last, nbytes=nbytes,  # type: ignore[arg-type]
                                                sums=sums))


def _write(s: socket.socket, ticket: bytes, src: KVPool, lo: int, hi: int, last: bool) -> object:
    data = _bytes(src, [0, 1], lo, hi)
    s.sendall(_write_head(ticket, lo, hi, len(data), _sums(src, [0, 1], lo, hi), last) + data)
    return _reply(s)


@pytest.fixture
def receiver() -> Iterator[tuple[KVReceiver, KVPool]]:
    dst = KVPool.allocate(L, 4)
    with KVReceiver(dst, listen="tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=3.0)) as r:
        yield r, dst


def test_a_layer_reported_ready_is_never_written_again(receiver: tuple[KVReceiver, KVPool]) -> None:
    """Bytes land before their checksums are checked: a rewrite of a verified layer (with bad
    checksums, none, or cut short) would change what wait_layer already vouched for."""
    rcv, dst = receiver
    good, junk = _pool(0x11), _pool(0xEE)
    t = rcv.reserve([0, 1], "r")
    tk = t.reservation.to_bytes()
    s = _connect(rcv.urls[0])
    assert _write(s, tk, good, 0, 1, False) == ("OK",)
    t.wait_layer(0, 5)
    data = _bytes(junk, [0, 1], 0, 1)
    for sums in (_sums(good, [0, 1], 0, 1), b""):
        s.sendall(_write_head(tk, 0, 1, len(data), sums, False) + data)
        got = _reply(s)
        assert isinstance(got, tuple) and isinstance(got[1], ProtocolError) and "expects layer 1 next" in str(got[1])
    assert _bytes(dst, [0, 1], 0, 1) == _bytes(good, [0, 1], 0, 1)
    assert _write(s, tk, good, 1, 2, True) == ("OK",)
    r = t.result(5)
    assert r.ok and _bytes(dst, [0, 1], 0, 2) == _bytes(good, [0, 1], 0, 2)


def test_one_write_at_a_time_per_reservation(receiver: tuple[KVReceiver, KVPool]) -> None:
    """A second connection cannot write while a write is landing (it could go on landing after
    the first completed the reservation); it is told to retry, and can once the first is over."""
    rcv, dst = receiver
    good, junk = _pool(0x11), _pool(0xEE)
    t = rcv.reserve([0, 1], "r")
    tk = t.reservation.to_bytes()
    b = _connect(rcv.urls[0])
    data = _bytes(junk, [0, 1], 0, 1)
    b.sendall(_write_head(tk, 0, 1, len(data), _sums(junk, [0, 1], 0, 1), False, rid=7) + data[:8])
    time.sleep(0.2)
    a = _connect(rcv.urls[0])
    got = _write(a, tk, good, 0, 2, True)
    assert isinstance(got, tuple) and got[0] == "ERROR" and got[1].retryable and "in flight" in str(got[1])
    assert not t.done()
    b.close()                                     # the first write ends unfinished: layer 0 stays unverified
    deadline = time.monotonic() + 5
    while True:
        got = _write(_connect(rcv.urls[0]), tk, good, 0, 2, True)
        if got == ("OK",) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == ("OK",)
    r = t.result(5)
    assert r.ok and _bytes(dst, [0, 1], 0, 2) == _bytes(good, [0, 1], 0, 2)


@pytest.mark.parametrize("staged", [False, True], ids=["host pool", "device-like pool"])
def test_a_write_that_pauses_is_not_dropped(staged: bool) -> None:
    """A pause mid-write (a retransmission on a real network, a busy writer) is waited out
    within the rate guard's grace; it used to drop the connection after one 0.25 s tick."""
    dst = KVPool.allocate(L, 4)
    dst._staged = staged
    good = _pool(0x11)
    with KVReceiver(dst, listen="tcp://127.0.0.1:0", leases=False) as rcv:
        t = rcv.reserve([0, 1], "r")
        data = _bytes(good, [0, 1], 0, 2)
        s = _connect(rcv.urls[0])
        s.sendall(_write_head(t.reservation.to_bytes(), 0, 2, len(data), _sums(good, [0, 1], 0, 2), True) + data[:100])
        time.sleep(0.6)
        s.sendall(data[100:])
        assert _reply(s) == ("OK",)
        assert t.result(5).ok and _bytes(dst, [0, 1], 0, 2) == data


@contextlib.contextmanager
def _junk_write(staged: bool) -> Iterator[tuple[Transfer, KVPool, bytes, socket.socket]]:
    """A reservation of blocks [0, 1] and a WRITE of both layers whose header is sent, its bytes
    (0xEE) not yet: (the reservation's transfer, its pool, the bytes, the writer's socket)."""
    dst = KVPool.allocate(L, 4)
    dst._staged = staged
    junk = _pool(0xEE)
    with KVReceiver(dst, listen="tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=10.0)) as rcv:
        t = rcv.reserve([0, 1], "r")
        data = _bytes(junk, [0, 1], 0, 2)
        s = _connect(rcv.urls[0])
        s.sendall(_write_head(t.reservation.to_bytes(), 0, 2, len(data), _sums(junk, [0, 1], 0, 2), True))
        yield t, dst, data, s


@pytest.mark.parametrize("staged", [False, True], ids=["host pool", "device-like pool"])
def test_a_trickled_write_is_dropped(staged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pool's writes are held to the minimum rate after the grace (a device pool's land in
    a bounce buffer first: they were not)."""
    monkeypatch.setattr(socket_server, "RATE_GRACE", 0.3)
    with _junk_write(staged) as (t, dst, data, s):
        t0 = time.monotonic()
        dropped = False
        for i in range(len(data) - 1):
            try:
                s.send(data[i:i + 1])
            except OSError:
                dropped = True
                break
            if _peer_closed(s):
                dropped = True
                break
            time.sleep(0.05)
        assert dropped and time.monotonic() - t0 < 3.0
        assert not t.done() and t.layers_done == 0   # nothing vouched for; an honest writer may still come
        t.cancel()


def _peer_closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        got = s.recv(1 << 16, socket.MSG_PEEK)
        return got == b"" or len(got) >= HEADER.size      # closed, or the refusal came
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def test_cancel_stops_a_landing_write_before_reporting_the_blocks_free() -> None:
    """A device pool's write lands in a bounce buffer and is copied up at its end: cancel()
    stops it at its next bytes (it used to wait out Timeout.transfer and then report the blocks
    free while the write went on, its bytes copied into them afterwards)."""
    with _junk_write(True) as (t, dst, data, s):
        stop = threading.Event()

        def trickle() -> None:
            for i in range(len(data) - 1):
                if stop.is_set():
                    return
                try:
                    s.send(data[i:i + 1])
                except OSError:
                    return
                time.sleep(0.05)
        th = threading.Thread(target=trickle)
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        t.cancel()
        took = time.monotonic() - t0
        stop.set()
        th.join()
        try:
            s.sendall(data[-1:])
        except OSError:
            pass
        time.sleep(0.3)
        assert took < 2.0 and not t.result(1).ok
        assert _bytes(dst, [0, 1], 0, 2).count(0xEE) == 0


def test_wabort_needs_the_writers_claim() -> None:
    """Of a leased reservation, only the writer that won its claim may give it up."""
    dst = KVPool.allocate(L, 4)
    with KVReceiver(dst, listen="tcp://127.0.0.1:0") as rcv, KVSender(_pool(0x11), "inproc://") as snd:
        t = rcv.reserve([0, 1], "r")
        assert t.reservation.lease_id
        pt = snd.push(t.reservation, snd.pool.alloc(2), layers_ready=0)
        snd.mark_ready(pt, 1)
        t.wait_layer(0, 10)
        s = _connect(rcv.urls[0])
        s.sendall(pack(Kind.WABORT, 3, encode_request(t.reservation.to_bytes(), None, None)))
        got = _reply(s)
        assert isinstance(got, tuple) and got[0] == "ERROR" and "claim" in str(got[1])
        assert not t.done()
        snd.mark_ready(pt, 2)
        assert pt.result(10).ok
        assert t.result(10).ok


class _LyingServer(Listener):
    """A listener answering every request with ``answer(kind, req_id, payload)``; any number of
    connections (the sender's abort comes on a new one)."""

    def __init__(self, family: int, address: object,
                 answer: Callable[[Kind, int, bytes], Union[bytes, tuple[bytes, int]]]) -> None:
        self.answer = answer
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind(address)
        super().__init__(sock)

    def _conn(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        with conn:
            while not self.stop.is_set():
                try:
                    kind, rid, n = unpack_header(recv_exact(conn, HEADER.size))
                    payload = recv_exact(conn, n) if n else b""
                    if kind is Kind.WRITE:
                        conn.recv(1 << 16)      # the data (small here)
                    out = self.answer(kind, rid, payload)
                    if isinstance(out, tuple):      # a reply with a descriptor attached
                        send_with_fd(conn, *out)
                    else:
                        conn.sendall(out)
                except Exception:
                    return


def _push_to(url: str, reservation_of: Callable[[], object]) -> tuple[object, list[str]]:
    freed: list[str] = []
    with KVSender(_pool(0x42), "inproc://", leases=False, timeout=Timeout(transfer=3.0)) as snd:
        snd.on_free = lambda _h, reason: freed.append(reason)
        res = dataclasses.replace(reservation_of(), urls=(url,))   # type: ignore[type-var]
        r = snd.push(res, snd.pool.alloc(1)).result(20)
    return r, freed


def test_a_receivers_reply_is_a_bounded_control_reply() -> None:
    """A receiver answering a WRITE (and the abort after it) with a DATA header of 2^40 bytes:
    the push fails with ProtocolError before any allocation; its handle ends, its worker lives."""
    srv = _LyingServer(socket.AF_INET, ("127.0.0.1", 0),
                       lambda k, rid, p: pack(Kind.DATA, rid, b"", length=1 << 40))
    try:
        url = f"tcp://127.0.0.1:{srv.sock.getsockname()[1]}"
        with KVReceiver(KVPool.allocate(L, 4), listen="tcp://127.0.0.1:0", leases=False) as rcv:
            r, freed = _push_to(url, lambda: rcv.reserve([0], "r").reservation)
        assert not r.ok and isinstance(r.error, ProtocolError) and "no data" in str(r.error)
        assert freed == ["aborted"]
    finally:
        srv.close()


def _mapped(segment: bytes, fd: Optional[int] = None) -> Callable[[Kind, int, bytes], Union[bytes, tuple[bytes, int]]]:
    def answer(kind: Kind, rid: int, payload: bytes) -> Union[bytes, tuple[bytes, int]]:
        if kind is Kind.SEGFD and fd is not None:
            return pack(Kind.OK, rid), fd
        if kind is not Kind.WMAP:
            return pack(Kind.OK, rid)
        lo, hi = decode_request(payload).layers or (0, 0)
        return pack(Kind.MAPPED, rid, FENCE.pack(0, 0) + encode_layers(lo, hi, b"") + struct.pack("!H", len(segment))
                    + segment + struct.pack("!I", 1) + struct.pack("!QQ", 100, L.block_nbytes // L.num_layers))
    return answer


@pytest.mark.parametrize("how", ["path", "link", "file", "unsealed memfd"])
def test_an_shm_receiver_cannot_make_the_sender_write_anything_but_its_sealed_segment(how: str) -> None:
    """WMAP's reply names the segment the sender maps writable, and the receiver passes its
    descriptor (SEGFD): only a kvbridge segment name, and only a descriptor of shared memory
    sealed against shrinking -- never a path or a link opened by name, a file, or a memfd its
    owner could cut under the copy (SIGBUS)."""
    fd, victim = tempfile.mkstemp(prefix="kvb-victim-")
    os.write(fd, b"A" * 4096)
    os.close(fd)
    link: Optional[str] = None
    passed: Optional[int] = None
    name = f"kvb-{os.getpid()}-{os.urandom(6).hex()}".encode()
    if how == "path":
        name = os.path.relpath(victim, "/dev/shm").encode()
    elif how == "link":           # a kvbridge-looking name that is a link: never opened by name
        link = "/dev/shm/" + name.decode()
        os.symlink(victim, link)
    elif how == "file":
        passed = os.open(victim, os.O_RDWR)
    else:
        passed = os.memfd_create("kvb-liar", os.MFD_CLOEXEC)
        os.ftruncate(passed, 1 << 16)
    abstract = f"kvb-test-liar-{os.getpid()}-{how.replace(' ', '-')}"
    srv = _LyingServer(socket.AF_UNIX, "\0" + abstract, _mapped(name, passed))
    try:
        dst = KVPool.allocate(L, 4, shared=True)
        with KVReceiver(dst, listen="shm://", leases=False) as rcv:
            r, freed = _push_to(f"shm://@{abstract}", lambda: rcv.reserve([0], "r").reservation)
        assert not r.ok and freed == ["aborted"] and isinstance(r.error, ProtocolError), repr(r.error)
        want = {"path": "not kvbridge's", "link": "descriptors", "file": "not sealed", "unsealed memfd": "not sealed"}
        assert want[how] in str(r.error), str(r.error)
        with open(victim, "rb") as f:
            assert f.read() == b"A" * 4096
    finally:
        srv.close()
        os.unlink(victim)
        if link:
            os.unlink(link)
        if passed is not None:
            os.close(passed)


def test_a_crashed_job_does_not_cost_its_worker() -> None:
    """A job that raises (a bug) fails its transfer; the worker thread goes on serving."""
    w = Workers("kvb-test", max_workers=1, idle=5.0)

    def crash(t: Transfer) -> object:
        raise RuntimeError("bug")
    bad = w.submit(Transfer("bad", 1, crash))        # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while not bad.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bad.done()
    good = w.submit(Transfer("good", 1, lambda t: FetchResult(None, [], ok=True)))   # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while not good.done() and time.monotonic() < deadline:   # polled, never run by a waiter
        time.sleep(0.01)
    assert good.done()
    w.close()


def test_a_waiter_that_runs_the_job_itself_does_not_wait_for_the_work_after_it() -> None:
    """wait() without a timeout runs a transfer no worker has picked up on the waiting thread. The
    work after its end (a failed push's abort, which waits up to Timeout.transfer for a silent
    receiver) ran there too, so wait() and result() returned only after it. It now runs on a
    thread of its own; the transfer's result is out at once."""
    after_started, release = threading.Event(), threading.Event()

    def slow_abort() -> None:
        after_started.set()
        release.wait(10)                 # a receiver that never answers the abort

    def job(t: Transfer) -> FetchResult:
        t._then = slow_abort
        return FetchResult(None, [], error=TransferCancelled("push failed"))   # type: ignore[arg-type]
    t = Transfer("inline", 1, job)
    t0 = time.monotonic()
    assert t.wait()                      # nobody took it: it runs here
    took = time.monotonic() - t0
    assert after_started.wait(5)         # the abort runs, elsewhere
    assert took < 1.0, f"wait() took {took:.1f} s"
    assert isinstance(t.result().error, TransferCancelled)
    assert threading.current_thread().name != "kvb-after"
    release.set()


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_cancel_of_a_push_to_a_silent_receiver_returns_at_once(scheme: str) -> None:
    """A receiver that takes a push's request and never answers: ``cancel()`` cuts the push's
    connection at once, and the abort that tells the receiver (best effort) runs after the
    push's result is out. It ran first, and waited for the silent receiver's reply for
    Timeout.transfer (30 s here) before cancel() could return."""
    from kvbridge import Retry, TransferCancelled

    class Silent(Listener):       # takes every byte, answers nothing
        def __init__(self) -> None:
            self.asked: list[int] = []
            if scheme == "shm":
                self.name = f"kvb-silent-{os.getpid()}-{time.monotonic_ns()}"
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind("\0" + self.name)
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
            super().__init__(s)

        @property
        def url(self) -> str:
            return f"shm://@{self.name}" if scheme == "shm" else f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

        def _conn(self, c: socket.socket) -> None:
            c.settimeout(0.2)
            with c:
                while not self.stop.is_set():
                    try:
                        got = c.recv(1 << 16)
                    except socket.timeout:
                        continue
                    except OSError:
                        return
                    if not got:
                        return
                    self.asked.append(len(got))

    fake = Silent()
    src = _pool(7, shared=scheme == "shm")
    try:
        with KVSender(src, "inproc://", leases=False, timeout=Timeout(connect=2, transfer=30),
                      retry=Retry(attempts=3)) as snd:
            h = snd.publish("silent", src.alloc(2), 4)
            res = dataclasses.replace(h, urls=(fake.url,), reservation=True)
            t = snd.push(res, src.alloc(2))
            end = time.monotonic() + 10
            while not fake.asked and time.monotonic() < end:
                time.sleep(0.01)
            assert fake.asked and not t.done()
            time.sleep(0.2)
            t0 = time.monotonic()
            assert t.cancel(timeout=10)
            took = time.monotonic() - t0
            assert took < 0.5, f"cancel took {took:.1f} s"
            assert isinstance(t.result().error, TransferCancelled), repr(t.result().error)
    finally:
        fake.close()
