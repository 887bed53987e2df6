"""The codec interface and the encoded frame every codec produces.

A codec turns the KV of some blocks of a :class:`~kvbridge.pool.KVPool` into one
self-describing *frame* and back. The bytes of a frame are::

    header (96 bytes, little-endian, versioned, hashed)  |  body (codec-specific)

and the KV inside a body is always in kvbridge's canonical order: for each layer,
for each part (K, V, or the MLA latent), for each block of the request. Scales of the
lossy codecs travel inside the body, so a frame is all a receiver needs besides its own
pool. ``decode`` validates the header (magic, version, codec, geometry, sizes, hashes)
and refuses anything malformed with :class:`ProtocolError` (truncated, wrong version,
wrong codec), :class:`IntegrityError` (a hash mismatch: corrupted in flight) or
:class:`LayoutMismatch` (the destination pool cannot hold these parts), never with a
crash or a silent misread.

Encoding and decoding are batch operations: one gather (``index_select``) per
(layer, part) into a staging tensor, one indexed scatter per (layer, part)
out of it, never a Python object per block. ``layers`` restricts a frame to a range of
layers, which is how layer-by-layer streaming uses the same codec.
"""

from __future__ import annotations

import abc
import struct
import warnings
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Union

import torch
import xxhash

from ..errors import ConfigError, IntegrityError, LayoutMismatch, PoolError, ProtocolError
from ..layout import KVLayout, TokenOrder
from ..pool import KVPool

__all__ = [
    "FRAME_MAGIC", "FRAME_VERSION", "HEADER_NBYTES", "FrameHeader", "EncodedKV", "Codec", "RawCodec",
    "FrameInput", "read_header", "seal_frame", "as_byte_tensor", "block_index", "layer_range", "gather_layer",
    "scatter_layer", "layer_parts", "layer_shape", "view_bytes", "DTYPE_CODES",
]

FRAME_MAGIC = b"KVBC"
FRAME_VERSION = 1
# magic, version, flags, src dtype, token order, parts, reserved, header size, codec name,
# layer_start, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
# body_nbytes, raw_nbytes, aux, reserved, body_hash, reserved, header_hash
_HEADER = struct.Struct("<4sBBBBBBH12sIIIIIIQQIIQQQ")
HEADER_NBYTES = _HEADER.size  # 96: keeps the body 16-byte aligned
assert HEADER_NBYTES == 96
_FLAG_BODY_HASH = 1
_ALIGN = 16

# Stable wire codes of the element types (never renumber).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5, torch.int8: 6, torch.uint8: 7,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_ORDER_CODES = {TokenOrder.NHD: 0, TokenOrder.HND: 1}
_CODE_ORDERS = {v: k for k, v in _ORDER_CODES.items()}

FrameInput = Union[torch.Tensor, bytes, bytearray, memoryview, "EncodedKV"]


