"""ucx:// -- UCX (through ucxx): shared memory on one host, RDMA or TCP across hosts.

A server listens on ``host:port`` with a small TCP socket that speaks kvbridge frames
(:mod:`.sockets`): a client's hello (a MAP frame carrying ``HELLO``, its UCX worker
address and a request naming the handle or reservation it is about to use, authorized
before anything of UCX is made for it; one hello per connection) returns the server's
worker address and a random 44-bit key that every tag of this client carries (UCX matches
tags worker-wide: the key is the only identity, so it must be unguessable), and the connection then
stays open as the *liveness channel* -- its EOF tells either side, at once, that the
other process died. Everything else travels as UCX tagged messages between endpoints
made from the peers' worker addresses, with endpoint error handling off: on this
machine that is what lets UCX pick shared memory (and CMA zero-copy for large
messages); endpoints made through a UCX listener always ran over TCP.

Pull: one REQ message (the handle, indices, claim, layer range -- :func:`.wire.encode_request`)
-> the server authorizes it through the sender's ``open_read`` (live handle, token/MAC,
generations, claim fence), answers with a header message (status, byte count, layers
prefix with checksums) and sends the bytes from the pool while it holds the read grant:
the owner sees every byte leave, so no separate validate-after-read round trip is
needed (as tcp). Small transfers ride inside the header message; larger ones follow as
DATA messages of up to :data:`CHUNK` bytes of the canonical stream, sent straight from
the pool (and received straight into the destination pool) when the chunk is one
contiguous run on that side, gathered/scattered through a bounce buffer otherwise.

Push: WREQ (reservation, layers, claim) -> the receiver's ``open_write`` says GO or
ERROR; the writer then sends the bytes as DATA messages and the checksums; the receiver
verifies what landed (``finish``) and answers OK or ERROR, holding the write grant until
every posted receive has completed, so a cancel never frees pages under a write.

Every control message is bounded (:data:`.wire.MAX_CONTROL`), parsed defensively, and
answered with an ERROR when malformed. Waits poll the UCX worker for :data:`SPIN`
seconds, then sleep on its event descriptor and the liveness socket, so an idle sender or
receiver uses no CPU; a side about to sleep first rings the other with a *doorbell* on
the liveness socket (a PING frame with id :data:`DOORBELL_ID` to the server, one byte to
the client): a kernel socket wake-up takes microseconds where UCX's own took hundreds on
this machine. Every wait is bounded by ``Timeout.transfer`` without progress.

Why tagged messages and not RMA: ucxx 0.52's Python API has no memory registration,
remote keys or GET/PUT; its tagged rendezvous over shared memory is a CMA zero-copy read
by the receiver (the same single copy a one-sided GET makes), and UCX's registration
cache keeps pool regions registered across transfers on RDMA transports.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")   # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 ignores

try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array  # noqa: F401
except ImportError as exc:   # mapped by the registry to BackendUnavailable naming the extra
    raise ImportError(f"ucx:// needs ucxx: pip install 'kvbridge[ucx]' ({exc})") from exc


from ..errors import (ConfigError, ConnectionLost, FrameTooLarge, KVBridgeError, PeerUnavailable, ProtocolError,
                      TransferCancelled, TransferTimeout)
from ..handle import KVHandle
from ..lease.base import Claim
from ..policy import Timeout
from .base import Chunk, Server, Spans, SpansFor, Transport
from .deadline import cancelled
from .sockets import MAX_PEERS, connector, tune
from .wire import (HEADER, LAYERS, MAX_CONTROL, Kind, RateGuard, decode_error, decode_layers, encode_request,
                   map_os_error, pack, unpack_header)
from . import ucx_core as _core
from .ucx_core import (HELLO, HELLO_MAX, INLINE, OP_PING, RID_MASK, TRAILER_MAX,
                       OP_READ, OP_RELEASE, OP_RELEASE_NOREPLY, OP_WABORT, OP_WREQ, ST_ERROR,
                       ST_GO, ST_OK, T_DATA, T_DONE, T_HDR, T_REQ, _DOORBELL, _Ep, _N, _REQ_HEAD,
                       _Inbox, _Stream, _Want, _Worker, _check, _live,
                       _recv_stream, _send_stream, _tag, _wait_reqs, _wants_layers, parse_ucx_url)  # noqa: F401
from .ucx_server import UCXServer, _Client  # noqa: F401
from .ucx_core import SPIN, _recv_probed  # noqa: F401  (benches wait as kvbridge does; tests' raw peers)

__all__ = ["UCXTransport", "UCXServer", "parse_ucx_url"]

log = logging.getLogger("kvbridge.ucx")



# -- client -------------------------------------------------------------------------------------
class _Peer:
    """One server as seen by a client: liveness socket, endpoint, the key its tags carry."""

    def __init__(self, url: str, sock: socket.socket, ep: _Ep, key: int) -> None:
        self.url, self.sock, self.ep, self.cid = url, sock, ep, key
        self.broken = False
        self.wants: dict[int, _Want] = {}     # request id -> its request in flight (under the worker's lock)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._poll_lock = threading.Lock()   # a poll object is not for concurrent use
        self._ring_lock = threading.Lock()

    def alive(self) -> None:
        """Raise ConnectionLost if the server's process is gone; drain its doorbells."""
        if self.broken:
            raise ConnectionLost(f"{self.url}: connection closed")
        if not self._poll_lock.acquire(blocking=False):
            return                           # another thread is checking right now
        try:
            self._check()
        finally:
            self._poll_lock.release()

    def _check(self) -> None:
        while self._poll.poll(0):
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.broken = True
                raise ConnectionLost(f"{self.url}: the sender's process closed the connection")

    def ring(self) -> None:
        """Wake the server's UCX side (a doorbell frame on the liveness socket). Never blocks: a
        server that does not read its socket (its buffers full of doorbells) is not rung again,
        and one that took part of a doorbell has lost the socket's framing (dropped)."""
        try:
            with self._ring_lock:
                sent = self.sock.send(_DOORBELL, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            self.broken = True
            raise ConnectionLost(f"{self.url}: the sender's process closed the connection") from None
        if sent != len(_DOORBELL):
            self.broken = True
            raise ConnectionLost(f"{self.url}: the sender does not read its connection")


def _watched(p: _Peer, dst: Optional[Spans]) -> Callable[[], None]:
    """What a wait for ``dst``'s bytes checks at every NAP: the peer's liveness and ``dst.cancel``
    (a Transfer's cancel flag, and the receiver's whole-reply deadline against a sender that
    trickles): a cancel ends the wait at once, not after ``Timeout.transfer`` of silence."""
    flag = dst.cancel if dst is not None else None

    def check() -> None:
        p.alive()
        # the destination's flag, else the cancel of the transfer this thread runs (a layer
        # read's header wait, before its destination is known; a push's GO and DONE)
        if flag.is_set() if flag is not None else cancelled():
            raise TransferCancelled("transfer cancelled")
    return check


class UCXTransport(Transport):
    scheme = "ucx"
    # Every read reply is validated after its bytes were copied (inline replies) or sent (the
    # trailer): the bytes and the handle, as shm's re-check. Not the lease's TTL: the receiver
    # claims in the store itself, and the claim's reply bounds the claim (docs/LEASES.md).
    validates_after_read = True
    vouches_lease_ttl = False

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._lock = threading.Lock()
        self._worker: Optional[_Worker] = None
        self._peers: dict[str, _Peer] = {}
        self._rid = 0
        self._inbox = _Inbox()
        self._closed = False
        self.opened = 0
        _live.add(self)

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Timeout = Timeout()) -> Server:
        host, port = parse_ucx_url(url)
        try:
            lst = socket.create_server((host, port), reuse_port=False, backlog=128)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {url}: {exc}") from None
        real = lst.getsockname()[1]
        try:
            return UCXServer(lst, f"ucx://{host}:{real}", source, timeout)
        except BaseException:
            lst.close()
            raise

    # connections
    def _w(self) -> _Worker:
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(self._inbox.sort_locked)
            return self._worker

    def _next(self) -> int:
        with self._lock:
            self._rid = (self._rid + 1) & RID_MASK
            return self._rid

    def _expect(self, p: _Peer, nbytes: int = 0) -> int:
        """A request id for a request to ``p`` whose replies its worker keeps (none in flight);
        ``nbytes``: the data its reply carries, when known before the reply."""
        w = self._w()
        while True:
            rid = self._next()
            with w.lock:
                if rid not in p.wants:
                    p.wants[rid] = _Want(nbytes)
                    return rid

    def _done(self, p: _Peer, rid: int) -> None:
        """The request is over: what its worker kept for it, and what comes later, is discarded."""
        w = self._w()
        with w.lock:
            self._inbox.forget_locked(w.w, p, rid)

    def _hello_reply(self, sock: socket.socket, url: str) -> bytes:
        """The server's answer to the hello: whole within ``Timeout.transfer``, at most
        HELLO_MAX bytes (a server that trickles or declares more is refused)."""
        end = time.monotonic() + self.timeout.transfer

        def take(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{url}: no whole hello reply within {self.timeout.transfer} s")
                sock.settimeout(left)
                chunk = sock.recv(n - len(buf))
                if not chunk:
                    raise ConnectionLost(f"{url}: the server closed the connection during the hello")
                buf += chunk
            return bytes(buf)
        kind, _, length = unpack_header(take(HEADER.size), data_ok=False)
        if length > HELLO_MAX:
            raise ProtocolError(f"{url}: hello reply of {length} bytes (at most {HELLO_MAX})")
        body = take(length) if length else b""
        if kind is Kind.ERROR:
            raise decode_error(body)
        if kind is not Kind.MAPPED or len(body) < 9:
            raise ProtocolError(f"{url}: not a ucx:// server (reply {kind.name})")
        return body

    def _peer(self, url: str, hello: bytes) -> _Peer:
        """The connection to ``url``; a new one says hello with ``hello`` (a request naming the
        handle or reservation about to be used: the server makes nothing for a client before)."""
        with self._lock:
            if self._closed:
                raise ConnectionLost(f"{url}: this transport is closed")
            p = self._peers.pop(url, None)
            if p is not None:
                self._peers[url] = p           # the most recently used last: the oldest is forgotten first
        if p is not None:
            try:
                p.alive()
                return p
            except ConnectionLost:
                self._drop(p)
        worker = self._w()
        host, port = parse_ucx_url(url)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = connector(family, (host, port), url)(self.timeout.connect)
        try:
            tune(sock)
            addr = worker.address
            sock.sendall(pack(Kind.MAP, 1, HELLO + struct.pack("!H", len(addr)) + addr + hello))
            body = self._hello_reply(sock, url)
            cid = struct.unpack_from("!Q", body)[0]
            try:
                ep = _Ep(worker, worker.endpoint(body[8:]))     # check_address first: a filter
            except _ucx.UCXError as exc:
                raise PeerUnavailable(f"cannot reach {url} over UCX: {exc}") from None
            sock.settimeout(None)
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, f"connect to {url}") from None
        p = _Peer(url, sock, ep, cid)
        try:
            with worker.lock:
                self._inbox.add_locked(p)
        except PeerUnavailable:
            self._close_peer(p)
            raise
        gone: list[_Peer] = []
        with self._lock:
            closed = self._closed
            old = self._peers.get(url)
            if not closed and old is not None and not old.broken:
                keep = old
            elif not closed:
                self._peers.pop(url, None)
                self._peers[url] = keep = p
                self.opened += 1
                while len(self._peers) > MAX_PEERS:   # handles naming ever new URLs (unsigned ones from a
                    gone.append(self._peers.pop(next(iter(self._peers))))   # hostile source): the oldest go
        for g in gone:
            self._close_peer(g)
        if closed:
            self._close_peer(p)
            raise ConnectionLost(f"{url}: this transport is closed")
        if keep is not p:
            self._close_peer(p)
        return keep

    def _drop(self, p: _Peer) -> None:
        p.broken = True
        with self._lock:
            if self._peers.get(p.url) is p:
                del self._peers[p.url]
        self._close_peer(p)

    def _close_peer(self, p: _Peer) -> None:
        p.broken = True
        p.ep.close()
        w = p.ep.worker
        with w.lock:
            self._inbox.remove_locked(w.w, p)     # later messages of its key are discarded
        try:
            p.sock.close()
        except OSError:
            pass

    # one exchange
    def _send(self, p: _Peer, tag: int, msg: bytes) -> Any:
        """Post a tagged send; the returned request holds ``msg`` (UCX reads it until the
        send completes: a rendezvous send reads it from the peer long after posting)."""
        return p.ep.send(msg, tag)

    def _recv_header(self, p: _Peer, rid: int, limit: int, what: str, kind: int = T_HDR,
                     alive: Optional[Callable[[], None]] = None) -> bytes:
        """The request's next message of ``kind`` (a reply header, or a read's trailer), whole, at
        most ``limit`` bytes (a longer one is received truncated, i.e. dropped, and refused)."""
        w = self._w()
        box: list[tuple[Any, bytearray, int]] = []

        def arrived() -> bool:
            with w.lock:
                pr = self._inbox.take_locked(p, rid, kind)
                if pr is not None:
                    buf = bytearray(pr.length if 0 < pr.length <= limit else 1)
                    box.append((w.w.tag_recv_with_handle(Array(buf), pr), buf, pr.length))
            return bool(box)
        check = alive or p.alive
        w.wait(arrived, self.timeout.transfer, what, check, (p.sock.fileno(),), p.ring)
        req, buf, n = box[0]
        try:
            w.wait(lambda: req.completed, self.timeout.transfer, what, check, (p.sock.fileno(),), p.ring)
        except BaseException:
            with w.lock:
                self._inbox.discards.hold_locked(req, buf)   # UCX may still write into it
            raise
        if len(buf) != n:
            raise ProtocolError(f"{what}: message of {n} bytes (at most {limit})")
        _check(req, what)
        return bytes(buf)

    def _exchange(self, url: str, op: int, payload: bytes, what: str,
                  body: Callable[[_Peer, int, bytes], Any], limit: int = MAX_CONTROL + INLINE,
                  hello: Optional[bytes] = None, dst: Optional[Spans] = None) -> Any:
        """Send one request; ``body(peer, rid, reply)`` handles an OK/GO reply. Errors that
        leave the connection in an unknown state drop it (so no late message of an abandoned
        request can match a later one: a new connection has a new key). ``dst``: the read's
        destination, whose cancel flag the waits check."""
        if len(payload) + 1 > MAX_CONTROL:
            raise FrameTooLarge(f"{what}: request of {len(payload)} bytes exceeds {MAX_CONTROL}")
        p = self._peer(url, payload if hello is None else hello)
        rid = self._expect(p, dst.nbytes if dst is not None else 0)
        clean = False
        try:
            check = _watched(p, dst)
            sreq = self._send(p, _tag(T_REQ, p.cid, rid), _REQ_HEAD.pack(op) + payload)
            reply = self._recv_header(p, rid, limit, what, alive=check)
            _wait_reqs(self._w(), [sreq], self.timeout.transfer, what, check, (p.sock.fileno(),), p.ring)
            if reply[0] == ST_ERROR:
                clean = True
                raise decode_error(reply[1:])
            if reply[0] not in (ST_OK, ST_GO):
                raise ProtocolError(f"{what}: unknown reply status {reply[0]}")
            out = body(p, rid, reply)
            clean = True
            return out
        except BaseException as exc:
            if not clean or (isinstance(exc, KVBridgeError) and (exc.retryable or isinstance(exc, ProtocolError))):
                self._drop(p)
            raise
        finally:
            self._done(p, rid)

    def _take_data(self, p: _Peer, rid: int, reply: bytes, pos: int, dst: Spans, what: str) -> int:
        n = int(_N.unpack_from(reply, 1)[0])
        if n != dst.nbytes:
            raise ProtocolError(f"{what}: sender offers {n} bytes, destination holds {dst.nbytes}")
        stream = _Stream(dst)
        check = _watched(p, dst)
        if n <= INLINE:
            if len(reply) - pos != n:
                raise ProtocolError(f"{what}: reply carries {len(reply) - pos} bytes, expected {n}")
            if n:
                src = bytearray(reply[pos:])
                stream.scatter(0, n, src)
                stream.landed(n)
            stream.stage_in()
            return n
        if len(reply) != pos:
            raise ProtocolError(f"{what}: unexpected bytes in the reply header")
        w = self._w()
        with w.lock:          # a layer read learns its size from the header: its pieces may all come ahead
            want = p.wants.get(rid)
            if want is not None:
                want.expect(n)
        dtag = _tag(T_DATA, p.cid, rid)

        def post(view: memoryview, k: int) -> Any:
            return p.ep.recv(view, dtag, lambda: self._inbox.take_locked(p, rid, T_DATA))
        _recv_stream(w, post, stream, self.timeout.transfer, what, check, (p.sock.fileno(),), p.ring,
                     cancel=lambda: self._drop(p))     # nothing lands in the destination after a failure
        trailer = self._recv_header(p, rid, TRAILER_MAX, what, T_DONE, check)
        if trailer[0] != ST_OK:
            raise decode_error(trailer[1:]) if trailer[0] == ST_ERROR else ProtocolError(f"{what}: bad trailer")
        stream.stage_in()
        return n

    # the Transport interface
    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        what = f"read {url}"

        def body(p: _Peer, rid: int, reply: bytes) -> int:
            if len(reply) < 1 + _N.size:
                raise ProtocolError(f"{what}: truncated reply")
            return self._take_data(p, rid, reply, 1 + _N.size, dst, what)
        return int(self._exchange(url, OP_READ, encode_request(handle.to_bytes(), indices, claim), what, body,
                                  dst=dst))

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        what = f"read layers of {url}"
        nb = len(indices) if indices is not None else handle.num_blocks

        def body(p: _Peer, rid: int, reply: bytes) -> Chunk:
            if len(reply) < 1 + _N.size + LAYERS.size:
                raise ProtocolError(f"{what}: truncated reply")
            lo, hi, sums, used = decode_layers(reply[1 + _N.size:], nb, (first, end))
            if handle.checksums and hi > lo and not sums:     # a sender with checksums always sends them
                raise ProtocolError(f"{what}: layer reply without the checksums of a handle that has them")
            dst = spans_for(lo, hi, int(_N.unpack_from(reply, 1)[0]))
            n = self._take_data(p, rid, reply, 1 + _N.size + used, dst, what)
            return Chunk(lo, hi, sums, n)
        return self._exchange(url, OP_READ, encode_request(handle.to_bytes(), indices, claim, (first, end)),  # type: ignore[no-any-return]
                              what, body)

    def write(self, url: str, ticket: KVHandle, src: Spans, layers: tuple[int, int], claim: Optional[Claim],
              sums: bytes, last: bool) -> int:
        what = f"write to {url}"

        def body(p: _Peer, rid: int, reply: bytes) -> int:
            if reply[0] != ST_GO:
                raise ProtocolError(f"{what}: expected GO")
            w = self._w()
            stream = _Stream(src)
            stream.stage_out()
            _send_stream(w, p.ep, _tag(T_DATA, p.cid, rid), stream, self.timeout.transfer, what, _watched(p, src),
                         (p.sock.fileno(),), p.ring, RateGuard(_core.MIN_RATE, _core.RATE_GRACE))   # a receiver
            # that takes the bytes slowly cannot hold the write (and its source blocks) for pieces x timeout
            done = self._send(p, _tag(T_DONE, p.cid, rid),
                              encode_request(b"", last=last, nbytes=0, sums=sums))
            final = self._recv_header(p, rid, MAX_CONTROL, what, alive=_watched(p, src))
            _wait_reqs(w, [done], self.timeout.transfer, what, _watched(p, None), (p.sock.fileno(),), p.ring)
            if final[0] == ST_ERROR:
                raise decode_error(final[1:])
            if final[0] != ST_OK:
                raise ProtocolError(f"{what}: unexpected reply status {final[0]}")
            return src.nbytes
        return int(self._exchange(url, OP_WREQ, encode_request(ticket.to_bytes(), None, claim, layers,
                                                               nbytes=src.nbytes), what, body))

    def abort_write(self, url: str, ticket: KVHandle, claim: Optional[Claim]) -> None:
        self._exchange(url, OP_WABORT, encode_request(ticket.to_bytes(), None, claim), f"abort write to {url}",
                       lambda p, r, b: None)

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        what = f"release {url}"
        if not wait:
            p = self._peer(url, encode_request(handle.to_bytes()))
            try:
                req = self._send(p, _tag(T_REQ, p.cid, self._next()),
                                 _REQ_HEAD.pack(OP_RELEASE_NOREPLY) + handle.to_bytes())
                p.ring()
                _wait_reqs(self._w(), [req], self.timeout.transfer, what, p.alive)
            except KVBridgeError:
                self._drop(p)
                raise
            return
        self._exchange(url, OP_RELEASE, handle.to_bytes(), what, lambda p, r, b: None,
                       hello=encode_request(handle.to_bytes()))

    def ping(self, url: str, payload: bytes = b"") -> bytes:
        """Ping a server this transport is connected to (a hello needs a live ticket)."""
        with self._lock:
            known = url in self._peers
        if not known:
            raise PeerUnavailable(f"ping {url}: not connected (a ucx:// hello names a handle or reservation)")
        return self._exchange(url, OP_PING, payload, f"ping {url}", lambda p, r, b: bytes(b[1:]),  # type: ignore[no-any-return]
                              hello=b"")

    def extra(self, name: str, default: Any = None) -> Any:
        if name == "connections_opened":
            return self.opened
        return default

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            self._close_peer(p)
        w = self._worker
        if w is not None:
            w.close()
        _live.discard(self)
