"""``auto``: the choice follows the cost model, never loses to raw by its own measure, and asks
before going lossy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcodec_helpers import make_pool

from kvbridge.codecs import CodecSpeed, break_even_gbps, choose_codec, measure_codec_speeds
from kvbridge.codecs.auto import transfer_seconds
from kvbridge.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

ZSTD = CodecSpeed("zstd+shuffle", ratio=1.6, encode_gbps=0.8, decode_gbps=1.6)
LZ4 = CodecSpeed("lz4+shuffle", ratio=1.2, encode_gbps=2.0, decode_gbps=3.0)
INT8 = CodecSpeed("int8", ratio=1.9, encode_gbps=0.6, decode_gbps=1.2, lossless=False)


def test_fast_link_stays_raw_and_says_why() -> None:
    c = choose_codec(20.0, [ZSTD, LZ4, INT8])
    assert c.codec == "raw" and c.speedup == 1.0
    assert "does not pay" in c.reason and "lossy codecs not allowed (int8)" in c.reason


def test_slow_link_picks_a_codec() -> None:
    c = choose_codec(0.05, [ZSTD, LZ4, INT8])
    assert c.codec == "zstd+shuffle" and c.speedup > 1.3 and "faster" in c.reason
    assert choose_codec(0.05, [ZSTD, LZ4, INT8], allow_lossy=True).codec == "int8"


def test_break_even_is_where_the_choice_flips() -> None:
    for s in (ZSTD, LZ4):
        for overlap in (False, True):
            b = break_even_gbps(s, overlap)
            assert transfer_seconds(s, b * 0.99, overlap) < 1 / (b * 0.99)
            assert transfer_seconds(s, b * 1.01, overlap) >= 1 / (b * 1.01)
    assert break_even_gbps(CodecSpeed("lz4", 0.99, 5.0, 5.0)) == 0.0  # incompressible: never


@settings(max_examples=200)
@given(link=st.floats(0.001, 100.0),
       speeds=st.lists(st.builds(CodecSpeed, st.sampled_from(["a", "b", "c", "d"]), st.floats(0.5, 8.0),
                                 st.floats(0.01, 50.0), st.floats(0.01, 50.0), st.booleans()), max_size=4,
                       unique_by=lambda s: s.name),
       lossy=st.booleans(), overlap=st.booleans())
def test_never_slower_than_raw(link: float, speeds: list[CodecSpeed], lossy: bool, overlap: bool) -> None:
    c = choose_codec(link, speeds, allow_lossy=lossy, overlap=overlap)
    assert c.seconds_per_gb <= 1 / link * (1 + 1e-9)
    if c.codec != "raw":
        chosen = next(s for s in speeds if s.name == c.codec)
        assert lossy or chosen.lossless
        assert transfer_seconds(chosen, link, overlap) == c.seconds_per_gb
        assert all(c.seconds_per_gb <= transfer_seconds(s, link, overlap) for s in speeds
                   if lossy or s.lossless)


def test_bad_link_figure() -> None:
    with pytest.raises(ConfigError):
        choose_codec(0.0, [ZSTD])


def test_measured_speeds_feed_the_choice() -> None:
    pool = make_pool("vllm_flash", "bfloat16", num_blocks=16)
    speeds = measure_codec_speeds(pool, list(range(16)), ["raw", "lz4", "zstd+shuffle", "int8"], repeats=1)
    assert [s.name for s in speeds] == ["raw", "lz4", "zstd+shuffle", "int8"]
    assert all(s.encode_gbps > 0 and s.decode_gbps > 0 for s in speeds)
    assert speeds[3].ratio > 1.5 and not speeds[3].lossless
    assert choose_codec(1e-6, speeds, allow_lossy=True).codec != "raw"


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_auto_on_an_8_bit_pool_leaves_out_the_codecs_that_cannot_code_it(dtype: str) -> None:
    """On an fp8 or int8 KV pool (vLLM's kv_cache_dtype=fp8) the 8-bit quantizers cannot encode:
    measuring every codec raised their ConfigError, so the README's measure-then-choose snippet
    and KVSender(codec="auto") failed instead of choosing among the others."""
    import torch

    from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
    L = KVLayout.vllm_flash(2, 2, 16, block_size=4, dtype=dtype)
    src, dst = KVPool.allocate(L, 8), KVPool.allocate(L, 8)
    for b in src.buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 120, b.shape, dtype=torch.uint8).view(torch.uint8))
    speeds = measure_codec_speeds(src, list(range(4)), repeats=1)
    names = [sp.name for sp in speeds]
    assert "raw" in names and "lz4" in names and not {"int8", "fp8", "fp8-block"} & set(names), names
    assert choose_codec(10.0, speeds, allow_lossy=False).codec in names
    with KVSender(src, "tcp://127.0.0.1:0", leases=False, codec="auto", link_gbps=0.001, allow_lossy=True) as snd, \
            KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("r", src.alloc(2), 8)
        assert snd.codec_choice is not None and snd.codec_choice.codec in names
        assert rcv.fetch(h, [0, 1]).ok


def test_an_unmeasured_figure_does_not_hide_the_others() -> None:
    """A NaN figure (a failed measurement) came first and stuck as the best (NaN < t is never true),
    so a slow link stayed raw whatever the other codecs measured. It is left out, like a zero one;
    min_gain outside [0, 1) is refused (a negative one let the choice lose to raw)."""
    nan = float("nan")
    for bad in (CodecSpeed("lz4", ratio=nan, encode_gbps=2.0, decode_gbps=3.0),
                CodecSpeed("lz4", ratio=1.5, encode_gbps=nan, decode_gbps=3.0)):
        assert choose_codec(0.05, [bad, ZSTD]).codec == "zstd+shuffle"
        assert choose_codec(0.05, [ZSTD, bad]).codec == "zstd+shuffle"
    for g in (-0.5, 1.0, nan):
        with pytest.raises(ConfigError, match="min_gain"):
            choose_codec(0.05, [ZSTD], min_gain=g)
