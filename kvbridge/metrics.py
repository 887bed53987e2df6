"""Counters kept by senders and receivers. Updated from several threads (transport server
threads, transfer workers), so every update goes through :meth:`add` or a method like it,
under a lock -- except the reads the sender's C frame loop answers, which it counts itself
under the GIL (``SenderStats._native``)."""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["SenderStats", "ReceiverStats"]

_BLOCKS: dict[str, str] = {}   # reason -> its blocks_<reason> counter


@dataclass
class _Counters:
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Add to several counters at once, atomically."""
        with self._lock:
            for name, d in deltas.items():
                setattr(self, name, getattr(self, name) + d)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass
class SenderStats(_Counters):
    published: int = 0
    blocks_published: int = 0
    pushes: int = 0              # push transfers started
    pushed: int = 0              # push transfers that completed
    # handles ended, by reason ("expired" = reclaimed at the TTL without a release)
    released: int = 0
    aborted: int = 0
    expired: int = 0
    revoked: int = 0
    retired: int = 0             # the engine retired a published block
    closed: int = 0
    blocks_freed: int = 0
    blocks_released: int = 0
    blocks_aborted: int = 0
    blocks_expired: int = 0
    blocks_revoked: int = 0
    blocks_retired: int = 0
    blocks_pushed: int = 0
    blocks_closed: int = 0
    bytes_pushed: int = 0
    refused: int = 0
    # reads granted (``reads``, ``bytes_served``): those the frame loop answered in C count in
    # ``_native`` (reads, bytes), which the C call adds to under the GIL (no lock, no call
    # back into Python per read); the others in ``_reads``, ``_bytes`` under the lock
    _native: "array[int]" = field(default_factory=lambda: array("q", [0, 0]), init=False, repr=False, compare=False)
    _reads: int = field(default=0, init=False, repr=False, compare=False)
    _bytes: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def reads(self) -> int:
        return int(self._reads + self._native[0])

    @property
    def bytes_served(self) -> int:
        return int(self._bytes + self._native[1])

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        out.update(reads=self.reads, bytes_served=self.bytes_served)
        return out

    def ended(self, reason: str, nblocks: int, count: int = 1) -> None:
        """``count`` handles ended for ``reason`` (a counter's name) and their ``nblocks`` blocks
        were freed."""
        with self._lock:
            setattr(self, reason, getattr(self, reason) + count)
            blocks = _BLOCKS.get(reason) or _BLOCKS.setdefault(reason, "blocks_" + reason)
            setattr(self, blocks, getattr(self, blocks) + nblocks)
            self.blocks_freed += nblocks

    def served(self, nbytes: int) -> None:
        """One read granted (the hot path's single update)."""
        with self._lock:
            self._reads += 1
            self._bytes += nbytes


@dataclass
class ReceiverStats(_Counters):
    fetches: int = 0
    claimed: int = 0             # leases claimed
    released: int = 0            # leases released after a verified fetch (counted once the store took it)
    released_later: int = 0      # ... of them, sent after the fetch had returned (off its critical path)
    release_failures: int = 0    # releases sent after the fetch that the store refused or never got
    aborted: int = 0             # claims given up after a failed fetch
    stale_refused: int = 0       # fetches whose bytes a lease check refused (never used)
    cancelled: int = 0
    ok: int = 0
    failed: int = 0
    retries: int = 0
    refetches: int = 0
    integrity_failures: int = 0
    reservations: int = 0        # push mode: destination blocks offered
    writes_refused: int = 0      # push mode: writes refused (bad ticket, stale fence, late)
    bytes: int = 0
    seconds: float = 0.0

    def fetched(self, ok: bool, nbytes: int, seconds: float) -> None:
        """One fetch ended (the hot path's single update)."""
        with self._lock:
            self.fetches += 1
            self.seconds += seconds
            if ok:
                self.ok += 1
                self.bytes += nbytes
