"""Pools of every layout family filled with seeded random bytes (block copy and receive tests)."""

from __future__ import annotations

from typing import Iterable

import torch
import xxhash

from kvbridge import KVLayout, KVPool


def checksum_of(parts: Iterable[bytes]) -> int:
    """A block's checksum spelled out, independently of kvbridge: the xxh3-64 of its parts'
    xxh3-64 digests, each as 8 little-endian bytes, in (layer, part) order."""
    return xxhash.xxh3_64_intdigest(b"".join(xxhash.xxh3_64_intdigest(bytes(p)).to_bytes(8, "little")
                                             for p in parts))

LAYOUTS = {
    "kv_first": KVLayout(3, 2, 16, 4, "float16", "kv_first", "NHD", 0, 1),
    "block_first": KVLayout(2, 1, 32, 8, "bfloat16", "block_first", "HND", 0, 1),
    "split": KVLayout(2, 2, 8, 16, "float32", "split", "NHD", 0, 1),
    "latent": KVLayout.mla(3, 64, block_size=4, dtype="float16"),
}


def filled(layout: KVLayout, n: int, seed: int) -> KVPool:
    pool = KVPool.allocate(layout, n, allocator="engine")
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        flat = b.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
    return pool
