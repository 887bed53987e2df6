"""Codec frames of a published handle: where a coded handle's bytes live until they are read.

A handle published with a codec other than ``raw`` is encoded once -- at publish for a whole
handle (one frame for all layers), at ``mark_ready`` for a layer-wise one (one frame per
layer) -- into one staging buffer, in shared memory when the sender serves ``shm://``.
Transports move frames like pool memory (:class:`~kvbridge.transports.base.Staging`); every
frame carries its header and a hash of its body (device frames included: hashed as they are
encoded), which the receiver requires and checks as it decodes. Frames vary in size, so coded
handles are always read by layer range, whose reply says how many bytes follow; a handle
published whole is read as ``[0, num_layers)`` in one reply, anything else is refused.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Optional, Sequence

import torch

from .codecs import HEADER_NBYTES, get_codec
from .codecs.base import _HEADER, read_header
from .codecs.registry import decode_frame
from .errors import ConfigError, IntegrityError, ProtocolError
from .pool import KVPool
from .segments import SharedSegment
from .transports.base import Spans, Staging

__all__ = ["FrameStore", "FrameLoader", "check_codec"]


def check_codec(name: str) -> None:
    """Refuse an unknown codec, or one whose optional dependency is missing, with a clear error."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"codec must be a codec name, got {name!r}")
    get_codec(name)


