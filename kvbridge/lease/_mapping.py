"""Mapping at the boundary: redis-py errors and script refusal codes to :mod:`kvbridge.errors`."""

from __future__ import annotations

import urllib.parse
from typing import Any, Sequence

from redis import exceptions as rx

from ..errors import (ConfigError, KVBridgeError, LeaseConflict, LeaseError, LeaseExpired,
                      LeaseNotFound, LeaseStoreUnavailable, StaleFence)
from .base import LeaseState

__all__ = ["STATES", "redact", "map_redis_error", "refusal"]

STATES = {"P": LeaseState.PUBLISHED, "C": LeaseState.CLAIMED,
          "R": LeaseState.RELEASED, "A": LeaseState.ABORTED}
_UNAVAILABLE = (rx.ConnectionError, rx.TimeoutError, rx.ReadOnlyError, rx.OutOfMemoryError,
                rx.TryAgainError, rx.ClusterDownError)
# Replies redis-py leaves as a plain ResponseError that say "not now", not "never": the server
# is running someone's long script (BUSY; BUSYKEY is another error).
_BUSY = "BUSY "
_ACCESS = (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)


def redact(url: str) -> str:
    """The URL without its password."""
    p = urllib.parse.urlsplit(url)
    if p.password is None:
        return url
    netloc = f"{p.username or ''}:***@{p.hostname or ''}" + (f":{p.port}" if p.port else "")
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


def map_redis_error(exc: BaseException, url: str) -> KVBridgeError:
    """Map a redis-py (or socket) error to the kvbridge tree."""
    where = redact(url)
    if isinstance(exc, _ACCESS):
        return ConfigError(f"lease server {where} refused access: {exc}",
                           hint="check the credentials in the URL and the server's ACL")
    if isinstance(exc, _UNAVAILABLE + (OSError,)) or (isinstance(exc, rx.ResponseError)
                                                      and str(exc).startswith(_BUSY)):
        return LeaseStoreUnavailable(f"lease server {where} unavailable: {exc}")
    if isinstance(exc, rx.ResponseError):
        return ConfigError(f"lease server {where} rejected a script: {exc}",
                           hint="needs Redis >= 6.2 or Valkey; keep the namespace's keys for kvbridge")
    return LeaseStoreUnavailable(f"lease server {where} failed: {exc!r}")


def refusal(reply: Sequence[Any], lease_id: str, who: str) -> LeaseError:
    code = reply[0]
    detail = reply[1] if len(reply) > 1 else ""
    if code == "NOTFOUND":
        return LeaseNotFound(f"lease {lease_id!r} not found (never published, or long gone)")
    if code == "EXPIRED":
        return LeaseExpired(f"lease {lease_id!r} expired")
    if code == "REVOKED":
        return LeaseExpired(f"lease {lease_id!r} was revoked by its owner")
    if code == "ENDED":
        state = STATES[detail].value if detail in STATES else detail
        return LeaseExpired(f"lease {lease_id!r} is already {state}")
    if code == "EXISTS":
        return LeaseConflict(f"lease id {lease_id!r} already exists (owner {detail!r}); "
                             "lease ids must be unique", hint="publish under a fresh id")
    if code == "CONFLICT":
        if not detail:
            return LeaseConflict(f"lease {lease_id!r} is not claimed by {who!r} (no claimer)")
        return LeaseConflict(f"lease {lease_id!r} is held by claimer {detail!r}, not {who!r}")
    if code == "NOTOWNER":
        return LeaseConflict(f"lease {lease_id!r} is owned by {detail!r}, not {who!r}")
    if code == "STALE":
        return StaleFence(f"fence of {who!r} on lease {lease_id!r} is no longer current")
    if code == "LAPSED":
        return StaleFence(f"claim of {who!r} on lease {lease_id!r} lapsed (claim TTL passed)")
    if code == "EPOCH":
        return StaleFence(f"fence of lease {lease_id!r} is from an older lease-server epoch "
                          "(the server lost its data)")
    if code == "BADKEY":
        return LeaseNotFound(f"lease {lease_id!r}: the key passed is not the one this lease id names")
    return LeaseError(f"lease {lease_id!r}: unexpected reply {list(reply)!r}")
