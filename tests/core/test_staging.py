"""Device pools through host transports: the staging ring, exercised on the CPU.

A pool with ``_staged = True`` is not host-addressable to the transports, exactly as a
CUDA pool is, so tcp/shm/inproc take the staged path (device -> ring -> wire -> ring ->
device) with synchronous copies. The GPU only changes the copies to async + events.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.transports import inproc, shm, sockets, staging, tcp

LAYOUT = KVLayout.vllm_flash(3, 2, 64, 8, dtype="float16")   # part = 2 KiB


def _fill(pool: KVPool, ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        for b in ids:
            for part in pool.block(layer, b):
                part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))


def _same(a: KVPool, a_ids: list[int], b: KVPool, b_ids: list[int]) -> bool:
    return all(torch.equal(x, y) for layer in range(LAYOUT.num_layers) for i, j in zip(a_ids, b_ids)
               for x, y in zip(a.block(layer, i), b.block(layer, j)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://", "shm://"])
@pytest.mark.parametrize("staged_side", ["sender", "receiver", "both"])
def test_staged_pools_move_exact_bytes(listen, staged_side, monkeypatch):
    monkeypatch.setattr(staging, "STAGE_CHUNK", 5000)    # many slots, odd boundaries
    calls: list[str] = []
    for mod, name in [(sockets, "send_staged"), (tcp, "recv_staged"), (inproc, "copy_slices"),
                      (shm, "copy_slices")]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=f"{mod.__name__.rsplit('.', 1)[1]}.{name}":
                            (calls.append(_n), _r(*a))[1])
    if listen == "shm://" and staged_side != "receiver":
        pytest.skip("an shm sender's pool lives in host shared memory")
    src = KVPool.allocate(LAYOUT, 40, shared=listen == "shm://")
    dst = KVPool.allocate(LAYOUT, 40)
    src._staged = staged_side in ("sender", "both")
    dst._staged = staged_side in ("receiver", "both")
    src.alloc(40)
    ids = random.Random(1).sample(range(40), 9)
    _fill(src, ids, 7)
    with KVSender(src, listen, leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("staged", ids, 9 * 8)
        assert (len(h.checksums) == 0) == src._staged     # device pools publish without checksums
        out = random.Random(2).sample(range(40), 9)
        res = rcv.fetch(h, out)
        assert res.ok, res.error
        assert res.nbytes == 9 * LAYOUT.block_nbytes
        assert _same(src, ids, dst, out)
    want = {("tcp", "sender"): ["sockets.send_staged"], ("tcp", "receiver"): ["tcp.recv_staged"],
            ("tcp", "both"): ["sockets.send_staged", "tcp.recv_staged"]}.get(
        (listen.split(":")[0], staged_side), [f"{listen.split(':')[0]}.copy_slices"])
    assert sorted(set(calls)) == sorted(want), calls     # the staged path was the one taken


@pytest.mark.timeout(30)
def test_ring_groups_cover_the_stream_once():
    slices = [torch.arange(n, dtype=torch.uint8) for n in (3, 10, 1, 7)]
    groups = staging._groups(slices, 4)
    assert [fill for _, fill in groups] == [4, 4, 4, 4, 4, 1]
    assert sum(p.numel() for g, _ in groups for p, _ in g) == 21


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "inproc://"])
def test_cuda_pools_move_exact_bytes(listen):
    src = KVPool.allocate(LAYOUT, 40, device="cuda")
    dst = KVPool.allocate(LAYOUT, 40, device="cuda")
    src.alloc(40)
    ids = random.Random(3).sample(range(40), 9)
    _fill(src, ids, 11)
    with KVSender(src, listen, leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        out = random.Random(4).sample(range(40), 9)
        res = rcv.fetch(snd.publish("cuda", ids, 9 * 8), out)
        assert res.ok, res.error
        assert _same(src, ids, dst, out)
