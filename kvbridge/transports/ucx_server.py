"""ucx:// server: the hello/liveness socket and the handlers of UCX requests (see :mod:`.ucx`)."""


from __future__ import annotations

import logging
import os
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


from ..errors import (ConnectionLost, FrameTooLarge, KVBridgeError, ProtocolError,
                      StaleHandle)
from ..policy import Timeout
from .base import ReadGrant
from .sockets import SocketServer
from .wire import (MAX_CONTROL, Kind, decode_request,
                   encode_error, encode_layers, pack)


from .ucx_core import (DONE_BIT, DOORBELL_ID, HANDLER_THREADS, HELLO, INLINE, KIND_MASK, OP_PING,
                       OP_READ, OP_RELEASE, OP_RELEASE_NOREPLY, OP_WABORT, OP_WREQ, SPIN, ST_ERROR,
                       ST_GO, ST_OK, T_DATA, T_HDR, T_REQ, _Ep, _N, _Stream, _Worker, _check, _live, _recv_probed,
                       _recv_stream, _send_stream, _tag, _wait_reqs, _wants_layers, parse_ucx_url)  # noqa: F401

log = logging.getLogger("kvbridge.ucx")



# -- server -------------------------------------------------------------------------------------
class _Client:
    __slots__ = ("cid", "ep", "conn", "alive", "asked")

    def __init__(self, cid: int, ep: _Ep, conn: socket.socket) -> None:
        self.cid, self.ep, self.conn, self.alive = cid, ep, conn, True
        self.asked = 0.0   # when its latest request was taken (it polls for SPIN after sending)


