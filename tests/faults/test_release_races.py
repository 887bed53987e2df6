"""Double release, release by a non-claimer, and 1,000 races of two decoders fetching one handle
through the full KVReceiver path (claim -> read -> validate -> release): exactly one gets the
published bytes each time, the other a final LeaseConflict/StaleHandle, and the owner frees every
handle exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvbridge import Action, LeaseConflict, StaleHandle
from kvbridge.lease import LeaseState

from ._util import Bounded, block_bytes, publish_fresh, untouched, wait_until

pytestmark = pytest.mark.timeout(60, method="signal")
N_RACES = 1000


def test_double_release_frees_once(shared_redis, make_sender, make_receiver, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-double")
    a, pool = make_receiver(url, claimer="A")
    res = a.fetch(h, [0, 1], release=False)
    assert tally.result(res, data, pool)
    store = a.lease_store(h)
    lease = store.get(h.lease_id)
    assert lease is not None and lease.state is LeaseState.CLAIMED and lease.claimer == "A"
    fence = lease.fence
    store.release(h.lease_id, "A", fence)
    store.release(h.lease_id, "A", fence)            # idempotent for the claimer
    store.abort(h.lease_id, "A", fence)              # too late to abort: stays released
    assert store.get(h.lease_id).state is LeaseState.RELEASED
    assert wait_until(lambda: sender.freed_reasons("req-double"), 5)
    a.release(h)                                     # a stray direct release after the free
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-double") == ["released"]   # exactly once
    assert sender.stats.released == 1 and sender.stats.blocks_freed == 2


def test_release_by_non_claimer_refused_in_lease_store(shared_redis, make_sender, make_receiver,
                                                       tally) -> None:
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-stranger")
    a, pool_a = make_receiver(url, claimer="A")
    b, pool_b = make_receiver(url, claimer="B")
    res = a.fetch(h, [0, 1], release=False)         # A holds the claim
    assert tally.result(res, data, pool_a)
    fence_a = a.lease_store(h).get(h.lease_id).fence
    sb = b.lease_store(h)
    for op in (sb.release, sb.abort):
        with pytest.raises(LeaseConflict):
            op(h.lease_id, "B", fence_a)             # a stranger, even with A's fence
    with pytest.raises(LeaseConflict):
        sb.claim(h.lease_id, "B", 5.0)
    res_b = b.fetch(h, [0, 1])                        # B through the full path: refused at claim
    assert not res_b.ok and isinstance(res_b.error, LeaseConflict)
    assert res_b.action is Action.REPREFILL and untouched(pool_b, [0, 1])
    assert sender.freed_reasons("req-stranger") == []   # A's blocks are still held for A
    a.lease_store(h).validate(h.lease_id, "A", fence_a)
    a.lease_store(h).release(h.lease_id, "A", fence_a)
    assert tally.owner(sender, start) == 0
    assert sender.freed_reasons("req-stranger") == ["released"]


def test_direct_release_by_non_claimer_does_not_free_claimed_blocks(
        shared_redis, make_sender, make_receiver, tally) -> None:
    """KVReceiver.release(handle) sends a transport RELEASE frame. For a leased handle the owner
    must not take it from anybody but the claimer (via the lease): here B, who never claimed,
    would otherwise free A's blocks behind A's claim -- without revoking the lease in Redis, so
    A's validate-after-read would still pass (invariant 1 broken on one-sided transports)."""
    tally.scenario()
    url = shared_redis.url
    sender = make_sender(url)
    start = sender.pool.num_free
    h, data = publish_fresh(sender, 2, "req-direct")
    a, pool_a = make_receiver(url, claimer="A")
    b, _ = make_receiver(url, claimer="B")
    sa = a.lease_store(h)
    claim = sa.claim(h.lease_id, "A", 10.0)          # A claimed, about to read
    b.release(h)                                      # B (handle bytes only) releases directly
    wait_until(lambda: bool(sender.freed_reasons("req-direct")), 0.5)
    freed_early = bool(sender.freed_reasons("req-direct"))
    lease = sa.get(h.lease_id)
    still_claimed = lease is not None and lease.state is LeaseState.CLAIMED
    try:
        sa.validate(h.lease_id, "A", claim.fence)    # what A's validate-after-read would say now
        validate_passes = True
    except StaleHandle:
        validate_passes = False
    res = a.fetch(h, [0, 1])                          # A's claim is idempotent: same fence
    tally.result(res, data, pool_a)
    assert not freed_early, (
        f"a RELEASE frame from a non-claimer freed a claimed handle's blocks without revoking "
        f"its lease (Redis: {'CLAIMED by A' if still_claimed else lease}; A's validate "
        f"{'still passes' if validate_passes else 'fails'}); A's fetch then: {res.error!r}")
    assert res.ok, res.error
    assert sa.get(h.lease_id).fence == claim.fence   # A's fetch went on under its own claim
    assert tally.owner(sender, start) == 0


def test_thousand_claim_races_full_path(shared_redis, make_sender, make_receiver, tally) -> None:
    """Two decoder threads fetch the same handle at the same moment, 1,000 times (inproc)."""
    tally.scenario(N_RACES)
    url = shared_redis.url
    sender = make_sender(url, num_blocks=N_RACES + 8, listen="inproc://")
    start = sender.pool.num_free
    recv = {name: make_receiver(url, claimer=name, num_blocks=N_RACES) for name in ("A", "B")}
    handles = [publish_fresh(sender, 1, f"race-{i}") for i in range(N_RACES)]
    barrier = threading.Barrier(2, timeout=10)
    out: dict[str, list[Any]] = {"A": [], "B": []}

    def racer(name: str) -> None:
        r, _ = recv[name]
        for i, (h, _) in enumerate(handles):
            barrier.wait()
            out[name].append(r.fetch(h, [i]))

    threads = [Bounded(lambda n=n: racer(n), f"racer {n}") for n in ("A", "B")]
    for t in threads:
        t.result(50)
    winners = {"A": 0, "B": 0}
    for i, (h, data) in enumerate(handles):
        ra, rb = out["A"][i], out["B"][i]
        oks = [n for n, r in (("A", ra), ("B", rb)) if r.ok]
        assert len(oks) == 1, (i, ra.error, rb.error)
        winner = oks[0]
        loser = rb if winner == "A" else ra
        winners[winner] += 1
        win_res = ra if winner == "A" else rb
        tally.result(win_res, data, recv[winner][1])
        assert block_bytes(recv[winner][1], i) == data[0]
        assert isinstance(loser.error, (LeaseConflict, StaleHandle)), loser.error
        assert loser.action is Action.REPREFILL and loser.failed_block_ids == [i]
    assert winners["A"] + winners["B"] == N_RACES
    assert tally.owner(sender, start, timeout=15) == 0
    assert sender.stats.released == N_RACES and sender.stats.blocks_freed == N_RACES
    assert all(sender.freed_reasons(f"race-{i}") == ["released"] for i in (0, N_RACES // 2, N_RACES - 1))
