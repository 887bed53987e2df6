"""Mapping at the boundary: redis-py errors and script refusal codes to :mod:`kvbridge.errors`."""

from __future__ import annotations

import urllib.parse
from typing import Any, Sequence

from redis import exceptions as rx

from ..errors import (ConfigError, KVBridgeError, LeaseConflict, LeaseError, LeaseExpired,
                      LeaseNotFound, LeaseStoreUnavailable, StaleFence)
from .base import LeaseState

__all__ = ["STATES", "redact", "check_url", "map_redis_error", "refusal"]

STATES = {"P": LeaseState.PUBLISHED, "C": LeaseState.CLAIMED,
          "R": LeaseState.RELEASED, "A": LeaseState.ABORTED}
_UNAVAILABLE = (rx.ConnectionError, rx.TimeoutError, rx.ReadOnlyError, rx.OutOfMemoryError,
                rx.TryAgainError, rx.ClusterDownError)
# Replies redis-py leaves as a plain ResponseError that say "not now", not "never": the server
# is running someone's long script (BUSY; BUSYKEY is another error), refuses writes until its
# replicas are back (NOREPLICAS, min-replicas-to-write) or its snapshots work again (MISCONF).
_NOT_NOW = ("BUSY ", "NOREPLICAS ", "MISCONF ")
_ACCESS = (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)


def redact(url: str) -> str:
    """The URL without its passwords (before the host, or in the query string); never raises."""
    try:
        p = urllib.parse.urlsplit(url)
        netloc = p.netloc
        if p.password is not None:
            netloc = f"{p.username or ''}:***@{netloc.rpartition('@')[2]}"
        query = "&".join(f"{k}=***" if "password" in urllib.parse.unquote(k).lower() and eq else k + eq + v
                         for k, eq, v in (item.partition("=") for item in p.query.split("&"))) if p.query else ""
        if (netloc, query) == (p.netloc, p.query):
            return url    # nothing to hide (and unix:///path keeps its slashes)
        tail = (f"?{query}" if query else "") + (f"#{p.fragment}" if p.fragment else "")
        return f"{p.scheme}://{netloc}{p.path}{tail}"
    except (ValueError, TypeError, AttributeError):
        scheme = url.partition("://")[0] if isinstance(url, str) else ""
        return f"{scheme[:16]}://(unparsable)"


# Options a lease URL may carry. Every other one is refused: redis-py lets a URL's options win
# over keyword arguments, so one from a handle's URL would replace the store's deadlines
# (socket_timeout=...), its reply format (protocol=3) or reach the connection class unchecked.
_URL_OPTIONS = frozenset({"db", "client_name"})
_TLS_OPTIONS = frozenset({"ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path",
                          "ssl_check_hostname", "ssl_password", "ssl_min_version", "ssl_ciphers"})


def check_url(url: object, schemes: Sequence[str]) -> str:
    """``url`` if it is a lease server URL kvbridge takes, else ``ConfigError``."""
    shown = redact(url) if isinstance(url, str) else repr(url)
    try:
        if not isinstance(url, str):
            raise ValueError("not a string")
        p = urllib.parse.urlsplit(url)
        p.port   # noqa: B018 -- raises ValueError for a port that is no number or out of range
        options = urllib.parse.parse_qs(p.query, keep_blank_values=True, strict_parsing=bool(p.query))
    except ValueError as exc:
        raise ConfigError(f"invalid lease server URL {shown!r}: {exc}") from None
    if p.scheme not in schemes:
        raise ConfigError(f"lease store URL must start with redis://, rediss:// or unix://: {shown!r}")
    allowed = _URL_OPTIONS | (_TLS_OPTIONS if p.scheme == "rediss" else frozenset())
    refused = sorted(set(options) - allowed)
    if refused:
        raise ConfigError(f"lease server URL {shown!r}: option(s) {', '.join(refused)} not accepted "
                          f"(accepted: {', '.join(sorted(allowed))})",
                          hint="credentials go before the host (redis://user:password@host); timeouts "
                               "and retries are the store's arguments (socket_timeout=, retry=)")
    return url


def map_redis_error(exc: BaseException, url: str) -> KVBridgeError:
    """Map a redis-py (or socket) error to the kvbridge tree."""
    where = redact(url)
    if isinstance(exc, _ACCESS):
        return ConfigError(f"lease server {where} refused access: {exc}",
                           hint="check the credentials in the URL and the server's ACL")
    if isinstance(exc, _UNAVAILABLE + (OSError,)) or (isinstance(exc, rx.ResponseError)
                                                      and str(exc).startswith(_NOT_NOW)):
        return LeaseStoreUnavailable(f"lease server {where} unavailable: {exc}")
    if isinstance(exc, rx.ResponseError) and "DB index" in str(exc):
        return ConfigError(f"lease server {where} has no such database: {exc}",
                           hint="the URL's /db number must be below the server's `databases` setting")
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
        # the holder is not named: a claimer's name is its claim's credential, and senders relay
        # this message to whoever sent the read (who could then claim re-entrantly as the holder)
        return LeaseConflict(f"lease {lease_id!r} is held by another claimer, not {who!r}")
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
