"""KVLayout: the geometry of a paged KV cache, and the only place byte offsets come from.

A pool holds, per layer, one or two torch buffers. A *part* is the K half, the V
half, or the single latent tensor (MLA) of one block of one layer, always one
contiguous run of ``part_nbytes`` bytes. Transfers move parts in a canonical
order -- for each layer, for each part, for each block of the request -- so two
pools exchange blocks whenever their parts have the same bytes, whatever the
arrangement of their buffers (vLLM FlashAttention, FlashInfer, SGLang's split
K/V buffers).

Supported physical orders (per layer)::

    KV_FIRST     one tensor (2, num_blocks, *part)   vLLM FlashAttention
    BLOCK_FIRST  one tensor (num_blocks, 2, *part)   FlashInfer
    SPLIT        two tensors K, V (num_blocks, *part) SGLang
    LATENT       one tensor (num_blocks, *part)      MLA latent cache, one part

with ``part = (block_size, num_kv_heads, head_dim)`` for NHD and
``(num_kv_heads, block_size, head_dim)`` for HND (MLA: ``(block_size, latent_dim)``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from functools import cached_property
from typing import Any, Iterator

import numpy as np

import torch

from .errors import ConfigError, LayoutMismatch

__all__ = ["KVOrder", "TokenOrder", "KVLayout", "Segment", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVOrder(str, enum.Enum):
    KV_FIRST = "kv_first"
    BLOCK_FIRST = "block_first"
    SPLIT = "split"
    LATENT = "latent"


class TokenOrder(str, enum.Enum):
    NHD = "NHD"
    HND = "HND"


# (buffer index within the pool, byte offset in that buffer, length)
Segment = tuple[int, int, int]

# One block across every layer at most: torch sizes and the wire's lengths are 64-bit (1 PiB)
MAX_BLOCK_NBYTES = 1 << 50

# Fields that decide whether the bytes of one part mean the same thing on both sides.
_COMPAT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype",
                  "token_order", "latent", "tp_rank", "tp_size")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a paged KV cache. ``head_dim`` is the latent width for MLA."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"
    kv_order: KVOrder = KVOrder.KV_FIRST
    token_order: TokenOrder = TokenOrder.NHD
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            if self.dtype not in _DTYPE_NAMES:
                raise ConfigError(f"unsupported KV dtype {self.dtype}")
            object.__setattr__(self, "dtype", _DTYPE_NAMES[self.dtype])
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:   # a list is no key: not a TypeError
            raise ConfigError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(DTYPES)}")
        try:
            object.__setattr__(self, "kv_order", KVOrder(self.kv_order))
            object.__setattr__(self, "token_order", TokenOrder(self.token_order))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {v!r}")
        rank = self.tp_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.tp_size:
            raise ConfigError(f"KVLayout.tp_rank must be an int in 0..{self.tp_size - 1} (tp_size {self.tp_size}), "
                              f"got {rank!r}")
        if self.kv_order is KVOrder.LATENT and self.num_kv_heads != 1:
            raise ConfigError("an MLA latent layout has num_kv_heads=1")
        if self.block_nbytes > MAX_BLOCK_NBYTES:     # no tensor holds it: refused here, not in allocate
            raise ConfigError(f"one block of this layout is {self.block_nbytes} bytes across its layers, over "
                              f"{MAX_BLOCK_NBYTES}: check num_layers, num_kv_heads, head_dim and block_size")

    # -- constructors for the common engines ---------------------------------------
    @classmethod
    def vllm_flash(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                   dtype: str = "bfloat16", hnd: bool = False, **kw: Any) -> "KVLayout":
        """vLLM FlashAttention: per layer (2, num_blocks, block_size, heads, dim)."""
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, KVOrder.KV_FIRST,
                   TokenOrder.HND if hnd else TokenOrder.NHD, **kw)

    @classmethod
    def flashinfer(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                   dtype: str = "bfloat16", hnd: bool = False, **kw: Any) -> "KVLayout":
        """FlashInfer: per layer (num_blocks, 2, block_size, heads, dim)."""
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, KVOrder.BLOCK_FIRST,
                   TokenOrder.HND if hnd else TokenOrder.NHD, **kw)

    @classmethod
    def split_kv(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                 dtype: str = "bfloat16", hnd: bool = False, **kw: Any) -> "KVLayout":
        """Separate K and V buffers per layer (SGLang): each (num_blocks, block_size, heads, dim)."""
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, KVOrder.SPLIT,
                   TokenOrder.HND if hnd else TokenOrder.NHD, **kw)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, block_size: int = 16,
            dtype: str = "bfloat16", **kw: Any) -> "KVLayout":
        """MLA latent cache: per layer (num_blocks, block_size, latent_dim)."""
        return cls(num_layers, 1, latent_dim, block_size, dtype, KVOrder.LATENT, TokenOrder.NHD, **kw)

    # -- geometry ----------------------------------------------------------------------
    @property
    def latent(self) -> bool:
        return self.kv_order is KVOrder.LATENT

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @cached_property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_parts(self) -> int:
        """2 (K and V) or 1 (MLA latent)."""
        return 1 if self.latent else 2

    @property
    def part_shape(self) -> tuple[int, ...]:
        if self.latent:
            return (self.block_size, self.head_dim)
        if self.token_order is TokenOrder.NHD:
            return (self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.block_size, self.head_dim)

    @cached_property
    def part_nbytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers and parts."""
        return self.part_nbytes * self.num_parts * self.num_layers

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.kv_order is KVOrder.SPLIT else 1

    @property
    def num_buffers(self) -> int:
        return self.num_layers * self.buffers_per_layer

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of each torch buffer of a pool with ``num_blocks`` blocks."""
        if self.kv_order is KVOrder.KV_FIRST:
            return (2, num_blocks, *self.part_shape)
        if self.kv_order is KVOrder.BLOCK_FIRST:
            return (num_blocks, 2, *self.part_shape)
        return (num_blocks, *self.part_shape)

    def buffer_index(self, layer: int, part: int) -> int:
        return layer * self.buffers_per_layer + (part if self.kv_order is KVOrder.SPLIT else 0)

    def segment(self, layer: int, block: int, part: int, num_blocks: int) -> Segment:
        """(buffer index, byte offset, nbytes) of one part of one block of one layer."""
        if not (0 <= layer < self.num_layers and 0 <= block < num_blocks and 0 <= part < self.num_parts):
            raise IndexError(f"segment({layer}, {block}, {part}) outside layout/pool")
        p = self.part_nbytes
        if self.kv_order is KVOrder.KV_FIRST:
            off = (part * num_blocks + block) * p
        elif self.kv_order is KVOrder.BLOCK_FIRST:
            off = (block * 2 + part) * p
        else:
            off = block * p
        return (self.buffer_index(layer, part), off, p)

    def part_base_stride(self, part: int, num_blocks: int) -> tuple[int, int]:
        """Byte offset of block 0's ``part`` in its buffer, and the stride between blocks."""
        p = self.part_nbytes
        if self.kv_order is KVOrder.KV_FIRST:
            return part * num_blocks * p, p
        if self.kv_order is KVOrder.BLOCK_FIRST:
            return part * p, 2 * p
        return 0, p

    def segments(self, block_ids: list[int], num_blocks: int,
                 layers: range | None = None) -> Iterator[Segment]:
        """Segments of ``block_ids`` in canonical order, adjacent ones merged into runs.

        Same offsets as :meth:`segment`, computed once per (layer, part) for speed."""
        for b in block_ids:
            if not 0 <= b < num_blocks:
                raise IndexError(f"block {b} outside a pool of {num_blocks} blocks")
        p = self.part_nbytes
        cur_buf, cur_off, cur_n = -1, 0, 0
        for layer in (layers if layers is not None else range(self.num_layers)):
            for part in range(self.num_parts):
                buf = self.buffer_index(layer, part)
                base, stride = self.part_base_stride(part, num_blocks)
                for b in block_ids:
                    off = base + b * stride
                    if buf == cur_buf and cur_off + cur_n == off:
                        cur_n += p
                        continue
                    if cur_n:
                        yield (cur_buf, cur_off, cur_n)
                    cur_buf, cur_off, cur_n = buf, off, p
        if cur_n:
            yield (cur_buf, cur_off, cur_n)

    def segment_array(self, block_ids: Any, num_blocks: int, layers: range | None = None) -> np.ndarray:
        """:meth:`segments` as an ``(n, 3)`` int64 array, computed without a Python loop per
        block (what device copies and nvlink:// plans take: thousands of pieces per handle)."""
        try:
            ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        except OverflowError:                      # an id past int64: outside any pool
            bad = next(b for b in block_ids if not 0 <= b < num_blocks)
            raise IndexError(f"block {bad} outside a pool of {num_blocks} blocks") from None
        if len(ids) and not (int(ids.min()) >= 0 and int(ids.max()) < num_blocks):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise IndexError(f"block {bad} outside a pool of {num_blocks} blocks")
        p = self.part_nbytes
        rng = layers if layers is not None else range(self.num_layers)
        if isinstance(rng, range):
            bufs, bs = _planes(self, num_blocks, rng.start, rng.stop, rng.step)
        else:                                      # any other iterable of layers, as segments() takes
            bufs, bs = _plane_arrays(self, num_blocks, list(rng))
        if not len(ids) or not len(bufs):
            return np.zeros((0, 3), dtype=np.int64)
        buf = np.repeat(bufs, len(ids))
        off = (bs[:, :1] + ids[None, :] * bs[:, 1:]).reshape(-1)
        # a piece joins the run before it when it lies in the same buffer right after its end
        start = np.ones(len(off), dtype=bool)
        start[1:] = (buf[1:] != buf[:-1]) | (off[1:] != off[:-1] + p)
        first = np.flatnonzero(start)
        counts = np.diff(np.append(first, len(off)))
        return np.stack([buf[first], off[first], counts * p], axis=1)

    # -- compatibility ---------------------------------------------------------------
    def compat_key(self) -> dict[str, Any]:
        """What decides whether the bytes of one part mean the same thing in two pools. With one
        KV head a part's NHD ``(block_size, 1, head_dim)`` and HND ``(1, block_size, head_dim)``
        are the same bytes in the same order, so the token order counts only from two heads up
        (an NHD pool and an HND one exchange blocks when each rank holds one head)."""
        d = asdict(self)
        d["latent"] = self.latent
        for k in ("kv_order", "token_order"):
            d[k] = getattr(self, k).value
        if self.num_kv_heads == 1:
            d["token_order"] = TokenOrder.NHD.value
        return {k: d[k] for k in _COMPAT_FIELDS}

    @cached_property
    def compat_hash(self) -> str:
        """Stable 16-hex-digit hash of what decides whether two pools can exchange blocks."""
        blob = json.dumps(self.compat_key(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def check_compatible(self, other: "KVLayout") -> None:
        """Raise :class:`LayoutMismatch` naming every field that differs."""
        a, b = self.compat_key(), other.compat_key()
        heads = self.num_kv_heads != other.num_kv_heads    # then the heads are named, not the token order
        diff = [f"{k}: {a[k]!r} != {b[k]!r}" for k in _COMPAT_FIELDS
                if a[k] != b[k] and not (heads and k == "token_order")]
        if diff:
            raise LayoutMismatch("layouts cannot exchange blocks; differing fields: " + ", ".join(diff))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_order"] = self.kv_order.value
        d["token_order"] = self.token_order.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        """The layout :meth:`to_dict` gave; :class:`ConfigError` for anything else."""
        if not isinstance(d, dict):
            raise ConfigError(f"a KVLayout dict is a dict (KVLayout.to_dict()), got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown KVLayout fields {sorted(map(str, unknown))}")
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise ConfigError(f"KVLayout dict lacks the fields {missing}")
        return cls(**d)


@functools.lru_cache(maxsize=256)
def _planes(layout: KVLayout, num_blocks: int, start: int, stop: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_plane_arrays` of ``range(start, stop, step)``, kept per layout."""
    return _plane_arrays(layout, num_blocks, range(start, stop, step))


def _plane_arrays(layout: KVLayout, num_blocks: int, layers: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, part) plane of ``layers``, in canonical order: its buffer index, and its
    block 0 offset and block stride (read-only arrays)."""
    planes = [(layer, part) for layer in layers for part in range(layout.num_parts)]
    bufs = np.array([layout.buffer_index(layer, part) for layer, part in planes], dtype=np.int64)
    bs = np.array([layout.part_base_stride(part, num_blocks) for _, part in planes], dtype=np.int64).reshape(-1, 2)
    bufs.flags.writeable = False
    bs.flags.writeable = False
    return bufs, bs
