"""KVSender: the prefill side. Publishes handles, serves their blocks, frees them once.

Ownership: ``publish`` takes over the engine's reference to the blocks. The sender
frees them (``pool.free``) exactly once -- on release by the receiver, on
``revoke``, or when the handle's TTL passes unreleased -- and never while a read
it serves is in flight (revoke first, then free when reads drain). ``on_free``
tells the engine, with the reason.

Leases (``leases=``, see ``LEASES.md``): each handle gets a lease in Redis (owner,
TTL, fence). Reads must present the claimer's current fence; the sender learns of
releases and aborts from its event stream (with a periodic sweep as fallback) and,
before freeing for any other reason, revokes the lease in Redis first. If Redis is
unreachable it keeps the blocks until its local deadline (TTL plus a margin for
clock rate), after which Redis has certainly expired the lease.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence, Union

from .errors import (AccessDenied, BadHandle, ConfigError, HandleNotFound, LeaseStoreUnavailable, PoolError,
                     ProtocolError, StaleHandle)
from .handle import KVHandle
from .integrity import block_checksums
from .lease import Fence, LeaseState, LeaseStore, open_lease_store, owner_deadline
from .metrics import SenderStats
from .policy import Timeout
from .pool import KVPool
from .transports.base import Server, Spans
from .transports.registry import get_transport_class, scheme_of
from .transports.wire import Claim

__all__ = ["KVSender", "FreeReason"]

log = logging.getLogger("kvbridge.sender")
FreeReason = str   # "released" | "aborted" | "expired" | "revoked" | "closed"
LeasesArg = Union[str, LeaseStore, None, bool]
SWEEP_INTERVAL = 1.0
_ID = slice(5, 21)  # handle id inside a handle's bytes (after magic, version, flags)


@dataclass
class _Record:
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


@dataclass
class _Grant:
    sender: "KVSender"
    rec: _Record
    spans: Spans
    closed: bool = field(default=False)

    def still_valid(self) -> bool:
        return self.rec.live and self.sender.pool.generations(self.rec.block_ids) == list(self.rec.handle.generations)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sender._read_done(self.rec)


class KVSender:
    """Publish blocks of ``pool`` and serve them at ``listen`` URL(s).

    ``secret``: shared HMAC key (then receivers can verify handles too); by default a
    random per-sender key. ``ttl``: seconds an unreleased handle lives.
    ``on_free(handle, reason)``: called after its blocks are freed.
    ``leases``: a Redis URL, a :class:`LeaseStore`, None (this process's embedded
    server) or False (no leases: local TTL and direct release only).
    """

    def __init__(self, pool: KVPool, listen: Union[str, Sequence[str]] = "tcp://127.0.0.1:0", *,
                 secret: Optional[bytes] = None, ttl: float = 60.0, timeout: Timeout = Timeout(),
                 on_free: Optional[Callable[[KVHandle, FreeReason], None]] = None,
                 checksums: bool = True, leases: LeasesArg = None, owner: Optional[str] = None,
                 lease_namespace: str = "kvb", clock_margin: float = 1.0) -> None:
        self.pool = pool
        self.servers: list[Server] = []
        self._closed = False
        self.ttl = ttl
        self.timeout = timeout
        self.on_free = on_free
        self.checksums = checksums and pool.is_host
        self._key = secret if secret is not None else os.urandom(32)
        self._records: dict[bytes, _Record] = {}
        self._by_lease: dict[str, _Record] = {}
        self._pending: list[_Record] = []
        self._lock = threading.Condition()
        self.stats = SenderStats()
        self.owner = owner or f"sender-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.clock_margin = clock_margin
        self._own_store = not isinstance(leases, LeaseStore)
        self.leases: Optional[LeaseStore] = (
            None if leases is False else leases if isinstance(leases, LeaseStore)
            else open_lease_store(leases if isinstance(leases, str) else None, namespace=lease_namespace))
        urls = [listen] if isinstance(listen, str) else list(listen)
        if not urls:
            raise ConfigError("KVSender needs at least one listen URL")
        try:
            for u in urls:
                self.servers.append(get_transport_class(scheme_of(u)).serve(u, self, timeout))
        except BaseException:
            self.close()
            raise
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvb-sender-sweep", daemon=True)
        self._sweeper.start()
        if self.leases is not None:
            self._watcher = threading.Thread(target=self._lease_loop, name="kvb-sender-leases", daemon=True)
            self._watcher.start()

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    @property
    def num_live(self) -> int:
        return len(self._records)

    # -- prefill side --------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                ttl: Optional[float] = None) -> KVHandle:
        """Hand ``block_ids`` (holding ``num_tokens`` tokens of ``request_id``) to a receiver."""
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise PoolError("publish: duplicate block ids")
        self.pool._check_ids(ids)
        for b in ids:
            if self.pool.refcount(b) <= 0:
                raise PoolError(f"publish: block {b} is not allocated")
        L = self.pool.layout
        if not 0 <= num_tokens <= len(ids) * L.block_size:
            raise ConfigError(f"{num_tokens} tokens do not fit {len(ids)} blocks of {L.block_size}")
        ttl = self.ttl if ttl is None else ttl
        bare = KVHandle(
            handle_id=os.urandom(16), request_id=request_id, layout_hash=L.compat_hash,
            urls=self.urls, block_ids=tuple(ids), generations=tuple(self.pool.generations(ids)),
            checksums=tuple(block_checksums(self.pool, ids)) if self.checksums else (),
            num_tokens=num_tokens, token=os.urandom(16))
        sent_at = time.monotonic()
        expires_at_ms = int((time.time() + ttl) * 1000)
        if self.leases is not None:
            lease = self.leases.publish(bare.lease_digest(), self.owner, ttl, num_blocks=len(ids),
                                        meta={"request_id": request_id[:200]})
            bare = replace(bare, lease_id=lease.lease_id, lease_url=str(getattr(self.leases, "url", "")),
                           fence_epoch=lease.fence.epoch, fence=lease.fence.counter)
        handle = replace(bare, expires_at_ms=expires_at_ms).signed(self._key)
        deadline = owner_deadline(sent_at, ttl, margin_s=self.clock_margin) if self.leases else sent_at + ttl
        rec = _Record(handle, handle.to_bytes(), ids, deadline)
        with self._lock:
            if self._closed:
                raise ConfigError("sender is closed")
            self._records[handle.handle_id] = rec
            if handle.lease_id:
                self._by_lease[handle.lease_id] = rec
            self._lock.notify_all()
        self.stats.published += 1
        self.stats.blocks_published += len(ids)
        return handle

    def revoke(self, handle: Union[KVHandle, bytes], reason: FreeReason = "revoked") -> bool:
        """End a handle now (e.g. the request was aborted); frees once reads drain."""
        hid = handle.handle_id if isinstance(handle, KVHandle) else bytes(handle)
        with self._lock:
            rec = self._records.get(hid)
        return self._end(rec, reason) if rec else False

    # -- BlockSource (called by transport servers) ---------------------------------------
    def _lookup(self, handle_bytes: bytes) -> _Record:
        if len(handle_bytes) < 21:
            raise BadHandle("handle is truncated")
        rec = self._records.get(bytes(handle_bytes[_ID]))
        if rec is not None and hmac.compare_digest(bytes(handle_bytes), rec.raw):
            return rec
        # Not the exact bytes we issued: say precisely why.
        h = KVHandle.from_bytes(handle_bytes)         # BadHandle on garbage
        try:
            h.verify(self._key)
        except BadHandle:
            self.stats.refused += 1
            raise BadHandle("handle MAC does not verify: it was altered or forged, or not issued here")
        if rec is None:
            self.stats.refused += 1
            raise HandleNotFound(f"handle {h.id} of request {h.request_id!r} is not live here "
                                 "(released, expired or never published)")
        raise AccessDenied("handle does not match the one issued under this id")

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]],
                  claim: Optional[Claim] = None) -> _Grant:
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            if claim is None:
                self.stats.refused += 1
                raise AccessDenied("this handle is leased: reads must carry the claimer and its fence")
            try:
                self.leases.validate(rec.handle.lease_id, claim.claimer, Fence(claim.epoch, claim.counter))
            except StaleHandle:
                self.stats.refused += 1
                raise
        n = len(rec.block_ids)
        if indices is None:
            ids = rec.block_ids
        else:
            if any(not 0 <= i < n for i in indices):
                raise ProtocolError(f"block index out of range for a {n}-block handle")
            ids = [rec.block_ids[i] for i in indices]
        with self._lock:
            if not rec.live:
                self.stats.refused += 1
                raise StaleHandle(f"handle {rec.handle.id} was {rec.reason}; its blocks are gone")
            if self.pool.generations(rec.block_ids) != list(rec.handle.generations):
                self.stats.refused += 1
                raise StaleHandle(f"blocks of handle {rec.handle.id} were freed and reused")
            rec.inflight += 1
        if indices is None:
            if rec.spans is None:
                rec.spans = Spans.of_blocks(self.pool, ids)
            spans = rec.spans
        else:
            spans = Spans.of_blocks(self.pool, ids)
        self.stats.reads += 1
        self.stats.bytes_served += spans.nbytes
        return _Grant(self, rec, spans)

    def release_remote(self, handle_bytes: bytes) -> None:
        """A direct release (handles without a lease). A leased handle ends only through its
        lease: a holder of the handle bytes is not necessarily its claimer."""
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            self.stats.refused += 1
            raise AccessDenied("a leased handle is released through its lease, by its claimer")
        self._end(rec, "released")

    # -- lifecycle -----------------------------------------------------------------------
    def _end(self, rec: _Record, reason: FreeReason) -> bool:
        with self._lock:
            if not rec.live:
                return False
            rec.live = False
            rec.reason = reason
            self._records.pop(rec.handle.handle_id, None)
            self._by_lease.pop(rec.handle.lease_id, None)
            revoke = (self.leases is not None and bool(rec.handle.lease_id)
                      and reason not in ("released", "aborted"))
            rec.revoking = revoke   # a read draining meanwhile must not free before the revoke lands
        if revoke:
            assert self.leases is not None
            # Revoke in Redis first: after this, no claimer's validate can succeed.
            try:
                self.leases.revoke(rec.handle.lease_id, self.owner)
            except LeaseStoreUnavailable:
                if time.monotonic() < rec.deadline:
                    log.warning("cannot revoke %s (lease server down); freeing at its deadline",
                                rec.handle.request_id)
                    with self._lock:
                        rec.free_after = rec.deadline
                        rec.revoking = False
                        self._pending.append(rec)
                        self._lock.notify_all()
                    return True
            except StaleHandle:
                pass   # already gone in Redis
        with self._lock:
            rec.revoking = False
            free_now = rec.inflight == 0
        if free_now:
            self._free(rec)
        return True

    def _read_done(self, rec: _Record) -> None:
        with self._lock:
            rec.inflight -= 1
            free_now = not rec.live and rec.inflight == 0 and not rec.free_after and not rec.revoking
        if free_now:
            self._free(rec)

    def _free(self, rec: _Record) -> None:
        with self._lock:
            if rec.freed:
                return
            rec.freed = True
        try:
            self.pool.free(rec.block_ids)
        except PoolError as exc:   # the engine freed them behind our back
            log.error("freeing blocks of %s: %s", rec.handle.request_id, exc)
        n = len(rec.block_ids)
        setattr(self.stats, rec.reason, getattr(self.stats, rec.reason, 0) + 1)
        setattr(self.stats, f"blocks_{rec.reason}", getattr(self.stats, f"blocks_{rec.reason}", 0) + n)
        self.stats.blocks_freed += n
        if self.on_free is not None:
            try:
                self.on_free(rec.handle, rec.reason)
            except Exception:
                log.exception("on_free callback failed")

    def _sweep_loop(self) -> None:
        """Local deadlines: expire unreleased handles; free revoked ones Redis never heard of."""
        while True:
            with self._lock:
                if self._closed and not self._pending:
                    return
                now = time.monotonic()
                due = [r for r in self._records.values() if r.deadline <= now]
                ripe = [r for r in self._pending if r.free_after <= now and r.inflight == 0]
                self._pending = [r for r in self._pending if r not in ripe]
                if not due and not ripe:
                    times = [r.deadline for r in self._records.values()] + [r.free_after for r in self._pending]
                    nxt = min(times, default=now + 1.0)
                    self._lock.wait(timeout=max(0.005, min(1.0, nxt - now)))
                    continue
            for r in ripe:
                self._free(r)
            for r in due:
                self._end(r, "expired")

    def _lease_loop(self) -> None:
        """Learn of releases/aborts from the owner's event stream; sweep as the fallback."""
        assert self.leases is not None
        next_sweep = time.monotonic() + SWEEP_INTERVAL
        while not self._closed:
            try:
                for ev in self.leases.events(self.owner, timeout_s=0.2):
                    rec = self._by_lease.get(ev.lease_id)
                    if rec is not None and ev.kind in ("released", "aborted"):
                        self._end(rec, ev.kind)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_INTERVAL
                    self._sweep_leases()
            except LeaseStoreUnavailable as exc:
                log.warning("lease server unreachable: %s", exc)
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

    def renew(self, handle: KVHandle, ttl: float) -> None:
        """Extend a live handle's lifetime (and its lease) by ``ttl`` seconds from now."""
        with self._lock:
            rec = self._records.get(handle.handle_id)
        if rec is None:
            raise HandleNotFound(f"handle {handle.id} is not live")
        sent_at = time.monotonic()
        if self.leases is not None and rec.handle.lease_id:
            self.leases.renew(rec.handle.lease_id, self.owner, ttl)
            rec.deadline = max(rec.deadline, owner_deadline(sent_at, ttl, margin_s=self.clock_margin))
        else:
            rec.deadline = max(rec.deadline, sent_at + ttl)

    def close(self) -> None:
        """Stop serving and free every unreleased handle (after its reads drain)."""
        for s in getattr(self, "servers", []):
            s.close()
        with self._lock:
            self._closed = True
            recs = list(self._records.values())
            self._lock.notify_all()
        for r in recs:
            self._end(r, "closed")
        if self.leases is not None:
            self._watcher.join(timeout=2)
            if self._own_store:
                self.leases.close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
