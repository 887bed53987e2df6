"""Lossless codecs: lz4 (block format) and zstd, each with an optional byte shuffle.

The gathered parts (canonical order, source dtype) form one *plane*, or with ``+shuffle`` one
plane per byte of the element (for 16-bit types all low bytes, then all high bytes): the
sign/exponent byte of KV values repeats far more than the mantissa byte. Each plane is cut into
chunks of ``2**chunk_shift`` bytes (1 MiB) compressed independently (the compressors run 2-4x
faster on 1 MiB pieces than on one 64 MiB buffer here); a chunk that does not shrink is stored
as it is, so incompressible mantissa bytes cost no decode time. Body::

    table: one (stored length u32, mode u8, 3 pad) per chunk, planes in order
    the chunks, back to back

``aux`` in the header is ``chunk_shift << 8 | shuffle itemsize`` (0 without shuffle).
Compression runs on the host; a device pool's blocks are gathered on the device and copied over.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Iterator

import lz4.block  # type: ignore[import-untyped]
import numpy as np
import torch

from ..errors import IntegrityError, ProtocolError
from ..layout import KVLayout
from ..pool import KVPool
from .base import Codec, FrameHeader, as_byte_tensor, gather_layer, layer_shape, view_bytes

__all__ = ["LZ4Codec", "ZstdCodec", "shuffle_bytes", "unshuffle_bytes"]

_ENTRY = struct.Struct("<IB3x")  # stored length, mode (1: compressed, 0: stored)
CHUNK_SHIFT = 20


def shuffle_bytes(x: torch.Tensor) -> torch.Tensor:
    """Bytes of ``x`` (contiguous, host) regrouped by position within the element: (itemsize * n,) uint8."""
    k = x.element_size()
    b = x.reshape(-1).view(torch.uint8)
    if k == 1:
        return b
    out = torch.empty_like(b)
    np.copyto(out.numpy().reshape(k, -1), b.numpy().reshape(-1, k).T)  # numpy: ~5x torch's transpose here
    return out


def unshuffle_bytes(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Inverse of :func:`shuffle_bytes`: (n * itemsize,) uint8 in element order."""
    if itemsize == 1:
        return b
    out = torch.empty_like(b)
    np.copyto(out.numpy().reshape(-1, itemsize), b.numpy().reshape(itemsize, -1).T)
    return out


