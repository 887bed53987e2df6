"""Two transfers never land in one destination block at once: a fetch, start_fetch, fetch_many
or reservation naming a block that another one in progress into the same pool is writing --
from this receiver or another on the pool -- is refused with PoolError before anything moves,
and every way a transfer ends (done, failed, cancelled before or after it started) frees its
blocks for the next one."""

from __future__ import annotations

import threading
import time
import types

import pytest

import kvbridge.transfer as transfer_mod
from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, PoolError, Timeout
from kvbridge.integrity import block_checksums

from waiting import in_threads

from ._peer import wait_until

pytestmark = pytest.mark.timeout(60)

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")


@pytest.fixture
def pair():
    spool, rpool = KVPool.allocate(L, 128), KVPool.allocate(L, 16)
    for b in spool.buffers:
        b.fill_(1.5)                 # the receiver's blocks are zeros: a landed byte shows
    snd = KVSender(spool, "inproc://landing-src", leases=False)
    rcv = KVReceiver(rpool, listen="inproc://landing-dst", leases=False)
    try:
        yield snd, rcv
    finally:
        rcv.close()
        snd.close()


def _publish(snd: KVSender, n: int, **kw):
    ids = snd.pool.alloc(n)
    return snd.publish(f"r{ids[0]}", ids, n * L.block_size, **kw)


def test_a_fetch_into_blocks_a_fetch_in_progress_is_writing_is_refused(pair):
    snd, rcv = pair
    pool = rcv.pool
    slow = _publish(snd, 2, layers_ready=0)             # layer-wise: its fetch waits for its layers
    t = rcv.start_fetch(slow, [3, 4])
    assert wait_until(lambda: pool.landing() == [3, 4], 5.0)
    before = [bytes(b.numpy().tobytes()) for b in pool.buffers]
    other = _publish(snd, 2)
    for call in (lambda: rcv.fetch(other, [4, 5]), lambda: rcv.start_fetch(other, [5, 3]),
                 lambda: rcv.fetch_many([(other, [4, 9])])):
        with pytest.raises(PoolError, match=r"block \[[34]\], which another fetch"):
            call()
    assert [bytes(b.numpy().tobytes()) for b in pool.buffers] == before      # nothing moved
    assert pool.landing() == [3, 4]                                          # nothing else marked
    assert rcv.fetch(other, [5, 6]).ok                                       # other blocks: fine
    assert t.cancel(5.0)
    assert pool.landing() == []
    assert rcv.fetch(_publish(snd, 2), [3, 4]).ok


def test_a_reservation_holds_its_blocks_until_it_ends(pair):
    snd, rcv = pair
    pool = rcv.pool
    rt = rcv.reserve([7, 8], "pushed")
    h = _publish(snd, 2)
    with pytest.raises(PoolError, match="another fetch or reservation"):
        rcv.fetch(h, [8, 9])
    with pytest.raises(PoolError, match="a reservation into destination block"):
        rcv.reserve([1, 7], "again")
    assert pool.landing() == [7, 8]
    pid = snd.push(rt.reservation, snd.pool.alloc(2))
    assert rt.result(10).ok and pid.result(10).ok
    assert pool.landing() == []
    assert rcv.fetch(h, [8, 9]).ok
    rt2 = rcv.reserve([7, 8], "expires", ttl=0.2)                            # ends at its ttl
    assert not rt2.result(10).ok and pool.landing() == []
    rt3 = rcv.reserve([7, 8], "cancelled")
    assert rt3.cancel(5.0) and pool.landing() == []


def test_another_receiver_on_the_same_pool_is_refused_too(pair):
    snd, rcv = pair
    with KVReceiver(rcv.pool, leases=False) as second:
        slow = _publish(snd, 1, layers_ready=0)
        t = second.start_fetch(slow, [2])
        assert wait_until(lambda: rcv.pool.landing() == [2], 5.0)
        with pytest.raises(PoolError):
            rcv.fetch(_publish(snd, 1), [2])
        snd.mark_ready(slow, L.num_layers)
        assert t.result(10).ok and rcv.pool.landing() == []


def test_every_end_unmarks(pair):
    snd, rcv = pair
    pool = rcv.pool
    assert rcv.fetch(_publish(snd, 2), [0, 1]).ok and pool.landing() == []            # the usual fetch
    gone = _publish(snd, 1)
    snd.revoke(gone)
    assert not rcv.fetch(gone, [0]).ok and pool.landing() == []                      # failed
    assert all(r.ok for r in rcv.fetch_many([(_publish(snd, 1), [0]), (_publish(snd, 1), [1])]))
    assert pool.landing() == []
    t = rcv.start_fetch(_publish(snd, 1, layers_ready=0), [5])
    assert t.cancel(5.0) and pool.landing() == []                                    # cancelled running
    with pytest.raises(PoolError):
        rcv.fetch(_publish(snd, 2), [3, 3])                                          # refused input
    assert pool.landing() == []


