"""The pipeline every fetch runs (the base of :class:`~kvbridge.receiver.KVReceiver`):
claim -> move -> verify -> release. A :class:`_Job` is one pull in progress;
:meth:`ReceiverPipeline._pull` moves it -- a whole handle in one read under the retry policy,
a layer-wise or coded one layer range by layer range as the sender makes layers ready --
verifies what landed against the handle's checksums (refetching bad blocks once), and
:meth:`ReceiverPipeline._settle` ends it: validate-after-read and the release, or the abort.
The public faces (``fetch``, ``start_fetch``, ``afetch``, ``fetch_many``) are in
:mod:`.receiver`."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from .errors import (AccessDenied, BadHandle, HandleNotFound, IntegrityError, KVBridgeError, LeaseError,
                     LeaseExpired, PeerUnavailable, ProtocolError, TransferCancelled, TransferTimeout, Unvouched)
from .frames import FrameLoader
from .handle import KVHandle
from .integrity import StreamVerifier, block_checksums, layer_checksums, unpack_sums
from .lease import Claim, LeaseStore
from .metrics import ReceiverStats
from .policy import Retry, Timeout
from .pool import KVPool, retired_during
from .releases import AfterRead, Recent, Releaser
from .sender_serving import LAYER_WAIT
from .transfer import FetchResult, Paced, Transfer
from .transports.base import Chunk, Spans, Transport
from .transports.deadline import cancelled
from .transports.socket_server import MIN_RATE
from .transports.wire import CLAIM_ME

__all__ = ["ReceiverPipeline"]

log = logging.getLogger("kvbridge.receiver")
# Transfers up to this many bytes are hashed once they have landed (still in cache), not as
# they land: for a few blocks, following the stream costs more than the hashing (host pools;
# a device pool is hashed in the host slot its bytes pass through, never read back).
HASH_AFTER = 256 << 10


# A lease the sender claimed inside the read (CLAIM_ME) is released through that sender, which
# makes the release in the store itself (CRELEASES); False: this receiver releases in the store.
RELEASE_VIA_SENDER = True


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
    owner_claimed: bool = False   # the sender made `claim` inside the read (CLAIM_ME) ...
    served_by: str = ""           # ... at this URL (its claimed release goes there)
    released: Any = None          # fetch_many: the outcome of this job's release, sent in one batch
    since: float = field(default_factory=time.monotonic)   # before any claim of this fetch was sent


def _restart(spans: Spans) -> None:
    """A read into ``spans`` starts over: from the stream's first byte, on a fresh clock."""
    if spans.verifier is not None and spans.verifier.started:
        spans.verifier.reset()
    spans.digests = None
    if isinstance(spans.cancel, Paced):
        spans.cancel.restart()


class ReceiverPipeline:
    """Claim, move, verify and release one :class:`_Job`. The state below is set up by
    :meth:`KVReceiver.__init__ <kvbridge.receiver.KVReceiver>`, which documents it."""

    pool: KVPool
    claimer: str
    claim_ttl: float
    retry: Retry
    timeout: Timeout
    verify: bool
    stats: ReceiverStats
    _after: AfterRead
    _releaser: Releaser
    _released: Recent
    _lock: threading.Lock

    if TYPE_CHECKING:      # the public class's, used by the pipeline
        def transport(self, url: str) -> Transport: ...
        def release(self, handle: KVHandle, wait: bool = True) -> bool: ...

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
        if self._releaser.releasing(h.lease_id) or h.handle_id in self._released:   # the latter: by its sender
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
                j.served_by = url
                return
            except KVBridgeError as exc:
                failed = exc

        def read(tr: Transport, url: str) -> int:
            n = tr.read(url, h, spans, j.idx, j.claim)
            j.served_by = url
            return n

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
            j.owner_claimed = True
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
                    if j.released is None and not (checked and (self._release_by_owner(j, c)
                                                                or self._releaser.submit(store, h.lease_id, c.fence))):
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

    def _release_by_owner(self, j: _Job, c: Claim) -> bool:
        """A lifecycle-only release of a lease the sender claimed inside the read: handed to
        that sender, which makes it in the store for its own claim (no round trip of this
        receiver's to the store, and none for the sender's event of it); riding on a later
        request to it, or alone after a linger. False where the transport cannot."""
        url = j.served_by
        if not (j.owner_claimed and url and RELEASE_VIA_SENDER):
            return False
        try:                  # to the URL that served the read: the one known to answer
            if not self.transport(url).release_claimed(url, j.h, c):
                return False
        except KVBridgeError:
            return False
        self._released.add(j.h.handle_id)          # refused here from now on, as the store will
        self.stats.add(released=1, released_later=1)
        return True

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
