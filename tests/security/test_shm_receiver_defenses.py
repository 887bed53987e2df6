"""A hostile shm:// sender, seen from the receiver: a fake sender on a unix control socket (in
Linux's abstract namespace) speaks kvbridge frames and lies -- it trickles its OPEN, MAPPED or
DONE reply, declares an OPEN reply of megabytes, or names a handle table shorter than its own
header. Every fetch ends with a kvbridge error in its result, in time."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import struct
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from loopback import Trickler, held_descriptors

from kvbridge import (FetchResult, KVHandle, KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Retry, Timeout,
                      TransferTimeout)
from kvbridge.transports.shmtable import HandleTable, open_info
from kvbridge.transports.wire import FENCE, HEADER, Kind, encode_layers, pack

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 1, 8, block_size=2, dtype="float16")
TRANSFER = 1.0
BYTE_EVERY = 0.2     # a trickle: one byte this often, well inside the receive timeout


def FakeShmSender(reply: Callable[[Kind, int], tuple[Any, ...]]) -> Trickler:
    """An shm:// control socket answering each frame with ``reply(kind, request id)``: (the reply's
    bytes, how many of them to send at once; the rest one byte every ``BYTE_EVERY``)."""
    return Trickler(reply, BYTE_EVERY, shm_name=f"kvbtest-{secrets.token_hex(6)}")


def _fetch_from(reply: Callable[[Kind, int], tuple[Any, ...]]) -> tuple[FetchResult, float]:
    """One fetch of two blocks from a fake shm:// sender answering with ``reply``: its result and
    how long it took (receiver and sender closed after)."""
    fake = FakeShmSender(reply)
    rcv = _receiver()
    try:
        t0 = time.monotonic()
        res = rcv.fetch(_handle(fake.url), rcv.pool.alloc(2), release=False)
        return res, time.monotonic() - t0
    finally:
        rcv.close()
        fake.close()


def _handle(url: str, nblocks: int = 2) -> KVHandle:
    with KVSender(KVPool.allocate(L, 8), "inproc://", leases=False) as snd:
        h = snd.publish("real", snd.pool.alloc(nblocks), 2 * nblocks)
    return dataclasses.replace(h, urls=(url,))


def _receiver(transfer: float = TRANSFER) -> KVReceiver:
    return KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=transfer),
                      retry=Retry(attempts=1))


def _error(rid: int) -> bytes:
    return pack(Kind.ERROR, rid, (12).to_bytes(2, "big") + b"refused")


@pytest.fixture
def shared_pool() -> Iterator[KVPool]:
    pool = KVPool.allocate(L, 4, shared=True)
    yield pool
    pool.close()


def _mapped(pool: KVPool, rid: int, nbytes: int) -> bytes:
    """A MAPPED reply naming ``nbytes`` of ``pool``'s (real, this user's) segment."""
    assert pool.segment is not None
    name = pool.segment.name.encode()
    return pack(Kind.MAPPED, rid, FENCE.pack(0, 0) + encode_layers(0, 0, b"") + struct.pack("!H", len(name)) + name
                + struct.pack("!I", 1) + struct.pack("!QQ", pool.buffer_offsets[0], nbytes))


@pytest.mark.parametrize("stage", ["OPEN", "MAP", "DONE"])
def test_a_trickled_open_map_or_done_reply_ends_in_time(stage: str, shared_pool: KVPool) -> None:
    """Each byte of the reply comes inside the socket's receive timeout: only a deadline on the
    whole exchange (Timeout.transfer plus its bytes at the minimum rate) ends the fetch. Before,
    shm://'s OPEN, MAP and DONE were not held to one and such a fetch took hours."""
    body = b" " * 4000                                  # 800 s at BYTE_EVERY

    def reply(kind: Kind, rid: int) -> tuple[Any, ...]:
        if kind.name == stage:
            whole = pack(Kind.OK if kind is Kind.DONE else Kind.MAPPED, rid, body)
            return whole, 2
        if kind is Kind.OPEN:
            return pack(Kind.OK, rid), HEADER.size       # one-sided reads not offered: MAP/DONE
        if kind is Kind.MAP:
            whole = _mapped(shared_pool, rid, 2 * L.block_nbytes)
            return whole, len(whole)
        if kind is Kind.SEGFD:                           # the segment MAP named, passed whole
            whole = pack(Kind.OK, rid)
            return whole, len(whole), fd
        whole = _error(rid)
        return whole, len(whole)
    assert shared_pool.segment is not None
    fd = shared_pool.segment.peer_fd(False)
    try:
        res, took = _fetch_from(reply)
    finally:
        os.close(fd)
    assert not res.ok and isinstance(res.error, TransferTimeout), repr(res.error)
    assert took < TRANSFER + 3.0, took


