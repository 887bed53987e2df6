"""Per-block checksums: xxh3-64 over each block's parts in canonical order."""

from __future__ import annotations

from typing import Sequence

import xxhash

from .pool import KVPool

__all__ = ["block_checksums", "StreamVerifier"]


def block_checksums(pool: KVPool, block_ids: Sequence[int]) -> list[int]:
    """One 64-bit xxh3 per block over all its layers and parts (host pools only)."""
    L = pool.layout
    views = pool.host_views()
    n = L.part_nbytes
    plan = [(views[L.buffer_index(layer, part)], *L.part_base_stride(part, pool.num_blocks))
            for layer in range(L.num_layers) for part in range(L.num_parts)]
    out = []
    for b in block_ids:
        h = xxhash.xxh3_64()
        for view, base, stride in plan:
            off = base + b * stride
            h.update(view[off:off + n])
        out.append(h.intdigest())
    return out


class StreamVerifier:
    """Checksums of destination blocks computed as their bytes land, in stream order.

    The canonical stream is (layer, part, block); each block's hash is updated with its
    parts in (layer, part) order, which is exactly :func:`block_checksums`' order, so the
    digests are comparable. Hashing right after each chunk lands reads it from cache
    instead of making a second pass over DRAM.
    """

    def __init__(self, pool: KVPool, block_ids: Sequence[int]) -> None:
        L = pool.layout
        views = pool.host_views()
        n = self.part = L.part_nbytes
        self.views: list[memoryview] = []    # part i covers stream bytes [i*n, (i+1)*n)
        self.owner: list[int] = []           # index into block_ids of part i
        for layer in range(L.num_layers):
            for part in range(L.num_parts):
                view = views[L.buffer_index(layer, part)]
                base, stride = L.part_base_stride(part, pool.num_blocks)
                for k, b in enumerate(block_ids):
                    off = base + b * stride
                    self.views.append(view[off:off + n])
                    self.owner.append(k)
        self.total = n * len(self.views)
        self._num_blocks = len(block_ids)
        self.reset()

    def reset(self) -> None:
        """Start over (a retried transfer resends the stream from its first byte)."""
        self.hashers = [xxhash.xxh3_64() for _ in range(self._num_blocks)]
        self._updates = [self.hashers[k].update for k in self.owner]
        self._i = 0      # first part not fully hashed
        self._done = 0   # stream bytes hashed

    def advance(self, upto: int) -> None:
        """Hash everything between the last call and byte ``upto`` of the stream."""
        n, views, updates = self.part, self.views, self._updates
        upto = min(upto, self.total)
        i, done = self._i, self._done
        if done >= upto:
            return
        if done > i * n:                       # finish a part that landed partly last time
            stop = min((i + 1) * n, upto)
            updates[i](views[i][done - i * n:stop - i * n])
            done = stop
            if done == (i + 1) * n:
                i += 1
        whole = upto // n
        while i < whole:                       # the common case: whole parts, one C call each
            updates[i](views[i])
            i += 1
        done = max(done, i * n)
        if done < upto:                        # the start of a part still landing
            updates[i](views[i][done - i * n:upto - i * n])
            done = upto
        self._i, self._done = i, done

    @property
    def complete(self) -> bool:
        return self._done == self.total

    def digests(self) -> list[int]:
        return [h.intdigest() for h in self.hashers]
