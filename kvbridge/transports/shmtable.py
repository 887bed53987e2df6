"""shm:// one-sided reads: the live-handle table and the reader's view of a sender.

A sender's shm endpoint keeps, in a shared-memory segment of its own, a table of the
whole raw handles it serves: one 32-byte slot per live handle, holding a 16-byte BLAKE2b
digest of the handle's exact bytes and a sequence number (odd: live). Together with the
per-block generations that a shared :class:`~kvbridge.pool.KVPool` mirrors into its
segment, it lets a reader that mapped both (once, over the control channel) do what a
MAP/DONE exchange did, with no message:

1. the handle's digest is in the table and live (the bytes are exactly what the sender
   issued -- token and MAC included -- and the handle has not ended), and every block's
   generation equals the handle's;
2. copy the blocks out of the mapped pool;
3. the slot's sequence number and every generation are unchanged, and the sender's
   control connection is still open.

A block's memory is rewritten only after its generation moved on (``KVPool.free`` and
``KVPool.retire`` publish the new generation before the block can be reused), and the
sender clears a handle's slot when the handle ends, before it frees anything. So if
step 3 sees the same values as step 1, no byte copied in step 2 came from a reuse; if
it does not, the bytes are discarded (:class:`~kvbridge.errors.StaleHandle`, as DONE
answered). The argument needs stores to become visible in program order and loads not
to pass loads (x86-64's TSO); elsewhere :data:`ONE_SIDED` is False and every read takes
the MAP/DONE exchange.

The digest stands in for the sender's own check of the bytes (the MAC and token, or the
comparison with those issued): a receiver without the secret never checks a MAC, and a
handle may come from anyone, so the key must be one that no other bytes can be made to
match, knowing a genuine handle or not -- a cryptographic hash (BLAKE2b-128: no second
preimage is within reach), computed by the one-sided read's C call itself
(``blockcopy.shm_read``, the same bytes as :func:`digest`).

Anything the fast path cannot vouch for -- a handle not in the table (layer-wise, coded,
table full, ended, forged), a generation already moved, a bad index -- goes to the
MAP/DONE exchange, so refusals keep their exact error from the sender.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import secrets
import struct
import threading
from typing import Any, Optional

from ..errors import ConfigError, ProtocolError
from ..blockcopy import pack_planes
from ..layout import KVLayout
from ..pool import GEN_SIZE
from ..segments import SharedSegment

__all__ = ["ONE_SIDED", "HandleTable", "SenderMap", "digest"]

ONE_SIDED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
MAGIC = b"KVBTAB1\0"
HEAD = struct.Struct("=8sI")
HEAD_SIZE = 64
SLOT = 32            # u32 seq | u32 pad | 16-byte digest | pad
SEQ_STRIDE = SLOT // 4
PROBE = 16           # slots a handle may sit in, from its home slot
MIN_SLOTS = 16384    # 512 KiB: thousands of live handles at a low load, whatever the pool's size
MAX_SLOTS = 1 << 20


def digest(raw: bytes) -> bytes:
    """A handle's key in the table: BLAKE2b-128 of its bytes."""
    return hashlib.blake2b(raw, digest_size=16).digest()


def _home(d: bytes, n: int) -> int:
    return int.from_bytes(d[:4], "little") & (n - 1)


class HandleTable:
    """The sender's side: publish and end handles in the shared table (thread-safe)."""

    def __init__(self, num_blocks: int) -> None:
        n = MIN_SLOTS
        while n < 4 * num_blocks and n < MAX_SLOTS:
            n *= 2
        self.nslots = n
        self.segment = SharedSegment(f"kvb-{os.getpid()}-{secrets.token_hex(6)}", HEAD_SIZE + n * SLOT)
        view = self.segment.view
        view[:HEAD.size] = HEAD.pack(MAGIC, n)
        self._view = view
        self._seq: Optional[memoryview] = view[HEAD_SIZE:].cast("I")
        self._slots: dict[bytes, int] = {}        # handle id -> slot
        self._lock = threading.Lock()
        self.full = 0                             # handles left to MAP/DONE because the table was full

    def add(self, handle_id: bytes, raw: bytes) -> bool:
        d = digest(raw)
        n = self.nslots
        with self._lock:
            seq = self._seq
            if handle_id in self._slots or seq is None:
                return False
            home = _home(d, n)
            for k in range(PROBE):
                i = (home + k) & (n - 1)
                s = seq[i * SEQ_STRIDE]
                if not s & 1:                     # free: write the digest, then make it live
                    off = HEAD_SIZE + i * SLOT + 8
                    self._view[off:off + 16] = d
                    seq[i * SEQ_STRIDE] = (s + 1) & 0xFFFFFFFF
                    self._slots[handle_id] = i
                    return True
            self.full += 1
            return False

    def remove(self, handle_id: bytes) -> None:
        with self._lock:
            i = self._slots.pop(handle_id, None)
            seq = self._seq
            if i is not None and seq is not None:
                j = i * SEQ_STRIDE
                seq[j] = (seq[j] + 1) & 0xFFFFFFFF    # even: ended

    def close(self) -> None:
        """End every slot (readers fall back to the control channel), then unmap."""
        with self._lock:
            seq = self._seq
            if seq is None:
                return
            for i in self._slots.values():
                seq[i * SEQ_STRIDE] = (seq[i * SEQ_STRIDE] + 1) & 0xFFFFFFFF
            self._slots.clear()
            seq.release()
            self._seq = None
        self.segment.close()


