"""The one exception tree of kvbridge.

Every error that leaves the public API is a :class:`KVBridgeError`. Backend
errors (``OSError``, redis-py, UCX, CuPy) are mapped at the boundary, never
leaked raw. Each class says what the caller should do through ``action``::

    KVBridgeError
    ├── RetryableError                 action=RETRY: the same call may succeed later
    │   ├── PeerUnavailable            cannot connect to the sender, or it went away
    │   │   └── ConnectionLost         an established connection broke mid-operation
    │   ├── TransferTimeout            a connect/transfer deadline passed
    │   └── LeaseStoreUnavailable      the lease server (Redis) cannot be reached
    └── FinalError                     retrying the same call cannot help
        ├── BadHandle                  malformed, truncated, forged or altered handle
        ├── LayoutMismatch             the two pools cannot exchange blocks (names fields)
        ├── IntegrityError             bytes failed their checksum   action=REFETCH
        ├── StaleHandle                blocks were freed or reused   action=REPREFILL
        │   ├── HandleNotFound         the sender has no such live handle
        │   ├── Unvouched              the sender served the bytes, could not vouch for the lease
        │   └── LeaseError             lease lifecycle refusals      action=REPREFILL
        │       ├── LeaseExpired       the lease TTL lapsed or the owner revoked it
        │       ├── LeaseNotFound      no such lease
        │       ├── LeaseConflict      another claimer holds the lease
        │       └── StaleFence         the caller's fence is no longer current
        ├── AccessDenied               wrong token or MAC for a handle
        ├── ProtocolError              malformed frame, wrong version
        │   └── FrameTooLarge          a frame over the size cap
        ├── PoolError                  bad block ids, out of blocks, double free
        ├── BackendUnavailable         a transport needs an extra that is not installed
        ├── ConfigError                invalid URL or option
        └── TransferCancelled          the caller cancelled the transfer  action=REPREFILL
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .lease.base import Claim

__all__ = [
    "Action", "KVBridgeError", "RetryableError", "FinalError", "PeerUnavailable",
    "ConnectionLost", "TransferTimeout", "LeaseStoreUnavailable", "BadHandle",
    "LayoutMismatch", "IntegrityError", "StaleHandle", "HandleNotFound", "LeaseError",
    "LeaseExpired", "LeaseNotFound", "LeaseConflict", "StaleFence", "AccessDenied",
    "ProtocolError", "FrameTooLarge", "PoolError", "BackendUnavailable", "ConfigError", "TransferCancelled",
    "Unvouched",
    "ERROR_CODES", "error_from_code",
]


class Action(str, enum.Enum):
    """What a caller should do after an error."""

    RETRY = "retry"          # same call again, with backoff, within the deadline
    REFETCH = "refetch"      # fetch the same handle again (once)
    REPREFILL = "reprefill"  # the KV is gone: recompute it
    FIX = "fix"              # a programming or configuration error: change the call


class KVBridgeError(Exception):
    """Base of every kvbridge error."""

    action: Action = Action.FIX
    code: int = 1
    hint: str = ""

    def __init__(self, message: str = "", *, hint: Optional[str] = None) -> None:
        self.message = message or self.__class__.__doc__ or self.__class__.__name__
        if hint is not None:
            self.hint = hint
        text = self.message if not self.hint else f"{self.message} ({self.hint})"
        super().__init__(text)

    @property
    def retryable(self) -> bool:
        return self.action is Action.RETRY


class RetryableError(KVBridgeError):
    """A transient failure: the same call may succeed later."""

    action = Action.RETRY
    code = 10


class PeerUnavailable(RetryableError):
    """The peer cannot be reached."""

    code = 11
    hint = "check that the sender is running and its URL is reachable; retry with backoff"


class ConnectionLost(PeerUnavailable):
    """The connection to the peer broke during an operation."""

    code = 12


class TransferTimeout(RetryableError):
    """A deadline passed before the operation finished."""

    code = 13
    hint = "raise Timeout(transfer=...) or check the peer's load"


class LeaseStoreUnavailable(RetryableError):
    """The lease server cannot be reached."""

    code = 14
    hint = "check the Redis URL and that the server is up"


class FinalError(KVBridgeError):
    """Retrying the same call cannot help."""

    action = Action.FIX
    code = 20


class BadHandle(FinalError):
    """The handle is malformed, truncated, forged or altered."""

    code = 21
    hint = "pass the handle exactly as the sender produced it"


class LayoutMismatch(FinalError):
    """The two pools' layouts cannot exchange blocks."""

    code = 22
    hint = "both sides must use the same model geometry, dtype, token order and TP slice"


class IntegrityError(FinalError):
    """Fetched bytes failed their checksum."""

    action = Action.REFETCH
    code = 23
    hint = "refetch once; if it fails again, re-prefill"


class StaleHandle(FinalError):
    """The handle's blocks were freed or reused: its KV is gone."""

    action = Action.REPREFILL
    code = 24
    hint = "re-prefill the request"


class HandleNotFound(StaleHandle):
    """The sender has no live handle with this id."""

    code = 25


class Unvouched(StaleHandle):
    """The sender served the bytes but, once the last one had left, could not vouch for the
    handle's lease: it had ended the handle, or the lease was near its TTL. The bytes are not
    used. A receiver reports the lease store's refusal instead where there is one; this error
    means the store still had the claim (the receiver then aborts it). ``claim``: the claim
    the read was served under."""

    code = 35

    def __init__(self, message: str = "", claim: Optional["Claim"] = None, *, hint: Optional[str] = None) -> None:
        super().__init__(message, hint=hint)
        self.claim = claim


class LeaseError(StaleHandle):
    """A lease refused the operation."""

    code = 30


class LeaseExpired(LeaseError):
    """The lease expired or was revoked by its owner."""

    code = 31


class LeaseNotFound(LeaseError):
    """No such lease exists."""

    code = 32


class LeaseConflict(LeaseError):
    """Another claimer holds the lease."""

    code = 33


class StaleFence(LeaseError):
    """The caller's fencing token is no longer current."""

    code = 34


class AccessDenied(FinalError):
    """The peer presented a wrong token or MAC."""

    code = 26
    hint = "use the handle the sender issued, unmodified, with the right shared secret"


class ProtocolError(FinalError):
    """A malformed or unsupported wire frame."""

    code = 27
    hint = "both sides must run compatible kvbridge versions"


class FrameTooLarge(ProtocolError):
    """A frame larger than the configured cap."""

    code = 28


class PoolError(FinalError):
    """Invalid block ids, an exhausted pool, a double free, or destination blocks that another
    fetch or reservation in progress into the pool is writing (the caller's to fix: name other
    blocks, or wait for that one to end)."""

    code = 29


class BackendUnavailable(FinalError):
    """A transport or codec needs an optional dependency that is not installed."""

    code = 40


class ConfigError(FinalError):
    """An invalid URL or option."""

    code = 41


class TransferCancelled(FinalError):
    """The transfer was cancelled; no more bytes of it will land."""

    action = Action.REPREFILL
    code = 42
    hint = "the destination blocks hold no usable KV; fetch again or re-prefill if still needed"


def _all_subclasses(cls: type[KVBridgeError]) -> list[type[KVBridgeError]]:
    out: list[type[KVBridgeError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERROR_CODES: dict[int, type[KVBridgeError]] = {c.code: c for c in _all_subclasses(KVBridgeError)}


def error_from_code(code: int, message: str) -> KVBridgeError:
    """Rebuild an error received from a peer (wire error replies carry code + message)."""
    cls = ERROR_CODES.get(code, ProtocolError)
    return cls(message)
