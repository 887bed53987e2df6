"""Lossy codecs: int8 and fp8 (e4m3) with absmax scales. These torch functions are each
codec's definition; the CUDA kernels in ``native/`` (loaded by :mod:`kvbridge.codecs.gpu`)
must reproduce them (int8 bit for bit, fp8 within one e4m3 step).

Quantization of a group ``x`` of values (a *row*: one token of one head, ``head_dim``
values; or, for ``fp8-block``, one whole part of one block)::

    amax  = max |x|                 (float32)
    scale = amax * float32(1/QMAX)  (float32, stored in the frame)
    inv   = QMAX / amax, 0 if amax == 0 (below 2^-96, where it would overflow: x and amax are
            first multiplied by 2^64, exactly)
    q     = round_half_even(x * inv) clamped to [-127, 127]          int8,  QMAX = 127
    q     = e4m3(clamp(x * inv, -448, 448)), round to nearest even    fp8,   QMAX = 448
    x'    = float32(q) * scale, then rounded to the destination dtype

Body of a frame: float32 scales (canonical order, padded to 16 bytes), then the quantized
values (canonical order). They take float32, float16 and bfloat16 KV; 8-bit KV (fp8, or bytes
in an int8/uint8 pool) and non-finite KV are refused at encode (:class:`ConfigError`); a
lossless codec carries them. Decode refuses what no encoder writes --
NaN, infinite or negative scales, scales above ``max(src dtype) / QMAX`` (they would decode to
inf), the int8 code -128, e4m3 NaN codes -- with
:class:`IntegrityError` before a value lands.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import ConfigError, IntegrityError, ProtocolError
from ..layout import KVLayout
from ..pool import KVPool
from .base import Codec, FrameHeader, layer_parts

__all__ = ["INT8_MAX", "FP8_MAX", "max_scale", "quantize_int8", "dequantize_int8", "quantize_fp8", "dequantize_fp8",
           "Int8Codec", "FP8Codec", "AbsmaxCodec"]

INT8_MAX = 127.0
FP8_MAX = 448.0
# 1/127 and 1/448 rounded to float32 (exactly representable here, so no double rounding):
# scale = amax * INV, the same constant the CUDA kernels multiply by.
_INV = {INT8_MAX: float.fromhex("0x1.020408p-7"), FP8_MAX: float.fromhex("0x1.24924ap-9")}
_INT_VIEW = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
             torch.bfloat16: (torch.int16, 0x7FFF)}
_ALIGN = 16
_CHUNK = 1 << 18  # values per quantization chunk (1 MiB of float32 temporaries)
_TINY, _UP = 2.0 ** -96, 2.0 ** 64  # rows with amax below _TINY are scaled by _UP (exactly) first


def _scaled(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``x * inv`` (a new tensor), float32 scales) per row of ``x`` (..., G).

    The absmax is exact in ``x``'s own dtype: for IEEE floats, |x| ordered as a float equals its
    bits without the sign ordered as an integer, and an integer max reduces several times faster
    on the CPU than a float one (a NaN has the largest bits and is refused below). The products
    are then computed in place on the float32 copy."""
    ibits = _INT_VIEW.get(x.dtype)
    if ibits is not None:
        itype, mask = ibits
        amax = (x.view(itype) & mask).amax(-1, keepdim=True).view(x.dtype).to(torch.float32)
    else:
        amax = x.abs().amax(-1, keepdim=True).to(torch.float32)
    if not bool(torch.isfinite(amax).all()):
        raise ConfigError("KV holds non-finite values (inf/nan) that a scaled codec cannot encode; "
                          "use a lossless codec")
    scale = (amax * _INV[qmax]).squeeze(-1)
    xf = x.to(torch.float32, copy=True)
    tiny = (amax < _TINY) & (amax > 0)      # all-zero rows (padding) need nothing
    if bool(tiny.any()):
        # QMAX / amax overflows float32 below ~1e-36 (subnormal or tiny normal groups: x * inf is
        # inf, 0 * inf NaN): scale those rows and their amax by 2^64 first. Powers of two are exact,
        # so x * inv rounds as it would without the overflow; other rows are untouched.
        up = torch.where(tiny, _UP, 1.0)
        amax = amax * up
        xf.mul_(up)
    # a true division (``qmax / amax`` with a Python number is ``amax.reciprocal() * qmax`` in torch:
    # rounded twice, a code in four differs from the kernels' correctly rounded QMAX / amax)
    inv = torch.where(amax > 0, torch.div(amax.new_full((), qmax), amax), amax.new_zeros(()))
    return xf.mul_(inv), scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (..., G), any float dtype -> (int8 (..., G), float32 scales (...))."""
    y, scale = _scaled(x, INT8_MAX)
    return y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (..., G) -> (float8_e4m3fn (..., G), float32 scales (...))."""
    y, scale = _scaled(x, FP8_MAX)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(q) * scale``; on the CPU float32(q) comes from a 256-entry table built by torch's own
    conversion (the same values, ~3x faster than ``q.to(float32)`` there)."""
    if q.device.type == "cpu":
        f = torch.index_select(_FP8_TABLE, 0, q.view(torch.uint8).reshape(-1).to(torch.int32)).view(q.shape)
    else:
        f = q.to(torch.float32)
    return (f * scale.unsqueeze(-1)).to(dtype)


_FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_FLOAT32_MAX = torch.finfo(torch.float32).max


def max_scale(src: torch.dtype, qmax: float) -> float:
    """The largest scale an encoder writes for KV of dtype ``src``: float32(max finite * 1/QMAX),
    computed as the encoder does. QMAX * it stays below that max (1/QMAX is rounded down)."""
    top = torch.tensor(torch.finfo(src).max, dtype=torch.float32) * torch.tensor(_INV[qmax], dtype=torch.float32)
    return float(top)


def _check_body(scales: torch.Tensor, q: torch.Tensor, name: str, limit: float = _FLOAT32_MAX) -> None:
    """Refuse what an encoder never writes, before anything is written: NaN, infinite or negative
    scales, or scales above ``limit`` (amax * 1/QMAX is finite, >= 0 and at most
    :func:`max_scale` of the source dtype: a larger one would decode to inf), the int8 code -128
    and the e4m3 NaN codes (values are clamped to +-127 and +-448). One reduction over each
    section (a few % of a decode)."""
    if not bool(((scales >= 0) & (scales <= limit)).all()):
        raise IntegrityError(f"{name} frame holds NaN, infinite, negative or out-of-range scales (above {limit:.6g}, "
                             "the largest its source dtype makes): refused before decoding")
    if q.dtype == torch.int8:
        bad = bool(q.amin() < -INT8_MAX)
    else:                                   # e4m3fn: NaN is S.1111.111, whatever the sign
        bad = bool((q.view(torch.uint8) & 0x7F).amax() == 0x7F)
    if bad:
        raise IntegrityError(f"{name} frame holds codes no encoder writes (int8 -128 or fp8 NaN): refused "
                             "before decoding")


class AbsmaxCodec(Codec):
    """Scaled 8-bit codecs: one float32 scale per row (a token of a head) or per part of a block."""

    lossless = False
    # 8-bit KV gains nothing from an 8-bit code plus scales; integer bytes are not values to scale
    source_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    qdtype: torch.dtype = torch.int8
    qmax = INT8_MAX
    kind = ""
    quantize: Quantize
    dequantize: Dequantize

    def __init__(self, per_block: bool = False, use_kernels: bool = True) -> None:
        self.per_block = per_block
        self.use_kernels = use_kernels

    # group: values sharing one scale
    def group(self, layout_or_hdr: Any) -> int:
        h = layout_or_hdr
        return int(h.block_size * h.num_kv_heads * h.head_dim if self.per_block else h.head_dim)

    def sizes(self, layout_or_hdr: Any, num_blocks: int, num_layers: int) -> tuple[int, int]:
        """(bytes of the scale section, number of quantized values)."""
        h = layout_or_hdr
        elems = num_layers * h.num_parts * num_blocks * h.block_size * h.num_kv_heads * h.head_dim
        return _align(4 * (elems // self.group(h))), elems

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        s, e = self.sizes(layout, num_blocks, num_layers)
        return s + e

    def _aux_ok(self, hdr: FrameHeader) -> bool:
        return hdr.aux == self.group(hdr)

    def _kernels(self, pool: KVPool) -> Optional[Any]:
        """The fused CUDA kernels for a device pool when CuPy is present, else None (torch)."""
        if not self.use_kernels or pool.device.type != "cuda":
            return None
        from . import gpu
        return gpu.kernels_or_none(pool.device) if gpu.supports(pool.layout.torch_dtype) else None

    def _sections(self, body: torch.Tensor, h: Any, n: int, nl: int) -> tuple[torch.Tensor, torch.Tensor]:
        sbytes, elems = self.sizes(h, n, nl)
        return body[:sbytes].view(torch.float32), body[sbytes:sbytes + elems].view(self.qdtype)

    def _plan(self, h: Any, n: int, nl: int, cuda: bool) -> Iterator[tuple[int, int, int, int, int, int]]:
        """(layer index, part, first block, last block + 1, value offset, scale offset) in frame order,
        over chunks of blocks of about ``_CHUNK`` values (temporaries stay cache-sized; on a GPU one
        chunk per part, as each chunk costs a launch and a synchronisation)."""
        pe = h.block_size * h.num_kv_heads * h.head_dim
        G = self.group(h)
        c = n if cuda else max(1, _CHUNK // pe)
        for i in range(nl):
            for p in range(h.num_parts):
                base = (i * h.num_parts + p) * n * pe
                for j0 in range(0, n, c):
                    off = base + j0 * pe
                    yield i, p, j0, min(n, j0 + c), off, off // G

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        G = self.group(L)
        scales, q = self._sections(body, L, n, len(layers))
        used = q.numel() // G * 4
        body[used:scales.numel() * 4].zero_()  # alignment padding: never send stale memory
        k = self._kernels(pool)
        if k is not None:
            k.encode(self.kind, pool, idx, layers, G, scales, q)
        else:
            pe = L.part_nbytes // L.itemsize
            cuda = pool.device.type == "cuda"
            c = n if cuda else max(1, min(n, _CHUNK // pe))
            tmp = torch.empty((c, *L.part_shape), dtype=L.torch_dtype, device=pool.device)
            parts = [layer_parts(pool, layer) for layer in layers]
            for i, p, j0, j1, off, soff in self._plan(L, n, len(layers), cuda):
                x = tmp[:j1 - j0]
                torch.index_select(parts[i][p], 0, idx[j0:j1], out=x)
                qq, sc = self.quantize(x.view(-1, G))
                q[off:off + qq.numel()].copy_(qq.view(-1))
                scales[soff:soff + sc.numel()].copy_(sc)
        return self.max_body_nbytes(L, n, len(layers)), G  # fixed size: scales (aligned), then values

    def _decode_into(self, body: torch.Tensor, hdr: FrameHeader, pool: KVPool, idx: torch.Tensor) -> None:
        sbytes, elems = self.sizes(hdr, hdr.num_blocks, hdr.num_layers)
        if hdr.body_nbytes != sbytes + elems:
            raise ProtocolError(f"{self.name} frame body is {hdr.body_nbytes} bytes, its geometry makes "
                                f"{sbytes + elems}")
        body = body.to(pool.device)
        if body.data_ptr() % 4:
            body = body.clone()
        scales, q = self._sections(body, hdr, hdr.num_blocks, hdr.num_layers)
        _check_body(scales, q, self.name, max_scale(hdr.src_dtype, self.qmax))
        k = self._kernels(pool)
        if k is not None:
            k.decode(self.kind, pool, idx, hdr.layers, self.group(hdr), scales, q)
            return
        G = self.group(hdr)
        pe = hdr.rows_per_part * hdr.head_dim
        parts = [layer_parts(pool, layer) for layer in hdr.layers]
        for i, p, j0, j1, off, soff in self._plan(hdr, hdr.num_blocks, hdr.num_layers, pool.device.type == "cuda"):
            dst = parts[i][p]
            qq = q[off:off + (j1 - j0) * pe].view(-1, G)
            x = self.dequantize(qq, scales[soff:soff + qq.shape[0]], dst.dtype)
            dst[idx[j0:j1]] = x.view(j1 - j0, *dst.shape[1:])   # one head: the pool's token order, same bytes


class Int8Codec(AbsmaxCodec):
    """int8 with one absmax scale per token per head (2x smaller than 16-bit KV, plus scales)."""

    name = "int8"
    kind = "int8"
    qdtype = torch.int8
    quantize = staticmethod(quantize_int8)
    dequantize = staticmethod(dequantize_int8)

    def __init__(self, use_kernels: bool = True) -> None:
        super().__init__(per_block=False, use_kernels=use_kernels)


class FP8Codec(AbsmaxCodec):
    """fp8 e4m3 with one scale per token per head, or (``per_block``) per part of a block."""

    qdtype = torch.float8_e4m3fn
    qmax = FP8_MAX
    quantize = staticmethod(quantize_fp8)
    dequantize = staticmethod(dequantize_fp8)

    def __init__(self, per_block: bool = False, use_kernels: bool = True) -> None:
        super().__init__(per_block=per_block, use_kernels=use_kernels)
        self.name = "fp8-block" if per_block else "fp8"
        self.kind = self.name
