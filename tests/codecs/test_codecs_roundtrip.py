"""Round trips of every codec over every layout kind: lossless bit-exact, lossy within bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcodec_helpers import FLOAT_DTYPES, LAYOUTS, assert_bits_equal, make_pool, parts_of

from kvbridge.codecs import codec_names, decode_frame, get_codec
from kvbridge.codecs.base import HEADER_NBYTES
from kvbridge.errors import ProtocolError
from kvbridge.layout import DTYPES
from kvbridge.pool import KVPool

pytestmark = pytest.mark.timeout(60)

LOSSLESS = ["raw", "lz4", "lz4+shuffle", "zstd", "zstd+shuffle"]
LOSSY = ["int8", "fp8", "fp8-block"]


def _bound(codec: str, x: torch.Tensor, group_amax: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """The stated per-element error bound of a lossy codec (before/after the destination rounding)."""
    half_ulp = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dst]
    a = x.abs()
    if codec == "int8":  # half a quantization step
        q = group_amax / 254.0
    else:  # e4m3: 3 mantissa bits (half-step 2^-4 relative); subnormal half-step 2^-10 * scale
        q = a * 2.0 ** -4 + group_amax / 448.0 * 2.0 ** -10
    return q * (1 + 1e-6) + (a + q) * half_ulp + 2.0 ** -24  # + fp16's subnormal half-step


def _group_amax(codec: str, part: torch.Tensor) -> torch.Tensor:
    """amax of each element's scale group, broadcast to ``part`` (n, *part_shape)."""
    xf = part.float()
    if codec == "fp8-block":
        return xf.abs().flatten(1).amax(1).view(-1, *([1] * (xf.dim() - 1))).expand_as(xf)
    return xf.abs().amax(-1, keepdim=True).expand_as(xf)


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("name", LOSSLESS + LOSSY)
def test_every_layout_every_codec(kind: str, name: str) -> None:
    src = make_pool(kind, "bfloat16", num_blocks=9, seed=hash((kind, name)) % 1000)
    dst = make_pool(kind, "bfloat16", num_blocks=9, seed=1)
    ids, dids = [7, 2, 3, 0], [1, 8, 4, 5]
    codec = get_codec(name)
    frame = codec.encode(src, ids)
    assert frame.header.codec == name and frame.nbytes == HEADER_NBYTES + frame.header.body_nbytes
    untouched = [parts_of(dst, layer, [0, 2, 3, 6, 7]) for layer in range(3)]
    decode_frame(bytes(frame), dst, dids, expect_codec=name)
    for layer in range(3):
        for s, d in zip(parts_of(src, layer, ids), parts_of(dst, layer, dids)):
            if codec.lossless:
                assert_bits_equal(s, d)
            else:
                err = (s.float() - d.float()).abs()
                assert bool((err <= _bound(name, s.float(), _group_amax(name, s), torch.bfloat16)).all())
        for before, after in zip(untouched[layer], parts_of(dst, layer, [0, 2, 3, 6, 7])):
            assert_bits_equal(before, after)  # other blocks are never written


@settings(max_examples=40)
@given(kind=st.sampled_from(sorted(LAYOUTS)), name=st.sampled_from(LOSSLESS),
       dtype=st.sampled_from(FLOAT_DTYPES), data=st.data())
def test_lossless_roundtrip_property(kind: str, name: str, dtype: str, data: st.DataObject) -> None:
    nb = data.draw(st.integers(1, 10), label="num_blocks")
    src = make_pool(kind, dtype, num_blocks=nb, seed=data.draw(st.integers(0, 99)))
    if data.draw(st.booleans(), label="specials"):  # lossless codecs carry inf/nan/-0 bit for bit
        src.buffers[0].view(-1)[:4] = torch.tensor([float("inf"), float("nan"), -0.0, -float("inf")]).to(
            src.buffers[0].dtype)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=nb, unique=True), label="ids")
    start = data.draw(st.integers(0, 2), label="layer")
    stop = data.draw(st.integers(start + 1, 3), label="stop")
    dst = KVPool.allocate(src.layout, nb + 3)
    dids = data.draw(st.permutations(range(nb + 3)))[:len(ids)]
    codec = get_codec(name)
    frame = codec.encode(src, ids, range(start, stop))
    codec.decode(frame.memoryview(), dst, dids, range(start, stop))
    for layer in range(3):
        for s, d in zip(parts_of(src, layer, ids), parts_of(dst, layer, dids)):
            if start <= layer < stop:
                assert_bits_equal(s, d)
            else:
                assert not bool(d.any())  # layers outside the frame stay untouched (zeros)


