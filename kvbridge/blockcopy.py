"""Whole-block copies and checksums in one pass: the C extension ``kvbridge._kvcopy``
(``native/cpu/kvcopy.c``) with a Python twin that gives the same results.

A pool's memory is seen as *planes*, one per (layer, part) in canonical order: block ``b``'s
part in plane ``p`` is ``part`` bytes at ``base_p + b * stride_p`` (see
:meth:`KVLayout.part_base_stride`). :func:`planes` packs them once per pool and layer range.

- :func:`hash_blocks`: the checksum per block (or per layer and block), exactly
  :func:`kvbridge.integrity.block_checksums`' definition: the xxh3-64 of the xxh3-64 digests of
  the block's parts (:func:`combine`).
- :func:`copy_blocks`: copy blocks between two plane sets and, optionally, hash each block's
  bytes as they land: in one pass where the CPU has AVX2 or AVX-512F (each 64-byte stripe loaded once,
  stored and hashed; ``_kvcopy.FUSED``), elsewhere chunk by chunk while the chunk is in cache.
- :func:`gather_blocks` / :func:`scatter_blocks`: blocks to and from one buffer in canonical
  (wire) order -- plane by plane, ids in the order given -- for tcp:// small reads: the
  sender's reply is built in one buffer, the receiver's lands (and is hashed) in one pass.
- :func:`dst_snapshot`: a fetch's destination ids checked (distinct ints in the pool) and their
  generations taken, in one call.
- ``fetch_whole`` (extension only): the receiver's usual tcp:// fetch of any size -- ids
  checked and marked as landing, request, reply by its deadline, landing, checksums and
  generations compared -- in one call; ``land``: a pool's landing marks set or unset;
  ``read_small`` (extension only): a tcp:// small read's request sent, its reply received,
  checked and landed in one call; ``serve_small`` (extension only): the sender's side, a whole
  small read of an indexed handle checked, copied out, validated and answered in one call;
  ``shm_read`` (extension only; ``shm_fetch``: with the destination's ids, generations and
  landing marks as ``fetch_whole`` takes them): an shm:// one-sided read -- table and generations checked,
  blocks copied (and hashed), both checked again -- in one call; ``recv_blocks`` (extension
  only): a tcp:// reply's block bytes received straight into whole blocks, each block hashed as
  its pieces land, in one call (see ``native/cpu/kvcopy.c``).

The extension is built by ``pip install`` (it needs a C compiler and Python's headers). Without
it -- or with ``KVBRIDGE_NO_NATIVE=1`` in the environment -- the Python twin runs; the tests run
both and compare them.
"""

from __future__ import annotations

import ctypes
import os
import struct
import weakref
from typing import TYPE_CHECKING, Any, Optional, Sequence

import xxhash

from .hostlimits import cpu_quota

if TYPE_CHECKING:
    from .pool import KVPool

__all__ = ["NATIVE", "combine", "copy_threads", "planes", "pack_planes", "hash_blocks", "copy_blocks", "gather_blocks",
           "scatter_blocks", "dst_snapshot", "py_hash_blocks", "py_copy_blocks", "py_gather_blocks",
           "py_scatter_blocks", "py_dst_snapshot"]

_native: Any = None
if not os.environ.get("KVBRIDGE_NO_NATIVE"):
    try:
        from . import _kvcopy as _native
    except ImportError:                     # not built (no compiler at install): the Python twin
        _native = None
NATIVE: bool = _native is not None
# the frame version the extension's socket calls speak (0: a build from before it said so)
NATIVE_WIRE_VERSION: Optional[int] = getattr(_native, "WIRE_VERSION", 0) if NATIVE else None


