"""A small whole read over tcp is served in one piece (``KVSender.serve_small``): checked, copied
out, validated after the copy and sent in one C call. Every other read --
and every refusal -- takes the long way (``open_read``), which says precisely why. Reads and
releases leave nothing behind for the garbage collector, whose full passes over a large heap
would stall every transfer in flight."""

from __future__ import annotations

import gc
import socket
import threading
import time
from typing import Any, Optional

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, blockcopy
from kvbridge.blockcopy import hash_blocks, planes
from kvbridge.errors import AccessDenied, ConfigError, ConnectionLost, HandleNotFound, ProtocolError, StaleHandle
from kvbridge.lease import EmbeddedRedis
from kvbridge.lease.base import Claim
from kvbridge.transports import tcp
from kvbridge.transports.base import Spans
from kvbridge.transports.wire import FENCE, TRAILER, VERSION, Kind, encode_error, encode_request, pack

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


def _served(snd: KVSender, payload: bytes, rid: int = 5) -> Optional[bytes]:
    """What ``serve_small`` sends for a READ ``payload`` (None: it served nothing, sent nothing)."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        if not snd.serve_small(mine.fileno(), payload, rid):
            theirs.setblocking(False)
            with pytest.raises(BlockingIOError):
                theirs.recv(1)                       # nothing was sent
            return None
        mine.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := theirs.recv(1 << 16):
            out += chunk
        return out


def _whole(h: Any) -> bytes:
    """A whole read's request for a handle (or its bytes)."""
    return encode_request(h if isinstance(h, bytes) else h.to_bytes(), None, None)


def _answers(answers: list[int], n: int) -> list[int]:
    """``answers`` once it holds ``n`` (the server thread appends after its reply has left)."""
    deadline = time.monotonic() + 5
    while len(answers) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    return answers


