"""A release without a reply rides behind one of the client's next requests once
``RELEASE_BATCH`` of them wait or, with none, goes alone after ``RELEASE_LINGER``; closing the
receiver sends what is still waiting."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.transports import sockets

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


@pytest.fixture(params=["tcp://127.0.0.1:0", "shm://"])
def pair(request):
    src = KVPool.allocate(LAYOUT, 8, shared=request.param.startswith("shm"))
    dst = KVPool.allocate(LAYOUT, 8)
    for b in src.buffers:
        b.copy_(torch.randn_like(b))
    freed: list[str] = []
    ev = threading.Event()

    def on_free(h, reason):
        freed.append(f"{h.request_id}:{reason}")
        ev.set()

    snd = KVSender(src, request.param, on_free=on_free, leases=False)
    rcv = KVReceiver(dst, leases=False)
    yield snd, rcv, freed, ev
    rcv.close()
    snd.close()


def test_releases_ride_on_a_request_once_a_batch_waits(pair, monkeypatch):
    snd, rcv, freed, ev = pair
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))   # only a request can carry them
    monkeypatch.setattr(sockets, "RELEASE_BATCH", 2)
    monkeypatch.setattr(sockets, "RELEASE_RIDE", 30.0)
    a, b, c = (snd.publish(n, snd.pool.alloc(2), 8) for n in "abc")
    assert rcv.fetch(a, [0, 1]).ok
    assert rcv.fetch(b, [2, 3], release=False).ok
    time.sleep(0.2)
    assert freed == []                 # one release waiting: the request went without it
    assert rcv.fetch(c, [4, 5]).ok     # (a one-sided shm read sends no request at all)
    time.sleep(0.2)
    assert freed == []                 # two waiting now, for the next request
    assert rcv.release(b)              # a control request (RELEASE): the two ride behind it
    deadline = time.monotonic() + 5
    while len(freed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(freed) == ["a:released", "b:released", "c:released"]


def test_a_release_that_waited_rides_on_the_next_request(pair, monkeypatch):
    """Fewer than a batch, but the oldest has waited RELEASE_RIDE: the next request carries
    them (requests that come slowly -- large reads -- still carry the releases, before the
    flusher would send them on their own)."""
    snd, rcv, freed, ev = pair
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))   # only a request can carry them
    a, b = (snd.publish(n, snd.pool.alloc(2), 8) for n in "ab")
    assert rcv.fetch(a, [0, 1]).ok
    time.sleep(sockets.RELEASE_RIDE + 0.05)
    assert freed == []
    assert rcv.fetch(b, [2, 3], release=False).ok      # (a one-sided shm read sends no request at all)
    deadline = time.monotonic() + 5
    while not freed and time.monotonic() < deadline and not snd.url.startswith("shm"):
        time.sleep(0.01)
    assert freed == ([] if snd.url.startswith("shm") else ["a:released"])


def test_release_goes_alone_after_the_linger(pair):
    snd, rcv, freed, ev = pair
    h = snd.publish("c", snd.pool.alloc(2), 8)
    t0 = time.monotonic()
    assert rcv.fetch(h, [4, 5]).ok
    assert ev.wait(5) and freed == ["c:released"]
    assert time.monotonic() - t0 < 2.0


def test_close_sends_waiting_releases(pair, monkeypatch):
    snd, rcv, freed, ev = pair
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))
    h = snd.publish("d", snd.pool.alloc(2), 8)
    assert rcv.fetch(h, [6, 7]).ok
    rcv.close()
    assert ev.wait(5) and freed == ["d:released"]


def test_a_released_handle_is_not_served_again_while_its_release_waits(pair, monkeypatch):
    """The release waits for a request to ride on; meanwhile the sender still holds the handle
    and would serve it. The receiver that released it refuses it itself, like the sender will:
    re-prefill, no destination byte touched (fetch and fetch_many)."""
    from kvbridge.errors import Action, HandleNotFound
    snd, rcv, freed, ev = pair
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))   # the release stays queued
    h = snd.publish("e", snd.pool.alloc(2), 8)
    assert rcv.fetch(h, [0, 1]).ok
    before = [b.clone() for b in rcv.pool.buffers]
    again = rcv.fetch(h, [2, 3])
    assert not again.ok and isinstance(again.error, HandleNotFound)
    assert again.error.action is Action.REPREFILL and again.failed_block_ids == [2, 3]
    assert isinstance(rcv.fetch_many([(h, [2, 3])])[0].error, HandleNotFound)
    assert all(bool(torch.equal(a, b)) for a, b in zip(before, rcv.pool.buffers))
    assert freed == []                                  # the refusal was this receiver's own
    other = KVReceiver(rcv.pool, leases=False)          # another receiver is not told: the sender decides
    try:
        assert other.fetch(h, [4, 5], release=False).ok
    finally:
        other.close()


def test_releases_that_arrive_together_are_ended_together_and_one_refusal_stops_none():
    """The server ends the RELEASE frames it finds together in one pass (KVSender.release_many):
    a forged or an already-ended handle among them is refused alone, the others end, each
    engine callback runs once and the counters add up."""
    src = KVPool.allocate(LAYOUT, 16, allocator="engine")
    freed: list[str] = []
    with KVSender(src, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(h.request_id)) as snd:
        hs = [snd.publish(f"r{i}", [i], 4) for i in range(6)]
        forged = bytearray(hs[0].to_bytes())
        forged[-1] ^= 1
        snd.release_remote(hs[5].to_bytes())
        got = snd.release_many([h.to_bytes() for h in hs[:3]] + [bytes(forged), hs[5].to_bytes(), hs[3].to_bytes()])
        assert [type(e).__name__ if e else None for e in got] == [None, None, None, "BadHandle", "HandleNotFound", None]
        assert sorted(freed) == ["r0", "r1", "r2", "r3", "r5"] and snd.num_live == 1
        assert snd.stats.released == 5 and snd.stats.blocks_released == 5
        assert src.refcount(0) == 0 and src.refcount(4) == 1

        # and over the wire: three releases in one send are one pass on the server
        calls: list[int] = []
        real = snd.release_many
        snd.servers[0]._release_many = lambda many: calls.append(len(many)) or real(many)
        rcv = KVReceiver(KVPool.allocate(LAYOUT, 8), leases=False)
        try:
            more = [snd.publish(f"w{i}", [8 + i], 4) for i in range(3)]
            for i, h in enumerate(more):
                assert rcv.fetch(h, [i]).ok
            rcv.close()                       # sends the three waiting releases in one send
            deadline = time.monotonic() + 5
            while snd.num_live > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert snd.num_live == 1 and sum(calls) == 3 and max(calls) >= 2
        finally:
            rcv.close()


def test_a_releases_frame_round_trips_and_a_malformed_one_is_refused():
    from kvbridge.errors import ProtocolError
    from kvbridge.transports.wire import HEADER, MAX_RELEASES, decode_releases, encode_releases, unpack_header
    raws = [bytes([i % 251]) * (40 + i % 7) for i in range(MAX_RELEASES + 44)]
    wire = encode_releases(raws)
    got, pos = [], 0
    while pos < len(wire):                        # MAX_RELEASES per frame: two frames here
        _, _, n = unpack_header(wire[pos:pos + HEADER.size])
        got.append(decode_releases(wire[pos + HEADER.size:pos + HEADER.size + n]))
        pos += HEADER.size + n
    assert [len(g) for g in got] == [MAX_RELEASES, 44] and sum(got, []) == raws
    assert encode_releases([]) == b"" and decode_releases(b"") == []
    one = encode_releases([b"abc"])[HEADER.size:]
    for bad in (one[:2], one[:-1], one + b"\x00", b"\x00\x00\x01\x00" + b"x" * 255,
                b"\x00\x00\x00\x00" * (MAX_RELEASES + 1)):
        with pytest.raises(ProtocolError):
            decode_releases(bad)


def test_a_malformed_releases_frame_ends_nothing_and_keeps_the_connection():
    """A RELEASES frame has no reply: a malformed one is logged and dropped whole (no handle of
    it ends), a forged handle in a good one is refused alone, and the peer's connection goes
    on serving."""
    import socket

    from kvbridge.transports.tcp import parse_tcp_url
    from kvbridge.transports.wire import HEADER, Kind, encode_releases, pack, unpack_header, recv_exact
    src = KVPool.allocate(LAYOUT, 8, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        hs = [snd.publish(f"r{i}", [i], 4) for i in range(3)]
        conn = socket.create_connection(parse_tcp_url(snd.url), timeout=5)
        with conn:
            body = encode_releases([hs[0].to_bytes()])[HEADER.size:]
            conn.sendall(pack(Kind.RELEASES, 0, body[:-1]) + pack(Kind.PING, 9, b"hi"))   # one byte short
            kind, rid, n = unpack_header(recv_exact(conn, HEADER.size))
            assert (kind, rid, recv_exact(conn, n)) == (Kind.PONG, 9, b"hi")
            assert snd.num_live == 3                                     # the malformed frame ended nothing
            forged = bytearray(hs[1].to_bytes())
            forged[-1] ^= 1
            conn.sendall(encode_releases([bytes(forged), hs[2].to_bytes()]) + pack(Kind.PING, 10))
            kind, rid, n = unpack_header(recv_exact(conn, HEADER.size))
            assert (kind, rid) == (Kind.PONG, 10)
            assert snd.num_live == 2 and src.refcount(2) == 0 and src.refcount(1) == 1


class _Client:
    """What the flusher asks of a client: flush, counted."""

    def __init__(self) -> None:
        self.flushes = 0

    def flush(self, idle_only: bool = False) -> bool:
        self.flushes += 1
        return True


class _CountedEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_the_flusher_is_woken_only_from_waiting() -> None:
    """Releases that keep coming cost no wake-up of the flusher per linger (it wakes itself while
    something is due); one after a quiet spell wakes it, and nothing scheduled is left unsent."""
    fl = sockets._Flusher(linger=0.02)
    fl._wake = ev = _CountedEvent()
    c = _Client()
    end = time.monotonic() + 0.4
    while time.monotonic() < end:                  # a release every millisecond: 20 lingers
        fl.schedule(c)
        time.sleep(0.001)
    deadline = time.monotonic() + 5
    while fl._due and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not fl._due and c.flushes >= 8
    assert ev.sets <= 5, ev.sets                   # the first, and a gap a busy machine left in the sleeps
    for _ in range(5):                             # after a quiet spell, each is sent within a few lingers
        time.sleep(0.1)
        before = c.flushes
        fl.schedule(c)
        deadline = time.monotonic() + 5
        while c.flushes == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c.flushes == before + 1


def test_the_released_set_keeps_the_latest_and_turns_over_whole():
    """A receiver remembers at least the latest keep // 2 handles it released, at most keep;
    the oldest go a generation at once."""
    from kvbridge.releases import Recent
    r = Recent(8)
    ids = [bytes([i]) * 16 for i in range(20)]
    for n, i in enumerate(ids, 1):
        r.add(i)
        held = [j for j in ids[:n] if j in r]
        assert ids[max(0, n - 4):n] == held[-min(n, 4):]       # the latest half always there
        assert len(held) <= 8 and held == ids[n - len(held):n]  # never more than keep, newest only
    assert ids[0] not in r and ids[-1] in r
    from kvbridge.receiver import RELEASED_KEPT
    rcv = KVReceiver(KVPool.allocate(LAYOUT, 2), leases=False)
    try:                                                 # the README's "at least the latest 4,096"
        assert RELEASED_KEPT == 4096 and rcv._released._half == RELEASED_KEPT
    finally:
        rcv.close()


def test_releases_taken_for_a_request_never_sent_still_go(pair, monkeypatch):
    """The usual fetch takes the waiting releases to carry, then finds nothing to send (its
    destination ids are for the long way to refuse): the releases go alone, not lost."""
    snd, rcv, freed, ev = pair
    if snd.url.startswith("shm"):
        pytest.skip("a one-sided shm read sends no request")
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))   # only a request can carry them
    monkeypatch.setattr(sockets, "RELEASE_BATCH", 1)
    a, b = (snd.publish(n, snd.pool.alloc(2), 8) for n in "ab")
    assert rcv.fetch(a, [0, 1]).ok
    assert freed == []
    with pytest.raises(Exception):
        rcv.fetch(b, [2, 2])                  # repeated destination ids: refused before any request
    deadline = time.monotonic() + 5
    while not freed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert freed == ["a:released"]


def test_releases_ride_behind_any_large_read(monkeypatch):
    """Behind a read over 64 KiB the waiting releases ride at once, fewer than a batch and
    however briefly they waited (the read's own cost dwarfs theirs)."""
    monkeypatch.setattr(sockets, "_FLUSHER", sockets._Flusher(linger=30.0))   # only a request can carry them
    monkeypatch.setattr(sockets, "RELEASE_RIDE", 30.0)
    big = KVLayout(num_layers=2, block_size=16, num_kv_heads=1, head_dim=1024, dtype="float16")   # 128 KiB blocks
    freed: list[str] = []
    with KVSender(KVPool.allocate(big, 4), "tcp://127.0.0.1:0", leases=False,
                  on_free=lambda h, reason: freed.append(f"{h.request_id}:{reason}")) as snd, \
            KVReceiver(KVPool.allocate(big, 4), leases=False) as rcv:
        a = snd.publish("a", snd.pool.alloc(1), 16)
        assert rcv.fetch(a, [0]).ok                      # a large read: its release waits
        b = snd.publish("b", snd.pool.alloc(1), 16)
        time.sleep(0.2)
        assert freed == []
        assert rcv.fetch(b, [1], release=False).ok       # the next large read carries it
        deadline = time.monotonic() + 5
        while not freed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert freed == ["a:released"]
