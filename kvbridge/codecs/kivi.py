"""``int4``: a KIVI-style 4-bit codec. Keys are quantized per channel (each channel of each head
over the tokens of a block: rotary keys have outlier channels), values per token (each token of
each head over ``head_dim``), both asymmetric with a float16 scale and minimum::

    lo, hi = min(x), max(x) over the group;  scale = fp16((hi - lo) / 15);  m = fp16(lo)
    q      = clamp(round((x - m) / scale), 0, 15)   (0 where scale == 0)
    x'     = q * scale + m                          (float32, then the destination dtype)

Two codes per byte (low nibble first) in canonical order. An MLA latent part is quantized as
keys. Body: key parameters (scale, min pairs per (layer, block, head, channel)), value
parameters (per (layer, block, row)), then the packed codes; each section 16-byte aligned.
This torch code is the definition; there is no CUDA kernel for it yet (on a device pool it
runs these torch operations on the device). Decode refuses parameters no encoder writes (NaN,
infinite, a negative scale) with :class:`IntegrityError` before a value lands, and clamps what it
decodes to the source dtype's finite range (the rounded top code of a float16 group spanning
+-65504 is 65536).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..errors import ConfigError, IntegrityError, ProtocolError
from ..layout import KVLayout, TokenOrder
from ..pool import KVPool
from .base import Codec, FrameHeader, layer_parts, layer_shape

__all__ = ["Int4Codec", "quantize_int4", "dequantize_int4"]

_LEVELS = 15.0
_CHUNK = 1 << 18  # values per chunk of blocks (cache-sized temporaries)


def _align(n: int) -> int:
    return -(-n // 16) * 16


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` over ``dim`` -> (uint8 codes 0..15 shaped like x, float16 params (..., 2) with the
    reduced dim removed: [scale, min])."""
    xf = x.to(torch.float32)
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    scale = ((hi - lo) / _LEVELS).to(torch.float16)
    m = lo.to(torch.float16)
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(m).all())):
        raise ConfigError("KV values too large or non-finite for int4's float16 parameters; use a lossless "
                          "codec or int8")
    s32, m32 = scale.to(torch.float32), m.to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros((), device=x.device))
    q = torch.round((xf - m32) * inv).clamp_(0, _LEVELS).to(torch.uint8)
    return q, torch.stack([scale.squeeze(dim), m.squeeze(dim)], -1)


def dequantize_int4(q: torch.Tensor, params: torch.Tensor, dim: int) -> torch.Tensor:
    scale = params[..., 0].to(torch.float32).unsqueeze(dim)
    m = params[..., 1].to(torch.float32).unsqueeze(dim)
    return q.to(torch.float32) * scale + m


def _pack(q: torch.Tensor) -> torch.Tensor:
    f = q.reshape(-1, 2)
    return f[:, 0] | (f[:, 1] << 4)


def _unpack(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 0xF, b >> 4], -1).reshape(-1)


