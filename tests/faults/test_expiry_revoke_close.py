"""A read in flight while its lease ends -- the lease TTL lapses, the claim lapses, the owner
revokes, the owner closes: validate-after-read rejects the bytes (never reported ok, every block
listed failed), and the owner frees only after the read has drained, exactly once."""

from __future__ import annotations

import time

import pytest

from kvbridge import HandleNotFound, Action, LeaseConflict, LeaseExpired, PeerUnavailable, StaleFence
from kvbridge.lease import owner_deadline

from ._util import Bounded, publish_fresh, wait_until

pytestmark = pytest.mark.timeout(30, method="signal")


def _held_fetch(sender, r, h, dst):
    """Start ``r.fetch(h, dst)``; return once the owner has authorized the read and holds it."""
    sender.hold_after = True
    fut = Bounded(lambda: r.fetch(h, dst))
    assert sender.entered.wait(5), "the read never reached the owner"
    return fut


@pytest.mark.parametrize("past_owner_deadline", [False, True], ids=["redis-expiry", "owner-deadline"])
def test_lease_expires_during_slow_read(shared_redis, make_sender, make_receiver, tally,
                                        past_owner_deadline: bool) -> None:
    tally.scenario()
    url = shared_redis.url
    ttl, margin = 0.6, 0.1
    sender = make_sender(url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    t_pub = time.monotonic()
    h, data = publish_fresh(sender, 3, "req-slow")
    r, pool = make_receiver(url, claimer="A", claim_ttl=10.0)   # the claim is capped at the lease
    fut = _held_fetch(sender, r, h, [0, 1, 2])
    store = r.lease_store(h)
    assert wait_until(lambda: store.get(h.lease_id) is None, ttl + 2), "Redis kept the lease"
    if past_owner_deadline:
        # the owner's own deadline passes too: it wants to free, but a read of it is in flight
        time.sleep(max(0.0, owner_deadline(t_pub, ttl, margin_s=margin) + 0.3 - time.monotonic()))
    assert sender.freed_reasons("req-slow") == [], "freed under an in-flight read"
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, LeaseExpired), res.error
    assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1, 2]
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-slow") == ["expired"] and sender.violations == 0


@pytest.mark.parametrize("takeover", [False, True])
def test_claim_lapses_during_slow_read(shared_redis, make_sender, make_receiver, tally, takeover) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url, ttl=20.0)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-lapse")
    a, pool_a = make_receiver(url, claimer="A", claim_ttl=0.3)
    sender.hold_claimer = "A"
    fut = _held_fetch(sender, a, h, [0, 1])
    time.sleep(0.4)
    if takeover:
        b, pool_b = make_receiver(url, claimer="B", claim_ttl=10.0)
        res_b = Bounded(lambda: b.fetch(h, [4, 5], release=False)).result(10)
        assert tally.result(res_b, data, pool_b), res_b.error
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool_a)
    assert not res.ok and isinstance(res.error, LeaseConflict if takeover else StaleFence), res.error
    assert res.failed_block_ids == [0, 1]
    if takeover:
        assert sender.freed_reasons("req-lapse") == []       # B still holds it
        lease = b.lease_store(h).get(h.lease_id)
        b.lease_store(h).release(h.lease_id, "B", lease.fence)
    else:
        sender.revoke(h)
    assert tally.owner(sender, start) == 0
    assert len(sender.freed_reasons("req-lapse")) == 1 and sender.violations == 0


def test_revoke_mid_flight(shared_redis, make_sender, make_receiver, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-revoke")
    r, pool = make_receiver(url, claimer="A")
    fut = _held_fetch(sender, r, h, [0, 1])
    assert sender.revoke(h) is True
    assert sender.revoke(h) is False                  # once
    assert r.lease_store(h).get(h.lease_id) is None   # revoked in Redis first ...
    time.sleep(0.2)
    assert sender.freed_reasons("req-revoke") == []   # ... but not freed under the read
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, LeaseExpired), res.error
    assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1]
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-revoke") == ["revoked"] and sender.violations == 0
    # revoked before anyone claimed: the fetch is final at once (the claim travels in the read,
    # which the owner refuses: the handle is no longer live there)
    h2, _ = publish_fresh(sender, 1, "req-revoke-2")
    sender.revoke(h2)
    t0 = time.monotonic()
    res2 = r.fetch(h2, [3])
    assert isinstance(res2.error, (LeaseExpired, HandleNotFound)) and res2.attempts <= 1, res2.error
    assert res2.action is Action.REPREFILL and res2.failed_block_ids == [3]
    assert time.monotonic() - t0 < 0.5
    assert tally.owner(sender, start) == 0


def test_close_with_handles_outstanding(shared_redis, make_sender, make_receiver, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    held, data = publish_fresh(sender, 2, "req-held")
    idle = [publish_fresh(sender, 1, f"req-idle-{i}")[0] for i in range(3)]
    r, pool = make_receiver(url, claimer="A")
    claimed_idle = r.fetch(idle[0], [5], release=False)      # claimed, read, not yet released
    assert claimed_idle.ok
    fut = _held_fetch(sender, r, held, [0, 1])
    closer = Bounded(sender.close, "close")
    assert wait_until(lambda: len(sender.frees) == 3, 5), sender.frees   # the idle ones at once
    assert sender.freed_reasons("req-held") == []             # the read in flight drains first
    assert all(sender.freed_reasons(f"req-idle-{i}") == ["closed"] for i in range(3))
    sender.gate.set()
    res = fut.result(10)
    closer.result(10)
    tally.result(res, data, pool)
    assert not res.ok and isinstance(res.error, (LeaseExpired, PeerUnavailable)), res.error
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-held") == ["closed"] and sender.violations == 0
    assert r.lease_store(held).get(held.lease_id) is None     # revoked in Redis before the free
