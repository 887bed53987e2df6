"""The Redis (or Valkey) lease store: one Lua script, one round trip, per operation.

Key layout (namespace ``ns``; the hash tag ``{ns}`` puts *every* key of a
namespace on one Redis Cluster slot, because the fence counter and the epoch are
shared by all leases and every script touches them)::

    {ns}:epoch            random u63 per dataset and server process, created with the first script run
    {ns}:epoch:run        the run_id of the server process the epoch was created on
    {ns}:fence            fence counter (INCR)
    {ns}:index            zset ref -> time its hash expires (for ``list``)
    {ns}:lease:<ref>      hash per lease, PEXPIREAT lease expiry + tombstone grace
    {ns}:events:<owner>   stream of release/abort/expire/revoke events, by ref (MAXLEN ~)

``ref = sha1hex("{ns}:lease:" + lease_id)`` (:meth:`RedisLeaseStore.ref`): lease ids are
secret 128-bit digests (``KVHandle.lease_digest``), so a key name, an index member or an
event does not give the lease id that every operation needs, and the scripts refuse a
lease key that is not the one their lease id names. Request ids are not stored.

In Cluster mode a namespace therefore lives on one shard; use several namespaces
to spread load. The server must not evict keys (``maxmemory-policy noeviction``).
Redis >= 6.2 or Valkey is assumed. The epoch also changes with the server process (its
``run_id``, checked by every script): a restart that loaded an older snapshot, or failover to
a replica that missed acknowledged writes, starts a new epoch, and every lease of the
namespace ends (owners free, claimers re-prefill), as when the data was lost.
Scripts are called with EVALSHA and loaded on ``NoScriptError``. redis-py's own
retries are off: :class:`~kvbridge.policy.Retry` applies to
``LeaseStoreUnavailable`` only, and every script is safe to repeat.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, List, Optional, Sequence, TypeVar

import redis as _redis
import redis.asyncio as _aioredis
from redis import exceptions as rx
from redis.backoff import NoBackoff
from redis.retry import Retry as _SyncRedisRetry
from redis.asyncio.retry import Retry as _AsyncRedisRetry

from ..errors import ConfigError, LeaseError, ProtocolError
from ..handle import check_ttl
from .credentials import with_password
from ..policy import Backoff, Retry
from . import _scripts
from ._mapping import STATES as _STATES
from ._mapping import check_url, map_redis_error, redact, refusal
from .base import EVENT_KINDS, Fence, Lease, LeaseEvent, LeaseState, LeaseStore

__all__ = ["RedisLeaseStore", "LeaseBatch", "DEFAULT_RETRY", "SCHEMES"]

T = TypeVar("T")
SCHEMES = ("redis", "rediss", "unix")
DEFAULT_RETRY = Retry(attempts=4, backoff=Backoff(base=0.05, cap=0.5), deadline=5.0)
LIST_PAGE = 500   # index entries one ``list`` script looks at: it blocks the server meanwhile


def _lease(view: str, lease_id: str = "") -> Lease:
    ref, s, ow, cl, ep, fc, left, cleft, nb, mt = json.loads(view)
    return Lease(lease_id=lease_id, ref=ref, owner=ow, state=_STATES[s], fence=Fence(int(ep), int(fc)),
                 claimer=cl or None, ttl_ms_left=max(0, int(left)), num_blocks=int(nb),
                 meta=json.loads(mt) if mt else {}, claim_ms_left=max(0, int(cleft)))


def _ms(seconds: float, what: str) -> int:
    """Milliseconds of a TTL, checked (:func:`~kvbridge.handle.check_ttl`) before any script runs: a
    script refused halfway (a TTL too large for PEXPIREAT) left its first writes -- a lease key
    without expiry -- behind."""
    return max(1, int(check_ttl(what, seconds) * 1000))


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ConfigError(f"{what} must be a non-empty string of at most 512 chars: {value!r}")
    return value


@dataclass
class _Op:
    """One script call: name, keys, args (after the epoch candidate), reply parser."""

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], Any]


class RedisLeaseStore(LeaseStore):
    """Lease store on a Redis-protocol server. ``url``: ``redis://``, ``rediss://`` or ``unix://``."""

    def __init__(self, url: str, namespace: str = "kvb", retry: Optional[Retry] = None, *,
                 socket_timeout: float = 5.0, connect_timeout: float = 2.0,
                 tombstone_s: float = 30.0, events_maxlen: int = 10_000,
                 max_connections: Optional[int] = None) -> None:
        super().__init__()
        check_url(url, SCHEMES)
        if not namespace or any(c in namespace for c in "{}:") or len(namespace) > 64:
            raise ConfigError(f"namespace must be 1-64 chars without '{{', '}}', ':': {namespace!r}")
        self.url = url
        self.namespace = namespace
        self.retry = retry or DEFAULT_RETRY
        self._socket_timeout = socket_timeout
        tag = "{" + namespace + "}"
        self._common_keys = [f"{tag}:epoch", f"{tag}:fence", f"{tag}:index"]
        self._prefix = f"{tag}:"
        self._lease_prefix = f"{tag}:lease:"
        self._events_prefix = f"{tag}:events:"
        self._grace_ms = _ms(tombstone_s, "tombstone_s")
        self._maxlen = int(events_maxlen)
        self._src = dict(_scripts.ALL)
        self._sha = {k: hashlib.sha1(v.encode()).hexdigest() for k, v in self._src.items()}
        # each owner's read position in its event stream; readers of one owner's events on
        # several threads (or tasks) each get an event once: the position only moves forward
        self._cursors: dict[str, str] = {}
        self._cursor_lock = threading.Lock()
        kw: dict[str, Any] = dict(decode_responses=True, socket_timeout=socket_timeout,
                                  socket_connect_timeout=connect_timeout, protocol=2,
                                  max_connections=max_connections)
        self._akw = dict(kw, retry=_AsyncRedisRetry(NoBackoff(), 0))
        self._conn_url = with_password(url)   # this user's embedded server: its password, from a 0600 file
        try:
            self._redis = _redis.Redis.from_url(self._conn_url, retry=_SyncRedisRetry(NoBackoff(), 0), **kw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid lease store URL {redact(url)!r}: {exc}") from exc
        # One async client per event loop (its connections belong to that loop); a closed loop's
        # is dropped when another loop next asks.
        self._ars: dict[asyncio.AbstractEventLoop, _aioredis.Redis] = {}
        self._alock = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisLeaseStore({redact(self.url)!r}, namespace={self.namespace!r})"

    def ref(self, lease_id: str) -> str:
        """The public name of a lease: its key is ``{ns}:lease:<ref>``, its events and index
        entries carry the ref. One-way: the ref does not give the lease id."""
        return hashlib.sha1((self._lease_prefix + lease_id).encode()).hexdigest()

    # -- building script calls ---------------------------------------------
    def _keys(self, lease_id: str) -> list[str]:
        return self._common_keys + [self._lease_prefix + self.ref(lease_id)]

    def _head(self, lease_id: str) -> list[Any]:
        return [self._grace_ms, self._prefix, self._maxlen, lease_id]

    @staticmethod
    def _view(lease_id: str) -> Callable[[Any], Lease]:
        return lambda r: _lease(r, lease_id)

    def _counted(self, stat: Optional[str], lease_id: str, who: str,
                 ok: Callable[[Any], T]) -> Callable[[Any], T]:
        def parse(reply: Any) -> T:
            if isinstance(reply, list) and reply[0] != "OK":
                self._count("refused")
                raise refusal(reply, lease_id, who)
            if stat:
                self._count(stat)
            return ok(reply)
        return parse

    def _op_publish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int,
                    meta: Optional[dict[str, str]]) -> _Op:
        _check_name(lease_id, "lease_id")
        _check_name(owner, "owner")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        mt = json.dumps({str(k): str(v) for k, v in (meta or {}).items()}, separators=(",", ":"))
        args = self._head(lease_id) + [owner, _ms(ttl_s, "ttl_s"), int(num_blocks), mt,
                                       secrets.token_hex(8)]
        return _Op("publish", self._keys(lease_id), args,
                   self._counted("published", lease_id, owner, self._view(lease_id)))

    def _op_claim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> _Op:
        _check_name(lease_id, "lease_id")
        _check_name(claimer, "claimer")
        args = self._head(lease_id) + [claimer, _ms(claim_ttl_s, "claim_ttl_s")]
        return _Op("claim", self._keys(lease_id), args,
                   self._counted("claimed", lease_id, claimer, self._view(lease_id)))

    def _op_holder(self, script: str, stat: Optional[str], lease_id: str, claimer: str,
                   fence: Fence, extra: Sequence[Any] = (),
                   ok: Callable[[Any], Any] = lambda r: None) -> _Op:
        _check_name(lease_id, "lease_id")
        _check_name(claimer, "claimer")
        if not isinstance(fence, Fence):
            raise ConfigError(f"fence must be a Fence, got {type(fence).__name__}")
        args = self._head(lease_id) + [claimer, str(fence.epoch), str(fence.counter), *extra]
        return _Op(script, self._keys(lease_id), args, self._counted(stat, lease_id, claimer, ok))

    def _op_release(self, lease_id: str, claimer: str, fence: Fence, notify: bool = True) -> _Op:
        return self._op_holder("release" if notify else "release_quiet", "released", lease_id, claimer, fence)

    def _op_abort(self, lease_id: str, claimer: str, fence: Fence) -> _Op:
        return self._op_holder("abort", "aborted", lease_id, claimer, fence)

    def _op_validate(self, lease_id: str, claimer: str, fence: Fence) -> _Op:
        return self._op_holder("validate", None, lease_id, claimer, fence)

    def _op_renew(self, lease_id: str, who: str, ttl_s: float, fence: Optional[Fence]) -> _Op:
        ms = _ms(ttl_s, "ttl_s")
        if fence is not None:
            return self._op_holder("renew_claim", None, lease_id, who, fence, [ms], self._view(lease_id))
        _check_name(lease_id, "lease_id")
        _check_name(who, "owner")
        return _Op("renew_owner", self._keys(lease_id), self._head(lease_id) + [who, ms],
                   self._counted(None, lease_id, who, self._view(lease_id)))

    def _op_revoke(self, lease_id: str, owner: str) -> _Op:
        _check_name(lease_id, "lease_id")
        _check_name(owner, "owner")

        def ok(r: Any) -> Optional[LeaseState]:
            if r[1] in ("P", "C"):
                self._count("revoked")
            return _STATES.get(r[1])
        return _Op("revoke", self._keys(lease_id), self._head(lease_id) + [owner],
                   self._counted(None, lease_id, owner, ok))

    def _op_get(self, lease_id: str) -> _Op:
        _check_name(lease_id, "lease_id")
        return _Op("get", self._keys(lease_id), self._head(lease_id),
                   lambda r: _lease(r, lease_id) if isinstance(r, str) else None)

    def _op_sweep(self, owner: str, lease_ids: Sequence[str]) -> _Op:
        ids = [_check_name(i, "lease_id") for i in lease_ids]
        keys = self._common_keys + [self._lease_prefix + self.ref(i) for i in ids]
        return _Op("sweep", keys, self._head("") + [owner],
                   lambda r: {i: _STATES.get(s) for i, s in zip(ids, r)})

    def _op_list(self, owner: Optional[str], limit: int,
                 cursor: tuple[str, int] = ("-inf", 0)) -> _Op:
        """One page of ``list``: (views, the next page's cursor or None when the index is done)."""
        args = self._head("") + [owner or "", int(limit), cursor[0], int(cursor[1]), LIST_PAGE]

        def parse(r: Any) -> tuple[list[Lease], Optional[tuple[str, int]]]:
            return [_lease(v) for v in r[2:]], ((r[0], int(r[1])) if r[0] else None)
        return _Op("list", self._common_keys, args, parse)

    # -- running script calls ----------------------------------------------
    @staticmethod
    def _epoch_candidate() -> str:
        return str(secrets.randbits(63) or 1)

    def _argv(self, op: _Op) -> list[Any]:
        return [*op.keys, self._epoch_candidate(), *op.args]

    def _call(self, fn: Callable[[], T]) -> T:
        def attempt() -> T:
            try:
                return fn()
            except (rx.RedisError, OSError) as exc:
                raise map_redis_error(exc, self.url) from exc
        return self.retry.call(attempt)

    async def _acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        async def attempt() -> T:
            try:
                return await fn()
            except (rx.RedisError, OSError) as exc:
                raise map_redis_error(exc, self.url) from exc
        return await self.retry.acall(attempt)

    def _eval(self, op: _Op) -> Any:
        try:
            return self._redis.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))
        except rx.NoScriptError:
            self._redis.script_load(self._src[op.script])
            return self._redis.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))

    async def _aeval(self, op: _Op) -> Any:
        r = self._aclient()
        try:
            return await r.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))
        except rx.NoScriptError:
            await r.script_load(self._src[op.script])
            return await r.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))

    def _parse(self, op: _Op, reply: Any) -> Any:
        """``op``'s result from the server's reply. A reply that is not what kvbridge's script
        returns (not a Redis/Valkey server running it, or a hostile one) is a ProtocolError,
        never a raw JSON or indexing error."""
        try:
            return op.parse(reply)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise self._malformed(op.script, reply, exc) from exc

    def _malformed(self, what: str, reply: Any, exc: Exception) -> ProtocolError:
        return ProtocolError(f"lease server {redact(self.url)} sent a malformed reply to {what}: "
                             f"{repr(reply)[:120]} ({type(exc).__name__}: {exc})",
                             hint="the lease URL must name a Redis >= 6.2 or Valkey server")

    def _run(self, op: _Op) -> Any:
        return self._parse(op, self._call(lambda: self._eval(op)))

    async def _arun(self, op: _Op) -> Any:
        return self._parse(op, await self._acall(lambda: self._aeval(op)))

    def _check_replies(self, replies: list[Any]) -> list[int]:
        """Indices that hit NoScriptError; other Redis errors are raised (mapped)."""
        missing = []
        for i, r in enumerate(replies):
            if isinstance(r, rx.NoScriptError):
                missing.append(i)
            elif isinstance(r, BaseException):
                raise r
        return missing

    def _eval_many(self, ops: Sequence[_Op]) -> list[Any]:
        def once(sel: Sequence[_Op]) -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for op in sel:
                pipe.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))
            return pipe.execute(raise_on_error=False)
        replies = once(ops)
        missing = self._check_replies(replies)
        if missing:
            for name in {ops[i].script for i in missing}:
                self._redis.script_load(self._src[name])
            again = once([ops[i] for i in missing])
            self._check_replies(again)
            for i, r in zip(missing, again):
                replies[i] = r
        return replies

    async def _aeval_many(self, ops: Sequence[_Op]) -> list[Any]:
        r = self._aclient()

        async def once(sel: Sequence[_Op]) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for op in sel:
                pipe.evalsha(self._sha[op.script], len(op.keys), *self._argv(op))
            return await pipe.execute(raise_on_error=False)
        replies = await once(ops)
        missing = self._check_replies(replies)
        if missing:
            for name in {ops[i].script for i in missing}:
                await r.script_load(self._src[name])
            again = await once([ops[i] for i in missing])
            self._check_replies(again)
            for i, rep in zip(missing, again):
                replies[i] = rep
        return replies

    def _parse_many(self, ops: Sequence[_Op], replies: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        for op, rep in zip(ops, replies):
            try:
                out.append(self._parse(op, rep))
            except LeaseError as exc:
                out.append(exc)
        return out

    def _run_many(self, ops: Sequence[_Op]) -> list[Any]:
        if not ops:
            return []
        return self._parse_many(ops, self._call(lambda: self._eval_many(ops)))

    async def _arun_many(self, ops: Sequence[_Op]) -> list[Any]:
        if not ops:
            return []
        return self._parse_many(ops, await self._acall(lambda: self._aeval_many(ops)))

    def _aclient(self) -> "_aioredis.Redis":
        loop = asyncio.get_running_loop()
        with self._alock:
            r = self._ars.get(loop)
            if r is None:
                for old in [lp for lp in self._ars if lp.is_closed()]:
                    del self._ars[old]
                r = self._ars[loop] = _aioredis.Redis.from_url(self._conn_url, **self._akw)
            return r

    # -- blocking API --------------------------------------------------------
    def publish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int = 0,
                meta: Optional[dict[str, str]] = None) -> Lease:
        return self._run(self._op_publish(lease_id, owner, ttl_s, num_blocks, meta))  # type: ignore[no-any-return]

    def claim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> Lease:
        return self._run(self._op_claim(lease_id, claimer, claim_ttl_s))  # type: ignore[no-any-return]

    def renew(self, lease_id: str, who: str, ttl_s: float, fence: Optional[Fence] = None) -> Lease:
        return self._run(self._op_renew(lease_id, who, ttl_s, fence))  # type: ignore[no-any-return]

    def validate(self, lease_id: str, claimer: str, fence: Fence) -> None:
        self._run(self._op_validate(lease_id, claimer, fence))

    def release(self, lease_id: str, claimer: str, fence: Fence) -> None:
        self._run(self._op_release(lease_id, claimer, fence))

    def abort(self, lease_id: str, claimer: str, fence: Fence) -> None:
        self._run(self._op_abort(lease_id, claimer, fence))

    def revoke(self, lease_id: str, owner: str) -> Optional[LeaseState]:
        return self._run(self._op_revoke(lease_id, owner))  # type: ignore[no-any-return]

    def get(self, lease_id: str) -> Optional[Lease]:
        return self._run(self._op_get(lease_id))  # type: ignore[no-any-return]

    def list(self, owner: Optional[str] = None, limit: int = 10_000) -> list[Lease]:
        """Up to ``limit`` leases, one round trip per :data:`LIST_PAGE` index entries (one script
        over the whole index stalled every other lease call on a busy server)."""
        out: list[Lease] = []
        cursor: Optional[tuple[str, int]] = ("-inf", 0)
        while cursor is not None and len(out) < limit:
            views, cursor = self._run(self._op_list(owner, limit - len(out), cursor))
            out += views
        return out

    def sweep(self, owner: str, lease_ids: Sequence[str]) -> dict[str, Optional[LeaseState]]:
        if not lease_ids:
            return {}
        return self._run(self._op_sweep(owner, lease_ids))  # type: ignore[no-any-return]

    def events(self, owner: str, timeout_s: float = 0.0) -> List[LeaseEvent]:
        key = self._events_prefix + _check_name(owner, "owner")
        block = self._block_ms(timeout_s)
        raw = self._call(lambda: self._redis.xread({key: self._cursors.get(owner, "0-0")},
                                                   count=1000, block=block))
        return self._parse_events(owner, raw)

    def batch(self) -> "LeaseBatch":
        """Collect operations and run them in one pipelined round trip."""
        return LeaseBatch(self)

    def publish_many(self, owner: str, lease_ids: Sequence[str], ttl_s: float,
                     num_blocks: int | Sequence[int] = 0) -> List[Lease | LeaseError]:
        """Publish N leases in one round trip; refusals are returned in place."""
        nbs = [num_blocks] * len(lease_ids) if isinstance(num_blocks, int) else list(num_blocks)
        return self._run_many([self._op_publish(i, owner, ttl_s, n, None)
                               for i, n in zip(lease_ids, nbs)])

    def claim_many(self, claimer: str, lease_ids: Sequence[str],
                   claim_ttl_s: float) -> List[Lease | LeaseError]:
        """Claim N leases in one round trip; refusals are returned in place."""
        return self._run_many([self._op_claim(i, claimer, claim_ttl_s) for i in lease_ids])

    def release_many(self, claimer: str,
                     items: Sequence[tuple[str, Fence]]) -> List[LeaseError | None]:
        """Release N leases in one round trip; refusals are returned in place."""
        return self._run_many([self._op_release(i, claimer, f) for i, f in items])

    def close(self) -> None:
        """Drop pooled connections (the store reconnects if used again)."""
        self._redis.close()

    # -- awaitable API -------------------------------------------------------
    async def apublish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int = 0,
                       meta: Optional[dict[str, str]] = None) -> Lease:
        return await self._arun(self._op_publish(lease_id, owner, ttl_s, num_blocks, meta))  # type: ignore[no-any-return]

    async def aclaim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> Lease:
        return await self._arun(self._op_claim(lease_id, claimer, claim_ttl_s))  # type: ignore[no-any-return]

    async def arenew(self, lease_id: str, who: str, ttl_s: float,
                     fence: Optional[Fence] = None) -> Lease:
        return await self._arun(self._op_renew(lease_id, who, ttl_s, fence))  # type: ignore[no-any-return]

    async def avalidate(self, lease_id: str, claimer: str, fence: Fence) -> None:
        await self._arun(self._op_validate(lease_id, claimer, fence))

    async def arelease(self, lease_id: str, claimer: str, fence: Fence) -> None:
        await self._arun(self._op_release(lease_id, claimer, fence))

    async def aabort(self, lease_id: str, claimer: str, fence: Fence) -> None:
        await self._arun(self._op_abort(lease_id, claimer, fence))

    async def arevoke(self, lease_id: str, owner: str) -> Optional[LeaseState]:
        return await self._arun(self._op_revoke(lease_id, owner))  # type: ignore[no-any-return]

    async def aget(self, lease_id: str) -> Optional[Lease]:
        return await self._arun(self._op_get(lease_id))  # type: ignore[no-any-return]

    async def alist(self, owner: Optional[str] = None, limit: int = 10_000) -> List[Lease]:
        out: list[Lease] = []
        cursor: Optional[tuple[str, int]] = ("-inf", 0)
        while cursor is not None and len(out) < limit:
            views, cursor = await self._arun(self._op_list(owner, limit - len(out), cursor))
            out += views
        return out

    async def asweep(self, owner: str,
                     lease_ids: Sequence[str]) -> dict[str, Optional[LeaseState]]:
        if not lease_ids:
            return {}
        return await self._arun(self._op_sweep(owner, lease_ids))  # type: ignore[no-any-return]

    async def aevents(self, owner: str, timeout_s: float = 0.0) -> List[LeaseEvent]:
        key = self._events_prefix + _check_name(owner, "owner")
        block = self._block_ms(timeout_s)
        r = self._aclient()
        raw = await self._acall(lambda: r.xread({key: self._cursors.get(owner, "0-0")},
                                                count=1000, block=block))
        return self._parse_events(owner, raw)

    async def apublish_many(self, owner: str, lease_ids: Sequence[str], ttl_s: float,
                            num_blocks: int | Sequence[int] = 0) -> List[Lease | LeaseError]:
        nbs = [num_blocks] * len(lease_ids) if isinstance(num_blocks, int) else list(num_blocks)
        return await self._arun_many([self._op_publish(i, owner, ttl_s, n, None)
                                      for i, n in zip(lease_ids, nbs)])

    async def aclaim_many(self, claimer: str, lease_ids: Sequence[str],
                          claim_ttl_s: float) -> List[Lease | LeaseError]:
        return await self._arun_many([self._op_claim(i, claimer, claim_ttl_s) for i in lease_ids])

    async def arelease_many(self, claimer: str,
                            items: Sequence[tuple[str, Fence]]) -> List[LeaseError | None]:
        return await self._arun_many([self._op_release(i, claimer, f) for i, f in items])

    async def aclose(self) -> None:
        """Drop the async connections of this event loop, and the blocking ones.

        Each event loop the store is awaited from has connections of its own: call ``aclose()``
        on a loop before it ends (those of a loop that ended without are dropped unclosed).
        """
        with self._alock:
            ar = self._ars.pop(asyncio.get_running_loop(), None)
        if ar is not None:
            await ar.aclose()
        self.close()

    # -- events helpers --------------------------------------------------------
    def _block_ms(self, timeout_s: float) -> Optional[int]:
        if timeout_s <= 0:
            return None  # XREAD without BLOCK: return at once
        cap = timeout_s if self._socket_timeout is None else max(0.001, self._socket_timeout - 0.25)
        return max(1, int(min(timeout_s, cap) * 1000))

    def _parse_events(self, owner: str, raw: Any) -> List[LeaseEvent]:
        """The events of an XREAD from the owner's read position. Two readers that read from the
        same position (threads, tasks) get the same entries: the first to parse them takes them
        and moves the position past them, the other drops what is at or before it."""
        out: list[LeaseEvent] = []
        try:
            entries = [(_stream_id(eid), eid, fields) for _key, es in raw or [] for eid, fields in es]
            with self._cursor_lock:
                last = _stream_id(self._cursors.get(owner, "0-0"))
                for sid, eid, fields in entries:
                    if sid <= last:
                        continue                        # another reader of these events took it
                    last = sid
                    self._cursors[owner] = eid
                    kind, ref = fields.get("k", ""), fields.get("id", "")
                    if kind in EVENT_KINDS:
                        out.append(LeaseEvent(kind, ref))
        except (ValueError, TypeError, AttributeError) as exc:
            raise self._malformed("XREAD", raw, exc) from exc
        return out


