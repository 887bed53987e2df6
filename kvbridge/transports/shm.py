"""shm:// -- same host: one side maps the other's shared-memory pool and memcpys.

Pull: the sender's pool must live in POSIX shared memory (``KVPool.allocate(...,
shared=True)``). A small control channel (a unix socket) carries the same
handle/token checks as tcp: MAP asks for the handle's blocks (or the ready layers of a
layer-wise handle) and gets the segment name and byte runs; the receiver maps the
segment read-only, copies, then DONE asks whether the handle is still valid -- the
server holds an in-flight count between MAP and DONE, so the blocks cannot be freed
under the copy, and a stale answer discards the bytes.

One-sided reads (whole raw handles, host destinations, x86-64): the first read from a
sender sends OPEN, which is authorized like a MAP and answers where the sender's pool, its
block generations and its live-handle table are; the receiver maps them read-only and
from then on reads with no message at all -- check, copy, re-check, seqlock-style (see
:mod:`.shmtable` for the safety argument). A whole handle into whole blocks of this pool's
geometry is checked, copied (each block hashed as it lands, in the same pass as the copy where
the CPU has AVX2) and checked again in one C call (``kvbridge.blockcopy.shm_read``); some
blocks of one take the same steps in Python around :func:`kvbridge.blockcopy.copy_blocks`.
Whether the sender still lives is asked at most once per ``LIVENESS_EVERY`` (a
read just after it died still passed the checks above, so its bytes are the handle's).
Leased handles are claimed by the receiver in the lease store. The re-check after the copy
(DONE, on the MAP path) is the validate-after-read
of the bytes and of the handle (the owner ends a handle in its table before it revokes or frees
anything); the claim's reply, which the receiver keeps, bounds how long the claim certainly
holds. Together they let a leased fetch skip the lease round trip after the copy
(``docs/LEASES.md``). The owner does not vouch for its lease's TTL here: a claim the receiver
did not make itself (``CLAIM_ME`` on the MAP path) is validated in the store after the read.

Push: the receiver's pool must live in shared memory. WMAP asks for the reserved
blocks of some layers; the writer maps that segment writable, copies, and WDONE hands
over the checksums, which the receiver verifies over what landed before answering OK.
The receiver holds an in-flight count between WMAP and WDONE, so a cancel never frees
pages under the copy.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

from ..blockcopy import copy_blocks, planes
from ..blockcopy import shm_read as _shm_read
from ..errors import (ConfigError, KVBridgeError, PoolError, ProtocolError, StaleHandle, TransferCancelled,
                      TransferTimeout)
from ..handle import KVHandle
from ..integrity import block_checksums
from ..lease.base import Claim
from ..policy import Timeout
from ..pool import KVPool, SharedSegment, peer_cred, peer_segment, retired_during
from .base import Chunk, Server, Spans, SpansFor, Transport, copy_runs, generations_held, unverified
from .deadline import WATCHDOG
from .shmcopy import copy_into
from .shmtable import ONE_SIDED, HandleTable, SenderMap, open_info
from .sockets import MAX_PEERS, SocketClient, SocketServer, client_for, connector
from .staging import copy_slices, device_slices
from .tcp import _claim_of
from .wire import (FENCE, HEADER, LAYERS, FrameReader, Kind, decode_error, decode_layers, decode_request,
                   encode_layers, encode_request, pack, recv_exact, unpack_header)

__all__ = ["ShmTransport"]

_disarm = WATCHDOG.disarm

_RUN = struct.Struct("!QQ")
MAX_MAPPED = 16
# An OPEN reply (shmtable.open_info: a layout and one offset per buffer) held to this before its
# body is read: the reader builds a plane per layer and part from it (a 7.6 MiB one naming
# 4 million layers took 3.3 GB and 8 s)
MAX_OPEN_REPLY = 256 << 10
MAX_GRANTS = 16   # mappings (MAP/WMAP without their DONE/WDONE yet) one control connection may hold


def _path_of(url: str, scheme: str = "shm") -> str:
    """The control socket's address: ``shm:///path.sock`` a file, ``shm://@name`` Linux's
    abstract namespace (no file, nothing left behind by a killed process)."""
    u = urlsplit(url)
    if u.scheme != scheme:
        raise ConfigError(f"expected {scheme}:///path/to/control.sock or {scheme}://@name, got {url!r}")
    if u.netloc.startswith("@"):
        if len(u.netloc) < 2:
            raise ConfigError(f"empty abstract socket name in {url!r}")
        return "\0" + u.netloc[1:]
    return u.path


def _mapped_body(grant: Any, layers: tuple[int, int], sums: bytes, what: str) -> bytes:
    pool = grant.spans.pool
    if pool.segment is None:
        raise ConfigError(f"shm:// needs the {what}'s pool in shared memory: KVPool.allocate(..., shared=True)")
    offs = pool.buffer_offsets
    name = pool.segment.name.encode()
    c = getattr(grant, "claim", None)
    body = [FENCE.pack(c.epoch, c.counter) if c is not None else FENCE.pack(0, 0),
            encode_layers(*layers, sums), struct.pack("!H", len(name)), name,
            struct.pack("!I", len(grant.spans.segments))]
    body += [_RUN.pack(offs[b] + o, n) for b, o, n in grant.spans.segments]
    return b"".join(body)


class ShmServer(SocketServer):
    def __init__(self, *a: Any, **kw: Any) -> None:
        # per connection: request id -> (its grant, the monotonic time by which its DONE is due)
        self._open: dict[socket.socket, dict[int, tuple[Any, float]]] = {}
        self._glock = threading.Lock()
        self._watchers: set[socket.socket] = set()   # connections OPEN came on: their readers' liveness signal
        self.table: Optional[HandleTable] = None
        super().__init__(*a, **kw)
        pool = getattr(self.endpoint, "pool", None)
        if (ONE_SIDED and hasattr(self.endpoint, "open_read") and pool is not None
                and getattr(pool, "segment", None) is not None and getattr(pool, "gen_offset", None) is not None):
            try:
                self.table = HandleTable(pool.num_blocks)
            except BaseException:
                self.close()        # its threads and listener go; the real error propagates
                raise

    def published(self, handle_id: bytes, raw: bytes) -> None:
        if self.table is not None:
            self.table.add(handle_id, raw)

    def ended(self, handle_id: bytes) -> None:
        if self.table is not None:
            self.table.remove(handle_id)

    def close(self) -> None:
        super().close()
        if self.table is not None:
            self.table.close()

    def idle_timeout(self, conn: socket.socket) -> float:
        # A peer holding a mapping must finish its copy within the transfer timeout of its MAP,
        # whatever else it sends meanwhile; a reader's OPEN connection stays (parked, no thread)
        # as long as the reader keeps it.
        due = self._due(conn)
        if due is not None:
            return max(0.0, due - time.monotonic())
        return float("inf") if conn in self._watchers else super().idle_timeout(conn)

    def _due(self, conn: socket.socket) -> Optional[float]:
        """When the oldest mapping ``conn`` holds must be done; None when it holds none."""
        with self._glock:
            held = self._open.get(conn)
            return min(d for _, d in held.values()) if held else None

    def can_park(self, conn: socket.socket) -> bool:
        return not self._open.get(conn)

    def connection_closed(self, conn: socket.socket) -> None:
        with self._glock:
            grants = self._open.pop(conn, {})
            self._watchers.discard(conn)
        for g, _ in grants.values():
            g.close()

    def _hold(self, conn: socket.socket, req_id: int, grant: Any) -> None:
        with self._glock:
            self._open.setdefault(conn, {})[req_id] = (grant, time.monotonic() + self.timeout.transfer)

    def _take(self, conn: socket.socket, req_id: int) -> Any:
        with self._glock:
            held = self._open.get(conn, {}).pop(req_id, None)
        return None if held is None else held[0]

    def _refuse_map(self, conn: socket.socket, req_id: int) -> Optional[KVBridgeError]:
        """Why a MAP/WMAP with ``req_id`` may not open a mapping on ``conn`` (checked before any
        work): its id already holds one, or the connection holds ``MAX_GRANTS``."""
        with self._glock:
            held = self._open.get(conn, {})
            if req_id in held:
                return ProtocolError(f"request {req_id} already holds a mapping on this connection")
            if len(held) >= MAX_GRANTS:
                return ProtocolError(f"this connection already holds {MAX_GRANTS} mappings")
        return None

    def _body(self, grant: Any, layers: tuple[int, int], sums: bytes, what: str) -> bytes:
        """A MAPPED reply's body: where the granted blocks are (the segment and its runs)."""
        return _mapped_body(grant, layers, sums, what)

    def handle(self, conn: socket.socket, reader: FrameReader, kind: Kind, req_id: int, payload: bytes) -> bool:
        due = self._due(conn)
        if due is not None and time.monotonic() > due:     # a peer that keeps talking but never DONEs
            self._reply_error(conn, req_id, TransferTimeout("a mapping was held past the transfer timeout"))
            return False
        if kind is Kind.OPEN:
            if self.table is None:
                conn.sendall(pack(Kind.OK, req_id))       # not offered: the reader uses MAP/DONE
                return True
            try:   # authorized like a MAP of a live handle; holds nothing
                req = decode_request(payload)
                self.source.open_read(req.ticket, req.indices, req.claim).close()
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            with self._glock:
                self._watchers.add(conn)
            conn.sendall(pack(Kind.MAPPED, req_id, open_info(self.source.pool, self.table)))  # type: ignore[attr-defined]
            return True
        if kind in (Kind.MAP, Kind.WMAP):
            refused = self._refuse_map(conn, req_id)
            if refused is not None:
                self._reply_error(conn, req_id, refused)
                return True
            grant: Any = None
            try:
                req = decode_request(payload)
                if kind is Kind.MAP:
                    grant = self.source.open_read(req.ticket, req.indices, req.claim, req.layers)
                    layers = grant.layers if req.layers is not None else (0, 0)
                    body = self._body(grant, layers, grant.sums if req.layers is not None else b"", "sender")
                else:
                    if req.layers is None:
                        raise ProtocolError("WMAP frame names no layers")
                    grant = self.sink.open_write(req.ticket, req.layers, req.claim)
                    body = self._body(grant, grant.layers, b"", "receiver")
            except KVBridgeError as exc:
                if grant is not None:
                    grant.close()
                self._reply_error(conn, req_id, exc)
                return True
            self._hold(conn, req_id, grant)
            conn.sendall(pack(Kind.MAPPED, req_id, body))
            return True
        if kind in (Kind.DONE, Kind.WDONE):
            done = self._take(conn, req_id)
            if done is None:
                self._reply_error(conn, req_id, ProtocolError(f"{kind.name} for no open mapping"))
                return True
            try:
                if kind is Kind.DONE:
                    if not done.still_valid():
                        raise StaleHandle("blocks were freed during the copy; bytes discarded")
                else:
                    req = decode_request(payload)
                    done.finish(req.sums, req.last)
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            finally:
                done.close()
            conn.sendall(pack(Kind.OK, req_id))
            return True
        return super().handle(conn, reader, kind, req_id, payload)


