"""Checksums: each block part's xxh3-64, combined in canonical order.

One definition: a checksum is the xxh3-64 of the xxh3-64 digests of the parts it covers, each
as 8 little-endian bytes, in (layer, part) order (:func:`combine`). Each part is hashed on its
own, so a large block's parts can be copied and hashed on two threads and still give one
checksum. Two granularities: a whole handle carries one checksum per block over all its layers
(:func:`block_checksums`); a layer-wise handle's checksums are computed per (layer, block) as
each layer becomes ready and travel with the bytes (:func:`layer_checksums`). Every part arrives
whole and in (layer, part) order, so :class:`StreamVerifier` computes either while the bytes
land.

Host pools are hashed by :mod:`kvbridge.blockcopy` (one C pass over the blocks' parts, or its
Python twin); shm:// one-sided reads hash each block as it lands, in the same pass as the copy.

Device pools (CUDA) have the same checksums, computed over their bytes as they pass through
host memory: :func:`block_checksums` stages the blocks (one gather and one device-to-host
copy per ring slot, :func:`~kvbridge.transports.staging.stage_out`) and hashes each slot;
a receiver hashes a staged transfer's bytes in the host slot they land in
(:meth:`StreamVerifier.consume`), and otherwise stages the landed blocks once more.
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Sequence

import xxhash

from .blockcopy import combine, hash_blocks, planes
from .pool import KVPool

__all__ = ["combine", "block_checksums", "layer_checksums", "pack_sums", "unpack_sums", "StreamVerifier"]


def _staged_checksums(pool: KVPool, block_ids: Sequence[int], layers: range, per_layer: bool) -> list[int]:
    """Checksums of a device pool's blocks, hashed slot by slot as they are staged to the host."""
    from .transports.base import Spans
    from .transports.staging import RINGS, stage_out

    v = StreamVerifier(pool, block_ids, layers, per_layer)
    ring = RINGS.take()
    try:
        stage_out(Spans.of_blocks(pool, list(block_ids), layers), ring, v.consume)
    finally:
        RINGS.give(ring)
    return v.digests()


def _hash(pool: KVPool, block_ids: Sequence[int], layers: range, group: int) -> list[int]:
    """The checksum per block over each ``group`` of planes of ``layers`` (host pools, one C pass)."""
    bufs = pool.buffers            # held across the C call (see blockcopy.planes)
    sums = hash_blocks(planes(pool, layers), block_ids, pool.layout.part_nbytes, group)
    del bufs
    return sums


def block_checksums(pool: KVPool, block_ids: Sequence[int], layers: Optional[range] = None) -> list[int]:
    """One checksum per block over ``layers`` (default all) and parts, in (layer, part) order."""
    if not pool.is_host:
        return _staged_checksums(pool, block_ids, layers if layers is not None else range(pool.layout.num_layers),
                                 False)
    layers = layers if layers is not None else range(pool.layout.num_layers)
    if not len(block_ids) or not len(layers):
        return [xxhash.xxh3_64_intdigest(b"") for _ in block_ids]
    return _hash(pool, block_ids, layers, len(layers) * pool.layout.num_parts)


def layer_checksums(pool: KVPool, block_ids: Sequence[int], layers: range) -> list[int]:
    """One checksum per (layer, block), layer-major: ``len(layers) * len(block_ids)`` values."""
    if not pool.is_host:
        return _staged_checksums(pool, block_ids, layers, True)
    if not len(block_ids) or not len(layers):
        return []
    return _hash(pool, block_ids, layers, pool.layout.num_parts)


def pack_sums(sums: Sequence[int]) -> bytes:
    return struct.pack(f"!{len(sums)}Q", *sums)


def unpack_sums(data: bytes) -> list[int]:
    return list(struct.unpack(f"!{len(data) // 8}Q", data))


