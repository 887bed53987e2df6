"""nvlink:// and device-pool checksums on a CUDA device: two processes, one GPU (peer GPUs use
the same code). Skipped here without a CUDA device and CuPy; ``python -m bench.gpu`` runs them."""

from __future__ import annotations

import base64
import importlib.util
import random

import pytest
import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, integrity
from kvbridge.transports import nvlink

from ._peer import RemotePeer, fill_pool, mismatched_blocks, reference_pool

_MISSING = [w for w, ok in [("a CUDA device", torch.cuda.is_available()),
                            ("CuPy (pip install 'kvbridge[cupy]')", importlib.util.find_spec("cupy") is not None)]
            if not ok]
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(bool(_MISSING), reason="needs " + " and ".join(_MISSING))]
LAYOUT = KVLayout.vllm_flash(4, 8, 128, 16, dtype="bfloat16")    # 32 KiB parts


def test_exports_name_the_allocation_base_and_the_offset_in_it():
    """What a peer maps: the IPC handle of the whole allocation, and where the buffer sits in it
    (PyTorch's caching allocator carves small tensors out of larger segments)."""
    whole = torch.zeros(6 << 20, dtype=torch.uint8, device="cuda")
    view = whole[(1 << 20) + 512:]
    base, size = nvlink._allocation_range(whole.data_ptr())
    assert base <= whole.data_ptr() and nvlink._allocation_range(view.data_ptr())[0] == base
    assert base + size >= whole.data_ptr() + whole.numel()
    ex = nvlink._Exports()
    try:
        e = ex.get(view)
        assert len(e.ipc) == 64 and any(e.ipc)
        assert e.offset == view.data_ptr() - base and e.offset >= (1 << 20) + 512
        eid, handle = ex.record(view.device)
        assert len(eid) == 16 and len(handle) == 64 and any(handle)
        assert ex.record(view.device) == (eid, handle)         # one interprocess event per device
    finally:
        ex.close()


def test_cross_process_fetch_maps_each_buffer_once():
    peer = RemotePeer()
    try:
        info = peer.new_sender(layout=LAYOUT.to_dict(), num_blocks=64, listen="nvlink://", seed=5)
        ref = reference_pool(LAYOUT, 64, 5)
        pool = KVPool.allocate(LAYOUT, 64, device="cuda")
        with KVReceiver(pool) as rcv:
            for k in range(3):    # a released handle's blocks go back to the sender's free list
                ids = peer.alloc(sid=info["sid"], n=16)
                random.Random(k).shuffle(ids)
                dst = random.Random(k + 10).sample(range(64), 16)
                h = KVHandle.from_bytes(base64.b64decode(peer.publish(
                    sid=info["sid"], request_id=f"r{k}", block_ids=ids, num_tokens=16 * 16)))
                assert len(h.checksums) == 16
                res = rcv.fetch(h, dst)
                assert res.ok, res.error
                assert mismatched_blocks(pool, dst, ref, ids) == []
            tr = rcv.transport(info["url"])
            assert tr.extra("ipc_opened") == LAYOUT.num_buffers      # opened once per (sender, buffer)
    finally:
        peer.close()


def test_a_peer_cannot_name_bytes_past_its_cuda_allocation(monkeypatch):
    """The offset and size a MAPPED gives for an export are held to the opened allocation's own
    size (cuMemGetAddressRange), not only to the sizes the same peer declared."""
    real = nvlink._parse_mapped

    def lying(body, pos, local):         # the peer says its buffers reach 1 GiB further
        m, runs = real(body, pos, local)
        m.buffers = [(e, h, o, n + (1 << 30)) for e, h, o, n in m.buffers]
        return m, runs
    monkeypatch.setattr(nvlink, "_parse_mapped", lying)
    peer = RemotePeer()
    try:
        info = peer.new_sender(layout=LAYOUT.to_dict(), num_blocks=8, listen="nvlink://", seed=5, reserve_all=True)
        with KVReceiver(KVPool.allocate(LAYOUT, 8, device="cuda")) as rcv:
            h = KVHandle.from_bytes(base64.b64decode(peer.publish(
                sid=info["sid"], request_id="r", block_ids=[0, 1], num_tokens=32)))
            res = rcv.fetch(h, [0, 1])
            assert not res.ok and "CUDA allocation" in str(res.error)
    finally:
        peer.close()


def test_cross_process_push_writes_into_the_reserved_blocks():
    """Push: this process listens on nvlink:// and reserves; the sender process maps this
    pool's buffers and writes; the layers' checksums are verified here."""
    peer = RemotePeer()
    try:
        info = peer.new_sender(layout=LAYOUT.to_dict(), num_blocks=64, listen="nvlink://", seed=7, reserve_all=True)
        ref = reference_pool(LAYOUT, 64, 7)
        pool = KVPool.allocate(LAYOUT, 64, device="cuda")
        with KVReceiver(pool, leases=False, listen="nvlink://") as rcv:
            ids = random.Random(21).sample(range(64), 12)
            dst = random.Random(22).sample(range(64), 12)
            resv = rcv.reserve(dst)
            push_id = peer.push(sid=info["sid"], reservation=base64.b64encode(resv.reservation.to_bytes()).decode(),
                                block_ids=ids)
            got = peer.push_result(push_id=push_id, timeout=20.0)
            assert got["ok"], got
            res = resv.result(20)
            assert res.ok, res.error
            assert mismatched_blocks(pool, dst, ref, ids) == []
    finally:
        peer.close()


def test_device_checksums_equal_host_checksums_on_cuda():
    host = KVPool.allocate(LAYOUT, 64)
    fill_pool(host, 3)
    dev = KVPool.allocate(LAYOUT, 64, device="cuda")
    for a, b in zip(dev.buffers, host.buffers):
        a.copy_(b)
    ids = random.Random(1).sample(range(64), 20)
    assert integrity.block_checksums(dev, ids) == integrity.block_checksums(host, ids)
    assert integrity.layer_checksums(dev, ids, range(1, 3)) == integrity.layer_checksums(host, ids, range(1, 3))
