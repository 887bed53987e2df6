"""A decode worker can claim a handle while the request waits, keep the claim alive, then fetch."""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import LeaseConflict
from kvbridge.lease import EmbeddedRedis

LAYOUT = KVLayout.vllm_flash(2, 2, 16, 4, dtype="float32")


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as srv:
        yield srv.url


@pytest.mark.timeout(60)
def test_claim_ahead_renew_then_fetch(redis_url):
    src, dst = KVPool.allocate(LAYOUT, 8), KVPool.allocate(LAYOUT, 8)
    ids = src.alloc(3)
    for b in ids:
        for layer in range(2):
            for part in src.block(layer, b):
                part.copy_(torch.randn(part.shape))
    with KVSender(src, "tcp://127.0.0.1:0", leases=redis_url, ttl=10) as snd, \
            KVReceiver(dst, leases=redis_url, claim_ttl=0.6) as early, \
            KVReceiver(KVPool.allocate(LAYOUT, 8), leases=redis_url) as other:
        h = snd.publish("queued", ids, 12)
        claim = early.claim(h)
        assert claim is not None and claim.claimer == early.claimer
        for _ in range(4):                      # the request waits longer than one claim TTL
            time.sleep(0.3)
            early.renew(h, claim)
        res_other = other.fetch(h, [0, 1, 2])   # the claim is still held: another decoder is refused
        assert not res_other.ok and isinstance(res_other.error, LeaseConflict)
        res = early.fetch(h, [5, 6, 7])         # reuses the claim: same claimer, same fence
        assert res.ok, res.error
        assert all(torch.equal(x, y) for layer in range(2) for a, b in zip(ids, [5, 6, 7])
                   for x, y in zip(src.block(layer, a), dst.block(layer, b)))
        deadline = time.monotonic() + 5
        while src.num_free != 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert src.num_free == 8                # released through the lease, blocks back once
