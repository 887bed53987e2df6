"""What a sender keeps per published handle, and the read grant it gives transports."""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from .errors import BadHandle
from .frames import FrameStore
from .handle import KVHandle
from .lease import Claim
from .pool import KVPool
from .transports.base import Spans
from .transports.wire import Vouch

if TYPE_CHECKING:
    from .sender import KVSender

__all__ = ["Record", "Grant", "Deadlines", "parse_ticket", "still_ours"]

log = logging.getLogger("kvbridge.sender")


@dataclass
class Record:
    handle: KVHandle
    raw: bytes
    block_ids: list[int]
    deadline: float
    inflight: int = 0
    live: bool = True
    reason: str = ""
    spans: Optional[Spans] = None
    freed: bool = False
    free_after: float = 0.0   # when Redis could not be told: free at the local deadline
    revoking: bool = False    # a revoke is on its way to Redis: nothing may free yet
    ready: int = 0            # layers 0..ready-1 are final
    sums: list[list[int]] = field(default_factory=list)   # layer-wise: per layer, per block
    frames: Optional[FrameStore] = None                   # a coded handle's frames
    alive_until: float = 0.0  # monotonic: the lease is certainly within its TTL until then (holds_until)
    claimed: Optional[Claim] = None   # the claim this sender made for a reader (CLAIM_ME), by that read


class Deadlines:
    """The sender's local deadlines, earliest first: a heap of (deadline, seq, handle id), used
    under the sender's lock with the sender's table of live records. Entries name handles, not
    records, so an ended record is freed at once (the heap keeps no garbage alive for the
    collector to walk); entries of ended or renewed handles stay until they surface (skipped,
    or put back at the new deadline), and :meth:`push` rebuilds the heap from the live
    records when such entries pile up."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def earliest(self) -> Optional[float]:
        return self._heap[0][0] if self._heap else None

    def push(self, rec: Record, live: Mapping[bytes, Record]) -> bool:
        """Add ``rec``'s deadline; True when it is the new earliest (the sweeper must wake)."""
        h = self._heap
        if len(h) > 2 * len(live) + 1024:          # mostly ended or renewed entries: rebuild
            h[:] = [(r.deadline, next(self._seq), k) for k, r in live.items() if r is not rec]
            heapq.heapify(h)
        first = not h or rec.deadline < h[0][0]
        heapq.heappush(h, (rec.deadline, next(self._seq), rec.handle.handle_id))
        return first

    def due(self, now: float, live: Mapping[bytes, Record]) -> list[Record]:
        """Live records whose deadline passed, taken off the heap: O(log n) each, not a scan."""
        h, out = self._heap, []
        while h and h[0][0] <= now:
            _, _, key = heapq.heappop(h)
            rec = live.get(key)
            if rec is None or not rec.live:
                continue
            if rec.deadline > now:                 # renewed since: back in at its new deadline
                heapq.heappush(h, (rec.deadline, next(self._seq), key))
            else:
                out.append(rec)
        return out


@dataclass(slots=True)
class Grant:
    sender: "KVSender"
    rec: Record
    spans: Spans
    layers: tuple[int, int] = (0, 0)
    sums: bytes = b""
    claim: Optional[Claim] = None
    closed: bool = field(default=False)

    def still_valid(self) -> bool:
        return self.rec.live and self.sender.pool.same_generations(self.rec.block_ids, self.rec.handle.generations)

    def vouch(self) -> Vouch:
        """The owner's validate-after-read, called once the last byte of the read has left (handed
        to the kernel, or copied): OK when the blocks still hold the handle's generations and,
        for a leased handle, the handle is live -- the owner has begun no end of it (revoke,
        expiry, close: ``live`` falls before any revoke is sent; releases and aborts come
        only from the claimer) -- and its lease is certainly within its TTL by this clock.
        UNSURE when only the lease is in doubt (the grant still holds the blocks, so the bytes
        are intact), STALE when the blocks moved on. A handle without a lease has no claim to
        be in force: its bytes being the handle's is all there is to vouch for."""
        rec = self.rec
        if not self.sender.pool.same_generations(rec.block_ids, rec.handle.generations):
            return Vouch.STALE
        if not rec.handle.lease_id or self.sender.leases is None:
            return Vouch.OK
        if not rec.live or time.monotonic() >= rec.alive_until:
            return Vouch.UNSURE
        return Vouch.OK

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sender._read_done(self.rec)


def still_ours(pool: KVPool, rec: Record) -> list[int]:
    """The blocks to free of an ended record: in a kvbridge-allocated pool, not those whose
    generation moved on -- the caller freed them behind the handle's back, and another request
    may hold them now: freed again, its block would go back to the free list under it."""
    if pool.engine_allocated or pool.same_generations(rec.block_ids, rec.handle.generations):
        return rec.block_ids
    gens = pool.live_generations
    ours = [b for b, g in zip(rec.block_ids, rec.handle.generations) if gens[b] == g]
    log.error("blocks of %s were freed behind its back (%d of %d); not freed again",
              rec.handle.request_id, len(rec.block_ids) - len(ours), len(rec.block_ids))
    return ours


def parse_ticket(ticket: Union[KVHandle, bytes, dict[str, Any]]) -> KVHandle:
    if isinstance(ticket, KVHandle):
        return ticket
    if isinstance(ticket, dict):
        return KVHandle.from_dict(ticket)
    if isinstance(ticket, (bytes, bytearray, memoryview)):
        return KVHandle.from_bytes(ticket)
    raise BadHandle(f"expected a KVHandle, bytes or dict, got {type(ticket).__name__}")
