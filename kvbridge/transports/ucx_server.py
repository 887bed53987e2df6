"""ucx:// server: the hello/liveness socket and the handlers of UCX requests (see :mod:`.ucx`)."""


from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")   # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 ignores

try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array
except ImportError as exc:   # mapped by the registry to BackendUnavailable naming the extra
    raise ImportError(f"ucx:// needs ucxx: pip install 'kvbridge[ucx]' ({exc})") from exc


from ..errors import (ConnectionLost, FrameTooLarge, KVBridgeError, ProtocolError, RetryableError,
                      StaleHandle)
from ..handle import KVHandle
from ..policy import Timeout
from .base import ReadGrant
from .sockets import SocketServer
from .wire import (MAX_CONTROL, Kind, RateGuard, Request, decode_request,
                   encode_error, encode_layers, pack)


from . import ucx_core as _core
from .ucx_core import (ADDRESS_MAX, DOORBELL_ID, HANDLER_THREADS, HELLO, INLINE, OP_PING,
                       OP_READ, OP_RELEASE, OP_RELEASE_NOREPLY, OP_WABORT, OP_WREQ, SPIN, ST_ERROR,
                       ST_GO, ST_OK, T_DATA, T_DONE, T_HDR, T_REQ, _Ep, _N, _Stream, _Worker, _check, _live,
                       _recv_stream, _send_stream, _tag, _untag, _wants_layers, check_address,
                       Discards, parse_ucx_url)  # noqa: F401

log = logging.getLogger("kvbridge.ucx")



MAX_CLIENTS = 1024        # clients (hello'd connections) per server
MAX_PENDING = 32          # per client: requests being received plus replies posted and not yet completed
MAX_HELD = _core.WINDOW * _core.CHUNK + MAX_CONTROL   # per client: bytes of messages taken in and not yet used
PING_MAX = 64             # a PING's payload, as tcp://


def _value(tag: Any) -> int:
    return int(tag.value if hasattr(tag, "value") else tag)


# -- server -------------------------------------------------------------------------------------
class _Write:
    """A write in flight: DATA / DONE messages for it that the loop took off the worker's
    unexpected queue before a receive was posted for them, oldest first."""

    __slots__ = ("data", "done")

    def __init__(self) -> None:
        self.data: list[Any] = []
        self.done: list[Any] = []


class _Client:
    __slots__ = ("key", "ep", "conn", "alive", "asked", "sends", "writes", "held")

    def __init__(self, key: int, ep: _Ep, conn: socket.socket) -> None:
        self.key, self.ep, self.conn, self.alive = key, ep, conn, True
        self.asked = 0.0   # when its latest request was taken (it polls for SPIN after sending)
        self.sends: list[Any] = []            # replies posted and not yet seen complete
        self.writes: dict[int, _Write] = {}   # request id -> write in flight
        self.held = 0                         # bytes of its messages taken in and not yet used

    @property
    def cid(self) -> int:
        return self.key