class UCXServer(SocketServer):
    """The hello/liveness socket (kvbridge frames; also answers READ/WRITE/RELEASE frames
    like tcp://) plus a UCX worker that serves tagged requests."""

    def __init__(self, listener: socket.socket, url: str, endpoint: Any, timeout: Timeout) -> None:
        self.worker = _Worker()
        self._clients: dict[int, _Client] = {}
        self._by_conn: dict[socket.socket, _Client] = {}
        self._next_cid = 0
        self._clock = threading.Lock()
        self._pool = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="kvb-ucx-serve")
        self._stop = threading.Event()
        super().__init__(listener, url, endpoint, timeout)
        self._loop = threading.Thread(target=self._ucx_loop, name=f"kvb-ucx {url}", daemon=True)
        self._loop.start()
        _live.add(self)

    # hello / liveness on the socket
    def idle_timeout(self, conn: socket.socket) -> float:
        return float("inf") if conn in self._by_conn else super().idle_timeout(conn)

    def connection_closed(self, conn: socket.socket) -> None:
        with self._clock:
            c = self._by_conn.pop(conn, None)
            if c is not None:
                self._clients.pop(c.cid, None)
        if c is not None:
            c.alive = False
            c.ep.close()

    def handle(self, conn: socket.socket, reader: Any, kind: Kind, req_id: int, payload: bytes) -> bool:
        if kind is Kind.PING and req_id == DOORBELL_ID and not payload:
            if conn in self._by_conn:
                self._drain(SPIN)
            return True
        if kind is Kind.MAP and payload.startswith(HELLO):
            addr = payload[len(HELLO):]
            try:
                if not 0 < len(addr) <= 65536:
                    raise ProtocolError("hello carries no UCX worker address")
                try:
                    ep = _Ep(self.worker, self.worker.endpoint(addr))
                except _ucx.UCXError as exc:
                    raise ProtocolError(f"cannot reach the client's UCX worker: {exc}") from None
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            with self._clock:
                self._next_cid = (self._next_cid % 0x7FFFFF) + 1   # bit 55 marks a write's DONE
                c = _Client(self._next_cid, ep, conn)
                self._clients[c.cid] = c
                self._by_conn[conn] = c
            conn.sendall(pack(Kind.MAPPED, req_id, struct.pack("!I", c.cid) + self.worker.address))
            return True
        return super().handle(conn, reader, kind, req_id, payload)

    # tagged requests
    def _drain(self, spin: float = 0.0) -> bool:
        """Take every request waiting on the worker; with ``spin``, poll that long for the
        first. Called by the loop thread and by a connection thread that got a doorbell."""
        w = self.worker
        took = False
        end = time.monotonic() + spin
        while not self._stop.is_set():
            with w.lock:
                w.w.progress()
                pr = w.w.tag_probe(_ucx.UCXXTag(T_REQ << 56), _ucx.UCXXTagMask(KIND_MASK), True)
            if pr.matched:
                self._take_request(pr)
                took = True
            elif took or time.monotonic() >= end:
                return took
        return took

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
                    p.poll(100)
            except Exception:   # never let the loop die silently
                log.exception("ucx server loop")
                time.sleep(0.05)

    def _take_request(self, pr: Any) -> None:
        tag, length = pr.sender_tag, pr.length
        tag = tag.value if hasattr(tag, "value") else int(tag)
        cid, rid = (tag >> 32) & 0xFFFFFF, tag & 0xFFFFFFFF
        too_big = length > MAX_CONTROL + 1 or length == 0
        buf = bytearray(1 if too_big else length)
        with self.worker.lock:
            req = self.worker.w.tag_recv_with_handle(Array(buf), pr)
        try:
            self.worker.wait(lambda: req.completed, self.timeout.transfer, "request")
            if not too_big:
                _check(req, "request")
        except KVBridgeError as exc:
            log.debug("dropping a request: %s", exc)
            if not too_big:
                return
        with self._clock:
            client = self._clients.get(cid)
        if client is None:
            return   # unknown client: nobody to answer
        client.asked = time.monotonic()
        if too_big:
            self._reply(client, rid, ST_ERROR, encode_error(FrameTooLarge(
                f"request of {length} bytes exceeds {MAX_CONTROL}" if length else "empty request")))
            return
        op = buf[0]
        if op == OP_WREQ or (op == OP_READ and _wants_layers(buf)):
            try:
                self._pool.submit(self._ucx_serve, client, rid, bytes(buf))   # these may wait: not on the loop
            except RuntimeError:
                pass   # shutting down
        else:
            self._ucx_serve(client, rid, bytes(buf), on_loop=True)

    def _alive(self, client: _Client) -> Callable[[], None]:
        def check() -> None:
            if not client.alive or self._stop.is_set():
                raise ConnectionLost("client went away")
        return check

    def _reply(self, client: _Client, rid: int, status: int, body: bytes = b"",
               data: Optional[Sequence[memoryview]] = None) -> None:
        msg = bytes([status]) + body + (b"".join(data) if data else b"")
        req = client.ep.send(msg, _tag(T_HDR, client.cid, rid))
        if time.monotonic() - client.asked > SPIN / 2:
            self._ring(client)     # the client polls for SPIN after asking; later it may sleep
        _wait_reqs(self.worker, [req], self.timeout.transfer, "reply", self._alive(client), (client.conn.fileno(),),
                   lambda: self._ring(client))

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
                self._reply(client, rid, ST_OK, payload)
            else:
                self._reply(client, rid, ST_ERROR, encode_error(ProtocolError(f"unknown request op {op}")))
        except KVBridgeError as exc:
            log.debug("ucx request %d of client %d: %s", rid, client.cid, exc)
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
        """The header, the bytes as DATA messages, then the validate-after-read trailer."""
        try:
            stream.stage_out()
            self._reply(client, rid, ST_OK, head)
            dtag = _tag(T_DATA, client.cid, rid)
            _send_stream(self.worker, client.ep, dtag, stream, self.timeout.transfer, "send", self._alive(client),
                         (client.conn.fileno(),), lambda: self._ring(client))
            client.asked = time.monotonic()
            # validate-after-read: the bytes left while the grant held the blocks; say whether
            # they were still the handle's (an engine may retire pinned blocks) when the last went
            trailer = b"" if grant.still_valid() else encode_error(
                StaleHandle("blocks were freed or reused during the transfer; bytes discarded"))
            tmsg = bytes([ST_ERROR if trailer else ST_OK]) + trailer
            req = client.ep.send(tmsg, dtag | DONE_BIT)
            _wait_reqs(self.worker, [req], self.timeout.transfer, "send", self._alive(client), (client.conn.fileno(),),
                       lambda: self._ring(client))
        except KVBridgeError as exc:
            if not close:
                raise
            log.debug("ucx read %d of client %d: %s", rid, client.cid, exc)   # the client sees it fail
        finally:
            if close:
                grant.close()

    def _ucx_write(self, client: _Client, rid: int, payload: bytes) -> None:
        try:
            req = decode_request(payload)
            if req.layers is None:
                raise ProtocolError("write request names no layers")
            grant = self.sink.open_write(req.ticket, req.layers, req.claim)
        except KVBridgeError as exc:
            self._reply(client, rid, ST_ERROR, encode_error(exc))
            return
        try:
            stream = _Stream(grant.spans)
            if req.nbytes != stream.nbytes:
                raise ProtocolError(f"write of {req.nbytes} bytes, the reserved blocks hold {stream.nbytes}")
            self._reply(client, rid, ST_GO)
            alive = self._alive(client)
            dtag = _tag(T_DATA, client.cid, rid)

            def post(view: memoryview, k: int) -> Any:
                with self.worker.lock:
                    return self.worker.w.tag_recv(Array(view), _ucx.UCXXTag(dtag), _ucx.UCXXTagMaskFull)
            failed: Optional[KVBridgeError] = None
            try:
                _recv_stream(self.worker, post, stream, self.timeout.transfer, "write", alive, (client.conn.fileno(),),
                             lambda: self._ring(client))
                client.asked = time.monotonic()
                stream.stage_in()
            except KVBridgeError as exc:
                failed = exc
            # the writer's DONE message: checksums and the last flag
            done = self._recv_control(client, _tag(T_DATA, client.cid, rid) | DONE_BIT)
            if failed is not None:
                raise failed
            dreq = decode_request(done)
            grant.finish(dreq.sums, dreq.last)
            self._reply(client, rid, ST_OK)
        except KVBridgeError as exc:
            try:
                self._reply(client, rid, ST_ERROR, encode_error(exc))
            except KVBridgeError:
                pass
        finally:
            grant.close()

    def _recv_control(self, client: _Client, tag: int) -> bytes:
        return _recv_probed(self.worker, tag, MAX_CONTROL, self.timeout.transfer, "write done", self._alive(client),
                            (client.conn.fileno(),), lambda: self._ring(client))

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