class Int4Codec(Codec):
    """KIVI-style 4-bit: keys per channel (over a block's tokens), values per token."""

    name = "int4"
    lossless = False
    # float KV, fp8 included (halved); int8/uint8 pools hold bytes whose values int4 cannot know
    source_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                               torch.float8_e5m2})

    @staticmethod
    def _token_dim(h: Any) -> int:
        """Axis of the tokens in one gathered part (n, *part_shape)."""
        return 2 if (h.num_parts == 2 and h.token_order is TokenOrder.HND) else 1

    @staticmethod
    def _sizes(h: Any, n: int, nl: int) -> tuple[int, int, int]:
        """Bytes of the key parameters, the value parameters and the packed codes."""
        rows = h.block_size * h.num_kv_heads
        kp = nl * n * h.num_kv_heads * h.head_dim * 4
        vp = nl * n * rows * 4 if h.num_parts == 2 else 0
        codes = nl * h.num_parts * n * rows * h.head_dim // 2
        return _align(kp), _align(vp), codes

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        return sum(self._sizes(layout, num_blocks, num_layers))

    def _aux_ok(self, hdr: FrameHeader) -> bool:
        return hdr.aux == 4

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        if (L.block_size * L.num_kv_heads * L.head_dim) % 2:
            raise ConfigError("int4 packs two values per byte: a part needs an even number of values")
        kp, vp, nc = self._sizes(L, n, len(layers))
        kpar = body[:kp].view(torch.float16)
        vpar = body[kp:kp + vp].view(torch.float16)
        codes = body[kp + vp:kp + vp + nc]
        body[:kp + vp].zero_()  # alignment padding included: never send stale memory
        tdim = self._token_dim(L)
        parts = [layer_parts(pool, layer) for layer in layers]
        cuda = pool.device.type == "cuda"
        tmp = torch.empty((n if cuda else min(n, self._chunk(L)), *L.part_shape), dtype=L.torch_dtype,
                          device=pool.device)
        for i, p, j0, j1, coff, poff in self._plan(L, n, len(layers), cuda):
            x = tmp[:j1 - j0]
            torch.index_select(parts[i][p], 0, idx[j0:j1], out=x)
            qq, pp = quantize_int4(x, tdim if p == 0 else -1)
            packed = _pack(qq)
            codes[coff:coff + packed.numel()].copy_(packed)
            (kpar if p == 0 else vpar)[poff:poff + pp.numel()].copy_(pp.reshape(-1))
        return kp + vp + nc, 4

    def _chunk(self, h: Any) -> int:
        return int(max(1, _CHUNK // (h.block_size * h.num_kv_heads * h.head_dim)))

    def _plan(self, h: Any, n: int, nl: int, cuda: bool) -> Iterator[tuple[int, int, int, int, int, int]]:
        """(layer index, part, first block, end block, code byte offset, parameter offset in float16
        values) over chunks of blocks, in frame order."""
        pe = h.block_size * h.num_kv_heads * h.head_dim
        per_block = (h.num_kv_heads * h.head_dim * 2, h.block_size * h.num_kv_heads * 2)  # K, V parameters
        c = n if cuda else self._chunk(h)  # on a GPU one chunk per part
        for i in range(nl):
            for p in range(h.num_parts):
                for j0 in range(0, n, c):
                    coff = ((i * h.num_parts + p) * n + j0) * pe // 2
                    yield i, p, j0, min(n, j0 + c), coff, (i * n + j0) * per_block[p]

    def _decode_into(self, body: torch.Tensor, hdr: FrameHeader, pool: KVPool, idx: torch.Tensor) -> None:
        n, nl = hdr.num_blocks, hdr.num_layers
        if (hdr.rows_per_part * hdr.head_dim) % 2:
            raise ProtocolError(f"int4 frame for parts of an odd number of values ({hdr.rows_per_part} x "
                                f"{hdr.head_dim}): no encoder writes one (two values per byte)")
        kp, vp, nc = self._sizes(hdr, n, nl)
        if hdr.body_nbytes != kp + vp + nc:
            raise ProtocolError(f"int4 frame body is {hdr.body_nbytes} bytes, its geometry makes {kp + vp + nc}")
        body = body.to(pool.device)
        if body.data_ptr() % 2:
            body = body.clone()
        part = layer_shape(hdr, 1)[2:]
        tdim = self._token_dim(hdr)
        kshape = list(part)
        del kshape[tdim - 1]
        kpar = body[:kp].view(torch.float16)
        vpar = body[kp:kp + vp].view(torch.float16)
        codes = body[kp + vp:kp + vp + nc]
        # an encoder writes finite (scale >= 0, min) pairs and zero padding: refuse anything else
        # before a value is written (one fused reduction per parameter section)
        for par in (kpar, vpar):
            pairs = par[:par.numel() // 2 * 2].view(-1, 2)
            if not bool((torch.isfinite(pairs).all(-1) & (pairs[:, 0] >= 0)).all()):
                raise IntegrityError("int4 frame holds NaN, infinite or negative parameters: refused before "
                                     "decoding")
        pe = hdr.rows_per_part * hdr.head_dim
        parts = [layer_parts(pool, layer) for layer in hdr.layers]
        # 15 * scale + min, both rounded to float16, can pass the source's largest value (65536 for
        # a float16 group spanning +-65504): clamp where the source dtype is that narrow
        top = torch.finfo(hdr.src_dtype).max
        clamp = top < _LEVELS * 65504.0 + 65504.0
        for i, p, j0, j1, coff, poff in self._plan(hdr, n, nl, pool.device.type == "cuda"):
            m = j1 - j0
            q = _unpack(codes[coff:coff + m * pe // 2]).view(m, *part)
            pshape = (m, *kshape, 2) if p == 0 else (m, *part[:-1], 2)
            npar = m * (hdr.num_kv_heads * hdr.head_dim * 2 if p == 0 else hdr.rows_per_part * 2)
            par = (kpar if p == 0 else vpar)[poff:poff + npar]
            x = dequantize_int4(q, par.view(pshape), tdim if p == 0 else -1)
            if clamp:
                x.clamp_(-top, top)
            dst = parts[i][p]        # one head: the frame's token order may not be the pool's, same bytes
            dst[idx[j0:j1]] = x.to(dst.dtype).reshape(m, *dst.shape[1:])
