"""The receiver's faces under cancellation, close and batches: what a Transfer and a
FetchResult say must be true, and no byte lands once a cancel has returned. Senders are real
(inproc) or scripted on loopback, where a test must hold a reply half-way."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from typing import Callable

import pytest
import torch

from loopback import FakeSender

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout, TransferCancelled
from kvbridge.transports.wire import FENCE, TRAILER, Kind, pack

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB blocks: past the small-read path
NBYTES = 4 * L.block_nbytes


class Scripted(FakeSender):
    """Answers every READ with ``script(conn, request id)``."""

    def __init__(self, script: Callable[[socket.socket, int], None]) -> None:
        self.script = script
        super().__init__()

    def answer(self, c: socket.socket, kind: Kind, rid: int) -> None:
        if kind is Kind.READ:
            self.script(c, rid)


class HeldReply(Scripted):
    """Sends the DATA header and 1,000 bytes of 0x01, then waits for ``go`` to send the rest
    (bytes of value ``later``) and the trailer."""

    def __init__(self, later: int = 2) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.later = later
        super().__init__(self._reply)

    def _reply(self, c: socket.socket, rid: int) -> None:
        c.sendall(pack(Kind.DATA, rid, FENCE.pack(0, 0), length=FENCE.size + NBYTES + TRAILER.size))
        c.sendall(b"\x01" * 1000)
        self.started.set()
        self.go.wait(10)
        c.sendall(bytes([self.later]) * (NBYTES - 1000) + TRAILER.pack(0, 0, 0))


def _handle(url: str) -> KVHandle:
    """A real handle of 4 blocks (ids 0-3 in its sender's pool), naming ``url`` as its sender."""
    with KVSender(KVPool.allocate(L, 8), "inproc://", leases=False) as snd:
        h = snd.publish("held", snd.pool.alloc(4), 64)
    return dataclasses.replace(h, urls=(url,))


def _later_bytes(pool: KVPool, later: int = 2) -> int:
    """Bytes of value ``later`` in the pool: what held replies sent after ``go``."""
    return sum(int((b.view(-1).view(torch.uint8) == later).sum()) for b in pool.buffers)


def _receiver(pool: KVPool, transfer: float = 5.0, **kw: object) -> KVReceiver:
    return KVReceiver(pool, leases=False, verify=False, timeout=Timeout(connect=2, transfer=transfer),
                      retry=Retry(attempts=1), **kw)  # type: ignore[arg-type]


def test_a_cancelled_afetch_task_ends_only_once_no_byte_will_land() -> None:
    """Cancelling the task that awaits ``afetch`` while its reply lands: once the task has
    ended (the caller may reuse the destination blocks), no byte of the transfer lands."""
    srv = HeldReply()
    dst = KVPool.allocate(L, 8)
    rcv = _receiver(dst, transfer=2.0)        # the cancelled read ends at the socket's timeout

    async def main() -> int:
        task = asyncio.ensure_future(rcv.afetch(_handle(srv.url), [0, 1, 2, 3], release=False))
        assert await asyncio.get_running_loop().run_in_executor(None, srv.started.wait, 5)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        srv.go.set()                          # the rest of the reply arrives after the task ended
        await asyncio.sleep(0.5)
        return _later_bytes(dst)
    try:
        assert asyncio.run(main()) == 0
    finally:
        srv.go.set()
        srv.close()
        rcv.close()


def test_a_transfer_cancelled_before_it_started_names_its_destination_blocks() -> None:
    """A transfer cancelled while it waits for a worker: its result's ``dst_block_ids`` and
    ``failed_block_ids`` are the destination blocks it was given, not the sender's block ids."""
    srv = HeldReply()
    rcv = _receiver(KVPool.allocate(L, 16), workers=1)
    try:
        h = _handle(srv.url)
        assert list(h.block_ids) == [0, 1, 2, 3]
        busy = rcv.start_fetch(h, [4, 5, 6, 7], release=False)      # holds the only worker
        assert srv.started.wait(5)
        t = rcv.start_fetch(h, [9, 12, 13, 15], release=False)
        assert t.cancel(5)
        res = t.result(1)
        assert isinstance(res.error, TransferCancelled)
        assert res.dst_block_ids == [9, 12, 13, 15] and res.failed_block_ids == [9, 12, 13, 15]
        srv.go.set()
        assert busy.wait(5)
    finally:
        srv.go.set()
        srv.close()
        rcv.close()


def test_close_ends_the_transfers_it_had_not_started() -> None:
    """``close()`` with transfers still queued for a worker: they end cancelled (before, nobody
    ever ran them, so ``wait``, ``result`` and ``await`` on them never returned); a running one
    is asked to stop."""
    srv = HeldReply()
    rcv = _receiver(KVPool.allocate(L, 16), workers=1)
    try:
        running = rcv.start_fetch(_handle(srv.url), [0, 1, 2, 3], release=False)
        assert srv.started.wait(5)
        queued = rcv.start_fetch(_handle(srv.url), [4, 5, 6, 7], release=False)
        rcv.close()
        assert queued.wait(2) and isinstance(queued.result().error, TransferCancelled)
        assert queued.result().failed_block_ids == [4, 5, 6, 7]

        async def awaited() -> bool:
            return (await asyncio.wait_for(queued, 2)).ok
        assert asyncio.run(awaited()) is False
        srv.go.set()
        assert running.wait(5) and running.cancel_event.is_set()
    finally:
        srv.go.set()
        srv.close()
        rcv.close()


def test_a_batch_is_checked_whole_before_any_of_it_moves() -> None:
    """``afetch_many`` with one invalid item raises before any transfer starts (before, the
    good handles were fetched and released behind the caller's back: their KV gone, their
    results never seen); ``fetch_many`` and ``afetch_many`` refuse two items naming one
    destination block (before, both reported ok and one held the other's KV)."""
    from kvbridge import BadHandle, PoolError
    src = KVPool.allocate(L, 8)
    dst = KVPool.allocate(L, 8)
    with KVSender(src, "inproc://", leases=False) as snd, _receiver(dst) as rcv:
        a, b = snd.publish("a", src.alloc(2), 32), snd.publish("b", src.alloc(2), 32)

        async def many(items: list) -> list:
            return await rcv.afetch_many(items)
        with pytest.raises(BadHandle):
            asyncio.run(many([(a, [0, 1]), (b"garbage", [2, 3])]))
        with pytest.raises(PoolError):
            asyncio.run(many([(a, [0, 1]), (b, [1, 2])]))
        with pytest.raises(PoolError):
            rcv.fetch_many([(a, [0, 1]), (b, [1, 2])])
        assert snd.stats.released == 0 and rcv.stats.fetches == 0
        assert [r.ok for r in rcv.fetch_many([(a, [0, 1]), (b, [2, 3])])] == [True, True]


def test_cancelling_afetch_many_stops_every_transfer_before_it_ends() -> None:
    """Cancelling the task awaiting ``afetch_many``: every one of its transfers stops, and the
    task ends only once none of them will land a byte (before, only the first was told: the
    task ended with the second still landing)."""
    srvs = [HeldReply(), HeldReply(later=3)]
    dst = KVPool.allocate(L, 8)
    rcv = _receiver(dst, transfer=2.0)

    async def main() -> int:
        task = asyncio.ensure_future(rcv.afetch_many([(_handle(s.url), ids) for s, ids in
                                                      zip(srvs, ([0, 1, 2, 3], [4, 5, 6, 7]))], release=False))
        for s in srvs:
            assert await asyncio.get_running_loop().run_in_executor(None, s.started.wait, 5)
        await asyncio.sleep(0.1)
        task.cancel()
        srvs[0].go.set()              # the first transfer sees its cancel as its next bytes land
        with pytest.raises(asyncio.CancelledError):
            await task
        srvs[1].go.set()              # the second one's bytes come only after the task ended
        await asyncio.sleep(0.5)
        return _later_bytes(dst, 3)
    try:
        assert asyncio.run(main()) == 0
    finally:
        for s in srvs:
            s.go.set()
            s.close()
        rcv.close()


def test_a_closed_receiver_refuses_fetches() -> None:
    """Every fetch face of a closed receiver raises ConfigError before it does anything (before,
    ``fetch`` and ``fetch_many`` consumed the handle over new connections that nothing closed
    any more, and ``start_fetch`` raised a bare RuntimeError); the handle stays fetchable."""
    from kvbridge import ConfigError
    src = KVPool.allocate(L, 8)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("a", src.alloc(2), 32)
        rcv = _receiver(KVPool.allocate(L, 8))
        rcv.close()

        async def afetch() -> object:
            return await rcv.afetch(h, [0, 1])
        for face in (lambda: rcv.fetch(h, [0, 1]), lambda: rcv.fetch_many([(h, [0, 1])]),
                     lambda: rcv.start_fetch(h, [0, 1]), lambda: asyncio.run(afetch())):
            with pytest.raises(ConfigError, match="closed"):
                face()
        assert snd.stats.reads == 0
        with _receiver(KVPool.allocate(L, 8)) as again:
            assert again.fetch(h, [0, 1]).ok


def test_cancelling_a_task_awaiting_a_reservation_ends_it_off_the_event_loop() -> None:
    """A task awaiting ``reserve()``'s transfer is cancelled while a write into it is stalled:
    the reservation ends (its blocks take no byte after the task ended) and the wait for the
    write in flight runs off the event loop (the loop keeps running meanwhile)."""
    from kvbridge.integrity import layer_checksums, pack_sums
    from kvbridge.transports.base import Spans
    from kvbridge.transports.wire import encode_request
    small = KVLayout.vllm_flash(2, 1, 4, block_size=2, dtype="float16")
    dst = KVPool.allocate(small, 4)
    junk = KVPool.allocate(small, 4)
    for b in junk.buffers:
        b.view(-1).view(torch.uint8).fill_(0xEE)
    data = b"".join(bytes(v) for v in Spans.of_blocks(junk, [0, 1]).views())
    with KVReceiver(dst, listen="tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=1.5)) as rcv:
        t = rcv.reserve([0, 1], "r")
        host, port = rcv.urls[0].removeprefix("tcp://").rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
        sums = pack_sums(layer_checksums(junk, [0, 1], range(0, 2)))
        s.sendall(pack(Kind.WRITE, 1, encode_request(t.reservation.to_bytes(), None, None, (0, 2), last=True,
                                                     nbytes=len(data), sums=sums)))

        async def main() -> float:
            async def wait() -> object:
                return await t
            task = asyncio.ensure_future(wait())
            await asyncio.sleep(0.3)
            beats: list[float] = []

            async def beat() -> None:
                while True:
                    beats.append(asyncio.get_running_loop().time())
                    await asyncio.sleep(0.02)
            ticker = asyncio.ensure_future(beat())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ticker.cancel()
            return max(b - a for a, b in zip(beats, beats[1:]))
        try:
            gap = asyncio.run(main())
            assert t.state.value == "cancelled"
            try:
                s.sendall(data)
            except OSError:
                pass
            time.sleep(0.3)
            assert not any(bool((b.view(-1).view(torch.uint8) == 0xEE).any()) for b in dst.buffers)
            assert gap < 0.5, f"the event loop stood still for {gap:.2f} s"
        finally:
            s.close()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?foo=bar", "redis://[zz/0", "http://127.0.0.1:1/"])
def test_a_handle_naming_an_unusable_lease_server_is_a_bad_handle(url: str) -> None:
    """The lease server a leased handle names (``lease_url``, outside its lease digest) comes from
    the sender, or from whoever forged the handle: a URL the store cannot use raised ConfigError
    -- "fix your configuration" -- from fetch and start_fetch. It is the handle's fault:
    BadHandle, before anything moves; the receiver's own ``leases=`` URL stays a ConfigError."""
    from kvbridge import BadHandle, ConfigError

    with KVSender(KVPool.allocate(L, 4), "inproc://", leases=False) as snd, \
            KVReceiver(KVPool.allocate(L, 4), leases=None) as rcv:
        h = snd.publish("r", snd.pool.alloc(1), 16)
        forged = dataclasses.replace(h, lease_url=url, lease_id="x")
        forged = dataclasses.replace(forged, lease_id=forged.lease_digest())
        dst = rcv.pool.alloc(1)
        with pytest.raises(BadHandle, match="lease server"):
            rcv.fetch(forged, dst)
        with pytest.raises(BadHandle, match="lease server"):
            rcv.start_fetch(forged, dst)
        assert rcv.pool.generations(dst) == rcv.pool.generations(dst)
    with pytest.raises(ConfigError):
        with KVReceiver(KVPool.allocate(L, 4), leases=url) as own:
            own.fetch(forged, own.pool.alloc(1))


def test_a_receiver_refuses_a_pool_secret_or_reservation_ttl_it_cannot_use() -> None:
    """As KVSender does: a str or empty secret (every MAC check and reservation signing then
    failed inside hmac), no pool or a closed one (an AttributeError later), and a reservation
    TTL that is not finite seconds in (0, MAX_TTL] are ConfigError at construction."""
    from kvbridge import ConfigError

    closed = KVPool.allocate(L, 2)
    closed.close()
    for kw in ({"secret": "abc"}, {"secret": b""}, {"reservation_ttl": float("nan")}, {"reservation_ttl": 0},
               {"reservation_ttl": 1e300}):
        with pytest.raises(ConfigError):
            KVReceiver(KVPool.allocate(L, 2), leases=False, **kw)  # type: ignore[arg-type]
    for pool in (None, closed):
        with pytest.raises(ConfigError, match="KVPool"):
            KVReceiver(pool, leases=False)  # type: ignore[arg-type]
    with KVReceiver(KVPool.allocate(L, 2), leases=False, secret=b"k" * 32, reservation_ttl=5) as ok:
        assert ok.secret == b"k" * 32
