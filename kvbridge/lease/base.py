"""Lease records and the abstract :class:`LeaseStore` (see ``docs/LEASES.md``).

Clock assumptions
-----------------
* Every TTL is kept by the lease server (Redis): the lease expiry and the claim
  expiry are absolute times on the *server's* clock (``TIME`` inside the Lua
  scripts, ``PEXPIREAT`` on the lease hash). No decision about whether a lease
  or a claim is alive is ever taken on a client clock.
* A claim never outlives its lease: the claim expiry is capped at the lease
  expiry, and only the owner extends the lease. So the owner always knows the
  latest moment at which any claimer's ``validate`` can still succeed.
* An owner that cannot reach the server frees its blocks only after its *local
  deadline*: the monotonic time taken just **after** the publish or renew call's
  answer arrived, plus the TTL stretched by a clock-rate margin, plus a fixed margin
  (:func:`owner_deadline`). The server set its expiry (its own clock at the script,
  plus the TTL) before that answer, however long the call waited in queues, so its
  expiry is earlier than the local deadline as long as the two clocks' rates
  differ by less than ``rate_margin``. Any validate after that point reaches the
  server, where the lease has expired or been lost: freeing is safe (invariant 1).
* A TTL is certainly still running, by a client's clock, until :func:`holds_until`: the
  monotonic time taken before the call that set it, plus the TTL shrunk by the rate
  margin, less a fixed margin. An owner vouches for its lease with it after serving a read,
  a claimer for its claim before it skips the validate-after-read round trip
  (``docs/LEASES.md``).
* Fences are ``(epoch, counter)``: the epoch is random per server dataset, so a
  server restart that lost its data never repeats a fence (invariant 4).
"""

from __future__ import annotations

import abc
import enum
import threading
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import ClassVar, List, NamedTuple, Optional, Sequence, TypeVar

__all__ = [
    "LeaseState", "Fence", "Lease", "LeaseEvent", "LeaseStats", "LeaseStore",
    "owner_deadline", "holds_until", "EVENT_KINDS", "Claim",
]

U64_MAX = (1 << 64) - 1
_S = TypeVar("_S", bound="LeaseStore")
EVENT_KINDS = ("released", "aborted", "expired", "revoked")


class LeaseState(str, enum.Enum):
    """The state of a live (or just finished) lease, as the server sees it now."""

    PUBLISHED = "published"  # claimable (also after a claim lapsed)
    CLAIMED = "claimed"      # held by a live claimer
    RELEASED = "released"    # the claimer is done: the owner frees
    ABORTED = "aborted"      # the claimer gave up: the owner frees


