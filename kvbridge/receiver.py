"""KVReceiver: the decode side. Fetches a handle's blocks into its own pool, verified, or
reserves blocks for a prefill side to push into.

One pipeline -- claim, move, verify, release -- runs every transfer; ``fetch``
(blocking), ``start_fetch`` (a :class:`~kvbridge.transfer.Transfer` to poll or wait on,
from any thread), ``afetch`` (awaitable) and ``fetch_many`` (batched claims, pipelined
reads) are thin faces of it. A layer-wise handle is moved layer by layer as the sender
makes layers ready, each layer verified as it lands, so ``transfer.wait_layer(i)``
returns while later layers are still being computed.

A transfer never raises for transfer or lifecycle failures: its :class:`FetchResult`
says what failed (``error``, ``failed_block_ids``) and what to do (``action``: retry
elsewhere, refetch, or re-prefill). Invalid *input* -- a malformed handle, a layout that
cannot match, bad destination block ids -- raises at once.

A leased handle is moved as claim -> read (under the claim's fence) -> validate after
the bytes landed -> verify checksums -> release; any failure aborts the claim so the
owner frees at once. Only bytes that passed validate-after-read are reported ok. Where the
transport validated every read after its last byte (tcp's trailer, inproc, ucx: the owner;
shm: the reader's re-check) and the claim certainly still holds by this receiver's clock,
validate-after-read needs no lease round trip and the release is sent after the fetch
returns; otherwise the release (or ``validate``) in the lease store is the validate-after-read
(``docs/LEASES.md``).

Push mode (``listen=`` and :meth:`KVReceiver.reserve`): the receiver offers destination
blocks under a signed reservation with its own lease; the writer claims the lease (one
writer wins) and writes under its fence; each write is verified as it lands; a cancel or
an expiry revokes the lease first and returns only once no write is in flight.

The pipeline itself -- claim, move, verify, release -- is :mod:`.receiver_pipeline`; this
module is its public face: input checks, the fetch forms, claims and releases, push mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any, Optional, Sequence, Union

from .blockcopy import dst_snapshot
from .errors import AccessDenied, BadHandle, ConfigError, KVBridgeError, LayoutMismatch, PoolError
from .frames import check_codec
from .handle import KVHandle, check_secret, check_ttl
from .lease import Claim, LeaseStore, resolve_lease_url
from .metrics import ReceiverStats
from .policy import Retry, Timeout, _seconds
from .pool import KVPool, LandingMark, block_id_list
from .receiver_pipeline import ReceiverPipeline, _Job as _Job
from .releases import AfterRead, Recent, Releaser, claim_batch, release_batch
from .reservations import ReservationDesk
from .stores import LeasesArg, StoreCache
from .transfer import FetchResult, Transfer, Workers
from .transports.base import ReadOp, Server, Transport, WriteGrant
from .transports.wire import CLAIM_ME
from .transports.registry import get_transport_class, scheme_of

__all__ = ["KVReceiver", "FetchResult", "HandleLike"]

log = logging.getLogger("kvbridge.receiver")


HandleLike = Union[KVHandle, bytes, dict[str, Any]]
RELEASED_KEPT = 4096    # released handles remembered (far longer than a deferred release takes to land)
MAX_URLS = 4096         # sender URLs whose transport is remembered (a cache)


class KVReceiver(ReceiverPipeline):
    """Fetch handles into ``pool``; with ``listen``, also take pushes into reserved blocks.

    ``secret``: verify handle MACs locally when shared (and sign reservations with it).
    ``leases``: a Redis URL or :class:`LeaseStore` to claim in; None uses the lease server
    named in each handle (this process's embedded one if the handle names none); False
    claims nothing (only for handles published without leases). ``workers``: threads
    that run started transfers. ``clock_margin``: seconds of a claim's TTL left unused when
    judging, by this clock, that the claim still holds (the release must land in them).
    """

    def __init__(self, pool: KVPool, *, secret: Optional[bytes] = None, retry: Retry = Retry(),
                 timeout: Timeout = Timeout(), verify: bool = True, leases: LeasesArg = None,
                 claimer: Optional[str] = None, claim_ttl: float = 30.0, lease_namespace: str = "kvb",
                 listen: Union[str, Sequence[str], None] = None, reservation_ttl: float = 60.0,
                 workers: int = 32, clock_margin: float = 1.0) -> None:
        if not isinstance(pool, KVPool) or pool.closed:   # before anything opens: nothing to close
            got = "a closed pool" if isinstance(pool, KVPool) else type(pool).__name__
            raise ConfigError(f"KVReceiver(pool): an open KVPool, not {got}")
        check_secret("KVReceiver", secret)
        check_ttl("KVReceiver(reservation_ttl)", reservation_ttl)
        check_ttl("KVReceiver(claim_ttl)", claim_ttl)      # 0 or less: every leased fetch lapsed its claim
        if isinstance(leases, str) and leases:
            resolve_lease_url(leases)      # a URL no store can take: refused here, not at every fetch
        _seconds("KVReceiver", "clock_margin", clock_margin, zero=True)
        self.pool = pool
        self._closed = False
        self.claimer = claimer or f"receiver-{socket.gethostname()}-{os.getpid()}-{os.urandom(12).hex()}"
        self.claim_ttl = claim_ttl
        self.clock_margin = clock_margin
        self._after = AfterRead(self.transport, claim_ttl, clock_margin)
        self._releaser = Releaser(self.claimer, retry, self._released_later)
        self.reservation_ttl = reservation_ttl
        self.secret = secret
        self.retry = retry
        self.timeout = timeout
        self.verify = verify
        self.stats = ReceiverStats()
        self._stores = StoreCache(leases, lease_namespace)
        self._transports: dict[str, Transport] = {}
        self._by_url: dict[str, Transport] = {}
        self._lock = threading.Lock()
        # handles without a lease this receiver released (the latest RELEASED_KEPT): their
        # releases may still be on their way, and until they land the sender would serve them
        self._released = Recent(2 * RELEASED_KEPT)
        self._workers = Workers("kvb-fetch", workers)
        self._desk = ReservationDesk(self, secret if secret is not None else os.urandom(32))
        self.servers: list[Server] = []
        urls = [] if listen is None else [listen] if isinstance(listen, str) else list(listen)
        try:
            for u in urls:
                self.servers.append(get_transport_class(scheme_of(u)).serve(u, self, timeout))
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    def lease_store(self, handle: KVHandle) -> Optional[LeaseStore]:
        """The store to claim ``handle`` in, or None for an unleased handle. A lease server URL
        the handle names (``leases=None``) that no store can use is the handle's fault: BadHandle."""
        return self._stores.for_ticket(handle)

    def transport(self, url: str) -> Transport:
        t = self._by_url.get(url)
        if t is not None:
            return t
        scheme = scheme_of(url)
        with self._lock:
            t = self._transports.get(scheme)
            if t is None:
                t = self._transports[scheme] = get_transport_class(scheme)(self.timeout, self.secret)
            if len(self._by_url) >= MAX_URLS:    # a cache: handles naming ever new URLs do not grow it
                self._by_url.clear()
            self._by_url[url] = t
        return t

    # -- input checks (on the caller's thread: cheap, and they raise) ----------------------
    def _parse(self, handle: HandleLike) -> KVHandle:
        if type(handle) is KVHandle and self.secret is None:     # the common case, first
            return handle
        if isinstance(handle, (bytes, bytearray, memoryview)):
            return KVHandle.from_bytes(handle, self.secret)
        if isinstance(handle, dict):
            return KVHandle.from_dict(handle, self.secret)
        if not isinstance(handle, KVHandle):
            raise BadHandle(f"expected a KVHandle, bytes or dict, got {type(handle).__name__}")
        if self.secret is not None:
            handle.verify(self.secret)
        return handle

    def _check_dst(self, dst_block_ids: Sequence[int], want: int) -> list[int]:
        dst = block_id_list(dst_block_ids, "destination")
        n = len(dst)
        if n != want:
            raise PoolError(f"{want} blocks to move but {n} destination block ids")
        if n > 1:
            if len(set(dst)) != n:
                raise PoolError("duplicate destination block ids")
            if min(dst) < 0 or max(dst) >= self.pool.num_blocks:
                self.pool._check_ids(dst)          # says which
        elif n and not 0 <= dst[0] < self.pool.num_blocks:
            self.pool._check_ids(dst)
        return dst

    def _prepare(self, handle: HandleLike, dst_block_ids: Sequence[int], indices: Optional[Sequence[int]],
                 release: bool) -> _Job:
        if self._closed:                  # it would open connections nothing closes any more
            raise ConfigError("receiver is closed")
        h = self._parse(handle)
        if h.reservation:
            raise BadHandle("this is a reservation (push mode): give it to KVSender.push, not fetch")
        if h.lease_id and h.lease_id != h.lease_digest():
            raise AccessDenied("handle's token or contents do not match its lease: altered or forged")
        if h.layout_hash != self.pool.layout.compat_hash:
            raise LayoutMismatch(
                f"handle layout {h.layout_hash} != this pool's {self.pool.layout.compat_hash} "
                f"({self.pool.layout.to_dict()})")
        idx = None if indices is None else block_id_list(indices, "indices")   # 1.9 is not index 1
        if h.codec != "raw":
            check_codec(h.codec)          # unknown, or its extra missing: refused here, never misread
            if idx is not None:
                raise ConfigError(f"a {h.codec}-coded handle is fetched whole (its frames hold every block)")
        dst = self._check_dst(dst_block_ids, h.num_blocks if idx is None else len(idx))
        if idx is not None and any(not 0 <= i < h.num_blocks for i in idx):
            raise PoolError(f"block index outside the {h.num_blocks}-block handle")
        if idx is not None and len(set(idx)) != len(idx):
            raise PoolError("repeated block indices")
        if not h.urls:
            raise BadHandle("handle names no sender URL")
        return _Job(h, dst, idx, release, FetchResult(h, dst), self.lease_store(h) if h.lease_id else None,
                    self.pool.generations(dst))

    # -- public faces of the pipeline ------------------------------------------------------
    def _transfer(self, j: _Job) -> Transfer:
        t = Transfer(j.h.request_id, self.pool.layout.num_layers, lambda t: self._pull(t, j))
        t.handle, t.dst_block_ids = j.h, j.dst
        return t

    def start_fetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
                    indices: Optional[Sequence[int]] = None, release: bool = True) -> Transfer:
        """Start moving the handle's blocks (or ``indices`` of them) into ``dst_block_ids``
        and return at once: poll ``done()``, block in ``wait()``/``result()``, follow
        ``wait_layer(i)``, or ``cancel()``. Invalid input raises here."""
        return self._submit([self._prepare(handle, dst_block_ids, indices, release)])[0]

    def _submit(self, jobs: list[_Job]) -> list[Transfer]:
        """Each job's transfer on the workers, its destination marked in the pool until it ends
        (however it ends: done, failed, cancelled before it started), unmarked before anyone
        sees it ended. Where submitting raises, the transfers made so far end cancelled (one a
        worker already took stops, and unmarks as it ends) and the rest unmark here: none is
        left for a worker to run later into blocks no longer marked."""
        pool = self.pool
        marks = [LandingMark(pool, j.dst) for j in jobs]
        pool._land([b for j in jobs for b in j.dst])   # distinct (_prepare_many)
        ts: list[Transfer] = []
        try:
            for j, mark in zip(jobs, marks):
                t = self._transfer(j)
                t._at_end(mark)
                ts.append(t)
                self._workers.submit(t)
        except BaseException:
            for t in ts:
                t._stop()
            for mark in marks[len(ts):]:
                mark()
            raise
        return ts

    def fetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
              indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Move the handle's blocks into ``dst_block_ids`` on this thread; the result.

        The usual fetch -- a whole unleased raw handle whose transport moves (and hashes) its
        host blocks in one piece (:meth:`Transport.fetch_whole`: tcp, the checks, marks and
        comparisons too, in one C call; :meth:`Transport.read_small`: shm's one-sided read) --
        runs here, without the pipeline's job, spans and stages; any other outcome than
        verified bytes on unchanged blocks goes on in :meth:`_pull` from where it stands."""
        h = handle
        pool = self.pool
        if (indices is not None or type(h) is not KVHandle or self.secret is not None
                or h.reservation or h.layerwise or h.codec != "raw" or not h.urls
                or h.layout_hash != pool.layout.compat_hash or h.handle_id in self._released or self._closed):
            return self._fetch_job(self._prepare(handle, dst_block_ids, indices, release))
        if h.lease_id:
            return self._fetch_leased(h, dst_block_ids, release)
        url = h.urls[0]
        t0 = time.perf_counter()
        tr = self._by_url.get(url) or self._transport_or_none(url)
        if tr is None:                   # no such backend here: the pipeline says so in the result
            return self._fetch_job(self._prepare(handle, dst_block_ids, indices, release))
        verify = self.verify and bool(h.checksums)
        quick = tr.fetch_whole(url, h, pool, dst_block_ids, verify)
        if quick is True:
            return self._fetched(tr, url, h, list(dst_block_ids), release, t0)
        if quick is not None:                # marked, and it did not end verified: the pipeline, held to its gens
            dst = list(dst_block_ids)
            gens, failed, landed = quick
            try:
                return self._pull(None, self._job(h, dst, release, gens, t0), failed=failed, landed=landed)
            finally:
                pool._landed(dst)
        # the destination as the fetch begins: read_small and any fallback hold to these generations
        got_dst = dst_snapshot(dst_block_ids, pool.live_generations, len(h.block_ids))
        if got_dst is None:              # the pipeline's _check_dst says what is wrong with them
            return self._fetch_job(self._prepare(handle, dst_block_ids, indices, release))
        dst, gens = got_dst
        pool._land(dst)
        try:
            try:
                got = tr.read_small(url, h, pool, dst, verify, gens)
            except KVBridgeError as exc:
                return self._pull(None, self._job(h, dst, release, gens, t0), failed=exc)
            if got is None or got[1] is not None:
                # no fast path, or it could not vouch: the pipeline, held to `gens`; or a checksum
                # differs (`landed`): the pipeline refetches or refuses
                return self._pull(None, self._job(h, dst, release, gens, t0), landed=got)
            return self._fetched(tr, url, h, dst, release, t0)
        finally:
            pool._landed(dst)

    def _fetch_leased(self, h: KVHandle, dst_block_ids: Sequence[int], release: bool) -> FetchResult:
        """The usual leased fetch: where the transport has :meth:`Transport.fetch_claimed` (tcp),
        the read asks the owner to claim as it serves and lands in one C call, as an unleased
        one; the pipeline's end (:meth:`_settle`: validate-after-read, the release through the
        owner) follows, or its retries from where the read stands."""
        url = h.urls[0]
        tr = self._by_url.get(url) or self._transport_or_none(url)
        store = None
        if (tr is None or not tr.claims_on_read or h.lease_id != h.lease_digest()
                or self._releaser.releasing(h.lease_id)
                or (store := self.lease_store(h)) is None):     # leases=False: refused, never claimed
            return self._fetch_job(self._prepare(h, dst_block_ids, None, release))    # it says what is wrong
        t0, since = time.perf_counter(), time.monotonic()    # since: before the claim is sent
        me = CLAIM_ME(self.claimer, self.claim_ttl)
        got = tr.fetch_claimed(url, h, self.pool, dst_block_ids, self.verify and bool(h.checksums), me)
        if got is None:
            return self._fetch_job(self._prepare(h, dst_block_ids, None, release))
        served, quick = got
        dst = list(dst_block_ids)
        try:                  # marked until the end: validate-after-read and the release may ask the store
            landed = quick is True
            j = _Job(h, dst, None, release, FetchResult(h, dst), store,
                     self.pool.generations(dst) if landed else quick[0], since=since)   # type: ignore[index]
            j.t0, j.claim = t0, me
            if served is not None:
                j.served_by = url
                self._learn_claim(j, served)
            if landed:
                j.res.attempts, j.res.nbytes = 1, len(dst) * self.pool.layout.block_nbytes
                return self._settle(j)
            _, failed, arrived = quick                       # type: ignore[misc]
            return self._pull(None, j, failed=failed, landed=arrived)
        finally:
            self.pool._landed(dst)

    def _transport_or_none(self, url: str) -> Optional[Transport]:
        try:
            return self.transport(url)
        except KVBridgeError:            # an unknown scheme, a backend not installed
            return None

    def _fetched(self, tr: Transport, url: str, h: KVHandle, dst: list[int], release: bool,
                 t0: float) -> FetchResult:
        """The usual fetch's end: its bytes landed verified; released (without a reply)."""
        if release:
            try:
                tr.release(url, h, False)              # without a reply: it rides on a later request
            except KVBridgeError:
                self.release(h, wait=False)            # the other URLs, and the log line
            else:
                self._released.add(h.handle_id)
        nbytes = len(dst) * self.pool.layout.block_nbytes
        seconds = time.perf_counter() - t0
        self.stats.fetched(True, nbytes, seconds)
        return FetchResult(h, dst, True, nbytes, seconds, 1)

    def _fetch_job(self, j: _Job) -> FetchResult:
        """A fetch through the pipeline on this thread, its destination marked meanwhile."""
        self.pool._land(j.dst)
        try:
            return self._pull(None, j)
        finally:
            self.pool._landed(j.dst)

    def _job(self, h: KVHandle, dst: list[int], release: bool, gens: list[int], t0: float) -> _Job:
        j = _Job(h, dst, None, release, FetchResult(h, dst), None, gens)
        j.t0 = t0
        return j

    async def afetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
                     indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Awaitable :meth:`fetch`: the transfer runs on a worker thread, the loop only wakes at
        the end (cancelling the awaiting task cancels the transfer)."""
        return await self.start_fetch(handle, dst_block_ids, indices=indices, release=release)

    def fetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                   release: bool = True) -> list[FetchResult]:
        """Fetch many handles: claims batched per lease server (one round trip), reads
        pipelined per sender on one connection."""
        jobs = self._prepare_many(items, release)
        every = [b for j in jobs for b in j.dst]      # distinct (_prepare_many)
        self.pool._land(every, "fetch_many")
        try:
            return self._fetch_many(jobs)
        finally:
            self.pool._landed(every)

    def _fetch_many(self, jobs: list[_Job]) -> list[FetchResult]:
        claim_batch(self, jobs)
        groups: dict[str, list[tuple[_Job, ReadOp]]] = {}
        for j in jobs:
            if j.res.error is None and not j.h.layerwise and j.h.codec == "raw":
                groups.setdefault(j.h.urls[0], []).append((j, ReadOp(j.h, self._spans(j), claim=j.claim)))
        for url, ops in groups.items():
            self.transport(url).read_many(url, [op for _, op in ops])
            for j, op in ops:
                j.res.attempts = 1
                try:
                    if isinstance(op.result, KVBridgeError) and op.result.retryable:
                        self._read_whole(j, op.dst)      # fall back to one read with the retry policy
                    elif isinstance(op.result, KVBridgeError):
                        raise op.result
                    else:
                        j.res.nbytes = int(op.result or 0)
                    self._verify_whole(j, op.dst)
                except KVBridgeError as exc:
                    j.res.error = exc
        release_batch(self, [j for j in jobs if not (j.h.layerwise or j.h.codec != "raw")])
        out = []
        for j in jobs:
            if j.res.error is None and (j.h.layerwise or j.h.codec != "raw"):
                out.append(self._pull(None, j))
            else:
                out.append(self._settle(j))
        return out

    def _prepare_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], release: bool) -> list[_Job]:
        """Every item checked before any moves (invalid input raises, nothing consumed); no
        destination block named twice (the fetch landing last would overwrite another's KV)."""
        jobs = [self._prepare(h, d, None, release) for h, d in items]
        if len(jobs) > 1 and len({b for j in jobs for b in j.dst}) != sum(len(j.dst) for j in jobs):
            raise PoolError("two fetches of one batch name the same destination block")
        return jobs

    async def afetch_many(self, items: Sequence[tuple[HandleLike, Sequence[int]]], *,
                          release: bool = True) -> list[FetchResult]:
        """Awaitable fetches, each on a worker thread; cancelling the awaiting task cancels
        every one of them, and it ends once none will land a byte any more."""
        ts = self._submit(self._prepare_many(items, release))
        try:
            return [await t for t in ts]
        except asyncio.CancelledError:
            for t in ts:
                t._stop()
            for t in ts:
                try:
                    await t
                except asyncio.CancelledError:     # cancelled again: t has still ended (its __await__)
                    pass
            raise

    def claim(self, handle: HandleLike) -> Optional[Claim]:
        """Claim a leased handle now, e.g. while its request waits in a decode queue; the later
        fetch by this receiver reuses the claim (claiming again is idempotent). Keep it
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
                                                claim.fence), self._on_retry)

    def release(self, handle: HandleLike, wait: bool = True) -> bool:
        """Tell the sender the KV is consumed -- after ``fetch(..., release=False)`` -- or that this
        side will not read it (a request aborted before its fetch): the sender's blocks come
        back now rather than at the handle's TTL. A leased handle is released through its lease
        on this thread (claimed first where this receiver had not: claims are re-entrant); an
        unleased one through its sender (``wait=False``: without waiting for the answer).
        Returns False, with a log line, where that failed (the sender then frees at expiry)."""
        handle = self._parse(handle)
        store = self.lease_store(handle)
        if store is not None:
            h = handle
            try:
                c = self._claim(store, h)
                assert c is not None
                self.retry.call(lambda: store.release(h.lease_id, c.claimer, c.fence), self._on_retry)
            except KVBridgeError as exc:
                log.warning("release of %s through its lease failed: %s", h.request_id, exc)
                return False
            self.stats.add(released=1)
            return True
        for url in handle.urls:
            try:
                self.transport(url).release(url, handle, wait)
                if not handle.lease_id:
                    self._released.add(handle.handle_id)
                return True
            except KVBridgeError as exc:
                log.warning("release of %s via %s failed: %s", handle.request_id, url, exc)
        return False

    # -- push mode: reservations (this receiver is a BlockSink) ------------------------------
    def reserve(self, dst_block_ids: Sequence[int], request_id: str = "", *, num_tokens: Optional[int] = None,
                ttl: Optional[float] = None) -> Transfer:
        """Offer ``dst_block_ids`` to a writer: the returned :class:`Transfer` carries the signed
        ``reservation`` (hand it to the prefill side, e.g. ``reservation.to_dict()``) and ends
        when the writer has written and this side verified every layer -- or on
        ``cancel()``, or at ``ttl`` (default ``reservation_ttl``) if the push never completes."""
        if not self.servers:
            raise ConfigError("reserve() needs a receiver that listens: KVReceiver(pool, listen='tcp://...')")
        dst = self._check_dst(dst_block_ids, len(dst_block_ids))
        mark = LandingMark(self.pool, dst)
        # until it ends and no write of it is in flight, no fetch or other reservation lands there
        self.pool._land(dst, "a reservation")
        try:
            return self._desk.reserve(dst, request_id, num_tokens, self.reservation_ttl if ttl is None else ttl,
                                      mark)
        except BaseException:
            mark()
            raise

    def open_write(self, ticket_bytes: bytes, layers: tuple[int, int], claim: Optional[Claim]) -> WriteGrant:
        return self._desk.open_write(ticket_bytes, layers, claim)

    def abort_remote(self, ticket_bytes: bytes, claim: Optional[Claim]) -> None:
        self._desk.abort_remote(ticket_bytes, claim)

    def authorize_ticket(self, ticket_bytes: bytes, claim: Optional[Claim]) -> None:
        """Raise unless ``ticket_bytes`` is a live reservation of this receiver (and ``claim`` its
        writer's, where it is leased): what a server asks before it does any work for a peer."""
        self._desk._authorized(ticket_bytes, claim, "a hello")

    def close(self) -> None:
        """Stop serving; send the releases still pending (bounded), then close connections."""
        self._closed = True
        for s in self.servers:
            s.close()
        self._desk.close()
        self._workers.close()
        self._releaser.close()
        with self._lock:
            ts = list(self._transports.values())
            self._transports.clear()
            self._by_url.clear()
        for t in ts:
            t.close()
        self._stores.close()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
