"""KVSender: the prefill side. Publishes handles, serves or pushes their blocks, frees them once.

Ownership: ``publish`` takes over the engine's reference to the blocks (a pool with
``allocator="engine"``: it pins them). The sender frees (unpins) them exactly once --
on release by the receiver, on ``revoke``, when a push completes or fails, or when the
handle's TTL passes unreleased -- and never while a read it serves is in flight
(revoke first, then free when reads drain). ``on_free(handle, reason)`` tells the
engine; with an engine-allocated pool that is the moment it may reuse the blocks.

Layer-wise: ``publish(..., layers_ready=0)`` hands out a handle before the prefill has
computed every layer; ``mark_ready(handle, n)`` says layers ``0..n-1`` are final,
computes their per-(layer, block) checksums, and wakes readers waiting for them.

Push: ``push(reservation, block_ids)`` writes the blocks into the destination blocks a
decode side reserved, layer by layer as they become ready (the same ``mark_ready``),
under the reservation's lease: it claims it (one writer wins), writes under the
claim's fence, and releases it when the last layer has landed and verified there.

Leases (``leases=``, see ``docs/LEASES.md``): each handle gets a lease in Redis
(owner, TTL, fence). Reads must present the claimer's current fence, and after the last
byte of each the sender vouches for it (:meth:`Grant.vouch`); the sender learns
of releases and aborts from its event stream (with a periodic sweep as fallback) and,
before freeing for any other reason, revokes the lease in Redis first. If Redis is
unreachable it keeps the blocks until its local deadline (TTL plus a margin for clock
rate), after which Redis has certainly expired the lease.

The class is built in three layers: :mod:`.sender_lifecycle` ends handles and frees their
blocks (with the sweeper and lease watcher threads), :mod:`.sender_serving` answers the reads
and releases that transport servers hand it, and this module is the public face: publishing,
layer readiness, push, renew and close.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

from .errors import AccessDenied, BadHandle, ConfigError, HandleNotFound, KVBridgeError, LayoutMismatch, PoolError
from .codecs import CodecChoice, available_codecs, choose_codec, is_lossless, measure_codec_speeds
from .frames import FrameStore, check_codec
from .handle import KVHandle, check_secret, check_ttl
from .integrity import block_checksums, layer_checksums
from .lease import Claim, LeaseStore, holds_until, owner_deadline
from .metrics import SenderStats
from .policy import Retry, Timeout, _seconds
from .pool import KVPool, block_id_list, whole_number
from .published import Deadlines, Record, parse_ticket
from .pushing import run_push
from .sender_lifecycle import FreeReason as FreeReason
from .sender_serving import LAYER_WAIT as LAYER_WAIT, SenderServing
from .stores import LeasesArg, StoreCache
from .transfer import FetchResult, Transfer, Workers
from .transports.base import Server, Spans, Transport
from .transports.registry import get_transport_class, scheme_of

__all__ = ["KVSender", "FreeReason"]

log = logging.getLogger("kvbridge.sender")
HandleForm = Union[KVHandle, bytes, dict[str, Any]]
_ID_LEN = 16    # a handle id (KVHandle.handle_id); a handle's bytes are longer


class KVSender(SenderServing):
    """Publish blocks of ``pool`` and serve them at ``listen`` URL(s); push them on request.

    ``secret``: shared HMAC key (then receivers can verify handles too); by default a
    random per-sender key. ``ttl``: seconds an unreleased handle lives.
    ``on_free(handle, reason)``: called after its blocks are freed (unpinned).
    ``leases``: a Redis URL, a :class:`LeaseStore`, None (this process's embedded
    server) or False (no leases: local TTL and direct release only). ``retry`` governs
    push writes and claims.
    """

    def __init__(self, pool: KVPool, listen: Union[str, Sequence[str]] = "tcp://127.0.0.1:0", *,
                 secret: Optional[bytes] = None, ttl: float = 60.0, timeout: Timeout = Timeout(),
                 on_free: Optional[Callable[[KVHandle, FreeReason], None]] = None,
                 checksums: bool = True, leases: LeasesArg = None, owner: Optional[str] = None,
                 lease_namespace: str = "kvb", clock_margin: float = 1.0, retry: Retry = Retry(),
                 claim_ttl: float = 30.0, codec: str = "raw", link_gbps: Optional[float] = None,
                 allow_lossy: bool = False) -> None:
        if not isinstance(pool, KVPool) or pool.closed:   # before anything opens: nothing to close
            got = "a closed pool" if isinstance(pool, KVPool) else type(pool).__name__
            raise ConfigError(f"KVSender(pool): an open KVPool, not {got}")
        check_secret("KVSender", secret)
        check_ttl("KVSender", ttl)
        check_ttl("KVSender(claim_ttl)", claim_ttl)
        _seconds("KVSender", "clock_margin", clock_margin, zero=True)
        if codec != "auto":
            check_codec(codec)
        elif link_gbps is None:
            raise ConfigError("codec='auto' needs the link's bandwidth: KVSender(..., link_gbps=...)")
        self.codec = codec
        self.link_gbps = link_gbps
        self.allow_lossy = allow_lossy
        self.codec_choice: Optional[CodecChoice] = None   # what "auto" picked, and why
        self.pool = pool
        self.servers: list[Server] = []
        self._closed = False
        self._ended_all = False   # close() has ended every handle (the sweeper may stop once none is pending)
        self._sweeper: Optional[threading.Thread] = None
        self._watcher: Optional[threading.Thread] = None
        self.leases: Optional[LeaseStore] = None
        self._own_store = not isinstance(leases, LeaseStore)
        self.ttl = ttl
        self.timeout = timeout
        self.retry = retry
        self.claim_ttl = claim_ttl
        self.on_free = on_free
        self.checksums = checksums
        self._key = bytes(secret) if secret is not None else os.urandom(32)
        self._records: dict[bytes, Record] = {}
        # handle id -> (bytes issued, block ids, generations) of the live handles whose whole
        # reads C answers by itself (serve_small): raw, complete, unleased, a few host blocks
        self._small: dict[bytes, tuple[bytes, tuple[int, ...], tuple[int, ...]]] = {}
        self._by_lease: dict[str, Record] = {}
        self._owed: list[tuple[Record, Claim]] = []    # claimed releases to make in the store (release_claimed)
        self._owed_lock = threading.Condition(threading.Lock())
        self._owed_thread: Optional[threading.Thread] = None
        # the live handles naming each block (prefix caching shares blocks), by id: an engine pool's
        # retire ends them all; a kvbridge pool's publish checks each holds a reference of its own
        self._by_block: dict[int, dict[int, Record]] = {}
        self._pending: list[Record] = []
        self._deadlines = Deadlines()   # local deadlines, earliest first (the sweeper's)
        self._lease_down_until = 0.0    # monotonic: revokes wait until then (the lease server was down)
        self._mutex = threading.RLock()   # taken bare on the hot paths; the conditions below share it
        self._lock = threading.Condition(self._mutex)
        self._ready_cv = threading.Condition(self._mutex)  # one lock, two conditions
        self._layer_waiters = 0     # reads and pushes waiting in _wait_layers (under the lock)
        self.stats = SenderStats()
        self.owner = owner or f"sender-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.clock_margin = clock_margin
        self._push_stores = StoreCache(leases if leases is not False else None, lease_namespace)
        self._transports: dict[str, Transport] = {}
        self._transports_taken = False     # close() has closed them: later work makes its own
        self._workers = Workers("kvb-push")
        urls = [listen] if isinstance(listen, str) else list(listen)
        try:
            if not urls:
                raise ConfigError("KVSender needs at least one listen URL")
            if leases is not False:
                self.leases = (leases if isinstance(leases, LeaseStore)
                               else StoreCache(leases, lease_namespace).own())
            for u in urls:
                self.servers.append(get_transport_class(scheme_of(u)).serve(u, self, timeout))
        except BaseException:
            self.close()      # what opened so far closes; the real error propagates
            raise
        if pool.engine_allocated:
            pool.on_retire.append(self._on_retire)
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvb-sender-sweep", daemon=True)
        self._sweeper.start()
        if self.leases is not None:
            self._watcher = threading.Thread(target=self._lease_loop, name="kvb-sender-leases", daemon=True)
            self._watcher.start()

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    @property
    def num_live(self) -> int:
        return len(self._records)

    # -- prefill side --------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                ttl: Optional[float] = None, layers_ready: Optional[int] = None,
                codec: Optional[str] = None) -> KVHandle:
        """Hand ``block_ids`` (holding ``num_tokens`` tokens of ``request_id``) to a receiver.

        ``layers_ready=n`` publishes before the prefill has finished: only layers ``0..n-1``
        are final; :meth:`mark_ready` announces the rest. ``codec`` (default: the sender's)
        encodes the blocks (``lz4``, ``zstd``, ``int8``, ``fp8``, ...; see
        :mod:`kvbridge.codecs`); the signed handle names it and receivers decode it."""
        codec = self.codec if codec is None else codec
        if codec == "auto":
            codec = self._auto_codec(block_ids)
        return self._publish(request_id, block_ids, num_tokens, ttl, layers_ready, leased=True, codec=codec)

    def _auto_codec(self, block_ids: Sequence[int]) -> str:
        """Pick the codec that makes the transfer fastest end to end over ``link_gbps``, from
        encode/decode speeds and ratios measured once on this pool's real KV; ``raw`` unless one
        beats it, and a lossy one only with ``allow_lossy``. ``codec_choice.reason`` says why."""
        if self.link_gbps is None:
            raise ConfigError("codec='auto' needs the link's bandwidth: KVSender(..., link_gbps=...)")
        if self.codec_choice is None:
            names = [n for n in available_codecs() if self.allow_lossy or is_lossless(n)]
            speeds = measure_codec_speeds(self.pool, list(block_ids)[:64], names)
            self.codec_choice = choose_codec(self.link_gbps, speeds, allow_lossy=self.allow_lossy)
            log.info("codec auto: %s (%s)", self.codec_choice.codec, self.codec_choice.reason)
        return self.codec_choice.codec

    def _publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int, ttl: Optional[float],
                 layers_ready: Optional[int], leased: bool, codec: str = "raw") -> KVHandle:
        if self._closed:     # refused before anything: the blocks stay the caller's, as on any refusal
            raise ConfigError("sender is closed")
        ids = block_id_list(block_ids, "publish")
        if len(set(ids)) != len(ids):
            raise PoolError("publish: duplicate block ids")
        self.pool._check_ids(ids)
        if not self.pool.engine_allocated:
            for b in ids:
                if self.pool.refcount(b) <= 0:
                    raise PoolError(f"publish: block {b} is not allocated",
                                    hint="alloc() it first, or wrap the engine's cache with allocator='engine'")
        L = self.pool.layout
        ntok = whole_number(num_tokens)     # 3.0, '3', None, True: refused, not packed or taken as 1
        if ntok is None or not 0 <= ntok <= len(ids) * L.block_size:
            raise ConfigError(f"num_tokens {num_tokens!r}: a whole number of tokens that fits {len(ids)} blocks "
                              f"of {L.block_size}")
        num_tokens = ntok
        layerwise = layers_ready is not None
        if layerwise:
            ready = whole_number(layers_ready)
            if ready is None or not 0 <= ready <= L.num_layers:
                raise ConfigError(f"layers_ready={layers_ready!r}: a whole number in 0..{L.num_layers}")
            layers_ready = ready
        ttl = check_ttl("publish", self.ttl if ttl is None else ttl)   # nan, inf, 0 or less, too large: refused
        check_codec(codec)
        if self.pool.engine_allocated:
            self.pool.pin(ids)
        frames: Optional[FrameStore] = None
        lease_id = ""
        try:
            if codec != "raw":   # frames carry their own body hashes: no per-block checksums
                frames = FrameStore(codec, self.pool, ids, layerwise,
                                    shared=any(u.startswith("shm:") for u in self.urls))
                if not layerwise:
                    frames.encode_upto(L.num_layers)
            bare = KVHandle(
                handle_id=os.urandom(16), request_id=request_id, layout_hash=L.compat_hash,
                urls=self.urls, block_ids=tuple(ids), generations=tuple(self.pool.generations(ids)),
                checksums=(tuple(block_checksums(self.pool, ids)) if self.checksums and not layerwise
                           and frames is None else ()),
                num_tokens=num_tokens, codec=codec, token=os.urandom(16), layerwise=layerwise)
            sent_at = answered_at = time.monotonic()
            expires_at_ms = int((time.time() + ttl) * 1000)
            if self.leases is not None and leased:
                lease = self.leases.publish(bare.lease_digest(), self.owner, ttl, num_blocks=len(ids))
                answered_at = time.monotonic()     # the server set the expiry before this
                lease_id = lease.lease_id
                bare = replace(bare, lease_id=lease.lease_id, lease_url=str(getattr(self.leases, "url", "")),
                               fence_epoch=lease.fence.epoch, fence=lease.fence.counter)
            # signed here, inside the undo: a field the encoding refuses (a request id over its
            # limit) is a refusal like any other, not pins and a lease left behind
            handle = replace(bare, expires_at_ms=expires_at_ms).signed(self._key)
            raw = handle.to_bytes()
        except BaseException:
            self._give_back(ids, frames, lease_id)
            raise
        deadline = owner_deadline(answered_at, ttl, margin_s=self.clock_margin) if bare.lease_id else sent_at + ttl
        # the whole-read spans are made now, with the record: a read allocates nothing that
        # outlives it (survivors of the read path would wake the collector over the whole heap)
        rec = Record(handle, raw, ids, deadline, ready=0 if layerwise else L.num_layers,
                     spans=Spans(self.pool, None, ids), frames=frames,
                     alive_until=holds_until(sent_at, ttl, margin_s=self.clock_margin))
        with self._lock:
            refusal = ConfigError("sender is closed") if self._closed else self._held_by_others(ids)
            if refusal is None:
                self._records[handle.handle_id] = rec
                if not layerwise and frames is None:   # under the lock: never after its end
                    self._index_small(rec)
                    for srv in self.servers:
                        srv.published(handle.handle_id, rec.raw)
                if handle.lease_id:
                    self._by_lease[self._lease_ref(handle.lease_id)] = rec
                for b in ids:
                    self._by_block.setdefault(b, {})[id(rec)] = rec
                self._schedule(rec)
        if refusal is not None:   # closed while this publish ran, or shared blocks without a reference
            self._give_back(ids, frames, handle.lease_id)
            raise refusal
        self.stats.add(published=1, blocks_published=len(ids))
        if layerwise and layers_ready:
            self.mark_ready(handle, layers_ready)
        return handle

    def _held_by_others(self, ids: list[int]) -> Optional[PoolError]:
        """(Under the lock.) On a kvbridge-allocated pool a handle owns one reference of each of its
        blocks: a block that live handles already hold every reference of would be freed under
        one of them when the other ends."""
        if self.pool.engine_allocated:
            return None              # the engine's blocks are pinned per handle
        for b in ids:
            held = self._by_block.get(b)
            if held and self.pool.refcount(b) <= len(held):
                return PoolError(f"publish: block {b} is already published in {len(held)} live handle(s) and "
                                 "has no reference left for another",
                                 hint="pool.ref() shared (prefix) blocks once for each further handle that "
                                      "names them; engine-allocated pools pin per handle themselves")
        return None

    def _give_back(self, ids: list[int], frames: Optional[FrameStore], lease_id: str = "") -> None:
        """Undo a refused publish: what it took goes, the caller's blocks stay the caller's (no
        ``on_free``: the caller never had the handle, and frees or reuses them as on any refusal)."""
        if frames is not None:
            frames.close()
        if self.pool.engine_allocated:
            self.pool.unpin(ids)
        if lease_id and self.leases is not None:
            try:
                self.leases.revoke(lease_id, self.owner)
            except KVBridgeError:
                pass        # nobody holds the handle: the lease lapses at its TTL

    def _named(self, handle: Union[HandleForm, Transfer]) -> tuple[bytes, Optional[KVHandle]]:
        """(handle id, the handle where ``handle`` holds one) of a handle in any form the engine
        may keep it: a :class:`KVHandle`, its bytes, its dict, its 16-byte id, or a push's
        :class:`Transfer`. Anything else is a :class:`BadHandle` (handle bytes were taken for an id
        and named no handle: revoke() said False, the blocks stayed pinned until the TTL)."""
        if isinstance(handle, Transfer):
            if handle.handle is None:    # a fetch's transfer: no handle of this sender
                raise ConfigError("a transfer named here is a push's (KVSender.push)")
            handle = handle.handle
        if isinstance(handle, KVHandle):
            return handle.handle_id, handle
        if isinstance(handle, (bytes, bytearray, memoryview)) and len(handle) == _ID_LEN:
            return bytes(handle), None
        if isinstance(handle, (bytes, bytearray, memoryview, dict)):
            h = parse_ticket(handle)
            return h.handle_id, h
        raise BadHandle(f"expected a KVHandle, its bytes, its dict or its 16-byte id, got {type(handle).__name__}")

    def mark_ready(self, handle: Union[HandleForm, Transfer], layers: int) -> bool:
        """Layers ``0..layers-1`` of a layer-wise handle (or push) are final: checksum them and
        wake the readers (or the push) waiting for them. Calls may repeat; counts never go back.
        Returns False when the handle has already ended (released, cancelled by the receiver,
        expired): nothing waits for its layers any more, so the prefill can skip the rest."""
        hid, h = self._named(handle)
        with self._lock:
            rec = self._records.get(hid)
        if rec is not None:
            h = rec.handle
        if h is not None and not h.layerwise:
            raise ConfigError("mark_ready() takes a layer-wise handle (publish(..., layers_ready=n)) or a push")
        if rec is None:
            return False
        L = self.pool.layout.num_layers
        n = whole_number(layers)
        if n is None or not 0 <= n <= L:
            raise ConfigError(f"mark_ready: {layers!r} layers: a whole number in 0..{L}")
        layers = n
        start = rec.ready
        if layers <= start:
            return rec.live
        if rec.frames is not None:         # a coded handle: its frames carry their own hashes
            rec.frames.encode_upto(layers)   # under the store's lock: each layer encoded once, in its slot
            new: list[list[int]] = [[] for _ in range(start, layers)]
        else:
            new = ([layer_checksums(self.pool, rec.block_ids, range(i, i + 1)) for i in range(start, layers)]
                   if self.checksums else [[] for _ in range(start, layers)])
        with self._ready_cv:
            if rec.ready >= layers:          # a concurrent call got as far first
                return rec.live
            rec.sums.extend(new[rec.ready - start:])   # the layers a concurrent call did not add
            rec.ready = layers
            if layers == L and rec.frames is None and rec.live:
                self._index_small(rec)
            self._ready_cv.notify_all()
        return rec.live

    def revoke(self, handle: HandleForm, reason: FreeReason = "revoked") -> bool:
        """End a handle now (e.g. the request was aborted); frees once reads drain. ``handle``: the
        handle, its bytes, its dict or its id (``handle_id``). False when it had ended already."""
        hid, _ = self._named(handle)
        with self._lock:
            rec = self._records.get(hid)
        return self._end(rec, reason) if rec else False

    def _on_retire(self, blocks: list[int]) -> None:
        """The engine retired pinned blocks: the handles naming them no longer hold their KV."""
        with self._lock:
            recs = {k: r for b in blocks for k, r in self._by_block.get(b, {}).items()}
        for r in recs.values():
            log.warning("engine retired blocks of live handle %s (request %r); ending it",
                        r.handle.id, r.handle.request_id)
            self._end(r, "retired")

    # -- push ------------------------------------------------------------------------------
    def push(self, reservation: Union[KVHandle, bytes, dict[str, Any]], block_ids: Sequence[int],
             num_tokens: Optional[int] = None, *, layers_ready: Optional[int] = None,
             ttl: Optional[float] = None) -> Transfer:
        """Write ``block_ids`` into the blocks a decode side reserved (``reservation``: its
        :attr:`Transfer.reservation`, as a handle, bytes or dict). Returns at once; the
        returned :class:`Transfer` runs on this sender's workers. ``layers_ready=n``: only
        layers ``0..n-1`` are final yet -- announce the rest with ``mark_ready(transfer, k)``;
        each batch of ready layers is written as it becomes ready. The blocks stay pinned
        until the push ends (``on_free`` with reason ``"pushed"`` or ``"aborted"``)."""
        res = parse_ticket(reservation)
        if not res.reservation:
            raise BadHandle("push() takes a reservation (KVReceiver.reserve), not a handle")
        if res.lease_id and res.lease_id != res.lease_digest():
            raise AccessDenied("reservation's token or contents do not match its lease: altered or forged")
        L = self.pool.layout
        if res.layout_hash != L.compat_hash:
            raise LayoutMismatch(f"reservation layout {res.layout_hash} != this pool's {L.compat_hash} "
                                 f"({L.compat_key()})")
        block_ids = block_id_list(block_ids, "push")
        if len(block_ids) != res.num_blocks:
            raise PoolError(f"the reservation holds {res.num_blocks} blocks, push names {len(block_ids)}")
        if not res.urls:
            raise BadHandle("reservation names no receiver URL")
        n = res.num_tokens if num_tokens is None else num_tokens
        h = self._publish(res.request_id, block_ids, n, ttl, L.num_layers if layers_ready is None else layers_ready,
                          leased=False)
        t = Transfer(res.request_id, L.num_layers, lambda t: self._run_push(t, h, res))
        t.handle, t.ends_itself = h, True    # cancelled before it started, it still ends h and tells the receiver
        self.stats.add(pushes=1)
        with self._lock:   # submitted before close() stops the workers; else it fails here, at once
            if not self._closed:
                return self._workers.submit(t)
        t._run(inline=True)   # close() ended its handle: it fails and tells the receiver (WABORT)
        return t

    def _run_push(self, t: Transfer, h: KVHandle, res: KVHandle) -> FetchResult:
        """A push reads its blocks for the wire until it ends: it holds them in flight, as a read
        does, so a revoke, expiry or close meanwhile frees them only once it has."""
        with self._lock:
            rec = self._records.get(h.handle_id)
            if rec is not None:
                rec.inflight += 1
        try:
            return run_push(self, t, h, res)
        finally:
            if rec is not None:
                self._read_done(rec)

    def _transport_after_close(self, url: str) -> tuple[Transport, bool]:
        """The sender's transport for ``url``'s scheme, and whether the caller must close it: work
        that may run while or after :meth:`close` (a cancelled push telling its receiver) gets a
        transport of its own once close() has taken the shared ones (kept, nothing would close it)."""
        scheme = scheme_of(url)
        with self._lock:
            if not self._transports_taken:
                t = self._transports.get(scheme)
                if t is None:
                    t = self._transports[scheme] = get_transport_class(scheme)(self.timeout)
                return t, False
        return get_transport_class(scheme)(self.timeout), True

    # -- lifetime -------------------------------------------------------------------------
    def renew(self, handle: HandleForm, ttl: float) -> None:
        """Extend a live handle's lifetime (and its lease) by ``ttl`` seconds from now (``handle`` in
        any form :meth:`revoke` takes)."""
        hid, _ = self._named(handle)
        with self._lock:
            rec = self._records.get(hid)
        if rec is None:
            raise HandleNotFound(f"handle {hid.hex()} is not live")
        check_ttl("renew", ttl)
        sent_at = time.monotonic()
        if self.leases is not None and rec.handle.lease_id:
            self.leases.renew(rec.handle.lease_id, self.owner, ttl)
            rec.deadline = max(rec.deadline, owner_deadline(time.monotonic(), ttl, margin_s=self.clock_margin))
            rec.alive_until = max(rec.alive_until, holds_until(sent_at, ttl, margin_s=self.clock_margin))
        else:
            rec.deadline = max(rec.deadline, sent_at + ttl)

    def close(self) -> None:
        """Stop serving and free every unreleased handle; returns once the reads and pushes in
        flight have drained (at most ``Timeout.transfer``) and their blocks were freed."""
        for s in self.servers:
            s.close()
        with self._lock:
            self._closed = True
            recs = list(self._records.values())
        for r in recs:
            self._end(r, "closed")
        with self._lock:   # only now may the sweeper stop: ends above may have left frees to it
            self._ended_all = True
            self._lock.notify_all()
        self._workers.close()
        end = time.monotonic() + self.timeout.transfer
        with self._lock:   # reads (their connections shut) and pushes in flight end: their blocks go first
            while any(r.inflight for r in recs) and time.monotonic() < end:
                self._lock.wait(0.01)
        if self.pool.engine_allocated and self._on_retire in self.pool.on_retire:
            self.pool.on_retire.remove(self._on_retire)
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        with self._owed_lock:
            self._owed_lock.notify_all()
            owed = self._owed_thread
        if owed is not None:
            owed.join(timeout=2)
        with self._lock:
            transports = list(self._transports.values())
            self._transports.clear()
            self._transports_taken = True
        for t in transports:
            t.close()
        self._push_stores.close()
        if self.leases is not None and self._own_store:
            self.leases.close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
