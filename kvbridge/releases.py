"""A receiver's lease bookkeeping around its fetches: whether validate-after-read already
holds without the lease store (:class:`AfterRead`, with :class:`ClaimClock`: how long the
receiver's own claims certainly hold), releases sent after the fetch has returned
(:class:`Releaser`), and ``fetch_many``'s claims and releases batched per store.

A release is the claimer's "done": the owner frees the blocks when it hears of it. When the
fetch's validate-after-read already holds without the lease store (``docs/LEASES.md``:
the owner's trailer or the reader's re-check, plus a claim that certainly holds), the
release is lifecycle only: it may arrive later, and if it never does the owner still frees
at the claim's expiry. It must still arrive while the claim holds -- a claim that lapsed
goes back to PUBLISHED, where another claimer could take it -- which is what the receiver's
clock margin leaves time for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .errors import KVBridgeError
from .handle import KVHandle
from .lease import Claim, Fence, Lease, LeaseStore, holds_until
from .logs import RateLimitedLog
from .policy import Retry

if TYPE_CHECKING:
    from .receiver import KVReceiver, _Job

__all__ = ["AfterRead", "ClaimClock", "Recent", "Releaser", "claim_batch", "release_batch"]

log = logging.getLogger("kvbridge.receiver")
_limited = RateLimitedLog(log)
MAX_PENDING = 1024    # releases waiting to be sent; past it a fetch releases on its own thread
LINGER = 0.001        # seconds the sender thread waits for more releases to share one round trip
CLOSE_FLUSH = 5.0     # seconds close() waits for pending releases to be sent
MAX_CLAIM_TTL = 3600.0   # the longest claim a sender makes for a CLAIM_ME read


class ClaimClock:
    """Until when (``time.monotonic()``) each claim this receiver made certainly holds, from
    the claim's own reply: its ``claim_ms_left`` counts from the moment the script ran, which
    is after ``sent_at``, and is capped at the lease's expiry by the server. Keyed by lease and
    fence; only the latest ``limit`` claims are kept."""

    def __init__(self, margin_s: float, limit: int = 4096) -> None:
        self.margin_s = margin_s
        self.limit = limit
        self._until: OrderedDict[tuple[str, int, int], float] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, lease_id: str, lease: Lease, sent_at: float) -> None:
        """Record the reply ``lease`` of a claim sent at ``sent_at`` (monotonic)."""
        key = (lease_id, lease.fence.epoch, lease.fence.counter)
        until = holds_until(sent_at, lease.claim_ms_left / 1000.0, margin_s=self.margin_s)
        with self._lock:
            self._until[key] = max(until, self._until.get(key, until))   # a fence's claim only grows
            self._until.move_to_end(key)
            while len(self._until) > self.limit:
                self._until.popitem(last=False)

    def until(self, lease_id: str, claim: Claim) -> Optional[float]:
        with self._lock:
            return self._until.get((lease_id, claim.epoch, claim.counter))

    def forget(self, lease_id: str, claim: Claim) -> None:
        with self._lock:
            self._until.pop((lease_id, claim.epoch, claim.counter), None)


class AfterRead:
    """Whether a fetch's validate-after-read already holds without asking the lease store.

    The bytes: every transport the handle may have been read through validated each read
    after its last byte -- the owner's trailer (tcp, ucx), its check after the copy (inproc),
    or the reader's re-check of generations and the live-handle table (shm) -- and refused the
    read otherwise (StaleHandle, or ``Unvouched`` when only the lease was in doubt). An owner
    ends a handle there before it revokes or frees anything, and only the claimer releases or
    aborts it, so the handle had not been ended when the last byte left.

    The claim: it certainly holds now, ``margin_s`` before it could lapse, by this clock --
    from the claim's own reply when the receiver claimed itself (:class:`ClaimClock`; the
    server caps a claim at the lease's expiry), else from ``since`` (taken before the read
    that carried the claim was sent) plus the claim TTL asked for, the owner's trailer
    having vouched that the lease was within its TTL. A claim that lapsed could have been
    taken by another claimer; one capped at the lease ends with it. The margin is the time
    the release has to land before the claim could lapse.

    Transports say what they do with two class attributes: ``validates_after_read`` (the
    bytes and the handle) and ``vouches_lease_ttl`` (the owner's check of its lease's TTL).
    """

    def __init__(self, transport: Callable[[str], Any], claim_ttl: float, margin_s: float) -> None:
        self.transport = transport
        self.claim_ttl = min(claim_ttl, MAX_CLAIM_TTL)
        self.margin_s = margin_s
        self.clock = ClaimClock(margin_s)
        self._kinds: dict[str, tuple[bool, bool]] = {}

    def kind(self, url: str) -> tuple[bool, bool]:
        """(validates_after_read, vouches_lease_ttl) of the transport serving ``url``."""
        got = self._kinds.get(url)
        if got is None:
            try:
                cls = type(self.transport(url))
                got = (bool(getattr(cls, "validates_after_read", False)),
                       bool(getattr(cls, "vouches_lease_ttl", False)))
            except KVBridgeError:                 # a backend not installed here vouches for nothing
                got = (False, False)
            self._kinds[url] = got
        return got

    def holds(self, h: KVHandle, since: float, claim: Claim) -> bool:
        kinds = [self.kind(u) for u in h.urls]
        if not kinds or not all(validates for validates, _ in kinds):
            return False
        until = self.clock.until(h.lease_id, claim)
        if until is None and all(ttl for _, ttl in kinds):
            until = holds_until(since, self.claim_ttl, margin_s=self.margin_s)
        return until is not None and time.monotonic() < until


class Recent:
    """The handle ids this receiver released lately: at least the latest ``keep // 2``, at most
    ``keep``. Two plain dicts, the newer one filled until it holds ``keep // 2`` and then made
    the older one, the oldest ids dropped with it at once: an insert is one dict store (an
    OrderedDict insert plus the eviction of its oldest entry touched several times as many
    cache lines, which a fetch after a large copy finds all evicted)."""

    __slots__ = ("_new", "_old", "_half", "_lock")

    def __init__(self, keep: int) -> None:
        self._new: dict[bytes, None] = {}
        self._old: dict[bytes, None] = {}
        self._half = max(1, keep // 2)
        self._lock = threading.Lock()

    def __contains__(self, handle_id: bytes) -> bool:
        return handle_id in self._new or handle_id in self._old

    def add(self, handle_id: bytes) -> None:
        new = self._new
        new[handle_id] = None
        if len(new) >= self._half:
            with self._lock:            # two threads turning over at once would drop a generation
                if self._new is new:
                    self._old, self._new = new, {}


class Releaser:
    """Sends releases on one background thread: a bounded queue, drained in batches, one
    pipelined round trip per store (``release_many`` where the store has it). ``submit``
    says False when the queue is full or closed: the caller then releases itself.
    ``on_done(ok, failed)`` counts outcomes; failures are logged, rate-limited (the owner
    frees at the claim's expiry anyway)."""

    def __init__(self, claimer: str, retry: Retry, on_done: Optional[Callable[[int, int], None]] = None,
                 limit: int = MAX_PENDING) -> None:
        self.claimer = claimer
        self.retry = retry
        self.on_done = on_done
        self.limit = limit
        self._queue: deque[tuple[LeaseStore, str, Fence]] = deque()
        self._sent: dict[str, int] = {}   # lease ids submitted, not yet answered (a count each)
        self._busy = 0                 # releases taken off the queue, not yet answered
        self._hurry = 0                # flushes waiting: send without lingering
        self._cv = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy

    def releasing(self, lease_id: str) -> bool:
        """Whether a release of ``lease_id`` was submitted and the store has not answered it
        yet: the lease is this receiver's to end, and ended as far as its fetches go."""
        return lease_id in self._sent

    def submit(self, store: LeaseStore, lease_id: str, fence: Fence) -> bool:
        with self._cv:
            if self._closed or len(self._queue) >= self.limit:
                return False
            self._queue.append((store, lease_id, fence))
            self._sent[lease_id] = self._sent.get(lease_id, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvb-release", daemon=True)
                self._thread.start()
            if len(self._queue) == 1:
                # only the thread's wait for a first release needs waking; while it lingers for
                # more, a wake-up per release would cost each fetch a futex wake and a GIL handoff
                self._cv.notify_all()
        return True

    def flush(self, timeout: float = CLOSE_FLUSH) -> bool:
        """Wait (bounded) until every release submitted so far has been answered."""
        end = time.monotonic() + timeout
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
            try:
                while self._queue or self._busy:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)
            finally:
                self._hurry -= 1
        return True

    def close(self, timeout: float = CLOSE_FLUSH) -> None:
        """Send what is pending (bounded by ``timeout``), then stop the thread."""
        if not self.flush(timeout):
            _limited.log(logging.WARNING, "close", "%d lease release(s) not sent before close; their owners "
                         "free at the claims' expiry", self.pending)
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._sent.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                # let the releases of the next fetches join in, unless a flush waits
                self._cv.wait_for(lambda: self._hurry > 0 or self._closed, LINGER)
                if self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._busy = len(batch)
            try:
                self._send(batch)
            except Exception:                      # never let the sender thread die silently
                log.exception("lease release thread")
            with self._cv:
                self._busy = 0
                for _, lease_id, _ in batch:
                    n = self._sent.pop(lease_id, 1) - 1
                    if n > 0:
                        self._sent[lease_id] = n
                self._cv.notify_all()

    def _send(self, batch: list[tuple[LeaseStore, str, Fence]]) -> None:
        by_store: dict[int, tuple[LeaseStore, list[tuple[str, Fence]]]] = {}
        for store, lease_id, fence in batch:
            by_store.setdefault(id(store), (store, []))[1].append((lease_id, fence))
        for store, items in by_store.values():
            got = self._release(store, items)
            bad = [(lid, r) for (lid, _), r in zip(items, got) if isinstance(r, KVBridgeError)]
            for lid, r in bad:
                _limited.log(logging.WARNING, f"release {type(r).__name__}", "release of lease %s after the "
                             "fetch failed: %s (its owner frees at the claim's expiry)", lid, r)
            if self.on_done is not None:
                self.on_done(len(items) - len(bad), len(bad))

    def _release(self, store: LeaseStore, items: Sequence[tuple[str, Fence]]) -> list[Any]:
        many = getattr(store, "release_many", None)
        try:
            if many is not None and len(items) > 1:
                return list(self.retry.call(lambda: many(self.claimer, items)))
        except KVBridgeError as exc:
            return [exc] * len(items)
        out: list[Any] = []
        for lease_id, fence in items:
            try:
                self.retry.call(lambda: store.release(lease_id, self.claimer, fence))
                out.append(None)
            except KVBridgeError as exc:
                out.append(exc)
        return out


def claim_batch(r: "KVReceiver", jobs: list["_Job"]) -> None:
    """``fetch_many``'s claims: one pipelined round trip per lease store."""
    by_store: dict[int, list["_Job"]] = {}
    for j in jobs:
        if j.res.error is None:
            try:
                r._not_consumed(j)
            except KVBridgeError as exc:
                j.res.error = exc
                continue
        if j.store is not None and j.res.error is None:
            by_store.setdefault(id(j.store), []).append(j)
    for js in by_store.values():
        store = js[0].store
        assert store is not None
        many = getattr(store, "claim_many", None)
        sent = time.monotonic()
        try:
            if many is None:
                got: list[Any] = [r._claim(store, j.h) for j in js]
            else:
                got = r.retry.call(lambda: many(r.claimer, [j.h.lease_id for j in js], r.claim_ttl), r._on_retry)
        except KVBridgeError as exc:
            for j in js:
                j.res.error = exc
            continue
        for j, lease in zip(js, got):
            if isinstance(lease, KVBridgeError):
                j.res.error = lease
            elif isinstance(lease, Claim):
                j.claim = lease
            else:
                j.claim = Claim(r.claimer, lease.fence.epoch, lease.fence.counter)
                r._after.clock.note(j.h.lease_id, lease, sent)
                r.stats.add(claimed=1)


def release_batch(r: "KVReceiver", jobs: list["_Job"]) -> None:
    """``fetch_many``'s releases that must be its validates-after-read (those that
    :meth:`AfterRead.holds` for release after the fetch): one pipelined round trip per store."""
    by_store: dict[int, list["_Job"]] = {}
    for j in jobs:
        c = j.claim
        if (j.res.error is None and j.release and j.store is not None and c is not None and c.epoch
                and not r._checked_after_read(j, c)):
            by_store.setdefault(id(j.store), []).append(j)
    for js in by_store.values():
        many = getattr(js[0].store, "release_many", None)
        if many is None or len(js) < 2:
            continue                                   # released one by one in _settle
        items = [(j.h.lease_id, c.fence) for j in js if (c := j.claim) is not None]
        try:
            got = r.retry.call(lambda: many(r.claimer, items), r._on_retry)
        except KVBridgeError as exc:
            got = [exc] * len(js)
        for j, out in zip(js, got):
            j.released = out if isinstance(out, KVBridgeError) else True
