"""KVReceiver: the decode side. Fetches a handle's blocks into its own pool, verified.

``fetch`` never raises for transfer or lifecycle failures: the :class:`FetchResult`
says what failed (``error``, ``failed_block_ids``) and what to do (``action``:
retry elsewhere, refetch, or re-prefill). Invalid *input* -- a malformed handle,
a layout that cannot match, bad destination block ids -- raises at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from .errors import (Action, BadHandle, IntegrityError, KVBridgeError, LayoutMismatch,
                     PeerUnavailable, PoolError)
from .handle import KVHandle
from .integrity import block_checksums
from .metrics import ReceiverStats
from .policy import Retry, Timeout
from .pool import KVPool
from .transports.base import ReadOp, Spans, Transport
from .transports.registry import get_transport_class, scheme_of

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


class KVReceiver:
    """Fetch handles into ``pool``. ``secret``: verify handle MACs locally when shared."""

    def __init__(self, pool: KVPool, *, secret: Optional[bytes] = None, retry: Retry = Retry(),
                 timeout: Timeout = Timeout(), verify: bool = True) -> None:
        self.pool = pool
        self.secret = secret
        self.retry = retry
        self.timeout = timeout
        self.verify = verify and pool.is_host
        self.stats = ReceiverStats()
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def transport(self, url: str) -> Transport:
        scheme = scheme_of(url)
        with self._lock:
            t = self._transports.get(scheme)
            if t is None:
                t = self._transports[scheme] = get_transport_class(scheme)(self.timeout, self.secret)
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

    def _bad_blocks(self, handle: KVHandle, dst: list[int], idx: Optional[list[int]]) -> list[int]:
        """Positions (into ``dst``) whose checksum does not match the handle's."""
        if not self.verify or not handle.checksums:
            return []
        want = handle.checksums if idx is None else [handle.checksums[i] for i in idx]
        got = block_checksums(self.pool, dst)
        return [k for k, (a, b) in enumerate(zip(got, want)) if a != b]

    # -- one read, over the handle's URLs in order -------------------------------------------
    def _read_once(self, handle: KVHandle, dst: Spans, idx: Optional[list[int]]) -> int:
        last: Optional[KVBridgeError] = None
        for url in handle.urls:
            try:
                return self.transport(url).read(url, handle, dst, idx)
            except PeerUnavailable as exc:   # try the next URL of the same sender
                last = exc
        assert last is not None
        raise last

    async def _aread_once(self, handle: KVHandle, dst: Spans, idx: Optional[list[int]]) -> int:
        last: Optional[KVBridgeError] = None
        for url in handle.urls:
            try:
                return await self.transport(url).aread(url, handle, dst, idx)
            except PeerUnavailable as exc:
                last = exc
        assert last is not None
        raise last

    def _on_retry(self, exc: BaseException, attempt: int) -> None:
        self.stats.retries += 1
        log.info("retrying after %s (attempt %d)", exc, attempt + 1)

    def _finish(self, res: FetchResult, idx: Optional[list[int]], t0: float, release: bool) -> FetchResult:
        """Verify checksums (refetching bad blocks once), release, record stats."""
        h, dst = res.handle, res.dst_block_ids
        if res.error is None:
            bad = self._bad_blocks(h, dst, idx)
            if bad:
                self.stats.refetches += 1
                sub_idx = [(idx[k] if idx is not None else k) for k in bad]
                sub_dst = [dst[k] for k in bad]
                try:
                    self._read_once(h, Spans.of_blocks(self.pool, sub_dst), sub_idx)
                    still = self._bad_blocks(h, sub_dst, sub_idx)
                    bad = [bad[k] for k in still]
                except KVBridgeError as exc:
                    res.error = exc
                if bad:
                    self.stats.integrity_failures += 1
                    res.failed_block_ids = [dst[k] for k in bad]
                    res.error = res.error or IntegrityError(
                        f"{len(bad)} block(s) of request {h.request_id!r} failed their checksum twice")
        if res.error is not None:
            if not res.failed_block_ids:
                res.failed_block_ids = list(dst)
            self.stats.failed += 1
        else:
            res.ok = True
            self.stats.ok += 1
            self.stats.bytes += res.nbytes
            if release:
                self.release(h)
        res.seconds = time.perf_counter() - t0
        self.stats.seconds += res.seconds
        return res

    # -- public API --------------------------------------------------------------------------
    def fetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
              indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Read the handle's blocks (or ``indices`` of them) into ``dst_block_ids``."""
        h, dst, idx = self._prepare(handle, dst_block_ids, indices)
        t0 = time.perf_counter()
        self.stats.fetches += 1
        res = FetchResult(h, dst)
        spans = Spans.of_blocks(self.pool, dst)

        def attempt() -> int:
            res.attempts += 1
            return self._read_once(h, spans, idx)
        try:
            res.nbytes = self.retry.call(attempt, self._on_retry)
        except KVBridgeError as exc:
            res.error = exc
        return self._finish(res, idx, t0, release)

    async def afetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
                     indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Awaitable :meth:`fetch`; the transfer runs on the event loop where the backend allows."""
        h, dst, idx = self._prepare(handle, dst_block_ids, indices)
        t0 = time.perf_counter()
        self.stats.fetches += 1
        res = FetchResult(h, dst)
        spans = Spans.of_blocks(self.pool, dst)

        async def attempt() -> int:
            res.attempts += 1
            return await self._aread_once(h, spans, idx)
        try:
            res.nbytes = await self.retry.acall(attempt, self._on_retry)
        except KVBridgeError as exc:
            res.error = exc
        return await asyncio.to_thread(self._finish, res, idx, t0, release)

    def fetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                   release: bool = True) -> list[FetchResult]:
        """Fetch many handles; requests to one sender are pipelined on one connection."""
        prepared = [self._prepare(h, d, None) for h, d in items]
        t0 = time.perf_counter()
        groups: dict[str, list[tuple[int, ReadOp]]] = {}
        for k, (h, dst, _) in enumerate(prepared):
            groups.setdefault(h.urls[0], []).append((k, ReadOp(h, Spans.of_blocks(self.pool, dst))))
        results: list[Optional[FetchResult]] = [None] * len(prepared)
        for url, ops in groups.items():
            self.transport(url).read_many(url, [op for _, op in ops])
            for k, op in ops:
                h, dst, _ = prepared[k]
                self.stats.fetches += 1
                res = FetchResult(h, dst, attempts=1)
                if isinstance(op.result, KVBridgeError) and op.result.retryable:
                    try:   # fall back to the single-fetch path with its retry policy
                        res.nbytes = self.retry.call(lambda: self._read_once(h, op.dst, None), self._on_retry)
                        res.attempts += 1
                    except KVBridgeError as exc:
                        res.error = exc
                elif isinstance(op.result, KVBridgeError):
                    res.error = op.result
                else:
                    res.nbytes = int(op.result or 0)
                results[k] = self._finish(res, None, t0, release)
        return [r for r in results if r is not None]

    async def afetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                          release: bool = True) -> list[FetchResult]:
        return list(await asyncio.gather(*(self.afetch(h, d, release=release) for h, d in items)))

    def release(self, handle: KVHandle) -> bool:
        """Tell the sender the KV is consumed. Failure is logged: the sender frees at expiry."""
        for url in handle.urls:
            try:
                self.transport(url).release(url, handle)
                return True
            except KVBridgeError as exc:
                log.warning("release of %s via %s failed: %s", handle.request_id, url, exc)
        return False

    def extra(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        with self._lock:
            ts = list(self._transports.values())
            self._transports.clear()
        for t in ts:
            t.close()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
