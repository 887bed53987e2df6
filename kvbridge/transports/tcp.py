"""tcp:// -- block bytes stream straight from the sender's pool into the receiver's.

The receiver sends one READ frame (the handle, optional block indices); the server
authorizes it against the sender (live handle, token/MAC, generations), answers
with a DATA header and ``sendmsg``s the pool memory; the receiver
``recvmsg_into``s directly into destination pool memory. No intermediate buffers,
no per-block ``bytes``. Connections are pooled and reused; ``read_many``
pipelines requests on one connection; many receivers may read at once (one
thread per connection on the server).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

from ..errors import ConfigError, ConnectionLost, KVBridgeError, PeerUnavailable, ProtocolError
from ..handle import KVHandle
from ..policy import Timeout
from .base import BlockSource, ReadOp, Server, Spans, Transport
from .staging import RingPool, recv_staged, send_staged
from .wire import (HEADER, MAX_CONTROL, RECV_WINDOW, Claim, FrameReader, Kind, _advance, _window, decode_error,
                   decode_read,
                   encode_error, encode_read, map_os_error, pack, recv_exact, recv_scatter, send_all,
                   set_os_timeouts, unpack_header)

__all__ = ["TCPTransport", "SocketServer", "SocketClient", "connector", "parse_tcp_url"]

log = logging.getLogger("kvbridge.tcp")
PIPELINE_WINDOW = 16
IDLE_TIMEOUT = 300.0


def parse_tcp_url(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    if u.scheme != "tcp" or not u.hostname:
        raise ConfigError(f"expected tcp://host:port, got {url!r}")
    try:
        port = u.port or 0
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None
    return u.hostname, port


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SocketServer(Server):
    """A threaded frame server on a listening socket; subclasses answer frame kinds."""

    def __init__(self, listener: socket.socket, url: str, source: BlockSource, timeout: Timeout) -> None:
        self.url = url
        self.source = source
        self.timeout = timeout
        self._listener = listener
        self._closed = threading.Event()
        self._rings = RingPool()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvb-accept {url}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break
            _tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                             name=f"kvb-conn {self.url}").start()

    def _serve_conn(self, conn: socket.socket) -> None:
        # Blocking socket with kernel timeouts: a peer that stalls mid-frame or mid-send for
        # `transfer` seconds is dropped; between frames we wait up to idle_timeout().
        tick = max(0.05, min(self.timeout.transfer, IDLE_TIMEOUT))
        set_os_timeouts(conn, tick)
        reader = FrameReader(conn)
        idle = 0.0
        try:
            while not self._closed.is_set():
                try:
                    kind, req_id, payload = reader.read_frame(MAX_CONTROL)
                except BlockingIOError:
                    idle += tick
                    if not reader.empty or idle >= self.idle_timeout(conn):
                        return
                    continue
                except (ConnectionLost, OSError):
                    return
                except ProtocolError as exc:   # includes FrameTooLarge: peers never send data here
                    self._reply_error(conn, 0, exc)
                    return   # framing is lost: close
                idle = 0.0
                if not self.handle(conn, kind, req_id, payload):
                    return
        except (OSError, KVBridgeError) as exc:
            log.debug("connection closed: %s", exc)
        finally:
            self.connection_closed(conn)
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def idle_timeout(self, conn: socket.socket) -> float:
        """How long to wait for the next frame on ``conn``."""
        return IDLE_TIMEOUT

    def connection_closed(self, conn: socket.socket) -> None:
        """Hook: ``conn`` is gone (release what it held)."""

    def _reply_error(self, conn: socket.socket, req_id: int, exc: KVBridgeError) -> None:
        try:
            conn.sendall(pack(Kind.ERROR, req_id, encode_error(exc)))
        except OSError:
            pass

    def handle(self, conn: socket.socket, kind: Kind, req_id: int, payload: bytes) -> bool:
        """Answer one frame; return False to close the connection."""
        if kind is Kind.READ:
            return self._serve_read(conn, req_id, payload)
        if kind in (Kind.RELEASE, Kind.RELEASE_NOREPLY):
            try:
                self.source.release_remote(payload)
            except KVBridgeError as exc:
                if kind is Kind.RELEASE:
                    self._reply_error(conn, req_id, exc)
                else:
                    log.info("release refused: %s", exc)
                return True
            if kind is Kind.RELEASE:
                conn.sendall(pack(Kind.OK, req_id))
            return True
        if kind is Kind.PING:
            conn.sendall(pack(Kind.PONG, req_id, payload))
            return True
        self._reply_error(conn, req_id, ProtocolError(f"unexpected {kind.name} frame"))
        return True

    def _serve_read(self, conn: socket.socket, req_id: int, payload: bytes) -> bool:
        try:
            handle_bytes, indices, claim = decode_read(payload)
            grant = self.source.open_read(handle_bytes, indices, claim)
        except KVBridgeError as exc:
            self._reply_error(conn, req_id, exc)
            return True
        try:
            head = pack(Kind.DATA, req_id, length=grant.spans.nbytes)
            if grant.spans.pool.is_host:
                send_all(conn, [head, *grant.spans.views()])
            else:
                ring = self._rings.take()
                try:
                    send_staged(conn, grant.spans, ring, head)
                finally:
                    self._rings.give(ring)
        finally:
            grant.close()
        return True

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)


def connector(family: int, address: Any, url: str) -> Callable[[float], socket.socket]:
    """A connect function for SocketClient: a stream socket to ``address``, errors mapped."""
    def connect(timeout: float) -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(address)
        except OSError as exc:
            s.close()
            raise PeerUnavailable(f"cannot connect to {url}: {exc}") from None
        return s
    return connect


class SocketClient:
    """Pooled connections to frame servers, keyed by address."""

    def __init__(self, connect: Callable[[float], socket.socket], timeout: Timeout) -> None:
        self._connect = connect
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._req = 0
        self.opened = 0

    def acquire(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = self._connect(self.timeout.connect)
        self.opened += 1
        _tune(sock)
        set_os_timeouts(sock, self.timeout.transfer)
        return sock

    def put_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < 8:
                self._idle.append(sock)
                return
        sock.close()

    def next_id(self) -> int:
        self._req = (self._req + 1) & 0xFFFFFFFF
        return self._req

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def release(self, handle: KVHandle, wait: bool, what: str) -> None:
        """RELEASE (and read the answer), or RELEASE_NOREPLY: one send, no round trip."""
        if not wait:
            sock = self.acquire()
            try:
                sock.sendall(pack(Kind.RELEASE_NOREPLY, self.next_id(), handle.to_bytes()))
            except BaseException as exc:
                sock.close()
                raise map_os_error(exc, what) from None
            self.put_back(sock)
            return
        sock, kind, _, length = self.call(Kind.RELEASE, handle.to_bytes(), what)
        try:
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, what) from None
        self.put_back(sock)
        if kind is Kind.ERROR:
            raise decode_error(body)

    def call(self, kind: Kind, payload: bytes, what: str) -> tuple[socket.socket, Kind, int, int]:
        """Send one control frame and read the reply header (the caller reads the body)."""
        sock = self.acquire()
        try:
            rid = self.next_id()
            sock.sendall(pack(kind, rid, payload))
            k, got_id, length = unpack_header(recv_exact(sock, HEADER.size))
            if got_id != rid and k is not Kind.ERROR:
                raise ProtocolError(f"{what}: reply for request {got_id}, expected {rid}")
            return sock, k, got_id, length
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, what) from None


def _read_reply_data(sock: socket.socket, kind: Kind, length: int, dst: Spans, what: str) -> int:
    if kind is Kind.ERROR:
        raise decode_error(recv_exact(sock, length))
    if kind is not Kind.DATA:
        raise ProtocolError(f"{what}: expected DATA, got {kind.name}")
    if length != dst.nbytes:
        raise ProtocolError(f"{what}: sender offers {length} bytes, destination holds {dst.nbytes}")
    if not dst.pool.is_host:
        ring = _RINGS.take()
        try:
            return recv_staged(sock, dst, ring)
        finally:
            _RINGS.give(ring)
    return recv_scatter(sock, dst.views(), dst.landed if dst.verifier is not None else None)


_RINGS = RingPool()


class TCPTransport(Transport):
    scheme = "tcp"

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._clients: dict[tuple[str, int], SocketClient] = {}
        self._by_url: dict[str, SocketClient] = {}
        self._aclients: dict[tuple[int, str, int], list[socket.socket]] = defaultdict(list)
        self._lock = threading.Lock()

    @classmethod
    def serve(cls, url: str, source: BlockSource, timeout: Timeout = Timeout()) -> Server:
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
        with self._lock:
            c = self._clients.get(addr)
            if c is None:
                family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
                c = self._clients[addr] = SocketClient(connector(family, addr, url), self.timeout)
            self._by_url[url] = c
        return c

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        client = self._client(url)
        sock, kind, _, length = client.call(Kind.READ, encode_read(handle.to_bytes(), indices, claim), f"read {url}")
        try:
            n = _read_reply_data(sock, kind, length, dst, f"read {url}")
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, f"read from {url}") from None
        client.put_back(sock)
        return n

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
        try:
            for i, op in enumerate(ops):
                while sent < len(ops) and sent < i + PIPELINE_WINDOW:
                    rid = client.next_id()
                    ids.append(rid)
                    sock.sendall(pack(Kind.READ, rid, encode_read(ops[sent].handle.to_bytes(), ops[sent].indices,
                                                                    ops[sent].claim)))
                    sent += 1
                kind, rid, length = unpack_header(recv_exact(sock, HEADER.size))
                if rid != ids[i]:
                    raise ProtocolError(f"pipelined reply {rid} out of order (expected {ids[i]})")
                try:
                    op.result = _read_reply_data(sock, kind, length, op.dst, f"read {url}")
                except KVBridgeError as exc:
                    if kind is not Kind.ERROR:
                        raise
                    op.result = exc
        except BaseException as exc:
            sock.close()
            err = map_os_error(exc, f"pipelined read from {url}")
            for op in ops:
                if op.result is None:
                    op.result = err
            return ops
        client.put_back(sock)
        return ops

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self._client(url).release(handle, wait, f"release {url}")

    def ping(self, url: str, payload: bytes = b"") -> None:
        client = self._client(url)
        sock, kind, _, length = client.call(Kind.PING, payload, f"ping {url}")
        try:
            recv_exact(sock, length)
        finally:
            client.put_back(sock)

    # -- asyncio: non-blocking sockets driven by the event loop, same frames -----------
    async def _aconnect(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        key = (id(loop), host, port)
        pool = self._aclients[key]
        if pool:
            return pool.pop()
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), self.timeout.connect)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise PeerUnavailable(f"cannot connect to tcp://{host}:{port}: {exc!r}") from None
        _tune(sock)
        return sock

    async def _arecv_exact(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        await self._arecv_scatter(loop, sock, [memoryview(buf)])
        return bytes(buf)

    async def _arecv_scatter(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                             views: Sequence[memoryview]) -> None:
        vs = [v for v in views if len(v)]
        i = 0
        while i < len(vs):
            try:
                k = sock.recvmsg_into(vs[i:_window(vs, i, RECV_WINDOW)])[0]
            except (BlockingIOError, InterruptedError):
                fut = loop.create_future()
                def wake(fut: asyncio.Future[None] = fut) -> None:
                    if not fut.done():
                        fut.set_result(None)
                loop.add_reader(sock.fileno(), wake)
                try:
                    await fut
                finally:
                    loop.remove_reader(sock.fileno())
                continue
            if k == 0:
                raise ConnectionLost("peer closed the connection mid-transfer")
            i = _advance(vs, i, k)

    async def aread(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
                    claim: Optional[Claim] = None) -> int:
        if not dst.pool.is_host:   # device pools: staged copies block; run them off the loop
            return await super().aread(url, handle, dst, indices, claim)
        host, port = parse_tcp_url(url)
        loop = asyncio.get_running_loop()
        sock = await self._aconnect(loop, host, port)
        try:
            async with asyncio.timeout(self.timeout.transfer):
                rid = 1
                await loop.sock_sendall(sock, pack(Kind.READ, rid, encode_read(handle.to_bytes(), indices, claim)))
                kind, got, length = unpack_header(await self._arecv_exact(loop, sock, HEADER.size))
                if kind is Kind.ERROR:
                    raise decode_error(await self._arecv_exact(loop, sock, length))
                if kind is not Kind.DATA or got != rid:
                    raise ProtocolError(f"read {url}: unexpected {kind.name} reply")
                if length != dst.nbytes:
                    raise ProtocolError(f"read {url}: sender offers {length} bytes, destination holds {dst.nbytes}")
                await self._arecv_scatter(loop, sock, dst.views())
        except BaseException as exc:
            sock.close()   # an error reply is rare; a fresh connection is simpler than resync
            if not isinstance(exc, Exception):
                raise      # cancellation and interrupts propagate as they are
            raise map_os_error(exc, f"read from {url}") from None
        self._aclients[(id(loop), host, port)].append(sock)
        return dst.nbytes

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
        for socks in self._aclients.values():
            for s in socks:
                s.close()
        self._aclients.clear()


