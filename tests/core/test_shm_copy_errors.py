"""A copy that fails inside shm:// (a torch or CUDA error while moving mapped bytes) comes back
as a PoolError in the fetch result, never as a raw RuntimeError, and ends the sender's grant."""

from __future__ import annotations

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import PoolError
from kvbridge.transports import shm

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


def test_failed_copy_is_a_pool_error_and_frees_the_grant(monkeypatch):
    src = KVPool.allocate(LAYOUT, 8, shared=True)
    dst = KVPool.allocate(LAYOUT, 8)
    for b in src.buffers:
        b.copy_(torch.randn_like(b))
    dst._staged = True                      # a device-pool stand-in: read through MAP/DONE
    with KVSender(src, "shm://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("x", src.alloc(2), 8)

        def boom(*a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        with monkeypatch.context() as m:
            m.setattr(shm.ShmTransport, "_copy_in", staticmethod(boom))
            res = rcv.fetch(h, [0, 1], release=False)
        assert not res.ok and isinstance(res.error, PoolError), repr(res.error)
        assert "illegal memory access" in str(res.error)
        res = rcv.fetch(h, [2, 3])           # the grant ended with the connection: served again
        assert res.ok, res.error
