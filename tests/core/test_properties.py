"""Property tests (hypothesis): handle encoding, layout offsets, wire frames, pool allocator."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbridge import BadHandle, KVHandle, KVLayout, KVPool, PoolError
from kvbridge.errors import FrameTooLarge, ProtocolError
from kvbridge.layout import KVOrder
from kvbridge.transports import wire

pytestmark = pytest.mark.timeout(60)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = b"k" * 32

# -- handles --------------------------------------------------------------------------------------
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=40)


@st.composite
def handles(draw, max_blocks: int = 64, checksums=None) -> KVHandle:
    ids = draw(st.lists(st.integers(0, 2**20), unique=True, max_size=max_blocks))
    n = len(ids)
    gens = draw(st.lists(u32, min_size=n, max_size=n))
    with_sums = draw(st.booleans()) if checksums is None else checksums
    sums = draw(st.lists(u64, min_size=n, max_size=n)) if with_sums and n else []
    kw = {}
    if "lease_url" in KVHandle.__dataclass_fields__:
        kw["lease_url"] = draw(st.sampled_from(["", "redis://127.0.0.1:6379/0"]))
    h = KVHandle(
        handle_id=draw(st.binary(min_size=16, max_size=16)), request_id=draw(text),
        layout_hash=draw(st.binary(min_size=8, max_size=8)).hex(),
        urls=tuple(draw(st.lists(st.sampled_from(["tcp://10.0.0.1:5000", "shm:///tmp/kvb.sock",
                                                  "inproc://sender-1", "ucx://[::1]:13337"]),
                                 max_size=3))),
        block_ids=tuple(ids), generations=tuple(gens), checksums=tuple(sums),
        num_tokens=draw(u32), codec=draw(st.sampled_from(["raw", "lz4", "fp8"])),
        token=draw(st.binary(min_size=16, max_size=16)), lease_id=draw(st.sampled_from(["", "ab" * 16])),
        fence_epoch=draw(u64), fence=draw(u64), expires_at_ms=draw(u64), **kw)
    return h.signed(KEY)


def _fields(h: KVHandle) -> tuple:
    return tuple(getattr(h, f) for f in KVHandle.__dataclass_fields__ if not f.startswith("_"))


@FAST
@given(handles())
def test_handle_bytes_round_trip(h):
    raw = h.to_bytes()
    back = KVHandle.from_bytes(raw, KEY)
    assert _fields(back) == _fields(h)
    assert back == h and back.to_bytes() == raw
    assert KVHandle.from_bytes(bytearray(raw)) == h and KVHandle.from_bytes(memoryview(raw)) == h


@FAST
@given(handles(), st.data())
def test_lease_digest_from_bytes_equals_the_encoded_one(h, data):
    """The lease digest a receiver takes from a parsed handle's bytes is the one its sender
    computed from the fields; with any lease fields, and none of them enters it."""
    from dataclasses import replace
    parsed = KVHandle.from_bytes(h.to_bytes())
    encoded = replace(h, mac=b"")                         # no bytes: the digest is encoded from the fields
    assert encoded._raw is None
    assert parsed.lease_digest() == encoded.lease_digest() == parsed.lease_digest()
    other = replace(h, lease_id=data.draw(st.sampled_from(["", "cd" * 16])), lease_url=data.draw(text),
                    fence_epoch=data.draw(u64), fence=data.draw(u64), expires_at_ms=data.draw(u64)).signed(KEY)
    assert KVHandle.from_bytes(other.to_bytes()).lease_digest() == parsed.lease_digest()
    moved = replace(h, num_tokens=(h.num_tokens + 1) % 2**32).signed(KEY)
    assert KVHandle.from_bytes(moved.to_bytes()).lease_digest() != parsed.lease_digest()


@FAST
@given(handles())
def test_handle_dict_round_trip(h):
    import json
    d = json.loads(json.dumps(h.to_dict()))
    back = KVHandle.from_dict(d, KEY)
    assert _fields(back) == _fields(h)
    assert d["num_blocks"] == h.num_blocks and d["request_id"] == h.request_id


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_handle_garbage_only_badhandle(data):
    try:
        KVHandle.from_bytes(data)
    except BadHandle:
        pass


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=10), st.one_of(st.integers(), st.text(max_size=10)), max_size=4)))
def test_handle_dict_garbage_only_badhandle(d):
    with pytest.raises(BadHandle):
        KVHandle.from_dict(d)
    with pytest.raises(BadHandle):
        KVHandle.from_dict({"kvbridge_handle": 1, "data": d if isinstance(d, str) else "!!"})


@FAST
@given(handles(max_blocks=16), st.data())
def test_handle_truncation_only_badhandle(h, data):
    raw = h.to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(BadHandle):
        KVHandle.from_bytes(raw[:cut])
    with pytest.raises(BadHandle):
        KVHandle.from_bytes(raw + data.draw(st.binary(min_size=1, max_size=8)), KEY)


@settings(max_examples=150, deadline=None)
@given(handles(max_blocks=16), st.data())
def test_handle_flip_never_verifies(h, data):
    raw = bytearray(h.to_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    try:
        parsed = KVHandle.from_bytes(bytes(raw))     # may parse: flips inside fields look valid
    except BadHandle:
        parsed = None
    with pytest.raises(BadHandle):
        KVHandle.from_bytes(bytes(raw), KEY)
    if parsed is not None:
        with pytest.raises(BadHandle):
            parsed.verify(KEY)


@settings(max_examples=20, deadline=None)
@given(handles(max_blocks=16), st.binary(min_size=1, max_size=64))
def test_handle_other_key_never_verifies(h, other):
    assume(other != KEY)
    with pytest.raises(BadHandle):
        KVHandle.from_bytes(h.to_bytes(), other)


@settings(max_examples=15, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([2**8 - 1, 2**16 - 1, 2**20, 2**32 - 1]))
def test_thousand_block_handle_is_small(rng, top):
    # 1,000 ids and generations drawn from a seeded RNG: hypothesis chooses the seed and the
    # value range (which sets the packed width), without generating 2,000 examples' worth of data.
    ids = rng.sample(range(2**20), 1000)
    gens = [rng.randint(0, top) for _ in range(1000)]
    h = KVHandle(os.urandom(16), "req-" + "x" * 60, "0" * 16,
                 ("tcp://10.11.12.13:45678", "shm:///tmp/kvb-123456-abcdef.sock"),
                 tuple(ids), tuple(gens), tuple(range(1000)), 16000, token=os.urandom(16),
                 lease_id="ab" * 16).signed(KEY)
    assert len(h.to_bytes()) < 16 * 1024
    assert KVHandle.from_bytes(h.to_bytes(), KEY).block_ids == tuple(ids)


# -- layouts ----------------------------------------------------------------------------------------
@st.composite
def layouts(draw) -> KVLayout:
    order = draw(st.sampled_from(list(KVOrder)))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32", "int8"]))
    layers, bs, dim = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    if order is KVOrder.LATENT:
        return KVLayout.mla(layers, dim, block_size=bs, dtype=dtype)
    return KVLayout(layers, draw(st.integers(1, 3)), dim, bs, dtype, order,
                    draw(st.sampled_from(["NHD", "HND"])))


def _part_views(pool: KVPool, layer: int, b: int) -> list[torch.Tensor]:
    v = pool.block(layer, b)
    return list(v) if isinstance(v, tuple) else [v]


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(1, 6))
def test_segments_match_torch_views(layout, nb):
    pool = KVPool.allocate(layout, nb)
    hv = pool.host_views()
    by_buf: dict[int, list[tuple[int, int]]] = {}
    val = 0
    for layer in range(layout.num_layers):
        for b in range(nb):
            views = _part_views(pool, layer, b)
            assert len(views) == layout.num_parts
            for part, view in enumerate(views):
                buf, off, n = layout.segment(layer, b, part, nb)
                assert buf == layout.buffer_index(layer, part) and 0 <= buf < layout.num_buffers
                assert n == layout.part_nbytes == view.numel() * view.element_size()
                assert 0 <= off and off + n <= len(hv[buf])
                assert view.data_ptr() == pool.buffers[buf].data_ptr() + off
                assert tuple(view.shape) == layout.part_shape
                # write a distinct value through the torch view, read it back at the segment
                val += 1
                pattern = torch.full((n,), val % 251 + 1, dtype=torch.uint8)
                assert view.is_contiguous()
                view.view(-1).view(torch.uint8).copy_(pattern)
                assert bytes(hv[buf][off:off + n]) == bytes([val % 251 + 1]) * n
                by_buf.setdefault(buf, []).append((off, n))
    # distinct, non-overlapping, and together exactly the buffers
    for buf, segs in by_buf.items():
        segs.sort()
        for (o1, n1), (o2, _) in zip(segs, segs[1:]):
            assert o1 + n1 <= o2
        assert sum(n for _, n in segs) == len(hv[buf])
    assert set(by_buf) == set(range(layout.num_buffers))
    # every part kept the value written last for it (no write clobbered another part)
    val = 0
    for layer in range(layout.num_layers):
        for b in range(nb):
            for part in range(layout.num_parts):
                val += 1
                buf, off, n = layout.segment(layer, b, part, nb)
                assert bytes(hv[buf][off:off + n]) == bytes([val % 251 + 1]) * n


def test_segment_array_takes_what_segments_takes():
    L = KVLayout.vllm_flash(3, 2, 8, 4, dtype="float16")
    # any iterable of layers, as segments() takes, not only a range
    assert [tuple(r) for r in L.segment_array([1, 2], 8, [2, 0]).tolist()] == list(L.segments([1, 2], 8, [2, 0]))
    assert [tuple(r) for r in L.segment_array([3], 8, (1,)).tolist()] == list(L.segments([3], 8, (1,)))
    with pytest.raises(IndexError, match="outside a pool of 8 blocks"):
        L.segment_array([1, 2**64], 8)                         # past int64: refused as any id outside


def _expand(segs) -> list[tuple[int, int, int]]:
    """Merge adjacent per-part segments into maximal runs (the reference for segments())."""
    merged: list[list[int]] = []
    for buf, off, n in segs:
        if merged and merged[-1][0] == buf and merged[-1][1] + merged[-1][2] == off:
            merged[-1][2] += n
        else:
            merged.append([buf, off, n])
    return [tuple(m) for m in merged]


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(1, 12), st.data())
def test_segments_merge(layout, nb, data):
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    merged = list(layout.segments(ids, nb))
    per_part = [layout.segment(layer, b, part, nb)
                for layer in range(layout.num_layers) for part in range(layout.num_parts) for b in ids]
    # the runs cover exactly the canonical byte stream, in order
    stream_a = [(buf, off + k) for buf, off, n in merged for k in range(n)]
    stream_b = [(buf, off + k) for buf, off, n in per_part for k in range(n)]
    assert stream_a == stream_b
    assert merged == _expand(per_part)          # maximal: adjacent runs never left unmerged
    for (b1, o1, n1), (b2, o2, _) in zip(merged, merged[1:]):
        assert not (b1 == b2 and o1 + n1 == o2)


@settings(max_examples=80, deadline=None)
@given(layouts(), st.integers(1, 12), st.data())
def test_segment_array_equals_segments(layout, nb, data):
    """The array form (device copies' plans) is the list form, piece for piece, for any block
    order, runs of neighbours and layer range; a block outside the pool is refused alike."""
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    if data.draw(st.booleans()) and ids:                  # runs of neighbours, the usual shape
        ids = list(range(ids[0], min(nb, ids[0] + len(ids))))
    lo = data.draw(st.integers(0, layout.num_layers))
    layers = data.draw(st.sampled_from([None, range(lo, layout.num_layers), range(0, lo)]))
    want = list(layout.segments(ids, nb, layers))
    got = layout.segment_array(ids, nb, layers)
    assert got.dtype == np.int64 and got.shape == (len(want), 3)
    assert [tuple(r) for r in got.tolist()] == want
    bad = data.draw(st.sampled_from([-1, nb]))
    with pytest.raises(IndexError, match=f"block {bad} outside a pool of {nb} blocks"):
        layout.segment_array(ids + [bad], nb, layers)
    with pytest.raises(IndexError, match=f"block {bad} outside a pool of {nb} blocks"):
        list(layout.segments(ids + [bad], nb, layers))


# -- wire ---------------------------------------------------------------------------------------------
_layers = st.tuples(st.integers(0, 0xFFFE), st.integers(1, 0xFFFF)).filter(lambda t: t[0] < t[1])
_claims = st.builds(wire.Claim, st.text(max_size=40), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.lists(u32, max_size=50)),
       st.one_of(st.none(), _claims), st.one_of(st.none(), _layers), st.booleans(),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.lists(st.integers(0, 2**64 - 1), max_size=20))
def test_request_frame_round_trip(hb, idx, claim, layers, last, nbytes, sums):
    packed = wire.encode_request(hb, idx, claim, layers, last=last, nbytes=nbytes,
                                 sums=b"".join(s.to_bytes(8, "big") for s in sums) if nbytes is not None else b"")
    out = wire.decode_request(packed)
    assert out.ticket == hb and out.indices == idx and out.claim == claim and out.layers == layers
    assert out.last == last and out.nbytes == (nbytes or 0)
    assert out.sums == (b"".join(s.to_bytes(8, "big") for s in sums) if nbytes is not None else b"")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_request_frame_garbage_only_protocol_error(payload):
    try:
        out = wire.decode_request(payload)
    except ProtocolError:
        return
    assert isinstance(out.ticket, bytes)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=16, max_size=16))
def test_unpack_header_random(head):
    try:
        kind, rid, length = wire.unpack_header(head)
    except (ProtocolError, FrameTooLarge):
        return
    assert isinstance(kind, wire.Kind) and head[:2] == b"KB" and 0 <= rid < 2**32
    assert kind in (wire.Kind.DATA, wire.Kind.LDATA) or length <= wire.MAX_CONTROL


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(wire.Kind)), u32, st.binary(max_size=64))
def test_pack_unpack_header(kind, rid, payload):
    frame = wire.pack(kind, rid, payload)
    assert wire.unpack_header(frame[:16]) == (kind, rid, len(payload)) and frame[16:] == payload


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_decode_error_random(payload):
    err = wire.decode_error(payload)
    assert err.code >= 1 and isinstance(err.message, str)


# -- pool allocator -------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.sampled_from(["alloc", "ref", "free"]),
                                              st.lists(st.integers(0, 11), max_size=4),
                                              st.integers(0, 4)), max_size=40))
def test_pool_allocator_model(nb, ops):
    pool = KVPool.allocate(KVLayout.mla(1, 1, block_size=1, dtype="uint8"), nb)
    refs = [0] * nb
    gens = [0] * nb
    freed_cb: list[list[int]] = []
    pool.on_free.append(lambda ids: freed_cb.append(list(ids)))
    for op, ids, n in ops:
        live = [b for b in range(nb) if refs[b] > 0]
        # mostly name live blocks (so ref/free succeed), sometimes any block
        ids = [live[b % len(live)] if live and b % 3 else b % nb for b in ids]
        cnt = Counter(ids)
        if op == "alloc":
            if n > refs.count(0):
                with pytest.raises(PoolError):
                    pool.alloc(n)
            else:
                got = pool.alloc(n)
                assert len(got) == len(set(got)) == n and all(refs[b] == 0 for b in got)
                for b in got:
                    refs[b] = 1
        elif op == "ref":
            if any(refs[b] == 0 for b in cnt):
                with pytest.raises(PoolError):
                    pool.ref(ids)
            else:
                pool.ref(ids)
                for b in ids:
                    refs[b] += 1
        else:
            before = list(freed_cb)
            if any(refs[b] < c for b, c in cnt.items()):
                with pytest.raises(PoolError):       # double free, also within one call
                    pool.free(ids)
                assert freed_cb == before
            else:
                out = pool.free(ids)
                expect = []
                for b in ids:
                    refs[b] -= 1
                    if refs[b] == 0:
                        gens[b] += 1
                        expect.append(b)
                assert out == expect
                if expect:
                    assert freed_cb[-1] == expect
        assert [pool.refcount(b) for b in range(nb)] == refs
        assert pool.generations(range(nb)) == gens
        assert pool.num_free == refs.count(0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3))
def test_pool_free_with_repeated_id_is_a_double_free(refs, extra):
    """free([b] * k) with k > refcount(b) must raise PoolError and change nothing."""
    pool = KVPool.allocate(KVLayout.mla(1, 1, block_size=1, dtype="uint8"), 4)
    (b,) = pool.alloc(1)
    pool.ref([b] * (refs - 1))
    assert pool.refcount(b) == refs
    with pytest.raises(PoolError):
        pool.free([b] * (refs + extra))
    assert pool.refcount(b) == refs and pool.generation(b) == 0 and pool.num_free == 3
