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

from .blockcopy import dst_snapshot
from .errors import (AccessDenied, BadHandle, ConfigError, HandleNotFound, IntegrityError, KVBridgeError,
                     LayoutMismatch, LeaseError, LeaseExpired, PeerUnavailable, PoolError, ProtocolError,
                     TransferCancelled, TransferTimeout, Unvouched)
from .frames import FrameLoader, check_codec
from .handle import KVHandle
from .integrity import StreamVerifier, block_checksums, layer_checksums, unpack_sums
from .lease import Claim, LeaseStore
from .metrics import ReceiverStats
from .policy import Retry, Timeout
from .pool import KVPool, block_id_list, retired_during
from .stores import LeasesArg, StoreCache
from .transfer import FetchResult, Paced, Transfer, Workers
from .releases import AfterRead, Recent, Releaser, claim_batch, release_batch
from .reservations import ReservationDesk
from .sender import LAYER_WAIT
from .transports.deadline import cancelled
from .transports.base import Chunk, ReadOp, Server, Spans, Transport, WriteGrant
from .transports.registry import get_transport_class, scheme_of
from .transports.sockets import MIN_RATE
from .transports.wire import CLAIM_ME

__all__ = ["KVReceiver", "FetchResult", "HandleLike"]

log = logging.getLogger("kvbridge.receiver")
HandleLike = Union[KVHandle, bytes, dict[str, Any]]
# Transfers up to this many bytes are hashed once they have landed (still in cache), not as
# they land: for a few blocks, following the stream costs more than the hashing (host pools;
# a device pool is hashed in the host slot its bytes pass through, never read back).
HASH_AFTER = 256 << 10
RELEASED_KEPT = 4096    # released handles remembered (far longer than a deferred release takes to land)
MAX_URLS = 4096         # sender URLs whose transport is remembered (a cache)


@dataclass(slots=True)
class _Job:
    """One pull in progress."""

    h: KVHandle
    dst: list[int]
    idx: Optional[list[int]]
    release: bool
    res: FetchResult
    store: Optional[LeaseStore]
    gens: list[int]
    t0: float = field(default_factory=time.perf_counter)
    claim: Optional[Claim] = None
    released: Any = None          # fetch_many: the outcome of this job's release, sent in one batch
    since: float = field(default_factory=time.monotonic)   # before any claim of this fetch was sent


def _restart(spans: Spans) -> None:
    """A read into ``spans`` starts over: from the stream's first byte, on a fresh clock."""
    if spans.verifier is not None and spans.verifier.started:
        spans.verifier.reset()
    spans.digests = None
    if isinstance(spans.cancel, Paced):
        spans.cancel.restart()


