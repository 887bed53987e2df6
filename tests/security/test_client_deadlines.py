"""A hostile sender that trickles what the receiver takes outside a large read's block bytes:
a small read's whole reply (in C and in Python), a large read's reply header, an ERROR body,
a layer reply's checksums. Each byte comes well inside the socket's receive timeout, so only
a deadline on the whole reply (Timeout.transfer plus its bytes at the minimum rate, kept by
kvbridge.transports.deadline's watchdog) ends the fetch: TransferTimeout, in time, and a
cancel that returns."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Callable

import pytest

import loopback

from kvbridge import (KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout, TransferCancelled,
                      TransferTimeout, blockcopy)
from kvbridge.transports.deadline import WATCHDOG
from kvbridge.transports.tcp import TCPTransport
from kvbridge.transports.wire import FENCE, HEADER, LAYERS, TRAILER, Kind, pack

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB blocks: one is a small read
TRANSFER = 1.0
LIMIT = TRANSFER + 3.0          # what every fetch here must end within
BYTE_EVERY = 0.2                # the trickle: one byte this often, well inside the 1 s receive timeout


def Trickler(reply: Callable[[Kind, int], tuple[bytes, int]]) -> loopback.Trickler:
    """A tcp:// sender answering with ``reply`` (bytes, how many at once), the rest trickled."""
    return loopback.Trickler(reply, BYTE_EVERY)


def _handle(url: str, nblocks: int, layerwise: bool = False) -> KVHandle:
    with KVSender(KVPool.allocate(L, 8), "inproc://", leases=False) as snd:
        h = snd.publish("real", snd.pool.alloc(nblocks), 16 * nblocks, layers_ready=0 if layerwise else None)
    return dataclasses.replace(h, urls=(url,))


def _receiver() -> KVReceiver:
    return KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=TRANSFER),
                      retry=Retry(attempts=1))


def _data(rid: int, nblocks: int) -> bytes:
    nbytes = nblocks * L.block_nbytes
    return pack(Kind.DATA, rid, FENCE.pack(0, 0) + bytes(nbytes) + TRAILER.pack(0, 0, 0))


def _error(rid: int) -> bytes:
    return pack(Kind.ERROR, rid, (12).to_bytes(2, "big") + b"x" * 2000)


def _fetch_in_thread(rcv: KVReceiver, h: KVHandle, blocks: list[int]) -> tuple[list, float]:
    out: list = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: out.append(rcv.fetch(h, blocks, release=False)), daemon=True)
    th.start()
    th.join(LIMIT + 5)
    return out, time.monotonic() - t0


def _assert_timed_out(out: list, took: float, srv: Trickler) -> None:
    assert out, f"the fetch still runs after {took:.1f} s (Timeout.transfer is {TRANSFER} s)"
    assert isinstance(out[0].error, TransferTimeout), repr(out[0].error)
    assert "trickles" in str(out[0].error)
    assert took < LIMIT, f"took {took:.1f} s"
    assert srv.trickled, "the reply was not trickled: the test tests nothing"


