"""A leased fetch costs two lease round trips: the claim (made by the owner as it serves the
read) and the release (the claimer's validate-after-read). Counted on the lease server."""

from __future__ import annotations

import redis

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.lease import EmbeddedRedis, RedisLeaseStore

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")


def _script_calls(srv: EmbeddedRedis) -> int:
    stats = redis.Redis.from_url(srv.auth_url).info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def test_leased_fetch_is_two_lease_round_trips(own_server: EmbeddedRedis) -> None:
    dst = KVPool.allocate(L, 8)
    for listen in ("tcp://127.0.0.1:0", "shm://", "inproc://"):
        src = KVPool.allocate(L, 8, shared=listen == "shm://", allocator="engine")
        with RedisLeaseStore(own_server.url) as ls, KVSender(src, listen, leases=ls) as snd, \
                KVReceiver(dst, leases=ls) as rcv:
            assert rcv.fetch(snd.publish("warm", [7], 4), [7]).ok         # scripts loaded
            h = snd.publish("r", [1, 2], 8)
            before = _script_calls(own_server)
            res = rcv.fetch(h, [3, 4])
            assert res.ok, res.error
            assert _script_calls(own_server) - before == 2, listen
            # a claim made ahead (a request waiting in a decode queue) costs its own trip; the fetch stays at two
            h2 = snd.publish("r2", [5, 6], 8)
            rcv.claim(h2)
            before = _script_calls(own_server)
            assert rcv.fetch(h2, [3, 4]).ok
            assert _script_calls(own_server) - before == 2, listen   # the owner claims again (idempotent) + release


def test_fetch_many_is_two_lease_round_trips(own_server: EmbeddedRedis) -> None:
    """The receiver's claims go in one pipelined round trip, its releases (the
    validates-after-read) in another."""
    src, dst = KVPool.allocate(L, 16, allocator="engine"), KVPool.allocate(L, 16)
    with RedisLeaseStore(own_server.url) as ls, RedisLeaseStore(own_server.url) as owner_ls, \
            KVSender(src, "tcp://127.0.0.1:0", leases=owner_ls) as snd, KVReceiver(dst, leases=ls) as rcv:
        assert rcv.fetch(snd.publish("warm", [15], 4), [15]).ok
        hs = [snd.publish(f"r{i}", [2 * i, 2 * i + 1], 8) for i in range(4)]
        trips = 0
        call = ls._call

        def counted(fn):  # type: ignore[no-untyped-def]
            nonlocal trips
            trips += 1
            return call(fn)
        ls._call = counted  # type: ignore[method-assign]
        res = rcv.fetch_many([(h, [2 * i, 2 * i + 1]) for i, h in enumerate(hs)])
        ls._call = call  # type: ignore[method-assign]
        assert all(r.ok for r in res), [r.error for r in res]
        assert trips == 2      # the receiver's; the owner still checks each read's fence as it serves it
        assert all(ls.get(h.lease_id).state.value == "released" for h in hs)  # type: ignore[union-attr]
