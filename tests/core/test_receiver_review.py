"""The receiver's faces under cancellation, close and batches: what a Transfer and a
FetchResult say must be true, and no byte lands once a cancel has returned. Senders are real
(inproc) or scripted on loopback, where a test must hold a reply half-way."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from typing import Callable

import pytest
import torch

from loopback import Listener

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout, TransferCancelled
from kvbridge.transports.wire import FENCE, HEADER, TRAILER, Kind, pack, recv_exact, unpack_header

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB blocks: past the small-read path
NBYTES = 4 * L.block_nbytes


class Scripted(Listener):
    """Answers every READ with ``script(conn, request id)``."""

    def __init__(self, script: Callable[[socket.socket, int], None]) -> None:
        self.script = script
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        super().__init__(s)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def _conn(self, c: socket.socket) -> None:
        with c:
            try:
                while not self.stop.is_set():
                    kind, rid, length = unpack_header(recv_exact(c, HEADER.size))
                    recv_exact(c, length)
                    if kind is Kind.READ:
                        self.script(c, rid)
            except Exception:                      # the receiver hung up
                pass


class HeldReply(Scripted):
    """Sends the DATA header and 1,000 bytes of 0x01, then waits for ``go`` to send the rest
    (0x02) and the trailer."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        super().__init__(self._reply)

    def _reply(self, c: socket.socket, rid: int) -> None:
        c.sendall(pack(Kind.DATA, rid, FENCE.pack(0, 0), length=FENCE.size + NBYTES + TRAILER.size))
        c.sendall(b"\x01" * 1000)
        self.started.set()
        self.go.wait(10)
        c.sendall(b"\x02" * (NBYTES - 1000) + TRAILER.pack(0, 0, 0))


def _handle(url: str) -> KVHandle:
    """A real handle of 4 blocks (ids 0-3 in its sender's pool), naming ``url`` as its sender."""
    with KVSender(KVPool.allocate(L, 8), "inproc://", leases=False) as snd:
        h = snd.publish("held", snd.pool.alloc(4), 64)
    return dataclasses.replace(h, urls=(url,))


def _later_bytes(pool: KVPool) -> int:
    """Bytes of 0x02 in the pool: what the held replies sent after ``go``."""
    return sum(int((b.view(-1).view(torch.uint8) == 2).sum()) for b in pool.buffers)


def _receiver(pool: KVPool, **kw: object) -> KVReceiver:
    return KVReceiver(pool, leases=False, verify=False, timeout=Timeout(connect=2, transfer=5),
                      retry=Retry(attempts=1), **kw)  # type: ignore[arg-type]


def test_a_cancelled_afetch_task_ends_only_once_no_byte_will_land() -> None:
    """Cancelling the task that awaits ``afetch`` while its reply lands: once the task has
    ended (the caller may reuse the destination blocks), no byte of the transfer lands."""
    srv = HeldReply()
    dst = KVPool.allocate(L, 8)
    rcv = _receiver(dst)

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
