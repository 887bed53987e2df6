"""Device pools over host transports, and batched copies of block lists between any two memories.

tcp:// and shm:// move host bytes. When a pool is not host-addressable (an engine's CUDA
KV cache), the sender stages the byte stream through a ring of pinned host slots: per
slot, **one gather** of the slot's pieces into a device buffer (``index_select`` over the
pool buffer viewed as rows of the pieces' common size) and **one device-to-host copy**;
the receiver does one host-to-device copy and one scatter (``index_copy_``) per slot. A
slot that spans several pool buffers (a layer boundary) takes one gather per buffer, never
one launch per piece. Copies are ``non_blocking`` on CUDA with an event per slot, so the
next slot is gathered and copied while the previous one is on the wire; on the CPU the
same code runs synchronously (that is how it is tested without a GPU).

:func:`copy_pieces` moves one byte stream into another (nvlink://): one kernel over every
piece when all buffers are on one CUDA device and CuPy is there (:mod:`.gpucopy`), the same
row gathers otherwise. The per-slot gathers above go through it too. :func:`stage_out` is also how device pools are
checksummed (:mod:`kvbridge.integrity` hashes the staged host bytes).
"""

from __future__ import annotations

import math
import socket
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..errors import TransferCancelled
from ..pool import _host_view
from . import gpucopy
from .base import Spans
from .wire import recv_scatter, send_all

__all__ = ["StagingRing", "RingPool", "RINGS", "device_slices", "send_staged", "recv_staged", "copy_slices",
           "plan_slots", "stage_out", "stage_in", "copy_pieces", "Piece"]

STAGE_CHUNK = 4 << 20
SLOTS = 3
Piece = tuple[int, int, int]     # (buffer index, byte offset, nbytes): one contiguous run of a flat buffer
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def device_slices(spans: Spans) -> list[torch.Tensor]:
    """The spans as flat uint8 tensor views of the pool's buffers (any device)."""
    flats = flat_buffers(spans.pool.buffers)
    return [flats[b][o:o + n] for b, o, n in spans.segments]