@settings(max_examples=40)
@given(kind=st.sampled_from(sorted(LAYOUTS)), name=st.sampled_from(LOSSY),
       src_dtype=st.sampled_from(FLOAT_DTYPES), dst_dtype=st.sampled_from(FLOAT_DTYPES), data=st.data())
def test_lossy_within_bounds_property(kind: str, name: str, src_dtype: str, dst_dtype: str,
                                      data: st.DataObject) -> None:
    nb = data.draw(st.integers(1, 8), label="num_blocks")
    src = make_pool(kind, src_dtype, num_blocks=nb, seed=data.draw(st.integers(0, 99)))
    dst = KVPool.allocate(type(src.layout)(**{**src.layout.to_dict(), "dtype": dst_dtype}), nb)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=nb, unique=True), label="ids")
    get_codec(name).decode(get_codec(name).encode(src, ids), dst, list(range(len(ids))))
    for layer in range(3):
        for s, d in zip(parts_of(src, layer, ids), parts_of(dst, layer, list(range(len(ids))))):
            assert d.dtype == DTYPES[dst_dtype]
            err = (s.float() - d.float()).abs()
            bound = _bound(name, s.float(), _group_amax(name, s), DTYPES[dst_dtype])
            assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("src_dtype,dst_dtype", [("bfloat16", "float32"), ("float32", "float16"),
                                                 ("float16", "bfloat16")])
def test_lossless_decodes_into_other_dtype(name: str, src_dtype: str, dst_dtype: str) -> None:
    src = make_pool("flashinfer", src_dtype, num_blocks=5)
    dst = make_pool("flashinfer", dst_dtype, num_blocks=5, seed=3)
    get_codec(name).decode(get_codec(name).encode(src, [4, 1]), dst, [0, 3])
    for layer in range(3):
        for s, d in zip(parts_of(src, layer, [4, 1]), parts_of(dst, layer, [0, 3])):
            assert_bits_equal(s.to(DTYPES[dst_dtype]), d)


@pytest.mark.parametrize("name", LOSSLESS + LOSSY)
def test_layer_frames_equal_whole_frame(name: str) -> None:
    """Layer-by-layer streaming: one frame per layer decodes to the same blocks as one frame."""
    src = make_pool("vllm_flash", "float16", num_blocks=6)
    whole = make_pool("vllm_flash", "float16", num_blocks=6, seed=9)
    layered = make_pool("vllm_flash", "float16", num_blocks=6, seed=9)
    codec = get_codec(name)
    codec.decode(codec.encode(src, [5, 0, 2]), whole, [1, 2, 3])
    staging = torch.empty(codec.max_encoded_nbytes(src.layout, 3, 1), dtype=torch.uint8)
    for layer in range(3):
        frame = codec.encode_layer(src, [5, 0, 2], layer, out=staging)
        assert frame.data.data_ptr() == staging.data_ptr() and frame.header.layers == range(layer, layer + 1)
        codec.decode_layer(frame, layered, [1, 2, 3], layer)
    for a, b in zip(whole.buffers, layered.buffers):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_frame_size_is_fixed_and_smaller(name: str) -> None:
    src = make_pool("vllm_flash", "bfloat16", num_blocks=8)
    frame = get_codec(name).encode(src, list(range(8)))
    assert frame.nbytes == get_codec(name).max_encoded_nbytes(src.layout, 8)
    assert frame.ratio > (1.9 if name == "fp8-block" else 1.5)  # head_dim 16: float32 scales cost 25%


def test_zero_and_partly_filled_blocks_compress() -> None:
    """Unwritten slots of a last block are zeros; zero blocks shrink to almost nothing."""
    pool = make_pool("vllm_flash", "bfloat16", num_blocks=8)
    for b in pool.buffers:
        b[:, 4:] = 0
    for name in ["lz4", "zstd", "lz4+shuffle", "zstd+shuffle"]:
        assert get_codec(name).encode(pool, [4, 5, 6, 7]).ratio > 20


def test_registry_lists_every_codec() -> None:
    assert set(LOSSLESS + LOSSY) <= set(codec_names())
    for name in LOSSLESS + LOSSY:
        assert get_codec(name).name == name and get_codec(name) is get_codec(name)
        assert get_codec(name).lossless == (name in LOSSLESS)


