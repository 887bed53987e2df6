"""Device pools through host transports: the staging ring, row gathers and checksums, on the CPU.

A pool with ``_staged = True`` is not host-addressable to the transports, exactly as a
CUDA pool is, so tcp/shm/inproc take the staged path (device -> ring -> wire -> ring ->
device) with synchronous copies. The GPU only changes the copies to async + events.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import IntegrityError, KVLayout, KVPool, KVReceiver, KVSender, integrity
from kvbridge import receiver_pipeline as pipeline_mod
from kvbridge.transports import Spans, inproc, shm, socket_server, staging, tcp

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
    for mod, name in [(socket_server, "send_staged"), (tcp, "recv_staged"), (inproc, "copy_slices"),
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
        assert len(h.checksums) == 9                       # device pools publish checksums too
        out = random.Random(2).sample(range(40), 9)
        res = rcv.fetch(h, out)
        assert res.ok, res.error
        assert res.nbytes == 9 * LAYOUT.block_nbytes
        assert _same(src, ids, dst, out)
    want = {("tcp", "sender"): ["socket_server.send_staged"], ("tcp", "receiver"): ["tcp.recv_staged"],
            ("tcp", "both"): ["socket_server.send_staged", "tcp.recv_staged"]}.get(
        (listen.split(":")[0], staged_side), [f"{listen.split(':')[0]}.copy_slices"])
    assert sorted(set(calls)) == sorted(want), calls     # the staged path was the one taken


@pytest.mark.timeout(30)
def test_slots_cover_the_stream_once():
    mixed = [(0, 0, 3), (1, 8, 10), (0, 5, 1), (2, 0, 7)]
    slots = staging.plan_slots(mixed, 4)
    assert [fill for _, fill in slots] == [4, 4, 4, 4, 4, 1]
    assert sum(n for pieces, _ in slots for _, _, n in pieces) == 21
    uniform = [(0, 64 * i, 64) for i in (5, 1, 9, 3, 7)]
    slots = staging.plan_slots(uniform, 150)            # rounded down to 128: no piece split
    assert [fill for _, fill in slots] == [128, 128, 64]
    assert all(n == 64 for pieces, _ in slots for _, _, n in pieces)


def _slots_by_hand(segments, chunk):
    """The reference for plan_slots: piece by piece, cut at every ``chunk`` bytes of the stream."""
    sizes = {n for _, _, n in segments if n}
    if len(sizes) == 1 and min(sizes) <= chunk:
        chunk -= chunk % min(sizes)
    slots, cur, fill = [], [], 0
    for b, o, n in segments:
        pos = 0
        while pos < n:
            k = min(n - pos, chunk - fill)
            cur.append((b, o + pos, k))
            fill, pos = fill + k, pos + k
            if fill == chunk:
                slots.append((cur, fill))
                cur, fill = [], 0
    if cur:
        slots.append((cur, fill))
    return slots


@pytest.mark.timeout(60)
@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 300)), max_size=40),
       st.integers(1, 700), st.booleans())
def test_slots_equal_a_piece_by_piece_cut(segments, chunk, as_array):
    """The vectorized plan is the piece-by-piece one, slot for slot, from tuples or an array."""
    got = staging.plan_slots(np.asarray(segments, dtype=np.int64).reshape(-1, 3) if as_array else segments, chunk)
    want = _slots_by_hand(segments, chunk)
    assert [(p.tolist(), f) for p, f in got] == [([list(x) for x in p], f) for p, f in want]


def _pieces(draw, sizes, total, align):
    """Pieces (buffer, offset, n) of the given buffers summing to ``total`` bytes."""
    out, left = [], total
    while left:
        b = draw(st.integers(0, len(sizes) - 1))
        n = min(left, draw(st.sampled_from([align, 2 * align, 3 * align, 1, 5])))
        off = draw(st.integers(0, (sizes[b] - n) // align)) * align
        out.append((b, off, n))
        left -= n
    return out


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_copy_pieces_matches_a_byte_loop(data):
    """Row gathers of any piece lists (aligned or not, overlapping sources) equal a plain byte copy."""
    align = data.draw(st.sampled_from([1, 2, 8, 64]))
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (512, 300, 1024)]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in (640, 512)]
    total = data.draw(st.integers(0, 256))
    sp = _pieces(data.draw, [t.numel() for t in src], total, align)
    dp = []
    used = [set(), set()]
    while sum(n for _, _, n in dp) < total:      # destination pieces must not overlap
        b = data.draw(st.integers(0, 1))
        n = min(total - sum(n for _, _, n in dp), data.draw(st.sampled_from([align, 2 * align, 3, 7])))
        off = data.draw(st.integers(0, (dst[b].numel() - n) // align)) * align
        if used[b] & set(range(off, off + n)):
            continue
        used[b] |= set(range(off, off + n))
        dp.append((b, off, n))
    want = [t.clone() for t in dst]
    stream = b"".join(bytes(src[b][o:o + n].tolist()) for b, o, n in sp)
    pos = 0
    for b, o, n in dp:
        want[b][o:o + n] = torch.tensor(list(stream[pos:pos + n]), dtype=torch.uint8)
        pos += n
    assert staging.copy_pieces(dst, dp, src, sp) == total
    assert all(torch.equal(a, b) for a, b in zip(dst, want))


@pytest.mark.timeout(30)
def test_staging_gathers_per_buffer_not_per_piece(monkeypatch):
    """A block-shaped handle: each slot is one gather per pool buffer it spans, not one copy per block."""
    pool = KVPool.allocate(LAYOUT, 64)
    _fill(pool, list(range(64)), 3)
    pool._staged = True
    ids = random.Random(5).sample(range(64), 40)
    spans = Spans.of_blocks(pool, ids)
    runs: list[int] = []
    real = staging._copy_run
    monkeypatch.setattr(staging, "_copy_run", lambda run, s, d: (runs.append(len(run.pieces)), real(run, s, d)))
    got = bytearray()
    ring = staging.StagingRing(chunk=16 * LAYOUT.part_nbytes)
    assert staging.stage_out(spans, ring, lambda v: got.extend(v)) == spans.nbytes
    pieces = len(spans.segments)
    assert len(runs) <= -(-spans.nbytes // ring.chunk) + LAYOUT.num_buffers and len(runs) < pieces / 4
    flats = staging.flat_buffers(pool.buffers)
    assert bytes(got) == b"".join(bytes(flats[b][o:o + n].numpy()) for b, o, n in spans.segments)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk", [staging.STAGE_CHUNK, 3000, 64])
def test_device_pool_checksums_equal_host_checksums(chunk, monkeypatch):
    """The staged-bytes checksums of a device pool are the host definition, at any slot size."""
    monkeypatch.setattr(staging, "RINGS", staging.RingPool(chunk))
    for layout in (LAYOUT, KVLayout.split_kv(2, 2, 4, block_size=4, dtype="bfloat16"),
                   KVLayout.mla(3, 16, block_size=4, dtype="bfloat16")):
        pool = KVPool.allocate(layout, 30)
        g = torch.Generator().manual_seed(1)
        for b in pool.buffers:
            b.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (b.numel() * b.element_size(),),
                                                             dtype=torch.uint8, generator=g))
        ids = [7, 8, 9, 2, 29, 0, 15]
        host = integrity.block_checksums(pool, ids), integrity.layer_checksums(pool, ids, range(1, layout.num_layers))
        pool._staged = True
        assert (integrity.block_checksums(pool, ids),
                integrity.layer_checksums(pool, ids, range(1, layout.num_layers))) == host


@pytest.mark.timeout(60)
def test_staged_receiver_hashes_in_the_slot_and_catches_corruption(monkeypatch):
    """Over tcp a device-pool receiver verifies the bytes in the host slot they land in (it never
    reads the pool back on a clean fetch) and refuses corrupted blocks like a host pool."""
    monkeypatch.setattr(staging, "STAGE_CHUNK", 5000)
    src = KVPool.allocate(LAYOUT, 40)
    dst = KVPool.allocate(LAYOUT, 40)
    src.alloc(40)
    dst._staged = True
    ids = random.Random(6).sample(range(40), 9)
    _fill(src, ids, 9)

    def no_readback(*a, **k):
        raise AssertionError("the receiver read the device pool back instead of hashing the slot")
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        src.ref(ids)                                       # a second handle of the same blocks
        h = snd.publish("bad", ids, 9 * 8)
        with monkeypatch.context() as m:
            m.setattr(pipeline_mod, "block_checksums", no_readback)
            res = rcv.fetch(snd.publish("clean", ids, 9 * 8), list(range(9)))
        assert res.ok, res.error
        src.block(1, ids[4])[0].view(-1).view(torch.uint8)[3] ^= 0xFF
        res = rcv.fetch(h, list(range(10, 19)))
        assert isinstance(res.error, IntegrityError), repr(res.error)
        assert res.failed_block_ids == [14]


@pytest.mark.timeout(30)
def test_verifier_consume_equals_advance():
    pool = KVPool.allocate(LAYOUT, 20)
    _fill(pool, list(range(20)), 4)
    ids = [3, 4, 11, 0]
    spans = Spans.of_blocks(pool, ids)
    stream = b"".join(bytes(v) for v in spans.views())
    for per_layer in (False, True):
        a = integrity.StreamVerifier(pool, ids, per_layer=per_layer)
        a.advance(len(stream))
        b = integrity.StreamVerifier(pool, ids, per_layer=per_layer)
        for k in range(0, len(stream), 999):
            b.consume(memoryview(stream)[k:k + 999])
        assert b.complete and a.digests() == b.digests()


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
        h = snd.publish("cuda", ids, 9 * 8)
        assert len(h.checksums) == 9
        res = rcv.fetch(h, out)
        assert res.ok, res.error
        assert _same(src, ids, dst, out)
