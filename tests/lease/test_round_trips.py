"""A leased fetch has one lease round trip on its critical path: the claim (made by the owner
as it serves the read over tcp and inproc, by the receiver itself over shm; over ucx the owner
also checks the receiver's fence). Validate-after-read needs no round trip of its own -- the
owner's trailer (or shm's re-check after the copy) and a claim that certainly still holds show
it -- so the release, lifecycle only, arrives after the fetch has returned. Counted on the
lease server."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import redis

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge import receiver_pipeline, releases
from kvbridge.errors import Action, LeaseExpired
from kvbridge import sender_lifecycle
from kvbridge.lease import EmbeddedRedis, LeaseState, RedisLeaseStore

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
LATER = 0.5      # seconds the releases linger here, so that what happens before fetch returns is countable


def _script_calls(srv: EmbeddedRedis) -> int:
    stats = redis.Redis.from_url(srv.auth_url).info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _state(ls: RedisLeaseStore, lease_id: str) -> Any:
    """The lease's stored state, read with a plain HGET: no script call to count."""
    st = ls._redis.hget(ls._lease_prefix + ls.ref(lease_id), "st")
    return {"C": LeaseState.CLAIMED, "R": LeaseState.RELEASED, "P": LeaseState.PUBLISHED}.get(st or "", st)


@pytest.fixture
def slow_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(releases, "LINGER", LATER)
    monkeypatch.setattr(sender_lifecycle, "SWEEP_INTERVAL", 3600.0)   # no owner sweep inside a counted window
    # this receiver's own releases through the store (tests/lease/test_release_via_sender.py: the
    # sender making them for the claims it made)
    monkeypatch.setattr(receiver_pipeline, "RELEASE_VIA_SENDER", False)


try:
    import ucxx  # noqa: F401
    HAVE_UCX = True
except ImportError:
    HAVE_UCX = False


NO_UCX = pytest.mark.skipif(not HAVE_UCX, reason="ucx:// needs ucxx: pip install 'kvbridge[ucx]'")


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://", "inproc://",
                                    pytest.param("ucx://127.0.0.1:0", marks=NO_UCX)])
def test_leased_fetch_is_one_lease_round_trip_then_the_release(own_server: EmbeddedRedis, slow_release: None,
                                                               listen: str) -> None:
    # ucx replies carry no fence, so its owner cannot claim for the reader: the receiver claims,
    # and the owner checks that claim's fence as it serves the read
    trips = 2 if listen.startswith("ucx:") else 1
    dst = KVPool.allocate(L, 8)
    src = KVPool.allocate(L, 8, shared=listen == "shm://", allocator="engine")
    with RedisLeaseStore(own_server.url) as ls, KVSender(src, listen, leases=ls) as snd, \
            KVReceiver(dst, leases=ls) as rcv:
        warm = snd.publish("warm", [7], 4)
        assert rcv.fetch(warm, [7]).ok                                     # scripts loaded
        assert _wait(lambda: _state(ls, warm.lease_id) is LeaseState.RELEASED)
        h = snd.publish("r", [1, 2], 8)
        before = _script_calls(own_server)
        res = rcv.fetch(h, [3, 4])
        assert res.ok, res.error
        assert _script_calls(own_server) - before == trips                 # the claim, nothing after the read
        assert _state(ls, h.lease_id) is LeaseState.CLAIMED
        assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED)   # the release arrives afterwards
        assert _script_calls(own_server) - before == trips + 1
        assert _wait(lambda: snd.num_live == 0)                            # and the owner frees
        assert rcv.stats.released_later == 2 and rcv.stats.release_failures == 0
        # a claim made ahead (a request waiting in a decode queue) costs its own trip; the fetch stays at one
        h2 = snd.publish("r2", [5, 6], 8)
        rcv.claim(h2)
        before = _script_calls(own_server)
        assert rcv.fetch(h2, [3, 4]).ok
        assert _script_calls(own_server) - before == trips   # claimed again (idempotent)
        assert _wait(lambda: _state(ls, h2.lease_id) is LeaseState.RELEASED)
        # keeping the claim (release=False) needs no validate either
        h3 = snd.publish("r3", [5, 6], 8)
        before = _script_calls(own_server)
        assert rcv.fetch(h3, [3, 4], release=False).ok
        assert _script_calls(own_server) - before == trips
        time.sleep(LATER + 0.2)
        assert _state(ls, h3.lease_id) is LeaseState.CLAIMED and rcv.stats.released_later == 3


