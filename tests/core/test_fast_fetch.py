"""The usual fetch's short path: destination ids checked and snapshotted in one call
(``blockcopy.dst_snapshot``, C and Python twin), private host pools on page boundaries (so a
copy out of a shared pool keeps the same offset within a page on both sides), and the
pipeline's precise errors for every destination the short path does not take."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, PoolError, blockcopy
from kvbridge.integrity import block_checksums
from kvbridge.layout import KVOrder

pytestmark = pytest.mark.timeout(60)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids_item = st.one_of(st.integers(-3, 12), st.integers(2**62, 2**70), st.booleans(), st.floats(0, 4),
                     st.just(None), st.text(max_size=1))


@FAST
@given(items=st.lists(ids_item, max_size=40), as_tuple=st.booleans(), nblocks=st.integers(0, 10),
       n_delta=st.integers(-1, 1))
def test_dst_snapshot_equals_its_twin(items, as_tuple, nblocks, n_delta):
    gens = [1000 + 7 * b for b in range(nblocks)]
    ids = tuple(items) if as_tuple else list(items)
    n = max(0, len(items) + n_delta)
    want = blockcopy.py_dst_snapshot(ids, gens, n)
    ok = (n == len(items) and all(type(b) is int and 0 <= b < nblocks for b in items)
          and len(set(items)) == len(items))
    assert (want is not None) == ok
    if want is not None:
        assert want == (list(items), [gens[b] for b in items])
        assert want[0] is not ids
    if blockcopy.NATIVE:
        got = blockcopy._native.dst_snapshot(ids, gens, n)
        assert got == want
        if got is not None:
            assert type(got[0]) is list and got[0] is not ids


def test_dst_snapshot_sees_duplicates_among_many_ids():
    """Past 32 ids the C twin sorts a copy to find duplicates: one pair anywhere is found."""
    gens = list(range(5000))
    ids = list(range(0, 4000, 3))
    for dup_at in (0, 33, len(ids) - 1):
        bad = ids + [ids[dup_at]]
        assert blockcopy.dst_snapshot(bad, gens, len(bad)) is None
        assert blockcopy.py_dst_snapshot(bad, gens, len(bad)) is None
    assert blockcopy.dst_snapshot(ids, gens, len(ids)) == (ids, ids)


@pytest.mark.parametrize("order", list(KVOrder))
def test_private_host_pools_start_on_a_page(order):
    layout = KVLayout(num_layers=3, num_kv_heads=1 if order is KVOrder.LATENT else 2, head_dim=32, block_size=4,
                      kv_order=order)
    for zero in (True, False):
        pool = KVPool.allocate(layout, 5, zero=zero)
        assert pool.buffers and all(b.data_ptr() % 4096 == 0 for b in pool.buffers)
        assert all(b.is_contiguous() and tuple(b.shape) == layout.buffer_shape(5) for b in pool.buffers)
        if zero:
            assert all(not b.any() for b in pool.buffers)
        last = pool.buffers[-1].view(-1).view(torch.uint8)
        assert last.numel() == math.prod(layout.buffer_shape(5)) * layout.itemsize
        last[-1] = 7                                          # the last byte is the pool's own
        assert int(last[-1]) == 7


@pytest.mark.parametrize("scheme", ["shm://", "tcp://127.0.0.1:0"])
def test_destinations_the_short_path_does_not_take(scheme):
    """Bad destination ids are refused with the pipeline's own errors, before anything is read;
    ids the short path does not take (numpy-like ints, a range) go the long way and land."""
    layout = KVLayout.vllm_flash(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4)
    src = KVPool.allocate(layout, 8, shared=True)
    dst = KVPool.allocate(layout, 8)
    with KVSender(src, scheme, leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        ids = src.alloc(2)
        for t in src.buffers:
            raw = t.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
        before = [bytes(t.view(torch.uint8).numpy()) for t in dst.buffers]
        def handle() -> KVHandle:      # each handle takes its own reference: a release frees only its own
            src.ref(ids)
            return snd.publish("r", ids, 8)
        for bad, says in (([3, 3], "duplicate"), ([1, 8], "8"), ([1], "2 blocks"), ([-1, 2], "-1")):
            with pytest.raises(PoolError, match=says):
                rcv.fetch(handle(), bad)
        assert [bytes(t.view(torch.uint8).numpy()) for t in dst.buffers] == before
        for other in (torch.tensor([4, 5]).tolist(), range(4, 6), [torch.tensor(4), torch.tensor(5)], (4, 5)):
            res = rcv.fetch(handle(), other)
            assert res.ok and res.dst_block_ids == [4, 5], (other, res.error)
            assert block_checksums(dst, [4, 5]) == block_checksums(src, ids)
            dst.buffers[0].zero_()
