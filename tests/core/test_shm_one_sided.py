"""shm:// one-sided reads: no message per read, and the seqlock-style checks that make that safe.

The sender lives in this process (its server threads still talk to the receiver over the
unix control socket), so a test can count the frames the server handles and free, retire
or corrupt blocks at an exact point of a read (``ShmTransport.after_copy`` runs between
the copy and the re-check).
"""

from __future__ import annotations

import base64
import threading
import time
from collections import Counter
from typing import Any, Iterator

import pytest
import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Timeout
from kvbridge.errors import Action, IntegrityError, PoolError, ProtocolError, RetryableError, StaleHandle
from kvbridge.transports.shmtable import ONE_SIDED
from kvbridge.transports.wire import Kind

from ._peer import LISTEN, RemotePeer, fill_pool, mismatched_blocks, reference_pool

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not ONE_SIDED, reason="one-sided shm reads need x86-64 memory ordering")]

L = KVLayout.vllm_flash(2, 2, 32, block_size=4, dtype="float16")


class Pair:
    def __init__(self, allocator: str = "kvbridge", leases: bool = False) -> None:
        self.src = KVPool.allocate(L, 16, shared=True, allocator=allocator)
        fill_pool(self.src, 11)
        if allocator == "kvbridge":
            self.src.alloc(16)
        self.dst = KVPool.allocate(L, 16)
        fill_pool(self.dst, 12)
        kw: dict[str, Any] = {} if leases else {"leases": False}
        self.snd = KVSender(self.src, "shm://", **kw)
        self.rcv = KVReceiver(self.dst, timeout=Timeout(connect=2, transfer=5), **kw)
        self.frames: Counter[str] = Counter()
        self._lock = threading.Lock()
        srv = self.snd.servers[0]
        handle, release_many = srv.handle, srv._release_many

        def counting(conn: Any, reader: Any, kind: Kind, req_id: int, payload: bytes) -> bool:
            if kind is not Kind.RELEASES:        # counted below, handle by handle
                with self._lock:
                    self.frames[kind.name] += 1
            return handle(conn, reader, kind, req_id, payload)

        def counting_releases(many: list[bytes]) -> Any:
            with self._lock:
                self.frames["RELEASES"] += len(many)
            assert release_many is not None
            return release_many(many)
        srv.handle = counting  # type: ignore[method-assign]
        srv._release_many = counting_releases
        self.tr = self.rcv.transport(self.snd.url)

    def publish(self, ids: list[int]) -> KVHandle:
        if not self.src.engine_allocated:
            self.src.ref(ids)
        return self.snd.publish("r", ids, len(ids) * L.block_size)

    def settled_frames(self) -> Counter[str]:
        time.sleep(0.2)               # frames already sent reach the server thread
        with self._lock:
            return Counter(self.frames)

    def close(self) -> None:
        self.rcv.close()
        self.snd.close()
        self.dst.close()
        self.src.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_reads_send_no_control_message(pair: Pair) -> None:
    src, dst = [9, 2, 14, 5], [1, 3, 5, 7]
    assert pair.rcv.fetch(pair.publish(src), dst).ok            # the first read OPENs the mapping
    first = pair.settled_frames()
    assert first["OPEN"] == 1 and first["MAP"] == 0, first
    for _ in range(50):
        res = pair.rcv.fetch(pair.publish(src), dst, release=False)
        assert res.ok, res.error
    assert pair.settled_frames() == first                         # nothing at all per read
    for _ in range(20):
        assert pair.rcv.fetch(pair.publish(src), dst).ok
    got = pair.settled_frames() - first
    assert got == Counter({"RELEASES": 20}), got           # releases go in one-way frames, nothing else
    assert mismatched_blocks(pair.dst, dst, pair.src, src) == []


def test_indices_bad_or_good_and_forgeries(pair: Pair) -> None:
    h = pair.publish([4, 6, 8])
    assert pair.rcv.fetch(h, [0, 1], indices=[2, 0], release=False).ok
    assert mismatched_blocks(pair.dst, [0, 1], pair.src, [8, 4]) == []
    before = pair.settled_frames()
    from kvbridge.transports.base import Spans
    from kvbridge.errors import ProtocolError
    with pytest.raises(ProtocolError):          # refused by the sender, as a MAP would be
        pair.tr.read(pair.snd.url, h, Spans.of_blocks(pair.dst, [0, 1]), [0, 0])
    with pytest.raises(ProtocolError):
        pair.tr.read(pair.snd.url, h, Spans.of_blocks(pair.dst, [0]), [3])
    assert pair.settled_frames()["MAP"] == before["MAP"] + 2