def test_close_flushes_pending_releases(own_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(releases, "LINGER", 30.0)        # nothing would go out before close
    monkeypatch.setattr(receiver_pipeline, "RELEASE_VIA_SENDER", False)   # through this receiver's Releaser
    src, dst = KVPool.allocate(L, 8, allocator="engine"), KVPool.allocate(L, 8)
    with RedisLeaseStore(own_server.url) as ls, KVSender(src, "tcp://127.0.0.1:0", leases=ls) as snd:
        rcv = KVReceiver(dst, leases=ls)
        hs = [snd.publish(f"c{i}", [i], 4) for i in range(3)]
        assert all(rcv.fetch(h, [i]).ok for i, h in enumerate(hs))
        assert all(_state(ls, h.lease_id) is LeaseState.CLAIMED for h in hs)
        t0 = time.monotonic()
        rcv.close()
        assert time.monotonic() - t0 < 5.0
        assert all(_state(ls, h.lease_id) is LeaseState.RELEASED for h in hs)   # sent before close returned
        assert rcv.stats.released_later == 3
        assert _wait(lambda: snd.num_live == 0)


def test_fetch_many_is_one_lease_round_trip_then_one_for_the_releases(own_server: EmbeddedRedis,
                                                                      slow_release: None) -> None:
    """The receiver's claims go in one pipelined round trip; its releases, after fetch_many has
    returned, in another (one batch for the four)."""
    src, dst = KVPool.allocate(L, 16, allocator="engine"), KVPool.allocate(L, 16)
    with RedisLeaseStore(own_server.url) as ls, RedisLeaseStore(own_server.url) as owner_ls, \
            KVSender(src, "tcp://127.0.0.1:0", leases=owner_ls) as snd, KVReceiver(dst, leases=ls) as rcv:
        warm = snd.publish("warm", [15], 4)
        assert rcv.fetch(warm, [15]).ok
        assert _wait(lambda: _state(ls, warm.lease_id) is LeaseState.RELEASED)
        hs = [snd.publish(f"r{i}", [2 * i, 2 * i + 1], 8) for i in range(4)]
        trips = 0
        call = ls._call

        def counted(fn):  # type: ignore[no-untyped-def]
            nonlocal trips
            trips += 1
            return call(fn)
        ls._call = counted  # type: ignore[method-assign]
        try:
            res = rcv.fetch_many([(h, [2 * i, 2 * i + 1]) for i, h in enumerate(hs)])
            assert trips == 1      # the receiver's claims; the owner still checks each read's fence as it serves it
            assert all(r.ok for r in res), [r.error for r in res]
            assert _wait(lambda: all(_state(ls, h.lease_id) is LeaseState.RELEASED for h in hs))
            assert trips == 2      # the four releases, in one pipelined round trip
        finally:
            ls._call = call  # type: ignore[method-assign]


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://", "inproc://"])
def test_a_handle_fetched_with_release_is_consumed_before_the_release_lands(
        own_server: EmbeddedRedis, slow_release: None, listen: str) -> None:
    """A claim is re-entrant for its claimer, so the store alone would grant this receiver the
    handle again while its release waits in the queue: the receiver itself refuses it, with the
    error the store gives once the release has landed, and touches no destination block."""
    dst = KVPool.allocate(L, 8)
    src = KVPool.allocate(L, 8, shared=listen == "shm://", allocator="engine")
    src.buffers[0].fill_(3)
    with RedisLeaseStore(own_server.url) as ls, KVSender(src, listen, leases=ls) as snd, \
            KVReceiver(dst, leases=ls) as rcv:
        h = snd.publish("once", [1, 2], 8)
        assert rcv.fetch(h, [3, 4]).ok
        assert _state(ls, h.lease_id) is LeaseState.CLAIMED               # the release is still queued
        before = [b.clone() for b in dst.buffers]
        again = rcv.fetch(h, [5, 6])
        assert not again.ok and isinstance(again.error, LeaseExpired)
        assert again.error.action is Action.REPREFILL and "already released" in str(again.error)
        assert all(bool((a == b).all()) for a, b in zip(before, dst.buffers))
        assert (rcv.fetch_many([(h, [5, 6])])[0].error.__class__ is LeaseExpired)
        assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED)
        late = rcv.fetch(h, [5, 6])                  # afterwards the store (or the owner, who freed it) says so
        assert not late.ok and late.error is not None and late.error.action is Action.REPREFILL
        assert rcv.stats.release_failures == 0


def test_releases_submitted_while_the_thread_lingers_do_not_wake_it(store: RedisLeaseStore,
                                                                    slow_release: None) -> None:
    """The release thread waits for a first release, then lingers for more to share its round
    trip: a release submitted while it lingers joins the batch without waking it (a wake-up per
    release cost each fetch a futex wake and a GIL handoff). All of them still go, together."""
    from kvbridge.policy import Retry
    leases = []
    for i in range(40):
        lid = f"wake-{i}"
        store.publish(lid, "owner", ttl_s=60)
        leases.append((lid, store.claim(lid, "rcv", 60).fence))
    r = releases.Releaser("rcv", Retry())
    wakes = []
    notify = r._cv.notify_all
    r._cv.notify_all = lambda: (wakes.append(1), notify())[1]     # type: ignore[method-assign]
    try:
        for lid, fence in leases:
            assert r.submit(store, lid, fence)
        assert len(wakes) == 1                      # the first release only
        assert r.flush(5.0) and not r.pending
        assert all(_state(store, lid) == LeaseState.RELEASED for lid, _ in leases)
    finally:
        r.close()