@pytest.mark.parametrize("name", LOSSY + ["int4"])
def test_chunked_quantization_changes_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encode and decode walk blocks in cache-sized chunks: any chunk size gives the same bytes."""
    from kvbridge.codecs import kivi, quant

    src = make_pool("flashinfer_hnd", "float16", num_blocks=9)
    ids = [8, 0, 5, 2, 7, 1, 4]
    whole = get_codec(name).encode(src, ids)
    dst_whole = make_pool("flashinfer_hnd", "bfloat16", num_blocks=9, seed=4)
    get_codec(name).decode(whole, dst_whole, ids[::-1])
    monkeypatch.setattr(quant, "_CHUNK", 300)  # 2 blocks per chunk here (128 values a part)
    monkeypatch.setattr(kivi, "_CHUNK", 300)
    chunked = get_codec(name).encode(src, ids)
    assert torch.equal(whole.data, chunked.data)
    dst = make_pool("flashinfer_hnd", "bfloat16", num_blocks=9, seed=4)
    get_codec(name).decode(chunked, dst, ids[::-1])
    for a, b in zip(dst_whole.buffers, dst.buffers):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("name", LOSSLESS + LOSSY + ["int4"])
def test_frames_are_deterministic_and_carry_no_stale_bytes(name: str) -> None:
    """Encoding into staging buffers full of different garbage gives byte-identical frames."""
    src = make_pool("split_kv_hnd", "bfloat16", num_blocks=5)
    codec = get_codec(name)
    cap = codec.max_encoded_nbytes(src.layout, 3)
    a = codec.encode(src, [4, 0, 2], out=torch.full((cap,), 0xAB, dtype=torch.uint8))
    b = codec.encode(src, [4, 0, 2], out=torch.full((cap,), 0x11, dtype=torch.uint8))
    assert torch.equal(a.data, b.data)


@pytest.mark.parametrize("name", ["lz4", "lz4+shuffle", "zstd", "zstd+shuffle"])
def test_many_chunk_frames(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planes are compressed in independent chunks; with 512-byte chunks a frame has dozens."""
    from kvbridge.codecs import lossless

    monkeypatch.setattr(lossless, "CHUNK_SHIFT", 9)
    src = make_pool("vllm_flash", "float16", num_blocks=10)
    for b in src.buffers:
        b[:, 5:] = 0  # compressible chunks next to incompressible ones: both modes in one frame
    frame = get_codec(name).encode(src, list(range(10)))
    assert frame.header.aux >> 8 == 9 and frame.ratio > 1.2
    dst = KVPool.allocate(src.layout, 10)
    get_codec(name).decode(frame, dst, list(range(10)))
    for a, b in zip(src.buffers, dst.buffers):
        assert_bits_equal(a, b)
    monkeypatch.setattr(lossless, "CHUNK_SHIFT", 10)  # a decoder that disagrees refuses the frame
    with pytest.raises(ProtocolError, match="unexpected parameter"):
        get_codec(name).decode(frame, dst, list(range(10)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantizers_are_the_documented_formulas(dtype: str) -> None:
    """The (optimised) torch quantizers equal the formulas in quant.py's docstring, bit for bit."""
    from kvbridge.codecs.quant import quantize_fp8, quantize_int8

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 64, generator=g) * torch.exp2(torch.randint(-12, 12, (3000, 1), generator=g).float())
    x[5] = 0
    x = x.to(DTYPES[dtype])
    before = x.clone()
    for qmax, fn in ((127.0, quantize_int8), (448.0, quantize_fp8)):
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True)
        y = xf * torch.where(amax > 0, torch.div(torch.tensor(qmax), amax), torch.zeros(()))  # a true division
        want = (y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) if qmax == 448.0
                else torch.round(y).clamp(-127, 127).to(torch.int8))
        q, scale = fn(x)
        assert torch.equal(q.view(want.dtype), want)
        assert torch.equal(scale, (amax * float(torch.tensor(1 / qmax, dtype=torch.float32))).squeeze(-1))
    assert_bits_equal(x, before)  # inputs are never modified


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_decode_keeps_the_handles_block_checksums(name: str) -> None:
    """After a lossless decode into a pool of the same dtype, the sender's per-block checksums hold."""
    from kvbridge.integrity import block_checksums

    src = make_pool("flashinfer", "bfloat16", num_blocks=7)
    dst = make_pool("split_kv", "bfloat16", num_blocks=7, seed=8)  # another arrangement, same parts
    get_codec(name).decode(get_codec(name).encode(src, [6, 2, 4]), dst, [0, 1, 3])
    assert block_checksums(src, [6, 2, 4]) == block_checksums(dst, [0, 1, 3])