class _Compressor(Codec):
    """Gather on the pool's device, compress on the host."""

    lossless = True
    base_name = ""
    out_align = 1         # bodies are written through numpy, byte by byte

    def __init__(self, shuffle: bool = False) -> None:
        self.shuffle = shuffle
        self.name = self.base_name + ("+shuffle" if shuffle else "")

    def output_device(self, pool: KVPool) -> torch.device:
        return torch.device("cpu")

    def _aux_ok(self, hdr: FrameHeader) -> bool:
        return hdr.aux == self._aux(hdr.src_dtype.itemsize)

    def _aux(self, itemsize: int) -> int:
        return CHUNK_SHIFT << 8 | (itemsize if self.shuffle else 0)

    def _bound(self, n: int) -> int:
        raise NotImplementedError

    def _compress(self, src: memoryview) -> bytes:
        raise NotImplementedError

    def _decompress(self, src: memoryview, size: int) -> bytes:
        raise NotImplementedError

    def _layout(self, raw_nbytes: int, itemsize: int) -> tuple[int, int, int]:
        """(planes, bytes per plane, chunks per plane)."""
        k = itemsize if self.shuffle else 1
        plane = raw_nbytes // k
        return k, plane, max(1, -(-plane // (1 << CHUNK_SHIFT)))

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        k, plane, nc = self._layout(num_layers * layout.num_parts * num_blocks * layout.part_nbytes, layout.itemsize)
        last = plane - (nc - 1) * (1 << CHUNK_SHIFT)
        return _ENTRY.size * k * nc + k * ((nc - 1) * self._bound(1 << CHUNK_SHIFT) + self._bound(last))

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        raw = torch.empty((len(layers), *layer_shape(L, n)), dtype=L.torch_dtype, device=pool.device)
        for i, layer in enumerate(layers):
            gather_layer(pool, idx, layer, raw[i])
        if raw.device.type != "cpu":
            raw = raw.cpu()
        flat = raw.view(-1).view(torch.uint8).numpy()
        k, plane_n, nc = self._layout(flat.size, L.itemsize)
        planes = [flat] if k == 1 else [np.ascontiguousarray(flat.reshape(-1, k)[:, j]) for j in range(k)]
        out = body.numpy()
        table = np.zeros((k * nc, 2), dtype=np.uint32)  # (stored length, mode) -> packed below
        pos = _ENTRY.size * k * nc
        step = 1 << CHUNK_SHIFT
        for j, plane in enumerate(planes):
            for c in range(nc):
                piece = plane[c * step:(c + 1) * step]
                packed = self._compress(piece.data) if piece.size else b""
                stored = len(packed) < piece.size
                data = np.frombuffer(packed, dtype=np.uint8) if stored else piece
                out[pos:pos + data.size] = data
                table[j * nc + c] = (data.size, 1 if stored else 0)
                pos += data.size
        out[:_ENTRY.size * k * nc] = np.frombuffer(
            b"".join(_ENTRY.pack(int(m), int(f)) for m, f in table), dtype=np.uint8)
        return pos, self._aux(L.itemsize)

    def _decode_body(self, body: torch.Tensor, hdr: FrameHeader, device: torch.device) -> Iterator[torch.Tensor]:
        host = (body if body.device.type == "cpu" else body.cpu()).numpy()
        k, plane_n, nc = self._layout(hdr.raw_nbytes, hdr.src_dtype.itemsize)
        head = _ENTRY.size * k * nc
        if host.size < head:
            raise ProtocolError(f"{self.name} frame body shorter than its chunk table")
        table = list(_ENTRY.iter_unpack(host[:head].tobytes()))
        if any(mode not in (0, 1) for _, mode in table) or head + sum(m for m, _ in table) != host.size:
            raise IntegrityError(f"{self.name} frame chunk table does not match its body: corrupted in flight")
        raw = np.empty(hdr.raw_nbytes, dtype=np.uint8)
        planes = raw.reshape(-1, k)
        step = 1 << CHUNK_SHIFT
        pos = head
        for e, (m, mode) in enumerate(table):
            j, c = divmod(e, nc)
            want = min(step, plane_n - c * step)
            chunk = host[pos:pos + m]
            pos += m
            if mode == 1:
                try:
                    piece = np.frombuffer(self._decompress(chunk.data, want), dtype=np.uint8)
                except IntegrityError:
                    raise
                except Exception as exc:  # the compressors' own error types
                    raise IntegrityError(f"{self.name} frame does not decompress ({type(exc).__name__}: {exc}):"
                                         " corrupted in flight") from None
            else:
                piece = chunk
            if piece.size != want:
                raise IntegrityError(f"{self.name} frame chunk {e} holds {piece.size} bytes, the header makes "
                                     f"{want}: corrupted in flight")
            if k == 1:
                raw[c * step:c * step + want] = piece
            else:
                planes[c * step:c * step + want, j] = piece
        t = as_byte_tensor(raw.data)
        per = hdr.raw_nbytes // hdr.num_layers
        shape = layer_shape(hdr, hdr.num_blocks)
        for i in range(hdr.num_layers):
            yield view_bytes(t[i * per:(i + 1) * per], hdr.src_dtype, shape)


class LZ4Codec(_Compressor):
    """lz4 block format (the fast one; finds little in fp16/bf16 KV without the shuffle)."""

    base_name = "lz4"

    def _bound(self, n: int) -> int:
        return n + n // 255 + 16

    def _compress(self, src: memoryview) -> bytes:
        out: bytes = lz4.block.compress(src, store_size=False)
        return out

    def _decompress(self, src: memoryview, size: int) -> bytes:
        if size == 0:
            return b""
        out: bytes = lz4.block.decompress(src, uncompressed_size=size)
        return out


class ZstdCodec(_Compressor):
    """zstd at ``level`` (default 1: the best ratio per CPU second on KV), needs ``kvbridge[zstd]``."""

    base_name = "zstd"

    def __init__(self, shuffle: bool = False, level: int = 1) -> None:
        import zstandard

        super().__init__(shuffle)
        self._zstd: Any = zstandard
        self.level = level
        self._local = threading.local()  # (de)compressor objects are not thread-safe

    def _pair(self) -> tuple[Any, Any]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            pair = (self._zstd.ZstdCompressor(level=self.level), self._zstd.ZstdDecompressor())
            self._local.pair = pair
        return pair

    def _bound(self, n: int) -> int:
        small = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0  # ZSTD_compressBound
        return n + (n >> 8) + small + 64

    def _compress(self, src: memoryview) -> bytes:
        out: bytes = self._pair()[0].compress(src)
        return out

    def _decompress(self, src: memoryview, size: int) -> bytes:
        # python-zstandard ignores max_output_size when the frame declares its content size and
        # allocates what the frame declares: a few KB could claim gigabytes. kvbridge's encoder
        # always declares the chunk's size; a frame that declares another is refused unread, one
        # that declares none is bounded by max_output_size.
        declared = self._zstd.frame_content_size(src)
        if declared not in (-1, size):
            raise IntegrityError(f"{self.name} frame chunk declares {declared} bytes, the header makes {size}: "
                                 "refused before decompressing")
        out: bytes = self._pair()[1].decompress(src, max_output_size=size)
        return out
