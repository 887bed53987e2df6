"""A small whole read over tcp is served in one piece (``KVSender.read_small``): copied out under
the lock that ends handles, validated after the copy, sent in one call. Every other read --
and every refusal -- takes the long way (``open_read``), which says precisely why. Reads and
releases leave nothing behind for the garbage collector, whose full passes over a large heap
would stall every transfer in flight."""

from __future__ import annotations

import gc
import socket
import threading
from typing import Any, Optional

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, blockcopy
from kvbridge.blockcopy import hash_blocks, planes
from kvbridge.errors import ConnectionLost, HandleNotFound, ProtocolError, StaleHandle
from kvbridge.lease.base import Claim
from kvbridge.transports import tcp
from kvbridge.transports.base import Spans
from kvbridge.transports.wire import FENCE, TRAILER, Kind, encode_error, pack

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not blockcopy.NATIVE, reason="the one-piece path needs the C extension")]

L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")   # 512 B per block


def _pools() -> tuple[KVPool, KVPool]:
    src, dst = KVPool.allocate(L, 16, allocator="engine"), KVPool.allocate(L, 16)
    for i, b in enumerate(src.buffers):
        b.view(-1).view(torch.uint8).copy_(torch.arange(b.numel() * b.element_size(), dtype=torch.int64)
                                           .mul(7 + i).remainder(251).to(torch.uint8))
    return src, dst


def _blocks(pool: KVPool, ids: list[int]) -> bytes:
    """The blocks' bytes in wire order."""
    return b"".join(bytes(v) for v in Spans.of_blocks(pool, ids).views())


