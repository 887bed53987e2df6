"""Push mode, the receiving side: destination blocks offered to a writer under a signed
reservation with its own lease. The writer claims the lease (one writer wins) and writes
under its fence; each write is verified as it lands; a cancel or an expiry revokes the
lease first and ends the reservation only once no write is in flight.

Bytes land straight in the reserved blocks, before their checksums are checked, so a write
may only ever touch layers no one has been told are ready: one write at a time per
reservation, each starting at the first layer not yet verified (a layer reported by
``wait_layer`` is never written again). A write that stops or fails part-way leaves that
layer unverified; the writer writes it again or the reservation fails."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

from .errors import (AccessDenied, BadHandle, ConfigError, HandleNotFound, IntegrityError, KVBridgeError,
                     LeaseExpired, ProtocolError, RetryableError, StaleHandle, TransferCancelled)
from .handle import KVHandle, check_ttl, lookup_ticket
from .integrity import StreamVerifier, layer_checksums, unpack_sums
from .lease import Claim, LeaseStore
from .pool import retired_during, whole_number
from .transfer import FetchResult, Transfer
from .transports.base import Spans

if TYPE_CHECKING:
    from .receiver import KVReceiver

__all__ = ["ReservationDesk"]

log = logging.getLogger("kvbridge.receiver")


@dataclass
class _Reservation:
    """Destination blocks offered to a writer (push mode)."""

    ticket: KVHandle
    raw: bytes
    dst: list[int]
    gens: list[int]
    deadline: float
    transfer: Transfer
    store: Optional[LeaseStore]
    t0: float = field(default_factory=time.perf_counter)
    done_layers: int = 0
    writes: int = 0
    nbytes: int = 0
    live: bool = True
    writing: Optional["_WriteGrant"] = None   # the one write in flight
    # unmarks the blocks in the pool (KVPool._land): once the reservation has ended and no write
    # of it is in flight -- a silent writer's write may outlast the end (Timeout.transfer)
    unmark: Optional[Callable[[], None]] = None


@dataclass
class _WriteGrant:
    desk: "ReservationDesk"
    rec: _Reservation
    spans: Spans
    layers: tuple[int, int]
    closed: bool = False

    def finish(self, sums: bytes, last: bool) -> None:
        self.desk._write_landed(self, sums, last)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.desk._write_done(self)


class ReservationDesk:
    """A receiver's reservations: offered, written into, ended (once), swept at expiry."""

    def __init__(self, receiver: "KVReceiver", key: bytes) -> None:
        self.r = receiver
        self._key = key
        self._lock = threading.Condition()
        self._reservations: dict[bytes, _Reservation] = {}
        self._sweeper: Optional[threading.Thread] = None
        self._closed = False

    def reserve(self, dst: list[int], request_id: str, num_tokens: Optional[int], ttl: float,
                unmark: Optional[Callable[[], None]] = None) -> Transfer:
        L = self.r.pool.layout
        n = len(dst) * L.block_size if num_tokens is None else whole_number(num_tokens)
        if n is None or not 0 <= n <= len(dst) * L.block_size:     # 3.0 or '3' raised raw, True passed as 1
            raise ConfigError(f"num_tokens {num_tokens!r}: a whole number of tokens that fits {len(dst)} blocks "
                              f"of {L.block_size}")
        check_ttl("reserve", ttl)      # nan raised ValueError, 1e300 OverflowError; 0 or less was taken
        gens = self.r.pool.generations(dst)
        bare = KVHandle(handle_id=os.urandom(16), request_id=request_id, layout_hash=L.compat_hash, urls=self.r.urls,
                        block_ids=tuple(dst), generations=tuple(gens), checksums=(), num_tokens=n,
                        token=os.urandom(16), layerwise=True, reservation=True)
        store = self.r._stores.own()
        if store is not None:
            lease = store.publish(bare.lease_digest(), self.r.claimer, ttl, num_blocks=len(dst),
                                  meta={"kind": "reservation"})
            bare = replace(bare, lease_id=lease.lease_id, lease_url=str(getattr(store, "url", "")),
                           fence_epoch=lease.fence.epoch, fence=lease.fence.counter)
        ticket = replace(bare, expires_at_ms=int((time.time() + ttl) * 1000)).signed(self._key)
        t = Transfer(request_id, L.num_layers, None, on_cancel=self._cancel_reservation)
        t.reservation = ticket
        rec = _Reservation(ticket, ticket.to_bytes(), dst, gens, time.monotonic() + ttl, t, store, unmark=unmark)
        with self._lock:
            if self._closed:
                raise ConfigError("receiver is closed")
            self._reservations[ticket.handle_id] = rec
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep_loop, name="kvb-reservations", daemon=True)
                self._sweeper.start()
            self._lock.notify_all()
        self.r.stats.add(reservations=1)
        return t

    def _lookup_reservation(self, raw: bytes) -> _Reservation:
        try:
            return lookup_ticket(self._reservations, raw, self._key, "reservation")
        except (BadHandle, HandleNotFound, AccessDenied):
            self.r.stats.add(writes_refused=1)
            raise

    def _authorized(self, ticket_bytes: bytes, claim: Optional[Claim], what: str) -> _Reservation:
        """The reservation ``ticket_bytes`` names, once ``claim`` is shown to be its writer's
        where it is leased (the ticket alone decides otherwise)."""
        rec = self._lookup_reservation(ticket_bytes)
        t = rec.ticket
        if rec.store is not None and t.lease_id:
            if claim is None:
                self.r.stats.add(writes_refused=1)
                raise AccessDenied(f"this reservation is leased: {what} must carry the writer's claim and fence")
            try:
                rec.store.validate(t.lease_id, claim.claimer, claim.fence)
            except StaleHandle:
                self.r.stats.add(writes_refused=1)
                raise
        return rec

    def open_write(self, ticket_bytes: bytes, layers: tuple[int, int], claim: Optional[Claim]) -> _WriteGrant:
        rec = self._authorized(ticket_bytes, claim, "writes")
        lo, hi = layers
        L = self.r.pool.layout.num_layers
        with self._lock:
            if not rec.live:
                self.r.stats.add(writes_refused=1)
                raise StaleHandle(f"reservation {rec.ticket.id} has ended; nothing more may be written")
            if rec.writing is not None:
                self.r.stats.add(writes_refused=1)
                raise RetryableError(f"reservation {rec.ticket.id} has a write in flight; one at a time")
            if not (lo == rec.done_layers and lo < hi <= L):
                self.r.stats.add(writes_refused=1)
                raise ProtocolError(f"write of layers [{lo}, {hi}) to a {L}-layer reservation that expects "
                                    f"layer {rec.done_layers} next")
            spans = Spans.of_blocks(self.r.pool, rec.dst, range(lo, hi))
            g = rec.writing = _WriteGrant(self, rec, spans, (lo, hi))
        if self.r.verify:
            spans.verifier = StreamVerifier(self.r.pool, rec.dst, range(lo, hi), per_layer=True)
        spans.cancel = rec.transfer.cancel_event
        return g

    def _write_landed(self, g: _WriteGrant, sums: bytes, last: bool) -> None:
        rec, (lo, hi) = g.rec, g.layers
        nb = len(rec.dst)
        if self.r.verify and sums:
            want = unpack_sums(sums)
            if len(want) != (hi - lo) * nb:
                raise ProtocolError(f"write carries {len(want)} checksums for {hi - lo} layers of {nb} blocks")
            v = g.spans.verifier
            got = v.digests() if v is not None and v.complete else layer_checksums(self.r.pool, rec.dst, range(lo, hi))
            bad = sorted({i % nb for i, (a, b) in enumerate(zip(got, want)) if a != b})
            if bad:
                raise IntegrityError(f"{len(bad)} block(s) of layers [{lo}, {hi}) failed their checksum on arrival")
        with self._lock:
            if not rec.live:
                raise StaleHandle(f"reservation {rec.ticket.id} ended during the write")
            rec.done_layers = max(rec.done_layers, hi)
            rec.writes += 1
            rec.nbytes += g.spans.nbytes
            complete = last and rec.done_layers == self.r.pool.layout.num_layers
        rec.transfer._layer_ready(rec.done_layers)
        if last and not complete:
            raise ProtocolError(f"last write arrived with only {rec.done_layers} layers written")
        if complete:
            self._end_reservation(rec, None, wait=False)

    def _write_done(self, g: _WriteGrant) -> None:
        rec = g.rec
        unmark = None
        with self._lock:
            if rec.writing is g:
                rec.writing = None
            if not rec.live and rec.writing is None:    # ended, and its last write is closed
                unmark, rec.unmark = rec.unmark, None
            self._lock.notify_all()
        if unmark is not None:
            unmark()

    def abort_remote(self, ticket_bytes: bytes, claim: Optional[Claim]) -> None:
        rec = self._authorized(ticket_bytes, claim, "an abort")
        self._end_reservation(rec, StaleHandle(f"the writer of {rec.ticket.request_id!r} gave up the push"))

    def _cancel_reservation(self, t: Transfer) -> None:
        assert t.reservation is not None
        with self._lock:
            rec = self._reservations.get(t.reservation.handle_id)
        if rec is not None:
            self._end_reservation(rec, TransferCancelled(f"reservation for {t.request_id!r} cancelled"))

    def _end_reservation(self, rec: _Reservation, error: Optional[KVBridgeError], wait: bool = True) -> None:
        """End a reservation once: on failure revoke its lease first (no writer's claim holds
        after that), stop a landing write, and wait until no write is in flight (at most
        ``Timeout.transfer``: a write still open then keeps the blocks marked in the pool until
        it closes); the blocks are unmarked before the transfer is seen to end."""
        with self._lock:
            if not rec.live:
                return
            rec.live = False
            self._reservations.pop(rec.ticket.handle_id, None)
        if error is not None:
            rec.transfer.cancel_event.set()       # a write landing now stops at its next chunk
            if rec.store is not None and rec.ticket.lease_id:
                try:
                    rec.store.revoke(rec.ticket.lease_id, self.r.claimer)
                except KVBridgeError as exc:
                    log.info("revoke of reservation %s: %s", rec.ticket.id, exc)
        if wait:    # a landing write stops at its next bytes (the cancel flag); a silent writer is dropped
            with self._lock:
                if not self._lock.wait_for(lambda: rec.writing is None, self.r.timeout.transfer):
                    log.error("reservation %s: a write is still in flight after %s s; its blocks stay "
                              "marked until it closes", rec.ticket.id, self.r.timeout.transfer)
        with self._lock:
            # unmarked before anyone sees the end -- unless a write is still open (its bytes may
            # still land: _write_done unmarks); wait=False: the last write's bytes have landed
            unmark = None
            if rec.writing is None or not wait:
                unmark, rec.unmark = rec.unmark, None
        if unmark is not None:
            unmark()
        res = FetchResult(rec.ticket, list(rec.dst), nbytes=rec.nbytes, attempts=rec.writes, error=error)
        if error is None and self.r.pool.generations(rec.dst) != rec.gens:
            res.error = retired_during(rec.ticket.request_id)     # the engine gave them up: REPREFILL, as a pull
        res.ok = res.error is None
        if not res.ok:
            res.failed_block_ids = list(rec.dst)
        res.seconds = time.perf_counter() - rec.t0
        if res.ok:
            self.r.stats.add(ok=1, bytes=res.nbytes)
        else:
            self.r.stats.add(failed=1, cancelled=int(isinstance(res.error, TransferCancelled)))
        rec.transfer._finish(res)

    def _sweep_loop(self) -> None:
        """Reservations whose push never completed end at their deadline."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [r for r in self._reservations.values() if r.deadline <= now]
                if not due:
                    nxt = min((r.deadline for r in self._reservations.values()), default=now + 1.0)
                    self._lock.wait(timeout=max(0.005, min(1.0, nxt - now)))
                    continue
            for r in due:
                self._end_reservation(r, LeaseExpired(
                    f"reservation for {r.ticket.request_id!r} expired before the push completed"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            recs = list(self._reservations.values())
            self._lock.notify_all()
        for r in recs:
            self._end_reservation(r, TransferCancelled("receiver closed"))