def test_a_block_reused_before_the_read_is_refused_the_long_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-piece path checks the handle's generations after its copy (nothing can end the
    handle or free a block meanwhile: it holds the GIL from the lookup to the check). A block
    the engine reused behind the sender's back is not served; the long way says StaleHandle,
    and the receiver keeps nothing."""
    src, dst = _pools()
    ids = [2, 3]
    real, answers = blockcopy.serve_next, []

    def serve(fd: int, buf: bytearray, *rest: Any) -> tuple[int, int, int, int]:
        counts = rest[-1]                         # reads, bytes (the sender's stats)
        before = counts[1]
        out = real(fd, buf, *rest)                # type: ignore[misc]
        if out[3]:                                # the READs the one-piece path answered (one at a time here)
            answers.append(counts[1] - before)
        if out[0] < 0 and out[2] >= 16 and buf[3] == Kind.READ:   # ... and one it left to the long way
            answers.append(out[0])
        return out                                # type: ignore[no-any-return]

    monkeypatch.setattr(blockcopy, "serve_next", serve)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        ok = snd.publish("fine", ids, 8)
        assert rcv.fetch(ok, [3, 4]).ok
        assert _answers(answers, 1) == [2 * L.block_nbytes] and _blocks(dst, [3, 4]) == _blocks(src, ids)
        h = snd.publish("reused", ids, 8)
        before = _blocks(dst, [5, 6])
        src._gens[ids[1]] += 1                     # the engine reused a block
        res = rcv.fetch(h, [5, 6])
        assert _answers(answers, 2)[1:] == [-1], "the one-piece path served a block that moved on"
        assert not res.ok and isinstance(res.error, StaleHandle)
        assert _blocks(dst, [5, 6]) == before      # refused: nothing landed


def _take(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the sender closed the connection"
        out += chunk
    return out


def test_the_frame_loop_answers_a_read_in_its_receive_and_keeps_what_follows() -> None:
    """The sender's frame loop receives and answers the usual READ in one C call
    (``KVSender.serve_next``): frames that came in the same receive behind it are served next,
    in order; a READ that arrives in pieces, or junk, goes to the frame reader as before."""
    src, _ = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", [1, 4], 8)
        data = pack(Kind.DATA, 7, FENCE.pack(0, 0) + _blocks(src, [1, 4]) + TRAILER.pack(0, 0, 0))
        host, port = tcp.parse_tcp_url(snd.url)
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(pack(Kind.READ, 7, _whole(h)) + pack(Kind.PING, 8, b"hi") + pack(Kind.READ, 9, _whole(h)))
            assert _take(s, len(data)) == data
            assert _take(s, 18) == pack(Kind.PONG, 8, b"hi")
            assert _take(s, len(data))[4:8] == (9).to_bytes(4, "big")       # the second read, in order
            frame = pack(Kind.READ, 10, _whole(h))
            s.sendall(frame[:10])                                          # a header in two pieces
            time.sleep(0.05)
            s.sendall(frame[10:])
            assert _take(s, len(data)) == pack(Kind.DATA, 10, data[16:])
            s.sendall(b"KB" + bytes([VERSION]) + b"\x7f" + bytes(12))               # a kind nobody knows
            s.settimeout(5)
            assert s.recv(1 << 16)[3] == Kind.ERROR                        # refused as before: framing lost
        assert snd.stats.reads == 3 and snd.stats.bytes_served == 3 * 2 * L.block_nbytes


def test_consecutive_reads_are_answered_in_one_call_each_counted_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's frame loop stays in C while each receive brings one whole usual READ: two
    reads, then the peer's close, are one ``serve_next`` call that answered 2; the stats count
    each read once its reply has left, not when the call returns. A pool closed while the loop waits
    for the next request is seen after that receive: the READ goes the long way (the
    connection closed, "the pool is closed"), never answered out of the closed pool's memory."""
    src, _ = _pools()
    real, calls = blockcopy.serve_next, []

    def serve(*args: Any) -> Any:
        out = real(*args)                         # type: ignore[misc]
        calls.append(out)
        return out
    monkeypatch.setattr(blockcopy, "serve_next", serve)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", [1, 4], 8)
        n = len(pack(Kind.DATA, 1, FENCE.pack(0, 0) + _blocks(src, [1, 4]) + TRAILER.pack(0, 0, 0)))
        host, port = tcp.parse_tcp_url(snd.url)
        with socket.create_connection((host, port), timeout=5) as s:
            for rid in (1, 2):
                s.sendall(pack(Kind.READ, rid, _whole(h)))
                assert _take(s, n)[3] == Kind.DATA
                deadline = time.monotonic() + 5         # counted after its reply has left, before
                while snd.stats.reads < rid and time.monotonic() < deadline:    # the next request came
                    time.sleep(0.001)
                assert snd.stats.reads == rid
            assert calls == []                          # ... all in the one call, still waiting
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls and calls[0][2:] == (-3, 2), calls   # the peer closed; two answered
        calls.clear()
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(pack(Kind.READ, 3, _whole(h)))
            assert _take(s, n)[3] == Kind.DATA
            src.close()                                 # while the loop waits in its receive
            s.sendall(pack(Kind.READ, 4, _whole(h)))
            got = s.recv(1 << 16)                       # the long way: "the pool is closed", no data
            assert got == b"" or got[3] == Kind.ERROR, got[:16]