class FrameStore:
    """The frames of one handle's blocks in one staging buffer."""

    def __init__(self, codec: str, pool: KVPool, block_ids: Sequence[int], layerwise: bool, shared: bool) -> None:
        self.codec = get_codec(codec)
        self.pool = pool
        self.ids = list(block_ids)
        self.layerwise = layerwise
        L = pool.layout
        self.codec.check_layout(L)           # at publish, not at the first mark_ready
        self.per = -(-self.codec.max_encoded_nbytes(L, len(self.ids), 1 if layerwise else L.num_layers) // 16) * 16
        cap = self.per * (L.num_layers if layerwise else 1)
        dev = self.codec.output_device(pool)
        self.segment = None
        if shared and dev.type == "cpu":
            self.segment = SharedSegment(f"kvb-{os.getpid()}-{secrets.token_hex(6)}", max(cap, 1))
            data = self.segment.tensor()[:cap]
        else:
            data = torch.empty(cap, dtype=torch.uint8, device=dev)
        self.data = data
        self.staging = Staging(data, self.segment)
        # (offset, nbytes) of each frame encoded so far, in layer order: layer-wise, piece i holds
        # layer i at offset i * per; whole, the one piece holds every layer. Grown only under
        # _lock, by encode_upto, which is what keeps concurrent mark_ready calls apart.
        self.pieces: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._closed = False

    def encode_upto(self, end: int) -> None:
        """Encode layers ``0..end-1`` that are not encoded yet (layer-wise: one frame each, at its
        layer's slot; whole: all layers in one frame). Safe to call from several threads at once:
        each layer is encoded once. A failure (a lossy codec refusing non-finite KV) leaves the
        frames of the layers before it in place, and a later call starts again from there."""
        with self._lock:
            if self._closed:             # the handle ended: its staging buffer may be unmapped
                return
            if not self.layerwise:
                if not self.pieces:
                    self._encode_one(range(self.pool.layout.num_layers), 0)
                return
            for i in range(len(self.pieces), end):
                self._encode_one(range(i, i + 1), i * self.per)

    def _encode_one(self, layers: range, off: int) -> None:
        frame = self.codec.encode(self.pool, self.ids, layers, out=self.data[off:off + self.per], checksum=True)
        if frame.header.body_hash is None:     # a codec that overrides encode() and drops the hash
            raise ConfigError(f"codec {self.codec.name!r} made a frame without a body hash; kvbridge publishes "
                              "only hashed frames")
        self.pieces.append((off, frame.nbytes))

    def spans(self, lo: int, hi: int) -> Spans:
        """The frames of layers [lo, hi) in order (a whole handle: its one frame, from layer 0)."""
        if not self.layerwise:
            if lo != 0:
                raise ProtocolError("a coded handle published whole is read from layer 0")
            return self.staging.spans(self.pieces[:1])
        return self.staging.spans(self.pieces[lo:hi])

    def close(self) -> None:
        with self._lock:                 # an encode in progress finishes before the buffer goes
            self._closed = True
        self.staging.buffers = []
        if self.segment is not None:
            self.segment.close()


class FrameLoader:
    """The receiving side: a buffer for the frames a layer read brings, then their decode."""

    def __init__(self, codec: str, pool: KVPool, dst: Sequence[int], layerwise: bool) -> None:
        self.codec_name = codec
        self.codec = get_codec(codec)
        self.pool = pool
        self.dst = list(dst)
        self.layerwise = layerwise
        self.last_error: Optional[IntegrityError] = None   # the latest decode refused as corrupted

    def spans_for(self, lo: int, hi: int, nbytes: int) -> Spans:
        L = self.pool.layout
        if not 0 <= lo <= hi <= L.num_layers:    # before the range sizes anything
            raise ProtocolError(f"sender offers layers [{lo}, {hi}) of a handle of {L.num_layers} layers")
        if not self.layerwise and (lo, hi) != (0, L.num_layers):
            raise ProtocolError(f"sender offers layers [{lo}, {hi}) of a coded handle published whole: its one "
                                f"frame holds [0, {L.num_layers}), served in one reply")
        if hi == lo:                    # nothing ready yet: the sender said so with an empty range
            if nbytes:
                raise ProtocolError(f"sender offers {nbytes} bytes for an empty layer range")
            return Staging(torch.empty(0, dtype=torch.uint8)).spans([])
        most = (self.codec.max_encoded_nbytes(L, len(self.dst), 1) * (hi - lo) if self.layerwise
                else self.codec.max_encoded_nbytes(L, len(self.dst), L.num_layers))
        if not 0 < nbytes <= most:
            raise ProtocolError(f"sender offers {nbytes} bytes of {self.codec_name} frames for layers "
                                f"[{lo}, {hi}); at most {most} can be genuine")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return Staging(buf).spans([(0, nbytes)])

    def decode(self, spans: Spans, lo: int, hi: int) -> None:
        """Decode the frames that landed into the destination blocks (header and body hash
        checked first: IntegrityError for corrupted bytes, ProtocolError for malformed ones,
        for a frame without a body hash and for one whose source dtype is not the pool's)."""
        buf = spans.pool.buffers[0]
        pos = 0
        steps = [range(i, i + 1) for i in range(lo, hi)] if self.layerwise else [range(lo, hi)]
        for rng in steps:
            if pos + HEADER_NBYTES > buf.numel():
                raise ProtocolError("coded chunk ends inside a frame header")
            head = bytes(buf[pos:pos + HEADER_NBYTES].numpy())
            n = HEADER_NBYTES + _HEADER.unpack(head)[15]       # body size; decode_frame checks the rest
            if pos + n > buf.numel():
                raise ProtocolError("coded chunk ends inside a frame")
            frame = buf[pos:pos + n]
            hdr = read_header(frame)
            if hdr.body_hash is None:
                raise ProtocolError(f"{hdr.codec} frame of layers {hdr.layers} carries no body hash: a sender "
                                    "publishes only hashed frames")
            if hdr.src_dtype != self.pool.layout.torch_dtype:
                raise ProtocolError(f"{hdr.codec} frame holds {hdr.src_dtype} KV, the handle's layout (and this "
                                    f"pool) {self.pool.layout.torch_dtype}")
            decode_frame(frame, self.pool, self.dst, rng, expect_codec=self.codec_name)
            pos += n
        if pos != buf.numel():
            raise ProtocolError(f"coded chunk has {buf.numel() - pos} bytes after its frames")