def open_info(pool: Any, table: HandleTable) -> bytes:
    """What OPEN answers: where the pool, its generations and the handle table are."""
    return json.dumps({"segment": pool.segment.name, "gen_offset": pool.gen_offset, "num_blocks": pool.num_blocks,
                       "buffer_offsets": list(pool.buffer_offsets), "layout": pool.layout.to_dict(),
                       "table": table.segment.name}).encode()


class SenderMap:
    """The reader's side: one sender's pool, generations and handle table, mapped read-only."""

    def __init__(self, info: bytes, segment: SharedSegment, table: SharedSegment) -> None:
        try:
            d = json.loads(info)
            self.layout = KVLayout.from_dict(d["layout"])
            self.num_blocks = int(d["num_blocks"])
            self.offsets = [int(o) for o in d["buffer_offsets"]]
            gen_offset = int(d["gen_offset"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"OPEN reply is malformed: {exc}") from None
        buf_nbytes = math.prod(self.layout.buffer_shape(self.num_blocks)) * self.layout.itemsize
        if (len(self.offsets) != self.layout.num_buffers or gen_offset < 0 or gen_offset % GEN_SIZE
                or self.num_blocks < 0
                or gen_offset + GEN_SIZE * self.num_blocks > segment.size
                or any(not 0 <= o <= segment.size - buf_nbytes for o in self.offsets)):
            raise ProtocolError("OPEN reply names memory outside the segment")
        if table.size < HEAD_SIZE:
            raise ProtocolError("peer's handle table is malformed (shorter than its header)")
        magic, n = HEAD.unpack_from(table.view, 0)
        if magic != MAGIC or n <= 0 or n & (n - 1) or HEAD_SIZE + n * SLOT > table.size:
            raise ProtocolError("peer's handle table is malformed")
        L = self.layout
        self.part = L.part_nbytes
        self.planes: list[tuple[int, int]] = []    # (segment offset of block 0's part, stride), stream order
        ends: list[int] = []
        for layer in range(L.num_layers):
            for part in range(L.num_parts):
                base, stride = L.part_base_stride(part, self.num_blocks)
                o = self.offsets[L.buffer_index(layer, part)]
                self.planes.append((o + base, stride))
                ends.append(o + buf_nbytes)
        # the same planes as addresses, for blockcopy.copy_blocks (each bounded by its buffer)
        self.packed = pack_planes([(segment.address + a, stride, segment.address + e)
                                   for (a, stride), e in zip(self.planes, ends)])
        self.segment, self.table = segment, table
        self.view = segment.view
        self.gens = segment.view[gen_offset:gen_offset + GEN_SIZE * self.num_blocks].cast("I")
        self.tview = table.view
        self.seq = table.view[HEAD_SIZE:HEAD_SIZE + n * SLOT].cast("I")
        self.nslots = n
        # what blockcopy.shm_read takes of this mapping, in one tuple made once
        self.native = (self.tview, n, self.gens, self.packed, self.part, self.view)
        self.watch: Any = None                    # the control connection OPEN came on: EOF = sender gone
        self.poll: Any = None                     # a poll object watching it
        self.poll_after = 0.0                     # when to ask it again (monotonic)
        # the destination pool the one-call read last looked at, as ShmTransport._lane made it
        self.lane: Optional[tuple[Any, Any, bytes, list[int], int]] = None

    def lookup(self, raw: bytes) -> Optional[tuple[int, int]]:
        """(slot, seq) of a live handle with exactly these bytes, or None."""
        d = digest(raw)
        n, seq, tv = self.nslots, self.seq, self.tview
        home = _home(d, n)
        for k in range(PROBE):
            i = (home + k) & (n - 1)
            s = seq[i * SEQ_STRIDE]
            if s & 1:
                off = HEAD_SIZE + i * SLOT + 8
                if tv[off:off + 16] == d and seq[i * SEQ_STRIDE] == s:
                    return i, s
        return None

    def still(self, slot: int, s: int) -> bool:
        return bool(self.seq[slot * SEQ_STRIDE] == s)

    def source_views(self, ids: list[int]) -> list[memoryview]:
        """The blocks' parts in the mapped pool, in canonical order (the order and offsets of
        :meth:`KVLayout.segments`, adjacent parts merged). Inside the segment by construction:
        ids past ``num_blocks`` are refused, and every buffer was checked to fit at OPEN."""
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ProtocolError("handle names blocks outside the sender's pool")
        p, view = self.part, self.view
        out: list[memoryview] = []
        start = end = -1
        for a, stride in self.planes:
            for b in ids:
                o = a + b * stride
                if o == end:
                    end += p
                    continue
                if end > start:
                    out.append(view[start:end])
                start, end = o, o + p
        if end > start:
            out.append(view[start:end])
        return out

    def close(self) -> None:
        for v in (self.gens, self.seq):
            v.release()
        for seg in (self.segment, self.table):
            try:
                seg.close()
            except (BufferError, ConfigError):
                pass
        if self.watch is not None:
            self.watch.close()