class UCXServer(SocketServer):
    """The hello/liveness socket (kvbridge frames; also answers READ/WRITE/RELEASE frames
    like tcp://) plus a UCX worker that serves tagged requests.

    Nothing touches UCX for a peer before its hello showed a live handle (or reservation)
    of this endpoint: only then is an endpoint made from its worker address, once per
    connection. Every message on the worker is taken off it: requests of known clients,
    DATA/DONE of a write in flight (bounded per client), the rest received and discarded.
    The loop and doorbell threads never wait for a send: replies are posted and reaped."""

    def __init__(self, listener: socket.socket, url: str, endpoint: Any, timeout: Timeout) -> None:
        self.worker = _Worker()
        self._clients: dict[int, _Client] = {}
        self._by_conn: dict[socket.socket, _Client] = {}
        self._helloed: set[socket.socket] = set()
        self._clock = threading.Lock()
        self._taking: list[tuple[_Client, int, bytearray, Any, float]] = []   # requests being received
        self._discards = Discards()                                           # messages being discarded
        self._sending: dict[int, _Client] = {}     # clients with replies posted (by id): all the reap visits
        self._pool = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="kvb-ucx-serve")
        self._stop = threading.Event()
        self.max_clients = MAX_CLIENTS
        super().__init__(listener, url, endpoint, timeout)
        self._loop = threading.Thread(target=self._ucx_loop, name=f"kvb-ucx {url}", daemon=True)
        self._loop.start()
        _live.add(self)

    # hello / liveness on the socket
    def idle_timeout(self, conn: socket.socket) -> float:
        return float("inf") if conn in self._by_conn else super().idle_timeout(conn)

    def connection_closed(self, conn: socket.socket) -> None:
        with self._clock:
            self._helloed.discard(conn)
            c = self._by_conn.get(conn)
        if c is not None:
            self._drop_client(c, shutdown=False)

    def _drop_client(self, c: _Client, shutdown: bool = True) -> None:
        """Forget a client: its endpoint closes (cancelling the receives posted on it), its
        liveness socket is shut (the client sees ConnectionLost). Messages of its key that
        still arrive are discarded by the loop."""
        with self._clock:
            c.alive = False
            if self._clients.get(c.key) is c:
                del self._clients[c.key]
            if self._by_conn.get(c.conn) is c:
                del self._by_conn[c.conn]
            writes = list(c.writes.values())
            c.writes.clear()
        c.ep.close()
        with self.worker.lock:
            for wr in writes:
                for pr in wr.data + wr.done:
                    self._discard_locked(pr)
        if shutdown:
            try:
                c.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle(self, conn: socket.socket, reader: Any, kind: Kind, req_id: int, payload: bytes) -> bool:
        if kind is Kind.PING and req_id == DOORBELL_ID and not payload:
            if conn in self._by_conn:
                self._drain(SPIN)
            return True
        if kind is Kind.MAP and payload.startswith(HELLO):
            return self._hello(conn, req_id, payload)
        return super().handle(conn, reader, kind, req_id, payload)

    def _hello(self, conn: socket.socket, req_id: int, payload: bytes) -> bool:
        """One hello per connection: it must name a live ticket of this endpoint (authorized
        as a read or a write would be) before anything of UCX is made for the peer."""
        with self._clock:
            again = conn in self._helloed
            self._helloed.add(conn)
        try:
            if again:
                raise ProtocolError("one hello per connection")
            addr, req = self._parse_hello(payload)
            check_address(addr, self.worker.address)
            self._authorize(req)
            with self._clock:
                if len(self._clients) >= self.max_clients:
                    raise RetryableError(f"server at its limit of {self.max_clients} ucx:// clients; retry later")
            try:
                ep = _Ep(self.worker, self.worker.endpoint(addr))
            except _ucx.UCXError as exc:
                raise ProtocolError(f"cannot reach the client's UCX worker: {exc}") from None
        except KVBridgeError as exc:
            self._reply_error(conn, req_id, exc)
            return False
        with self._clock:
            key = 0
            while key == 0 or key in self._clients:
                key = secrets.randbits(_core.KEY_BITS)
            c = _Client(key, ep, conn)
            self._clients[key] = c
            self._by_conn[conn] = c
        conn.sendall(pack(Kind.MAPPED, req_id, struct.pack("!Q", key) + self.worker.address))
        return True

    @staticmethod
    def _parse_hello(payload: bytes) -> tuple[bytes, Request]:
        body = payload[len(HELLO):]
        if len(body) < 2:
            raise ProtocolError("hello carries no UCX worker address")
        (n,) = struct.unpack_from("!H", body)
        if not 0 < n <= ADDRESS_MAX or len(body) < 2 + n:
            raise ProtocolError("hello carries no UCX worker address")
        if len(body) == 2 + n:
            raise ProtocolError("hello names no handle or reservation")
        return bytes(body[2:2 + n]), decode_request(bytes(body[2 + n:]))

    def _authorize(self, req: Request) -> None:
        """What shm's OPEN does: a handle is authorized by opening (and at once closing) a
        read of it; a reservation through the receiver's ticket lookup (and the writer's
        claim where it is leased). Holds nothing."""
        if KVHandle.from_bytes(req.ticket).reservation:        # BadHandle on garbage
            self.sink.authorize_ticket(req.ticket, req.claim)   # ProtocolError if this endpoint takes no writes
        else:
            self.source.open_read(req.ticket, req.indices, req.claim, req.layers).close()

    # the worker: every message taken off it
    def _drain(self, spin: float = 0.0) -> bool:
        """Take every message waiting on the worker; with ``spin``, poll that long for the
        first. Called by the loop thread and by a connection thread that got a doorbell."""
        w = self.worker
        took = False
        end = time.monotonic() + spin
        while not self._stop.is_set():
            with w.lock:
                w.w.progress()
                pr = w.w.tag_probe(_ucx.UCXXTag(0), _ucx.UCXXTagMask(0), True)
                if pr.matched:
                    self._sort_locked(pr)
            if pr.matched:
                took = True
            elif took or time.monotonic() >= end:
                break
        self._reap()
        return took

    def _discard_locked(self, pr: Any) -> None:
        """Receive a probed message into one byte and forget it once complete (its worker's lock held)."""
        self._discards.take_locked(self.worker.w, pr)

    def _sort_locked(self, pr: Any) -> None:
        """Route one message the loop took (under the worker's lock)."""
        kind, key, rid = _untag(_value(pr.sender_tag))
        client = self._clients.get(key)
        if client is None or not client.alive:
            self._discard_locked(pr)
            return
        if kind == T_REQ:
            self._take_request_locked(client, rid, pr)
            return
        wr = client.writes.get(rid) if kind in (T_DATA, T_DONE) else None
        if wr is None:
            self._discard_locked(pr)
            return
        if client.held + pr.length > MAX_HELD:
            log.info("ucx client holds over %d bytes of unreceived messages: dropped", MAX_HELD)
            self._discard_locked(pr)
            self._pool_drop(client)
            return
        client.held += pr.length
        (wr.data if kind == T_DATA else wr.done).append(pr)

    def _pool_drop(self, client: _Client) -> None:
        """Drop a client from a thread that holds the worker's lock (the drop takes it)."""
        if not client.alive:
            return
        client.alive = False
        threading.Thread(target=self._drop_client, args=(client,), daemon=True).start()

    def _take_request_locked(self, client: _Client, rid: int, pr: Any) -> None:
        length = pr.length
        if length == 0 or length > MAX_CONTROL + 1:
            self._discard_locked(pr)
            self._post_reply_locked(client, rid, ST_ERROR, encode_error(FrameTooLarge(
                f"request of {length} bytes exceeds {MAX_CONTROL}" if length else "empty request")))
            return
        if len(client.sends) + sum(1 for t in self._taking if t[0] is client) >= MAX_PENDING \
                or client.held + length > MAX_HELD:
            log.info("ucx client with %d requests/replies outstanding: dropped", MAX_PENDING)
            self._discard_locked(pr)
            self._pool_drop(client)
            return
        client.held += length
        buf = bytearray(length)
        req = self.worker.w.tag_recv_with_handle(Array(buf), pr)
        self.worker.w.progress()      # an eager request completes here, so the reap below serves it at once
        self._taking.append((client, rid, buf, req, time.monotonic() + self.timeout.transfer))

    def _reap(self) -> None:
        """Requests whose bytes arrived are served; completed sends and discards forgotten."""
        with self.worker.lock:
            taking, self._taking = self._taking, []
            ready = [t for t in taking if t[3].completed]
            for t in ready:
                t[0].held -= len(t[2])
        now = time.monotonic()
        keep = []
        for t in taking:
            client, rid, buf, req, due = t
            if req.completed:
                pass
            elif now > due and client.alive:
                log.info("ucx request not received within %s s: client dropped", self.timeout.transfer)
                self._drop_client(client)
                keep.append(t)          # its buffer stays until UCX is done with it
            else:
                keep.append(t)
        with self.worker.lock:
            self._taking.extend(keep)
        with self.worker.lock:
            sending = list(self._sending.values())
            done = []
            for c in sending:
                done += [h for h in c.sends if h.completed]
                c.sends = [h for h in c.sends if not h.completed]
                if not c.sends:
                    del self._sending[id(c)]
        for h in done:
            try:
                h.check_error()
            except _ucx.UCXError as exc:
                log.debug("ucx reply: %s", exc)
        for client, rid, buf, req, _ in ready:
            try:
                _check(req, "request")
            except KVBridgeError as exc:
                log.debug("dropping a request: %s", exc)
                continue
            if client.alive:
                self._dispatch_request(client, rid, bytes(buf))

    def _ring(self, client: _Client) -> None:
        """Wake the client if it sleeps: a byte on its liveness socket (the kernel wakes a
        thread in microseconds; UCX's own wake-up takes hundreds here)."""
        try:
            client.conn.send(b"\0", socket.MSG_DONTWAIT)
        except OSError:
            pass

    def _ucx_loop(self) -> None:
        w = self.worker
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._drain():
                    last = time.monotonic()
                    continue
                if time.monotonic() - last < SPIN:
                    continue
                with w.lock:
                    armed = w.w.arm()
                if armed:
                    p = select.poll()
                    p.register(w.efd, select.POLLIN)
                    p.poll(100 if not self._taking else 10)
            except Exception:   # never let the loop die silently
                log.exception("ucx server loop")
                time.sleep(0.05)

    def _dispatch_request(self, client: _Client, rid: int, msg: bytes) -> None:
        client.asked = time.monotonic()
        op = msg[0]
        if op == OP_WREQ or (op == OP_READ and _wants_layers(bytearray(msg))):
            try:
                self._pool.submit(self._ucx_serve, client, rid, msg)   # these may wait: not on the loop
            except RuntimeError:
                pass   # shutting down
        else:
            self._ucx_serve(client, rid, msg, on_loop=True)

    def _alive(self, client: _Client) -> Callable[[], None]:
        def check() -> None:
            if not client.alive or self._stop.is_set():
                raise ConnectionLost("client went away")
        return check

    def _post_reply_locked(self, client: _Client, rid: int, status: int, body: bytes = b"",
                           data: Optional[Sequence[memoryview]] = None) -> None:
        msg = bytes([status]) + body + (b"".join(data) if data else b"")
        if client.ep.closed:
            return
        req = client.ep.ep.tag_send(Array(msg), _ucx.UCXXTag(_tag(T_HDR, client.key, rid)))
        client.sends.append(_core._Held(req, msg))
        self._sending[id(client)] = client
        self.worker.w.progress()      # push it out now (never waits: a send that cannot go stays posted)

    def _reply(self, client: _Client, rid: int, status: int, body: bytes = b"",
               data: Optional[Sequence[memoryview]] = None) -> None:
        """Post a reply; never wait for it (the loop reaps it). A client that leaves too many
        replies unreceived is dropped."""
        with self.worker.lock:
            self._post_reply_locked(client, rid, status, body, data)
            over = len(client.sends) > MAX_PENDING
        if over:
            log.info("ucx client leaves over %d replies unreceived: dropped", MAX_PENDING)
            self._drop_client(client)
            raise ConnectionLost("client does not take its replies")
        if time.monotonic() - client.asked > SPIN / 2:
            self._ring(client)     # the client polls for SPIN after asking; later it may sleep

    def _ucx_serve(self, client: _Client, rid: int, msg: bytes, on_loop: bool = False) -> None:
        """Answer one request. On the loop thread (``on_loop``) only what cannot wait long
        runs: whole-handle reads (a large one hands its bytes to a handler thread once
        authorized), releases, pings; layer reads and writes arrive on a handler thread."""
        try:
            op = msg[0]
            payload = msg[1:]
            if op == OP_READ:
                self._ucx_read(client, rid, payload, on_loop)
            elif op == OP_WREQ:
                self._ucx_write(client, rid, payload)
            elif op in (OP_RELEASE, OP_RELEASE_NOREPLY, OP_WABORT):
                try:
                    if op == OP_WABORT:
                        req = decode_request(payload)
                        self.sink.abort_remote(req.ticket, req.claim)
                    else:
                        self.source.release_remote(payload)
                except KVBridgeError as exc:
                    if op == OP_RELEASE_NOREPLY:
                        log.info("release refused: %s", exc)
                    else:
                        self._reply(client, rid, ST_ERROR, encode_error(exc))
                    return
                if op != OP_RELEASE_NOREPLY:
                    self._reply(client, rid, ST_OK)
            elif op == OP_PING:
                if len(payload) > PING_MAX:
                    self._reply(client, rid, ST_ERROR, encode_error(ProtocolError(
                        f"PING payload of {len(payload)} bytes (at most {PING_MAX})")))
                else:
                    self._reply(client, rid, ST_OK, payload)
            else:
                self._reply(client, rid, ST_ERROR, encode_error(ProtocolError(f"unknown request op {op}")))
        except KVBridgeError as exc:
            log.debug("ucx request %d of client %x: %s", rid, client.key, exc)
        except Exception:
            log.exception("ucx request handler")

    def _ucx_read(self, client: _Client, rid: int, payload: bytes, on_loop: bool = False) -> None:
        try:
            req = decode_request(payload)
            if req.nbytes or req.sums or req.last:
                raise ProtocolError("read request carries write fields")
            grant: Optional[ReadGrant] = self.source.open_read(req.ticket, req.indices, req.claim, req.layers)
        except KVBridgeError as exc:
            self._reply(client, rid, ST_ERROR, encode_error(exc))
            return
        assert grant is not None
        replied = False
        try:
            stream = _Stream(grant.spans)
            head = _N.pack(stream.nbytes)
            if req.layers is not None:
                head += encode_layers(*grant.layers, grant.sums)
            if stream.nbytes <= INLINE:
                stream.stage_out()
                data = b"".join(stream.views)     # read ...
                if not grant.still_valid():       # ... then validate: a stale copy is never sent
                    raise StaleHandle("blocks were freed or reused during the read; bytes discarded")
                replied = True
                self._reply(client, rid, ST_OK, head, [memoryview(data)])
                return
            if on_loop:
                try:
                    self._pool.submit(self._stream_out, client, rid, grant, stream, head)
                except RuntimeError:   # shutting down
                    raise ConnectionLost("the server is closing") from None
                grant = None   # the handler thread closes it
                return
            replied = True
            self._stream_out(client, rid, grant, stream, head, close=False)
        except KVBridgeError as exc:
            if replied:
                raise   # the client learns from the connection or its timeout
            self._reply(client, rid, ST_ERROR, encode_error(exc))
        finally:
            if grant is not None:
                grant.close()

    def _stream_out(self, client: _Client, rid: int, grant: Any, stream: _Stream, head: bytes,
                    close: bool = True) -> None:
        """The header, the bytes as DATA messages (at MIN_RATE at least after RATE_GRACE),
        then the validate-after-read trailer."""
        try:
            stream.stage_out()
            self._reply(client, rid, ST_OK, head)
            _send_stream(self.worker, client.ep, _tag(T_DATA, client.key, rid), stream, self.timeout.transfer, "send",
                         self._alive(client), (client.conn.fileno(),), lambda: self._ring(client),
                         RateGuard(_core.MIN_RATE, _core.RATE_GRACE))
            client.asked = time.monotonic()
            # validate-after-read: the bytes left while the grant held the blocks; say whether
            # they were still the handle's (an engine may retire pinned blocks) when the last went
            trailer = b"" if grant.still_valid() else encode_error(
                StaleHandle("blocks were freed or reused during the transfer; bytes discarded"))
            tmsg = bytes([ST_ERROR if trailer else ST_OK]) + trailer
            with self.worker.lock:
                if not client.ep.closed:
                    client.sends.append(_core._Held(client.ep.ep.tag_send(
                        Array(tmsg), _ucx.UCXXTag(_tag(T_DONE, client.key, rid))), tmsg))
                    self._sending[id(client)] = client
            self._ring(client)
        except KVBridgeError as exc:
            if client.alive and not isinstance(exc, ConnectionLost):
                self._drop_client(client)    # DATA messages may still be posted: the endpoint goes
            if not close:
                raise
            log.debug("ucx read %d of client %x: %s", rid, client.key, exc)   # the client sees it fail
        finally:
            if close:
                grant.close()

    def _ucx_write(self, client: _Client, rid: int, payload: bytes) -> None:
        try:
            req = decode_request(payload)
            if req.layers is None:
                raise ProtocolError("write request names no layers")
            if rid in client.writes:
                raise ProtocolError(f"request id {rid} already has a write in flight")
            grant = self.sink.open_write(req.ticket, req.layers, req.claim)
        except KVBridgeError as exc:
            self._reply(client, rid, ST_ERROR, encode_error(exc))
            return
        wr = _Write()
        stream: Optional[_Stream] = None
        try:
            stream = _Stream(grant.spans)
            if req.nbytes != stream.nbytes:
                raise ProtocolError(f"write of {req.nbytes} bytes, the reserved blocks hold {stream.nbytes}")
            with self.worker.lock:
                client.writes[rid] = wr
            self._reply(client, rid, ST_GO)
            dtag = _tag(T_DATA, client.key, rid)

            def post(view: memoryview, k: int) -> Any:
                with self.worker.lock:
                    if client.ep.closed:
                        raise ConnectionLost("client went away")
                    if wr.data:                 # taken off the worker by the loop before this receive
                        pr = wr.data.pop(0)
                        client.held -= pr.length
                        return _core._Held(self.worker.w.tag_recv_with_handle(Array(view), pr), view)
                    return _core._Held(client.ep.ep.tag_recv(Array(view), _ucx.UCXXTag(dtag)), view)
            try:
                _recv_stream(self.worker, post, stream, self.timeout.transfer, "write", self._alive(client),
                             (client.conn.fileno(),), lambda: self._ring(client),
                             RateGuard(_core.MIN_RATE, _core.RATE_GRACE), lambda: self._drop_client(client))
            except KVBridgeError:
                if client.alive:
                    self._drop_client(client)
                raise
            client.asked = time.monotonic()
            stream.stage_in()
            done = self._recv_done(client, wr, rid)     # the writer's DONE: checksums and the last flag
            dreq = decode_request(done)
            grant.finish(dreq.sums, dreq.last)
            self._reply(client, rid, ST_OK)
        except KVBridgeError as exc:
            try:
                self._reply(client, rid, ST_ERROR, encode_error(exc))
            except KVBridgeError:
                pass
        finally:
            with self.worker.lock:
                if client.writes.get(rid) is wr:
                    del client.writes[rid]
                for pr in wr.data + wr.done:      # anything more for this write is discarded
                    client.held -= pr.length
                    self._discard_locked(pr)
                wr.data.clear()
                wr.done.clear()
            if stream is not None and stream.unsettled:
                log.error("a failed write's receives never completed: its reservation is kept from reuse")
            else:
                grant.close()

    def _recv_done(self, client: _Client, wr: _Write, rid: int) -> bytes:
        """The write's DONE message, at most MAX_CONTROL bytes: the loop may have taken it."""
        utag = _ucx.UCXXTag(_tag(T_DONE, client.key, rid))
        box: list[Any] = []

        def arrived() -> bool:
            with self.worker.lock:
                if wr.done:
                    pr = wr.done.pop(0)
                    client.held -= pr.length
                    box.append(pr)
                else:
                    pr = self.worker.w.tag_probe(utag, _ucx.UCXXTagMaskFull, True)
                    if pr.matched:
                        box.append(pr)
            return bool(box)
        self.worker.wait(arrived, self.timeout.transfer, "write done", self._alive(client),
                         (client.conn.fileno(),), lambda: self._ring(client))
        pr = box[0]
        ok = 0 < pr.length <= MAX_CONTROL
        buf = bytearray(pr.length if ok else 1)
        with self.worker.lock:
            req = self.worker.w.tag_recv_with_handle(Array(buf), pr)
        self.worker.wait(lambda: req.completed, self.timeout.transfer, "write done", self._alive(client))
        if not ok:
            raise ProtocolError(f"write done: message of {pr.length} bytes (at most {MAX_CONTROL})")
        _check(req, "write done")
        return bytes(buf)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        super().close()
        self._loop.join(timeout=2)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._clock:
            clients = list(self._clients.values())
            self._clients.clear()
            self._by_conn.clear()
        for c in clients:
            c.alive = False
            c.ep.close()
        self.worker.close()
        _live.discard(self)
