"""tcp:// -- block bytes stream straight from one pool into the other.

Pull: the receiver sends one READ frame (the handle, optional block indices, optional
layer range); the server authorizes it against the sender (live handle, token/MAC,
generations, claim fence), answers with a DATA (or, for layers, LDATA) header and
``sendmsg``s the pool memory; the receiver receives directly into destination pool
memory (whole blocks of a host pool, layer-wise reads aside: one C call that receives and
hashes each block as its pieces land, :func:`_recv_blocks`; otherwise ``recvmsg_into``).
After the last byte the server sends the reply's trailer: the owner's validate-after-read
(:mod:`.wire`), which the receiver checks before it keeps the bytes.
Push: the writer sends a WRITE frame (reservation, layers, checksums) followed by the
bytes, which the receiver's server takes straight into the reserved blocks. No
intermediate buffers, no per-block ``bytes`` -- except for reads of up to ``SMALL_READ``
bytes of host pools, which the sender copies out into one buffer, validates and sends in one
call (a whole unleased read: one C call, ``KVSender.serve_next`` -- which also receives it --
or ``KVSender.serve_small``; any other: a C gather,
:func:`kvbridge.blockcopy.gather_blocks`), and the receiver takes in one receive into a
private buffer before copying it into place, hashing each block as it lands (one C call,
:func:`_read_small_native`; its Python twin :func:`_read_small`). Connections are pooled;
``read_many`` pipelines requests on one connection; the server's worker threads serve active
connections only (:mod:`.sockets`). Every exchange -- a read (small, large, layers, a pipeline
of them), a write and its answer, a ping, a release -- must end within Timeout.transfer plus
its bytes at the minimum rate: past that :mod:`.deadline`'s watchdog shuts the connection
down, whichever receive (Python or C) it blocks in, and the caller gets a TransferTimeout.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Optional, Union
from urllib.parse import urlsplit

from .. import blockcopy
from ..errors import (ConfigError, ConnectionLost, KVBridgeError, PoolError, ProtocolError, StaleHandle,
                      TransferCancelled)
from ..handle import KVHandle
from ..lease.base import Claim
from ..policy import Timeout
from ..pool import retired_during
from .base import Chunk, Fallback, ReadOp, Server, Spans, SpansFor, Transport, unverified
from .sockets import SocketClient, SocketServer, client_for, connector
from .staging import RingPool, recv_staged, send_staged
from .wire import (FENCE, HEADER, LAYERS, MAGIC, TRAILER, VERSION, Kind, Vouch, check_trailer, decode_error,
                   decode_layers, encode_claim, encode_request, pack, recv_exact, recv_iter, send_iter, unpack_header)

if TYPE_CHECKING:
    from ..pool import KVPool

__all__ = ["TCPTransport", "parse_tcp_url"]

PIPELINE_WINDOW = 16
SMALL_READ = 64 << 10   # host reads up to this take their whole reply in one receive
_NO_FENCE = (0, 0)      # a reply's fence when the read was not leased
_VOUCHED = (Vouch.OK, 0, 0)   # the trailer of a reply the owner vouched for
_REPLY = HEADER.size + FENCE.size + TRAILER.size   # a DATA reply's bytes besides the blocks'
_RINGS = RingPool()


def parse_tcp_url(url: str, scheme: str = "tcp") -> tuple[str, int]:
    """(host, port) of a ``scheme://host:port`` URL (port 0 when absent)."""
    u = urlsplit(url)
    if u.scheme != scheme or not u.hostname:
        raise ConfigError(f"expected {scheme}://host:port, got {url!r}")
    try:
        port = u.port or 0
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None
    return u.hostname, port


def _recv_into(sock: socket.socket, dst: Spans) -> int:
    if not dst.pool.is_host:
        ring = _RINGS.take()
        try:
            return recv_staged(sock, dst, ring)
        finally:
            _RINGS.give(ring)
    v = dst.verifier
    if blockcopy.recv_blocks is not None and dst.whole_blocks and (v is None or not (v.per_layer or v.started)):
        return _recv_blocks(sock, dst)      # (a per-layer verifier's digests are per (layer, block): its own loop)
    return recv_iter(sock, dst.iter_views(), dst.on_landed)