def test_a_block_reused_during_the_copy_is_refused_by_the_trailer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The validate-after-read of the one-piece path: a generation that moves while the blocks
    are copied out (the engine reusing them behind the sender's back) makes the owner send
    STALE, and the receiver keeps nothing."""
    src, dst = _pools()
    ids = [2, 3]
    real = blockcopy.gather_blocks
    calls = []

    def gather_while_reused(*args: object) -> bytearray:
        out = real(*args)                            # type: ignore[arg-type]
        calls.append(1)
        src._gens[ids[0]] += 1                       # the block moved on while it was copied
        return out

    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        ok = snd.publish("fine", ids, 8)
        assert rcv.fetch(ok, [3, 4]).ok
        assert _blocks(dst, [3, 4]) == _blocks(src, ids)
        h = snd.publish("reused", ids, 8)
        before = _blocks(dst, [5, 6])
        monkeypatch.setattr(blockcopy, "gather_blocks", gather_while_reused)
        res = rcv.fetch(h, [5, 6])
        assert calls, "the read did not take the one-piece path"
        assert not res.ok and isinstance(res.error, StaleHandle)
        assert _blocks(dst, [5, 6]) == before         # refused: nothing landed


def test_reads_that_are_not_plain_take_the_long_way() -> None:
    src, _ = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        plain = snd.publish("plain", [0], 4)
        got = snd.read_small(plain.to_bytes(), 1 << 16, 32, 4)
        assert got is not None and bytes(got[0][32:-4]) == _blocks(src, [0])
        assert got is not None and got[1] and len(got[0]) == 32 + L.block_nbytes + 4
        assert snd.read_small(plain.to_bytes(), L.block_nbytes - 1, 32, 4) is None            # over the limit
        layered = snd.publish("layered", [1], 4, layers_ready=0)
        assert snd.read_small(layered.to_bytes(), 1 << 16, 32, 4) is None      # layers not ready
        with pytest.raises(ProtocolError):
            snd.open_read(layered.to_bytes(), None)
        forged = bytearray(plain.to_bytes())
        forged[-1] ^= 1
        assert snd.read_small(bytes(forged), 1 << 16, 32, 4) is None          # not the bytes issued
        snd.release_remote(plain.to_bytes())
        assert snd.read_small(plain.to_bytes(), 1 << 16, 32, 4) is None       # ended
        with pytest.raises(HandleNotFound):
            snd.open_read(plain.to_bytes(), None)
        src._gens[layered.block_ids[0]] += 1
        snd.mark_ready(layered, L.num_layers)
        assert snd.read_small(layered.to_bytes(), 1 << 16, 32, 4) is None      # its block moved on
        with pytest.raises(StaleHandle):
            snd.open_read(layered.to_bytes(), None)


def test_reads_and_releases_leave_nothing_for_the_collector() -> None:
    """Objects that outlive a fetch pile up in the young generations until the collector walks
    the whole heap (all of torch's and the engine's objects): a pause of every transfer in
    flight. With 3,000 handles published, fetching each once with release may leave no
    tracked object behind; ended handles are freed at once, not when the sender's deadline
    heap gets round to them."""
    src, dst = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        for _ in range(300):                                    # connections, caches, warm-up
            assert rcv.fetch(snd.publish("w", [0], 4), [1]).ok
        hs = [snd.publish("r", [0], 4, ttl=600.0) for _ in range(3000)]
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for h in hs:
                assert rcv.fetch(h, [1]).ok
            del hs, h
            grown = len(gc.get_objects()) - before
        finally:
            gc.enable()
        assert grown < 300, f"{grown} tracked objects outlived 3,000 fetches"


# -- the receiving end of a small read: the C call and its Python twin, against a scripted peer --
def _python_read(sock: socket.socket, rid: int, frame: bytes, dst: Spans, claim: Optional[Claim]) -> int:
    sock.sendall(frame)
    return tcp._read_small(sock, rid, dst, "read", claim)


def _native_read(sock: socket.socket, rid: int, frame: bytes, dst: Spans, claim: Optional[Claim]) -> int:
    return tcp._read_small_native(sock, rid, frame, dst, "read", claim)


READERS = [pytest.param(_python_read, id="python"), pytest.param(_native_read, id="native")]
BODY = bytes(range(256)) * 4          # two 512-byte blocks


def _reply(rid: int = 7, body: bytes = BODY, fence: tuple[int, int] = (0, 0), status: int = 0,
           kind: Kind = Kind.DATA, length: Optional[int] = None) -> bytes:
    payload = FENCE.pack(*fence) + body + TRAILER.pack(status, 0, 0)
    return pack(kind, rid, payload, length=len(payload) if length is None else length)


def _serve_once(reply: bytes, trickle: bool = False, close: bool = False) -> tuple[socket.socket, threading.Thread]:
    """A peer that takes one request and answers ``reply`` (byte by byte with ``trickle``; the
    connection closed after it with ``close``)."""
    mine, theirs = socket.socketpair()

    def run() -> None:
        theirs.recv(65536)
        if trickle:
            for i in range(len(reply)):
                theirs.sendall(reply[i:i + 1])
        else:
            theirs.sendall(reply)
        if close:
            theirs.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return mine, t


@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "trickled"])
def test_the_usual_reply_lands_hashed(read: Any, trickle: bool) -> None:
    _, dst = _pools()
    spans = Spans.of_blocks(dst, [4, 9])
    spans.want_digests = True
    sock, t = _serve_once(_reply(), trickle)
    assert read(sock, 7, pack(Kind.READ, 7, b"x"), spans, None) == len(BODY)
    t.join(5)
    assert _blocks(dst, [4, 9]) == BODY
    assert spans.digests == hash_blocks(planes(dst), [4, 9], L.part_nbytes, L.num_layers * L.num_parts)


REFUSALS = [
    pytest.param(pack(Kind.ERROR, 7, encode_error(HandleNotFound("gone here"))), HandleNotFound, id="error-reply"),
    pytest.param(_reply(rid=8), ProtocolError, id="another-request"),
    pytest.param(_reply(length=FENCE.size + 1024 + TRAILER.size + 1), ProtocolError, id="another-size"),
    pytest.param(_reply(kind=Kind.OK), ProtocolError, id="not-data"),
    pytest.param(b"XX" + _reply()[2:], ProtocolError, id="bad-magic"),
    pytest.param(_reply(status=2), StaleHandle, id="stale-trailer"),
    pytest.param(_reply(fence=(3, 4)), ProtocolError, id="fence-unasked"),
    pytest.param(_reply()[:100], ConnectionLost, id="closed-mid-reply"),
    pytest.param(_reply()[:10], ConnectionLost, id="closed-mid-header"),
]


@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("reply, error", REFUSALS)
def test_a_refused_reply_raises_and_lands_nothing(read: Any, reply: bytes, error: type) -> None:
    _, dst = _pools()
    spans = Spans.of_blocks(dst, [4, 9])
    before = _blocks(dst, [4, 9])
    sock, t = _serve_once(reply, close=True)
    with pytest.raises(error):
        read(sock, 7, pack(Kind.READ, 7, b"x"), spans, None)
    t.join(5)
    assert _blocks(dst, [4, 9]) == before


@pytest.mark.parametrize("read", READERS)
def test_a_claimed_read_learns_its_fence(read: Any) -> None:
    _, dst = _pools()
    spans = Spans.of_blocks(dst, [4, 9])
    sock, t = _serve_once(_reply(fence=(3, 4)))
    read(sock, 7, pack(Kind.READ, 7, b"x"), spans, Claim("me", 0, 0))
    t.join(5)
    assert spans.claimed == Claim("me", 3, 4) and _blocks(dst, [4, 9]) == BODY
