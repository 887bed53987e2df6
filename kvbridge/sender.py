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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

from . import blockcopy
from .errors import (AccessDenied, BadHandle, ConfigError, ConnectionLost, HandleNotFound, KVBridgeError,
                     LayoutMismatch, LeaseStoreUnavailable, PoolError, ProtocolError, StaleHandle)
from .codecs import CodecChoice, available_codecs, choose_codec, is_lossless, measure_codec_speeds
from .frames import FrameStore, check_codec
from .handle import ID_OFFSET, KVHandle, find_issued, lookup_ticket
from .integrity import block_checksums, layer_checksums, pack_sums
from .logs import RateLimitedLog
from .lease import Claim, LeaseState, LeaseStore, holds_until, owner_deadline
from .metrics import SenderStats
from .policy import Retry, Timeout, _seconds
from .pool import KVPool, block_id_list, whole_number
from .published import Deadlines, Grant, parse_ticket, Record, still_ours
from .pushing import run_push
from .stores import LeasesArg, StoreCache
from .transfer import FetchResult, Transfer, Workers
from .transports.base import Server, Spans, Transport
from .transports.registry import get_transport_class, scheme_of
from .transports.sockets import SMALL_REPLY
from .transports.wire import FrameReader

__all__ = ["KVSender", "FreeReason"]

log = logging.getLogger("kvbridge.sender")
_limited = RateLimitedLog(log)
FreeReason = str   # "released" | "aborted" | "expired" | "revoked" | "retired" | "pushed" | "closed"
SWEEP_INTERVAL = 1.0
EVENT_BATCH = 0.005   # seconds the lease watcher waits after a batch of events before reading more
LAYER_WAIT = 0.25   # a read of a layer not ready yet waits this long on the sender, then asks again
LEASE_DOWN_WAIT = 1.0   # seconds after a revoke found the lease server down during which none is tried


