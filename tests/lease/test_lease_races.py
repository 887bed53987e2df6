"""Claim races: exactly one winner per lease, whatever the interleaving."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvbridge.errors import LeaseConflict, StaleFence
from kvbridge.lease import Lease, RedisLeaseStore

pytestmark = pytest.mark.timeout(120)

N_RACES = 1000


def test_thread_races_one_winner_each(store: RedisLeaseStore, store2: RedisLeaseStore) -> None:
    ids = [f"r{i}" for i in range(N_RACES)]
    for chunk in range(0, N_RACES, 100):
        store.publish_many("owner", ids[chunk:chunk + 100], ttl_s=60)
    barrier = threading.Barrier(2, timeout=10)
    results: dict[str, list[Any]] = {"A": [], "B": []}

    def racer(name: str, s: RedisLeaseStore) -> None:
        for lid in ids:
            barrier.wait()  # both claim the same lease at the same moment
            try:
                results[name].append(s.claim(lid, name, 30))
            except LeaseConflict as exc:
                results[name].append(exc)

    threads = [threading.Thread(target=racer, args=("A", store)),
               threading.Thread(target=racer, args=("B", store2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads)
    winners = {"A": 0, "B": 0}
    for i, lid in enumerate(ids):
        a, b = results["A"][i], results["B"][i]
        won = [x for x in (a, b) if isinstance(x, Lease)]
        assert len(won) == 1, (lid, a, b)
        winners[won[0].claimer] += 1  # type: ignore[index]
        loser = "B" if won[0].claimer == "A" else "A"
        winner_store, loser_store = (store, store2) if loser == "B" else (store2, store)
        assert isinstance(results[loser][i], LeaseConflict)
    # spot-check: the winner validates, the loser's borrowed fence does not
    for i in range(0, N_RACES, 97):
        lid = ids[i]
        win = next(x for x in (results["A"][i], results["B"][i]) if isinstance(x, Lease))
        store.validate(lid, win.claimer, win.fence)
        with pytest.raises(LeaseConflict):
            store.validate(lid, "B" if win.claimer == "A" else "A", win.fence)
    assert winners["A"] + winners["B"] == N_RACES


def test_pipelined_races_one_winner_each(store: RedisLeaseStore, store2: RedisLeaseStore) -> None:
    ids = [f"p{i}" for i in range(N_RACES)]
    for chunk in range(0, N_RACES, 250):
        store.publish_many("owner", ids[chunk:chunk + 250], ttl_s=60)

    def racer(name: str, s: RedisLeaseStore) -> list[Any]:
        out: list[Any] = []
        for chunk in range(0, N_RACES, 64):
            out.extend(s.claim_many(name, ids[chunk:chunk + 64], 30))
        return out

    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(racer, "A", store)
        fb = pool.submit(racer, "B", store2)
        ra, rb = fa.result(timeout=60), fb.result(timeout=60)
    for a, b in zip(ra, rb):
        kinds = sorted(type(x).__name__ for x in (a, b))
        assert kinds == ["Lease", "LeaseConflict"], (a, b)


def test_takeover_race_after_claim_lapses(store: RedisLeaseStore, store2: RedisLeaseStore) -> None:
    ids = [f"t{i}" for i in range(200)]
    store.publish_many("owner", ids, ttl_s=60)
    first = store.claim_many("dead", ids, 0.1)
    time.sleep(0.2)  # the first claimer "died": its claims lapse
    with ThreadPoolExecutor(2) as pool:
        fb = pool.submit(store.claim_many, "B", ids, 30)
        fc = pool.submit(store2.claim_many, "C", ids, 30)
        rb, rc = fb.result(timeout=30), fc.result(timeout=30)
    for old, b, c in zip(first, rb, rc):
        won = [x for x in (b, c) if isinstance(x, Lease)]
        assert len(won) == 1
        assert won[0].fence > old.fence  # type: ignore[union-attr]
    refused = store.release_many("dead", [(x.lease_id, x.fence) for x in first])  # type: ignore[union-attr]
    assert all(isinstance(x, LeaseConflict) for x in refused)


def test_same_claimer_concurrent_retries_share_one_fence(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=60)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: store.claim("a", "dec", 30), range(32), timeout=30))
    assert len({g.fence for g in got}) == 1
    store.release("a", "dec", got[0].fence)
    with pytest.raises((StaleFence, LeaseConflict)):
        store.validate("a", "dec", got[0].fence.__class__(got[0].fence.epoch, 1))