def _stream_id(eid: Any) -> tuple[int, int]:
    """A Redis stream entry id ("<ms>-<seq>") as a pair that orders as the stream does."""
    ms, sep, seq = str(eid).partition("-")
    if not sep:
        raise ValueError(f"stream id {eid!r}")
    return int(ms), int(seq)


class LeaseBatch:
    """Operations collected for one pipelined round trip.

    ``execute()`` returns one result per operation, in order: the value the
    single call would return, or the :class:`~kvbridge.errors.LeaseError` it
    would raise. Connection failures raise for the whole batch (retried: every
    operation is safe to repeat).
    """

    def __init__(self, store: RedisLeaseStore) -> None:
        self._store = store
        self._ops: list[_Op] = []

    def __len__(self) -> int:
        return len(self._ops)

    def publish(self, lease_id: str, owner: str, ttl_s: float, num_blocks: int = 0,
                meta: Optional[dict[str, str]] = None) -> "LeaseBatch":
        self._ops.append(self._store._op_publish(lease_id, owner, ttl_s, num_blocks, meta))
        return self

    def claim(self, lease_id: str, claimer: str, claim_ttl_s: float) -> "LeaseBatch":
        self._ops.append(self._store._op_claim(lease_id, claimer, claim_ttl_s))
        return self

    def renew(self, lease_id: str, who: str, ttl_s: float,
              fence: Optional[Fence] = None) -> "LeaseBatch":
        self._ops.append(self._store._op_renew(lease_id, who, ttl_s, fence))
        return self

    def validate(self, lease_id: str, claimer: str, fence: Fence) -> "LeaseBatch":
        self._ops.append(self._store._op_validate(lease_id, claimer, fence))
        return self

    def release(self, lease_id: str, claimer: str, fence: Fence, notify: bool = True) -> "LeaseBatch":
        """``notify=False``: no event for the lease's owner -- for an owner that releases on its
        reader's behalf (it ends the handle itself)."""
        self._ops.append(self._store._op_release(lease_id, claimer, fence, notify))
        return self

    def abort(self, lease_id: str, claimer: str, fence: Fence) -> "LeaseBatch":
        self._ops.append(self._store._op_abort(lease_id, claimer, fence))
        return self

    def revoke(self, lease_id: str, owner: str) -> "LeaseBatch":
        self._ops.append(self._store._op_revoke(lease_id, owner))
        return self

    def get(self, lease_id: str) -> "LeaseBatch":
        self._ops.append(self._store._op_get(lease_id))
        return self

    def execute(self) -> list[Any]:
        ops, self._ops = self._ops, []
        return self._store._run_many(ops)

    async def aexecute(self) -> list[Any]:
        ops, self._ops = self._ops, []
        return await self._store._arun_many(ops)