def _default_copy_threads() -> int:
    """2 where this process may run on two CPUs or more -- by its affinity and by its cgroup's
    CPU quota (a container allowed one CPU's time gains nothing from a second thread) -- else 1."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, quota)
    return 2 if cpus >= 2 else 1


def copy_threads(threads: Optional[int] = None, spin_us: Optional[int] = None) -> dict[str, int]:
    """How many threads share a large block copy of the extension (1 without it).

    ``threads`` 2 (the default where this process may run on two CPUs or more, by its affinity
    and its cgroup's CPU quota (:func:`cpu_quota`), or
    ``KVBRIDGE_COPY_THREADS``) lets one helper thread take whole parts of every copy of 1 MiB
    or more in two parts or more (shm's one-sided read, :func:`copy_blocks`), the parts of one
    block among them (its checksum combines its parts' digests): the calling thread copies the
    first half, the helper the second from its start and the caller the rest from its end until
    they meet; 1 copies on the calling thread alone. ``spin_us`` (``KVBRIDGE_COPY_SPIN_US``,
    default 50) is how long the helper polls for the next copy before it sleeps. Returns the
    settings and counters: ``threads``, ``spin_us``, ``jobs`` (copies offered to the helper),
    ``helped`` (those it took part in), ``units`` (their pieces) and ``helper_units`` (the
    pieces the helper ran)."""
    if _native is None:
        if threads not in (None, 1):
            raise ValueError("copy_threads: no native extension here; copies run on the calling thread")
        return {"threads": 1, "spin_us": 0, "jobs": 0, "helped": 0, "units": 0, "helper_units": 0}
    t, s, jobs, helped, units, helper_units = _native.copy_threads(threads, spin_us)
    return {"threads": t, "spin_us": s, "jobs": jobs, "helped": helped, "units": units, "helper_units": helper_units}


def _configure_from_env() -> None:
    if _native is None:
        return
    raw_t, raw_s = os.environ.get("KVBRIDGE_COPY_THREADS"), os.environ.get("KVBRIDGE_COPY_SPIN_US")
    try:
        threads = int(raw_t) if raw_t else _default_copy_threads()
        spin = int(raw_s) if raw_s else 50
        copy_threads(threads, spin)
    except ValueError as exc:
        raise ValueError(f"KVBRIDGE_COPY_THREADS={raw_t!r} / KVBRIDGE_COPY_SPIN_US={raw_s!r}: {exc}") from None


_configure_from_env()

_PLANES: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], tuple[Any, bytes]]]" = weakref.WeakKeyDictionary()
_TRIPLE = struct.Struct("=3q")


def pack_planes(triples: Sequence[tuple[int, int, int]]) -> bytes:
    """(base address, stride, end address) per plane, packed as native int64s."""
    return b"".join(_TRIPLE.pack(*t) for t in triples)


def planes(pool: "KVPool", layers: Optional[range] = None) -> bytes:
    """The packed planes of a host pool over ``layers`` (default all), made once per pool and
    range (a pool's buffers never move) and made again if its buffers were replaced. A closed
    pool (no buffers) is refused. Callers hold ``pool.buffers`` across the C call, so a pool
    closed meanwhile cannot free the memory under it."""
    bufs = pool.buffers
    if layers is None:      # the hot case (every small read, both sides): kept on the pool itself
        mine = getattr(pool, "_planes_all", None)
        if mine is not None and mine[0] is bufs:
            return mine[1]  # type: ignore[no-any-return]
    L = pool.layout
    whole = layers is None
    layers = layers if layers is not None else range(L.num_layers)
    key = (layers.start, layers.stop)
    try:
        owner, packed = _PLANES[pool][key]
        if owner is bufs:
            return packed
    except (KeyError, TypeError):
        pass
    if not bufs:
        from .errors import PoolError
        raise PoolError("the pool is closed")
    addrs = pool.buffer_addresses()
    sizes = [b.numel() * b.element_size() for b in bufs]
    out = []
    for layer in layers:
        for part in range(L.num_parts):
            i = L.buffer_index(layer, part)
            base, stride = L.part_base_stride(part, pool.num_blocks)
            out.append((addrs[i] + base, stride, addrs[i] + sizes[i]))
    packed = pack_planes(out)
    if whole:
        try:
            pool._planes_all = (bufs, packed)
        except AttributeError:
            pass
    try:
        _PLANES.setdefault(pool, {})[key] = (bufs, packed)
    except TypeError:       # a pool-like object that cannot be weakly referenced: no cache
        pass
    return packed


def _unpack(packed: bytes) -> list[tuple[int, int, int]]:
    return [t for t in _TRIPLE.iter_unpack(packed)]


def _check(pl: list[tuple[int, int, int]], ids: Sequence[int], part: int) -> None:
    if not len(ids):
        return
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise ValueError("negative block id")
    for j, (base, stride, end) in enumerate(pl):
        if stride < 0 or base < 0 or part < 0 or base + hi * stride + part > end:
            raise ValueError(f"block {hi} outside plane {j}")


def combine(part_digests: Sequence[int]) -> int:
    """A block's checksum from its parts' xxh3-64 digests in (layer, part) order: the xxh3-64 of
    them, each as 8 little-endian bytes (the extension's ``kvb_combine``). Each part is hashed on
    its own, so the parts of one block can be copied and hashed on two threads."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(part_digests)}Q", *part_digests))


def _part_digest(address: int, part: int) -> int:
    return xxhash.xxh3_64_intdigest((ctypes.c_char * part).from_address(address))


def py_hash_blocks(packed: bytes, ids: Sequence[int], part: int, group: int) -> list[int]:
    """The Python twin of the extension's ``hash_blocks``."""
    pl = _unpack(packed)
    if group <= 0 or len(pl) % group:
        raise ValueError("group must divide the number of planes")
    _check(pl, ids, part)
    return [combine([_part_digest(base + b * stride, part) for base, stride, _ in pl[g * group:(g + 1) * group]])
            for g in range(len(pl) // group) for b in ids]


def py_copy_blocks(dst: bytes, dst_ids: Sequence[int], src: bytes, src_ids: Sequence[int], part: int,
                   hash: bool) -> Optional[list[int]]:
    """The Python twin of the extension's ``copy_blocks``."""
    dp, sp = _unpack(dst), _unpack(src)
    if len(dp) != len(sp):
        raise ValueError("source and destination have different numbers of planes")
    _check(dp, dst_ids, part)
    _check(sp, src_ids, part)
    if len(dst_ids) != len(src_ids):
        raise ValueError("source and destination name different numbers of blocks")
    out = []
    for d, s in zip(dst_ids, src_ids):
        pd = []
        for (db, dstr, _), (sb, sstr, _) in zip(dp, sp):
            ctypes.memmove(db + d * dstr, sb + s * sstr, part)
            if hash:
                pd.append(_part_digest(db + d * dstr, part))
        if hash:
            out.append(combine(pd))
    return out if hash else None


def py_gather_blocks(packed: bytes, ids: Sequence[int], part: int, head: int, tail: int) -> bytearray:
    """The Python twin of the extension's ``gather_blocks``."""
    if head < 0 or tail < 0:
        raise ValueError("negative head or tail")
    pl = _unpack(packed)
    _check(pl, ids, part)
    out = bytearray(head + len(pl) * len(ids) * part + tail)
    w = head
    for base, stride, _ in pl:
        for b in ids:
            out[w:w + part] = (ctypes.c_char * part).from_address(base + b * stride)
            w += part
    return out


def py_scatter_blocks(dst: bytes, dst_ids: Sequence[int], src: Any, offset: int, part: int,
                      hash: bool) -> Optional[list[int]]:
    """The Python twin of the extension's ``scatter_blocks``."""
    dp = _unpack(dst)
    _check(dp, dst_ids, part)
    mv = memoryview(src).cast("B")
    n = len(dst_ids)
    if offset < 0 or offset + len(dp) * n * part > len(mv):
        raise ValueError(f"scatter_blocks: the source holds {len(mv)} bytes, {len(dp) * n * part} wanted "
                         f"from offset {offset}")
    out = []
    for k, b in enumerate(dst_ids):
        pd = []
        for j, (base, stride, _) in enumerate(dp):
            land = (ctypes.c_char * part).from_address(base + b * stride)
            o = offset + (j * n + k) * part
            memoryview(land).cast("B")[:] = mv[o:o + part]
            if hash:
                pd.append(xxhash.xxh3_64_intdigest(land))
        if hash:
            out.append(combine(pd))
    return out if hash else None


def py_dst_snapshot(ids: Any, gens: list[int], n: int) -> Optional[tuple[list[int], list[int]]]:
    """``n`` distinct ints (``int`` itself) in ``[0, len(gens))``, given as a list or tuple: a new
    list of them and one of their generations in ``gens`` now; else None (the caller's long way
    says what is wrong, or takes what only it takes)."""
    if type(ids) not in (list, tuple) or len(ids) != n:
        return None
    nb = len(gens)
    for b in ids:
        if type(b) is not int or not 0 <= b < nb:
            return None
    if n > 1 and len(set(ids)) != n:
        return None
    return list(ids), [gens[b] for b in ids]


hash_blocks = _native.hash_blocks if NATIVE else py_hash_blocks
dst_snapshot = _native.dst_snapshot if NATIVE else py_dst_snapshot
copy_blocks = _native.copy_blocks if NATIVE else py_copy_blocks
gather_blocks = _native.gather_blocks if NATIVE else py_gather_blocks
scatter_blocks = _native.scatter_blocks if NATIVE else py_scatter_blocks
# tcp:// small reads in one call (send, receive, check, land); no twin: without the extension
# tcp.py takes the same steps in Python
read_small = _native.read_small if NATIVE else None
# the receiver's usual tcp fetch in one call (ids, landing marks, request, reply, checksums,
# generations); without the extension the receiver's pipeline takes the same steps
fetch_whole = _native.fetch_whole if NATIVE else None
# a pool's landing marks (a bytearray) set or unset atomically for Python threads (GIL held)
land = _native.land if NATIVE else None
serve_small = _native.serve_small if NATIVE else None
serve_next = _native.serve_next if NATIVE else None
# shm:// one-sided reads in one call; without the extension shm.py takes the same steps in Python
shm_read = _native.shm_read if NATIVE else None
# the receiver's usual shm:// fetch in one call (ids, landing marks, the one-sided read held to
# the destination's generations, checksums); without it the receiver takes the same steps
shm_fetch = _native.shm_fetch if NATIVE else None
# tcp:// large reads received straight into whole blocks (hashed as they land) in one call;
# without the extension tcp.py's receive loop runs (recv_iter and the stream verifier)
recv_blocks = _native.recv_blocks if NATIVE else None
