"""Codecs for KV blocks: lossless (lz4, zstd, each with byte shuffle) and lossy (int8, fp8, int4).

How a transfer pipeline uses them (the handle carries only the codec *name*, ``KVHandle.codec``,
under its MAC; geometry, source dtype, layer range and scales travel in each frame)::

    # publish: check the name early (ConfigError lists the known ones; BackendUnavailable
    # names the extra), or let choose_codec pick it from measured figures
    codec = get_codec(name)

    # serve (sender): one frame per handle, or per layer range when streaming layer by layer
    staging = torch.empty(codec.max_encoded_nbytes(pool.layout, len(ids), nlayers),
                          dtype=torch.uint8, device=codec.output_device(pool))
    frame = codec.encode(pool, ids, layers=range(l0, l1), out=staging)
    send(frame.nbytes, frame.memoryview())     # lossless frames vary in size: send the length
    # (device pools: raw/int8/fp8/int4 frames are on the device; copy frame.data to pinned
    #  memory, then seal_frame(pinned[:frame.nbytes]) adds the body checksum)

    # fetch (receiver): validates everything before writing, converts to dst's dtype
    decode_frame(received, dst_pool, dst_ids, layers=range(l0, l1), expect_codec=handle.codec)

Errors: :class:`~kvbridge.errors.ProtocolError` (truncated, foreign, other codec or version,
unexpected layers), :class:`~kvbridge.errors.IntegrityError` (a checksum or decompression
failure: refetch), :class:`~kvbridge.errors.LayoutMismatch`, :class:`~kvbridge.errors.PoolError`.
A frame's own xxh3 replaces the handle's per-block checksums for lossy codecs (the decoded
blocks differ from the source by design); after a lossless decode into a pool of the same
dtype those checksums still hold.
"""

from .auto import CodecChoice, CodecSpeed, break_even_gbps, choose_codec, measure_codec_speeds
from .base import HEADER_NBYTES, Codec, EncodedKV, FrameHeader, RawCodec, read_header, seal_frame
from .registry import available_codecs, codec_names, decode_frame, get_codec, is_lossless, known_codecs, register_codec

__all__ = [
    "Codec", "RawCodec", "EncodedKV", "FrameHeader", "HEADER_NBYTES", "read_header", "seal_frame", "known_codecs",
    "get_codec", "register_codec", "available_codecs", "codec_names", "decode_frame", "is_lossless", "CodecSpeed",
    "CodecChoice", "choose_codec", "break_even_gbps", "measure_codec_speeds",
]