def _recv_blocks(sock: socket.socket, dst: Spans) -> int:
    """Whole blocks in one C call (``blockcopy.recv_blocks``): received straight into them and,
    with verification on, each block hashed as its pieces land -- the checksums left in
    ``dst.digests``, which the receiver prefers to its stream verifier (left unfed)."""
    assert blockcopy.recv_blocks is not None and dst.block_ids is not None
    pool = dst.pool
    bufs = pool.buffers                  # held across the C call: the pool cannot free them meanwhile
    code, got, sums = blockcopy.recv_blocks(sock.fileno(), blockcopy.planes(pool), dst.block_ids,
                                            pool.layout.part_nbytes, dst.want_digests or dst.verifier is not None,
                                            dst.cancel)
    del bufs
    if code == 1:
        raise ConnectionLost("peer closed the connection mid-transfer")
    if code == 2:
        raise TransferCancelled("transfer cancelled")
    dst.digests = sums
    return int(got)


def _claim_of(prefix: bytes, claim: Optional[Claim]) -> Optional[Claim]:
    """The claim a reply says the read was served under (None: the read was not leased)."""
    epoch, counter = FENCE.unpack_from(prefix, 0)
    if not (epoch or counter):
        return None
    if claim is None:
        raise ProtocolError("sender reports a claim for an unclaimed read")
    return Claim(claim.claimer, epoch, counter)


def _read_reply_data(sock: socket.socket, kind: Kind, length: int, dst: Spans, what: str,
                     claim: Optional[Claim]) -> int:
    """A DATA reply into ``dst``, its trailer checked last: a StaleHandle raised here means the
    frame was read whole (an ERROR reply, or a trailer that refused the bytes)."""
    if kind is Kind.ERROR:
        raise decode_error(recv_exact(sock, length))
    if kind is not Kind.DATA or length < FENCE.size + TRAILER.size:
        raise ProtocolError(f"{what}: expected DATA, got {kind.name}")
    if length - FENCE.size - TRAILER.size != dst.nbytes:
        raise ProtocolError(f"{what}: sender offers {length - FENCE.size - TRAILER.size} bytes, "
                            f"destination holds {dst.nbytes}")
    dst.claimed = _claim_of(recv_exact(sock, FENCE.size), claim)
    n = _recv_into(sock, dst)
    check_trailer(recv_exact(sock, TRAILER.size), dst.claimed or claim, what)
    return n


def _read_small(sock: socket.socket, rid: int, dst: Spans, what: str, claim: Optional[Claim]) -> int:
    """A small read's whole reply -- header, fence, bytes, trailer -- taken in as few receives
    as it arrives in (usually one) into a private buffer, and copied into the destination only
    once it proved to be this read's DATA with a trailer that vouches for it: a refused or
    malformed reply leaves the destination untouched."""
    want = HEADER.size + FENCE.size + dst.nbytes + TRAILER.size
    buf = bytearray(want)
    mv = memoryview(buf)
    k = got = sock.recv_into(mv)
    while got < HEADER.size:
        if not k:
            raise ConnectionLost("peer closed the connection")
        k = sock.recv_into(mv[got:])
        got += k
    if HEADER.unpack_from(buf) != (MAGIC, VERSION, Kind.DATA, rid, want - HEADER.size):   # not the usual reply
        _refuse_small(sock, buf, got, rid, want, what)
    while got < want:
        k = sock.recv_into(mv[got:])
        if not k:
            raise ConnectionLost("peer closed the connection mid-transfer")
        got += k
    fence = FENCE.unpack_from(buf, HEADER.size)
    dst.claimed = None if fence == _NO_FENCE else _claim_of(bytes(buf[HEADER.size:HEADER.size + FENCE.size]), claim)
    if TRAILER.unpack_from(buf, want - TRAILER.size) != _VOUCHED:
        check_trailer(bytes(buf[want - TRAILER.size:]), dst.claimed or claim, what)
    off = HEADER.size + FENCE.size
    if blockcopy.NATIVE and dst.block_ids is not None:     # lands, and is hashed, in one C pass
        pool = dst.pool
        pinned = pool.buffers                               # held across the C copy
        try:
            got_sums = blockcopy.scatter_blocks(blockcopy.planes(pool), dst.block_ids, buf, off,
                                                pool.layout.part_nbytes, dst.want_digests)
        except ValueError as exc:                           # our own ids: checked before the read
            raise PoolError(f"{what}: destination blocks {dst.block_ids} do not fit the pool: {exc}") from None
        del pinned
        if dst.want_digests:
            dst.digests = got_sums
        if dst.watched:
            dst.landed(dst.nbytes)
        return dst.nbytes
    for v in dst.views():
        v[:] = mv[off:off + len(v)]
        off += len(v)
    if dst.watched:
        dst.landed(dst.nbytes)
    return dst.nbytes