class KVReceiver:
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
        self.pool = pool
        self._closed = False
        self.claimer = claimer or f"receiver-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
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
        """The store to claim ``handle`` in, or None for an unleased handle."""
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
                f"({self.pool.layout.compat_key()})")
        idx = None if indices is None else [int(i) for i in indices]
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

    # -- the pipeline: claim -> move -> verify -> release ----------------------------------
    def _on_read_retry(self, exc: BaseException, attempt: int) -> None:
        """:meth:`_on_retry` of a claim or a read: none after its transfer's cancel."""
        if cancelled():
            raise TransferCancelled(f"transfer cancelled (its last try: {exc})")
        self._on_retry(exc, attempt)

    def _on_retry(self, exc: BaseException, attempt: int) -> None:
        self.stats.add(retries=1)
        log.info("retrying after %s (attempt %d)", exc, attempt + 1)

    def _not_consumed(self, j: _Job) -> None:
        """Refuse a handle this receiver already released: its release may not have reached the
        lease store or the sender yet, which would still grant or serve it."""
        if j.store is not None:
            self._not_released(j.h)
        elif j.h.handle_id in self._released:
            raise HandleNotFound(f"handle {j.h.id} of request {j.h.request_id!r} was released by this "
                                 "receiver; its KV is gone")

    def _not_released(self, h: KVHandle) -> None:
        """A claim is re-entrant for its claimer, so until the store has this receiver's release
        of ``h`` it would grant the handle again: refuse it as the store will."""
        if self._releaser.releasing(h.lease_id):
            raise LeaseExpired(f"lease {h.lease_id!r} is already released (by this receiver; "
                               "the release is on its way)")

    def _claim(self, store: Optional[LeaseStore], h: KVHandle) -> Optional[Claim]:
        if store is None:
            return None
        self._not_released(h)
        sent = time.monotonic()
        lease = self.retry.call(lambda: store.claim(h.lease_id, self.claimer, self.claim_ttl), self._on_read_retry)
        self._after.clock.note(h.lease_id, lease, sent)
        self.stats.add(claimed=1)
        return Claim(self.claimer, lease.fence.epoch, lease.fence.counter)

    def _pull(self, t: Optional[Transfer], j: _Job, failed: Optional[KVBridgeError] = None,
              landed: Optional[tuple[int, Optional[list[int]]]] = None) -> FetchResult:
        """The pipeline. ``t`` is None for a blocking fetch on the caller's thread (nothing
        to report progress to, nothing can cancel it). A whole read's first try, made by
        :meth:`fetch`, either ``failed`` or ``landed`` (bytes, digests): go on from there."""
        try:
            if t is not None and t.cancel_event.is_set():
                raise TransferCancelled(f"fetch of {j.h.request_id!r} cancelled before it started")
            self._not_consumed(j)
            if j.claim is None and j.store is not None:
                if self.transport(j.h.urls[0]).claims_on_read:
                    j.claim = CLAIM_ME(self.claimer, self.claim_ttl)   # the sender claims as it serves
                else:
                    j.claim = self._claim(j.store, j.h)
            if j.h.layerwise or j.h.codec != "raw":
                self._move_layers(t, j)
            else:
                spans = self._spans(j, t)
                if landed is None:
                    self._read_whole(j, spans, failed)
                else:
                    j.res.attempts, (j.res.nbytes, spans.digests) = 1, landed
                self._learn_claim(j, spans.claimed)
                self._verify_whole(j, spans)
                if t is not None:
                    t._layer_ready(self.pool.layout.num_layers)
        except KVBridgeError as exc:
            j.res.error = exc
        return self._settle(j)

    def _spans(self, j: _Job, t: Optional[Transfer] = None) -> Spans:
        """Destination memory; with verification on, hashed as it lands."""
        spans = Spans(self.pool, None, j.dst)      # whole blocks; the ids were checked by _prepare
        if self.verify and j.h.checksums:
            host = spans.want_digests = self.pool.is_host
            if not host or spans.nbytes > HASH_AFTER:
                spans.verifier = StreamVerifier(self.pool, j.dst)
        return self._paced(spans, t)

    def _paced(self, spans: Spans, t: Optional[Transfer]) -> Spans:
        """``spans`` asking, between receives, ``t``'s cancel flag and whether the peer trickles."""
        spans.cancel = Paced(t.cancel_event if t is not None else None, spans.nbytes, self.timeout.transfer, MIN_RATE)
        return spans

    def _over_urls(self, h: KVHandle, op: Any, j: Optional[_Job] = None, failed: Optional[KVBridgeError] = None) -> Any:
        """Run ``op(transport, url)`` over the handle's URLs in order (the same sender).

        When no URL answers and the claim was to travel with the read, claim in the lease
        store now: a lease that is gone (the owner died and it expired) is final at once
        (re-prefill), instead of retrying a sender that will not come back. ``failed``: the
        first URL was already tried and raised it (go on with the next, if it did not answer)."""
        last: Optional[KVBridgeError] = None
        if failed is not None and not isinstance(failed, PeerUnavailable):
            raise failed
        for url in h.urls if failed is None else h.urls[1:]:
            try:
                return op(self.transport(url), url)
            except PeerUnavailable as exc:
                last = exc
        last = last or failed
        assert last is not None
        if j is not None and j.store is not None and j.claim is not None and j.claim.epoch == 0:
            j.claim = self._claim(j.store, j.h)      # a LeaseError here is final
        raise last

    def _read_whole(self, j: _Job, spans: Spans, failed: Optional[KVBridgeError] = None) -> None:
        """Read into ``spans`` under the retry policy; ``failed``: how the first try at the first
        URL (made already) failed."""
        h = j.h
        url = h.urls[0]
        j.res.attempts += 1
        _restart(spans)                           # fetch_many's pipelined try left it part-way
        if failed is None:
            try:      # the first try at the first URL, straight (nearly every read ends here)
                j.res.nbytes = int(self.transport(url).read(url, h, spans, j.idx, j.claim))
                return
            except KVBridgeError as exc:
                failed = exc

        def read(tr: Transport, url: str) -> int:
            return tr.read(url, h, spans, j.idx, j.claim)

        def attempt() -> int:
            nonlocal failed
            if cancelled():                       # during the retry's back-off
                raise TransferCancelled(f"fetch of {h.request_id!r} cancelled")
            if failed is not None:                # the rest of the first try: the other URLs
                exc, failed = failed, None
                return int(self._over_urls(h, read, j, exc))
            j.res.attempts += 1
            _restart(spans)                       # a new attempt restarts the stream
            return int(self._over_urls(h, read, j))
        j.res.nbytes = self.retry.call(attempt, self._on_read_retry)

    def _verify_whole(self, j: _Job, spans: Spans) -> None:
        """Compare the landed blocks with the handle's checksums; refetch bad ones once."""
        if not self.verify or not j.h.checksums:
            return
        want = j.h.checksums if j.idx is None else [j.h.checksums[i] for i in j.idx]
        v = spans.verifier
        if spans.digests is not None:             # the transport hashed each block as it landed
            got = spans.digests
        else:
            got = v.digests() if v is not None and v.complete else block_checksums(self.pool, j.dst)
        if len(got) == len(want) and all(map(int.__eq__, got, want)):
            return
        bad = [k for k, (a, b) in enumerate(zip(got, want)) if a != b]
        if not bad:
            return
        self.stats.add(refetches=1)
        sub_idx = [(j.idx[k] if j.idx is not None else k) for k in bad]
        sub_dst = [j.dst[k] for k in bad]
        self._over_urls(j.h, lambda tr, url: tr.read(url, j.h, self._paced(Spans.of_blocks(self.pool, sub_dst), None),
                                                      sub_idx, j.claim))
        again = block_checksums(self.pool, sub_dst)
        still = [bad[k] for k, g in enumerate(again) if g != want[bad[k]]]
        if still:
            self.stats.add(integrity_failures=1)
            j.res.failed_block_ids = [j.dst[k] for k in still]
            raise IntegrityError(f"{len(still)} block(s) of request {j.h.request_id!r} failed their checksum twice")

    def _move_layers(self, t: Optional[Transfer], j: _Job) -> None:
        """A layer-wise handle: read whatever layers are ready, verify them, announce them."""
        L = self.pool.layout.num_layers
        made: list[Spans] = []
        coded = FrameLoader(j.h.codec, self.pool, j.dst, j.h.layerwise) if j.h.codec != "raw" else None

        def spans_for(lo: int, hi: int, nbytes: int) -> Spans:
            if coded is not None:         # frames land in a staging buffer, then decode into the blocks
                s = coded.spans_for(lo, hi, nbytes)
            else:
                s = Spans.of_blocks(self.pool, j.dst, range(lo, hi))
            if self.verify and coded is None:
                s.verifier = StreamVerifier(self.pool, j.dst, range(lo, hi), per_layer=True)
            made.append(self._paced(s, t))
            return s

        def read(lo: int, hi: int) -> Chunk:
            def attempt() -> Chunk:
                if cancelled():                   # during the retry's back-off
                    raise TransferCancelled(f"fetch of {j.h.request_id!r} cancelled")
                j.res.attempts += 1
                return self._over_urls(j.h, lambda tr, url: tr.read_layers(  # type: ignore[no-any-return]
                    url, j.h, spans_for, lo, hi, j.idx, j.claim), j)
            return self.retry.call(attempt, self._on_read_retry)

        done = 0
        # layer-wise: the sender may take Timeout.transfer for each next layer (the prefill is
        # computing it); a handle published whole (coded: one frame, one reply) has one deadline
        idle_until = time.monotonic() + self.timeout.transfer
        while done < L:
            if t is not None and t.cancel_event.is_set():
                raise TransferCancelled(f"fetch of {j.h.request_id!r} cancelled at layer {done}")
            made.clear()
            asked = time.monotonic()
            chunk = read(done, L)
            if chunk.end == chunk.first:               # nothing ready yet: the sender waited, ask again
                now = time.monotonic()
                if now > idle_until:
                    raise TransferTimeout(f"layer {done} of {j.h.request_id!r} not ready within "
                                          f"{self.timeout.transfer} s")
                # an honest sender waits LAYER_WAIT before it answers "nothing yet"; one that
                # answers sooner is not asked again before then (no busy loop of READs)
                until = min(asked + LAYER_WAIT, idle_until)
                while now < until and not (t is not None and t.cancel_event.is_set()):
                    time.sleep(min(0.05, until - now))     # a cancel is seen within 50 ms
                    now = time.monotonic()
                continue
            bad = self._bad_layer_blocks(j, made[-1], chunk, coded)
            if bad:
                self.stats.add(refetches=1)
                made.clear()
                again = read(chunk.first, chunk.end)
                bad = (self._bad_layer_blocks(j, made[-1], again, coded) if again.end == chunk.end
                       else list(range(len(j.dst))))
                if bad:
                    self.stats.add(integrity_failures=1)
                    j.res.failed_block_ids = [j.dst[k] for k in bad]
                    why = f": {coded.last_error.message}" if coded is not None and coded.last_error is not None else ""
                    raise IntegrityError(f"{len(bad)} block(s) of request {j.h.request_id!r} failed the "
                                         f"checksum of layers [{chunk.first}, {chunk.end}) twice{why}")
            self._learn_claim(j, chunk.claim)
            j.res.nbytes += chunk.nbytes
            done = chunk.end
            if t is not None:
                t._layer_ready(done)
            if j.h.layerwise:
                idle_until = time.monotonic() + self.timeout.transfer

    def _learn_claim(self, j: _Job, claim: Optional[Claim]) -> None:
        """The sender claimed on our behalf: from now on reads carry that fence."""
        if claim is not None and j.claim is not None and j.claim.epoch == 0:
            if claim.claimer != self.claimer:
                raise ProtocolError("sender reports a claim for another claimer")
            j.claim = claim
            self.stats.add(claimed=1)

    def _bad_layer_blocks(self, j: _Job, spans: Spans, chunk: Chunk, coded: Optional[FrameLoader] = None) -> list[int]:
        """Positions (into ``j.dst``) with a layer whose checksum does not match; for coded
        frames, decode them (each frame's body hash checked first: all blocks, or none)."""
        if coded is not None:
            try:
                coded.decode(spans, chunk.first, chunk.end)
            except IntegrityError as exc:
                coded.last_error = exc            # named if the refetch fails too
                return list(range(len(j.dst)))
            return []
        if not self.verify or not chunk.sums:
            return []
        nb = len(j.dst)
        want = unpack_sums(chunk.sums)
        v = spans.verifier
        layers = range(chunk.first, chunk.end)
        got = v.digests() if v is not None and v.complete else layer_checksums(self.pool, j.dst, layers)
        return sorted({i % nb for i, (a, b) in enumerate(zip(got, want)) if a != b})

    def _settle(self, j: _Job) -> FetchResult:
        """Validate-after-read and the release, or abort; record stats. Where the transport and
        this clock already showed validate-after-read (:class:`~kvbridge.releases.AfterRead`),
        the release is lifecycle only and goes after the fetch returns (``release=False``:
        nothing to send); otherwise the release (or ``validate``) in the store is it."""
        res, h, c, store = j.res, j.h, j.claim, j.store
        if isinstance(res.error, Unvouched):          # the owner could not vouch: ask the store why
            served = res.error.claim
            if c is not None and c.epoch == 0 and served is not None and served.epoch:
                c = j.claim = served
            self._unvouched(j, c)
        if c is not None and c.epoch == 0:           # asked the sender to claim; never heard the fence
            c = j.claim = None
            if res.error is None:
                res.error = ProtocolError(f"sender of {h.request_id!r} served a leased read without its claim")
            elif store is not None and not isinstance(res.error, (LeaseError, BadHandle, AccessDenied)):
                try:                                  # it may have claimed: learn the fence to abort
                    lease = store.claim(h.lease_id, self.claimer, self.claim_ttl)
                    c = Claim(self.claimer, lease.fence.epoch, lease.fence.counter)
                except KVBridgeError:
                    c = None
        if res.error is None and self.pool.generations(j.dst) != j.gens:
            res.error = retired_during(h.request_id)
        if res.error is None and store is not None and c is not None:
            # A release succeeds only while the lease is claimed by us with this fence -- so
            # before the owner could have revoked it and freed the blocks.
            checked = self._checked_after_read(j, c)
            try:
                if j.release:
                    if isinstance(j.released, KVBridgeError):
                        raise j.released
                    if j.released is None and not (checked and self._releaser.submit(store, h.lease_id, c.fence)):
                        self.retry.call(lambda: store.release(h.lease_id, c.claimer, c.fence), self._on_retry)
                        self.stats.add(released=1)
                    elif j.released is not None:
                        self.stats.add(released=1)
                elif not checked:
                    self.retry.call(lambda: store.validate(h.lease_id, c.claimer, c.fence), self._on_retry)
            except KVBridgeError as exc:
                res.error = exc
                if isinstance(exc, LeaseError):
                    self.stats.add(stale_refused=1)
        if res.error is not None:
            if not res.failed_block_ids:
                res.failed_block_ids = list(j.dst)
            self.stats.add(failed=1, cancelled=int(isinstance(res.error, TransferCancelled)))
            # Abort only a genuine claim that failed; a refused (altered) handle or a lease we no
            # longer hold is not ours to end.
            if store is not None and c is not None and not isinstance(res.error, (LeaseError, BadHandle,
                                                                                  AccessDenied)):
                try:
                    store.abort(h.lease_id, c.claimer, c.fence)
                    self.stats.add(aborted=1)
                except KVBridgeError as exc:   # the owner still frees at expiry
                    log.warning("abort of lease %s failed: %s", h.lease_id, exc)
        else:
            res.ok = True
            if j.release and c is None:
                self.release(h, wait=False)
        if c is not None and c.epoch and (j.release or not res.ok):
            self._after.clock.forget(h.lease_id, c)
        res.seconds = time.perf_counter() - j.t0
        self.stats.fetched(res.ok, res.nbytes, res.seconds)
        return res

    def _checked_after_read(self, j: _Job, c: Claim) -> bool:
        """Whether validate-after-read already holds without the lease store (see AfterRead)."""
        return j.released is None and self._after.holds(j.h, j.since, c)   # else fetch_many's batch did it

    def _unvouched(self, j: _Job, c: Optional[Claim]) -> None:
        """The owner served the bytes but could not vouch for the lease after the last one left
        (it ended the handle, or the lease neared its TTL). The bytes are never used; the
        error reported is the lease store's answer where it refuses the claim."""
        store = j.store
        if store is None or c is None or not c.epoch:
            return
        try:
            self.retry.call(lambda: store.validate(j.h.lease_id, c.claimer, c.fence), self._on_retry)
        except KVBridgeError as exc:
            j.res.error = exc
            if isinstance(exc, LeaseError):
                self.stats.add(stale_refused=1)

    def _released_later(self, ok: int, failed: int) -> None:
        self.stats.add(released=ok, released_later=ok, release_failures=failed)

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
        return self._workers.submit(self._transfer(self._prepare(handle, dst_block_ids, indices, release)))

    def fetch(self, handle: HandleLike, dst_block_ids: Sequence[int], *,
              indices: Optional[Sequence[int]] = None, release: bool = True) -> FetchResult:
        """Move the handle's blocks into ``dst_block_ids`` on this thread; the result.

        The usual fetch -- a whole unleased raw handle whose transport moves (and hashes) its
        host blocks in one piece (:meth:`Transport.read_small`) -- runs here, without the
        pipeline's job, spans and stages; any other outcome than verified bytes on
        unchanged blocks goes on in :meth:`_pull` from where it stands."""
        h = handle
        pool = self.pool
        if (indices is not None or type(h) is not KVHandle or self.secret is not None
                or h.lease_id or h.reservation or h.layerwise or h.codec != "raw" or not h.urls
                or h.layout_hash != pool.layout.compat_hash or h.handle_id in self._released or self._closed):
            return self._pull(None, self._prepare(handle, dst_block_ids, indices, release))
        # the destination as the fetch begins: read_small and any fallback hold to these generations
        got_dst = dst_snapshot(dst_block_ids, pool.live_generations, len(h.block_ids))
        if got_dst is None:              # the pipeline's _check_dst says what is wrong with them
            return self._pull(None, self._prepare(handle, dst_block_ids, indices, release))
        dst, gens = got_dst
        url = h.urls[0]
        t0 = time.perf_counter()
        tr = self._by_url.get(url) or self.transport(url)
        try:
            got = tr.read_small(url, h, pool, dst, self.verify and bool(h.checksums), gens)
        except KVBridgeError as exc:
            return self._pull(None, self._job(h, dst, release, gens, t0), failed=exc)
        if got is None or got[1] is not None:
            # no fast path, or it could not vouch: the pipeline, held to `gens`; or a checksum
            # differs (`landed`): the pipeline refetches or refuses
            return self._pull(None, self._job(h, dst, release, gens, t0), landed=got)
        if release:
            try:
                tr.release(url, h, False)              # without a reply: it rides on a later request
            except KVBridgeError:
                self.release(h, wait=False)            # the other URLs, and the log line
            else:
                self._released.add(h.handle_id)
        seconds = time.perf_counter() - t0
        self.stats.fetched(True, got[0], seconds)
        return FetchResult(h, dst, True, got[0], seconds, 1)

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
        ts = [self._workers.submit(self._transfer(j)) for j in self._prepare_many(items, release)]
        try:
            return [await t for t in ts]
        except asyncio.CancelledError:
            for t in ts:
                t._stop()
            for t in ts:
                await t
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
        return self._desk.reserve(dst, request_id, num_tokens, self.reservation_ttl if ttl is None else ttl)

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