@pytest.mark.parametrize("how", ["freed_and_reused", "retired", "revoked_engine"])
def test_block_changing_under_the_copy_is_detected(how: str) -> None:
    p = Pair(allocator="engine" if how != "freed_and_reused" else "kvbridge")
    try:
        src, dst = [3, 7], [0, 1]
        h = p.publish(src)
        assert p.rcv.fetch(p.publish([5]), [9]).ok                 # mapping open
        hit: list[int] = []

        def change(handle: KVHandle) -> None:
            hit.append(1)
            if how == "freed_and_reused":          # freed, allocated again and overwritten mid-read
                assert p.snd.revoke(h)             # drops the handle's reference
                p.src.free([3, 7])                 # and the engine's: generations move on
                assert sorted(p.src.alloc(2)) == [3, 7]
                for t in p.src.buffers:
                    t.view(-1).view(torch.uint8).fill_(0xAB)
            elif how == "retired":                  # the engine reused the blocks and said so
                p.src.retire([7])
            else:                                   # the handle ended (engine pool: unpinned, not freed)
                assert p.snd.revoke(h)
        p.tr.after_copy = change
        res = p.rcv.fetch(h, dst)
        p.tr.after_copy = None
        assert hit == [1]
        assert isinstance(res.error, StaleHandle), repr(res.error)
        assert not res.ok and res.action is Action.REPREFILL and res.failed_block_ids == dst
        assert p.settled_frames()["DONE"] == 0
    finally:
        p.close()


def test_destination_block_freed_under_the_copy_is_refused(pair: Pair) -> None:
    """A destination block whose generation moves during the one-sided copy (the engine reused
    it): the C call sees it before the source's re-check, the fetch fails with PoolError naming
    it, and nothing is tried again."""
    assert pair.rcv.fetch(pair.publish([5]), [9]).ok               # mapping open
    h = pair.publish([3, 7])

    def reused(handle: KVHandle) -> None:
        pair.dst._gens[1] += 1

    pair.tr.after_copy = reused
    try:
        res = pair.rcv.fetch(h, [0, 1])
    finally:
        pair.tr.after_copy = None
    assert not res.ok and "freed or retired during the transfer" in str(res.error), repr(res.error)
    assert res.failed_block_ids == [0, 1] and res.attempts == 1
    assert pair.settled_frames()["MAP"] == 0


@pytest.mark.parametrize("how", ["retired", "ended"])
def test_block_changed_before_the_read_is_refused_with_nothing_written(how: str) -> None:
    """A handle whose block the engine retired (generation moved, handle still in the table), or
    that ended, is not vouched for by the one-sided check: nothing is copied, the MAP/DONE
    exchange gives the sender's own refusal, and the destination keeps its bytes."""
    p = Pair(allocator="engine")
    try:
        assert p.rcv.fetch(p.publish([5]), [9]).ok                 # mapping open
        h = p.publish([3, 7])
        if how == "retired":
            p.src.retire([7])
        else:
            assert p.snd.revoke(h)
        before = [bytes(t.view(-1).view(torch.uint8).numpy()) for t in p.dst.buffers]
        maps = p.settled_frames()["MAP"]
        res = p.rcv.fetch(h, [0, 1])
        assert not res.ok and res.action is Action.REPREFILL, repr(res.error)
        assert p.settled_frames()["MAP"] > maps                  # the sender was asked, and refused
        assert [bytes(t.view(-1).view(torch.uint8).numpy()) for t in p.dst.buffers] == before
    finally:
        p.close()