def test_a_sender_slow_to_open_holds_up_no_other_senders_reads() -> None:
    """One OPEN at a time per sender, not per receiver: a sender trickling its OPEN reply (up to
    its deadline) does not hold up the first read from another sender."""
    fake = FakeShmSender(lambda kind, rid: (pack(Kind.MAPPED, rid, b" " * 4000), 2))
    src = KVPool.allocate(L, 4, shared=True)
    rcv = _receiver(transfer=4.0)
    try:
        with KVSender(src, "shm://", leases=False) as snd:
            h = snd.publish("honest", src.alloc(2), 4)
            stuck = threading.Thread(target=rcv.fetch, args=(_handle(fake.url), rcv.pool.alloc(2)),
                                     kwargs={"release": False}, daemon=True)
            stuck.start()
            time.sleep(0.3)                                  # its OPEN is trickling now
            t0 = time.monotonic()
            res = rcv.fetch(h, rcv.pool.alloc(2), release=False)
            took = time.monotonic() - t0
            assert res.ok, res.error
            assert took < 1.5, took                          # not behind the other's 4 s deadline
            stuck.join(10)
            assert not stuck.is_alive()
    finally:
        rcv.close()
        fake.close()
        src.close()


@pytest.fixture
def table() -> Iterator[HandleTable]:
    t = HandleTable(4)
    yield t
    t.close()


def _open_reply(pool: KVPool, table: HandleTable, table_name: str, **change: object) -> dict[str, object]:
    info: dict[str, object] = json.loads(open_info(pool, table))
    info["table"] = table_name
    info.update(change)
    return info


