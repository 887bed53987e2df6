"""``KVReceiver.release`` of a leased handle (leases are the default): after
``fetch(..., release=False)``, or for a handle the decode side will not read, the release goes
through the lease and the sender frees the blocks at once -- it used to go to the sender, which
refuses leased handles, so the blocks stayed pinned until the handle's TTL."""

from __future__ import annotations

import pytest

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.lease import EmbeddedRedis, RedisLeaseStore
from tests.waiting import wait_until

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("read_first", [True, False], ids=["after-fetch", "never-read"])
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://"])
def test_release_of_a_leased_handle_frees_its_blocks(own_server: EmbeddedRedis, listen: str,
                                                      read_first: bool) -> None:
    freed: list[str] = []
    src = KVPool.allocate(L, 8, allocator="engine")
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(src, listen, leases=ls, ttl=600, on_free=lambda h, r: freed.append(r)) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv:
        h = snd.publish("kept", [1, 2], 8)
        if read_first:
            assert rcv.fetch(h, [3, 4], release=False).ok
        assert rcv.release(h.to_dict()) is True
        assert wait_until(lambda: freed == ["released"], 5), freed
        assert src.refcount(1) == 0 and src.refcount(2) == 0
        assert rcv.release(h) is False                     # once only: the lease is gone
        assert not rcv.fetch(h, [3, 4]).ok                 # and so is the KV
