"""Lossless codecs: lz4 (block format) and zstd, each with an optional byte shuffle.

The body is a plane table (one ``(length u64, mode u8)`` entry of 16 bytes per plane) and the
planes: without shuffle one plane, the gathered parts (canonical order, source dtype); with
``+shuffle`` one plane per byte of the element (for 16-bit types the low bytes, then the high
bytes), each compressed on its own: the sign/exponent byte of KV values repeats far more than
the mantissa byte, and a plane that does not compress (mode 0) is stored as it is instead of
costing decode time. Compression runs
on the host; a device pool's blocks are gathered on the device and copied over first.
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

_PLANE = struct.Struct("<QB7x")  # stored length, mode (1: compressed, 0: stored), padding


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

    def __init__(self, shuffle: bool = False) -> None:
        self.shuffle = shuffle
        self.name = self.base_name + ("+shuffle" if shuffle else "")

    def output_device(self, pool: KVPool) -> torch.device:
        return torch.device("cpu")

    def _aux_ok(self, hdr: FrameHeader) -> bool:
        return hdr.aux == (hdr.src_dtype.itemsize if self.shuffle else 0)

    def _bound(self, n: int) -> int:
        raise NotImplementedError

    def _compress(self, src: memoryview) -> bytes:
        raise NotImplementedError

    def _decompress(self, src: memoryview, size: int) -> bytes:
        raise NotImplementedError

    def _planes(self, itemsize: int) -> int:
        return itemsize if self.shuffle else 1

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        k = self._planes(layout.itemsize)
        raw = num_layers * layout.num_parts * num_blocks * layout.part_nbytes
        return _PLANE.size * k + k * self._bound(raw // k)

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        raw = torch.empty((len(layers), *layer_shape(L, n)), dtype=L.torch_dtype, device=pool.device)
        for i, layer in enumerate(layers):
            gather_layer(pool, idx, layer, raw[i])
        if raw.device.type != "cpu":
            raw = raw.cpu()
        k = self._planes(L.itemsize)
        flat = raw.view(-1).view(torch.uint8).numpy()
        planes = [flat] if k == 1 else [np.ascontiguousarray(flat.reshape(-1, k)[:, j]) for j in range(k)]
        table = bytearray()
        pos = _PLANE.size * k
        out = body.numpy()
        for plane in planes:
            packed = self._compress(plane.data)
            stored = len(packed) < plane.nbytes  # an incompressible plane (mantissa bytes) is stored as is
            data = np.frombuffer(packed, dtype=np.uint8) if stored else plane
            if pos + data.nbytes > out.size:  # cannot happen: the bound is the compressor's own
                raise ProtocolError(f"{self.name} output over its bound {out.size}")
            out[pos:pos + data.nbytes] = data
            table += _PLANE.pack(data.nbytes, 1 if stored else 0)
            pos += data.nbytes
        out[:len(table)] = np.frombuffer(bytes(table), dtype=np.uint8)
        return pos, (L.itemsize if self.shuffle else 0)

    def _decode_body(self, body: torch.Tensor, hdr: FrameHeader, device: torch.device) -> Iterator[torch.Tensor]:
        host = (body if body.device.type == "cpu" else body.cpu()).numpy()
        k = self._planes(hdr.src_dtype.itemsize)
        plane_n = hdr.raw_nbytes // k
        if host.size < _PLANE.size * k:
            raise ProtocolError(f"{self.name} frame body shorter than its plane table")
        table = [_PLANE.unpack_from(host[:_PLANE.size * k].tobytes(), j * _PLANE.size) for j in range(k)]
        if any(mode not in (0, 1) for _, mode in table) or _PLANE.size * k + sum(n for n, _ in table) != host.size:
            raise IntegrityError(f"{self.name} frame plane table does not match its body: corrupted in flight")
        raw = np.empty(hdr.raw_nbytes, dtype=np.uint8) if k > 1 else None
        pos = _PLANE.size * k
        for j, (n, mode) in enumerate(table):
            chunk = host[pos:pos + n]
            pos += n
            if mode == 1:
                try:
                    plane = np.frombuffer(self._decompress(chunk.data, plane_n), dtype=np.uint8)
                except Exception as exc:  # the compressors' own error types
                    raise IntegrityError(f"{self.name} frame does not decompress ({type(exc).__name__}: {exc}):"
                                         " corrupted in flight") from None
            else:
                plane = chunk
            if plane.size != plane_n:
                raise IntegrityError(f"{self.name} frame plane {j} holds {plane.size} bytes, the header makes "
                                     f"{plane_n}: corrupted in flight")
            if raw is None:
                raw = plane
            else:
                raw.reshape(-1, k)[:, j] = plane
        assert raw is not None
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
        out: bytes = self._pair()[1].decompress(src, max_output_size=size)
        return out