def _read_small_native(sock: socket.socket, rid: int, frame: bytes, pool: KVPool, block_ids: list[int],
                       nbytes: int, want_digests: bool, what: str,
                       claim: Optional[Claim]) -> tuple[Optional[Claim], Optional[list[int]]]:
    """:func:`_read_small` in one C call (``kvbridge._kvcopy.read_small``), request included, into
    whole ``block_ids`` of ``pool``: the claim the sender reported and, with ``want_digests``,
    each block's checksum as it landed. The refusals are read here, as there."""
    assert blockcopy.read_small is not None
    pinned = pool.buffers                                   # held across the C copy
    try:
        got = blockcopy.read_small(sock.fileno(), frame, rid, nbytes, blockcopy.planes(pool), block_ids,
                                   pool.layout.part_nbytes, want_digests, claim is not None)
    except ValueError as exc:                               # our own ids: checked before the read
        raise PoolError(f"{what}: destination blocks {block_ids} do not fit the pool: {exc}") from None
    del pinned
    if got[0] == 0:                                         # landed
        _, epoch, counter, sums = got
        return (Claim(claim.claimer, epoch, counter) if claim is not None and (epoch or counter) else None,
                sums if want_digests else None)
    _small_refused(sock, got[0], got[1], rid, nbytes, what, claim)


def _small_refused(sock: socket.socket, code: int, reply: bytes, rid: int, nbytes: int, what: str,
                   claim: Optional[Claim]) -> NoReturn:
    """Raise for a small read whose reply the C call refused (``code`` 1: its header, 2: its
    fence or trailer, 3: the peer closed; ``reply``: the bytes it took)."""
    raw = bytearray(reply)
    if code == 3:
        raise ConnectionLost("peer closed the connection" if len(raw) < HEADER.size
                             else "peer closed the connection mid-transfer")
    want = HEADER.size + FENCE.size + nbytes + TRAILER.size
    if code == 1:
        _refuse_small(sock, raw, len(raw), rid, want, what)
    claimed = _claim_of(bytes(raw[HEADER.size:HEADER.size + FENCE.size]), claim)
    check_trailer(bytes(raw[-TRAILER.size:]), claimed or claim, what)     # the reply's last bytes taken
    raise ProtocolError(f"{what}: the sender served a leased read without its claim")   # the one case left


def _refuse_small(sock: socket.socket, buf: bytearray, got: int, rid: int, want: int, what: str) -> NoReturn:
    """Raise for a small read's reply header that is not this read's DATA of the size asked."""
    kind, got_id, length = unpack_header(buf)
    if kind is Kind.ERROR:
        body = bytes(buf[HEADER.size:got])
        if len(body) < length:
            body += recv_exact(sock, length - len(body))
        raise decode_error(body[:length])
    if kind is not Kind.DATA:
        raise ProtocolError(f"{what}: expected DATA, got {kind.name}")
    if got_id != rid:
        raise ProtocolError(f"{what}: reply for request {got_id}, expected {rid}")
    raise ProtocolError(f"{what}: sender offers {length - FENCE.size - TRAILER.size} bytes, "
                        f"destination holds {want - HEADER.size - FENCE.size - TRAILER.size}")