def test_threads_fetching_into_their_own_blocks_never_collide(pair):
    snd, rcv = pair
    hs = [[_publish(snd, 1) for _ in range(10)] for _ in range(4)]

    def run(k: int) -> None:
        for h in hs[k]:
            assert rcv.fetch(h, [10 + k]).ok
    errors = in_threads(run, 4)
    assert not errors and rcv.pool.landing() == []


# -- review: ends that the marks did not follow ----------------------------------------------

def test_a_transfer_seen_ended_has_unmarked_its_blocks(pair, monkeypatch):
    """Whoever sees a transfer end (result, wait, done, cancel) may name its blocks at once: the
    unmark comes before the end is visible, not in a done-callback after the waiters woke."""
    snd, rcv = pair
    pool = rcv.pool
    real = pool._landed

    def unhurried(ids):              # widens the window between the end and the unmark
        time.sleep(0.3)
        real(ids)
    monkeypatch.setattr(pool, "_landed", unhurried)
    slow = _publish(snd, 2, layers_ready=0)
    t = rcv.start_fetch(slow, [3, 4])
    snd.mark_ready(slow, L.num_layers)
    assert t.result(10).ok
    assert pool.landing() == []
    assert rcv.fetch(_publish(snd, 2), [3, 4]).ok
    rt = rcv.reserve([7, 8], "expires", ttl=0.2)           # ended by the sweeper thread
    assert not rt.result(10).ok
    assert pool.landing() == []
    assert rcv.reserve([7, 8], "next").cancel(5.0)


def test_a_write_still_in_flight_when_its_reservation_ends_keeps_the_blocks_marked(pair):
    """A reservation ends after Timeout.transfer even with a silent writer's write open (an shm
    writer maps the blocks and copies one-sided): its blocks stay marked until that write
    closes, so no fetch lands in them meanwhile."""
    snd, rcv = pair
    pool = rcv.pool
    with KVReceiver(pool, listen="inproc://landing-silent", leases=False, timeout=Timeout(transfer=0.3)) as push:
        rt = push.reserve([7, 8], "silent")
        g = push.open_write(rt.reservation.to_bytes(), (0, L.num_layers), None)   # then silent
        rt.cancel(5.0)                        # waits Timeout.transfer for the write, then ends
        assert rt.done()
        assert pool.landing() == [7, 8]
        with pytest.raises(PoolError, match="another fetch or reservation"):
            rcv.fetch(_publish(snd, 1), [8])
        g.close()
        assert pool.landing() == []
        rt2 = push.reserve([7, 8], "closed")
        g2 = push.open_write(rt2.reservation.to_bytes(), (0, L.num_layers), None)
    assert rt2.done() and pool.landing() == [7, 8]            # close() ended it; the write is open
    g2.close()
    assert pool.landing() == [] and rcv.fetch(_publish(snd, 2), [7, 8]).ok


def test_a_fetch_whose_worker_could_not_start_never_lands_later(pair, monkeypatch):
    """start_fetch raising (the worker thread could not start) leaves no transfer behind that a
    later worker would still run into blocks no longer marked."""
    snd, rcv = pair
    pool = rcv.pool
    spool2 = KVPool.allocate(L, 8)
    for b in spool2.buffers:
        b.fill_(2.5)
    with KVSender(spool2, "inproc://landing-src2", leases=False) as snd2:
        first = _publish(snd, 1)                                         # 1.5s
        other = _publish(snd2, 1)                                        # 2.5s

        class NoThread(threading.Thread):
            def start(self):
                raise RuntimeError("can't start new thread")
        monkeypatch.setattr(transfer_mod, "threading",
                            types.SimpleNamespace(**{**vars(threading), "Thread": NoThread}))
        with pytest.raises(RuntimeError, match="can't start"):
            rcv.start_fetch(first, [3])
        monkeypatch.undo()
        assert pool.landing() == []
        assert rcv.fetch(other, [3]).ok                                  # block 3: other's KV
        assert rcv.start_fetch(_publish(snd, 1), [9]).result(10).ok      # a worker starts now
        assert block_checksums(pool, [3]) == [other.checksums[0]]        # still other's KV
        assert pool.landing() == []


def test_a_task_cancelled_twice_ends_only_once_no_byte_will_land(pair, monkeypatch):
    """afetch/afetch_many end only once none of their transfers will land a byte any more (their
    caller may hand the blocks on then). A second cancel() of the awaiting task while the first
    was winding the transfers down ended the task at once, the transfers still running."""
    import asyncio

    snd, rcv = pair
    pool = rcv.pool
    real = rcv._pull

    def unhurried(*a, **kw):           # a transfer that takes a while to wind down
        try:
            return real(*a, **kw)
        finally:
            time.sleep(0.4)
    monkeypatch.setattr(rcv, "_pull", unhurried)

    async def twice(coro) -> None:
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.landing() == []

    asyncio.run(twice(rcv.afetch_many([(_publish(snd, 1, layers_ready=0), [1]),
                                       (_publish(snd, 1, layers_ready=0), [2])])))
    asyncio.run(twice(rcv.afetch(_publish(snd, 1, layers_ready=0), [3])))