@dataclass(frozen=True)
class FrameHeader:
    """What a frame says about itself. ``raw_nbytes`` is the size of its KV in ``src_dtype``."""

    codec: str
    src_dtype: torch.dtype
    token_order: TokenOrder
    num_parts: int
    layer_start: int
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    body_nbytes: int
    raw_nbytes: int
    aux: int = 0
    body_hash: Optional[int] = None

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_start + self.num_layers)

    @property
    def rows_per_part(self) -> int:
        """Rows of ``head_dim`` elements in one part (tokens x heads)."""
        return self.block_size * self.num_kv_heads

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_parts * self.num_blocks * self.rows_per_part

    @property
    def num_elements(self) -> int:
        return self.num_rows * self.head_dim

    @property
    def frame_nbytes(self) -> int:
        return HEADER_NBYTES + self.body_nbytes

    def pack(self) -> bytes:
        flags = _FLAG_BODY_HASH if self.body_hash is not None else 0
        name = self.codec.encode()
        if len(name) > 12:
            raise ConfigError(f"codec name {self.codec!r} longer than 12 bytes")
        head = _HEADER.pack(
            FRAME_MAGIC, FRAME_VERSION, flags, DTYPE_CODES[self.src_dtype], _ORDER_CODES[self.token_order],
            self.num_parts, 0, HEADER_NBYTES, name, self.layer_start, self.num_layers, self.num_blocks,
            self.block_size, self.num_kv_heads, self.head_dim, self.body_nbytes, self.raw_nbytes, self.aux, 0,
            self.body_hash or 0, 0, 0)
        return head[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(head[:-8]))

    @classmethod
    def for_pool(cls, codec: str, layout: KVLayout, num_blocks: int, layers: range, body_nbytes: int = 0,
                 aux: int = 0) -> "FrameHeader":
        raw = len(layers) * layout.num_parts * num_blocks * layout.part_nbytes
        return cls(codec, layout.torch_dtype, layout.token_order, layout.num_parts, layers.start, len(layers),
                   num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim, body_nbytes, raw, aux)


def read_header(data: FrameInput) -> FrameHeader:
    """Parse and validate a frame's header (not its body). Raises :class:`ProtocolError` for a
    truncated or foreign frame, :class:`IntegrityError` for a corrupted header."""
    t = as_byte_tensor(data)
    if t.numel() < HEADER_NBYTES:
        raise ProtocolError(f"codec frame truncated: {t.numel()} bytes, the header alone is {HEADER_NBYTES}")
    head = bytes(t[:HEADER_NBYTES].cpu().numpy())
    (magic, version, flags, dcode, ocode, parts, _r0, hsize, name, l0, nl, nb, bs, nh, hd, body, raw, aux, _r1,
     bhash, _r2, hhash) = _HEADER.unpack(head)
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"not a kvbridge codec frame (magic {magic!r}, expected {FRAME_MAGIC!r})")
    if version != FRAME_VERSION:
        raise ProtocolError(f"codec frame version {version} not supported (this kvbridge reads version "
                            f"{FRAME_VERSION})")
    if xxhash.xxh3_64_intdigest(head[:-8]) != hhash:
        raise IntegrityError("codec frame header failed its checksum (corrupted in flight)")
    if hsize != HEADER_NBYTES or dcode not in _CODE_DTYPES or ocode not in _CODE_ORDERS or parts not in (1, 2):
        raise ProtocolError("codec frame header has invalid fields")
    if min(nl, nb, bs, nh, hd) <= 0:
        raise ProtocolError("codec frame header has a zero dimension")
    try:
        codec = name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("codec frame header names no valid codec") from None
    hdr = FrameHeader(codec, _CODE_DTYPES[dcode], _CODE_ORDERS[ocode], parts, l0, nl, nb, bs, nh, hd, body, raw,
                      aux, bhash if flags & _FLAG_BODY_HASH else None)
    if raw != hdr.num_elements * hdr.src_dtype.itemsize:
        raise ProtocolError(f"codec frame says {raw} raw bytes, its geometry makes "
                            f"{hdr.num_elements * hdr.src_dtype.itemsize}")
    if t.numel() != HEADER_NBYTES + body:
        what = "truncated" if t.numel() < HEADER_NBYTES + body else "has trailing bytes"
        raise ProtocolError(f"codec frame {what}: {t.numel()} bytes, header says {HEADER_NBYTES + body}")
    return hdr


@dataclass(frozen=True)
class EncodedKV:
    """One encoded frame: ``data`` (a 1-D uint8 tensor, header + body, on the pool's device
    for raw and the lossy codecs, on the host for compressors) and its parsed header."""

    data: torch.Tensor
    header: FrameHeader

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def raw_nbytes(self) -> int:
        return self.header.raw_nbytes

    @property
    def ratio(self) -> float:
        """Raw KV bytes per frame byte (>1: smaller on the wire)."""
        return self.raw_nbytes / max(1, self.nbytes)

    def memoryview(self) -> memoryview:
        """The frame as a byte memoryview (host frames; no copy)."""
        if self.data.device.type != "cpu":
            raise ConfigError("memoryview() needs a host frame; copy a device frame to pinned memory first")
        return self.data.numpy().data.cast("B")

    def __bytes__(self) -> bytes:
        return bytes(self.data.cpu().numpy())


