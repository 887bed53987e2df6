"""Frames are refused when truncated, corrupted, foreign or misaddressed; the registry's errors."""

from __future__ import annotations

import struct
import sys

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcodec_helpers import make_pool

from kvbridge.codecs import decode_frame, get_codec, read_header, register_codec
from kvbridge.codecs import registry as reg
from kvbridge.codecs.base import HEADER_NBYTES, RawCodec
from kvbridge.errors import (BackendUnavailable, ConfigError, IntegrityError, LayoutMismatch, PoolError,
                             ProtocolError)
from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool

pytestmark = pytest.mark.timeout(60)

ALL = ["raw", "lz4", "lz4+shuffle", "zstd", "zstd+shuffle", "int8", "fp8", "fp8-block"]
REFUSED = (IntegrityError, ProtocolError)


def _frame(name: str, **kw: object) -> tuple[bytes, KVPool]:
    src = make_pool("vllm_flash", "bfloat16", num_blocks=6)
    return bytes(get_codec(name).encode(src, [1, 4, 5], **kw)), src  # type: ignore[arg-type]


@settings(max_examples=60)
@given(name=st.sampled_from(ALL), data=st.data())
def test_any_corrupted_byte_is_refused(name: str, data: st.DataObject) -> None:
    frame, src = _frame(name)
    pos = data.draw(st.integers(0, len(frame) - 1), label="pos")
    flip = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(frame)
    bad[pos] ^= flip
    dst = KVPool.allocate(src.layout, 6)
    with pytest.raises(REFUSED):
        decode_frame(bytes(bad), dst, [0, 1, 2])
    assert not any(bool(b.any()) for b in dst.buffers)  # nothing written


@settings(max_examples=40)
@given(name=st.sampled_from(ALL), data=st.data())
def test_truncated_or_padded_frames_are_refused(name: str, data: st.DataObject) -> None:
    frame, src = _frame(name)
    n = data.draw(st.integers(0, len(frame) - 1), label="keep")
    dst = KVPool.allocate(src.layout, 6)
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(frame[:n], dst, [0, 1, 2])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_frame(frame + b"\0" * data.draw(st.integers(1, 64)), dst, [0, 1, 2])


@pytest.mark.parametrize("name", ["int8", "fp8", "lz4"])
def test_header_is_hashed_even_without_body_checksum(name: str) -> None:
    frame, src = _frame(name, checksum=False)
    assert read_header(frame).body_hash is None
    for pos in range(4, HEADER_NBYTES):
        bad = bytearray(frame)
        bad[pos] ^= 0x10
        with pytest.raises(REFUSED):
            decode_frame(bytes(bad), KVPool.allocate(src.layout, 6), [0, 1, 2])


def test_forged_header_with_valid_hash_is_still_checked() -> None:
    frame, src = _frame("raw")
    head = bytearray(frame[:HEADER_NBYTES])
    struct.pack_into("<Q", head, 56, 12345)  # raw_nbytes
    struct.pack_into("<Q", head, 88, xxhash.xxh3_64_intdigest(bytes(head[:88])))
    with pytest.raises(ProtocolError, match="raw bytes"):
        decode_frame(bytes(head) + frame[HEADER_NBYTES:], KVPool.allocate(src.layout, 6), [0, 1, 2])
    head = bytearray(frame[:HEADER_NBYTES])
    struct.pack_into("<I", head, 28, 0)  # num_layers
    struct.pack_into("<Q", head, 88, xxhash.xxh3_64_intdigest(bytes(head[:88])))
    with pytest.raises(ProtocolError, match="zero dimension"):
        decode_frame(bytes(head) + frame[HEADER_NBYTES:], KVPool.allocate(src.layout, 6), [0, 1, 2])
    head = bytearray(frame[:HEADER_NBYTES])
    head[4] = 9  # version
    with pytest.raises(ProtocolError, match="version 9"):
        decode_frame(bytes(head) + frame[HEADER_NBYTES:], KVPool.allocate(src.layout, 6), [0, 1, 2])
    with pytest.raises(ProtocolError, match="not a kvbridge codec frame"):
        decode_frame(b"GARBAGE!" * 20, KVPool.allocate(src.layout, 6), [0, 1, 2])


def test_codec_and_handle_must_agree() -> None:
    frame, src = _frame("int8")
    dst = KVPool.allocate(src.layout, 6)
    with pytest.raises(ProtocolError, match="the handle says 'raw'"):
        decode_frame(frame, dst, [0, 1, 2], expect_codec="raw")
    with pytest.raises(ProtocolError, match="encoded with codec 'int8', not 'fp8'"):
        get_codec("fp8").decode(frame, dst, [0, 1, 2])


