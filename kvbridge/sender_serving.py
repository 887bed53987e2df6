"""How a sender serves its published blocks (a base of :class:`~kvbridge.sender.KVSender`,
the :class:`~kvbridge.transports.base.BlockSource` that transport servers call): a read opened
under its lease's claim and fence (:meth:`SenderServing.open_read`, waiting a while for layers
not ready yet), the small whole reads answered in one C call, and the frame loop's run of
them in one C call too (:meth:`SenderServing.serve_small`, :meth:`SenderServing.serve_next`), and direct releases,
one at a time or in a batch."""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

from . import blockcopy
from .errors import (AccessDenied, BadHandle, ConnectionLost, HandleNotFound, KVBridgeError, LeaseError, PoolError,
                     ProtocolError, StaleHandle)
from .handle import ID_OFFSET, find_issued, lookup_ticket
from .integrity import pack_sums
from .lease import Claim
from .published import Grant, Record
from .sender_lifecycle import SenderLifecycle, _limited, log
from .transports.base import Spans
from .transports.socket_server import SMALL_REPLY
from .transports.wire import FrameReader

__all__ = ["SenderServing", "LAYER_WAIT"]

LAYER_WAIT = 0.25   # a read of a layer not ready yet waits this long on the sender, then asks again


class SenderServing(SenderLifecycle):
    """The reads, and direct releases, that transport servers hand a sender."""

    def _lookup(self, handle_bytes: bytes) -> Record:
        try:
            return lookup_ticket(self._records, handle_bytes, self._key)
        except (BadHandle, HandleNotFound):
            self.stats.add(refused=1)
            raise

    def _wait_layers(self, rec: Record, first: int, end: int) -> int:
        """Wait (bounded) until layer ``first`` is ready; the end of the ready part of [first, end)."""
        with self._ready_cv:
            self._layer_waiters += 1
            try:
                self._ready_cv.wait_for(lambda: rec.ready > first or not rec.live, LAYER_WAIT)
            finally:
                self._layer_waiters -= 1
            return max(first, min(end, rec.ready))

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]],
                  claim: Optional[Claim] = None, layers: Optional[tuple[int, int]] = None) -> Grant:
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            if claim is None:
                self.stats.add(refused=1)
                raise AccessDenied("this handle is leased: reads must carry the claimer and its fence")
            try:
                if claim.epoch == 0:      # CLAIM_ME: claim on the reader's behalf, one round trip
                    ttl = min(max(claim.counter / 1000, 0.001), 3600.0)
                    lease = self.leases.claim(rec.handle.lease_id, claim.claimer, ttl)
                    claim = Claim(claim.claimer, lease.fence.epoch, lease.fence.counter)
                    rec.claimed = claim   # its release may come back here (release_claimed)
                else:
                    self.leases.validate(rec.handle.lease_id, claim.claimer, claim.fence)
            except StaleHandle:
                self.stats.add(refused=1)
                raise
        else:
            claim = None
        n = len(rec.block_ids)
        if indices is None:
            ids = rec.block_ids
        else:
            if any(not 0 <= i < n for i in indices):
                raise ProtocolError(f"block index out of range for a {n}-block handle")
            if len(set(indices)) != len(indices):   # a repeated index would multiply the bytes served
                raise ProtocolError("repeated block indices in a read")
            ids = [rec.block_ids[i] for i in indices]
        L = self.pool.layout.num_layers
        lo = hi = 0
        if layers is not None:
            if not (rec.handle.layerwise or rec.frames is not None):
                raise ProtocolError("layer reads are for layer-wise or coded handles; read this one whole")
            lo = layers[0]
            if not 0 <= lo < L:     # -1 would index the buffers from their end: another layer's bytes
                raise ProtocolError(f"layer {lo} outside a {L}-layer handle")
            if rec.frames is not None and indices is not None:
                raise ProtocolError("a coded handle is read whole: its frames hold every block")
            hi = self._wait_layers(rec, lo, min(layers[1], L))
            if rec.frames is not None and not rec.handle.layerwise:
                hi = L                          # one frame holds every layer
        with self._lock:
            if not rec.live:
                self.stats.add(refused=1)
                raise StaleHandle(f"handle {rec.handle.id} was {rec.reason}; its blocks are gone")
            if not self.pool.same_generations(rec.block_ids, rec.handle.generations):
                self.stats.add(refused=1)
                raise StaleHandle(f"blocks of handle {rec.handle.id} were freed and reused")
            if layers is None and (rec.ready < L or rec.frames is not None):
                raise ProtocolError("layer-wise and coded handles are read by layer range")
            rec.inflight += 1
        try:
            sums = b""
            if layers is not None and rec.frames is not None:
                spans = rec.frames.spans(lo, hi)
            elif layers is not None:
                spans = Spans.of_blocks(self.pool, ids, range(lo, hi))
                if self.checksums and hi > lo:
                    sel = rec.sums[lo:hi] if indices is None else [[s[i] for i in indices] for s in rec.sums[lo:hi]]
                    sums = pack_sums([x for layer in sel for x in layer])
            elif indices is None and rec.spans is not None:
                spans = rec.spans
            else:
                spans = Spans.of_blocks(self.pool, ids)
        except BaseException:
            self._read_done(rec)
            raise
        self.stats.served(spans.nbytes)
        return Grant(self, rec, spans, (lo, hi), sums, claim)  # type: ignore[arg-type]  # self is a KVSender

    def serve_small(self, fd: int, payload: bytes, req_id: int) -> bool:
        """Answer a READ request's ``payload`` on socket ``fd`` in one C call
        (``blockcopy.serve_small``) where it asks for all of a handle this sender indexed for
        that (:meth:`_index_small`), in exactly the bytes issued, and its blocks still hold the
        handle's generations once copied out. False where nothing was sent: :meth:`open_read`
        serves the read, or says precisely why not. A send that fails raises OSError."""
        small = self._small
        if not small:
            return False
        pool = self.pool
        assert blockcopy.serve_small is not None          # indexed only with the extension
        pinned = pool.buffers                             # held across the C copy
        try:
            n = blockcopy.serve_small(fd, payload, req_id, small, ID_OFFSET, pool.live_generations,
                                      blockcopy.planes(pool), pool.layout.part_nbytes)
        except (ValueError, PoolError):                   # a closed pool: the long way says so
            return False
        del pinned
        if n < 0:
            return False
        self.stats.served(n)
        return True

    def serve_next(self, fd: int, reader: FrameReader) -> bool:
        """The frame loop's next steps on socket ``fd`` when ``reader`` holds nothing, in one C
        call (``blockcopy.serve_next``): receives into its buffer, answering each whole READ that
        :meth:`serve_small` would answer and that came alone in its receive, until a receive
        brings anything else. True when the last receive's READ was answered (any bytes behind
        it stay in the reader), or reads were answered before the socket's timeout passed;
        False when the bytes received are the reader's to parse as usual. The socket's timeout
        with nothing answered raises BlockingIOError and a closed peer ConnectionLost, as the
        reader's own receive does; a failed send, OSError."""
        if blockcopy.serve_next is None:                  # no extension: the reader receives
            return False
        pool = self.pool
        pinned = pool.buffers                             # held across the C copies: checked after each receive
        try:
            packed = blockcopy.planes(pool)
        except PoolError:                                 # a closed pool: the reader receives
            return False
        served, used, got, count = blockcopy.serve_next(fd, reader.ready(), self._small, ID_OFFSET,
                                                        pool.live_generations, packed, pool.layout.part_nbytes,
                                                        pool, pinned, self.stats._native)
        del pinned
        if got < 0:
            if got == -3:
                raise ConnectionLost("peer closed the connection")
            if count:
                return True
            raise BlockingIOError("no frame within the socket's timeout")
        if served < 0:
            reader.start, reader.end = 0, got
            return False
        reader.start, reader.end = (0, 0) if used == got else (used, got)
        return True

    def _index_small(self, rec: Record) -> None:
        """Under the lock, for a live, raw, complete handle: where it is unleased and a few host
        blocks, :meth:`serve_small` may serve its whole reads (until :meth:`_mark_ended`)."""
        h = rec.handle
        if (blockcopy.serve_small is not None and not h.lease_id and self.pool.is_host
                and len(rec.block_ids) * self.pool.layout.block_nbytes <= SMALL_REPLY):
            self._small[h.handle_id] = (rec.raw, h.block_ids, h.generations)

    def release_remote(self, handle_bytes: bytes) -> None:
        """A direct release (handles without a lease). A leased handle ends only through its
        lease: a holder of the handle bytes is not necessarily its claimer."""
        self._end(self._releasable(handle_bytes), "released")

    def release_many(self, many: Sequence[bytes]) -> list[Optional[KVBridgeError]]:
        """:meth:`release_remote` of each, ended under one hold of the lock and freed in one
        pass (releases that arrived together); per release, None or why it was refused."""
        out: list[Optional[KVBridgeError]] = []
        recs: list[Record] = []
        records, leased = self._records, self.leases is not None
        for raw in many:
            rec = find_issued(records, raw)        # the usual one: exactly the bytes issued, unleased
            if rec is not None and not (leased and rec.handle.lease_id):
                recs.append(rec)
                out.append(None)
                continue
            try:
                recs.append(self._releasable(raw))   # refused, saying precisely why
                out.append(None)
            except KVBridgeError as exc:
                out.append(exc)
        with self._mutex:
            free = [r for r in recs if self._mark_ended(r, "released")]
        if len(free) == 1:
            self._release_blocks(free[0])
        elif free:
            self._release_many_blocks(free)
        return out

    def release_claimed(self, items: Sequence[tuple[bytes, Optional[Claim]]]) -> list[Optional[KVBridgeError]]:
        """Leased handles whose lease this sender claimed inside a read (``CLAIM_ME``), which
        that reader has consumed, queued to be released in the lease store for the claim this
        sender made: :meth:`flush_claimed` has the release thread make them in one pipelined
        round trip; each handle ends here once the store took its release -- the reader's own
        release round trip, and this sender's wake-up for the store's event of it, both saved.
        An entry is refused unless it names a live leased handle in the exact bytes issued and
        precisely the claim made for it (claimer and fence), once. Per entry, None or why it
        was refused."""
        out: list[Optional[KVBridgeError]] = []
        todo: list[tuple[Record, Claim]] = []
        for raw, claim in items:
            try:
                rec = self._lookup(raw)
                if self.leases is None or not rec.handle.lease_id:
                    raise AccessDenied("a claimed release names a handle without a lease")
                if claim is None or claim.epoch == 0 or rec.claimed != claim:
                    raise AccessDenied("a claimed release must name the claim this sender made for the read")
                rec.claimed = None      # taken: the same entry again is refused, not queued twice
                todo.append((rec, claim))
                out.append(None)
            except AccessDenied as exc:
                self.stats.add(refused=1)
                out.append(exc)
            except KVBridgeError as exc:            # a handle _lookup refused (and counted)
                out.append(exc)
        if todo:
            with self._owed_lock:
                self._owed.extend(todo)
            self.flush_claimed()
        return out

    def flush_claimed(self) -> None:
        """Have the queued claimed releases (:meth:`release_claimed`) made in one round trip:
        by this sender's release thread (the connection goes on serving the next request
        meanwhile), started on the first of them."""
        if not self._owed:
            return
        with self._owed_lock:
            if self._owed_thread is None and not self._closed:
                self._owed_thread = threading.Thread(target=self._owed_loop, name="kvb-sender-releases",
                                                     daemon=True)
                self._owed_thread.start()
            self._owed_lock.notify()

    def _owed_loop(self) -> None:
        while True:
            with self._owed_lock:
                self._owed_lock.wait_for(lambda: bool(self._owed) or self._closed, timeout=1.0)
                if self._closed and not self._owed:
                    return
            try:
                self._flush_owed()
            except Exception:   # never let the release thread die silently
                log.exception("releases for readers failed")

    def _flush_owed(self) -> None:
        with self._owed_lock:
            todo, self._owed = self._owed, []
        if not todo:
            return
        assert self.leases is not None
        batch = getattr(self.leases, "batch", None)
        try:
            if batch is not None:
                b = batch()
                for rec, c in todo:
                    b.release(rec.handle.lease_id, c.claimer, c.fence, notify=False)   # ended below
                results = b.execute()
            else:
                results = []
                for rec, c in todo:
                    try:
                        self.leases.release(rec.handle.lease_id, c.claimer, c.fence)
                        results.append(None)
                    except LeaseError as exc:
                        results.append(exc)
        except KVBridgeError as exc:      # the store unreachable: the readers' claims lapse, the leases expire
            _limited.log(logging.WARNING, "owner-release", "releases for readers not made (%s); their "
                         "leases end at expiry", exc)
            return
        self._claimed_done(todo, results)

    def _claimed_done(self, todo: Sequence[tuple[Record, Claim]], results: Sequence[object]) -> None:
        for (rec, _), res in zip(todo, results):
            if isinstance(res, KVBridgeError):  # the claim lapsed or the lease ended: not this release's to end
                log.info("release of %s for its reader refused by the lease store: %s", rec.handle.request_id, res)
            else:
                self._end(rec, "released")

    def _releasable(self, handle_bytes: bytes) -> Record:
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            self.stats.add(refused=1)
            raise AccessDenied("a leased handle is released through its lease, by its claimer")
        return rec
