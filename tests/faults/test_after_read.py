"""Validate-after-read without a lease round trip, under faults (tcp).

After the last byte of a read, the owner's trailer says whether it still vouches for the read:
blocks unchanged, handle live, lease within its TTL by its clock. The receiver keeps the bytes
without asking the lease store only if it does and the claim certainly still holds by the
receiver's clock; the release then goes after the fetch returns. Each way that can fail is
provoked here while a read is held at the owner (after it authorized the read, before a byte is
sent): the blocks retired, the owner's lease clock running out, the claim growing old, the
lease vanishing, one reply of a pipeline refused. Never ok with stale bytes, never two
consumers."""

from __future__ import annotations

import time

import pytest
import redis

from kvbridge import Action, KVPool, LeaseExpired, StaleHandle, Unvouched
from kvbridge.lease import LeaseState

from ._util import LAYOUT, Bounded, FaultSender, fill_random, publish_fresh, wait_until

pytestmark = pytest.mark.timeout(30, method="signal")


def _held(sender, fetch):
    sender.hold_after = True
    fut = Bounded(fetch)
    assert sender.entered.wait(5), "the read never reached the owner"
    return fut


def test_ok_fetch_releases_after_it_returns(shared_redis, make_sender, make_receiver, tally) -> None:
    tally.scenario()
    sender = make_sender(shared_redis.url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-later")
    r, pool = make_receiver(shared_redis.url, claimer="A")
    res = r.fetch(h, [0, 1])
    assert tally.result(res, data, pool), res.error
    assert tally.owner(sender, start) == 0                     # the release arrived; the owner freed
    assert sender.freed_reasons("req-later") == ["released"] and sender.violations == 0
    assert r.stats.released_later == 1 and r.stats.release_failures == 0


def test_blocks_retired_before_the_trailer_fetch_fails_stale(shared_redis, ns, make_receiver, tally) -> None:
    """The engine reuses the blocks while the read is in flight: the trailer says STALE."""
    tally.scenario()
    pool = KVPool.allocate(LAYOUT, 8, allocator="engine")
    sender = FaultSender(pool, "tcp://127.0.0.1:0", leases=shared_redis.url, lease_namespace=ns, clock_margin=0.2)
    try:
        data = fill_random(pool, [2, 3])
        h = sender.publish("req-retired", [2, 3], 2 * LAYOUT.block_size)
        r, rpool = make_receiver(shared_redis.url, claimer="A")
        fut = _held(sender, lambda: r.fetch(h, [0, 1]))
        pool.retire([3])                                      # generations move on; the owner ends the handle
        sender.gate.set()
        res = fut.result(10)
        tally.result(res, data, rpool)
        assert not res.ok and type(res.error) is StaleHandle, repr(res.error)
        assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1]
        assert r.stats.released_later == 0
    finally:
        sender.gate.set()
        Bounded(sender.close, "close sender").result(10)


def test_owner_near_its_lease_ttl_does_not_vouch(shared_redis, make_sender, make_receiver, tally) -> None:
    """The lease is within the owner's clock margin of its TTL when the last byte leaves: the
    trailer says UNSURE, and the bytes are not used even though the store still has the claim
    (the receiver aborts it: the owner frees at once)."""
    tally.scenario()
    ttl, margin = 3.0, 2.5                                   # the owner vouches for ~0.47 s after publish
    sender = make_sender(shared_redis.url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    t_pub = time.monotonic()
    h, data = publish_fresh(sender, 2, "req-late")
    r, pool = make_receiver(shared_redis.url, claimer="A")
    fut = _held(sender, lambda: r.fetch(h, [0, 1]))
    time.sleep(max(0.0, t_pub + 0.7 - time.monotonic()))
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, Unvouched), repr(res.error)
    assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1]
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-late") == ["aborted"] and sender.violations == 0


def test_claim_older_than_ttl_margin_is_validated_in_the_store(shared_redis, make_sender, make_receiver,
                                                              tally) -> None:
    """The owner vouches, but the claim may be within the receiver's margin of lapsing: the
    release is made synchronously, and is the validate-after-read."""
    tally.scenario()
    sender = make_sender(shared_redis.url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-old")
    r, pool = make_receiver(shared_redis.url, claimer="A", claim_ttl=2.0, clock_margin=1.0)
    fut = _held(sender, lambda: r.fetch(h, [0, 1]))
    time.sleep(1.1)                                          # the claim holds until ~2 s: still in force
    sender.gate.set()
    res = fut.result(10)
    assert tally.result(res, data, pool), res.error
    lease = r.lease_store(h).get(h.lease_id)
    assert lease is not None and lease.state is LeaseState.RELEASED   # released before fetch returned
    assert r.stats.released == 1 and r.stats.released_later == 0
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-old") == ["released"] and sender.violations == 0


def test_claim_older_than_ttl_margin_and_lease_gone_fails(shared_redis, make_sender, make_receiver, tally) -> None:
    """... and when the lease is gone from the store by then, the fetch fails there."""
    tally.scenario()
    sender = make_sender(shared_redis.url)
    h, data = publish_fresh(sender, 2, "req-gone")
    r, pool = make_receiver(shared_redis.url, claimer="A", claim_ttl=2.0, clock_margin=1.0)
    store = r.lease_store(h)
    fut = _held(sender, lambda: r.fetch(h, [0, 1]))
    time.sleep(1.1)
    admin = redis.Redis.from_url(shared_redis.auth_url)
    assert admin.delete(store._lease_prefix + store.ref(h.lease_id)) == 1   # the store lost the lease
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, LeaseExpired), repr(res.error)
    assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1]
    assert r.stats.released_later == 0


def test_a_refused_reply_keeps_the_pipeline_in_step(shared_redis, make_sender, make_receiver, tally) -> None:
    """fetch_many pipelines reads on one connection; the owner revokes the middle handle after
    authorizing its read: that reply's trailer refuses it, the others are served and kept."""
    tally.scenario()
    sender = make_sender(shared_redis.url)
    start = sender.pool.num_free
    pubs = [publish_fresh(sender, 1, f"req-{i}") for i in range(3)]
    r, pool = make_receiver(shared_redis.url, claimer="A")
    opened = r.transport(sender.url).extra("connections_opened") or 0
    open_read = sender.open_read

    def revoking(handle_bytes, indices, claim=None, layers=None):  # type: ignore[no-untyped-def]
        grant = open_read(handle_bytes, indices, claim, layers)
        if grant._inner.rec.handle.request_id == "req-1":
            sender.revoke(grant._inner.rec.handle)          # ended after authorization, before the bytes
        return grant
    sender.open_read = revoking  # type: ignore[method-assign]
    res = r.fetch_many([(h, [i]) for i, (h, _) in enumerate(pubs)])
    for i in (0, 2):
        assert tally.result(res[i], pubs[i][1], pool), res[i].error
    tally.result(res[1], pubs[1][1], pool)
    assert not res[1].ok and isinstance(res[1].error, LeaseExpired), repr(res[1].error)
    assert r.transport(sender.url).extra("connections_opened") - opened <= 1
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-1") == ["revoked"] and sender.violations == 0
    assert wait_until(lambda: r.stats.released_later == 2, 5)
