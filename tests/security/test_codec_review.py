"""Codecs used by a hostile peer and by a careless engine: frames whose values or geometry no
encoder writes, pools of dtypes a codec cannot quantize, staging buffers and destination ids
that do not fit. Each case gets a kvbridge error (nothing written) or a finite, in-bounds result."""

from __future__ import annotations

import dataclasses
import struct
from typing import Optional

import pytest
import torch
import xxhash

from kvbridge.codecs import decode_frame, get_codec
from kvbridge.codecs.base import FrameHeader
from kvbridge.errors import ConfigError, IntegrityError, ProtocolError
from kvbridge.frames import FrameStore
from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool

pytestmark = pytest.mark.timeout(30)

LOSSY = ["int8", "fp8", "fp8-block", "int4"]


def _forged(L: KVLayout, codec: str, body: bytes, n: int, layers: range, aux: int,
            src_dtype: Optional[torch.dtype] = None) -> bytes:
    """A frame as a peer could write it: any body, a header and body hash that check out."""
    hdr = FrameHeader.for_pool(codec, L, n, layers, len(body), aux)
    if src_dtype is not None:
        itemsize = src_dtype.itemsize
        hdr = dataclasses.replace(hdr, src_dtype=src_dtype, raw_nbytes=hdr.raw_nbytes // L.itemsize * itemsize)
    hdr = dataclasses.replace(hdr, body_hash=xxhash.xxh3_64_intdigest(body))
    return hdr.pack() + body


def _untouched(pool: KVPool) -> bool:
    return not any(bool(b.view(-1).view(torch.uint8).any()) for b in pool.buffers)


# -- lossy codecs need float KV --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_codec_refuses_kv_it_cannot_scale(codec: str, dtype: str) -> None:
    """8-bit KV (an fp8 cache, or one stored as int8/uint8 bytes): a scaled 8-bit codec cannot make
    it smaller, and integer bytes hold values whose meaning it does not know. Refused at encode with
    ConfigError (was NotImplementedError from torch, or a silent lossy round trip of raw bytes),
    except int4 on fp8 KV, which halves it."""
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype=dtype)
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 0x70, b.shape, dtype=torch.uint8))
    c = get_codec(codec)
    if codec == "int4" and dtype.startswith("float8"):
        dst = KVPool.allocate(L, 2)
        decode_frame(bytes(c.encode(src, [0, 1])), dst, [0, 1])
        assert all(bool(b.float().isfinite().all()) for b in dst.buffers)
        return
    with pytest.raises(ConfigError, match=dtype):
        c.encode(src, [0, 1])
    with pytest.raises(ConfigError, match=dtype):
        c.check_layout(L)
    with pytest.raises(ConfigError, match=dtype):     # a sender's publish, layer-wise too
        FrameStore(codec, src, [0, 1], layerwise=True, shared=False)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_lossy_frame_claiming_8bit_source_is_refused(codec: str, dtype: torch.dtype) -> None:
    """A frame that says its scaled values came from 8-bit KV: no encoder writes one."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype="float16")
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.copy_(torch.randn(b.shape))
    c = get_codec(codec)
    enc = c.encode(src, [0, 1])
    fr = _forged(L, codec, bytes(enc.data.numpy())[96:], 2, range(1), enc.header.aux, src_dtype=dtype)
    dst = KVPool.allocate(L, 2)
    with pytest.raises(ProtocolError, match="no encoder"):
        decode_frame(fr, dst, [0, 1])
    assert _untouched(dst)


# -- scales and parameters within what an encoder can write ----------------------------------------

def _extreme_pool(L: KVLayout) -> KVPool:
    """Every group holds the dtype's largest finite value (both signs) and some small ones."""
    pool = KVPool.allocate(L, 2)
    big = torch.finfo(L.torch_dtype).max
    for b in pool.buffers:
        x = torch.randn(b.shape)
        x[..., 0], x[..., 1] = big, -big
        b.copy_(x.to(b.dtype))
    return pool


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("codec", ["int8", "fp8", "fp8-block"])
def test_scale_beyond_the_source_range_is_refused(codec: str, dtype: str) -> None:
    """A finite scale larger than any value of the frame's source dtype could make (amax / QMAX)
    decoded to inf in the pool (1e6 x 127 in float16). Refused; the largest genuine scale decodes
    to finite values."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype=dtype)
    src = _extreme_pool(L)
    c = get_codec(codec)
    enc = c.encode(src, [0, 1])
    dst = KVPool.allocate(L, 2)
    decode_frame(bytes(enc.data.numpy()), dst, [0, 1])       # genuine, at the edge: finite
    assert all(bool(b.isfinite().all()) for b in dst.buffers)
    s, _ = c.sizes(L, 2, 1)
    n = 4 * (c.sizes(L, 2, 1)[1] // c.group(L))
    body = bytearray(bytes(enc.data.numpy())[96:])
    top = float(torch.tensor(torch.finfo(L.torch_dtype).max, dtype=torch.float32) / (127 if codec == "int8" else 448))
    body[:4] = struct.pack("<f", min(top * 1.01, torch.finfo(torch.float32).max))
    assert n >= 4
    dst = KVPool.allocate(L, 2)
    with pytest.raises(IntegrityError, match="scale"):
        decode_frame(_forged(L, codec, bytes(body), 2, range(1), enc.header.aux), dst, [0, 1])
    assert _untouched(dst)


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn", "float8_e5m2"])
def test_int4_never_decodes_past_the_source_range(dtype: str) -> None:
    """int4's top code is ``15 * scale + min`` with both rounded to float16: a genuine group spanning
    float16's whole range decoded 65536 (inf in a float16 pool), and forged parameters (scale 65504)
    decoded inf, or NaN in an fp8 pool. Decoded values stay within the source dtype's finite range."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype=dtype)
    c = get_codec("int4")
    src = _extreme_pool(L)
    dst = KVPool.allocate(L, 2)
    decode_frame(bytes(c.encode(src, [0, 1]).data.numpy()), dst, [0, 1])
    assert all(bool(b.float().isfinite().all()) for b in dst.buffers)
    kp, vp, nc = c._sizes(L, 2, 1)
    params = torch.tensor([65504.0, 0.0], dtype=torch.float16).repeat((kp + vp) // 4)
    body = params.view(torch.uint8).numpy().tobytes() + b"\xff" * nc     # every code 15
    dst = KVPool.allocate(L, 2)
    decode_frame(_forged(L, "int4", body, 2, range(1), 4), dst, [0, 1])
    top = torch.finfo(L.torch_dtype).max
    for b in dst.buffers:
        assert bool(b.float().isfinite().all()) and float(b.float().max()) == top


def test_int4_frame_of_odd_parts_is_refused() -> None:
    """int4 packs two values per byte, so no encoder writes a frame for parts of an odd number of
    values (its encode refuses them); a forged one for a pool of that geometry raised torch's
    RuntimeError from a reshape. ProtocolError, nothing written."""
    L = KVLayout.mla(1, 3, 1, "float16")
    c = get_codec("int4")
    kp, vp, nc = c._sizes(L, 1, 1)
    dst = KVPool.allocate(L, 1)
    with pytest.raises(ProtocolError, match="odd"):
        decode_frame(_forged(L, "int4", bytes(kp + vp + nc), 1, range(1), 4), dst, [0])
    assert _untouched(dst)
    with pytest.raises(ConfigError, match="even"):
        c.encode(dst, [0])


# -- a careless caller's buffers and ids -----------------------------------------------------------

@pytest.mark.parametrize("codec", ["raw", "int8", "fp8", "int4", "lz4", "zstd+shuffle"])
def test_staging_buffer_that_cannot_hold_a_frame_is_refused(codec: str) -> None:
    """``out`` strided, or starting off the alignment the frame's sections are viewed at: torch's
    RuntimeError or a BufferError escaped. ConfigError; compressors take any start."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype="float16")
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.copy_(torch.randn(b.shape))
    c = get_codec(codec)
    cap = c.max_encoded_nbytes(L, 2)
    with pytest.raises(ConfigError, match="contiguous"):
        c.encode(src, [0, 1], out=torch.zeros(2 * cap, dtype=torch.uint8)[::2])
    off = torch.zeros(cap + 16, dtype=torch.uint8)[1:]
    if codec.startswith(("lz4", "zstd")):
        fr = c.encode(src, [0, 1], out=off)
        dst = KVPool.allocate(L, 2)
        decode_frame(fr, dst, [0, 1])
        assert all(torch.equal(a, b) for a, b in zip(src.buffers, dst.buffers))
    else:
        with pytest.raises(ConfigError, match="aligned"):
            c.encode(src, [0, 1], out=off)


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8", "int4"])
def test_strided_frame_tensor_decodes(codec: str) -> None:
    """A frame handed over as a strided 1-D uint8 view (every other byte of a buffer): hashing it
    raised a raw BufferError. It decodes like the same bytes laid out contiguously."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype="float16")
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.copy_(torch.randn(b.shape))
    fr = get_codec(codec).encode(src, [0, 1]).data
    spread = torch.zeros(2 * fr.numel(), dtype=torch.uint8)
    spread[::2] = fr
    want, got = KVPool.allocate(L, 2), KVPool.allocate(L, 2)
    decode_frame(fr, want, [0, 1])
    decode_frame(spread[::2], got, [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(want.buffers, got.buffers))
    got = KVPool.allocate(L, 2)
    decode_frame(memoryview(spread.numpy()[::2]), got, [0, 1])     # a strided buffer, as numpy gives it
    assert all(torch.equal(a, b) for a, b in zip(want.buffers, got.buffers))


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8", "int4"])
def test_duplicate_destination_ids_are_refused(codec: str) -> None:
    """Two frame blocks decoded into one destination block: one silently overwrote the other (which
    one depends on the scatter). PoolError, nothing written; a repeated source id still encodes."""
    from kvbridge.errors import PoolError
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype="float16")
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.copy_(torch.randn(b.shape))
    fr = bytes(get_codec(codec).encode(src, [0, 0, 1]).data.numpy())
    dst = KVPool.allocate(L, 3)
    with pytest.raises(PoolError, match="duplicate"):
        decode_frame(fr, dst, [2, 0, 2])
    assert _untouched(dst)
    decode_frame(fr, dst, [2, 0, 1])


# -- the receiver's frame buffer -------------------------------------------------------------------

@pytest.mark.parametrize("lo,hi", [(0, 4096), (1, 3), (-1, 1), (2, 1)])
def test_frame_loader_sizes_nothing_by_a_layer_range_outside_the_layout(lo: int, hi: int) -> None:
    """The staging buffer of a layer-wise coded read was sized by ``(hi - lo)`` layers' worth of
    frames whatever ``hi`` was: a range past the layout's layers (a transport that did not check
    it) let a peer size it at will. The range is checked first (ProtocolError), nothing allocated."""
    from kvbridge.frames import FrameLoader
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    loader = FrameLoader("lz4", KVPool.allocate(L, 2), [0, 1], layerwise=True)
    one = get_codec("lz4").max_encoded_nbytes(L, 2, 1)
    with pytest.raises(ProtocolError, match="layers"):
        loader.spans_for(lo, hi, 3 * one)
    assert loader.spans_for(0, 2, 2 * one).nbytes == 2 * one


# -- the registry as a peer reaches it -------------------------------------------------------------

def test_frame_naming_an_unknown_codec_is_a_protocol_error() -> None:
    """A frame whose header names no registered codec raised ConfigError (action FIX: "change
    your call"), though the caller's call was fine and the peer's frame was not. ProtocolError."""
    L = KVLayout.vllm_flash(1, 2, 8, block_size=4, dtype="float16")
    dst = KVPool.allocate(L, 1)
    for name in ("brotli", "raw\0x"):
        with pytest.raises(ProtocolError, match="names codec"):
            decode_frame(_forged(L, name, bytes(16), 1, range(1), 0), dst, [0])
    assert _untouched(dst)
    with pytest.raises(ConfigError, match="unknown codec"):     # the caller's own name stays a ConfigError
        get_codec("brotli")


def test_entry_point_codec_is_found_while_another_thread_loads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry points were marked loaded before they were read: a thread asking for an entry-point
    codec while another read them got "unknown codec". It waits for the reading and gets the codec."""
    import threading
    from importlib.metadata import EntryPoint

    from kvbridge.codecs import registry as reg
    monkeypatch.setattr(reg, "known_codecs", dict(reg.known_codecs))
    monkeypatch.setattr(reg, "_instances", {})
    monkeypatch.setattr(reg, "_entry_points_loaded", False)
    entered, release = threading.Event(), threading.Event()

    def slow_entry_points(group: str) -> list[EntryPoint]:       # a slow scan of installed metadata
        entered.set()
        release.wait(5)
        return [EntryPoint("plugin", "kvbridge.codecs.base:RawCodec", group)]
    monkeypatch.setattr(reg, "entry_points", slow_entry_points)
    got: dict[str, object] = {}

    def ask(key: str, call: object) -> None:
        try:
            got[key] = call()  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 -- reported below
            got[key] = exc
    a = threading.Thread(target=ask, args=("names", reg.codec_names))
    a.start()
    assert entered.wait(5)
    b = threading.Thread(target=ask, args=("codec", lambda: reg.get_codec("plugin")))
    b.start()
    b.join(0.2)
    release.set()
    a.join(5)
    b.join(5)
    assert "plugin" in got["names"]  # type: ignore[operator]
    assert getattr(got["codec"], "name", got["codec"]) == "plugin"


# -- accuracy at the edges of the float range ------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("codec", ["int8", "fp8", "fp8-block"])
def test_tiny_groups_quantize_within_bounds(codec: str, dtype: str) -> None:
    """A group whose absmax is below QMAX / float32 max (~1e-36: subnormal, or tiny normal values;
    bfloat16 has them too) made 1/amax overflow to inf: zeros became NaN, so fp8 wrote NaN codes its
    own decode refused (a genuine frame failed as corrupted, every refetch again) and int8 wrote
    +-127 for any value. Such groups round trip within the stated bounds."""
    L = KVLayout.vllm_flash(1, 1, 8, block_size=2, dtype=dtype)
    src = KVPool.allocate(L, 2)
    rows = torch.tensor([[1e-39, 0.0, -3e-40, 2e-41, 0.0, 5e-40, -1e-39, 7e-42],
                         [1e-37, 0.0, -3e-38, 2e-38, 4e-39, 0.0, -1e-37, 1e-40],
                         [3e-37, -1e-37, 0.0, 1e-38, 2e-37, 1e-39, -3e-37, 0.0],
                         [1.0, -0.5, 0.25, 0.0, 0.125, -1.0, 0.75, 0.5]])
    for b in src.buffers:
        b.view(-1, 8).copy_(rows.repeat(b.numel() // 32, 1))
    dst = KVPool.allocate(L, 2)
    decode_frame(bytes(get_codec(codec).encode(src, [0, 1]).data.numpy()), dst, [0, 1])
    for s, d in zip(src.buffers, dst.buffers):
        x, y = s.float().view(-1, 8), d.float().view(-1, 8)
        amax = (x.abs().amax(-1, keepdim=True) if codec != "fp8-block"      # fp8-block: 2 rows a block part
                else x.abs().view(-1, 16).amax(-1).repeat_interleave(2).view(-1, 1))
        step = amax / 254 if codec == "int8" else x.abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        rounding = (x.abs() + step) * (2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -24)   # the pool's own
        assert bool(((x - y).abs() <= step * (1 + 1e-3) + rounding + 2.0 ** -140).all()), (x - y).abs().max()


def test_codec_names_are_printable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name with a NUL or a control character was registered, then read back from a frame as
    another name (the header pads names with NULs): its own frames were refused. ConfigError."""
    from kvbridge.codecs import register_codec
    from kvbridge.codecs import registry as reg
    from kvbridge.codecs.base import RawCodec
    monkeypatch.setattr(reg, "known_codecs", dict(reg.known_codecs))
    monkeypatch.setattr(reg, "_instances", {})
    for bad in ("plain\0", "pl\nain", "pl ain"):
        with pytest.raises(ConfigError, match="1-12"):
            register_codec(bad, RawCodec)
    register_codec("plain-2", RawCodec)
