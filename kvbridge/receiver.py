"""KVReceiver: the decode side. Fetches a handle's blocks into its own pool, verified.

``fetch`` never raises for transfer or lifecycle failures: the :class:`FetchResult`
says what failed (``error``, ``failed_block_ids``) and what to do (``action``:
retry elsewhere, refetch, or re-prefill). Invalid *input* -- a malformed handle,
a layout that cannot match, bad destination block ids -- raises at once.

A leased handle is fetched as claim -> read (under the claim's fence) -> validate
after the bytes landed -> verify checksums -> release; any failure aborts the
claim so the owner frees at once. Only bytes that passed validate-after-read are
reported ok: a lease that expired or moved on during the read rejects them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from .errors import (AccessDenied, Action, BadHandle, IntegrityError, KVBridgeError, LayoutMismatch, LeaseError,
                     PeerUnavailable, PoolError)
from .handle import KVHandle
from .integrity import StreamVerifier, block_checksums
from .lease import Fence, LeaseStore, open_lease_store
from .metrics import ReceiverStats
from .policy import Retry, Timeout
from .pool import KVPool
from .transports.base import ReadOp, Spans, Transport
from .transports.registry import get_transport_class, scheme_of
from .transports.wire import Claim

__all__ = ["KVReceiver", "FetchResult", "HandleLike"]

log = logging.getLogger("kvbridge.receiver")
HandleLike = Union[KVHandle, bytes, dict[str, Any]]


@dataclass
class FetchResult:
    """Outcome of one fetch. ``failed_block_ids`` are destination ids that hold no valid KV."""

    handle: KVHandle
    dst_block_ids: list[int]
    ok: bool = False
    nbytes: int = 0
    seconds: float = 0.0
    attempts: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    error: Optional[KVBridgeError] = None

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def action(self) -> Optional[Action]:
        return None if self.ok or self.error is None else self.error.action

    def raise_for_error(self) -> "FetchResult":
        if self.error is not None:
            raise self.error
        return self


@dataclass
class _Fetch:
    """One fetch in progress."""

    h: KVHandle
    dst: list[int]
    idx: Optional[list[int]]
    t0: float
    res: FetchResult
    spans: Spans
    store: Optional[LeaseStore]
    claim: Optional[Claim] = None


class KVReceiver:
    """Fetch handles into ``pool``. ``secret``: verify handle MACs locally when shared.

    ``leases``: a Redis URL or :class:`LeaseStore` to claim in; None uses the lease
    server named in each handle (this process's embedded one if the handle names
    none); False claims nothing (only for handles published without leases).
    """

    def __init__(self, pool: KVPool, *, secret: Optional[bytes] = None, retry: Retry = Retry(),
                 timeout: Timeout = Timeout(), verify: bool = True,
                 leases: Union[str, LeaseStore, None, bool] = None, claimer: Optional[str] = None,
                 claim_ttl: float = 30.0, lease_namespace: str = "kvb") -> None:
        self.pool = pool
        self.claimer = claimer or f"receiver-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.claim_ttl = claim_ttl
        self._leases_arg = leases
        self._namespace = lease_namespace
        self._stores: dict[str, LeaseStore] = {}
        self.secret = secret
        self.retry = retry
        self.timeout = timeout
        self.verify = verify and pool.is_host
        self.stats = ReceiverStats()
        self._transports: dict[str, Transport] = {}
        self._by_url: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def lease_store(self, handle: KVHandle) -> Optional[LeaseStore]:
        """The store to claim ``handle`` in, or None for an unleased handle."""
        arg = self._leases_arg
        if not handle.lease_id or arg is False:
            return None
        if isinstance(arg, LeaseStore):
            return arg
        url = arg if isinstance(arg, str) else handle.lease_url
        with self._lock:
            store = self._stores.get(url)
            if store is None:
                store = self._stores[url] = open_lease_store(url or None, namespace=self._namespace)
        return store

    def transport(self, url: str) -> Transport:
        t = self._by_url.get(url)
        if t is not None:
            return t
        scheme = scheme_of(url)
        with self._lock:
            t = self._transports.get(scheme)
            if t is None:
                t = self._transports[scheme] = get_transport_class(scheme)(self.timeout, self.secret)
            self._by_url[url] = t
        return t

    # -- input checks ------------------------------------------------------------------
    def _prepare(self, handle: HandleLike, dst_block_ids: Sequence[int],
                 indices: Optional[Sequence[int]]) -> tuple[KVHandle, list[int], Optional[list[int]]]:
        if isinstance(handle, (bytes, bytearray, memoryview)):
            handle = KVHandle.from_bytes(handle, self.secret)
        elif isinstance(handle, dict):
            handle = KVHandle.from_dict(handle, self.secret)
        elif not isinstance(handle, KVHandle):
            raise BadHandle(f"expected a KVHandle, bytes or dict, got {type(handle).__name__}")
        elif self.secret is not None:
            handle.verify(self.secret)
        if handle.lease_id and handle.lease_id != handle.lease_digest():
            raise AccessDenied("handle's token or contents do not match its lease: altered or forged")
        if handle.layout_hash != self.pool.layout.compat_hash:
            raise LayoutMismatch(
                f"handle layout {handle.layout_hash} != this pool's {self.pool.layout.compat_hash} "
                f"({self.pool.layout.compat_key()})")
        dst = [int(b) for b in dst_block_ids]
        idx = None if indices is None else [int(i) for i in indices]
        want = handle.num_blocks if idx is None else len(idx)
        if len(dst) != want:
            raise PoolError(f"{want} blocks to fetch but {len(dst)} destination block ids")
        if len(set(dst)) != len(dst):
            raise PoolError("duplicate destination block ids")
        self.pool._check_ids(dst)
        if idx is not None and any(not 0 <= i < handle.num_blocks for i in idx):
            raise PoolError(f"block index outside the {handle.num_blocks}-block handle")
        if not handle.urls:
            raise BadHandle("handle names no sender URL")
        return handle, dst, idx

    def _spans(self, handle: KVHandle, dst: list[int]) -> Spans:
        """Destination memory; with verification on, hashed as it lands."""
        spans = Spans.of_blocks(self.pool, dst)
        if self.verify and handle.checksums:
            spans.verifier = StreamVerifier(self.pool, dst)
        return spans

    @staticmethod
    def _restart(spans: Spans) -> None:
        """A new attempt restarts the stream: so does its verifier."""
        if spans.verifier is not None and spans.verifier._done:
            spans.verifier.reset()

    def _bad_blocks(self, handle: KVHandle, dst: list[int], idx: Optional[list[int]],
                    spans: Optional[Spans] = None) -> list[int]:
        """Positions (into ``dst``) whose checksum does not match the handle's."""
        if not self.verify or not handle.checksums:
            return []
        want = handle.checksums if idx is None else [handle.checksums[i] for i in idx]
        v = spans.verifier if spans is not None else None
        got = v.digests() if v is not None and v.complete else block_checksums(self.pool, dst)
        return [k for k, (a, b) in enumerate(zip(got, want)) if a != b]

    # -- one read, over the handle's URLs in order -------------------------------------------
    def _read_once(self, handle: KVHandle, dst: Spans, idx: Optional[list[int]],
                   claim: Optional[Claim] = None) -> int:
        last: Optional[KVBridgeError] = None
        for url in handle.urls:
            try:
                return self.transport(url).read(url, handle, dst, idx, claim)
            except PeerUnavailable as exc:   # try the next URL of the same sender
                last = exc
        assert last is not None
        raise last

    async def _aread_once(self, handle: KVHandle, dst: Spans, idx: Optional[list[int]],
                          claim: Optional[Claim] = None) -> int:
        last: Optional[KVBridgeError] = None
        for url in handle.urls:
            try:
                return await self.transport(url).aread(url, handle, dst, idx, claim)
            except PeerUnavailable as exc:
                last = exc
        assert last is not None
        raise last

    def _on_retry(self, exc: BaseException, attempt: int) -> None:
        self.stats.retries += 1
        log.info("retrying after %s (attempt %d)", exc, attempt + 1)

    def _claim(self, store: Optional[LeaseStore], h: KVHandle) -> Optional[Claim]:
        if store is None:
            return None
        lease = self.retry.call(lambda: store.claim(h.lease_id, self.claimer, self.claim_ttl), self._on_retry)
        self.stats.claimed += 1
        return Claim(self.claimer, lease.fence.epoch, lease.fence.counter)

    def _validate(self, store: Optional[LeaseStore], h: KVHandle, claim: Optional[Claim]) -> None:
        """Validate-after-read: the lease must still be ours, with the same fence."""
        if store is not None and claim is not None:
            self.retry.call(lambda: store.validate(h.lease_id, claim.claimer, Fence(claim.epoch, claim.counter)),
                            self._on_retry)

    def _finish(self, res: FetchResult, idx: Optional[list[int]], t0: float, release: bool,
                store: Optional[LeaseStore] = None, claim: Optional[Claim] = None,
                spans: Optional[Spans] = None) -> FetchResult:
        """Verify checksums (refetching bad blocks once), then release or abort; record stats."""
        h, dst = res.handle, res.dst_block_ids
        if res.error is None:
            bad = self._bad_blocks(h, dst, idx, spans)
            if bad:
                self.stats.refetches += 1
                sub_idx = [(idx[k] if idx is not None else k) for k in bad]
                sub_dst = [dst[k] for k in bad]
                try:
                    self._read_once(h, Spans.of_blocks(self.pool, sub_dst), sub_idx, claim)
                    still = self._bad_blocks(h, sub_dst, sub_idx)
                    bad = [bad[k] for k in still]
                except KVBridgeError as exc:
                    res.error = exc
                if bad:
                    self.stats.integrity_failures += 1
                    res.failed_block_ids = [dst[k] for k in bad]
                    res.error = res.error or IntegrityError(
                        f"{len(bad)} block(s) of request {h.request_id!r} failed their checksum twice")
        if res.error is None and store is not None and claim is not None:
            # Validate after read, in the same round trip as the release when there is one: a
            # release succeeds only while the lease is claimed by us with this fence -- so before
            # the owner could have revoked it and freed the blocks.
            c = claim
            try:
                if release:
                    self.retry.call(lambda: store.release(h.lease_id, c.claimer, Fence(c.epoch, c.counter)),
                                    self._on_retry)
                    self.stats.released += 1
                else:
                    self._validate(store, h, c)
            except KVBridgeError as exc:
                res.error = exc
                if isinstance(exc, LeaseError):
                    self.stats.stale_refused += 1
        if res.error is not None:
            if not res.failed_block_ids:
                res.failed_block_ids = list(dst)
            self.stats.failed += 1
            # Abort only a genuine claim that failed; a refused (altered) handle or a lease we no
            # longer hold is not ours to end.
            if (store is not None and claim is not None
                    and not isinstance(res.error, (LeaseError, BadHandle, AccessDenied))):
                self._end_claim(store, h, claim, abort=True)
        else:
            res.ok = True
            self.stats.ok += 1
            self.stats.bytes += res.nbytes
            if release and claim is None:
                self.release(h, wait=False)
        res.seconds = time.perf_counter() - t0
        self.stats.seconds += res.seconds
        return res

    def _end_claim(self, store: LeaseStore, h: KVHandle, claim: Claim, abort: bool) -> None:
        fence = Fence(claim.epoch, claim.counter)
        try:
            (store.abort if abort else store.release)(h.lease_id, claim.claimer, fence)
            self.stats.aborted += abort
        except KVBridgeError as exc:   # the owner still frees at expiry
            log.warning("%s of lease %s failed: %s", "abort" if abort else "release", h.lease_id, exc)

    # -- public API --------------------------------------------------------------------------
    def _start(self, handle: HandleLike, dst_block_ids: Sequence[int],
               indices: Optional[Sequence[int]]) -> "_Fetch":
        h, dst, idx = self._prepare(handle, dst_block_ids, indices)
        self.stats.fetches += 1
        return _Fetch(h, dst, idx, time.perf_counter(), FetchResult(h, dst), self._spans(h, dst),
                      self.lease_store(h))

    def fetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
              indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Read the handle's blocks (or ``indices`` of them) into ``dst_block_ids``."""
        f = self._start(handle, dst_block_ids, indices)

        def attempt() -> int:
            f.res.attempts += 1
            self._restart(f.spans)
            return self._read_once(f.h, f.spans, f.idx, f.claim)
        try:
            f.claim = self._claim(f.store, f.h)
            f.res.nbytes = self.retry.call(attempt, self._on_retry)
        except KVBridgeError as exc:
            f.res.error = exc
        return self._finish(f.res, f.idx, f.t0, release, f.store, f.claim, f.spans)

    async def afetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
                     indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Awaitable :meth:`fetch`; the claim and the transfer run on the event loop."""
        f = self._start(handle, dst_block_ids, indices)

        async def attempt() -> int:
            f.res.attempts += 1
            self._restart(f.spans)
            return await self._aread_once(f.h, f.spans, f.idx, f.claim)
        try:
            if f.store is not None:
                store, h = f.store, f.h
                lease = await self.retry.acall(lambda: store.aclaim(h.lease_id, self.claimer, self.claim_ttl),
                                               self._on_retry)
                self.stats.claimed += 1
                f.claim = Claim(self.claimer, lease.fence.epoch, lease.fence.counter)
            f.res.nbytes = await self.retry.acall(attempt, self._on_retry)
        except KVBridgeError as exc:
            f.res.error = exc
        return await asyncio.to_thread(self._finish, f.res, f.idx, f.t0, release, f.store, f.claim, f.spans)

    def fetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                   release: bool = True) -> list[FetchResult]:
        """Fetch many handles; requests to one sender are pipelined on one connection."""
        prepared = [self._prepare(h, d, None) for h, d in items]
        t0 = time.perf_counter()
        groups: dict[str, list[tuple[int, ReadOp]]] = {}
        stores: list[Optional[LeaseStore]] = []
        claim_errors: dict[int, KVBridgeError] = {}
        for k, (h, dst, _) in enumerate(prepared):
            store = self.lease_store(h)
            stores.append(store)
            op = ReadOp(h, self._spans(h, dst))
            try:
                op.claim = self._claim(store, h)
            except KVBridgeError as exc:
                claim_errors[k] = exc
                continue
            groups.setdefault(h.urls[0], []).append((k, op))
        results: list[Optional[FetchResult]] = [None] * len(prepared)
        for k, claim_error in claim_errors.items():
            self.stats.fetches += 1
            res = FetchResult(prepared[k][0], prepared[k][1], error=claim_error)
            results[k] = self._finish(res, None, t0, release)
        for url, ops in groups.items():
            self.transport(url).read_many(url, [op for _, op in ops])
            for k, op in ops:
                h, dst, _ = prepared[k]
                self.stats.fetches += 1
                res = FetchResult(h, dst, attempts=1)
                try:
                    if isinstance(op.result, KVBridgeError) and op.result.retryable:
                        # fall back to the single-fetch path with its retry policy
                        self._restart(op.dst)
                        res.nbytes = self.retry.call(lambda: self._read_once(h, op.dst, None, op.claim),
                                                     self._on_retry)
                        res.attempts += 1
                    elif isinstance(op.result, KVBridgeError):
                        raise op.result
                    else:
                        res.nbytes = int(op.result or 0)
                except KVBridgeError as exc:
                    res.error = exc
                results[k] = self._finish(res, None, t0, release, stores[k], op.claim, op.dst)
        return [r for r in results if r is not None]

    async def afetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                          release: bool = True) -> list[FetchResult]:
        return list(await asyncio.gather(*(self.afetch(h, d, release=release) for h, d in items)))

    def claim(self, handle: HandleLike) -> Optional[Claim]:
        """Claim a leased handle now, e.g. while its request waits in a decode queue; the later
        :meth:`fetch` by this receiver reuses the claim (claiming again is idempotent). Keep it
        alive with :meth:`renew`. Returns None for a handle without a lease."""
        h = self._parse(handle)
        return self._claim(self.lease_store(h), h)

    def renew(self, handle: HandleLike, claim: Claim, ttl: Optional[float] = None) -> None:
        """Extend this receiver's claim by ``ttl`` seconds (default ``claim_ttl``); a claim never
        outlives its lease, which only the owner extends."""
        h = self._parse(handle)
        store = self.lease_store(h)
        if store is not None:
            self.retry.call(lambda: store.renew(h.lease_id, claim.claimer, self.claim_ttl if ttl is None else ttl,
                                                Fence(claim.epoch, claim.counter)), self._on_retry)

    def _parse(self, handle: HandleLike) -> KVHandle:
        if isinstance(handle, KVHandle):
            return handle
        if isinstance(handle, dict):
            return KVHandle.from_dict(handle, self.secret)
        return KVHandle.from_bytes(handle, self.secret)

    def release(self, handle: KVHandle, wait: bool = True) -> bool:
        """Tell the sender the KV is consumed (for handles without a lease). Failure is logged:
        the sender frees at expiry. ``wait=False`` sends without waiting for the answer."""
        for url in handle.urls:
            try:
                self.transport(url).release(url, handle, wait)
                return True
            except KVBridgeError as exc:
                log.warning("release of %s via %s failed: %s", handle.request_id, url, exc)
        return False

    def close(self) -> None:
        with self._lock:
            ts = list(self._transports.values())
            stores = list(self._stores.values())
            self._transports.clear()
            self._by_url.clear()
            self._stores.clear()
        for t in ts:
            t.close()
        for s in stores:
            s.close()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
