"""KVPool: registered memory for ``num_blocks`` blocks per layer, an allocator and generations.

The pool owns block bookkeeping (one source of truth): reference counts (pins) and a
per-block *generation* that changes whenever a block's memory stops holding what it
held, so a handle that names (block, generation) can tell reused memory from its own KV.

Who allocates is a mode:

* ``allocator="kvbridge"`` (the default): the pool's own free list. ``alloc`` takes
  blocks, ``free`` drops references and a block reaching zero returns to the free list
  with a new generation.
* ``allocator="engine"``: the engine's scheduler owns allocation (vLLM, SGLang). kvbridge
  keeps pins and generations only: ``ref``/``pin`` pins any block the engine names,
  ``free``/``unpin`` drops pins without touching any free list, and the engine calls
  :meth:`KVPool.retire` when it frees or reuses blocks, which moves their generation on,
  so a handle to a reused block is refused. Retiring a pinned block (one a live handle
  or transfer still names) is reported to ``on_retire`` listeners, which end those
  handles; the safe order is to reuse a published block only after ``on_free`` reported it.

A shared pool (``allocate(..., shared=True)``) also keeps its generations in its segment,
after the buffers (``gen_offset``, one u32 per block), written before a freed or retired
block can be written again: an ``shm://`` reader checks them with no message.
"""

from __future__ import annotations

import ctypes
import math
import operator
import os
import secrets
import threading
from collections import deque
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from . import blockcopy
from .errors import ConfigError, LayoutMismatch, PoolError, TransferCancelled
from .layout import KVLayout, KVOrder
from .segments import SharedSegment, sweep_dead_segments

__all__ = ["KVPool", "SharedSegment", "block_id_list", "whole_number", "retired_during", "sweep_dead_segments"]

_ALIGN = 4096
_MAX_POOL_NBYTES = 1 << 62     # a pool's bytes: past this torch cannot size its tensors
GEN_SIZE = 4   # bytes per block in a shared pool's generation table (native-endian u32)
TensorOrPair = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _page_aligned(alloc: Callable[..., torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer of ``shape`` that starts on a page boundary, as shared pools' buffers do.
    Copies between two pools then keep the same offset within a page on both sides: a copy
    and hash from a shared pool into a buffer one cache line past a page boundary -- where
    torch's allocator puts large buffers -- ran at 0.73-0.82x of the same copy into an aligned
    one (docs/TRANSPORT_BENCH.md, "Private pools start on a page")."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = alloc(nbytes + _ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor, without copying."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return memoryview(arr).cast("B")


def _check_disjoint(bufs: Sequence[torch.Tensor]) -> None:
    """LayoutMismatch where two (contiguous) buffers share bytes: one layer's KV would land on another's."""
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), i) for i, b in enumerate(bufs))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutMismatch(f"buffers {min(i, j)} and {max(i, j)} overlap in memory: each layer (and K and V "
                                 "of a split layout) needs its own")


