"""Publish refusals that leave nothing behind, block ids that must be integers, and the error of
a fetch whose destination the engine gave up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import Action, BadHandle, PoolError, TransferCancelled
from kvbridge.lease import RedisLeaseStore
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(3, 2, 8, block_size=12, dtype="float16")


def test_prefix_blocks_in_a_second_handle_need_their_own_reference() -> None:
    """On a kvbridge-allocated pool a handle owns one reference of each block. Publishing shared
    (prefix) blocks in a second handle without ``pool.ref`` was accepted, and ending the first
    handle freed them under the second (which then failed as stale, or read reused blocks)."""
    src, dst = KVPool.allocate(L, 8), KVPool.allocate(L, 8)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst) as rcv:
        prefix = src.alloc(2)
        a = snd.publish("a", prefix + src.alloc(1), 36)
        tail = src.alloc(1)
        with pytest.raises(PoolError, match="pool.ref"):
            snd.publish("b", prefix + tail, 36)
        assert [src.refcount(b) for b in prefix + tail] == [1, 1, 1]     # nothing taken, nothing freed
        src.ref(prefix)
        b = snd.publish("b", prefix + tail, 36)
        assert rcv.fetch(a, dst.alloc(3)).ok                          # a released: its reference goes
        assert wait_until(lambda: src.refcount(prefix[0]) == 1, 5)
        assert rcv.fetch(b, dst.alloc(3)).ok                          # b's blocks were not freed under it


def test_a_request_id_the_handle_cannot_carry_leaves_no_pin_and_no_lease(valkey_url: str) -> None:
    src = KVPool.allocate(L, 8, allocator="engine")
    with RedisLeaseStore(valkey_url) as ls, KVSender(src, "tcp://127.0.0.1:0", leases=ls) as snd:
        with pytest.raises(BadHandle):
            snd.publish("x" * (1 << 17), [1, 2], 24)
        assert src.refcount(1) == 0 and src.refcount(2) == 0
        assert [x for x in ls.list(snd.owner) if x.state.name in ("PUBLISHED", "CLAIMED")] == []   # revoked
    src = KVPool.allocate(L, 8, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        with pytest.raises(BadHandle):
            snd.publish("x" * (1 << 17), [1, 2], 24)
        assert src.refcount(1) == 0 and src.refcount(2) == 0


def test_block_ids_must_be_integers_not_rounded() -> None:
    src, dst = KVPool.allocate(L, 8, allocator="engine"), KVPool.allocate(L, 8, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst) as rcv:
        with pytest.raises(PoolError, match="integers"):
            snd.publish("f", [1.9, 2.2], 24)
        assert src.refcount(1) == 0 and src.refcount(2) == 0
        h = snd.publish("n", [np.int64(1), torch.tensor(2)], 24)      # numpy and tensor integers are ids
        assert h.block_ids == (1, 2)
        with pytest.raises(PoolError, match="integers"):
            rcv.fetch(h, [1.9, 2.9])
        for bad in ([1.9], ["1"], [True]):              # int(1.9) fetched the handle's block 1
            with pytest.raises(PoolError, match="integers"):
                rcv.fetch(h, [5], indices=bad)
            with pytest.raises(PoolError, match="integers"):
                rcv.start_fetch(h, [5], indices=bad)
        with pytest.raises(PoolError, match="integers"):
            rcv.fetch(h, [True, 5])
        assert rcv.fetch(h, [6], indices=[np.int64(1)], release=False).ok
        assert torch.equal(dst.buffers[0][:, 6], src.buffers[0][:, 2])
        assert rcv.fetch(h, [np.int32(4), 5]).ok


def test_a_destination_the_engine_retires_mid_fetch_is_a_cancel_not_a_call_to_fix() -> None:
    src, dst = KVPool.allocate(L, 4, allocator="engine"), KVPool.allocate(L, 4, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst) as rcv:
        h = snd.publish("p", [0, 1], 20, layers_ready=1)
        t = rcv.start_fetch(h, [2, 3])
        assert t.wait_layer(0, 5)
        dst.retire([3])
        snd.mark_ready(h, 3)
        res = t.result(10)
        assert isinstance(res.error, TransferCancelled) and res.action is Action.REPREFILL, repr(res.error)
        assert "freed or retired" in str(res.error)


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://", "inproc://retired-push"])
def test_a_reserved_block_the_engine_retires_mid_push_is_a_cancel_too(listen: str) -> None:
    """The same for a push: the reservation ended PoolError (FIX) where a pull ends
    TransferCancelled (REPREFILL), though nothing in the call was wrong."""
    src = KVPool.allocate(L, 4, allocator="engine")
    dst = KVPool.allocate(L, 4, allocator="engine", shared=listen.startswith("shm"))
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, listen=listen, leases=False) as rcv:
        rt = rcv.reserve([2, 3], "push-req")
        pt = snd.push(rt.reservation, [0, 1], layers_ready=1)
        assert rt.wait_layer(0, 5)
        dst.retire([3])
        snd.mark_ready(pt, 3)
        res = rt.result(10)
        assert isinstance(res.error, TransferCancelled) and res.action is Action.REPREFILL, repr(res.error)
        assert "freed or retired" in str(res.error) and res.failed_block_ids == [2, 3]
        assert pt.result(10) is not None and dst.landing() == []


def test_with_a_persistent_secret_a_handle_from_before_a_restart_is_not_found() -> None:
    from kvbridge.errors import HandleNotFound
    key = b"k" * 32
    src, dst = KVPool.allocate(L, 4, allocator="engine"), KVPool.allocate(L, 4, allocator="engine")
    first = KVSender(src, "tcp://127.0.0.1:0", leases=False, secret=key)
    h = first.publish("r", [1, 2], 20)
    first.close()
    with KVSender(src, first.url, leases=False, secret=key), KVReceiver(dst, leases=False, secret=key) as rcv:
        res = rcv.fetch(h, [0, 3])
    assert isinstance(res.error, HandleNotFound) and res.action is Action.REPREFILL, repr(res.error)


def test_counts_that_are_not_whole_numbers_are_refused_clearly() -> None:
    from kvbridge.errors import ConfigError, LayoutMismatch
    with pytest.raises(ConfigError, match="whole number"):
        KVPool.allocate(L, 2.5)                                          # type: ignore[arg-type]
    with pytest.raises(LayoutMismatch, match="no blocks"):
        KVPool.wrap(L, [torch.empty(L.buffer_shape(0)) for _ in range(L.num_layers)], allocator="engine")
    src = KVPool.allocate(L, 4, allocator="engine")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("m", [1], 12, layers_ready=1)
        with pytest.raises(ConfigError, match="whole number"):
            snd.mark_ready(h, 1.5)                                       # type: ignore[arg-type]
        assert snd.mark_ready(h, 2) is True
