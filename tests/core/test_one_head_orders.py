"""One KV head per rank: an NHD pool and an HND pool hold a part's bytes in the same order, so
they exchange blocks -- raw over every transport, and through every codec (whose frames carry the
sender's token order and are written in the receiver's) -- while two heads stay refused."""

from __future__ import annotations

import pytest
import torch

from kvbridge import KVLayout, LayoutMismatch
from kvbridge.codecs import available_codecs, get_codec, is_lossless
from kvbridge.codecs.registry import decode_frame

from ._peer import mismatched_blocks, reference_pool

pytestmark = pytest.mark.timeout(60)

NHD1 = KVLayout.vllm_flash(3, 1, 16, block_size=4, dtype="float16")
HND1 = KVLayout.vllm_flash(3, 1, 16, block_size=4, dtype="float16", hnd=True)
NHD2 = KVLayout.vllm_flash(3, 2, 16, block_size=4, dtype="float16")
HND2 = KVLayout.vllm_flash(3, 2, 16, block_size=4, dtype="float16", hnd=True)
LOSSY_BOUND = {"int8": 0.02, "fp8": 0.13, "fp8-block": 0.13, "int4": 0.3}


def _close(pool, dst, ref, src, codec):
    if codec == "raw" or is_lossless(codec):
        assert mismatched_blocks(pool, dst, ref, src) == []
        return
    for layer in range(ref.layout.num_layers):
        a = ref.buffers[layer][:, src].float()
        b = pool.buffers[layer][:, dst].float().reshape(a.shape)   # one head: the same order of values
        assert float((a - b).abs().max() / a.abs().max()) <= LOSSY_BOUND.get(codec, 0.3), (codec, layer)


@pytest.mark.parametrize("codec", ["raw", *[c for c in available_codecs() if c != "raw"]])
@pytest.mark.parametrize("pair", [(NHD1, HND1), (HND1, NHD1)], ids=["nhd-to-hnd", "hnd-to-nhd"])
def test_one_head_pools_of_either_order_exchange_blocks(pair, codec, make_sender, make_receiver):
    sl, rl = pair
    snd = make_sender(sl, 12, normal=True)
    recv, pool = make_receiver(rl, 12)
    src, dst = [7, 2, 11, 4], [0, 9, 3, 5]
    h = snd.publish(src, codec=codec)
    assert h.layout_hash == rl.compat_hash
    res = recv.fetch(h, dst)
    assert res.ok, res.error
    _close(pool, dst, reference_pool(sl, 12, snd.seed, normal=True), src, codec)


def test_two_head_pools_of_different_orders_stay_refused(make_sender, make_receiver):
    snd = make_sender(NHD2, 8)
    recv, pool = make_receiver(HND2, 8)
    before = [b.view(torch.uint8).clone() for b in pool.buffers]
    with pytest.raises(LayoutMismatch, match="token_order"):
        recv.fetch(snd.publish([1, 2]), [3, 4])
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, pool.buffers))


@pytest.mark.parametrize("codec", [c for c in available_codecs() if c != "raw"])
def test_a_frame_decodes_into_the_other_order_only_with_one_head(codec):
    """decode_frame checks the frame's geometry against the pool's: the token order counts from
    two heads up, and nothing is written when it refuses."""
    for enc_l, dec_l, ok in ((NHD1, HND1, True), (HND1, NHD1, True), (NHD2, HND2, False), (HND2, NHD2, False)):
        src = reference_pool(enc_l, 6, 5, normal=True)
        frame = get_codec(codec).encode(src, [1, 4])
        dst = reference_pool(dec_l, 6, 9, normal=True)
        before = [b.view(torch.uint8).clone() for b in dst.buffers]
        if ok:
            decode_frame(frame.data, dst, [2, 0], expect_codec=codec)
            _close(dst, [2, 0], src, [1, 4], codec)
        else:
            with pytest.raises(LayoutMismatch, match="token_order"):
                decode_frame(frame.data, dst, [2, 0], expect_codec=codec)
            assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, dst.buffers))
