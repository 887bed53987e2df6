"""How a sender's published handles end (the base of :class:`~kvbridge.sender.KVSender`):
each ends once (released, aborted, expired, revoked, retired, pushed or closed), its lease
revoked first where it must be, and its blocks freed exactly once, never while a read or push
still holds them; then ``on_free`` tells the engine. The threads that end handles by time live
here too: the sweeper (local deadlines) and the lease watcher (the owner's event stream, with a
periodic sweep as fallback)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .errors import KVBridgeError, LeaseStoreUnavailable, PoolError, StaleHandle
from .handle import KVHandle
from .lease import Claim, LeaseState, LeaseStore
from .logs import RateLimitedLog
from .metrics import SenderStats
from .pool import KVPool
from .published import Deadlines, Record, still_ours
from .transports.base import Server

__all__ = ["SenderLifecycle", "FreeReason"]

log = logging.getLogger("kvbridge.sender")
_limited = RateLimitedLog(log)
FreeReason = str   # "released" | "aborted" | "expired" | "revoked" | "retired" | "pushed" | "closed"
SWEEP_INTERVAL = 1.0
EVENT_BATCH = 0.005   # seconds the lease watcher waits after a batch of events before reading more
LEASE_DOWN_WAIT = 1.0   # seconds after a revoke found the lease server down during which none is tried


class SenderLifecycle:
    """Ending and freeing published handles. The state below is set up by
    :meth:`KVSender.__init__ <kvbridge.sender.KVSender>`, which documents it."""

    pool: KVPool
    servers: list[Server]
    leases: Optional[LeaseStore]
    owner: str
    on_free: Optional[Callable[[KVHandle, FreeReason], None]]
    stats: SenderStats
    checksums: bool
    _closed: bool
    _ended_all: bool
    _key: bytes
    _records: dict[bytes, Record]
    _small: dict[bytes, tuple[bytes, tuple[int, ...], tuple[int, ...]]]
    _by_lease: dict[str, Record]
    _owed: list[tuple[Record, Claim]]
    _owed_lock: threading.Condition
    _owed_thread: Optional[threading.Thread]
    _by_block: dict[int, dict[int, Record]]
    _pending: list[Record]
    _deadlines: Deadlines
    _lease_down_until: float
    _mutex: threading.RLock
    _lock: threading.Condition
    _ready_cv: threading.Condition
    _layer_waiters: int

    def _mark_ended(self, rec: Record, reason: FreeReason) -> bool:
        """Under the lock: end ``rec`` (no reader sees it live from now on). True when its blocks
        are to be freed now, by the caller (it claimed the free); False when it had ended
        already, a read still holds it, or its lease must be revoked first (``rec.revoking``)."""
        if not rec.live:
            return False
        rec.live = False
        rec.reason = reason
        self._small.pop(rec.handle.handle_id, None)
        self._records.pop(rec.handle.handle_id, None)
        for srv in self.servers:
            if srv.watches_ends:
                srv.ended(rec.handle.handle_id)    # one-sided readers see the end before any free
        if rec.handle.lease_id:
            self._by_lease.pop(self._lease_ref(rec.handle.lease_id), None)
        if self._by_block:
            for b in rec.block_ids:
                held = self._by_block.get(b)
                if held is not None:
                    held.pop(id(rec), None)
                    if not held:
                        del self._by_block[b]
        if self._layer_waiters:
            self._ready_cv.notify_all()   # readers and pushes waiting for its layers: it is over
        revoke = (self.leases is not None and bool(rec.handle.lease_id)
                  and reason not in ("released", "aborted"))
        rec.revoking = revoke   # a read draining meanwhile must not free before the revoke lands
        if not revoke and rec.inflight == 0 and not rec.freed:   # the usual end: freed at once
            rec.freed = True
            return True
        return False

    def _end(self, rec: Record, reason: FreeReason) -> bool:
        with self._mutex:
            if not rec.live:
                return False
            free_now = self._mark_ended(rec, reason)
            revoke = rec.revoking
        if free_now:
            self._release_blocks(rec)
            return True
        if revoke:
            assert self.leases is not None
            # Revoke in Redis first: after this, no claimer's validate can succeed. Within a moment
            # of a revoke that found the lease server down, none is tried: each would wait out its
            # retries (a close() or sweep of many handles took minutes); freeing at the deadline is safe.
            down = time.monotonic() < self._lease_down_until
            why = "lease server down"
            try:
                if not down:
                    self.leases.revoke(rec.handle.lease_id, self.owner)
            except LeaseStoreUnavailable:
                down, self._lease_down_until = True, time.monotonic() + LEASE_DOWN_WAIT
            except StaleHandle:
                pass   # already gone in Redis
            except KVBridgeError as exc:
                # refused (the server lost kvbridge's user, a script error): the lease may still be
                # live there, and ends at its TTL like one the owner cannot reach
                down, why = True, f"the lease server refused it: {exc}"
            if down:
                if time.monotonic() < rec.deadline:
                    _limited.log(logging.WARNING, "revoke", "cannot revoke %s (%s); freeing at its deadline",
                                 rec.handle.request_id, why)
                    with self._lock:
                        rec.free_after = rec.deadline
                        rec.revoking = False
                        self._pending.append(rec)
                        self._lock.notify_all()
                    return True
        with self._lock:
            rec.revoking = False
            free_now = rec.inflight == 0
        if free_now:
            self._free(rec)
        return True

    def _read_done(self, rec: Record) -> None:
        with self._lock:
            rec.inflight -= 1
            free_now = not rec.live and rec.inflight == 0 and not rec.free_after and not rec.revoking
        if free_now:
            self._free(rec)

    def _free(self, rec: Record) -> None:
        with self._lock:
            if rec.freed:
                return
            rec.freed = True
        self._release_blocks(rec)

    def _release_blocks(self, rec: Record) -> None:
        """Give a record's blocks back (once: the caller set ``rec.freed`` under the lock)."""
        try:
            self.pool.free(still_ours(self.pool, rec))
        except PoolError as exc:   # the engine freed them behind our back
            log.error("freeing blocks of %s: %s", rec.handle.request_id, exc)
        if rec.frames is not None:
            rec.frames.close()
        self.stats.ended(rec.reason, len(rec.block_ids))
        self._tell_engine(rec)

    def _release_many_blocks(self, recs: list[Record]) -> None:
        """:meth:`_release_blocks` of records that ended together (all for the same reason):
        their blocks freed in one pass, one by one only if that pass is refused."""
        try:
            self.pool.free([b for r in recs for b in still_ours(self.pool, r)])
        except PoolError:          # some were freed behind our back: find which, free the rest
            for r in recs:
                try:
                    self.pool.free(still_ours(self.pool, r))
                except PoolError as exc:
                    log.error("freeing blocks of %s: %s", r.handle.request_id, exc)
        for r in recs:
            if r.frames is not None:
                r.frames.close()
        self.stats.ended(recs[0].reason, sum(len(r.block_ids) for r in recs), len(recs))
        for r in recs:
            self._tell_engine(r)

    def _tell_engine(self, rec: Record) -> None:
        """``on_free``: the engine may reuse the blocks now."""
        if self.on_free is not None:
            try:
                self.on_free(rec.handle, rec.reason)
            except Exception:
                log.exception("on_free callback failed")

    def _schedule(self, rec: Record) -> None:
        """``rec``'s deadline to the sweeper (under the lock), woken only when it is the earliest."""
        if self._deadlines.push(rec, self._records):
            self._lock.notify_all()

    def _sweep_loop(self) -> None:
        """Local deadlines: expire unreleased handles; free revoked ones Redis never heard of.
        This thread alone frees at deadlines: an unexpected error ending one handle is logged,
        and the others (and later rounds) go on."""
        while True:
            with self._lock:
                if self._ended_all and not self._pending:
                    return
                now = time.monotonic()
                due = self._deadlines.due(now, self._records)
                ripe = [r for r in self._pending if r.free_after <= now and r.inflight == 0]
                if ripe:
                    self._pending = [r for r in self._pending if r not in ripe]
                if not due and not ripe:
                    times = [r.free_after for r in self._pending]
                    if self._deadlines.earliest is not None:
                        times.append(self._deadlines.earliest)
                    nxt = min(times, default=now + 1.0)
                    self._lock.wait(timeout=max(0.005, min(1.0, nxt - now)))
                    continue
            for r in ripe:
                self._guarded(self._free, r)
            for r in due:
                self._guarded(self._end, r, "expired")

    @staticmethod
    def _guarded(fn: Callable[..., object], rec: Record, *args: object) -> None:
        try:
            fn(rec, *args)
        except Exception:
            log.exception("ending %s at its deadline failed", rec.handle.request_id)

    def _lease_ref(self, lease_id: str) -> str:
        return self.leases.ref(lease_id) if self.leases is not None else lease_id

    def _lease_loop(self) -> None:
        """Learn of releases/aborts from the owner's event stream; sweep as the fallback."""
        assert self.leases is not None
        next_sweep = time.monotonic() + SWEEP_INTERVAL
        while not self._closed:
            try:
                evs = self.leases.events(self.owner, timeout_s=0.2)
                for ev in evs:
                    rec = self._by_lease.get(ev.ref)
                    if rec is not None and ev.kind in ("released", "aborted"):
                        self._end(rec, ev.kind)
                if evs:   # let the next releases gather: one wake-up per batch, not one per release
                    time.sleep(EVENT_BATCH)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_INTERVAL
                    self._sweep_leases()
            except LeaseStoreUnavailable as exc:
                _limited.log(logging.WARNING, "unreachable", "lease server unreachable: %s", exc)
                time.sleep(0.2)
            except KVBridgeError as exc:   # refused (credentials, ACL): says so, not 5 times a second
                _limited.log(logging.ERROR, "refused", "lease watcher: %s", exc)
                time.sleep(0.2)
            except Exception:   # never let the watcher die silently
                log.exception("lease watcher error")
                time.sleep(0.2)

    def _sweep_leases(self) -> None:
        """One round trip: end the handles whose lease Redis reports finished or gone."""
        assert self.leases is not None
        live = {r.handle.lease_id: r for r in list(self._records.values()) if r.handle.lease_id}
        if not live:
            return
        for lid, state in self.leases.sweep(self.owner, list(live)).items():
            if state is None:
                self._end(live[lid], "expired")
            elif state in (LeaseState.RELEASED, LeaseState.ABORTED):
                self._end(live[lid], state.value)