@pytest.mark.parametrize("path", ["fetch_whole", "read_small", "python"])
def test_a_trickled_small_read_ends_in_time(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One block (64 KiB, a small read): its whole reply, header first, a byte at a time. In C
    -- the usual fetch's one call (fetch_whole, which keeps the deadline itself) and the
    pipeline's small read (read_small, held by the watchdog), whose receive loops go on as long
    as each receive brings a byte -- and in its Python twin."""
    if path != "python" and blockcopy.read_small is None:
        pytest.skip("the native extension (kvbridge._kvcopy) is not built")
    if path != "fetch_whole":
        monkeypatch.setattr(blockcopy, "fetch_whole", None)
    if path == "python":
        monkeypatch.setattr(blockcopy, "read_small", None)
    srv = Trickler(lambda kind, rid: (_data(rid, 1), 0))
    rcv = _receiver()
    try:
        out, took = _fetch_in_thread(rcv, _handle(srv.url, 1), [0])
        _assert_timed_out(out, took, srv)
    finally:
        srv.close()
        rcv.close()


def test_a_trickled_reply_header_of_a_large_read_ends_in_time() -> None:
    """Four blocks (a large read): its reply header, then its fence, a byte at a time -- before
    any block byte, so the paced block receive never starts."""
    srv = Trickler(lambda kind, rid: (_data(rid, 4), 0))
    rcv = _receiver()
    try:
        out, took = _fetch_in_thread(rcv, _handle(srv.url, 4), [0, 1, 2, 3])
        _assert_timed_out(out, took, srv)
    finally:
        srv.close()
        rcv.close()


@pytest.mark.parametrize("face", ["small read", "large read", "ping"])
def test_a_trickled_error_body_ends_in_time(face: str) -> None:
    """An ERROR reply whose header comes at once and whose body trickles."""
    srv = Trickler(lambda kind, rid: (_error(rid), HEADER.size))
    try:
        if face == "ping":
            tr = TCPTransport(Timeout(connect=2, transfer=TRANSFER))
            out: list = []
            t0 = time.monotonic()

            def ping() -> None:
                try:
                    tr.ping(srv.url)
                except Exception as exc:
                    out.append(exc)
            th = threading.Thread(target=ping, daemon=True)
            th.start()
            th.join(LIMIT + 5)
            took = time.monotonic() - t0
            tr.close()
            assert out, f"the ping still runs after {took:.1f} s"
            assert isinstance(out[0], TransferTimeout), repr(out[0])
            assert took < LIMIT and srv.trickled
            return
        rcv = _receiver()
        try:
            n = 1 if face == "small read" else 4
            out, took = _fetch_in_thread(rcv, _handle(srv.url, n), list(range(n)))
            _assert_timed_out(out, took, srv)
        finally:
            rcv.close()
    finally:
        srv.close()


def test_a_trickled_layer_checksum_prefix_ends_in_time() -> None:
    """A layer reply whose fence and layers prefix come at once and whose checksums trickle."""
    nblocks = 4

    def reply(kind: Kind, rid: int) -> tuple[bytes, int]:
        nsums = L.num_layers * nblocks
        head = FENCE.pack(0, 0) + LAYERS.pack(0, L.num_layers, nsums)
        body = head + bytes(8 * nsums) + bytes(nblocks * L.block_nbytes) + TRAILER.pack(0, 0, 0)
        return pack(Kind.LDATA, rid, body), HEADER.size + len(head)

    srv = Trickler(reply)
    rcv = _receiver()
    try:
        out, took = _fetch_in_thread(rcv, _handle(srv.url, 4, layerwise=True), [0, 1, 2, 3])
        _assert_timed_out(out, took, srv)
    finally:
        srv.close()
        rcv.close()


def test_cancel_of_a_trickled_small_read_returns_in_time() -> None:
    """Transfer.cancel() of a small read blocked in C on a trickling sender returns by the read's
    deadline (the watchdog cuts the connection; no flag reaches a C receive)."""
    srv = Trickler(lambda kind, rid: (_data(rid, 1), 0))
    rcv = _receiver()
    try:
        t = rcv.start_fetch(_handle(srv.url, 1), [0], release=False)
        time.sleep(0.3)                  # in the read by now
        t0 = time.monotonic()
        t.cancel(LIMIT + 5)
        took = time.monotonic() - t0
        assert t.done(), f"cancel() returned after {took:.1f} s with the fetch still running"
        assert took < LIMIT, f"cancel() took {took:.1f} s"
        assert srv.trickled
    finally:
        srv.close()
        rcv.close()


def test_a_well_behaved_sender_is_never_cut_and_the_watchdog_goes_idle() -> None:
    """Real fetches end well within their deadlines: no connection is cut, the connections are
    reused, and once nothing is in flight the watchdog's thread stops waking."""
    cuts = WATCHDOG.cuts
    with KVSender(KVPool.allocate(L, 16), "tcp://127.0.0.1:0", leases=False) as snd:
        rcv = KVReceiver(KVPool.allocate(L, 16), leases=False, timeout=Timeout(connect=2, transfer=TRANSFER),
                         retry=Retry(attempts=1))
        try:
            for n in (1, 4, 1, 4):                  # small and large reads
                h = snd.publish(f"r{n}-{time.monotonic()}", snd.pool.alloc(n), 16 * n)
                rcv.fetch(h, rcv.pool.alloc(n)).raise_for_error()
            # reused: the fetches share one connection (the deferred releases' flusher may open a
            # second where it found that one busy twice in a row)
            assert rcv.transport(snd.url).extra("connections_opened") <= 2
        finally:
            rcv.close()
    assert WATCHDOG.cuts == cuts
    end = time.monotonic() + 5
    while not WATCHDOG.sleeping and time.monotonic() < end:
        time.sleep(0.05)
    assert WATCHDOG.sleeping, "the watchdog still wakes with nothing in flight"


@pytest.mark.parametrize("nblocks,at_once", [(1, 0), (1, HEADER.size + 5), (4, HEADER.size + FENCE.size + 4096)],
                         ids=["small-silent", "small-half", "large-half"])
def test_cancel_of_a_read_the_sender_stalls_returns_at_once(nblocks: int, at_once: int) -> None:
    """A sender that sends part of its reply, or none, then nothing (each receive would wait out
    the socket's timeout, Timeout.transfer = 30 s here): Transfer.cancel() cuts the connection
    the transfer reads from and returns at once, TransferCancelled, no byte landing after."""
    srv = loopback.Trickler(lambda kind, rid: (_data(rid, nblocks), at_once), 3600.0)
    rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=30),
                     retry=Retry(attempts=3))
    try:
        t = rcv.start_fetch(_handle(srv.url, nblocks), list(range(nblocks)), release=False)
        time.sleep(0.3)                  # in the read by now, blocked in a receive
        assert not t.done()
        t0 = time.monotonic()
        assert t.cancel(10)
        took = time.monotonic() - t0
        assert took < 0.5, f"cancel() took {took:.2f} s"
        assert isinstance(t.result(0).error, TransferCancelled), repr(t.result(0).error)
        assert not WATCHDOG.owners                                 # nothing left armed for it
    finally:
        srv.close()
        rcv.close()


