"""Per-block checksums: xxh3-64 over each block's parts in canonical order."""

from __future__ import annotations

from typing import Sequence

import xxhash

from .pool import KVPool

__all__ = ["block_checksums"]


def block_checksums(pool: KVPool, block_ids: Sequence[int]) -> list[int]:
    """One 64-bit xxh3 per block over all its layers and parts (host pools only)."""
    L = pool.layout
    views = pool.host_views()
    nb = pool.num_blocks
    out = []
    seg = L.segment
    for b in block_ids:
        h = xxhash.xxh3_64()
        for layer in range(L.num_layers):
            for part in range(L.num_parts):
                buf, off, n = seg(layer, b, part, nb)
                h.update(views[buf][off:off + n])
        out.append(h.intdigest())
    return out