class KVSender:
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
        _seconds("KVSender", "ttl", ttl)
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
        self._key = secret if secret is not None else os.urandom(32)
        self._records: dict[bytes, Record] = {}
        # handle id -> (bytes issued, block ids, generations) of the live handles whose whole
        # reads C answers by itself (serve_small): raw, complete, unleased, a few host blocks
        self._small: dict[bytes, tuple[bytes, tuple[int, ...], tuple[int, ...]]] = {}
        self._by_lease: dict[str, Record] = {}
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
        if not 0 <= num_tokens <= len(ids) * L.block_size:
            raise ConfigError(f"{num_tokens} tokens do not fit {len(ids)} blocks of {L.block_size}")
        layerwise = layers_ready is not None
        if layerwise and not 0 <= int(layers_ready) <= L.num_layers:  # type: ignore[arg-type]
            raise ConfigError(f"layers_ready={layers_ready} outside 0..{L.num_layers}")
        ttl = self.ttl if ttl is None else ttl
        _seconds("publish", "ttl", ttl)   # nan, inf, 0 or less: refused, not a raw error or a dead handle
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
            sent_at = time.monotonic()
            expires_at_ms = int((time.time() + ttl) * 1000)
            if self.leases is not None and leased:
                lease = self.leases.publish(bare.lease_digest(), self.owner, ttl, num_blocks=len(ids))
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
        deadline = owner_deadline(sent_at, ttl, margin_s=self.clock_margin) if bare.lease_id else sent_at + ttl
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
            self.mark_ready(handle, int(layers_ready))
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

    def mark_ready(self, handle: Union[KVHandle, Transfer], layers: int) -> bool:
        """Layers ``0..layers-1`` of a layer-wise handle (or push) are final: checksum them and
        wake the readers (or the push) waiting for them. Calls may repeat; counts never go back.
        Returns False when the handle has already ended (released, cancelled by the receiver,
        expired): nothing waits for its layers any more, so the prefill can skip the rest."""
        h = handle.handle if isinstance(handle, Transfer) else handle
        if h is None or not h.layerwise:
            raise ConfigError("mark_ready() takes a layer-wise handle (publish(..., layers_ready=n)) or a push")
        with self._lock:
            rec = self._records.get(h.handle_id)
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

    def revoke(self, handle: Union[KVHandle, bytes], reason: FreeReason = "revoked") -> bool:
        """End a handle now (e.g. the request was aborted); frees once reads drain."""
        hid = handle.handle_id if isinstance(handle, KVHandle) else bytes(handle)
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

    # -- BlockSource (called by transport servers) ---------------------------------------
    def _lookup(self, handle_bytes: bytes) -> Record:
        try:
            return lookup_ticket(self._records, handle_bytes, self._key)
        except (BadHandle, HandleNotFound):
            self.stats.add(refused=1)
            raise

    def _wait_layers(self, rec: Record, first: int, end: int) -> int:
        """Wait (bounded) until layer ``first`` is ready; the end of the ready part of [first, end)."""
        with self._ready_cv:
            self._layer_waiters += 1
            try:
                self._ready_cv.wait_for(lambda: rec.ready > first or not rec.live, LAYER_WAIT)
            finally:
                self._layer_waiters -= 1
            return max(first, min(end, rec.ready))

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]],
                  claim: Optional[Claim] = None, layers: Optional[tuple[int, int]] = None) -> Grant:
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            if claim is None:
                self.stats.add(refused=1)
                raise AccessDenied("this handle is leased: reads must carry the claimer and its fence")
            try:
                if claim.epoch == 0:      # CLAIM_ME: claim on the reader's behalf, one round trip
                    ttl = min(max(claim.counter / 1000, 0.001), 3600.0)
                    lease = self.leases.claim(rec.handle.lease_id, claim.claimer, ttl)
                    claim = Claim(claim.claimer, lease.fence.epoch, lease.fence.counter)
                else:
                    self.leases.validate(rec.handle.lease_id, claim.claimer, claim.fence)
            except StaleHandle:
                self.stats.add(refused=1)
                raise
        else:
            claim = None
        n = len(rec.block_ids)
        if indices is None:
            ids = rec.block_ids
        else:
            if any(not 0 <= i < n for i in indices):
                raise ProtocolError(f"block index out of range for a {n}-block handle")
            if len(set(indices)) != len(indices):   # a repeated index would multiply the bytes served
                raise ProtocolError("repeated block indices in a read")
            ids = [rec.block_ids[i] for i in indices]
        L = self.pool.layout.num_layers
        lo = hi = 0
        if layers is not None:
            if not (rec.handle.layerwise or rec.frames is not None):
                raise ProtocolError("layer reads are for layer-wise or coded handles; read this one whole")
            lo = layers[0]
            if not lo < L:
                raise ProtocolError(f"layer {lo} outside a {L}-layer handle")
            if rec.frames is not None and indices is not None:
                raise ProtocolError("a coded handle is read whole: its frames hold every block")
            hi = self._wait_layers(rec, lo, min(layers[1], L))
            if rec.frames is not None and not rec.handle.layerwise:
                hi = L                          # one frame holds every layer
        with self._lock:
            if not rec.live:
                self.stats.add(refused=1)
                raise StaleHandle(f"handle {rec.handle.id} was {rec.reason}; its blocks are gone")
            if not self.pool.same_generations(rec.block_ids, rec.handle.generations):
                self.stats.add(refused=1)
                raise StaleHandle(f"blocks of handle {rec.handle.id} were freed and reused")
            if layers is None and (rec.ready < L or rec.frames is not None):
                raise ProtocolError("layer-wise and coded handles are read by layer range")
            rec.inflight += 1
        try:
            sums = b""
            if layers is not None and rec.frames is not None:
                spans = rec.frames.spans(lo, hi)
            elif layers is not None:
                spans = Spans.of_blocks(self.pool, ids, range(lo, hi))
                if self.checksums and hi > lo:
                    sel = rec.sums[lo:hi] if indices is None else [[s[i] for i in indices] for s in rec.sums[lo:hi]]
                    sums = pack_sums([x for layer in sel for x in layer])
            elif indices is None and rec.spans is not None:
                spans = rec.spans
            else:
                spans = Spans.of_blocks(self.pool, ids)
        except BaseException:
            self._read_done(rec)
            raise
        self.stats.served(spans.nbytes)
        return Grant(self, rec, spans, (lo, hi), sums, claim)

    def serve_small(self, fd: int, payload: bytes, req_id: int) -> bool:
        """Answer a READ request's ``payload`` on socket ``fd`` in one C call
        (``blockcopy.serve_small``) where it asks for all of a handle this sender indexed for
        that (:meth:`_index_small`), in exactly the bytes issued, and its blocks still hold the
        handle's generations once copied out. False where nothing was sent: :meth:`open_read`
        serves the read, or says precisely why not. A send that fails raises OSError."""
        small = self._small
        if not small:
            return False
        pool = self.pool
        assert blockcopy.serve_small is not None          # indexed only with the extension
        pinned = pool.buffers                             # held across the C copy
        try:
            n = blockcopy.serve_small(fd, payload, req_id, small, ID_OFFSET, pool.live_generations,
                                      blockcopy.planes(pool), pool.layout.part_nbytes)
        except (ValueError, PoolError):                   # a closed pool: the long way says so
            return False
        del pinned
        if n < 0:
            return False
        self.stats.served(n)
        return True

    def serve_next(self, fd: int, reader: FrameReader) -> bool:
        """The frame loop's next step on socket ``fd`` when ``reader`` holds nothing: one receive
        into its buffer, and a whole READ at the front answered in the same C call
        (``blockcopy.serve_next``) exactly where :meth:`serve_small` would answer it. True when
        it was (any bytes behind it stay in the reader); False when the bytes received are the
        reader's to parse as usual. The socket's timeout raises BlockingIOError and a closed peer
        ConnectionLost, as the reader's own receive does; a failed send, OSError."""
        if blockcopy.serve_next is None:                  # no extension: the reader receives
            return False
        pool = self.pool
        pinned = pool.buffers                             # held across the C copy
        try:
            packed = blockcopy.planes(pool)
        except PoolError:                                 # a closed pool: the reader receives
            return False
        served, used, got = blockcopy.serve_next(fd, reader.buf, self._small, ID_OFFSET, pool.live_generations,
                                                 packed, pool.layout.part_nbytes)
        del pinned
        if got < 0:
            if got == -2:
                raise BlockingIOError("no frame within the socket's timeout")
            raise ConnectionLost("peer closed the connection")
        if served < 0:
            reader.start, reader.end = 0, got
            return False
        reader.start, reader.end = (0, 0) if used == got else (used, got)
        self.stats.served(served)
        return True

    def _index_small(self, rec: Record) -> None:
        """Under the lock, for a live, raw, complete handle: where it is unleased and a few host
        blocks, :meth:`serve_small` may serve its whole reads (until :meth:`_mark_ended`)."""
        h = rec.handle
        if (blockcopy.serve_small is not None and not h.lease_id and self.pool.is_host
                and len(rec.block_ids) * self.pool.layout.block_nbytes <= SMALL_REPLY):
            self._small[h.handle_id] = (rec.raw, h.block_ids, h.generations)

    def release_remote(self, handle_bytes: bytes) -> None:
        """A direct release (handles without a lease). A leased handle ends only through its
        lease: a holder of the handle bytes is not necessarily its claimer."""
        self._end(self._releasable(handle_bytes), "released")

    def release_many(self, many: Sequence[bytes]) -> list[Optional[KVBridgeError]]:
        """:meth:`release_remote` of each, ended under one hold of the lock and freed in one
        pass (releases that arrived together); per release, None or why it was refused."""
        out: list[Optional[KVBridgeError]] = []
        recs: list[Record] = []
        records, leased = self._records, self.leases is not None
        for raw in many:
            rec = find_issued(records, raw)        # the usual one: exactly the bytes issued, unleased
            if rec is not None and not (leased and rec.handle.lease_id):
                recs.append(rec)
                out.append(None)
                continue
            try:
                recs.append(self._releasable(raw))   # refused, saying precisely why
                out.append(None)
            except KVBridgeError as exc:
                out.append(exc)
        with self._mutex:
            free = [r for r in recs if self._mark_ended(r, "released")]
        if len(free) == 1:
            self._release_blocks(free[0])
        elif free:
            self._release_many_blocks(free)
        return out

    def _releasable(self, handle_bytes: bytes) -> Record:
        rec = self._lookup(handle_bytes)
        if self.leases is not None and rec.handle.lease_id:
            self.stats.add(refused=1)
            raise AccessDenied("a leased handle is released through its lease, by its claimer")
        return rec

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
        if len(block_ids) != res.num_blocks:
            raise PoolError(f"the reservation holds {res.num_blocks} blocks, push names {len(block_ids)}")
        if not res.urls:
            raise BadHandle("reservation names no receiver URL")
        n = res.num_tokens if num_tokens is None else num_tokens
        h = self._publish(res.request_id, block_ids, n, ttl, L.num_layers if layers_ready is None else layers_ready,
                          leased=False)
        t = Transfer(res.request_id, L.num_layers, lambda t: self._run_push(t, h, res))
        t.handle = h
        self.stats.add(pushes=1)
        with self._lock:   # submitted before close() stops the workers; else it fails here, at once
            if not self._closed:
                return self._workers.submit(t)
        t._run()           # close() ended its handle: it fails and tells the receiver (WABORT)
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

    def _transport(self, url: str) -> Transport:
        scheme = scheme_of(url)
        with self._lock:
            t = self._transports.get(scheme)
            if t is None:
                t = self._transports[scheme] = get_transport_class(scheme)(self.timeout)
        return t

    # -- lifecycle -----------------------------------------------------------------------
    def _mark_ended(self, rec: Record, reason: FreeReason) -> bool:
        """Under the lock: end ``rec`` (no reader sees it live from now on). True when its blocks
        are to be freed now, by the caller (it claimed the free); False when it had ended
        already, a read still holds it, or its lease must be revoked first (``rec.revoking``)."""
        if not rec.live:
            return False
        rec.live = False
        rec.reason = reason
        self._small.pop(rec.handle.handle_id, None)
        self._records.pop(rec.handle.handle_id, None)
        for srv in self.servers:
            if srv.watches_ends:
                srv.ended(rec.handle.handle_id)    # one-sided readers see the end before any free
        if rec.handle.lease_id:
            self._by_lease.pop(self._lease_ref(rec.handle.lease_id), None)
        if self._by_block:
            for b in rec.block_ids:
                held = self._by_block.get(b)
                if held is not None:
                    held.pop(id(rec), None)
                    if not held:
                        del self._by_block[b]
        if self._layer_waiters:
            self._ready_cv.notify_all()   # readers and pushes waiting for its layers: it is over
        revoke = (self.leases is not None and bool(rec.handle.lease_id)
                  and reason not in ("released", "aborted"))
        rec.revoking = revoke   # a read draining meanwhile must not free before the revoke lands
        if not revoke and rec.inflight == 0 and not rec.freed:   # the usual end: freed at once
            rec.freed = True
            return True
        return False

    def _end(self, rec: Record, reason: FreeReason) -> bool:
        with self._mutex:
            if not rec.live:
                return False
            free_now = self._mark_ended(rec, reason)
            revoke = rec.revoking
        if free_now:
            self._release_blocks(rec)
            return True
        if revoke:
            assert self.leases is not None
            # Revoke in Redis first: after this, no claimer's validate can succeed. Within a moment
            # of a revoke that found the lease server down, none is tried: each would wait out its
            # retries (a close() or sweep of many handles took minutes); freeing at the deadline is safe.
            down = time.monotonic() < self._lease_down_until
            try:
                if not down:
                    self.leases.revoke(rec.handle.lease_id, self.owner)
            except LeaseStoreUnavailable:
                down, self._lease_down_until = True, time.monotonic() + LEASE_DOWN_WAIT
            except StaleHandle:
                pass   # already gone in Redis
            if down:
                if time.monotonic() < rec.deadline:
                    _limited.log(logging.WARNING, "revoke", "cannot revoke %s (lease server down); freeing at "
                                 "its deadline", rec.handle.request_id)
                    with self._lock:
                        rec.free_after = rec.deadline
                        rec.revoking = False
                        self._pending.append(rec)
                        self._lock.notify_all()
                    return True
        with self._lock:
            rec.revoking = False
            free_now = rec.inflight == 0
        if free_now:
            self._free(rec)
        return True

    def _read_done(self, rec: Record) -> None:
        with self._lock:
            rec.inflight -= 1
            free_now = not rec.live and rec.inflight == 0 and not rec.free_after and not rec.revoking
        if free_now:
            self._free(rec)

    def _free(self, rec: Record) -> None:
        with self._lock:
            if rec.freed:
                return
            rec.freed = True
        self._release_blocks(rec)

    def _release_blocks(self, rec: Record) -> None:
        """Give a record's blocks back (once: the caller set ``rec.freed`` under the lock)."""
        try:
            self.pool.free(still_ours(self.pool, rec))
        except PoolError as exc:   # the engine freed them behind our back
            log.error("freeing blocks of %s: %s", rec.handle.request_id, exc)
        if rec.frames is not None:
            rec.frames.close()
        self.stats.ended(rec.reason, len(rec.block_ids))
        self._tell_engine(rec)

    def _release_many_blocks(self, recs: list[Record]) -> None:
        """:meth:`_release_blocks` of records that ended together (all for the same reason):
        their blocks freed in one pass, one by one only if that pass is refused."""
        try:
            self.pool.free([b for r in recs for b in still_ours(self.pool, r)])
        except PoolError:          # some were freed behind our back: find which, free the rest
            for r in recs:
                try:
                    self.pool.free(still_ours(self.pool, r))
                except PoolError as exc:
                    log.error("freeing blocks of %s: %s", r.handle.request_id, exc)
        for r in recs:
            if r.frames is not None:
                r.frames.close()
        self.stats.ended(recs[0].reason, sum(len(r.block_ids) for r in recs), len(recs))
        for r in recs:
            self._tell_engine(r)

    def _tell_engine(self, rec: Record) -> None:
        """``on_free``: the engine may reuse the blocks now."""
        if self.on_free is not None:
            try:
                self.on_free(rec.handle, rec.reason)
            except Exception:
                log.exception("on_free callback failed")

    def _schedule(self, rec: Record) -> None:
        """``rec``'s deadline to the sweeper (under the lock), woken only when it is the earliest."""
        if self._deadlines.push(rec, self._records):
            self._lock.notify_all()

    def _sweep_loop(self) -> None:
        """Local deadlines: expire unreleased handles; free revoked ones Redis never heard of."""
        while True:
            with self._lock:
                if self._ended_all and not self._pending:
                    return
                now = time.monotonic()
                due = self._deadlines.due(now, self._records)
                ripe = [r for r in self._pending if r.free_after <= now and r.inflight == 0]
                if ripe:
                    self._pending = [r for r in self._pending if r not in ripe]
                if not due and not ripe:
                    times = [r.free_after for r in self._pending]
                    if self._deadlines.earliest is not None:
                        times.append(self._deadlines.earliest)
                    nxt = min(times, default=now + 1.0)
                    self._lock.wait(timeout=max(0.005, min(1.0, nxt - now)))
                    continue
            for r in ripe:
                self._free(r)
            for r in due:
                self._end(r, "expired")

    def _lease_ref(self, lease_id: str) -> str:
        return self.leases.ref(lease_id) if self.leases is not None else lease_id

    def _lease_loop(self) -> None:
        """Learn of releases/aborts from the owner's event stream; sweep as the fallback."""
        assert self.leases is not None
        next_sweep = time.monotonic() + SWEEP_INTERVAL
        while not self._closed:
            try:
                evs = self.leases.events(self.owner, timeout_s=0.2)
                for ev in evs:
                    rec = self._by_lease.get(ev.ref)
                    if rec is not None and ev.kind in ("released", "aborted"):
                        self._end(rec, ev.kind)
                if evs:   # let the next releases gather: one wake-up per batch, not one per release
                    time.sleep(EVENT_BATCH)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_INTERVAL
                    self._sweep_leases()
            except LeaseStoreUnavailable as exc:
                _limited.log(logging.WARNING, "unreachable", "lease server unreachable: %s", exc)
                time.sleep(0.2)
            except Exception:   # never let the watcher die silently
                log.exception("lease watcher error")
                time.sleep(0.2)

    def _sweep_leases(self) -> None:
        """One round trip: end the handles whose lease Redis reports finished or gone."""
        assert self.leases is not None
        live = {r.handle.lease_id: r for r in list(self._records.values()) if r.handle.lease_id}
        if not live:
            return
        for lid, state in self.leases.sweep(self.owner, list(live)).items():
            if state is None:
                self._end(live[lid], "expired")
            elif state in (LeaseState.RELEASED, LeaseState.ABORTED):
                self._end(live[lid], state.value)

    def renew(self, handle: KVHandle, ttl: float) -> None:
        """Extend a live handle's lifetime (and its lease) by ``ttl`` seconds from now."""
        with self._lock:
            rec = self._records.get(handle.handle_id)
        if rec is None:
            raise HandleNotFound(f"handle {handle.id} is not live")
        _seconds("renew", "ttl", ttl)
        sent_at = time.monotonic()
        if self.leases is not None and rec.handle.lease_id:
            self.leases.renew(rec.handle.lease_id, self.owner, ttl)
            rec.deadline = max(rec.deadline, owner_deadline(sent_at, ttl, margin_s=self.clock_margin))
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
        with self._lock:
            transports = list(self._transports.values())
            self._transports.clear()
        for t in transports:
            t.close()
        self._push_stores.close()
        if self.leases is not None and self._own_store:
            self.leases.close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
