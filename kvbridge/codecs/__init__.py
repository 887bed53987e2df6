"""Codecs for KV blocks: lossless (lz4, zstd, with byte shuffle) and lossy (int8, fp8).

The transfer pipeline uses three calls::

    codec = get_codec(handle.codec)                       # ConfigError / BackendUnavailable
    frame = codec.encode(pool, block_ids, layers=None)    # EncodedKV: .data (uint8 tensor), .header
    decode_frame(frame_bytes, dst_pool, dst_block_ids, expect_codec=handle.codec)

and :func:`choose_codec` picks one from measured link and codec speeds.
"""

from .auto import CodecChoice, CodecSpeed, break_even_gbps, choose_codec, measure_codec_speeds
from .base import HEADER_NBYTES, Codec, EncodedKV, FrameHeader, RawCodec, read_header, seal_frame
from .registry import available_codecs, codec_names, decode_frame, get_codec, is_lossless, known_codecs, register_codec

__all__ = [
    "Codec", "RawCodec", "EncodedKV", "FrameHeader", "HEADER_NBYTES", "read_header", "seal_frame", "known_codecs",
    "get_codec", "register_codec", "available_codecs", "codec_names", "decode_frame", "is_lossless", "CodecSpeed",
    "CodecChoice", "choose_codec", "break_even_gbps", "measure_codec_speeds",
]
