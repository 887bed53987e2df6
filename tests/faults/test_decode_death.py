"""Decode dies after claiming: its claim lapses after the claim TTL; another decoder takes over
and gets the published bytes, or, with nobody taking over, the owner reclaims the blocks within
its lease TTL plus margin. The dead claimer's late calls are refused."""

from __future__ import annotations

import time

import pytest

from kvbridge import LeaseConflict, StaleHandle
from kvbridge.lease import Fence, LeaseState, RedisLeaseStore, owner_deadline

from ._util import Bounded, Child, handle_to_b64, publish_fresh, wait_until

pytestmark = pytest.mark.timeout(30, method="signal")
CLAIM_TTL = 0.5


def _decoder(url: str, ns: str) -> Child:
    """A decode worker in a child process (started before publishing: it takes a second)."""
    child = Child()
    child.call("receiver", num_blocks=8, leases=url, ns=ns, claim_ttl=CLAIM_TTL, claimer="decode-A")
    return child


def _dead_claimer(child: Child, h, *, mid_read: bool, sender) -> Fence:
    """The decode worker claims ``h`` -- and starts reading it if ``mid_read`` -- then is
    SIGKILLed. Returns the fence it held."""
    try:
        fence = Fence(**child.call("claim", handle=handle_to_b64(h)))
        if mid_read:
            sender.hold_after = True
            child.call("fetch_bg", handle=handle_to_b64(h))
            assert sender.entered.wait(10), "the dying decoder's read never reached the owner"
        child.kill()
    finally:
        child.close()
    return fence


@pytest.mark.parametrize("mid_read", [False, True], ids=["before-read", "mid-read"])
def test_claimer_killed_another_takes_over(shared_redis, ns, make_sender, make_receiver, tally,
                                           mid_read: bool) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url, ttl=20.0)
    start = sender.pool.num_free
    child = _decoder(url, ns)
    h, data = publish_fresh(sender, 3, "req-takeover")
    fence_a = _dead_claimer(child, h, mid_read=mid_read, sender=sender)
    sender.gate.set()   # a held read of the dead decoder goes on into a dead socket

    b, pool_b = make_receiver(url, claimer="decode-B", claim_ttl=5.0)
    store = b.lease_store(h)
    lease = store.get(h.lease_id)
    if lease is not None and lease.state is LeaseState.CLAIMED:
        # while A's claim is live, B is refused at once (final: LeaseConflict)
        early = b.fetch(h, [0, 1, 2])
        assert not early.ok and isinstance(early.error, LeaseConflict), early.error
        assert early.failed_block_ids == [0, 1, 2]
    # A's claim lapses after CLAIM_TTL, kept by Redis
    assert wait_until(lambda: store.get(h.lease_id).state is LeaseState.PUBLISHED, CLAIM_TTL + 2.0)
    res = Bounded(lambda: b.fetch(h, [3, 4, 5])).result(15)
    assert tally.result(res, data, pool_b), res.error
    assert res.ok and res.failed_block_ids == []
    # the dead decoder's late release/validate (say, from a zombie) are refused
    for op in (store.release, store.validate, store.abort):
        with pytest.raises(StaleHandle):
            op(h.lease_id, "decode-A", fence_a)
    # the owner learns of B's release and frees exactly once
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-takeover") == ["released"]
    assert sender.violations == 0


def test_claimer_killed_nobody_takes_over_owner_reclaims(shared_redis, ns, make_sender, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    ttl, margin = 1.0, 0.2
    sender = make_sender(url, ttl=ttl, clock_margin=margin)
    start = sender.pool.num_free
    child = _decoder(url, ns)
    t0 = time.monotonic()
    h, _ = publish_fresh(sender, 2, "req-orphan")
    t1 = time.monotonic()
    _dead_claimer(child, h, mid_read=True, sender=sender)
    sender.gate.set()
    # TTL kept by Redis; the owner's local deadline is owner_deadline(sent_at, ttl, margin)
    bound = owner_deadline(t1, ttl, margin_s=margin) + 2.0   # + one sweep / revoke round
    assert wait_until(lambda: sender.freed_at("req-orphan") is not None, bound - time.monotonic() + 0.5)
    freed = sender.freed_at("req-orphan")
    assert freed is not None and freed <= bound, (freed - t0, bound - t0)
    assert freed >= t0 + ttl, "freed before Redis can have expired the lease"
    assert sender.freed_reasons("req-orphan") == ["expired"]
    assert tally.owner(sender, start) == 0
    with RedisLeaseStore(url, namespace=ns) as s:
        assert s.get(h.lease_id) is None   # gone in Redis too