def test_destination_must_fit() -> None:
    frame, src = _frame("zstd+shuffle")
    with pytest.raises(LayoutMismatch, match="head_dim"):
        decode_frame(frame, KVPool.allocate(KVLayout.vllm_flash(3, 2, 32, 4), 6), [0, 1, 2])
    with pytest.raises(LayoutMismatch, match="token_order"):
        decode_frame(frame, KVPool.allocate(KVLayout.vllm_flash(3, 2, 16, 4, hnd=True), 6), [0, 1, 2])
    with pytest.raises(LayoutMismatch, match="layers"):
        decode_frame(frame, KVPool.allocate(KVLayout.vllm_flash(2, 2, 16, 4), 6), [0, 1, 2])
    dst = KVPool.allocate(src.layout, 6)
    with pytest.raises(PoolError, match="3 blocks, 2 destination"):
        decode_frame(frame, dst, [0, 1])
    with pytest.raises(PoolError, match="outside a pool"):
        decode_frame(frame, dst, [0, 1, 6])
    with pytest.raises(ProtocolError, match="expected range"):
        decode_frame(frame, dst, [0, 1, 2], layers=1)
    # a split-K/V pool with the same part geometry takes a flash-layout frame
    split = KVPool.allocate(KVLayout.split_kv(3, 2, 16, 4), 6)
    decode_frame(frame, split, [5, 4, 3])
    assert torch.equal(split.layer_kv(2)[1][4], src.layer_kv(2)[1][4])


def test_bad_arguments() -> None:
    src = make_pool("vllm_flash", "bfloat16", num_blocks=6)
    codec = get_codec("raw")
    with pytest.raises(ConfigError, match="out must be"):
        codec.encode(src, [0, 1], out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="layers"):
        codec.encode(src, [0, 1], layers=range(2, 5))
    with pytest.raises(PoolError):
        codec.encode(src, [])
    with pytest.raises(PoolError, match="outside"):
        codec.encode(src, [-1])


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8-block"])
def test_lossy_refuses_non_finite_kv(name: str) -> None:
    src = make_pool("vllm_flash", "bfloat16", num_blocks=4)
    src.buffers[1][1, 2, 0, 0, 3] = float("nan")
    with pytest.raises(ConfigError, match="non-finite"):
        get_codec(name).encode(src, [0, 2])
    get_codec("zstd").encode(src, [0, 2])  # lossless codecs carry it


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown codec 'brotli'.*int8.*lz4\+shuffle.*zstd"):
        get_codec("brotli")


def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    monkeypatch.setattr(reg, "_instances", {})
    with pytest.raises(BackendUnavailable, match=r"zstandard.*kvbridge\[zstd\]"):
        get_codec("zstd+shuffle")
    assert "zstd" not in reg.available_codecs() and "lz4" in reg.available_codecs()


def test_register_a_third_party_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reg, "known_codecs", dict(reg.known_codecs))
    monkeypatch.setattr(reg, "_instances", {})

    class Plain(RawCodec):
        pass

    register_codec("plain", Plain)
    with pytest.raises(ConfigError, match="already registered"):
        register_codec("plain", Plain)
    with pytest.raises(ConfigError, match="1-12 ASCII"):
        register_codec("a-name-longer-than-12", Plain)
    frame, src = bytes(get_codec("plain").encode(make_pool(), [3])), make_pool()
    dst = KVPool.allocate(src.layout, 12)
    assert decode_frame(frame, dst, [0]).codec == "plain"
    assert torch.equal(dst.buffers[0][:, 0], src.buffers[0][:, 3])


def test_seal_adds_the_body_checksum_later() -> None:
    """Device frames travel without a body hash until staged; seal_frame adds it in place."""
    from kvbridge.codecs import seal_frame

    frame, src = _frame("int8", checksum=False)
    staged = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    assert seal_frame(staged).body_hash is not None and read_header(staged).body_hash is not None
    decode_frame(staged, KVPool.allocate(src.layout, 6), [0, 1, 2])
    staged[-1] ^= 1
    with pytest.raises(IntegrityError, match="body failed its checksum"):
        decode_frame(staged, KVPool.allocate(src.layout, 6), [0, 1, 2])


@settings(max_examples=150)
@given(name=st.sampled_from(ALL + ["int4"]), data=st.data())
def test_forged_headers_never_crash(name: str, data: st.DataObject) -> None:
    """A peer can send any header with a valid hash: decoding raises a kvbridge error or writes a
    frame that fits, never anything else (no ZeroDivisionError, no IndexError, no huge allocation)."""
    from kvbridge.errors import KVBridgeError

    frame, src = _frame(name)
    head = bytearray(frame[:HEADER_NBYTES])
    for _ in range(data.draw(st.integers(1, 4), label="fields")):
        off, fmt = data.draw(st.sampled_from([(5, "<B"), (6, "<B"), (7, "<B"), (8, "<B"), (24, "<I"), (28, "<I"),
                                              (32, "<I"), (36, "<I"), (40, "<I"), (44, "<I"), (48, "<Q"),
                                              (56, "<Q"), (64, "<I")]), label="field")
        bits = struct.calcsize(fmt) * 8
        struct.pack_into(fmt, head, off, data.draw(st.integers(0, 2 ** bits - 1) | st.integers(0, 4), label="v"))
    struct.pack_into("<Q", head, 88, xxhash.xxh3_64_intdigest(bytes(head[:88])))
    try:
        decode_frame(bytes(head) + frame[HEADER_NBYTES:], KVPool.allocate(src.layout, 6), [0, 1, 2])
    except KVBridgeError:
        pass