def as_byte_tensor(data: FrameInput) -> torch.Tensor:
    """A flat uint8 tensor over ``data`` without copying (bytes-likes are wrapped read-only; a
    strided tensor is copied into one run)."""
    if isinstance(data, EncodedKV):
        return data.data
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ConfigError(f"a codec frame tensor must be 1-D uint8, got {data.dtype} {tuple(data.shape)}")
        return data if data.is_contiguous() else data.contiguous()   # a strided view: hashed and viewed as one run
    mv = memoryview(data)
    mv = (mv if mv.c_contiguous else memoryview(mv.tobytes())).cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers: decode never writes into its input
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def block_index(pool: KVPool, block_ids: Union[Sequence[int], torch.Tensor], unique: bool = False) -> torch.Tensor:
    """``block_ids`` as an int64 index tensor on the pool's device, range-checked (``unique``: and
    without repeats, as destinations must be: two blocks decoded into one would overwrite each other)."""
    idx = torch.as_tensor(block_ids, dtype=torch.long)
    if idx.dim() != 1 or idx.numel() == 0:
        raise PoolError("a codec needs a non-empty 1-D list of block ids")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= pool.num_blocks:
        raise PoolError(f"block id {lo if lo < 0 else hi} outside a pool of {pool.num_blocks} blocks")
    if unique and idx.numel() > 1 and int(torch.unique(idx).numel()) != idx.numel():
        raise PoolError("duplicate destination block ids")
    return idx.to(pool.device)


def layer_range(layout: KVLayout, layers: Union[range, int, None]) -> range:
    """Normalise ``layers`` (None: all, an int: that one layer, a step-1 range) and check it."""
    if layers is None:
        return range(layout.num_layers)
    if isinstance(layers, int):
        layers = range(layers, layers + 1)
    if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > layout.num_layers:
        raise ConfigError(f"layers {layers} is not a non-empty step-1 range within {layout.num_layers} layers")
    return layers


def layer_parts(pool: KVPool, layer: int) -> tuple[torch.Tensor, ...]:
    """(K, V), each (num_blocks, *part_shape), or (latent,) of one layer."""
    kv = pool.layer_kv(layer)
    return kv if isinstance(kv, tuple) else (kv,)


def gather_layer(pool: KVPool, idx: torch.Tensor, layer: int, out: torch.Tensor) -> torch.Tensor:
    """Gather the parts of blocks ``idx`` of one layer into ``out`` (parts, n, *part_shape), in the
    pool's dtype: one ``index_select`` per part."""
    for p, src in enumerate(layer_parts(pool, layer)):
        torch.index_select(src, 0, idx, out=out[p])
    return out


def scatter_layer(pool: KVPool, idx: torch.Tensor, layer: int, src: torch.Tensor) -> None:
    """Write ``src`` (parts, n, *part_shape), any float dtype, into blocks ``idx`` of one layer,
    converting to the pool's dtype: one indexed copy per part."""
    for p, dst in enumerate(layer_parts(pool, layer)):
        part = src[p]
        if part.dtype != dst.dtype or part.device != dst.device:
            part = part.to(device=dst.device, dtype=dst.dtype)
        if part.shape[1:] != dst.shape[1:]:   # one head, the other token order: the same bytes (_check_geometry)
            part = part.reshape(part.shape[0], *dst.shape[1:])
        dst[idx] = part  # index_put_: ~1.4x index_copy_ on the CPU