@pytest.mark.parametrize("size", [0, 4])
def test_an_open_reply_naming_a_table_shorter_than_its_header_is_refused(size: int, shared_pool: KVPool,
                                                                        table: HandleTable) -> None:
    """A handle table (a sealed memfd of the sender's user, passed for the name the OPEN reply
    gave it) too short to hold its header: a ProtocolError in the fetch's result (a raw
    struct.error escaped fetch())."""
    import fcntl
    name = f"kvb-1-{secrets.token_hex(6)}"
    short = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(short, size)
    fcntl.fcntl(short, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    info = json.dumps(_open_reply(shared_pool, table, name)).encode()
    assert shared_pool.segment is not None
    pool_fd = shared_pool.segment.peer_fd(False)
    passes = [pool_fd, short]      # the pool's, then the table's (the reader's order)

    def reply(kind: Kind, rid: int) -> tuple[object, ...]:
        if kind is Kind.SEGFD and passes:
            return pack(Kind.OK, rid), HEADER.size, passes.pop(0)
        whole = pack(Kind.MAPPED, rid, info) if kind is Kind.OPEN else _error(rid)
        return whole, len(whole)
    try:
        res, _ = _fetch_from(reply)
        assert not res.ok and isinstance(res.error, ProtocolError), repr(res.error)
        assert "table is malformed" in str(res.error)
        assert passes == []
    finally:
        os.close(short)
        os.close(pool_fd)


def test_an_open_reply_of_megabytes_is_refused_before_its_body(shared_pool: KVPool, table: HandleTable) -> None:
    """An OPEN reply is a layout and one offset per buffer (a few KB): one naming 500,000 layers
    (about 1 MB) made the reader build a million planes (hundreds of MB; 16 MiB: gigabytes). Refused
    from its header, before the body is read."""
    assert shared_pool.segment is not None
    layout = dict(L.to_dict(), num_layers=500_000)
    info = _open_reply(shared_pool, table, table.segment.name, layout=layout, num_blocks=0,
                       gen_offset=0, buffer_offsets=[0] * 500_000)
    body = json.dumps(info, separators=(",", ":")).encode()
    assert len(body) > 900_000

    def reply(kind: Kind, rid: int) -> tuple[bytes, int]:
        whole = pack(Kind.MAPPED, rid, body) if kind is Kind.OPEN else _error(rid)
        return whole, len(whole)
    res, took = _fetch_from(reply)
    assert not res.ok and isinstance(res.error, ProtocolError), repr(res.error)
    assert "OPEN reply of" in str(res.error)
    assert took < 1.0


@pytest.mark.parametrize("extra", [1, 5], ids=["two descriptors", "more than a reply may carry"])
def test_a_reply_with_the_wrong_descriptors_is_refused_and_every_one_closed(extra: int, shared_pool: KVPool,
                                                                            table: HandleTable) -> None:
    """SEGFD answered with two descriptors, or with more than a reply may carry (the kernel cuts
    them: MSG_CTRUNC): a ProtocolError, and not one descriptor left open in the reader."""
    assert shared_pool.segment is not None
    info = json.dumps(_open_reply(shared_pool, table, table.segment.name)).encode()
    fd = shared_pool.segment.peer_fd(False)

    def reply(kind: Kind, rid: int) -> tuple[object, ...]:
        if kind is Kind.SEGFD:
            return pack(Kind.OK, rid), HEADER.size, [fd] * (1 + extra)
        whole = pack(Kind.MAPPED, rid, info) if kind is Kind.OPEN else _error(rid)
        return whole, len(whole)
    try:
        before = len(held_descriptors(shared_pool.segment.name))
        res, _ = _fetch_from(reply)
        assert not res.ok and isinstance(res.error, ProtocolError), repr(res.error)
        assert ("not one" if extra == 1 else "more descriptors") in str(res.error), str(res.error)
        assert len(held_descriptors(shared_pool.segment.name)) == before     # none kept, none leaked
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["error", "other request id", "other kind", "long body", "trickled"])
def test_a_wrong_segfd_reply_fails_the_fetch_and_its_descriptor_is_closed(how: str, shared_pool: KVPool) -> None:
    """On the MAP path, SEGFD answered with an ERROR, a reply to another request, a reply of another
    kind, a body longer than an ERROR's, or a reply trickled a byte at a time -- each carrying a
    descriptor of a real sealed segment: the fetch fails (TransferTimeout within the deadline for the
    trickle), and the descriptor is closed every time."""
    assert shared_pool.segment is not None
    fd = shared_pool.segment.peer_fd(False)

    def reply(kind: Kind, rid: int) -> tuple[Any, ...]:
        if kind is Kind.OPEN:
            return pack(Kind.OK, rid), HEADER.size                  # one-sided reads not offered: MAP/DONE
        if kind is Kind.MAP:
            whole = _mapped(shared_pool, rid, 2 * L.block_nbytes)
            return whole, len(whole)
        if kind is Kind.SEGFD:
            whole = {"error": _error(rid), "other request id": pack(Kind.OK, rid + 7),
                     "other kind": pack(Kind.MAPPED, rid), "long body": pack(Kind.OK, rid, b" " * 5000),
                     "trickled": _error(rid)[:HEADER.size] + b" " * 4000}[how]
            return whole, 1 if how == "trickled" else len(whole), fd
        whole = _error(rid)
        return whole, len(whole)
    try:
        before = len(held_descriptors(shared_pool.segment.name))
        res, took = _fetch_from(reply)
        assert not res.ok, res
        if how == "trickled":
            assert isinstance(res.error, TransferTimeout) and took < TRANSFER + 3.0, (repr(res.error), took)
        elif how != "error":
            assert isinstance(res.error, ProtocolError), repr(res.error)
        assert len(held_descriptors(shared_pool.segment.name)) == before
    finally:
        os.close(fd)
