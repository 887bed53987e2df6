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
