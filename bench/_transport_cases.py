"""Shapes, data and targets of the transport benchmark (:mod:`bench.transport`): the cases it
moves (contiguous sizes, block-shaped layouts), deterministic fills, preallocated buffers,
the memcpy ceilings' copy helpers, and the summaries it reports."""

from __future__ import annotations

import ctypes
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

KiB, MiB = 1 << 10, 1 << 20

CONTIG_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_MAX = 64 * MiB
TCP_TARGET_CONTIG = 0.9      # tcp >= 0.9x plain socket, sizes >= 1 MiB
SHM_TARGET = 0.8             # shm >= 0.8x memcpy, sizes >= 1 MiB and block-shaped
TCP_TARGET_BLOCKS = 0.8      # block-shaped tcp >= 0.8x plain socket
LATENCY_TARGET = 2.0         # kvbridge latency <= 2x plain ping-pong
UCX_TARGET_CONTIG = 0.9      # ucx >= 0.9x bare ucxx, sizes >= 1 MiB
UCX_TARGET_BLOCKS = 0.8      # block-shaped ucx >= 0.8x bare ucxx moving the same bytes in one piece
UCX_LATENCY_TARGET = 1.5     # ucx 4 KiB round trip <= 1.5x bare ucxx
NIXL_LATENCY_TARGET = 2.0    # ucx 4 KiB fetch within 2x of NIXL's (when nixl is installed)


# ============================================================================== shapes

def contig_layout(nbytes: int) -> dict[str, Any]:
    """A one-layer, one-block vLLM layout whose single block is ``nbytes`` (K then V: one run)."""
    if nbytes % 128:
        raise ValueError("contiguous sizes must be multiples of 128 bytes")
    # part = 16 tokens x 1 head x head_dim x 2 bytes = nbytes / 2
    return dict(num_layers=1, num_kv_heads=1, head_dim=nbytes // 64, block_size=16,
                dtype="bfloat16", kv_order="kv_first", token_order="NHD")


def flash_layout(num_layers: int, heads: int, head_dim: int, block_size: int = 16) -> dict[str, Any]:
    return dict(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                dtype="bfloat16", kv_order="kv_first", token_order="NHD")


def scattered_ids(pool_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` non-adjacent block ids (every other block), shuffled: no two merge into a run."""
    ids = list(range(0, pool_blocks, 2))[:n]
    if len(ids) < n:
        raise ValueError("pool too small for every-other-block ids")
    random.Random(seed).shuffle(ids)
    return ids


@dataclass
class Case:
    """One shape to move: a layout, a pool size, source and destination block ids."""

    name: str
    group: str                  # "contiguous" | "blocks"
    layout: dict[str, Any]
    pool_blocks: int
    src_ids: list[int]
    dst_ids: list[int]
    nbytes: int = 0
    segments: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def make_case(name: str, group: str, layout: dict[str, Any], pool_blocks: int,
              src_ids: list[int], dst_ids: list[int]) -> Case:
    from kvbridge.layout import KVLayout
    L = KVLayout.from_dict(layout)
    segs = list(L.segments(src_ids, pool_blocks))
    return Case(name, group, layout, pool_blocks, src_ids, dst_ids,
                nbytes=len(src_ids) * L.block_nbytes, segments=len(segs),
                extra={"part_nbytes": L.part_nbytes})


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def contig_case(nbytes: int) -> Case:
    return make_case(fmt_size(nbytes), "contiguous", contig_layout(nbytes), 1, [0], [0])


def block_cases(quick: bool) -> list[Case]:
    out = []
    # 32 layers x 64 blocks of 16 tokens x 8 heads x 128 dim, bf16: part 32 KiB, 128 MiB per handle
    L = flash_layout(32, 8, 128)
    out.append(make_case("32L x 64 blk, 32 KiB parts", "blocks", L, 256,
                         scattered_ids(256, 64, 1), scattered_ids(256, 64, 2)))
    # 16 KiB parts (4 heads x 128 dim), 128 blocks: the same 128 MiB in twice as many pieces
    L = flash_layout(32, 4, 128)
    out.append(make_case("32L x 128 blk, 16 KiB parts", "blocks", L, 256,
                         scattered_ids(256, 128, 3), scattered_ids(256, 128, 4)))
    return out


# ============================================================================== data

def fill_bytes(t: Any, seed: int) -> None:
    """Fill a contiguous CPU tensor with deterministic pseudo-random bytes."""
    import torch
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).view(-1).random_(0, 256, generator=g)


def fill_pool(pool: Any, seed: int) -> None:
    for i, b in enumerate(pool.buffers):
        fill_bytes(b, seed * 1000 + i)


def host_buffer(nbytes: int, value: Optional[int] = None, seed: Optional[int] = None) -> Any:
    """A preallocated, touched uint8 tensor."""
    import torch
    t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if seed is not None:
        fill_bytes(t, seed)
    else:
        t.fill_(0x5A if value is None else value)
    return t


def tensor_view(t: Any) -> memoryview:
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")



PLAIN_SEED = 7_777


def memcpy(dst: Any, src: Any, n: int) -> None:
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def scattered_pairs(src_pool: Any, src_ids: list[int], dst_pool: Any,
                    dst_ids: list[int]) -> list[tuple[memoryview, memoryview]]:
    """(destination, source) memoryviews of every part of the blocks, in stream order: a copy
    loop by hand does ``d[:] = s`` for each (one memcpy; fewer Python calls than ctypes.memmove)."""
    from kvbridge.transports.base import Spans
    s = Spans.of_blocks(src_pool, src_ids).views()
    d = Spans.of_blocks(dst_pool, dst_ids).views()
    if [len(v) for v in s] != [len(v) for v in d]:
        raise ValueError("source and destination runs do not pair up")
    return list(zip(d, s))


def summarize(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "q1": q[0], "q3": q[2], "n": len(s)}


def _iters_for(nbytes: int, quick: bool, cap: int = 400) -> int:
    """Transfers per repetition: about 64 MiB (quick: 32 MiB) moved, 1 to ``cap`` transfers."""
    target = (32 if quick else 64) * MiB
    return max(1, min(cap, math.ceil(target / nbytes)))

