"""KVSender: the prefill side. Publishes handles, serves their blocks, frees them once.

Ownership: ``publish`` takes over the engine's reference to the blocks. The sender
frees them (``pool.free``) exactly once -- on release by the receiver, on
``revoke``, or when the handle's TTL passes unreleased -- and never while a read
it serves is in flight (revoke first, then free when reads drain). ``on_free``
tells the engine, with the reason.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from .errors import (AccessDenied, BadHandle, ConfigError, HandleNotFound, PoolError,
                     ProtocolError, StaleHandle)
from .handle import KVHandle
from .integrity import block_checksums
from .metrics import SenderStats
from .policy import Timeout
from .pool import KVPool
from .transports.base import Server, Spans
from .transports.registry import get_transport_class, scheme_of

__all__ = ["KVSender", "FreeReason"]

log = logging.getLogger("kvbridge.sender")
FreeReason = str   # "released" | "expired" | "revoked" | "closed"
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
    """

    def __init__(self, pool: KVPool, listen: Union[str, Sequence[str]] = "tcp://127.0.0.1:0", *,
                 secret: Optional[bytes] = None, ttl: float = 60.0, timeout: Timeout = Timeout(),
                 on_free: Optional[Callable[[KVHandle, FreeReason], None]] = None,
                 checksums: bool = True) -> None:
        self.pool = pool
        self.ttl = ttl
        self.timeout = timeout
        self.on_free = on_free
        self.checksums = checksums and pool.is_host
        self._key = secret if secret is not None else os.urandom(32)
        self._records: dict[bytes, _Record] = {}
        self._lock = threading.Condition()
        self._closed = False
        self.stats = SenderStats()
        urls = [listen] if isinstance(listen, str) else list(listen)
        if not urls:
            raise ConfigError("KVSender needs at least one listen URL")
        self.servers: list[Server] = []
        try:
            for u in urls:
                self.servers.append(get_transport_class(scheme_of(u)).serve(u, self, timeout))
        except BaseException:
            self.close()
            raise
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvb-sender-sweep", daemon=True)
        self._sweeper.start()

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
        handle = KVHandle(
            handle_id=os.urandom(16), request_id=request_id, layout_hash=L.compat_hash,
            urls=self.urls, block_ids=tuple(ids), generations=tuple(self.pool.generations(ids)),
            checksums=tuple(block_checksums(self.pool, ids)) if self.checksums else (),
            num_tokens=num_tokens, token=os.urandom(16),
            expires_at_ms=int((time.time() + ttl) * 1000),
        ).signed(self._key)
        rec = _Record(handle, handle.to_bytes(), ids, time.monotonic() + ttl)
        with self._lock:
            if self._closed:
                raise ConfigError("sender is closed")
            self._records[handle.handle_id] = rec
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

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]]) -> _Grant:
        rec = self._lookup(handle_bytes)
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
        rec = self._lookup(handle_bytes)
        self._end(rec, "released")

    # -- lifecycle -----------------------------------------------------------------------
    def _end(self, rec: _Record, reason: FreeReason) -> bool:
        with self._lock:
            if not rec.live:
                return False
            rec.live = False
            rec.reason = reason
            self._records.pop(rec.handle.handle_id, None)
            free_now = rec.inflight == 0
        if free_now:
            self._free(rec)
        return True

    def _read_done(self, rec: _Record) -> None:
        with self._lock:
            rec.inflight -= 1
            free_now = not rec.live and rec.inflight == 0
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
        setattr(self.stats, rec.reason, getattr(self.stats, rec.reason, 0) + 1)
        self.stats.blocks_freed += len(rec.block_ids)
        if self.on_free is not None:
            try:
                self.on_free(rec.handle, rec.reason)
            except Exception:
                log.exception("on_free callback failed")

    def _sweep_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [r for r in self._records.values() if r.deadline <= now]
                if not due:
                    nxt = min((r.deadline for r in self._records.values()), default=now + 1.0)
                    self._lock.wait(timeout=max(0.005, min(1.0, nxt - now)))
                    continue
            for r in due:
                self._end(r, "expired")

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

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
