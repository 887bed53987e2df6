"""Device pools over host transports: a ring of pinned host buffers between the pool and the wire.

tcp:// and shm:// move host bytes. When a pool is not host-addressable (an engine's
CUDA KV cache), the sender copies the next chunk device-to-host into a free ring slot
while the previous slot is on the wire, and the receiver copies each landed slot
host-to-device while the next one arrives. Copies are ``non_blocking`` on CUDA with an
event per slot, so the copy engine and the socket overlap; on the CPU the same code runs
synchronously (that is how it is tested without a GPU).
"""

from __future__ import annotations

import socket
import threading
from typing import Optional, Sequence

import torch

from ..pool import _host_view
from .base import Spans
from .wire import recv_scatter, send_all

__all__ = ["StagingRing", "RingPool", "device_slices", "send_staged", "recv_staged", "copy_slices"]

STAGE_CHUNK = 4 << 20
SLOTS = 3


def device_slices(spans: Spans) -> list[torch.Tensor]:
    """The spans as flat uint8 tensor views of the pool's buffers (any device)."""
    flats = [b.view(-1).view(torch.uint8) for b in spans.pool.buffers]
    return [flats[b][o:o + n] for b, o, n in spans.segments]


def _groups(slices: Sequence[torch.Tensor], chunk: int) -> list[tuple[list[tuple[torch.Tensor, int]], int]]:
    """Cut the byte stream into slot-sized groups of (piece, offset in slot)."""
    groups: list[tuple[list[tuple[torch.Tensor, int]], int]] = []
    cur: list[tuple[torch.Tensor, int]] = []
    fill = 0
    for t in slices:
        pos, n = 0, t.numel()
        while pos < n:
            k = min(n - pos, chunk - fill)
            cur.append((t[pos:pos + k], fill))
            fill += k
            pos += k
            if fill == chunk:
                groups.append((cur, fill))
                cur, fill = [], 0
    if cur:
        groups.append((cur, fill))
    return groups


class StagingRing:
    """``SLOTS`` host buffers of ``chunk`` bytes (pinned when CUDA is present)."""

    def __init__(self, chunk: int = STAGE_CHUNK, slots: int = SLOTS) -> None:
        pin = torch.cuda.is_available()
        self.chunk = chunk
        self.slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.views = [_host_view(s) for s in self.slots]
        self.events: list[Optional[torch.cuda.Event]] = [None] * slots

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


def send_staged(sock: socket.socket, spans: Spans, ring: StagingRing, head: bytes) -> int:
    """Send ``head`` then the spans' bytes, staging chunk i+1 while chunk i is on the wire."""
    cuda = spans.pool.device.type == "cuda"
    groups = _groups(device_slices(spans), ring.chunk)
    n = len(ring.slots)

    def stage(i: int) -> None:
        slot = i % n
        for piece, off in groups[i][0]:
            ring.slots[slot][off:off + piece.numel()].copy_(piece, non_blocking=cuda)
        ring._record(slot, cuda)

    send_all(sock, [head])
    sent = 0
    if groups:
        stage(0)
    for i, (_, fill) in enumerate(groups):
        if i + 1 < len(groups):
            stage(i + 1)
        ring._wait(i % n)
        sent += send_all(sock, [ring.views[i % n][:fill]])
    return sent


def recv_staged(sock: socket.socket, spans: Spans, ring: StagingRing) -> int:
    """Receive the spans' bytes slot by slot, copying each landed slot to the pool."""
    cuda = spans.pool.device.type == "cuda"
    n = len(ring.slots)
    got = 0
    for i, (pieces, fill) in enumerate(_groups(device_slices(spans), ring.chunk)):
        slot = i % n
        ring._wait(slot)                      # its previous host-to-device copies are done
        got += recv_scatter(sock, [ring.views[slot][:fill]])
        for piece, off in pieces:
            piece.copy_(ring.slots[slot][off:off + piece.numel()], non_blocking=cuda)
        ring._record(slot, cuda)
    for slot in range(n):
        ring._wait(slot)
    return got


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