def test_the_c_one_sided_read_checks_table_and_generations_before_writing(pair: Pair) -> None:
    """blockcopy.shm_read on a real mapping: bytes whose key is not live in the table, or a
    generation other than the block's, write nothing (code 1); the genuine ones copy and hash
    (code 0), the digests coming back as None exactly when they equal the ones expected."""
    from kvbridge import blockcopy
    from kvbridge.blockcopy import planes
    from kvbridge.integrity import block_checksums
    if blockcopy.shm_read is None:
        pytest.skip("the extension is not built")
    assert pair.rcv.fetch(pair.publish([5]), [9]).ok               # mapping open
    h = pair.publish([3, 7])
    m = pair.tr._senders[pair.snd.url]
    before = block_checksums(pair.dst, [0, 1])

    def read(raw: bytes, want: tuple[int, ...], expect: Any = None) -> Any:
        return blockcopy.shm_read(m.native, raw, h.block_ids, want, planes(pair.dst), [0, 1], True, expect, None)
    raw = h.to_bytes()
    moved = (h.generations[0], h.generations[1] + 1)
    assert read(raw, moved) == (1, None)
    assert read(raw + b"x", h.generations) == (1, None)
    assert read(raw[:-1], h.generations) == (1, None)
    assert read(raw[:5] + bytes([raw[5] ^ 1]) + raw[6:], h.generations) == (1, None)
    assert read(raw, (h.generations[0], 1 << 32 | h.generations[1])) == (1, None)
    assert block_checksums(pair.dst, [0, 1]) == before           # nothing written
    code, sums = read(raw, h.generations)
    assert code == 0 and sums == list(h.checksums) == block_checksums(pair.dst, [0, 1])
    assert read(raw, h.generations, h.checksums) == (0, None)    # compared in the call
    other = (h.checksums[0], h.checksums[1] ^ 1)
    for expect in (other, h.checksums[:1], list(h.checksums), (h.checksums[0], "x")):
        assert read(raw, h.generations, expect) == (0, list(h.checksums)), expect


def test_the_table_key_is_the_blake2b_digest_of_the_handle_bytes(pair: Pair) -> None:
    """The C call keys the table as the sender (hashlib) does: BLAKE2b-128 of the handle's bytes,
    equal to hashlib's for every length around its 128-byte blocks, and the C call finds the
    slot the sender wrote."""
    import hashlib
    import os
    from kvbridge import blockcopy
    from kvbridge.blockcopy import planes
    from kvbridge.transports import shmtable
    if blockcopy.shm_read is None:
        pytest.skip("the extension is not built")
    from kvbridge import _kvcopy
    for n in [*range(0, 300), 383, 384, 385, 1000, 4096, 10_000]:
        data = os.urandom(n)
        assert _kvcopy.blake2b_128(data) == hashlib.blake2b(data, digest_size=16).digest() == shmtable.digest(data), n
    assert pair.rcv.fetch(pair.publish([5]), [9]).ok               # mapping open
    h = pair.publish([2])
    m = pair.tr._senders[pair.snd.url]
    assert m.lookup(h.to_bytes()) is not None
    code, sums = blockcopy.shm_read(m.native, h.to_bytes(), h.block_ids, h.generations, planes(pair.dst), [0], True,
                                    None, None)
    assert code == 0 and sums == list(h.checksums)


def test_corrupted_byte_caught_with_verification(pair: Pair) -> None:
    src, dst = [9, 2, 14, 5], [1, 3, 5, 7]
    assert pair.rcv.fetch(pair.publish(src), dst).ok
    h = pair.publish(src)
    pair.src.block(1, 14)[1].view(-1).view(torch.uint8)[5] ^= 0x01   # after its checksum
    res = pair.rcv.fetch(h, dst)
    assert isinstance(res.error, IntegrityError), repr(res.error)
    assert res.action is Action.REFETCH and res.failed_block_ids == [5]
    assert pair.rcv.stats.refetches == 1 and pair.rcv.stats.integrity_failures == 1
    assert pair.settled_frames()["MAP"] == 0                       # the refetch was one-sided too


def test_leased_fetch_one_sided() -> None:
    p = Pair(leases=True)
    try:
        src, dst = [1, 2], [3, 4]
        assert p.rcv.fetch(p.publish(src), dst).ok
        first = p.settled_frames()
        for _ in range(5):
            res = p.rcv.fetch(p.publish(src), dst)
            assert res.ok, res.error
        assert p.settled_frames() == first       # claim and release go to the lease store, not the sender
        # a stale claim: the read is local, but validate-after-read refuses it
        h = p.publish(src)
        c = p.rcv.claim(h)
        store = p.rcv.lease_store(h)
        store.abort(h.lease_id, c.claimer, c.fence)
        fill_pool(p.dst, 12)
        res = p.rcv.fetch(h, dst)
        assert not res.ok and res.failed_block_ids == dst, res
    finally:
        p.close()


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return bool(cond())