def flat_buffers(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [b.reshape(-1).view(torch.uint8) for b in buffers]


# -- row plans: a list of pieces as a few (buffer, row size, row indices) gathers ----------------
class _Run:
    """Consecutive pieces of one source buffer (and one destination buffer): one gather each way."""

    __slots__ = ("src", "dst", "pieces")

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.pieces: list[tuple[int, int, int]] = []    # (src offset, dst offset, nbytes)


def _rows(offsets: list[int], lengths: list[int], g: int) -> torch.Tensor:
    """Row indices (rows of ``g`` bytes) covering each (offset, length) piece, in order."""
    starts = torch.tensor([o // g for o in offsets], dtype=torch.int64)
    if all(n == g for n in lengths):
        return starts
    counts = torch.tensor([n // g for n in lengths], dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts                       # position of each piece's first row
    pos = torch.arange(int(counts.sum()), dtype=torch.int64)
    return torch.repeat_interleave(starts - first, counts) + pos


def _word(g: int, *tensors_and_offsets: tuple[torch.Tensor, int]) -> tuple[int, torch.dtype]:
    """The widest word that divides the row size and every base address involved."""
    for w, dt in _WORDS:
        if g % w == 0 and all((t.data_ptr() + off) % w == 0 for t, off in tensors_and_offsets):
            return w, dt
    return 1, torch.uint8


def _as_rows(flat: torch.Tensor, g: int, w: int, dt: torch.dtype) -> torch.Tensor:
    """``flat`` (uint8) as rows of ``g`` bytes, each row ``g // w`` words of ``dt``."""
    n = flat.numel() // g * g
    return flat[:n].view(dt).view(-1, g // w) if w > 1 else flat[:n].view(-1, g)


def _runs_of(src: Sequence[Piece], dst: Sequence[Piece]) -> list[_Run]:
    """Pair the two streams' pieces (cut at both sides' boundaries) and group them into runs."""
    runs: list[_Run] = []
    i = j = soff = doff = 0
    while i < len(src) and j < len(dst):
        sb, so, sn = src[i]
        db, do, dn = dst[j]
        k = min(sn - soff, dn - doff)
        if k:
            if not runs or runs[-1].src != sb or runs[-1].dst != db:
                runs.append(_Run(sb, db))
            runs[-1].pieces.append((so + soff, do + doff, k))
        soff += k
        doff += k
        if soff == sn:
            i, soff = i + 1, 0
        if doff == dn:
            j, doff = j + 1, 0
    return runs


def _copy_run(run: _Run, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[pieces] = src[pieces] as row gathers: one kernel when a side is contiguous, else two."""
    p = run.pieces
    g = 0
    for so, do, n in p:
        g = math.gcd(g, so, do, n)
    w, dt = _word(g, (src, 0), (dst, 0))
    s2, d2 = _as_rows(src, g, w, dt), _as_rows(dst, g, w, dt)
    lens = [n for _, _, n in p]
    s_contig = all(p[k][0] + p[k][2] == p[k + 1][0] for k in range(len(p) - 1))
    d_contig = all(p[k][1] + p[k][2] == p[k + 1][1] for k in range(len(p) - 1))
    nrows = sum(lens) // g
    if s_contig:
        block = s2[p[0][0] // g:p[0][0] // g + nrows]
        if d_contig:
            d2[p[0][1] // g:p[0][1] // g + nrows].copy_(block, non_blocking=True)
            return
        d2.index_copy_(0, _rows([d for _, d, _ in p], lens, g).to(dst.device, non_blocking=True),
                       block.to(dst.device, non_blocking=True))
        return
    srows = _rows([s for s, _, _ in p], lens, g).to(src.device, non_blocking=True)
    if d_contig and src.device == dst.device:
        torch.index_select(s2, 0, srows, out=d2[p[0][1] // g:p[0][1] // g + nrows])
        return
    gathered = s2.index_select(0, srows).to(dst.device, non_blocking=True)
    if d_contig:
        d2[p[0][1] // g:p[0][1] // g + nrows].copy_(gathered, non_blocking=True)
    else:
        d2.index_copy_(0, _rows([d for _, d, _ in p], lens, g).to(dst.device, non_blocking=True), gathered)


def copy_pieces(dst_flats: Sequence[torch.Tensor], dst: Any, src_flats: Sequence[torch.Tensor], src: Any) -> int:
    """Copy the byte stream ``src`` (pieces of ``src_flats``) into ``dst`` (pieces of ``dst_flats``),
    on the current streams; the caller synchronizes. Returns the bytes moved. Pieces are
    sequences of ``(buffer, offset, nbytes)`` or ``(n, 3)`` arrays.

    Every buffer on one CUDA device (and CuPy there): one kernel over all the pieces
    (:mod:`kvbridge.transports.gpucopy`). Otherwise one gather/scatter per run of pieces between
    the same two buffers (a layer's part)."""
    got = gpucopy.copy(dst_flats, dst, src_flats, src)
    if got is not None:
        return got
    if hasattr(src, "tolist"):
        src = src.tolist()
    if hasattr(dst, "tolist"):
        dst = dst.tolist()
    moved = 0
    for run in _runs_of(src, dst):
        _copy_run(run, src_flats[run.src], dst_flats[run.dst])
        moved += sum(n for _, _, n in run.pieces)
    return moved


# -- the staging ring ----------------------------------------------------------------------------
def plan_slots(segments: Any, chunk: int) -> list[tuple[np.ndarray, int]]:
    """Cut the stream into slots of at most ``chunk`` bytes: (the slot's pieces as an ``(m, 3)``
    array, its fill). ``segments``: pieces as tuples or an ``(n, 3)`` array (no Python loop
    per piece: a block-shaped handle has thousands).

    When every piece has one size (a block-shaped handle) the slot size is rounded down to a
    multiple of it, so no piece is split and each slot's gather has rows of that size."""
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    seg = seg[seg[:, 2] > 0]
    if not len(seg):
        return []
    sizes = np.unique(seg[:, 2])
    if len(sizes) == 1 and int(sizes[0]) <= chunk:
        chunk -= chunk % int(sizes[0])
    ends = np.cumsum(seg[:, 2])
    starts = ends - seg[:, 2]
    first = starts // chunk                         # the slot each piece starts in ...
    k = (ends - 1) // chunk - first + 1             # ... and how many slots it reaches into
    idx = np.repeat(np.arange(len(seg)), k)
    slot = first[idx] + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    lo = np.maximum(starts[idx], slot * chunk)
    hi = np.minimum(ends[idx], (slot + 1) * chunk)
    pieces = np.stack([seg[idx, 0], seg[idx, 1] + (lo - starts[idx]), hi - lo], axis=1)
    groups = np.split(pieces, np.flatnonzero(np.diff(slot)) + 1)   # slots are consecutive: none empty
    return [(g, int(g[:, 2].sum())) for g in groups]


class StagingRing:
    """``SLOTS`` host buffers of ``chunk`` bytes (pinned when CUDA is present), and per device
    ``SLOTS`` device buffers that the gathers fill (made on first use)."""

    def __init__(self, chunk: int = STAGE_CHUNK, slots: int = SLOTS) -> None:
        pin = torch.cuda.is_available()
        self.chunk = chunk
        self.slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.views = [_host_view(s) for s in self.slots]
        self.events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._dev: dict[torch.device, list[torch.Tensor]] = {}

    def device_slots(self, device: torch.device) -> list[torch.Tensor]:
        bufs = self._dev.get(device)
        if bufs is None:
            bufs = self._dev[device] = [torch.empty(self.chunk, dtype=torch.uint8, device=device)
                                        for _ in self.slots]
        return bufs

    def _record(self, slot: int, cuda: bool) -> None:
        if cuda:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            self.events[slot] = ev

    def _wait(self, slot: int) -> None:
        ev, self.events[slot] = self.events[slot], None
        if ev is not None:
            ev.synchronize()


class RingPool:
    """Rings reused across transfers (allocating pinned memory per transfer is slow)."""

    def __init__(self, chunk: int = STAGE_CHUNK) -> None:
        self.chunk = chunk
        self._free: list[StagingRing] = []
        self._lock = threading.Lock()

    def take(self) -> StagingRing:
        with self._lock:
            if self._free:
                return self._free.pop()
        return StagingRing(self.chunk)

    def give(self, ring: StagingRing) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(ring)


RINGS = RingPool()    # for checksums of device pools and other staging outside a transport


def stage_out(spans: Spans, ring: StagingRing, sink: Callable[[memoryview], object]) -> int:
    """Hand the spans' byte stream to ``sink`` slot by slot, as host memory (valid during the
    call): per slot one gather on the device and one device-to-host copy, the next slot's
    copies in flight while ``sink`` runs. Returns the bytes staged."""
    pool = spans.pool
    dev = pool.device
    cuda = dev.type == "cuda"
    flats = flat_buffers(pool.buffers)
    plan = plan_slots(spans.segment_array, ring.chunk)
    dslots = ring.device_slots(dev)
    n = len(ring.slots)

    def stage(i: int) -> None:
        slot = i % n
        pieces, fill = plan[i]
        copy_pieces([dslots[slot]], [(0, 0, fill)], flats, pieces)                 # one gather (per buffer)
        ring.slots[slot][:fill].copy_(dslots[slot][:fill], non_blocking=cuda)    # one device-to-host copy
        ring._record(slot, cuda)

    done = 0
    try:
        if plan:
            stage(0)
        for i, (_, fill) in enumerate(plan):
            if i + 1 < len(plan):
                stage(i + 1)
            ring._wait(i % n)
            sink(ring.views[i % n][:fill])
            done += fill
    finally:
        for slot in range(n):
            ring._wait(slot)
    return done


def stage_in(spans: Spans, ring: StagingRing, source: Callable[[memoryview], int]) -> int:
    """Fill the spans slot by slot: ``source(view)`` fills a host slot, then one host-to-device
    copy and one scatter move it into the pool while the next slot fills. Returns bytes."""
    pool = spans.pool
    dev = pool.device
    cuda = dev.type == "cuda"
    flats = flat_buffers(pool.buffers)
    dslots = ring.device_slots(dev)
    n = len(ring.slots)
    got = 0
    try:
        for i, (pieces, fill) in enumerate(plan_slots(spans.segment_array, ring.chunk)):
            slot = i % n
            ring._wait(slot)                      # its previous copies are done: slot and buffer free
            got += source(ring.views[slot][:fill])
            dslots[slot][:fill].copy_(ring.slots[slot][:fill], non_blocking=cuda)      # one host-to-device copy
            copy_pieces(flats, pieces, [dslots[slot]], [(0, 0, fill)])                 # one scatter (per buffer)
            ring._record(slot, cuda)
    finally:
        for slot in range(n):
            ring._wait(slot)
    return got


def send_staged(sock: socket.socket, spans: Spans, ring: StagingRing, head: bytes) -> int:
    """Send ``head`` then the spans' bytes, staging slot i+1 while slot i is on the wire."""
    send_all(sock, [head])
    return stage_out(spans, ring, lambda view: send_all(sock, [view]))


def recv_staged(sock: socket.socket, spans: Spans, ring: StagingRing) -> int:
    """Receive the spans' bytes slot by slot into the pool. With a verifier the bytes are
    hashed in the host slot as they land (the device pool itself is never read back)."""
    v = spans.verifier

    def land(view: memoryview) -> int:
        got = recv_scatter(sock, [view])
        if v is not None:
            v.consume(view)
        if spans.cancel is not None and spans.cancel.is_set():
            raise TransferCancelled("transfer cancelled")
        return got
    return stage_in(spans, ring, land)


def copy_slices(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> int:
    """Copy one byte stream into another with different piece boundaries (any devices)."""
    i = j = doff = soff = moved = 0
    while i < len(dst) and j < len(src):
        d, s = dst[i], src[j]
        k = min(d.numel() - doff, s.numel() - soff)
        d[doff:doff + k].copy_(s[soff:soff + k])
        moved += k
        doff += k
        soff += k
        if doff == d.numel():
            i, doff = i + 1, 0
        if soff == s.numel():
            j, soff = j + 1, 0
    if dst and dst[0].device.type == "cuda" or src and src[0].device.type == "cuda":
        torch.cuda.synchronize()
    return moved