def whole_number(x: Any) -> Optional[int]:
    """``x`` as an int where it is one (Python, numpy or 0-d tensor integers); None otherwise."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def block_id_list(block_ids: Iterable[Any], what: str) -> list[int]:
    """``block_ids`` as a list of ints: Python, numpy or 0-d tensor integers (``operator.index``);
    anything else -- a float, a string, a bool -- is refused, not rounded into another block."""
    try:
        items = iter(block_ids)
    except TypeError:
        raise PoolError(f"{what}: block ids are a sequence of integers, got {type(block_ids).__name__} "
                        f"{block_ids!r:.40}") from None
    out = []
    for b in items:
        i = whole_number(b)
        if i is None:
            raise PoolError(f"{what}: block ids must be integers, got {b!r:.40}")
        out.append(i)
    return out


def retired_during(request_id: str) -> TransferCancelled:
    """The error of a transfer whose destination blocks were freed or retired while it ran: the
    engine gave them up (a preempted or aborted request), nothing in the call to fix."""
    return TransferCancelled(f"destination blocks of {request_id!r} were freed or retired during the transfer; their "
                     "contents are not this request's KV")


class LandingMark:
    """Destination blocks marked in ``pool`` (by :meth:`KVPool._land`); calling it unmarks them,
    the first time only -- a later call (two ends racing, a cleanup after an end) never unmarks
    blocks that another transfer has marked since. Transfers that end on another thread hold one
    (synchronous fetches pair ``_land`` with ``_landed`` directly: cheaper on the fast path)."""

    __slots__ = ("pool", "_ids")

    def __init__(self, pool: "KVPool", ids: list[int]) -> None:
        self.pool = pool
        self._ids = [ids]

    def __call__(self) -> None:
        try:
            ids = self._ids.pop()           # atomic: one caller gets them
        except IndexError:
            return
        self.pool._landed(ids)


class KVPool:
    """Blocks of KV cache for every layer, plus their allocator and generations.

    Build with :meth:`allocate` (kvbridge owns the memory) or :meth:`wrap` (an
    engine's own cache, zero copy). ``buffers[i]`` is the torch tensor of buffer
    ``i`` as numbered by :meth:`KVLayout.buffer_index`.
    """

    # the packed planes of every layer, with the buffers they describe (kvbridge.blockcopy.planes)
    _planes_all: Optional[tuple[list[torch.Tensor], bytes]] = None

    def __init__(self, layout: KVLayout, buffers: Sequence[torch.Tensor], num_blocks: int,
                 segment: Optional[SharedSegment] = None, buffer_offsets: Sequence[int] = (),
                 allocator: str = "kvbridge", gen_offset: Optional[int] = None) -> None:
        if allocator not in ("kvbridge", "engine"):
            raise ConfigError(f"allocator must be 'kvbridge' or 'engine', got {allocator!r}")
        self.engine_allocated = allocator == "engine"
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffers = list(buffers)
        self.segment = segment
        self.buffer_offsets = list(buffer_offsets)  # byte offset of each buffer in `segment`
        self.device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self._lock = threading.Lock()
        self._free: deque[int] = deque(() if self.engine_allocated else range(num_blocks))
        self._refs = [0] * num_blocks
        self._gens = [0] * num_blocks
        # Destination blocks of the fetches and reservations in progress into this pool (any
        # receiver's), one byte per block: a second one naming any of them is refused (_land).
        # The C extension marks and unmarks them, also inside the usual tcp fetch's one call
        # (blockcopy.fetch_whole), each call atomic for Python threads; without it, the lock.
        self._landing = bytearray(num_blocks)
        self._landing_lock = threading.Lock()
        # Every block's generation: the pool's own list (never replaced), read by the C extension
        # on every small read and fetch -- a plain attribute, not a property, for that hot path.
        # Never change it from outside the pool.
        self.live_generations: list[int] = self._gens
        # A shared pool mirrors each generation (u32) into its segment at ``gen_offset``, so a
        # reader that maps the segment checks generations with no message (shm:// one-sided reads).
        self.gen_offset = gen_offset if segment is not None else None
        self._shared_gens: Optional[memoryview] = None
        if segment is not None and gen_offset is not None:
            self._shared_gens = segment.view[gen_offset:gen_offset + GEN_SIZE * num_blocks].cast("I")
        self._views: Optional[list[memoryview]] = None
        self._staged = False
        self._cpu = self.device.type == "cpu"     # is_host is asked on every read: no torch call then
        self.on_free: list[Callable[[list[int]], None]] = []
        self.on_retire: list[Callable[[list[int]], None]] = []   # engine pools: pinned blocks retired

    # -- construction ------------------------------------------------------------------
    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: Union[str, torch.device] = "cpu",
                 shared: bool = False, zero: bool = True, allocator: str = "kvbridge") -> "KVPool":
        """Allocate a pool. ``shared=True`` puts it in POSIX shared memory (needed by ``shm://``).
        ``allocator="engine"``: the memory is kvbridge's, the block table the caller's."""
        n = whole_number(num_blocks)
        if n is None or n <= 0:
            raise ConfigError(f"num_blocks must be a positive whole number, not {num_blocks!r}")
        num_blocks = n
        device = torch.device(device)
        shape = layout.buffer_shape(num_blocks)
        if not shared:
            alloc = torch.zeros if zero else torch.empty
            total = layout.block_nbytes * num_blocks
            if total > _MAX_POOL_NBYTES:     # torch would fail to even size it (raw TypeError or RuntimeError)
                raise PoolError(f"cannot allocate {num_blocks} blocks of {layout.block_nbytes} bytes: {total} bytes")
            try:
                if device.type == "cpu":
                    bufs = [_page_aligned(alloc, shape, layout.torch_dtype) for _ in range(layout.num_buffers)]
                else:
                    bufs = [alloc(shape, dtype=layout.torch_dtype, device=device) for _ in range(layout.num_buffers)]
            except RuntimeError as exc:      # torch's out of memory (CPU or device): a backend missing is not one
                why = str(exc).lower()
                if "can't allocate" not in why and "out of memory" not in why:
                    raise
                raise PoolError(f"cannot allocate {num_blocks} blocks of {layout.block_nbytes} bytes ({total} "
                                f"bytes) on {device}: {str(exc).splitlines()[0][:200]}",
                                hint="allocate fewer blocks") from None
            return cls(layout, bufs, num_blocks, allocator=allocator)
        if device.type != "cpu":
            raise ConfigError("shared=True pools live in host shared memory; use device='cpu'")
        sweep_dead_segments()
        parts_per_buffer = 2 if layout.kv_order in (KVOrder.KV_FIRST, KVOrder.BLOCK_FIRST) else 1
        nbytes = num_blocks * layout.part_nbytes * parts_per_buffer
        stride = -(-nbytes // _ALIGN) * _ALIGN
        gen_offset = stride * layout.num_buffers          # the generation table follows the buffers
        need = gen_offset + GEN_SIZE * num_blocks
        if need > _MAX_POOL_NBYTES:
            raise PoolError(f"cannot allocate {num_blocks} blocks of {layout.block_nbytes} bytes in shared memory "
                            f"({need} bytes)", hint="allocate fewer blocks")
        seg = SharedSegment(f"kvb-{os.getpid()}-{secrets.token_hex(6)}", need)   # past the memory left: PoolError
        bufs, offs = [], []
        for i in range(layout.num_buffers):
            raw = torch.frombuffer(seg.mmap, dtype=torch.uint8, count=nbytes, offset=i * stride)
            bufs.append(raw.view(layout.torch_dtype).view(shape))
            offs.append(i * stride)
        return cls(layout, bufs, num_blocks, segment=seg, buffer_offsets=offs, allocator=allocator,
                   gen_offset=gen_offset)

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: Sequence[TensorOrPair], allocator: str = "kvbridge") -> "KVPool":
        """Wrap an engine's existing cache: one tensor per layer, or (K, V) per layer for SPLIT.

        ``allocator="engine"`` when the engine's scheduler picks block ids (see the module doc).
        The buffers must not share memory (two layers, or K and V, over the same bytes)."""
        tensors = list(tensors)
        if len(tensors) != layout.num_layers:
            raise LayoutMismatch(f"expected {layout.num_layers} layers, got {len(tensors)}")
        bufs: list[torch.Tensor] = []
        for t in tensors:
            if layout.kv_order is KVOrder.SPLIT:
                if not (isinstance(t, (tuple, list)) and len(t) == 2
                        and all(isinstance(x, torch.Tensor) for x in t)):
                    raise LayoutMismatch("a SPLIT layout wraps a (K, V) pair of tensors per layer")
                bufs.extend(t)
            else:
                if not isinstance(t, torch.Tensor):
                    raise LayoutMismatch(f"{layout.kv_order.value} layout wraps one tensor per layer")
                bufs.append(t)
        first = bufs[0]
        if first.dim() != len(layout.buffer_shape(1)):
            raise LayoutMismatch(f"KV buffers must have {len(layout.buffer_shape(1))} dimensions, "
                                 f"got shape {tuple(first.shape)}")
        num_blocks = first.shape[1] if layout.kv_order is KVOrder.KV_FIRST else first.shape[0]
        if num_blocks <= 0:
            raise LayoutMismatch("the KV buffers hold no blocks")
        want = layout.buffer_shape(num_blocks)
        for i, b in enumerate(bufs):
            if tuple(b.shape) != want:
                raise LayoutMismatch(f"buffer {i} has shape {tuple(b.shape)}, layout says {want}")
            if b.dtype != layout.torch_dtype:
                raise LayoutMismatch(f"buffer {i} has dtype {b.dtype}, layout says {layout.dtype}")
            if not b.is_contiguous():
                raise LayoutMismatch(f"buffer {i} is not contiguous")
            if b.device != first.device:
                raise LayoutMismatch("all buffers must be on one device")
        if first.device.type == "meta":
            raise LayoutMismatch("the KV buffers are on the meta device: they hold no memory to move")
        _check_disjoint(bufs)
        return cls(layout, bufs, num_blocks, allocator=allocator)

    # -- memory access ---------------------------------------------------------------
    @property
    def is_host(self) -> bool:
        """True when transports may address the memory directly (a CPU pool). Device pools
        are staged through host buffers; ``_staged`` makes a CPU pool behave like one."""
        return self._cpu and not self._staged

    def host_views(self) -> list[memoryview]:
        """Byte memoryviews over each buffer (CPU pools only); built once, reused."""
        if not self.is_host:
            raise ConfigError("host_views() needs a CPU pool; GPU pools are staged by the transport")
        if self._views is None:
            self._views = [_host_view(b) for b in self.buffers]
        return self._views

    def buffer_addresses(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers]

    def layer_kv(self, layer: int) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(K, V), each ``(num_blocks, *part_shape)``, or the latent tensor for MLA."""
        L = self.layout
        if L.kv_order is KVOrder.KV_FIRST:
            b = self.buffers[layer]
            return b[0], b[1]
        if L.kv_order is KVOrder.BLOCK_FIRST:
            b = self.buffers[layer]
            return b[:, 0], b[:, 1]
        if L.kv_order is KVOrder.SPLIT:
            return self.buffers[2 * layer], self.buffers[2 * layer + 1]
        return self.buffers[layer]

    def block(self, layer: int, block_id: int) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """View of one block of one layer: (K, V) parts, or the latent part for MLA."""
        self._check_ids([block_id])
        kv = self.layer_kv(layer)
        if isinstance(kv, tuple):
            return kv[0][block_id], kv[1][block_id]
        return kv[block_id]

    # -- allocator -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def _check_ids(self, ids: Iterable[int]) -> None:
        for b in ids:
            if not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise PoolError(f"block id {b!r} outside pool of {self.num_blocks} blocks")

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each)."""
        if self.engine_allocated:
            raise PoolError("this pool's blocks are allocated by the engine (allocator='engine'); "
                            "pin the engine's block ids instead of alloc()")
        k = whole_number(n)
        if k is None or k < 0:
            raise PoolError(f"alloc() takes a whole number of blocks >= 0, got {n!r}")
        n = k
        with self._lock:
            if n > len(self._free):
                raise PoolError(f"pool exhausted: asked {n} blocks, {len(self._free)} free",
                                hint="free blocks or allocate a larger pool")
            ids = [self._free.popleft() for _ in range(n)]
            for b in ids:
                self._refs[b] = 1
        return ids

    def ref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to allocated blocks (e.g. a published handle pins them)."""
        ids = block_id_list(block_ids, "ref")
        self._check_ids(ids)
        with self._lock:
            if not self.engine_allocated:
                for b in ids:
                    if self._refs[b] <= 0:
                        raise PoolError(f"block {b} is free; cannot take a reference")
            for b in ids:
                self._refs[b] += 1

    pin = ref

    def unpin(self, block_ids: Iterable[int]) -> list[int]:
        """Drop pins taken with :meth:`pin` (the same as :meth:`free`)."""
        return self.free(block_ids)

    def retire(self, block_ids: Iterable[int]) -> list[int]:
        """Engine pools: the engine freed or reused these blocks. Their generation moves on,
        so handles naming them are refused. Returns the retired blocks that were still
        pinned (a live handle or transfer names them); ``on_retire`` listeners hear of those.
        Cheap enough for an allocator's free path: one lock, one pass, no allocation when
        nothing is pinned."""
        if not self.engine_allocated:
            raise PoolError("retire() is for engine-allocated pools; kvbridge's allocator frees with free()")
        gens, refs, n = self._gens, self._refs, self.num_blocks
        pinned: list[int] = []
        try:
            with self._lock:
                shared = self._shared_gens
                for b in block_ids:
                    if type(b) is not int:             # numpy or tensor integers; nothing else
                        b = block_id_list((b,), "retire")[0]
                    if not 0 <= b < n:
                        raise PoolError(f"block id {b!r} outside pool of {n} blocks")
                    gens[b] = (gens[b] + 1) & 0xFFFFFFFF
                    if shared is not None:
                        shared[b] = gens[b]    # before the engine may write the block again
                    if refs[b]:
                        pinned.append(b)
        finally:    # a bad id further on: the blocks retired before it still end their handles
            if pinned:
                for cb in list(self.on_retire):
                    cb(pinned)
        return pinned

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference each; blocks reaching zero return to the free list with a new
        generation (engine pools: they are only unpinned). Returns the ids reaching zero."""
        ids = block_id_list(block_ids, "free")
        self._check_ids(ids)
        freed: list[int] = []
        counts: dict[int, int] = {}
        for b in ids:
            counts[b] = counts.get(b, 0) + 1
        with self._lock:
            for b, k in counts.items():
                if self._refs[b] < k:
                    raise PoolError(f"double free of block {b} (refcount {self._refs[b]}, freed {k}x)")
            for b in ids:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    freed.append(b)
                    if not self.engine_allocated:   # the engine retires its own blocks
                        self._gens[b] = (self._gens[b] + 1) & 0xFFFFFFFF
                        if self._shared_gens is not None:
                            self._shared_gens[b] = self._gens[b]   # published before the block is reusable
                        self._free.append(b)
        if freed:
            for cb in list(self.on_free):
                cb(freed)
        return freed

    def _one(self, block_id: Any) -> int:
        b = whole_number(block_id)
        if b is None or not 0 <= b < self.num_blocks:    # -1 is no block (it would answer for the last)
            raise PoolError(f"block id {block_id!r} outside pool of {self.num_blocks} blocks")
        return b

    def refcount(self, block_id: int) -> int:
        return self._refs[self._one(block_id)]

    def _land(self, block_ids: Sequence[int], what: str = "a fetch") -> None:
        """Mark ``block_ids`` (checked ids) as the destination of ``what``, in progress; PoolError,
        marking nothing, where any of them already is one: two transfers landing in one block
        would leave it holding bytes of either, each verified against its own. Undone by
        :meth:`_landed` when the transfer ends, however it ends."""
        marks = self._landing
        if blockcopy.land is not None:
            if blockcopy.land(marks, block_ids, True):
                return
        else:
            with self._landing_lock:
                if not any(marks[b] for b in block_ids):
                    for b in block_ids:
                        marks[b] = 1
                    return
        shown = sorted({b for b in block_ids if marks[b]})
        raise PoolError(f"{what} into destination block{'s' if len(shown) > 1 else ''} "
                        f"{shown[:8]}{' ...' if len(shown) > 8 else ''}, which another fetch or reservation "
                        "in progress is writing: wait for it to end, or name other blocks")

    def _landed(self, block_ids: Sequence[int]) -> None:
        marks = self._landing
        if blockcopy.land is not None:
            blockcopy.land(marks, block_ids, False)
            return
        with self._landing_lock:
            for b in block_ids:
                marks[b] = 0

    def landing(self) -> list[int]:
        """Destination blocks of the fetches and reservations in progress into this pool."""
        return [b for b, m in enumerate(self._landing) if m]

    def generation(self, block_id: int) -> int:
        return self._gens[self._one(block_id)]

    def generations(self, block_ids: Iterable[int]) -> list[int]:
        """Generations of ids already checked (:meth:`_check_ids`): no check here, it is on the fetch path."""
        g = self._gens
        return [g[b] for b in block_ids]

    def same_generations(self, block_ids: Sequence[int], gens: Sequence[int]) -> bool:
        """Whether ``block_ids`` still have generations ``gens`` (equal lengths)."""
        g = self._gens
        for b, want in zip(block_ids, gens):
            if g[b] != want:
                return False
        return True

    @property
    def closed(self) -> bool:
        """After :meth:`close`: its buffers are gone."""
        return not self.buffers

    def close(self) -> None:
        self._views = None
        self.buffers = []
        if self._shared_gens is not None:
            self._shared_gens.release()
            self._shared_gens = None
        if self.segment is not None:
            self.segment.close()

    def __repr__(self) -> str:
        return (f"KVPool({self.num_blocks} blocks x {self.layout.num_layers} layers, "
                f"{self.layout.block_nbytes} B/block, device={self.device}, free={self.num_free})")
