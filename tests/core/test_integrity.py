"""Checksums computed as bytes land equal checksums computed afterwards, however the bytes arrive."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from kvbridge import KVLayout, KVPool
from kvbridge.integrity import StreamVerifier, block_checksums

LAYOUTS = [KVLayout.vllm_flash(3, 2, 8, 4, dtype="float32"), KVLayout.flashinfer(2, 1, 8, 4, hnd=True),
           KVLayout.split_kv(2, 2, 4, 2, dtype="float16"), KVLayout.mla(2, 16, 4)]


@settings(max_examples=150, deadline=None)
@given(which=st.sampled_from(range(len(LAYOUTS))), data=st.data())
def test_stream_verifier_matches_block_checksums(which, data):
    layout = LAYOUTS[which]
    pool = KVPool.allocate(layout, 12)
    g = torch.Generator().manual_seed(which)
    for b in pool.buffers:
        b.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (b.numel() * b.element_size(),),
                                                         generator=g, dtype=torch.uint8))
    ids = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True))
    v = StreamVerifier(pool, ids)
    steps = data.draw(st.lists(st.integers(1, 3 * layout.part_nbytes), min_size=1, max_size=60))
    pos = 0
    for step in steps:
        pos = min(v.total, pos + step)
        v.advance(pos)
    v.advance(v.total)
    assert v.complete
    assert v.digests() == block_checksums(pool, ids)
    # a retried stream starts over and ends with the same digests
    v.reset()
    v.advance(v.total)
    assert v.digests() == block_checksums(pool, ids)


def test_stream_verifier_sees_a_flipped_byte():
    layout = LAYOUTS[0]
    pool = KVPool.allocate(layout, 4)
    want = block_checksums(pool, [1, 2])
    pool.block(2, 2)[1].view(-1)[3] = 1.5
    v = StreamVerifier(pool, [1, 2])
    v.advance(v.total)
    got = v.digests()
    assert got[0] == want[0] and got[1] != want[1]


def test_checksums_are_each_parts_digest_combined():
    """The definition, spelled out independently (``_pools.checksum_of``): a block's checksum is
    the xxh3-64 of its parts' xxh3-64 digests in (layer, part) order; a (layer, block)'s covers
    that layer's parts. block_checksums, layer_checksums and the stream verifier (whole and per
    layer) all give it, for every layout family."""
    from kvbridge.integrity import layer_checksums
    from ._pools import checksum_of
    for layout in LAYOUTS:
        pool = KVPool.allocate(layout, 6)
        g = torch.Generator().manual_seed(5)
        for b in pool.buffers:
            b.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (b.numel() * b.element_size(),),
                                                             generator=g, dtype=torch.uint8))
        views, ids = pool.host_views(), [4, 1, 5]

        def part(layer: int, b: int, p: int) -> bytes:
            buf, off, n = layout.segment(layer, b, p, pool.num_blocks)
            return bytes(views[buf][off:off + n])
        whole = [checksum_of(part(layer, b, p) for layer in range(layout.num_layers) for p in range(layout.num_parts))
                 for b in ids]
        per_layer = [checksum_of(part(layer, b, p) for p in range(layout.num_parts))
                     for layer in range(layout.num_layers) for b in ids]
        assert block_checksums(pool, ids) == whole
        assert layer_checksums(pool, ids, range(layout.num_layers)) == per_layer
        for flag, want in ((False, whole), (True, per_layer)):
            v = StreamVerifier(pool, ids, per_layer=flag)
            v.advance(v.total)
            assert v.digests() == want, (layout, flag)
