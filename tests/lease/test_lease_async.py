"""Awaitable twins: native redis.asyncio, same semantics as the blocking calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvbridge.errors import (LeaseConflict, LeaseExpired, LeaseNotFound, LeaseStoreUnavailable,
                             StaleFence)
from kvbridge.lease import EmbeddedRedis, Lease, LeaseEvent, LeaseState, RedisLeaseStore
from kvbridge.policy import Backoff, Retry

pytestmark = pytest.mark.timeout(60)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_async_lifecycle(server: EmbeddedRedis, ns: str) -> None:
    async def main() -> None:
        async with RedisLeaseStore(server.url, namespace=ns) as s:
            p = await s.apublish("a", "owner", ttl_s=10, num_blocks=3, meta={"k": "v"})
            assert p.state is LeaseState.PUBLISHED and p.meta == {"k": "v"}
            c = await s.aclaim("a", "dec", 5)
            assert (await s.aclaim("a", "dec", 5)).fence == c.fence
            with pytest.raises(LeaseConflict):
                await s.aclaim("a", "other", 5)
            await s.avalidate("a", "dec", c.fence)
            r = await s.arenew("a", "dec", 5, fence=c.fence)
            assert r.fence == c.fence
            await s.arenew("a", "owner", 20)
            assert [x.ref for x in await s.alist("owner")] == [s.ref("a")]
            assert await s.asweep("owner", ["a", "b"]) == {"a": LeaseState.CLAIMED, "b": None}
            await s.arelease("a", "dec", c.fence)
            await s.arelease("a", "dec", c.fence)
            assert await s.aevents("owner", timeout_s=1) == [LeaseEvent("released", s.ref("a"))]
            got = await s.aget("a")
            assert got is not None and got.state is LeaseState.RELEASED
            with pytest.raises(LeaseNotFound):
                await s.aclaim("nope", "dec", 5)
            await s.apublish("b", "owner", ttl_s=10)
            cb = await s.aclaim("b", "dec", 5)
            await s.aabort("b", "dec", cb.fence)
            await s.apublish("c", "owner", ttl_s=10)
            assert await s.arevoke("c", "owner") is LeaseState.PUBLISHED
            with pytest.raises(LeaseExpired):
                await s.aclaim("c", "dec", 5)
            assert await s.aevents("owner", timeout_s=1) == [
                LeaseEvent("aborted", s.ref("b")), LeaseEvent("revoked", s.ref("c"))]
            t0 = time.monotonic()
            assert await s.aevents("owner", timeout_s=0.2) == []
            assert time.monotonic() - t0 < 2
    run(main())


def test_async_races_one_winner(server: EmbeddedRedis, ns: str) -> None:
    async def main() -> None:
        async with RedisLeaseStore(server.url, namespace=ns) as s:
            ids = [f"r{i}" for i in range(300)]
            await s.apublish_many("owner", ids, ttl_s=30)
            for lid in ids:
                res = await asyncio.gather(s.aclaim(lid, "A", 10), s.aclaim(lid, "B", 10),
                                           return_exceptions=True)
                assert sorted(type(x).__name__ for x in res) == ["Lease", "LeaseConflict"]
            a, b = await asyncio.gather(s.aclaim_many("A", ids, 10), s.aclaim_many("B", ids, 10))
            for x, y in zip(a, b):  # both retried: each lease is held by its first winner
                assert sorted(type(v).__name__ for v in (x, y)) == ["Lease", "LeaseConflict"]
            held = [x for x in a if isinstance(x, Lease)]
            rel = await s.arelease_many("A", [(x.lease_id, x.fence) for x in held])
            assert rel == [None] * len(held)
            batch = s.batch().get(ids[0]).claim(ids[0], "Z", 1)
            got, refused = await batch.aexecute()
            assert got is not None and isinstance(refused, (LeaseConflict, LeaseExpired))
    run(main())


def test_async_store_reused_across_event_loops(server: EmbeddedRedis, ns: str) -> None:
    s = RedisLeaseStore(server.url, namespace=ns)

    async def then_close(coro: Any) -> Any:
        try:
            return await coro
        finally:
            await s.aclose()  # before the loop ends: the store may move on to another loop

    try:
        run(then_close(s.apublish("a", "owner", ttl_s=10)))
        c = run(then_close(s.aclaim("a", "dec", 5)))  # a new loop: a new async client
        s.validate("a", "dec", c.fence)  # and the blocking side agrees
    finally:
        s.close()


def test_async_restart_with_data_loss(own_server: EmbeddedRedis, ns: str) -> None:
    fast = Retry(attempts=3, backoff=Backoff(0.01, 0.05), deadline=1.0)

    async def main() -> None:
        async with RedisLeaseStore(own_server.url, namespace=ns, retry=fast) as s:
            await s.apublish("a", "owner", ttl_s=30)
            old = await s.aclaim("a", "dec", 30)
            own_server.kill()
            t0 = time.monotonic()
            with pytest.raises(LeaseStoreUnavailable):
                await s.avalidate("a", "dec", old.fence)
            assert time.monotonic() - t0 < 3
            own_server.restart()
            with pytest.raises(StaleFence):
                await s.avalidate("a", "dec", old.fence)
    run(main())


def test_async_cancellation_propagates(server: EmbeddedRedis, ns: str) -> None:
    async def main() -> None:
        async with RedisLeaseStore(server.url, namespace=ns) as s:
            task = asyncio.create_task(s.aevents("owner", timeout_s=3))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=2)
            # the store is still usable after a cancelled call
            await s.apublish("a", "owner", ttl_s=5)
            assert (await s.aget("a")) is not None
    run(main())
