"""shm:// -- same host: the receiver maps the sender's shared-memory pool and memcpys.

The sender's pool must live in POSIX shared memory (``KVPool.allocate(...,
shared=True)``). A small control channel (a unix socket) carries the same
handle/token checks as tcp: MAP asks for the handle's blocks and gets the segment
name and byte runs, the receiver copies, then DONE asks whether the handle is
still valid -- the server holds an in-flight count between MAP and DONE, so the
blocks cannot be freed under the copy, and a stale answer discards the bytes.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import tempfile
import threading
from collections import OrderedDict
from typing import Optional
from urllib.parse import urlsplit

from ..errors import ConfigError, KVBridgeError, ProtocolError, StaleHandle
from ..handle import KVHandle
from ..policy import Timeout
from ..pool import SharedSegment
from .base import BlockSource, ReadGrant, Server, Spans, Transport, copy_runs
from .staging import copy_slices, device_slices
from .tcp import SocketClient, SocketServer, connector
from .wire import (HEADER, Claim, Kind, decode_error, decode_read, encode_read, map_os_error, pack, recv_exact,
                   unpack_header)

__all__ = ["ShmTransport"]

_RUN = struct.Struct("!QQ")
MAX_MAPPED = 16


def _path_of(url: str) -> str:
    u = urlsplit(url)
    if u.scheme != "shm":
        raise ConfigError(f"expected shm:///path/to/control.sock, got {url!r}")
    return u.path


class ShmServer(SocketServer):
    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self._open: dict[socket.socket, dict[int, ReadGrant]] = {}
        self._glock = threading.Lock()

    def idle_timeout(self, conn: socket.socket) -> float:
        # A receiver holding a mapping must finish its copy within the transfer timeout.
        return self.timeout.transfer if self._open.get(conn) else super().idle_timeout(conn)

    def connection_closed(self, conn: socket.socket) -> None:
        with self._glock:
            grants = self._open.pop(conn, {})
        for g in grants.values():
            g.close()

    def handle(self, conn: socket.socket, kind: Kind, req_id: int, payload: bytes) -> bool:
        if kind is Kind.MAP:
            try:
                handle_bytes, indices, claim = decode_read(payload)
                grant = self.source.open_read(handle_bytes, indices, claim)
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            pool = grant.spans.pool
            if pool.segment is None:
                grant.close()
                self._reply_error(conn, req_id, ConfigError(
                    "shm:// needs the sender's pool in shared memory: KVPool.allocate(..., shared=True)"))
                return True
            with self._glock:
                self._open.setdefault(conn, {})[req_id] = grant
            offs = pool.buffer_offsets
            name = pool.segment.name.encode()
            body = [struct.pack("!H", len(name)), name, struct.pack("!I", len(grant.spans.segments))]
            body += [_RUN.pack(offs[b] + o, n) for b, o, n in grant.spans.segments]
            conn.sendall(pack(Kind.MAPPED, req_id, b"".join(body)))
            return True
        if kind is Kind.DONE:
            with self._glock:
                done: Optional[ReadGrant] = self._open.get(conn, {}).pop(req_id, None)
            if done is None:
                self._reply_error(conn, req_id, ProtocolError("DONE for no open mapping"))
                return True
            try:
                valid = done.still_valid()
            finally:
                done.close()
            if valid:
                conn.sendall(pack(Kind.OK, req_id))
            else:
                self._reply_error(conn, req_id, StaleHandle("blocks were freed during the copy; bytes discarded"))
            return True
        return super().handle(conn, kind, req_id, payload)


def _parse_mapped(payload: bytes) -> tuple[str, list[tuple[int, int]]]:
    try:
        (nl,) = struct.unpack_from("!H", payload, 0)
        name = payload[2:2 + nl].decode()
        (n,) = struct.unpack_from("!I", payload, 2 + nl)
        base = 6 + nl
        if len(payload) != base + n * _RUN.size:
            raise ProtocolError("MAPPED frame has the wrong length")
        return name, [_RUN.unpack_from(payload, base + i * _RUN.size) for i in range(n)]
    except (struct.error, UnicodeDecodeError):
        raise ProtocolError("MAPPED frame is malformed") from None


class ShmTransport(Transport):
    scheme = "shm"

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._clients: dict[str, SocketClient] = {}
        self._maps: OrderedDict[str, SharedSegment] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def serve(cls, url: str, source: BlockSource, timeout: Timeout = Timeout()) -> Server:
        path = _path_of(url) or os.path.join(tempfile.gettempdir(), f"kvb-{os.getpid()}-{secrets.token_hex(4)}.sock")
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(path)
            lst.listen(128)
        except OSError as exc:
            lst.close()
            raise ConfigError(f"cannot listen on {path}: {exc}") from None
        srv = ShmServer(lst, f"shm://{path}", source, timeout)
        close = srv.close

        def close_and_unlink() -> None:
            close()
            try:
                os.unlink(path)
            except OSError:
                pass
        srv.close = close_and_unlink  # type: ignore[method-assign]
        return srv

    def _client(self, url: str) -> SocketClient:
        path = _path_of(url)
        with self._lock:
            c = self._clients.get(path)
            if c is None:
                c = self._clients[path] = SocketClient(connector(socket.AF_UNIX, path, url), self.timeout)
        return c

    def _segment(self, name: str) -> SharedSegment:
        with self._lock:
            seg = self._maps.get(name)
            if seg is not None:
                self._maps.move_to_end(name)
                return seg
        try:
            seg = SharedSegment(name)   # lazy: a fetch faults in only the pages it reads
        except ConfigError as exc:
            raise StaleHandle(f"sender's shared memory is gone: {exc}") from None
        with self._lock:
            self._maps[name] = seg
            while len(self._maps) > MAX_MAPPED:
                self._maps.popitem(last=False)[1].close()
        return seg

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        client = self._client(url)
        sock, kind, rid, length = client.call(Kind.MAP, encode_read(handle.to_bytes(), indices, claim), f"map {url}")
        try:
            payload = recv_exact(sock, length) if length else b""
            if kind is Kind.ERROR:
                client.put_back(sock)
                raise decode_error(payload)
            if kind is not Kind.MAPPED:
                raise ProtocolError(f"map {url}: unexpected {kind.name} reply")
            name, runs = _parse_mapped(payload)
            seg = self._segment(name)
            if any(o + n > seg.size for o, n in runs):
                raise ProtocolError("sender named bytes outside its segment")
            if dst.pool.is_host:
                n = copy_runs(dst.runs(), [(seg.address + o, k) for o, k in runs],
                              dst.landed if dst.verifier is not None else None)
            else:   # a device pool: host-to-device straight from the mapped segment
                whole = seg.tensor()
                n = copy_slices(device_slices(dst), [whole[o:o + k] for o, k in runs])
            sock.sendall(pack(Kind.DONE, rid))
            k2, _, l2 = unpack_header(recv_exact(sock, HEADER.size))
            body = recv_exact(sock, l2) if l2 else b""
        except KVBridgeError as exc:
            if kind is not Kind.ERROR:
                sock.close()
            raise exc from None
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, f"read from {url}") from None
        client.put_back(sock)
        if k2 is Kind.ERROR:
            raise decode_error(body)   # validate-after-read failed: the bytes must not be used
        return n

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self._client(url).release(handle, wait, f"release {url}")

    def close(self) -> None:
        with self._lock:
            clients, maps = list(self._clients.values()), list(self._maps.values())
            self._clients.clear()
            self._maps.clear()
        for c in clients:
            c.close()
        for m in maps:
            m.close()
