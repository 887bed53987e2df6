"""README (Leases and lifecycle): until a fetch's release lands, the receiver that released a
handle refuses it itself -- ``fetch``, ``fetch_many`` and ``claim`` -- with the answer the store
gives once the release has landed. ``fetch`` and ``fetch_many`` are held to it in
``test_round_trips.py``; this is ``claim``, which the store alone would grant again (a claim
is re-entrant for its claimer)."""

from __future__ import annotations

import pytest

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge import releases
from kvbridge import sender_lifecycle
from kvbridge.errors import Action, LeaseExpired
from kvbridge.lease import EmbeddedRedis, RedisLeaseStore

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://"])
def test_claim_of_a_handle_whose_release_is_queued_is_refused(own_server: EmbeddedRedis, listen: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(releases, "LINGER", 0.5)                      # the release stays queued a while
    monkeypatch.setattr(sender_lifecycle, "SWEEP_INTERVAL", 3600.0)
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 8, allocator="engine"), listen, leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv:
        h = snd.publish("once", [1, 2], 8)
        assert rcv.claim(h) is not None                               # re-entrant before the fetch
        assert rcv.fetch(h, [3, 4]).ok
        stored = ls._redis.hget(ls._lease_prefix + ls.ref(h.lease_id), "st")
        assert stored == "C"                                          # the store still says claimed
        with pytest.raises(LeaseExpired, match="already released") as err:
            rcv.claim(h)
        assert err.value.action is Action.REPREFILL