def _check_geometry(hdr: FrameHeader, layout: KVLayout, n: int, layers: Optional[range]) -> None:
    theirs = {"block_size": hdr.block_size, "num_kv_heads": hdr.num_kv_heads, "head_dim": hdr.head_dim,
              "num_parts": hdr.num_parts, "token_order": hdr.token_order.value}
    ours = {"block_size": layout.block_size, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "num_parts": layout.num_parts, "token_order": layout.token_order.value}
    if hdr.num_kv_heads == layout.num_kv_heads == 1:   # one head: NHD and HND parts are the same bytes
        del theirs["token_order"], ours["token_order"]
    diff = [f"{k}: frame {theirs[k]!r} != pool {ours[k]!r}" for k in theirs if theirs[k] != ours[k]]
    if diff:
        raise LayoutMismatch("codec frame does not fit the destination pool: " + ", ".join(diff))
    if hdr.layers.stop > layout.num_layers:
        raise LayoutMismatch(f"codec frame holds layers {hdr.layers}, the pool has {layout.num_layers}")
    if layers is not None and hdr.layers != layers:
        raise ProtocolError(f"codec frame holds layers {hdr.layers}, the caller expected {layers}")
    if hdr.num_blocks != n:
        raise PoolError(f"codec frame holds {hdr.num_blocks} blocks, {n} destination block ids given")


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Codec(abc.ABC):
    """Encode blocks of a pool into one frame, decode a frame into blocks of another pool.

    Subclasses implement :meth:`max_body_nbytes`, :meth:`_encode_body` and
    :meth:`_decode_body`; the base class owns the frame, its validation and the pool
    access. A codec instance is stateless and may be shared between threads.
    """

    name: str = ""
    lossless: bool = True
    # the KV dtypes this codec encodes (None: any); a frame saying its KV was another is refused
    source_dtypes: Optional[frozenset[torch.dtype]] = None
    # where an ``out`` staging buffer must start (the body's sections are viewed as wider types)
    out_align: int = _ALIGN

    # -- subclass hooks --------------------------------------------------------------
    @abc.abstractmethod
    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        """Upper bound of the body for this geometry (to size a staging buffer)."""

    @abc.abstractmethod
    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        """Encode into ``body`` (uint8, capacity :meth:`max_body_nbytes`); return (bytes written, aux)."""

    def _decode_body(self, body: torch.Tensor, hdr: FrameHeader, device: torch.device) -> Iterator[torch.Tensor]:
        """Yield each layer's KV as a (parts, n, *part_shape) float tensor, in frame order (used by the
        default :meth:`_decode_into`; a codec overrides one of the two)."""
        raise NotImplementedError

    def _aux_ok(self, hdr: FrameHeader) -> bool:
        return hdr.aux == 0

    def output_device(self, pool: KVPool) -> torch.device:
        """Where :meth:`encode` leaves its frame."""
        return pool.device

    def check_layout(self, layout: KVLayout) -> None:
        """Refuse (:class:`ConfigError`) a pool whose KV this codec cannot encode."""
        ok = self.source_dtypes
        if ok is not None and layout.torch_dtype not in ok:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in ok))
            raise ConfigError(f"codec {self.name!r} cannot encode {layout.dtype} KV (it takes {names}); "
                              "use a lossless codec")

    # -- public API --------------------------------------------------------------------
    def max_encoded_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: Optional[int] = None) -> int:
        """Upper bound of a frame (header included) for ``num_blocks`` blocks of ``num_layers`` layers."""
        nl = layout.num_layers if num_layers is None else num_layers
        return HEADER_NBYTES + self.max_body_nbytes(layout, num_blocks, nl)

    def encode(self, pool: KVPool, block_ids: Union[Sequence[int], torch.Tensor],
               layers: Union[range, int, None] = None, *, out: Optional[torch.Tensor] = None,
               checksum: Optional[bool] = None) -> EncodedKV:
        """Encode blocks ``block_ids`` of ``pool`` (all layers, or ``layers``) into one frame.

        ``out``: a 1-D contiguous uint8 staging tensor of at least :meth:`max_encoded_nbytes` bytes
        on :meth:`output_device` (pinned host memory, a registered buffer), starting
        ``out_align``-byte aligned (16; compressors: any byte); the frame is a view of its
        beginning. ``checksum`` (default: on for host frames) adds an xxh3-64 of the body that
        :meth:`decode` verifies; device frames are hashed by whoever stages them to the host.
        """
        L = pool.layout
        self.check_layout(L)
        rng = layer_range(L, layers)
        idx = block_index(pool, block_ids)
        n = int(idx.numel())
        cap = self.max_encoded_nbytes(L, n, len(rng))
        dev = self.output_device(pool)
        if out is None:
            out = torch.empty(cap, dtype=torch.uint8, device=dev)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < cap or out.device != dev:
            raise ConfigError(f"out must be a 1-D uint8 tensor of >= {cap} bytes on {dev}")
        elif not out.is_contiguous() or out.data_ptr() % self.out_align:
            raise ConfigError(f"out must be contiguous and start {self.out_align}-byte aligned for codec "
                              f"{self.name!r} (a slice of a staging buffer at a multiple of {self.out_align})")
        body = out[HEADER_NBYTES:cap]
        written, aux = self._encode_body(pool, idx, rng, body)
        hdr = FrameHeader.for_pool(self.name, L, n, rng, written, aux)
        if checksum is None:
            checksum = dev.type == "cpu"
        if checksum:
            hdr = replace(hdr, body_hash=_hash(body[:written]))
        out[:HEADER_NBYTES].copy_(torch.frombuffer(bytearray(hdr.pack()), dtype=torch.uint8))
        return EncodedKV(out[:HEADER_NBYTES + written], hdr)

    def decode(self, data: FrameInput, pool: KVPool, block_ids: Union[Sequence[int], torch.Tensor],
               layers: Union[range, int, None] = None) -> FrameHeader:
        """Decode a frame into blocks ``block_ids`` of ``pool``, converting to the pool's dtype.

        ``layers`` (optional) is the layer range the caller expects the frame to hold.
        Returns the frame's header. Nothing is written unless the header and the body hash
        (when present) check out.
        """
        t = as_byte_tensor(data)
        hdr = read_header(t)
        if hdr.codec != self.name:
            raise ProtocolError(f"frame was encoded with codec {hdr.codec!r}, not {self.name!r}")
        if not self._aux_ok(hdr):
            raise ProtocolError(f"codec {self.name!r} frame has unexpected parameter {hdr.aux}")
        if self.source_dtypes is not None and hdr.src_dtype not in self.source_dtypes:
            raise ProtocolError(f"codec {self.name!r} frame says its KV was {hdr.src_dtype}: no encoder "
                                "writes one")
        expect = None if layers is None else layer_range(pool.layout, layers)
        idx = block_index(pool, block_ids, unique=True)
        _check_geometry(hdr, pool.layout, int(idx.numel()), expect)
        body = t[HEADER_NBYTES:]
        if hdr.body_hash is not None and _hash(body) != hdr.body_hash:
            raise IntegrityError(f"codec frame body failed its checksum ({hdr.body_nbytes} bytes, codec "
                                 f"{hdr.codec!r}): corrupted in flight")
        self._decode_into(body, hdr, pool, idx)
        return hdr

    def _decode_into(self, body: torch.Tensor, hdr: FrameHeader, pool: KVPool, idx: torch.Tensor) -> None:
        """Write a validated frame's body into blocks ``idx`` (a fused kernel may override this)."""
        for layer, kv in zip(hdr.layers, self._decode_body(body, hdr, pool.device)):
            scatter_layer(pool, idx, layer, kv)

    def encode_layer(self, pool: KVPool, block_ids: Union[Sequence[int], torch.Tensor], layer: int, *,
                     out: Optional[torch.Tensor] = None, checksum: Optional[bool] = None) -> EncodedKV:
        """:meth:`encode` of one layer (layer-by-layer streaming)."""
        return self.encode(pool, block_ids, range(layer, layer + 1), out=out, checksum=checksum)

    def decode_layer(self, data: FrameInput, pool: KVPool, block_ids: Union[Sequence[int], torch.Tensor],
                     layer: int) -> FrameHeader:
        """:meth:`decode` of a frame that must hold exactly ``layer``."""
        return self.decode(data, pool, block_ids, range(layer, layer + 1))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def seal_frame(frame: torch.Tensor) -> FrameHeader:
    """Add the body checksum to a frame in place (a 1-D uint8 host tensor, e.g. a device frame
    just copied to a pinned staging buffer) and return its new header. A sealed frame stays as it is."""
    if frame.device.type != "cpu":
        raise ConfigError("seal_frame() hashes host memory; copy the device frame to the host first")
    hdr = read_header(frame)
    if hdr.body_hash is None:
        hdr = replace(hdr, body_hash=_hash(frame[HEADER_NBYTES:]))
        frame[:HEADER_NBYTES].copy_(torch.frombuffer(bytearray(hdr.pack()), dtype=torch.uint8))
    return hdr