class StreamVerifier:
    """Checksums of destination blocks computed as their bytes land, in stream order.

    The stream is (layer, part, block) over ``layers``: each part arrives whole before the next
    begins, so one hash state (the part landing) and a digest per part suffice. With
    ``per_layer`` each (layer, block) has its own checksum (layer-wise transfers); otherwise
    each block's covers all its parts, exactly :func:`block_checksums`. Hashing right after
    each chunk lands reads it from cache instead of a second pass over DRAM.

    :meth:`advance` hashes the destination pool's own memory (host pools); :meth:`consume`
    hashes the next bytes of the stream from wherever they are (a staging slot). For a
    device pool only :meth:`consume` can feed it; a verifier nobody fed stays incomplete and
    the receiver checksums the landed blocks instead.
    """

    def __init__(self, pool: KVPool, block_ids: Sequence[int], layers: Optional[range] = None,
                 per_layer: bool = False) -> None:
        # No per-part objects: part i of the stream is found by arithmetic (a handle of 1,000
        # scattered blocks x 32 layers has 64,000 parts; a list of objects for each would keep
        # the cyclic garbage collector busy, holding the GIL, for the whole transfer).
        L = pool.layout
        layers = layers if layers is not None else range(L.num_layers)
        views: Optional[list[memoryview]] = pool.host_views() if pool.is_host else None
        self.part = L.part_nbytes
        self.ids = list(block_ids)
        self.nb = len(self.ids)
        self.nparts = L.num_parts
        self.planes = [(views[L.buffer_index(layer, p)] if views is not None else None,
                        *L.part_base_stride(p, pool.num_blocks))
                       for layer in layers for p in range(L.num_parts)]    # plane j: parts [j*nb, (j+1)*nb)
        self.host = views is not None
        self.per_layer = per_layer
        self.total = self.part * self.nb * len(self.planes)
        self.reset()

    def reset(self) -> None:
        """Start over (a retried transfer resends the stream from its first byte)."""
        self._pd = [0] * (self.nb * len(self.planes))   # each stream part's xxh3-64, in stream order
        self._cur = xxhash.xxh3_64()                     # the part landing now
        self._i = 0      # first part not fully hashed
        self._done = 0   # stream bytes hashed

    @property
    def started(self) -> bool:
        return self._done > 0

    def _piece(self, i: int, lo: int, data: Any) -> None:
        """Bytes ``data`` of stream part ``i`` from its byte ``lo``: a whole part hashed at once,
        else into the state of the part landing, its digest taken once the part is whole."""
        hi = lo + len(data)
        if lo == 0 and hi == self.part:
            self._pd[i] = xxhash.xxh3_64_intdigest(data)
            return
        if lo == 0:
            self._cur.reset()
        self._cur.update(data)
        if hi == self.part:
            self._pd[i] = self._cur.intdigest()

    def _feed(self, i: int, lo: int, hi: int) -> None:
        """Hash bytes [lo, hi) of stream part ``i``."""
        j, k = divmod(i, self.nb)
        view, base, stride = self.planes[j]
        assert view is not None
        off = base + self.ids[k] * stride
        self._piece(i, lo, view[off + lo:off + hi])

    def _feed_whole(self, i: int, end: int) -> None:
        """Hash whole parts ``i..end-1``: the common case, one C call per part, plane by plane
        with the per-plane lookups hoisted out of the loop."""
        n, nb, ids, planes, pd, digest = self.part, self.nb, self.ids, self.planes, self._pd, xxhash.xxh3_64_intdigest
        while i < end:
            j, k0 = divmod(i, nb)
            view, base, stride = planes[j]
            assert view is not None
            k1 = min(nb, k0 + end - i)
            for k in range(k0, k1):
                off = base + ids[k] * stride
                pd[j * nb + k] = digest(view[off:off + n])
            i += k1 - k0

    def consume(self, data: memoryview) -> None:
        """Hash ``data`` as the next bytes of the stream (e.g. a staging slot as it lands)."""
        n, pos, end = self.part, self._done, min(self._done + len(data), self.total)
        while pos < end:
            i = pos // n
            k = min(end, (i + 1) * n) - pos
            self._piece(i, pos - i * n, data[pos - self._done:pos - self._done + k])
            pos += k
        self._i, self._done = end // n, end

    def advance(self, upto: int) -> None:
        """Hash everything between the last call and byte ``upto`` of the stream (host pools;
        for a device pool the destination is not host memory and this does nothing)."""
        if not self.host:
            return
        n = self.part
        upto = min(upto, self.total)
        i, done = self._i, self._done
        if done >= upto:
            return
        if done > i * n:                       # finish a part that landed partly last time
            stop = min((i + 1) * n, upto)
            self._feed(i, done - i * n, stop - i * n)
            done = stop
            if done == (i + 1) * n:
                i += 1
        whole = upto // n
        if i < whole:
            self._feed_whole(i, whole)
            i = whole
        done = max(done, i * n)
        if done < upto:                        # the start of a part still landing
            self._feed(i, 0, upto - i * n)
            done = upto
        self._i, self._done = i, done

    @property
    def complete(self) -> bool:
        return self._done == self.total

    def digests(self) -> list[int]:
        """The checksums (:func:`combine` of each block's, or each (layer, block)'s, part digests)."""
        nb, pd = self.nb, self._pd
        if self.per_layer:
            npart = self.nparts
            return [combine([pd[(layer * npart + p) * nb + k] for p in range(npart)])
                    for layer in range(len(self.planes) // npart) for k in range(nb)]
        return [combine(pd[k::nb]) for k in range(nb)]