class _Hangup(loopback.FakeSender):
    """A tcp:// sender that hangs up on every request (a retryable ConnectionLost), counting them."""

    def __init__(self) -> None:
        self.reads = 0
        super().__init__()

    def answer(self, c: socket.socket, kind: Kind, rid: int) -> None:
        self.reads += 1
        raise ConnectionResetError          # ends _conn: the connection closes unanswered


def test_no_retry_follows_a_cancel() -> None:
    """A read that fails retryably is retried (a fixed 2 s back-off here, up to 30 tries); a
    cancel during the back-off cuts it short and ends the transfer at the next try,
    TransferCancelled, with no further request to the sender."""
    from kvbridge.policy import Backoff
    srv = _Hangup()
    rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=30),
                     retry=Retry(attempts=30, backoff=Backoff(base=2.0, cap=2.0, jitter=False), deadline=None))
    try:
        t = rcv.start_fetch(_handle(srv.url, 1), [0], release=False)
        time.sleep(1.0)                 # the first try failed at once: half-way through its back-off
        assert srv.reads == 1 and not t.done()
        t0 = time.monotonic()
        assert t.cancel(5)
        took = time.monotonic() - t0
        reads = srv.reads
        assert isinstance(t.result(0).error, TransferCancelled), repr(t.result(0).error)
        time.sleep(2.5)
        assert srv.reads == reads, "the sender was asked again after the cancel"
        assert took < 0.5, f"cancel() took {took:.2f} s (1 s of back-off was left)"
    finally:
        srv.close()
        rcv.close()