def _parse_mapped(payload: bytes, pos: int) -> tuple[str, list[tuple[int, int]]]:
    try:
        (nl,) = struct.unpack_from("!H", payload, pos)
        name = payload[pos + 2:pos + 2 + nl].decode()
        (n,) = struct.unpack_from("!I", payload, pos + 2 + nl)
        base = pos + 6 + nl
        if len(payload) != base + n * _RUN.size:
            raise ProtocolError("MAPPED frame has the wrong length")
        return name, [_RUN.unpack_from(payload, base + i * _RUN.size) for i in range(n)]
    except (struct.error, UnicodeDecodeError):
        raise ProtocolError("MAPPED frame is malformed") from None


def _blockwise(m: SenderMap, pool: KVPool, dst_ids: Sequence[int], n: int) -> bool:
    """``n`` of the sender's blocks go whole into as many whole blocks ``dst_ids`` of ``pool``, of
    the same geometry on both sides: block-by-block copies (one C pass) are then exact. (A
    sender announcing another layout would have each copy spill into the next destination
    block: not here; m.part is derived from m.layout, so an equal compat hash means an equal
    part.)"""
    return len(dst_ids) == n and m.layout.compat_hash == pool.layout.compat_hash


# what the one-call read takes of a destination pool: (pool, its buffers, its planes -- b"" where
# whole blocks cannot be read into it in one call --, its generations list, bytes per block)
Lane = tuple[Any, Any, bytes, list[int], int]
LIVENESS_EVERY = 0.001   # seconds between two checks that a one-sided reader's sender is alive


