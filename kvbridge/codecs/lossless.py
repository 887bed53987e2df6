"""Lossless codecs: lz4 (block format) and zstd, each with an optional byte shuffle.

The body is the compressor's output over the gathered parts (canonical order, source
dtype). With ``+shuffle`` the bytes are first regrouped by their position in the element
(all low bytes, then all high bytes for 16-bit types): the sign/exponent byte of KV values
repeats far more than the mantissa byte, which the compressors then find. Compression runs
on the host; a device pool's blocks are gathered on the device and copied over first.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import lz4.block
import torch

from ..errors import IntegrityError, ProtocolError
from ..layout import KVLayout
from ..pool import KVPool
from .base import Codec, FrameHeader, as_byte_tensor, gather_layer, layer_shape, view_bytes

__all__ = ["LZ4Codec", "ZstdCodec", "shuffle_bytes", "unshuffle_bytes"]


def shuffle_bytes(x: torch.Tensor) -> torch.Tensor:
    """Bytes of ``x`` (contiguous) regrouped by position within the element: (itemsize * n,) uint8."""
    k = x.element_size()
    b = x.reshape(-1).view(torch.uint8)
    return b if k == 1 else b.view(-1, k).t().contiguous().view(-1)


def unshuffle_bytes(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Inverse of :func:`shuffle_bytes`: (n * itemsize,) uint8 in element order."""
    return b if itemsize == 1 else b.view(itemsize, -1).t().contiguous().view(-1)


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

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        return self._bound(num_layers * layout.num_parts * num_blocks * layout.part_nbytes)

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        raw = torch.empty((len(layers), *layer_shape(L, n)), dtype=L.torch_dtype, device=pool.device)
        for i, layer in enumerate(layers):
            gather_layer(pool, idx, layer, raw[i])
        if raw.device.type != "cpu":
            raw = raw.cpu()
        src = shuffle_bytes(raw) if self.shuffle else raw.view(-1).view(torch.uint8)
        packed = self._compress(memoryview(src.numpy()))
        m = len(packed)
        if m > body.numel():  # cannot happen: the bound is the compressor's own worst case
            raise ProtocolError(f"{self.name} output {m} bytes over its bound {body.numel()}")
        if m:
            body[:m].copy_(as_byte_tensor(packed))
        return m, (L.itemsize if self.shuffle else 0)

    def _decode_body(self, body: torch.Tensor, hdr: FrameHeader, device: torch.device) -> Iterator[torch.Tensor]:
        host = body if body.device.type == "cpu" else body.cpu()
        try:
            out = self._decompress(memoryview(host.numpy()), hdr.raw_nbytes)
        except Exception as exc:  # the compressors' own error types
            raise IntegrityError(f"{self.name} frame does not decompress ({type(exc).__name__}: {exc}): "
                                 "corrupted in flight") from None
        if len(out) != hdr.raw_nbytes:
            raise IntegrityError(f"{self.name} frame decompressed to {len(out)} bytes, header says "
                                 f"{hdr.raw_nbytes}: corrupted in flight")
        raw = as_byte_tensor(out)
        if self.shuffle:
            raw = unshuffle_bytes(raw, hdr.src_dtype.itemsize)
        per = hdr.raw_nbytes // hdr.num_layers
        shape = layer_shape(hdr, hdr.num_blocks)
        for i in range(hdr.num_layers):
            yield view_bytes(raw[i * per:(i + 1) * per], hdr.src_dtype, shape)


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
        return pair  # type: ignore[no-any-return]

    def _bound(self, n: int) -> int:
        small = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0  # ZSTD_compressBound
        return n + (n >> 8) + small + 64

    def _compress(self, src: memoryview) -> bytes:
        out: bytes = self._pair()[0].compress(src)
        return out

    def _decompress(self, src: memoryview, size: int) -> bytes:
        out: bytes = self._pair()[1].decompress(src, max_output_size=size)
        return out