def test_only_whole_plain_reads_of_live_indexed_handles_are_served_in_one_piece() -> None:
    src, _ = _pools()
    big = KVPool.allocate(L, 160, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, \
            KVSender(big, "tcp://127.0.0.1:0", leases=False) as snd_big:
        plain = snd.publish("plain", [0, 5], 8)
        want = pack(Kind.DATA, 5, FENCE.pack(0, 0) + _blocks(src, [0, 5]) + TRAILER.pack(0, 0, 0))
        assert _served(snd, _whole(plain)) == want
        assert _served(snd, encode_request(plain.to_bytes(), [1], None)) is None                 # some blocks
        assert _served(snd, encode_request(plain.to_bytes(), None, Claim("me", 0, 0))) is None   # a claim
        assert _served(snd, encode_request(plain.to_bytes(), None, None, layers=(0, 1))) is None  # layers
        for junk in (b"", b"\x00", _whole(plain)[:40], _whole(plain)[:-1] + b"\x01", b"\xff" * 300):
            assert _served(snd, junk) is None
        forged = bytearray(plain.to_bytes())
        forged[-1] ^= 1
        assert _served(snd, _whole(bytes(forged))) is None                   # not the bytes issued
        layered = snd.publish("layered", [1], 4, layers_ready=0)
        assert _served(snd, _whole(layered)) is None                         # layers not ready
        snd.mark_ready(layered, L.num_layers)
        assert _served(snd, _whole(layered)) == pack(Kind.DATA, 5, FENCE.pack(0, 0) + _blocks(src, [1])
                                                     + TRAILER.pack(0, 0, 0))
        snd.release_remote(plain.to_bytes())
        assert _served(snd, _whole(plain)) is None                           # ended
        with pytest.raises(HandleNotFound):
            snd.open_read(plain.to_bytes(), None)
        src._gens[1] += 1
        assert _served(snd, _whole(layered)) is None                         # its block moved on
        with pytest.raises(StaleHandle):
            snd.open_read(layered.to_bytes(), None)
        over = snd_big.publish("over", list(range(129)), 129 * 4)            # 64.5 KiB: over the limit
        assert _served(snd_big, _whole(over)) is None
        grant = snd_big.open_read(over.to_bytes(), None)
        assert grant.spans.nbytes == 129 * L.block_nbytes
        grant.close()       # a read left in flight holds the sender's close for Timeout.transfer
        under = snd_big.publish("under", list(range(128)), 128 * 4)
        assert len(_served(snd_big, _whole(under)) or b"") == 36 + 128 * L.block_nbytes


def test_a_leased_handle_is_never_served_in_one_piece() -> None:
    src, _ = _pools()
    with EmbeddedRedis() as redis, KVSender(src, "tcp://127.0.0.1:0", leases=redis.url) as snd:
        h = snd.publish("leased", [0], 4)
        assert h.lease_id and _served(snd, _whole(h)) is None
        with pytest.raises(AccessDenied):
            snd.open_read(h.to_bytes(), None)


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
    assert dst.block_ids is not None
    dst.claimed, sums = tcp._read_small_native(sock, rid, frame, dst.pool, dst.block_ids, dst.nbytes,
                                               dst.want_digests, "read", claim)
    dst.digests = sums
    return dst.nbytes


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


# -- the receiver's usual fetch (KVReceiver.fetch's one C call) goes on in the pipeline when it must --
def _after_fetch_whole(monkeypatch: pytest.MonkeyPatch, then: Any) -> list[int]:
    """Make ``blockcopy.fetch_whole`` (the usual tcp fetch's one C call) return ``then(what it
    returned, its arguments, call number)``; the call numbers so far."""
    real, calls = blockcopy.fetch_whole, []
    assert real is not None

    def fetch_whole(*args: Any) -> Any:
        calls.append(len(calls) + 1)
        return then(real(*args), args, calls[-1])

    monkeypatch.setattr(blockcopy, "fetch_whole", fetch_whole)
    return calls


def _as_fallback(pool: KVPool, ids: list[int], gens: list[int], detail: Any, code: int) -> Any:
    """A fetch_whole that landed verified turned into one that did not (``code``, ``detail``):
    its marks held again, as the C call leaves them for the caller."""
    pool._land(ids)
    return code, gens, detail


def test_the_usual_fetch_retries_a_sender_that_is_gone_then_fails_retryable() -> None:
    from kvbridge import Retry
    from kvbridge.errors import Action, PeerUnavailable
    from kvbridge.policy import Backoff
    src, dst = _pools()
    retry = Retry(attempts=3, backoff=Backoff(base=0.01, cap=0.02), deadline=5.0)
    with KVReceiver(dst, leases=False, retry=retry) as rcv:
        with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
            h = snd.publish("gone", [2, 3], 8)
        before = _blocks(dst, [5, 6])
        res = rcv.fetch(h, [5, 6])
        assert not res.ok and isinstance(res.error, PeerUnavailable) and res.error.action is Action.RETRY
        assert res.attempts == 3 and res.failed_block_ids == [5, 6] and _blocks(dst, [5, 6]) == before
        assert rcv.stats.retries == 2 and rcv.stats.failed == 1 and dst.landing() == []


def test_the_usual_fetch_of_a_url_with_no_backend_here_fails_in_its_result() -> None:
    """A handle whose URL names a scheme no backend here serves: ConfigError in the result, as
    the pipeline gives it, not raised; nothing marked."""
    import dataclasses
    src, dst = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = dataclasses.replace(snd.publish("nowhere", [2, 3], 8), urls=("nosuch://x",))
        res = rcv.fetch(h, [5, 6])
        assert not res.ok and isinstance(res.error, ConfigError) and "nosuch" in str(res.error), repr(res.error)
        assert dst.landing() == []


@pytest.mark.skipif(blockcopy.fetch_whole is None, reason="the native extension (kvbridge._kvcopy) is not built")
def test_the_usual_fetch_refetches_a_block_whose_digest_is_wrong_once(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("flip", [2, 3], 8)
        gens = dst.generations([5, 6])
        calls = _after_fetch_whole(monkeypatch, lambda got, args, n: got if n > 1 else _as_fallback(  # as if block 1's
            dst, [5, 6], gens, [h.checksums[0], h.checksums[1] ^ 1], 0))                # bytes changed in transit
        res = rcv.fetch(h, [5, 6])
        assert calls == [1]
        assert res.ok and res.attempts == 1 and rcv.stats.refetches == 1 and rcv.stats.integrity_failures == 0
        assert _blocks(dst, [5, 6]) == _blocks(src, [2, 3]) and dst.landing() == []
        bad = snd.publish("bad", [2, 3], 8)
        first = Spans.of_blocks(src, [2]).views()[0]
        first[0] = (first[0] + 1) % 256                    # the sender's block itself differs now
        res = rcv.fetch(bad, [7, 8])
        assert not res.ok and type(res.error).__name__ == "IntegrityError" and res.failed_block_ids == [7]
        assert rcv.stats.integrity_failures == 1 and dst.landing() == []


def _tcp_once(then: Any) -> tuple[str, threading.Thread]:
    """A tcp:// peer on loopback that takes one connection and one request, calls ``then(rid)``
    and sends what it returns (None: closes the connection instead)."""
    lst = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lst.accept()
        with conn, lst:
            head = _take(conn, 16)
            _take(conn, int.from_bytes(head[8:16], "big"))
            out = then(int.from_bytes(head[4:8], "big"))
            if out is not None:
                conn.sendall(out)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{lst.getsockname()[1]}", t


@pytest.mark.parametrize("outcome", ["landed", "peer gone"])
def test_the_usual_fetch_refuses_a_destination_freed_during_the_read(outcome: str) -> None:
    """A destination block freed while the usual fetch waits for its reply (the peer frees it
    before it answers): PoolError naming it, whether the bytes landed or the read failed
    (retrying would write into a block that is not the fetch's any more), nothing tried again,
    nothing left marked."""
    import dataclasses
    src, dst = _pools()
    with KVSender(src, "inproc://", leases=False) as snd:
        h = snd.publish("moved", [2, 3], 8)

    def freed_meanwhile(rid: int) -> Optional[bytes]:
        dst._gens[6] += 1                                  # the engine reused a destination block
        return _reply(rid, _blocks(src, [2, 3])) if outcome == "landed" else None

    url, t = _tcp_once(freed_meanwhile)
    with KVReceiver(dst, leases=False) as rcv:
        res = rcv.fetch(dataclasses.replace(h, urls=(url,)), [5, 6], release=False)
    t.join(5)
    assert not res.ok and "freed or retired during the transfer" in str(res.error), repr(res.error)
    assert res.failed_block_ids == [5, 6] and res.attempts == 1 and dst.landing() == []


@pytest.mark.skipif(blockcopy.fetch_whole is None, reason="the native extension (kvbridge._kvcopy) is not built")
@pytest.mark.parametrize("then", ["retry", "refetch"])
def test_a_fallback_holds_to_the_generations_of_the_fetch_start(monkeypatch: pytest.MonkeyPatch, then: str) -> None:
    """A destination block freed just after the usual fetch's C call checked it, before the
    pipeline takes over (a retry after a failed read, a refetch after a bad digest): the
    pipeline compares with the generations of the fetch's start, so the fetch fails with
    PoolError, not ok."""
    src, dst = _pools()
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("moved", [2, 3], 8)
        gens = dst.generations([5, 6])

        def freed_after(got: Any, args: Any, n: int) -> Any:
            assert got is True
            dst._gens[6] += 1                              # another thread frees block 6 right then
            if then == "retry":
                return _as_fallback(dst, [5, 6], gens, ConnectionResetError(104, "Connection reset by peer"), 6)
            return _as_fallback(dst, [5, 6], gens, [h.checksums[0], h.checksums[1] ^ 1], 0)

        _after_fetch_whole(monkeypatch, freed_after)
        res = rcv.fetch(h, [5, 6])
        assert not res.ok and "freed or retired during the transfer" in str(res.error), repr(res.error)
        assert res.failed_block_ids == [5, 6] and dst.landing() == []


def test_generations_held_and_unverified() -> None:
    """The two helpers of Transport.read_small: a moved generation turns any outcome but an
    interrupt into TransferCancelled; a read that did not hash never counts as verified."""
    from kvbridge.errors import TransferCancelled
    from kvbridge.integrity import block_checksums
    from kvbridge.transports.base import generations_held, unverified
    src, dst = _pools()
    gens = dst.generations([5, 6])
    assert generations_held(dst, [5, 6], gens, "r", lambda: 7) == 7

    def boom() -> None:
        raise ValueError("read failed")
    with pytest.raises(ValueError):
        generations_held(dst, [5, 6], gens, "r", boom)

    def moved(exc: Optional[BaseException]) -> Any:
        def read() -> int:
            dst._gens[5] += 1
            if exc is not None:
                raise exc
            return 7
        return read
    for exc in (None, ValueError("read failed")):
        with pytest.raises(TransferCancelled, match="freed or retired"):
            generations_held(dst, [5, 6], dst.generations([5, 6]), "r", moved(exc))
    with pytest.raises(KeyboardInterrupt):
        generations_held(dst, [5, 6], dst.generations([5, 6]), "r", moved(KeyboardInterrupt()))
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("u", [2, 3], 8)
    for b in dst.buffers:
        b.view(-1).view(torch.uint8).zero_()
    assert unverified(None, h, False) is None
    with pytest.raises(ProtocolError):                 # an unhashed read never counts as verified
        unverified(None, h, True)
    landed = block_checksums(dst, [5, 6])
    assert unverified(landed, h, True) == landed != list(h.checksums)   # differs: handed back
    assert unverified(list(h.checksums), h, True) is None


# -- the usual fetch's one C call, outcome by outcome (a socketpair as the peer) --
def _fetch_whole(dst: KVPool, reply: Optional[bytes], ids: Any = (4, 9), sums: Any = None, before: Any = None,
                 trickle: bool = False, timeout: float = 5.0, leased: Any = (),
                 asked: Optional[list[bytes]] = None) -> Any:
    """``blockcopy.fetch_whole`` into blocks ``ids`` of ``dst`` against a peer that answers
    ``reply`` (None: closes at once; ``before(rid)`` runs as the request arrives; ``leased``:
    the optional (claim, fence) arguments; ``asked`` gets the request's payload)."""
    mine, theirs = socket.socketpair()
    if reply is None:
        theirs.close()

    def run() -> None:
        head = _take(theirs, 16)
        payload = _take(theirs, int.from_bytes(head[8:16], "big"))
        if asked is not None:
            asked.append(payload)
        if before is not None:
            before()
        step = 1 if trickle else len(reply or b"")
        try:
            for i in range(0, len(reply or b""), step):
                theirs.sendall((reply or b"")[i:i + step])
                if trickle:
                    time.sleep(0.05)
        except OSError:                                 # the deadline passed: the reader gave up
            pass
        theirs.close()
    t = threading.Thread(target=run, daemon=True)
    if reply is not None:
        t.start()
    with mine:
        from kvbridge.transports.wire import set_os_timeouts
        set_os_timeouts(mine, 2.0)
        out = blockcopy.fetch_whole(mine.fileno(), b"ticket", 7, b"", len(BODY), planes(dst),
                                    ids if isinstance(ids, (list, tuple)) else ids, L.part_nbytes, sums,
                                    dst.live_generations, dst._landing, timeout, *leased)
    if reply is not None:
        t.join(5)
    return out


def test_fetch_whole_leased_asks_the_owner_to_claim_and_hands_back_its_fence() -> None:
    """Leased (``claim``, ``fence``): the READ carries the claim (CLAIM_ME) as the wire encodes
    it; the reply's fence is written to ``fence`` whatever the outcome once its header passed;
    a leased reply without a fence, or an unleased one with one, is code 2, nothing landed; a
    leased landing leaves its marks to the caller."""
    from kvbridge.transports.wire import CLAIM_ME, decode_request, encode_claim
    me = CLAIM_ME("rcv-1", 30.0)
    _, dst = _pools()
    asked: list[bytes] = []
    fence = bytearray(b"\xff" * 16)
    assert _fetch_whole(dst, _reply(7, fence=(3, 4)), [4, 9], leased=(encode_claim(me), fence), asked=asked) is True
    req = decode_request(asked[0])
    assert req.ticket == b"ticket" and req.claim == me and req.indices is None
    assert FENCE.unpack(fence) == (3, 4) and _blocks(dst, [4, 9]) == BODY
    assert dst.landing() == [4, 9]                                # leased: the caller's to undo after its release
    dst._landed([4, 9])
    code, _, detail = _fetch_whole(dst, _reply(7, fence=(3, 4)), [4, 9], sums=(1, 2), leased=(encode_claim(me), fence))
    assert code == 0 and FENCE.unpack(fence) == (3, 4)            # a checksum differs: the fence known still
    dst._landed([4, 9])
    for reply, leased in ((_reply(7), (encode_claim(me), fence)), (_reply(7, fence=(3, 4)), ())):
        _, dst = _pools()
        untouched = _blocks(dst, [4, 9])
        code, _, detail = _fetch_whole(dst, reply, [4, 9], leased=leased)
        assert code == 2 and _blocks(dst, [4, 9]) == untouched and dst.landing() == [4, 9]
        dst._landed([4, 9])
    for bad in ((b"short", fence), (encode_claim(me), bytearray(8)), (encode_claim(me),)):
        assert _fetch_whole(dst, None, [4, 9], leased=bad) is None and dst.landing() == []
    with pytest.raises(TypeError):                                  # the fence must be writable
        _fetch_whole(dst, None, [4, 9], leased=(encode_claim(me), b"\0" * 16))
    assert dst.landing() == []


def test_fetch_whole_holds_the_fence_against_a_resize_while_it_waits() -> None:
    """The fence is held as a writable buffer for the whole call: another thread that tries to
    shrink it while the call waits for the reply gets BufferError, and the fence is written."""
    from kvbridge.transports.wire import CLAIM_ME, encode_claim
    _, dst = _pools()
    fence = bytearray(16)
    tried: list[BaseException] = []

    def shrink() -> None:
        try:
            del fence[2:]
        except BufferError as exc:
            tried.append(exc)
    assert _fetch_whole(dst, _reply(7, fence=(3, 4)), [4, 9], before=shrink,
                        leased=(encode_claim(CLAIM_ME("rcv-1", 30.0)), fence)) is True
    assert len(tried) == 1 and FENCE.unpack(fence) == (3, 4)
    dst._landed([4, 9])


def test_fetch_whole_lands_verifies_and_unmarks() -> None:
    from kvbridge.integrity import block_checksums
    src, dst = _pools()
    assert _fetch_whole(dst, _reply(7), [4, 9]) is True                  # no verification asked
    assert _blocks(dst, [4, 9]) == BODY and dst.landing() == []
    sums = tuple(block_checksums(dst, [4, 9]))                          # the handle's, as a sender computes them
    _, dst = _pools()
    assert _fetch_whole(dst, _reply(7), [4, 9], sums) is True
    assert _blocks(dst, [4, 9]) == BODY and dst.landing() == []


@pytest.mark.parametrize("case", ["digest", "header", "trailer", "closed", "generation", "deadline", "send"])
def test_fetch_whole_hands_every_other_outcome_back_marked(case: str) -> None:
    """Each outcome but a verified landing: its code, the generations as it began, the marks
    left for the caller; a checksum that differs is reported with every block's."""
    _, dst = _pools()
    gens = dst.generations([4, 9])
    reply, sums, before, trickle, timeout = _reply(7), None, None, False, 5.0
    if case == "digest":
        sums = (1, 2)
    elif case == "header":
        reply = _reply(8)                                   # another request's
    elif case == "trailer":
        reply = _reply(7, status=2)
    elif case == "closed":
        reply = _reply(7)[:40]
    elif case == "generation":
        def before() -> None:
            dst._gens[9] += 1
    elif case == "deadline":
        trickle, timeout = True, 0.3
    elif case == "send":
        reply = None
    untouched = _blocks(dst, [4, 9])
    code, got_gens, detail = _fetch_whole(dst, reply, [4, 9], sums, before, trickle, timeout)
    want = {"digest": 0, "header": 1, "trailer": 2, "closed": 3, "generation": 4, "deadline": 5, "send": 6}[case]
    assert code == want and got_gens == gens and dst.landing() == [4, 9]
    # a small reply lands only once whole and vouched for by its trailer
    assert _blocks(dst, [4, 9]) == (BODY if case in ("digest", "generation") else untouched)
    if case == "digest":
        assert len(detail) == 2 and tuple(detail) != sums
    elif case == "send":
        assert isinstance(detail, OSError)
    elif case == "generation":
        assert detail is None
    else:
        assert isinstance(detail, bytes)
    dst._landed([4, 9])


def test_fetch_whole_refuses_what_it_does_not_take_before_sending() -> None:
    """Ids it does not take (repeated, outside the pool, not ints, another count) and a block
    already landing: None, nothing sent, nothing marked."""
    _, dst = _pools()
    for ids in ([4, 4], [4, 99], [4, -1], [4.0, 9], [4], [4, 9, 10], (x for x in [4, 9])):
        mine, theirs = socket.socketpair()
        with mine, theirs:
            assert blockcopy.fetch_whole(mine.fileno(), b"t", 7, b"", len(BODY), planes(dst), ids, L.part_nbytes,
                                         None, dst.live_generations, dst._landing, 1.0) is None
            theirs.setblocking(False)
            with pytest.raises(BlockingIOError):
                theirs.recv(1)
        assert dst.landing() == []
    dst._land([9])
    mine, theirs = socket.socketpair()
    with mine, theirs:
        assert blockcopy.fetch_whole(mine.fileno(), b"t", 7, b"", len(BODY), planes(dst), [4, 9], L.part_nbytes,
                                     None, dst.live_generations, dst._landing, 1.0) is None
    assert dst.landing() == [9]