@dataclass(frozen=True, order=True)
class Fence:
    """A fencing token: ``(epoch, counter)``, both u64. Never repeats."""

    epoch: int
    counter: int
    ZERO: ClassVar["Fence"]

    def __post_init__(self) -> None:
        for name in ("epoch", "counter"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= U64_MAX:
                raise ValueError(f"Fence.{name} must be an int in [0, 2**64): {v!r}")

    def __str__(self) -> str:
        return f"{self.epoch:x}:{self.counter}"

    @classmethod
    def parse(cls, text: str) -> "Fence":
        """Inverse of ``str(fence)``."""
        epoch, _, counter = text.partition(":")
        return cls(int(epoch, 16), int(counter))


Fence.ZERO = Fence(0, 0)


class Claim(NamedTuple):
    """A claimer's hold on a lease: who, and under which fence. Reads of a leased handle
    (and writes into a leased reservation) carry it; :meth:`KVReceiver.claim` returns it."""

    claimer: str
    epoch: int
    counter: int

    @property
    def fence(self) -> "Fence":
        return Fence(self.epoch, self.counter)


@dataclass
class Lease:
    """A snapshot of one lease. ``ttl_ms_left``: lease TTL; ``claim_ms_left``: claim TTL.
    ``ref``: the lease's public name (:meth:`LeaseStore.ref`); ``lease_id`` is empty in
    :meth:`LeaseStore.list`, which sees only refs."""

    lease_id: str
    owner: str
    state: LeaseState
    fence: Fence
    claimer: Optional[str]
    ttl_ms_left: int
    num_blocks: int
    meta: dict[str, str] = field(default_factory=dict)
    claim_ms_left: int = 0
    ref: str = ""


@dataclass(frozen=True)
class LeaseEvent:
    """A notification to an owner: ``kind`` is one of :data:`EVENT_KINDS`; ``ref`` names the
    lease as :meth:`LeaseStore.ref` does (an event never carries the lease id)."""

    kind: str
    ref: str


@dataclass
class LeaseStats:
    """Per-store counters: successful calls (idempotent repeats count again) and refusals."""

    published: int = 0
    claimed: int = 0
    released: int = 0
    aborted: int = 0
    revoked: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def owner_deadline(answered_at: float, ttl_s: float, *, margin_s: float = 1.0,
                   rate_margin: float = 0.01) -> float:
    """The owner's local (``time.monotonic()``) deadline for a lease.

    ``answered_at`` is ``time.monotonic()`` taken *after* the publish/renew call's answer
    arrived: the server started the TTL before then (taken before the call was sent instead,
    a call that waited in a stalled server started its TTL later than the owner counted, and
    the owner freed blocks whose lease the server still honoured). Past the returned time the
    server has certainly expired the lease, so an owner cut off from the server may free the
    blocks. Keep the maximum over renewals.
    """
    return answered_at + ttl_s * (1.0 + rate_margin) + margin_s


def holds_until(sent_at: float, ttl_s: float, *, margin_s: float = 1.0, rate_margin: float = 0.01) -> float:
    """The local (``time.monotonic()``) time until which a TTL is certainly still running.

    The lower-bound twin of :func:`owner_deadline`: ``sent_at`` is ``time.monotonic()`` taken
    *before* the call that set (or extended) the TTL was sent, so the server started the TTL
    after it. Before the returned time -- the TTL shrunk by the clock-rate margin, less
    ``margin_s`` -- the server cannot have ended it, as long as the two clocks' rates differ
    by less than ``rate_margin``; ``margin_s`` leaves room for what must still happen under it
    (the last bytes landing, a release reaching the server)."""
    return sent_at + ttl_s * (1.0 - rate_margin) - margin_s


class LeaseStore(abc.ABC):
    """The lifecycle authority for published KV handles.

    Blocking methods and awaitable twins (prefix ``a``). Errors are from
    :mod:`kvbridge.errors`: ``LeaseExpired``, ``LeaseNotFound``, ``LeaseConflict``,
    ``StaleFence`` (final) and ``LeaseStoreUnavailable`` (retryable).
    """

    def __init__(self) -> None:
        self.stats = LeaseStats()
        self._stats_lock = threading.Lock()

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def ref(self, lease_id: str) -> str:
        """The lease's public name, as events and :meth:`list` give it: a one-way function of
        the lease id, so whoever sees refs (or the server's key names) cannot name the lease."""
        return lease_id

    # -- owner side --------------------------------------------------------
    @abc.abstractmethod
    def publish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int = 0,
                meta: Optional[dict[str, str]] = None) -> Lease:
        """Create a lease in PUBLISHED with a new fence; ``LeaseConflict`` if the id exists."""

    @abc.abstractmethod
    def revoke(self, lease_id: str, owner: str) -> Optional[LeaseState]:
        """End the lease before freeing its blocks; returns the state it had (None: gone)."""

    @abc.abstractmethod
    def events(self, owner: str, timeout_s: float = 0.0) -> list[LeaseEvent]:
        """Events for ``owner`` since the last call, waiting at most ``timeout_s``."""

    @abc.abstractmethod
    def sweep(self, owner: str, lease_ids: Sequence[str]) -> dict[str, Optional[LeaseState]]:
        """States of the owner's leases in one round trip (None: gone, expired or revoked)."""

    # -- claimer side ------------------------------------------------------
    @abc.abstractmethod
    def claim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> Lease:
        """Claim the lease; idempotent for the current claimer (same fence)."""

    @abc.abstractmethod
    def validate(self, lease_id: str, claimer: str, fence: Fence) -> None:
        """Raise unless the lease is alive and claimed by ``claimer`` with ``fence``."""

    @abc.abstractmethod
    def release(self, lease_id: str, claimer: str, fence: Fence) -> None:
        """The claimer is done; idempotent for the right claimer and fence."""

    @abc.abstractmethod
    def abort(self, lease_id: str, claimer: str, fence: Fence) -> None:
        """The claimer gives up; idempotent for the right claimer and fence."""

    # -- both --------------------------------------------------------------
    @abc.abstractmethod
    def renew(self, lease_id: str, who: str, ttl_s: float, fence: Optional[Fence] = None) -> Lease:
        """Owner (no fence): extend the lease. Claimer (fence): extend the claim, up to the lease."""

    @abc.abstractmethod
    def get(self, lease_id: str) -> Optional[Lease]:
        """The lease now, or None if gone."""

    @abc.abstractmethod
    def list(self, owner: Optional[str] = None) -> list[Lease]:
        """Live and just-finished leases, optionally of one owner (for operators)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (blocking side)."""

    # -- awaitable twins ---------------------------------------------------
    @abc.abstractmethod
    async def apublish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int = 0,
                       meta: Optional[dict[str, str]] = None) -> Lease: ...

    @abc.abstractmethod
    async def arevoke(self, lease_id: str, owner: str) -> Optional[LeaseState]: ...

    @abc.abstractmethod
    async def aevents(self, owner: str, timeout_s: float = 0.0) -> List[LeaseEvent]: ...

    @abc.abstractmethod
    async def asweep(self, owner: str,
                     lease_ids: Sequence[str]) -> dict[str, Optional[LeaseState]]: ...

    @abc.abstractmethod
    async def aclaim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> Lease: ...

    @abc.abstractmethod
    async def avalidate(self, lease_id: str, claimer: str, fence: Fence) -> None: ...

    @abc.abstractmethod
    async def arelease(self, lease_id: str, claimer: str, fence: Fence) -> None: ...

    @abc.abstractmethod
    async def aabort(self, lease_id: str, claimer: str, fence: Fence) -> None: ...

    @abc.abstractmethod
    async def arenew(self, lease_id: str, who: str, ttl_s: float,
                     fence: Optional[Fence] = None) -> Lease: ...

    @abc.abstractmethod
    async def aget(self, lease_id: str) -> Optional[Lease]: ...

    @abc.abstractmethod
    async def alist(self, owner: Optional[str] = None) -> List[Lease]: ...

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections (both sides)."""

    # -- context managers --------------------------------------------------
    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, et: Optional[type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    async def __aenter__(self: _S) -> _S:
        return self

    async def __aexit__(self, et: Optional[type[BaseException]], ev: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        await self.aclose()