def test_leased_one_sided_fetch_releases_after_it_returns() -> None:
    """The re-check after the copy and the claim's own reply show validate-after-read: the
    release goes after the fetch returns. Revoked between copy and re-check: never ok."""
    p = Pair(allocator="engine", leases=True)
    try:
        src, dst = [1, 2], [3, 4]
        assert p.rcv.fetch(p.publish(src), dst).ok
        assert _wait(lambda: p.rcv.stats.released_later == 1 and p.snd.num_live == 0)
        h = p.publish(src)
        p.tr.after_copy = lambda handle: p.snd.revoke(h)          # the owner ends it under the copy
        res = p.rcv.fetch(h, dst)
        p.tr.after_copy = None
        assert isinstance(res.error, StaleHandle) and not res.ok and res.failed_block_ids == dst, res.error
        assert p.rcv.lease_store(h).get(h.lease_id) is None       # revoked in the store: nothing to release
        assert p.rcv.stats.released_later == 1
    finally:
        p.close()


@pytest.mark.parametrize("lapsed", [False, True])
def test_leased_claim_older_than_ttl_margin_is_validated_in_the_store(lapsed: bool) -> None:
    """The claim is within the receiver's clock margin of its TTL when the copy's re-check
    passes: the release is made at once, in the store, as the validate-after-read -- ok while
    the claim holds, refused once it lapsed."""
    p = Pair(allocator="engine", leases=True)
    rcv = KVReceiver(p.dst, claim_ttl=0.6 if lapsed else 2.0, clock_margin=0.3 if lapsed else 1.0)
    try:
        src, dst = [5, 6], [7, 8]
        tr = rcv.transport(p.snd.url)
        assert rcv.fetch(p.publish([9]), [9]).ok                  # mapping open
        h = p.publish(src)
        tr.after_copy = lambda handle: time.sleep(0.8 if lapsed else 1.1)   # past TTL - margin
        res = rcv.fetch(h, dst)
        tr.after_copy = None
        if lapsed:
            assert not res.ok and isinstance(res.error, StaleHandle), res.error
        else:
            assert res.ok, res.error
            assert mismatched_blocks(p.dst, dst, p.src, src) == []
            lease = rcv.lease_store(h).get(h.lease_id)
            assert lease is not None and lease.state.value == "released"   # before fetch returned
        assert _wait(lambda: rcv.stats.released_later == 1)         # only the first fetch's went later
    finally:
        rcv.close()
        p.close()


def test_sender_closed_or_killed_after_mapping() -> None:
    p = Pair()
    try:
        h1 = p.publish([1])
        assert p.rcv.fetch(p.publish([1]), [0]).ok
        p.snd.close()                                # a clean close ends every slot first
        res = p.rcv.fetch(h1, [5])
        assert not res.ok and isinstance(res.error, (RetryableError, StaleHandle)), res.error
        assert res.failed_block_ids == [5]
    finally:
        p.close()
    victim = RemotePeer()
    dst = KVPool.allocate(L, 4)
    rcv = KVReceiver(dst, leases=False, timeout=Timeout(connect=1, transfer=3))
    try:
        info = victim.new_sender(layout=L.to_dict(), num_blocks=8, listen=LISTEN["shm"], seed=1,
                                 reserve_all=True, leases=False)
        hs = [KVHandle.from_bytes(base64.b64decode(victim.publish(sid=info["sid"], request_id=f"k{i}",
                                                                  block_ids=[i], num_tokens=4)))
              for i in range(2)]
        assert rcv.fetch(hs[0], [0]).ok
        victim.kill()
        t0 = time.monotonic()
        res = rcv.fetch(hs[1], [1])
        assert time.monotonic() - t0 < 10
        assert not res.ok and isinstance(res.error, RetryableError), repr(res.error)
        assert res.action is Action.RETRY and res.failed_block_ids == [1]
    finally:
        rcv.close()
        dst.close()
        victim.kill()
        victim.reap_orphans()


