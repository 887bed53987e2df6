"""Server-side fencing: the owner refuses a read whose claim is not the lease's current one --
a lapsed claim, a claim taken over by another decoder, a forged counter, no claim at all --
before a byte is sent. Through the full KVReceiver path too: a claim that lapses (and is taken
over) while the claimer's read is queued at the owner ends in a final error, no bytes used."""

from __future__ import annotations

import time

import pytest

from kvbridge import AccessDenied, Action, LeaseConflict, StaleFence, StaleHandle
from kvbridge.transports.base import Spans
from kvbridge import Claim

from ._util import Bounded, publish_fresh, untouched, wait_until

pytestmark = pytest.mark.timeout(30, method="signal")


def _read(r, h, pool, dst, claim):
    """One raw read through the receiver's transport, under ``claim``."""
    return r.transport(h.urls[0]).read(h.urls[0], h, Spans.of_blocks(pool, dst), None, claim)


@pytest.mark.parametrize("scheme", ["tcp", "inproc"])
def test_stale_fence_read_refused_by_owner(shared_redis, make_sender, make_receiver, tally, scheme) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url, listen="tcp://127.0.0.1:0" if scheme == "tcp" else "inproc://")
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-fence")
    a, pool_a = make_receiver(url, claimer="A")
    b, pool_b = make_receiver(url, claimer="B", claim_ttl=10.0)
    sa = a.lease_store(h)
    first = sa.claim(h.lease_id, "A", 0.2)
    claim_a = Claim("A", first.fence.epoch, first.fence.counter)
    refused_before = sender.stats.refused
    # no claim at all: refused
    with pytest.raises(AccessDenied):
        _read(a, h, pool_a, [0, 1], None)
    # a forged counter for the current claimer: refused
    with pytest.raises(StaleFence):
        _read(a, h, pool_a, [0, 1], claim_a._replace(counter=first.fence.counter + 1))
    # A's claim lapses (claim TTL kept by Redis): A's own read is refused
    time.sleep(0.3)
    with pytest.raises(StaleFence):
        _read(a, h, pool_a, [0, 1], claim_a)
    # B claims: A's old fence is refused, also when A pretends to be B
    second = b.lease_store(h).claim(h.lease_id, "B", 10.0)
    assert second.fence > first.fence
    with pytest.raises(LeaseConflict):
        _read(a, h, pool_a, [0, 1], claim_a)
    with pytest.raises(StaleFence):
        _read(a, h, pool_a, [0, 1], claim_a._replace(claimer="B"))
    stale_landed = 0 if untouched(pool_a, [0, 1]) else 1
    tally.stale += stale_landed
    assert stale_landed == 0, "a refused read wrote bytes into the destination"
    assert sender.stats.refused - refused_before == 5
    # B, the current claimer, reads fine and releases; the owner frees once
    res = b.fetch(h, [0, 1])
    assert tally.result(res, data, pool_b), res.error
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-fence") == ["released"]


def test_claim_lapses_while_read_is_queued(shared_redis, make_sender, make_receiver, tally) -> None:
    """A's READ reaches the owner but waits (before authorization) until A's claim has lapsed and
    B has claimed: the owner refuses it (server-side check) and A's fetch ends final."""
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-queued")
    a, pool_a = make_receiver(url, claimer="A", claim_ttl=0.3)
    b, pool_b = make_receiver(url, claimer="B", claim_ttl=10.0)
    sender.hold_before, sender.hold_claimer = True, "A"
    fut = Bounded(lambda: a.fetch(h, [0, 1]))
    assert sender.entered.wait(5)
    sb = b.lease_store(h)
    assert wait_until(lambda: _try_claim(sb, h), 3.0), "A's claim did not lapse"
    sender.gate.set()
    res = fut.result(10)
    tally.result(res, data, pool_a)
    assert not res.ok and isinstance(res.error, LeaseConflict), res.error
    assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1]
    assert untouched(pool_a, [0, 1])
    res_b = b.fetch(h, [2, 3])   # B's claim is idempotent: same fence, reads, releases
    assert tally.result(res_b, data, pool_b), res_b.error
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-queued") == ["released"]


def _try_claim(store, h) -> bool:
    try:
        store.claim(h.lease_id, "B", 10.0)
        return True
    except StaleHandle:
        return False
