"""shm:// -- same host: one side maps the other's shared-memory pool and memcpys.

Pull: the sender's pool must live in shared memory (``KVPool.allocate(..., shared=True)``:
a memfd sealed against shrinking and growing). A small control channel (a unix socket)
carries the same handle/token checks as tcp: MAP asks for the handle's blocks (or the ready
layers of a layer-wise handle) and gets the segment's name and byte runs; the first time, the
receiver asks for that segment's descriptor on the same connection (SEGFD: handed by
``SCM_RIGHTS``, read-only, only for a segment a reply on that connection named) and maps it
read-only -- only shared memory sealed against shrinking, so no one can cut it from under the
copy --, copies, then DONE asks whether the handle is still valid -- the
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

The transport itself (MAP/DONE, WMAP/WDONE) is here; one-sided reads are
:mod:`.shm_onesided` (a base of :class:`ShmTransport`), the server :mod:`.shm_server`.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from ..errors import ConfigError, KVBridgeError, PoolError, ProtocolError
from ..handle import KVHandle
from ..integrity import block_checksums
from ..lease.base import Claim
from ..policy import Timeout
from ..pool import KVPool
from ..segments import SharedSegment, peer_cred
from .base import Chunk, Server, Spans, SpansFor, copy_runs, generations_held, total, unverified
from .deadline import WATCHDOG
from .shm_onesided import OneSidedReads, Peer
from .shm_server import _RUN, MAX_GRANTS as MAX_GRANTS, ShmServer as ShmServer, _path_of as _path_of
from .shmtable import ONE_SIDED, SenderMap
from .sockets import SocketClient, client_for, connector
from .staging import copy_slices, device_slices
from .tcp import _claim_of
from .wire import (FENCE, HEADER, LAYERS, Kind, decode_error, decode_layers, encode_request, pack, recv_exact,
                   unpack_header)

__all__ = ["ShmTransport"]

_disarm = WATCHDOG.disarm

MAX_MAPPED = 16


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


class ShmTransport(OneSidedReads):
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

    def _segment(self, name: str, writable: bool, peer: Peer) -> SharedSegment:
        """The peer's segment, mapped once (read-only to read from, writable to push into): the
        first time, from the descriptor the peer passes for it on the connection whose reply
        named it (:meth:`_peer_segment`: only a kvbridge segment, sealed, that its user owns)."""
        key = (name, writable, peer.uid)
        with self._lock:
            seg = self._maps.get(key)
            if seg is not None:
                self._maps.move_to_end(key)
                return seg
        seg = self._peer_segment(peer, name, writable)   # lazy: a copy faults in only the pages it touches
        with self._lock:
            self._maps[key] = seg
            while len(self._maps) > MAX_MAPPED:     # dropped, not closed: a copy on another thread may
                self._maps.popitem(last=False)          # still be reading it; unmapped with its last reference
        return seg

    def _exchange(self, url: str, kind: Kind, payload: bytes, move: Any, done: Kind, what: str) -> Any:
        """MAP/WMAP -> copy -> DONE/WDONE on one connection. ``move(body, peer)`` copies (from or
        into segments of the peer, ``peer`` the connection and its user) and returns (result,
        DONE payload)."""
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
            result, done_payload = move(body, Peer(*peer_cred(sock), sock, client, what))
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
              peer: Peer) -> tuple[SharedSegment, list[tuple[int, int]]]:
        name, runs = _parse_mapped(body, pos)
        seg = self._segment(name, writable, peer)
        if any(o + n > seg.size for o, n in runs):
            raise ProtocolError("peer named bytes outside its segment")
        return seg, runs

    @staticmethod
    def _copy_in(dst: Spans, seg: SharedSegment, runs: list[tuple[int, int]]) -> int:
        if dst.pool.is_host:
            return copy_runs(dst.runs(), [(seg.address + o, k) for o, k in runs], dst.on_landed)
        whole = seg.tensor()   # a device pool: host-to-device straight from the mapped segment
        return copy_slices(device_slices(dst), [whole[o:o + k] for o, k in runs])

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

        def move(body: bytes, peer: Peer) -> tuple[int, bytes]:
            dst.claimed = _claim_of(body, claim)
            seg, runs = self._runs(body, FENCE.size + LAYERS.size, False, peer)
            return self._copy_in(dst, seg, runs), b""
        return int(self._exchange(url, Kind.MAP, encode_request(handle.to_bytes(), indices, claim), move,
                                  Kind.DONE, f"map {url}"))

    def read_small(self, url: str, handle: KVHandle, pool: KVPool, block_ids: list[int], verify: bool,
                   gens: list[int]) -> Optional[tuple[int, Optional[list[int]]]]:
        """The one-sided read of a whole handle from a sender already mapped (any size: it sends
        nothing), where :meth:`fetch_whole` did not take it (another geometry, no extension);
        None where it cannot vouch for the read (then :meth:`read` and MAP/DONE)."""
        m = self._senders.get(url)
        if m is None or not ONE_SIDED or handle.layerwise or handle.codec != "raw":
            return None
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

        def move(body: bytes, peer: Peer) -> tuple[Chunk, bytes]:
            got = _claim_of(body, claim)
            lo, hi, sums, used = decode_layers(body[FENCE.size:], nb, (first, end))
            seg, runs = self._runs(body, FENCE.size + used, False, peer)
            dst = spans_for(lo, hi, total(runs))
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
        def move(body: bytes, peer: Peer) -> tuple[int, bytes]:
            lo, hi, _, used = decode_layers(body[FENCE.size:], ticket.num_blocks, layers)
            if (lo, hi) != layers:
                raise ProtocolError(f"receiver mapped layers [{lo}, {hi}) for a write of {layers}")
            mapped, runs = self._runs(body, FENCE.size + used, True, peer)
            if total(runs) != src.nbytes:
                raise ProtocolError(f"receiver mapped {total(runs)} bytes for {src.nbytes}")
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