def test_one_sided_bytes_equal_reference() -> None:
    p = Pair()
    try:
        ids = list(range(15, -1, -1))
        assert p.rcv.fetch(p.publish(ids), list(range(16))).ok
        assert mismatched_blocks(p.dst, list(range(16)), reference_pool(L, 16, 11), ids) == []
    finally:
        p.close()


def test_full_table_falls_back_to_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """More live handles than the table holds: the rest are read through MAP/DONE, all correct."""
    from kvbridge.transports import shmtable
    monkeypatch.setattr(shmtable, "MIN_SLOTS", 16)
    monkeypatch.setattr(shmtable, "PROBE", 2)
    p = Pair()
    try:
        table = p.snd.servers[0].table
        assert table is not None and table.nslots == 64          # 4 per block of the 16-block pool
        hs = [p.publish([i % 16]) for i in range(120)]
        assert table.full > 0
        for i, h in enumerate(hs):
            res = p.rcv.fetch(h, [(i + 1) % 16], release=False)
            assert res.ok, res.error
            assert mismatched_blocks(p.dst, [(i + 1) % 16], p.src, [i % 16]) == []
        got = p.settled_frames()
        assert 0 < got["MAP"] < 120 and got["MAP"] == got["DONE"], got
    finally:
        p.close()


def test_a_mapped_fetch_is_one_call_and_its_refusals_go_the_long_way(pair: Pair,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Once mapped, fetch takes ``fetch_whole`` (``blockcopy.shm_fetch``: ids, generations,
    landing marks, the read and its comparisons in one C call), never ``read_small``; the
    destination ids it does not take (a block named twice, one outside the pool, one already
    landing) come back None with nothing marked, and the long way refuses them as before."""
    from kvbridge import blockcopy
    if blockcopy.shm_fetch is None:
        pytest.skip("the extension is not built")
    src, dst = [9, 2, 14, 5], [1, 3, 5, 7]
    assert pair.rcv.fetch(pair.publish(src), dst).ok              # maps the sender
    calls: Counter[str] = Counter()
    whole = pair.tr.fetch_whole

    def counted_whole(*a: Any, **k: Any) -> Any:
        out = whole(*a, **k)
        calls["whole " + repr(out if out is None or out is True else "fallback")] += 1
        return out

    def no_read_small(*a: Any, **k: Any) -> Any:
        calls["read_small"] += 1
        return None
    monkeypatch.setattr(pair.tr, "fetch_whole", counted_whole)
    monkeypatch.setattr(pair.tr, "read_small", no_read_small)
    for _ in range(5):
        res = pair.rcv.fetch(pair.publish(src), dst)
        assert res.ok, res.error
    assert calls == Counter({"whole True": 5}), calls
    assert not any(pair.dst._landing)                             # every mark undone
    assert pair.dst.block(0, 3)[0].view(-1).view(torch.uint8).tolist() == \
        pair.src.block(0, 2)[0].view(-1).view(torch.uint8).tolist()
    calls.clear()
    for bad, why in (([1, 1, 5, 7], "duplicate"), ([1, 3, 5, 99], "99")):
        with pytest.raises(PoolError, match=why):
            pair.rcv.fetch(pair.publish(src), bad)
    pair.dst._land([5])                                           # another transfer lands in block 5
    try:
        with pytest.raises(PoolError, match="5"):
            pair.rcv.fetch(pair.publish(src), dst)
    finally:
        pair.dst._landed([5])
    assert calls["whole None"] == 3 and calls["whole True"] == 0, calls
    assert not any(pair.dst._landing)


def test_a_mapped_fetch_naming_blocks_outside_the_senders_pool_fails_in_its_result(pair: Pair) -> None:
    """A handle naming a source block outside the mapped pool (altered, or another pool's): the
    one-call fetch leaves it to the long way, whose ProtocolError comes back in the result (a
    fetch raises only for the caller's own mistakes); nothing is left marked."""
    import dataclasses
    assert pair.rcv.fetch(pair.publish([5]), [9]).ok              # maps the sender
    bad = dataclasses.replace(pair.publish([2, 3]), block_ids=(2, 999))
    res = pair.rcv.fetch(bad, [4, 5])
    assert not res.ok and isinstance(res.error, ProtocolError), repr(res.error)
    assert pair.dst.landing() == []