class ShmTransport(Transport):
    scheme = "shm"
    server_class: type[ShmServer] = ShmServer
    # One-sided reads carry no message to claim in: the receiver claims in the lease store itself.
    claims_on_read = not ONE_SIDED
    validates_after_read = True   # the post-copy re-check (one-sided) or DONE (MAP path)
    vouches_lease_ttl = False     # ... of the bytes and the handle only: the claim's own reply bounds it

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._clients: dict[str, SocketClient] = {}
        self._by_url: dict[str, SocketClient] = {}          # the same clients by URL: no parse per release
        self._maps: OrderedDict[tuple[str, bool, int], SharedSegment] = OrderedDict()
        self._senders: dict[str, Optional[SenderMap]] = {}   # url -> mapped sender (None: MAP/DONE only)
        self._by_path: dict[str, Optional[SenderMap]] = {}   # the same by control socket (one per sender)
        self._lock = threading.Lock()
        self._opening: dict[str, list[Any]] = {}     # control socket -> [its OPEN lock, OPENs under way]
        self.after_copy: Optional[Callable[[KVHandle], None]] = None   # fault injection: runs between copy and re-check

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Timeout = Timeout()) -> Server:
        path = _path_of(url, cls.scheme) or f"\0kvb-{cls.scheme}-{os.getpid()}-{secrets.token_hex(6)}"  # abstract
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(path)
            lst.listen(128)
        except OSError as exc:
            lst.close()
            raise ConfigError(f"cannot listen on {path!r}: {exc}") from None
        abstract = path.startswith("\0")
        srv = cls.server_class(lst, f"{cls.scheme}://@{path[1:]}" if abstract else f"{cls.scheme}://{path}", source,
                               timeout)
        close = srv.close

        def close_and_unlink() -> None:
            close()
            if not abstract:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        srv.close = close_and_unlink  # type: ignore[method-assign]
        return srv

    def _client(self, url: str) -> SocketClient:
        c = self._by_url.get(url)
        if c is not None:
            return c
        path = _path_of(url, self.scheme)
        with self._lock:
            return client_for(self._clients, self._by_url, path, url,
                              lambda: SocketClient(connector(socket.AF_UNIX, path, url), self.timeout))

    def _segment(self, name: str, writable: bool, uid: int) -> SharedSegment:
        """The peer's segment, mapped once (read-only to read from, writable to push into); only
        a kvbridge segment that the peer's user owns (:func:`peer_segment`)."""
        key = (name, writable, uid)
        with self._lock:
            seg = self._maps.get(key)
            if seg is not None:
                self._maps.move_to_end(key)
                return seg
        try:
            seg = peer_segment(name, writable, uid)   # lazy: a copy faults in only the pages it touches
        except ConfigError as exc:
            raise StaleHandle(f"the peer's shared memory is gone: {exc}") from None
        with self._lock:
            self._maps[key] = seg
            while len(self._maps) > MAX_MAPPED:
                self._maps.popitem(last=False)[1].close()
        return seg

    def _exchange(self, url: str, kind: Kind, payload: bytes, move: Any, done: Kind, what: str) -> Any:
        """MAP/WMAP -> copy -> DONE/WDONE on one connection. ``move(body, peer)`` copies (from or
        into segments of the peer, ``peer`` its (pid, uid)) and returns (result, DONE payload)."""
        # Each half (MAP and its reply; DONE and its reply) must end within Timeout.transfer plus
        # its bytes at the minimum rate (the watchdog of .deadline, as on tcp://); the copy between
        # them is local memory, not the peer's pace, and is not held to it.
        client = self._client(url)
        start = time.monotonic()
        sock, k, rid, length = client.call(kind, payload, what, 0)
        try:
            if length:
                client.arm(sock, length, start)
            body = recv_exact(sock, length) if length else b""
            if k is Kind.ERROR:
                client.put_back(sock)
                raise decode_error(body)
            if k is not Kind.MAPPED:
                raise ProtocolError(f"{what}: unexpected {k.name} reply")
            cut = _disarm(sock)
            if cut:                            # cut as the reply's last byte came
                raise client.cut_error(what, cut)
            result, done_payload = move(body, peer_cred(sock))
            start = time.monotonic()
            client.arm(sock, len(done_payload), start)
            sock.sendall(pack(done, rid, done_payload))
            k2, _, l2 = unpack_header(recv_exact(sock, HEADER.size), data_ok=False)
            if l2:
                client.arm(sock, len(done_payload) + l2, start)
            reply = recv_exact(sock, l2) if l2 else b""
        except KVBridgeError as exc:
            if k is Kind.ERROR:
                raise exc from None
            raise client.fail(sock, exc, what) from None
        except RuntimeError as exc:    # the copy itself failed (torch, CUDA): closing ends the grant
            client.drop(sock)
            raise PoolError(f"{what}: the copy failed: {exc}") from exc
        except BaseException as exc:
            raise client.fail(sock, exc, what) from None
        client.put_back(sock)
        if k2 is Kind.ERROR:
            raise decode_error(reply)   # validate-after-copy failed: the bytes must not be used
        return result

    def _runs(self, body: bytes, pos: int, writable: bool,
              peer: tuple[int, int]) -> tuple[SharedSegment, list[tuple[int, int]]]:
        name, runs = _parse_mapped(body, pos)
        seg = self._segment(name, writable, peer[1])
        if any(o + n > seg.size for o, n in runs):
            raise ProtocolError("peer named bytes outside its segment")
        return seg, runs

    @staticmethod
    def _copy_in(dst: Spans, seg: SharedSegment, runs: list[tuple[int, int]]) -> int:
        if dst.pool.is_host:
            return copy_runs(dst.runs(), [(seg.address + o, k) for o, k in runs], dst.on_landed)
        whole = seg.tensor()   # a device pool: host-to-device straight from the mapped segment
        return copy_slices(device_slices(dst), [whole[o:o + k] for o, k in runs])

    def _sender(self, url: str, handle: KVHandle, claim: Optional[Claim]) -> Optional[SenderMap]:
        """The sender at ``url`` mapped for one-sided reads: OPEN once (a refusal of the
        handle is raised, as MAP would); None where the sender does not offer them."""
        try:
            return self._senders[url]
        except KeyError:
            pass
        path = _path_of(url, self.scheme)
        # One OPEN per sender, even when reads race; a sender slow to answer holds up only reads
        # from itself. Its lock lives while OPENs of it are under way (nothing kept per URL).
        with self._lock:
            entry = self._opening.setdefault(path, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                with self._lock:
                    if path in self._by_path:          # mapped meanwhile, or another URL of it
                        return self._keep(url, path, self._by_path[path])
                return self._open_sender(url, path, handle, claim)
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._opening[path]

    def _keep(self, url: str, path: str, m: Optional[SenderMap]) -> Optional[SenderMap]:
        """``m`` is the sender at ``url`` (its socket ``path``), this transport's lock held. At most
        ``MAX_PEERS`` URLs and senders are kept (handles naming ever new URLs -- unsigned ones
        from a hostile source, one socket under many spellings -- neither grow them nor map a
        sender twice): the oldest are forgotten."""
        self._senders[url] = self._by_path[path] = m
        while len(self._senders) > MAX_PEERS:
            del self._senders[next(iter(self._senders))]
        while len(self._by_path) > MAX_PEERS:
            old = self._by_path.pop(next(iter(self._by_path)))
            if old is not None:
                old.watch.close()          # any URL still naming it finds it gone at its next read
        return m

    def _open_sender(self, url: str, path: str, handle: KVHandle, claim: Optional[Claim]) -> Optional[SenderMap]:
        client = self._client(url)
        what = f"open {url}"
        start = time.monotonic()     # the OPEN and its whole reply: Timeout.transfer plus its bytes at the minimum rate
        sock, k, _, length = client.call(Kind.OPEN, encode_request(handle.to_bytes(), None, claim), what, 0)
        try:
            if k is Kind.MAPPED and length > MAX_OPEN_REPLY:     # a real one is a few KB
                raise ProtocolError(f"{what}: an OPEN reply of {length} bytes (at most {MAX_OPEN_REPLY})")
            if length:
                client.arm(sock, length, start)
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            raise client.fail(sock, exc, what) from None
        if k is Kind.ERROR:
            client.put_back(sock)
            raise decode_error(body)
        m: Optional[SenderMap] = None
        if k is Kind.MAPPED:
            cut = _disarm(sock)
            if cut:                            # kept as the liveness watch, never pooled: disarmed here
                sock.close()
                raise client.cut_error(what, cut)
            try:
                info = json.loads(body)
                uid = peer_cred(sock)[1]
                seg = peer_segment(info["segment"], False, uid)
                try:
                    table = peer_segment(info["table"], False, uid)
                except BaseException:
                    seg.close()
                    raise
            except ConfigError as exc:
                sock.close()
                raise StaleHandle(f"the peer's shared memory is gone: {exc}") from None
            except ProtocolError:
                sock.close()
                raise
            except (ValueError, KeyError, TypeError):
                sock.close()
                raise ProtocolError("OPEN reply is malformed") from None
            try:
                m = SenderMap(body, seg, table)
            except BaseException:
                seg.close()
                table.close()
                sock.close()
                raise
            sock.setblocking(False)
            m.watch = sock                     # kept: its EOF says the sender is gone
            m.poll = select.poll()
            m.poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        else:
            client.put_back(sock)
        with self._lock:
            return self._keep(url, path, m)

    def _forget(self, url: str, m: SenderMap) -> None:
        """Stop reading one-sided from a sender that went away. The mapping is left to the
        garbage collector: another thread may still be copying out of it."""
        with self._lock:
            if self._senders.get(url) is m:
                del self._senders[url]
            for path in [p for p, v in self._by_path.items() if v is m]:
                del self._by_path[path]
        m.watch.close()

    def _read_one_sided(self, url: str, m: SenderMap, handle: KVHandle, dst: Spans,
                        indices: Optional[list[int]]) -> Optional[int]:
        """Check, copy, re-check; None when the fast path cannot vouch for the read (the
        MAP/DONE exchange then answers, with the sender's own refusal if there is one)."""
        if (_shm_read is not None and indices is None and dst.block_ids is not None
                and _blockwise(m, dst.pool, dst.block_ids, handle.num_blocks)):
            return self._read_native(url, m, handle, dst)
        hit = m.lookup(handle.to_bytes())
        if hit is None:
            return None
        ids, want, gens, nb = handle.block_ids, handle.generations, m.gens, m.num_blocks
        for b, g in zip(ids, want):
            if not 0 <= b < nb or gens[b] != g:
                return None
        sel: Sequence[int]
        if indices is None:
            sel = ids
        else:
            n = len(ids)
            if any(not 0 <= i < n for i in indices) or len(set(indices)) != len(indices):
                return None
            sel = [ids[i] for i in indices]
        if dst.block_ids is not None and _blockwise(m, dst.pool, dst.block_ids, len(sel)):
            # one C pass copies them and, when asked, hashes each as it lands
            if dst.cancel is not None and dst.cancel.is_set():
                raise TransferCancelled("transfer cancelled")
            # Both memories stay mapped across the C call: the destination's buffers are held
            # here, and a slice of the sender's mapping makes closing it fail (BufferError).
            bufs, pin = dst.pool.buffers, None
            try:
                try:
                    pin = m.view[0:0]
                except ValueError:            # released: this reader is closing the mapping
                    raise ProtocolError("the sender's mapping was closed by this reader") from None
                dst.digests = copy_blocks(planes(dst.pool), dst.block_ids, m.packed, sel, m.part,
                                          dst.want_digests or dst.verifier is not None)
            except ValueError as exc:
                raise ProtocolError(f"one-sided read outside the mapped pools: {exc}") from None
            finally:
                if pin is not None:
                    pin.release()
                del bufs
            nbytes = dst.nbytes
        else:
            nbytes = copy_into(dst.views(), m.source_views(list(sel)), dst.on_landed)
        if self.after_copy is not None:
            self.after_copy(handle)
        stale = not m.still(*hit)
        for b, g in zip(ids, want):
            stale = stale or gens[b] != g
        if stale:
            dst.digests = None
            raise StaleHandle("blocks were freed during the copy; bytes discarded")
        return nbytes if self._alive(url, m) else None

    def _read_native(self, url: str, m: SenderMap, handle: KVHandle, dst: Spans) -> Optional[int]:
        """:meth:`_read_one_sided` of a whole handle into whole blocks of the same geometry in one
        C call (:meth:`_shm_read`). The same outcomes: None, the bytes, or StaleHandle."""
        if dst.cancel is not None and dst.cancel.is_set():
            raise TransferCancelled("transfer cancelled")
        assert dst.block_ids is not None
        lane = self._lane(m, dst.pool)   # the caller saw whole blocks of the same geometry: lane[2] is set
        read, dst.digests = self._shm_read(url, m, handle, lane, dst.block_ids,
                                           dst.want_digests or dst.verifier is not None)
        return dst.nbytes if read else None

    @staticmethod
    def _lane(m: SenderMap, pool: KVPool) -> Lane:
        """What the one-call read takes of the destination ``pool`` (``SenderMap.lane``), made once
        per pool and again where its buffers were replaced; its planes are b"" where it cannot
        take whole blocks into it (no extension, a device pool, another geometry than the sender's)."""
        lane = m.lane
        if lane is None or lane[0] is not pool or lane[1] is not pool.buffers:
            fits = _shm_read is not None and pool.is_host and m.layout.compat_hash == pool.layout.compat_hash
            lane = m.lane = (pool, pool.buffers, planes(pool) if fits else b"", pool.live_generations,
                             pool.layout.block_nbytes)
        return lane

    def _shm_read(self, url: str, m: SenderMap, handle: KVHandle, lane: Lane,
                  block_ids: Sequence[int], want: bool, expect: Optional[tuple[int, ...]] = None,
                  dst_gens: Optional[list[int]] = None) -> tuple[bool, Optional[list[int]]]:
        """``blockcopy.shm_read``: the handle live in the table and its generations as issued,
        the copy into ``block_ids`` of the lane's pool (hashed as it lands when ``want``), both
        again -- one C call. (True, the digests -- None unhashed, or equal to ``expect`` where
        given) once read; (False, None) where it cannot vouch for the read (nothing written, or
        the sender is gone: MAP/DONE then answers); StaleHandle where the blocks changed
        meanwhile; with ``dst_gens`` (the destination blocks' generations as the caller began),
        PoolError where one is not as it began after the copy."""
        after = self.after_copy
        # the lane holds the pool's buffers across the C call, as the mapping's view is pinned there
        assert _shm_read is not None
        try:
            code, sums = _shm_read(m.native, handle.to_bytes(), handle.block_ids, handle.generations,
                                   lane[2], block_ids, want, expect, None if dst_gens is None else (lane[3], dst_gens),
                                   None if after is None else (lambda: after(handle)))
        except ValueError as exc:
            try:
                len(m.view), len(m.gens), len(m.tview)
            except ValueError:            # released: this reader is closing the mapping
                raise ProtocolError("the sender's mapping was closed by this reader") from None
            raise ProtocolError(f"one-sided read outside the mapped pools: {exc}") from None
        if code == 2:
            raise StaleHandle("blocks were freed during the copy; bytes discarded")
        if code == 3:
            raise retired_during(handle.request_id)
        if code == 1 or (time.monotonic() >= m.poll_after and not self._alive(url, m)):
            return False, None
        return True, sums

    def _alive(self, url: str, m: SenderMap) -> bool:
        """Is the sender still there? Asked at most once per LIVENESS_EVERY: a poll releases the
        GIL, and bytes copied from a sender that died an instant ago were still checked valid.
        False: the sender closed or died; forgotten, so MAP/DONE says which."""
        alive = True
        now = time.monotonic()
        if now < m.poll_after:
            return True
        m.poll_after = now + LIVENESS_EVERY
        try:
            quiet = not m.poll.poll(0)        # nothing arrived on the control socket: no EOF
        except RuntimeError:                  # another thread is polling it: ask the socket
            quiet = False
        if not quiet:
            try:
                alive = m.watch.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive = True
            except OSError:
                alive = False
        if not alive:
            self._forget(url, m)
        return alive

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        if ONE_SIDED and dst.pool.is_host and not handle.layerwise and handle.codec == "raw" and (
                claim is None or claim.epoch != 0):
            m = self._sender(url, handle, claim)
            if m is not None:
                n = self._read_one_sided(url, m, handle, dst, indices)
                if n is not None:
                    return n
                dst.digests = None            # whatever a copy left is not what MAP/DONE will land

        def move(body: bytes, peer: tuple[int, int]) -> tuple[int, bytes]:
            dst.claimed = _claim_of(body, claim)
            seg, runs = self._runs(body, FENCE.size + LAYERS.size, False, peer)
            return self._copy_in(dst, seg, runs), b""
        return int(self._exchange(url, Kind.MAP, encode_request(handle.to_bytes(), indices, claim), move,
                                  Kind.DONE, f"map {url}"))

    def read_small(self, url: str, handle: KVHandle, pool: KVPool, block_ids: list[int], verify: bool,
                   gens: list[int]) -> Optional[tuple[int, Optional[list[int]]]]:
        """The one-sided read of a whole handle from a sender already mapped (any size: it sends
        nothing); None where it cannot vouch for the read (then :meth:`read` and MAP/DONE)."""
        m = self._senders.get(url)
        if m is None or not ONE_SIDED or handle.layerwise or handle.codec != "raw":
            return None
        lane = m.lane
        if lane is None or lane[0] is not pool or lane[1] is not pool.buffers:
            lane = self._lane(m, pool)
        if lane[2] and len(block_ids) == len(handle.block_ids):
            done, sums = self._shm_read(url, m, handle, lane, block_ids, verify, handle.checksums if verify else None,
                                        gens)
            return (len(block_ids) * lane[4], sums) if done else None
        if not pool.is_host:
            return None
        dst = Spans(pool, None, block_ids)
        dst.want_digests = verify

        def one_sided() -> Optional[int]:
            got = self._read_one_sided(url, m, handle, dst, None)
            if got is not None and verify and dst.digests is None:    # copied unhashed: hash it now,
                dst.digests = block_checksums(pool, block_ids)         # while the blocks are still the fetch's
            return got
        n = generations_held(pool, block_ids, gens, handle.request_id, one_sided)
        return None if n is None else (n, unverified(dst.digests, handle, verify))

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        nb = len(indices) if indices is not None else handle.num_blocks

        def move(body: bytes, peer: tuple[int, int]) -> tuple[Chunk, bytes]:
            got = _claim_of(body, claim)
            lo, hi, sums, used = decode_layers(body[FENCE.size:], nb, (first, end))
            seg, runs = self._runs(body, FENCE.size + used, False, peer)
            dst = spans_for(lo, hi, sum(n for _, n in runs))
            return Chunk(lo, hi, sums, self._copy_in(dst, seg, runs), got), b""
        chunk: Chunk = self._exchange(url, Kind.MAP, encode_request(handle.to_bytes(), indices, claim, (first, end)),
                                      move, Kind.DONE, f"map layers of {url}")
        return chunk

    @staticmethod
    def _copy_out(src: Spans, seg: SharedSegment, runs: list[tuple[int, int]]) -> int:
        if src.pool.is_host:
            return copy_runs([(seg.address + o, k) for o, k in runs], src.runs())
        whole = seg.tensor()   # a device pool: device-to-host straight into the mapped segment
        return copy_slices([whole[o:o + k] for o, k in runs], device_slices(src))

    def write(self, url: str, ticket: KVHandle, src: Spans, layers: tuple[int, int], claim: Optional[Claim],
              sums: bytes, last: bool) -> int:
        def move(body: bytes, peer: tuple[int, int]) -> tuple[int, bytes]:
            lo, hi, _, used = decode_layers(body[FENCE.size:], ticket.num_blocks, layers)
            if (lo, hi) != layers:
                raise ProtocolError(f"receiver mapped layers [{lo}, {hi}) for a write of {layers}")
            mapped, runs = self._runs(body, FENCE.size + used, True, peer)
            if sum(n for _, n in runs) != src.nbytes:
                raise ProtocolError(f"receiver mapped {sum(n for _, n in runs)} bytes for {src.nbytes}")
            return self._copy_out(src, mapped, runs), encode_request(b"", last=last, nbytes=0, sums=sums)
        return int(self._exchange(url, Kind.WMAP, encode_request(ticket.to_bytes(), None, claim, layers), move,
                                  Kind.WDONE, f"write to {url}"))

    def abort_write(self, url: str, ticket: KVHandle, claim: Optional[Claim]) -> None:
        self._client(url).control(Kind.WABORT, encode_request(ticket.to_bytes(), None, claim), f"abort write to {url}")

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        (self._by_url.get(url) or self._client(url)).release(handle, wait, url)

    def close(self) -> None:
        with self._lock:
            clients, maps = list(self._clients.values()), list(self._maps.values())
            senders = [m for m in self._senders.values() if m is not None]
            self._clients.clear()
            self._by_url.clear()
            self._maps.clear()
            self._senders.clear()
            self._by_path.clear()
        for c in clients:
            c.close()
        for m in maps:
            m.close()
        for s in senders:
            s.close()