def _hash(body: torch.Tensor) -> int:
    host = body if body.device.type == "cpu" else body.cpu()
    if host.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(host.numpy().data)


def layer_shape(hdr_or_layout: Union[FrameHeader, KVLayout], n: int) -> tuple[int, ...]:
    """(parts, n, *part_shape) of one layer of a frame or layout."""
    if isinstance(hdr_or_layout, KVLayout):
        return (hdr_or_layout.num_parts, n, *hdr_or_layout.part_shape)
    h = hdr_or_layout
    if h.num_parts == 1:
        part: tuple[int, ...] = (h.block_size, h.head_dim)
    elif h.token_order is TokenOrder.NHD:
        part = (h.block_size, h.num_kv_heads, h.head_dim)
    else:
        part = (h.num_kv_heads, h.block_size, h.head_dim)
    return (h.num_parts, n, *part)


class RawCodec(Codec):
    """The identity: the gathered parts as they are, in the source dtype."""

    name = "raw"

    def max_body_nbytes(self, layout: KVLayout, num_blocks: int, num_layers: int) -> int:
        return num_layers * layout.num_parts * num_blocks * layout.part_nbytes

    def _encode_body(self, pool: KVPool, idx: torch.Tensor, layers: range, body: torch.Tensor) -> tuple[int, int]:
        L, n = pool.layout, int(idx.numel())
        per = L.num_parts * n * L.part_nbytes
        for i, layer in enumerate(layers):
            dst = body[i * per:(i + 1) * per].view(L.torch_dtype).view(layer_shape(L, n))
            gather_layer(pool, idx, layer, dst)
        return per * len(layers), 0

    def _decode_body(self, body: torch.Tensor, hdr: FrameHeader, device: torch.device) -> Iterator[torch.Tensor]:
        per = hdr.raw_nbytes // hdr.num_layers
        if hdr.body_nbytes != hdr.raw_nbytes:
            raise ProtocolError(f"raw frame body is {hdr.body_nbytes} bytes, its geometry makes {hdr.raw_nbytes}")
        shape = layer_shape(hdr, hdr.num_blocks)
        for i in range(hdr.num_layers):
            yield view_bytes(body[i * per:(i + 1) * per], hdr.src_dtype, shape)


def view_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` bytes as a ``dtype`` tensor of ``shape`` (copied first if misaligned)."""
    if raw.data_ptr() % max(1, dtype.itemsize):
        raw = raw.clone()
    return raw.view(dtype).view(shape)

