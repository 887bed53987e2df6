"""Redis killed (and restarted with its data lost) mid-flight.

* A read authorized before the kill is still served (the owner never frees blocks under a read
  it serves); after the restart the epoch is new, so the claimer's validate-after-read fails with
  StaleFence and the bytes are rejected; the owner frees after the read drains, no later than its
  local deadline.
* A read that reaches the owner while Redis is down, or after the restart, is refused.
* Operations retry and then succeed (a publish that outlives a short outage) or fail clearly
  (LeaseStoreUnavailable, retryable, within the retry deadline); fences never repeat.
* An owner cut off from Redis keeps its blocks until its local deadline
  ``owner_deadline(sent_at, ttl, margin_s)`` -- never earlier -- then frees them.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge import Action, KVPool, LeaseNotFound, LeaseStoreUnavailable, Retry, StaleFence
from kvbridge.lease import Fence, RedisLeaseStore, owner_deadline
from kvbridge.policy import Backoff

from ._util import LAYOUT, Bounded, FaultSender, publish_fresh, untouched, wait_until

pytestmark = pytest.mark.timeout(40, method="signal")


def test_restart_during_read_bytes_rejected_owner_frees_after_drain(own_redis, make_sender,
                                                                     make_receiver, tally) -> None:
    tally.scenario()
    url = own_redis.url
    ttl, margin = 3.0, 0.3
    sender = make_sender(url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    t_pub = time.monotonic()
    h, data = publish_fresh(sender, 3, "req-restart")
    r, pool = make_receiver(url, claimer="A", claim_ttl=10.0)
    old_epoch = h.fence_epoch
    sender.hold_after = True
    fut = Bounded(lambda: r.fetch(h, [0, 1, 2]))
    assert sender.entered.wait(5)
    own_redis.kill()
    time.sleep(0.3)                                   # the owner's watcher sees Redis gone
    assert sender.freed_reasons("req-restart") == []
    own_redis.restart()                               # empty dataset: new epoch
    time.sleep(1.3)                                   # >= one lease sweep: the owner learns the lease is gone
    assert sender.freed_reasons("req-restart") == [], "freed under an in-flight read"
    sender.gate.set()
    res = fut.result(15)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, StaleFence), res.error
    assert "epoch" in str(res.error) and res.action is Action.REPREFILL
    assert res.failed_block_ids == [0, 1, 2]
    assert tally.owner(sender, start, timeout=owner_deadline(t_pub, ttl, margin_s=margin) + 2 - time.monotonic()) == 0
    freed = sender.freed_at("req-restart")
    assert freed is not None and freed <= owner_deadline(t_pub, ttl, margin_s=margin) + 1.5
    assert sender.violations == 0 and len(sender.freed_reasons("req-restart")) == 1
    # fences never repeat: the new dataset has a new epoch
    h2, data2 = publish_fresh(sender, 1, "req-after")
    assert h2.fence_epoch != old_epoch
    res2 = Bounded(lambda: r.fetch(h2, [4])).result(10)
    assert tally.result(res2, data2, pool), res2.error
    assert tally.owner(sender, start) == 0


def test_redis_stays_down_past_owner_deadline_read_in_flight(own_redis, make_sender, make_receiver,
                                                             tally) -> None:
    """Redis dies for good while a read is in flight: the owner's local deadline passes, but it
    frees only once the read has drained; the claimer cannot validate, so the bytes are not used."""
    tally.scenario()
    url = own_redis.url
    ttl, margin = 0.8, 0.2
    sender = make_sender(url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    t_pub = time.monotonic()
    h, data = publish_fresh(sender, 2, "req-down")
    r, pool = make_receiver(url, claimer="A", claim_ttl=10.0,
                            retry=Retry(attempts=2, backoff=Backoff(0.01, 0.02), deadline=2.0))
    sender.hold_after = True
    fut = Bounded(lambda: r.fetch(h, [0, 1]))
    assert sender.entered.wait(5)
    own_redis.kill()
    time.sleep(max(0.0, owner_deadline(t_pub, ttl, margin_s=margin) + 0.8 - time.monotonic()))
    assert sender.freed_reasons("req-down") == [], "freed under an in-flight read"
    sender.gate.set()
    res = fut.result(15)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, LeaseStoreUnavailable) and res.action is Action.RETRY
    assert res.failed_block_ids == [0, 1]
    assert tally.owner(sender, start, timeout=3) == 0
    assert sender.freed_reasons("req-down") == ["expired"] and sender.violations == 0


@pytest.mark.parametrize("when", ["down", "restarted"])
def test_read_arriving_while_redis_down_or_after_restart_is_refused(own_redis, make_sender,
                                                                    make_receiver, tally, when) -> None:
    tally.scenario()
    url = own_redis.url
    sender = make_sender(url, ttl=2.0, clock_margin=0.2)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-queued")
    r, pool = make_receiver(url, claimer="A", claim_ttl=10.0,
                            retry=Retry(attempts=2, backoff=Backoff(0.01, 0.02), deadline=2.0))
    sender.hold_before = True                         # READ queued before the owner's lease check
    fut = Bounded(lambda: r.fetch(h, [0, 1]))
    assert sender.entered.wait(5)
    own_redis.kill()
    if when == "restarted":
        own_redis.restart()
    sender.gate.set()
    res = fut.result(20)
    tally.result(res, data, pool)
    assert not res.ok and untouched(pool, [0, 1]), res.error
    if when == "down":   # the owner cannot check the fence: retryable, retried, exhausted
        assert isinstance(res.error, LeaseStoreUnavailable) and res.action is Action.RETRY
    else:                # the claim made with the read finds no lease in the new dataset (a claim
        # made before the restart would carry a fence of the lost dataset: StaleFence)
        assert isinstance(res.error, (StaleFence, LeaseNotFound)) and res.action is Action.REPREFILL
    assert res.failed_block_ids == [0, 1]
    if when == "down":
        own_redis.restart()
    assert tally.owner(sender, start, timeout=6) == 0


def test_owner_cut_off_keeps_blocks_until_local_deadline(own_redis, make_sender, make_receiver,
                                                         tally) -> None:
    tally.scenario()
    url = own_redis.url
    # the fetch below must come before the local deadline (ttl - margin): the receiver's setup,
    # the kill and the revoke took over 0.7 s in a slow spell of a 2-core machine
    ttl, margin = 3.0, 0.3
    sender = make_sender(url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    t0 = time.monotonic()
    h_rev, _ = publish_fresh(sender, 2, "req-revoked")    # the engine revokes it during the outage
    h_exp, data = publish_fresh(sender, 2, "req-expiring")   # nobody fetches it
    t1 = time.monotonic()
    r, pool = make_receiver(url, claimer="A", retry=Retry(attempts=2, backoff=Backoff(0.01, 0.02),
                                                          deadline=2.0))
    own_redis.kill()
    assert sender.revoke(h_rev) is True                   # cannot reach Redis: kept until deadline
    # a fetch during the outage: the claim cannot be made -> retryable error, bounded
    t_f = time.monotonic()
    res = Bounded(lambda: r.fetch(h_exp, [0, 1])).result(15)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, LeaseStoreUnavailable) and res.action is Action.RETRY
    assert time.monotonic() - t_f < 8.0
    lo, hi = owner_deadline(t0, ttl, margin_s=margin), owner_deadline(t1, ttl, margin_s=margin)
    assert wait_until(lambda: len(sender.frees) == 2, hi + 4.0 - time.monotonic()), sender.frees
    for rid, reason in (("req-revoked", "revoked"), ("req-expiring", "expired")):
        assert sender.freed_reasons(rid) == [reason]
        freed = sender.freed_at(rid)
        assert lo <= freed <= hi + 3.0, (rid, freed - t0, lo - t0, hi - t0)   # never before the deadline
    assert tally.owner(sender, start) == 0


def test_operations_retry_through_outage_then_succeed_or_fail_clearly(own_redis, ns, make_receiver,
                                                                      tally) -> None:
    tally.scenario()
    url = own_redis.url
    patient = Retry(attempts=100, backoff=Backoff(base=0.05, cap=0.1, jitter=False), deadline=10.0)
    store = RedisLeaseStore(url, namespace=ns, retry=patient)
    pool = KVPool.allocate(LAYOUT, 8)
    sender = FaultSender(pool, "tcp://127.0.0.1:0", leases=store, lease_namespace=ns, ttl=10.0)
    try:
        start = pool.num_free
        h0, _ = publish_fresh(sender, 1, "req-before")
        own_redis.kill()
        threading.Timer(0.5, own_redis.restart).start()
        t0 = time.monotonic()
        h1, data1 = publish_fresh(sender, 1, "req-through")  # retried until Redis is back
        assert 0.4 <= time.monotonic() - t0 < 5.0
        assert Fence(h1.fence_epoch, h1.fence) != Fence(h0.fence_epoch, h0.fence)
        assert h1.fence_epoch != h0.fence_epoch
        r, rpool = make_receiver(url, claimer="A")
        res1 = Bounded(lambda: r.fetch(h1, [0])).result(10)
        assert tally.result(res1, data1, rpool), res1.error
        res0 = Bounded(lambda: r.fetch(h0, [1])).result(10)   # its lease died with the dataset
        tally.result(res0, [], rpool)
        assert isinstance(res0.error, LeaseNotFound) and res0.action is Action.REPREFILL
        # a long outage with the default store retry: publish fails clearly, the engine keeps its blocks
        own_redis.kill()
        plain = FaultSender(KVPool.allocate(LAYOUT, 4), "tcp://127.0.0.1:0", leases=url, lease_namespace=ns)
        try:
            ids = plain.pool.alloc(1)
            t0 = time.monotonic()
            with pytest.raises(LeaseStoreUnavailable):
                plain.publish("req-down", ids, 1)
            assert time.monotonic() - t0 < 6.0
            assert plain.num_live == 0 and plain.pool.refcount(ids[0]) == 1
            plain.pool.free(ids)
        finally:
            own_redis.restart()
            Bounded(plain.close).result(10)
        sender.revoke(h0)
        assert tally.owner(sender, start, timeout=8) == 0
    finally:
        Bounded(sender.close).result(10)
        store.close()