class TCPTransport(Transport):
    scheme = "tcp"
    claims_on_read = True
    # Every read reply ends with the owner's validate-after-read (the trailer, see .wire), which
    # also vouches for the lease's TTL: with the claim's own TTL, checked by the receiver, a
    # leased fetch needs no lease round trip after its bytes land (docs/LEASES.md).
    validates_after_read = True
    vouches_lease_ttl = True

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._clients: dict[tuple[str, int], SocketClient] = {}
        self._by_url: dict[str, SocketClient] = {}
        self._lock = threading.Lock()

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Timeout = Timeout()) -> Server:
        host, port = parse_tcp_url(url)
        try:
            lst = socket.create_server((host, port), reuse_port=False, backlog=128)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {url}: {exc}") from None
        real_port = lst.getsockname()[1]
        return SocketServer(lst, f"tcp://{host}:{real_port}", source, timeout)

    def _client(self, url: str) -> SocketClient:
        c = self._by_url.get(url)
        if c is not None:
            return c
        addr = parse_tcp_url(url)
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        with self._lock:
            return client_for(self._clients, self._by_url, addr, url,
                              lambda: SocketClient(connector(family, addr, url), self.timeout))

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        client = self._client(url)
        if dst.nbytes <= SMALL_READ and dst.pool.is_host:
            what = "read " + url
            payload = encode_request(handle.to_bytes(), indices, claim)
            if blockcopy.read_small is not None and dst.block_ids is not None:
                dst.claimed, sums = self._small(client, url, payload, dst.pool, dst.block_ids, dst.nbytes,
                                                dst.want_digests, claim)
                if dst.want_digests:
                    dst.digests = sums
                if dst.watched:
                    dst.landed(dst.nbytes)
                return dst.nbytes
            sock, rid = client.send(Kind.READ, payload, what, _REPLY + dst.nbytes)
            try:
                n = _read_small(sock, rid, dst, what, claim)
            except BaseException as exc:
                raise client.fail(sock, exc, f"read from {url}") from None
            client.put_back(sock)
            return n
        sock, kind, _, length = client.call(Kind.READ, encode_request(handle.to_bytes(), indices, claim),
                                            f"read {url}", _REPLY + dst.nbytes)
        try:
            n = _read_reply_data(sock, kind, length, dst, f"read {url}", claim)
        except BaseException as exc:
            raise client.fail(sock, exc, f"read from {url}") from None
        client.put_back(sock)
        return n

    def fetch_whole(self, url: str, handle: KVHandle, pool: KVPool, dst: Any,
                    verify: bool) -> Optional[Union[Literal[True], Fallback]]:
        got = self._whole(url, handle, pool, dst, verify, None)
        return None if got is None else got[1]

    def fetch_claimed(self, url: str, handle: KVHandle, pool: KVPool, dst: Any, verify: bool,
                      claim: Claim) -> Optional[tuple[Optional[Claim], Union[Literal[True], Fallback]]]:
        return self._whole(url, handle, pool, dst, verify, claim)

    def _whole(self, url: str, handle: KVHandle, pool: KVPool, dst: Any, verify: bool,
               claim: Optional[Claim]) -> Optional[tuple[Optional[Claim], Union[Literal[True], Fallback]]]:
        """The usual fetch in one C call (``blockcopy.fetch_whole``), leased (``claim``: the
        owner claims as it serves) or not; the claim the reply reported, and the outcome."""
        layout = pool.layout
        nbytes = handle.num_blocks * layout.block_nbytes   # the C call refuses dst of another count
        if blockcopy.fetch_whole is None or not pool.is_host:
            return None
        pinned = pool.buffers                              # held across the C copy
        try:
            packed = blockcopy.planes(pool)
            client = self._by_url.get(url) or self._client(url)
            sock, rid = client.take()
        except KVBridgeError:                              # a closed pool, no connection: the long way says so
            return None
        start = time.monotonic()
        fence = bytearray(FENCE.size) if claim is not None else None   # the C call writes the reply's fence here
        leased = () if claim is None else (encode_claim(claim), fence)
        try:
            riders = client.riders(nbytes > SMALL_READ) if client._pending or client._claimed else b""
            out = blockcopy.fetch_whole(sock.fileno(), handle.to_bytes(), rid, riders, nbytes, packed, dst,
                                        layout.part_nbytes, handle.checksums if verify else None,
                                        pool.live_generations, pool._landing, client.deadline(nbytes + 4096, 0.0),
                                        *leased)
        except BaseException:                              # a signal: the connection may hold half a reply
            client.drop(sock)
            raise
        del pinned
        if out is None and riders:                         # nothing sent: the releases it was to carry go alone
            try:
                sock.sendall(riders)
            except OSError:
                client.drop(sock)
                return None
        if out is None:
            client.give_back(sock)
            return None
        served = None if fence is None or not any(fence) else _claim_of(bytes(fence), claim)
        if out is True:
            client.give_back(sock)
            return served, True
        code, gens, detail = out
        what = "read " + url
        if code == 0:                                      # a checksum differs: the pipeline refetches
            client.give_back(sock)
            return served, (gens, None, (nbytes, unverified(detail, handle, True)))
        if code == 4:                                      # a destination block was retired meanwhile
            client.give_back(sock)
            return served, (gens, retired_during(handle.request_id), None)
        if code == 5:
            sock.close()
            failed = client.cut_error(what)
        else:
            try:
                if code == 6:
                    raise detail
                client.arm(sock, nbytes, start)        # an ERROR body read here: held to the same deadline
                _small_refused(sock, code, detail, rid, nbytes, what, claim)
            except Exception as exc:
                failed = client.fail(sock, exc, f"read from {url}")
        if not pool.same_generations(dst, gens):           # a retry would land in blocks no longer the fetch's
            failed = retired_during(handle.request_id)
        return served, (gens, failed, None)

    @staticmethod
    def _small(client: SocketClient, url: str, payload: bytes, pool: KVPool, block_ids: list[int], nbytes: int,
               want_digests: bool, claim: Optional[Claim]) -> tuple[Optional[Claim], Optional[list[int]]]:
        """One small read in C (:func:`_read_small_native`) on a pooled connection."""
        sock, rid, frame = client.prepare(Kind.READ, payload, _REPLY + nbytes)
        try:
            out = _read_small_native(sock, rid, frame, pool, block_ids, nbytes, want_digests, "read " + url, claim)
        except BaseException as exc:
            raise client.fail(sock, exc, f"read from {url}") from None
        client.put_back(sock)
        return out

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        client = self._client(url)
        what = f"read layers of {url}"
        nb = len(indices) if indices is not None else handle.num_blocks
        start = time.monotonic()     # until the reply's size is known: its prefix, checksums and trailer
        sock, kind, _, length = client.call(
            Kind.READ, encode_request(handle.to_bytes(), indices, claim, (first, end)), what,
            _REPLY + LAYERS.size + 8 * (end - first) * nb)
        try:
            if kind is Kind.ERROR:
                raise decode_error(recv_exact(sock, length))
            if kind is not Kind.LDATA or length < FENCE.size + LAYERS.size:
                raise ProtocolError(f"{what}: expected LDATA, got {kind.name}")
            pre = recv_exact(sock, FENCE.size + LAYERS.size)
            got_claim = _claim_of(pre, claim)
            head = pre[FENCE.size:]
            nsums = int.from_bytes(head[4:8], "big")
            if nsums > (end - first) * nb:     # checked before anything is received for them
                raise ProtocolError(f"{what}: {nsums} checksums for at most {end - first} layers of {nb} blocks")
            if FENCE.size + LAYERS.size + 8 * nsums > length:
                raise ProtocolError(f"{what}: checksums overrun the frame")
            if nsums:
                head += recv_exact(sock, 8 * nsums)
            lo, hi, sums, used = decode_layers(head, nb, (first, end))
            used += FENCE.size + TRAILER.size
            if length < used:
                raise ProtocolError(f"{what}: LDATA frame too short for its trailer")
            dst = spans_for(lo, hi, length - used)
            if length - used != dst.nbytes:
                raise ProtocolError(f"{what}: sender offers {length - used} bytes, destination holds {dst.nbytes}")
            client.arm(sock, HEADER.size + length, start)    # the whole reply, now that its size is ours
            n = _recv_into(sock, dst)
            check_trailer(recv_exact(sock, TRAILER.size), got_claim or claim, what)
        except BaseException as exc:
            raise client.fail(sock, exc, what) from None
        client.put_back(sock)
        return Chunk(lo, hi, sums, n, got_claim)

    def read_many(self, url: str, ops: list[ReadOp]) -> list[ReadOp]:
        """Pipelined: up to PIPELINE_WINDOW requests in flight on one connection."""
        if not ops:
            return ops
        client = self._client(url)
        try:
            sock = client.acquire()
        except KVBridgeError as exc:
            for op in ops:
                op.result = exc
            return ops
        ids: list[int] = []
        sent = 0
        client.arm(sock, sum(_REPLY + o.dst.nbytes for o in ops))   # the whole pipeline
        try:
            for i, op in enumerate(ops):
                while sent < len(ops) and sent < i + PIPELINE_WINDOW:
                    rid = client.next_id()
                    ids.append(rid)
                    o = ops[sent]
                    sock.sendall(client.frames(pack(Kind.READ, rid, encode_request(o.handle.to_bytes(), o.indices,
                                                                                  o.claim))))
                    sent += 1
                kind, rid, length = unpack_header(recv_exact(sock, HEADER.size))
                if rid != ids[i]:
                    raise ProtocolError(f"pipelined reply {rid} out of order (expected {ids[i]})")
                try:
                    op.result = _read_reply_data(sock, kind, length, op.dst, f"read {url}", op.claim)
                except StaleHandle as exc:      # refused by its ERROR reply or its trailer: read whole
                    op.result = exc
                except KVBridgeError as exc:
                    if kind is not Kind.ERROR:
                        raise
                    op.result = exc
        except BaseException as exc:
            err = client.fail(sock, exc, f"pipelined read from {url}")
            for op in ops:
                if op.result is None:
                    op.result = err
            return ops
        client.put_back(sock)
        return ops

    def write(self, url: str, ticket: KVHandle, src: Spans, layers: tuple[int, int], claim: Optional[Claim],
              sums: bytes, last: bool) -> int:
        client = self._client(url)
        what = f"write to {url}"
        sock = client.acquire()
        client.arm(sock, src.nbytes + len(sums) + _REPLY)   # its bytes out, the answer back
        try:
            head = pack(Kind.WRITE, client.next_id(), encode_request(
                ticket.to_bytes(), None, claim, layers, last=last, nbytes=src.nbytes, sums=sums))
            try:
                if src.pool.is_host:
                    send_iter(sock, head, src.iter_views())
                else:
                    ring = _RINGS.take()
                    try:
                        send_staged(sock, src, ring, head)
                    finally:
                        _RINGS.give(ring)
            except OSError:
                pass   # a refusal may have closed the connection mid-send: its reply says why
            kind, _, length = unpack_header(recv_exact(sock, HEADER.size), data_ok=False)
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            raise client.fail(sock, exc, what) from None
        if kind is Kind.ERROR:
            client.drop(sock)   # the server may have dropped the connection after a refusal
            raise decode_error(body)
        if kind is not Kind.OK:
            client.drop(sock)
            raise ProtocolError(f"{what}: unexpected {kind.name} reply")
        client.put_back(sock)
        return src.nbytes

    def abort_write(self, url: str, ticket: KVHandle, claim: Optional[Claim]) -> None:
        self._client(url).control(Kind.WABORT, encode_request(ticket.to_bytes(), None, claim), f"abort write to {url}")

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self._client(url).release(handle, wait, url)

    def release_claimed(self, url: str, handle: KVHandle, claim: Claim) -> bool:
        self._client(url).release(handle, False, url, claim)
        return True

    def ping(self, url: str, payload: bytes = b"") -> None:
        self._client(url).control(Kind.PING, payload, f"ping {url}")

    def extra(self, name: str, default: Any = None) -> Any:
        if name == "connections_opened":
            return sum(c.opened for c in self._clients.values())
        return default

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
            self._by_url.clear()
        for c in clients:
            c.close()
