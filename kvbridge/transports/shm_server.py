"""shm://'s control-channel server (the sender's for reads, a push receiver's for writes):
:class:`ShmServer` answers OPEN (where a one-sided reader maps this sender's pool, generations
and live-handle table), MAP/WMAP (a grant held, and the segment and byte runs it names) and
DONE/WDONE (the re-check, or the pushed layers verified), at most ``MAX_GRANTS`` mappings per
connection, each due within the transfer timeout. Also here: the control socket's address
(:func:`_path_of`) and the MAPPED body's run format, which the client side (:mod:`.shm`)
parses. The protocol as a whole is described in :mod:`.shm`."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import AccessDenied, ConfigError, KVBridgeError, ProtocolError, StaleHandle, TransferTimeout
from ..segments import peer_cred
from .shmtable import ONE_SIDED, HandleTable, open_info
from .socket_server import SocketServer
from .wire import FENCE, FrameReader, Kind, decode_request, encode_layers, pack, send_with_fd

__all__ = ["ShmServer"]

_RUN = struct.Struct("!QQ")
MAX_GRANTS = 16   # mappings (MAP/WMAP without their DONE/WDONE yet) one control connection may hold
MAX_SHOWN = 16    # segments named on one connection whose descriptors it may still ask for (SEGFD)


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
        # per connection: the segments its MAPPED replies named (the latest MAX_SHOWN), name ->
        # (segment, writable: named by a WMAP): the only descriptors SEGFD hands it
        self._shown: dict[socket.socket, OrderedDict[str, tuple[Any, bool]]] = {}
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
            self._shown.pop(conn, None)
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

    def _show(self, conn: socket.socket, segment: Any, writable: bool) -> None:
        """``conn`` was told ``segment``'s name: it may ask for its descriptor (SEGFD). None (a
        pool not in shared memory: nvlink's, which names no segment) shows nothing."""
        if segment is None:
            return
        with self._glock:
            shown = self._shown.setdefault(conn, OrderedDict())
            was = shown.pop(segment.name, None)
            shown[segment.name] = (segment, writable or (was is not None and was[1]))
            while len(shown) > MAX_SHOWN:
                shown.popitem(last=False)

    def _segfd(self, conn: socket.socket, req_id: int, payload: bytes) -> None:
        """SEGFD: the descriptor of a segment a MAPPED reply on this connection named -- read-only
        unless a WMAP named it and the writer asks for a writable one; anything else refused."""
        flag, name = payload[:1], payload[1:].decode("ascii", "replace")
        writable = flag == b"\x01"
        with self._glock:
            shown = self._shown.get(conn)
            got = shown.get(name) if shown is not None else None
        if got is None or flag not in (b"\x00", b"\x01"):
            self._reply_error(conn, req_id, ProtocolError("SEGFD names no segment a reply on this connection named"))
            return
        if writable and not got[1]:
            self._reply_error(conn, req_id, ProtocolError("SEGFD asks to write a segment this connection may "
                                                          "only read"))
            return
        uid = peer_cred(conn)[1]
        if uid not in (os.geteuid(), 0):       # its segments are this user's alone (mode 0600)
            self._reply_error(conn, req_id, AccessDenied(
                f"shared memory is handed only to this user's processes (the peer is uid {uid})"))
            return
        try:
            fd = got[0].peer_fd(writable)       # a duplicate: a segment closed meanwhile cannot lend its number
        except (StaleHandle, ConfigError) as exc:   # closed meanwhile; or no descriptor to be had here
            self._reply_error(conn, req_id, exc)
            return
        try:
            send_with_fd(conn, pack(Kind.OK, req_id), fd)
        finally:
            os.close(fd)

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
            pool = self.source.pool    # type: ignore[attr-defined]
            self._show(conn, pool.segment, False)
            self._show(conn, self.table.segment, False)
            conn.sendall(pack(Kind.MAPPED, req_id, open_info(pool, self.table)))
            return True
        if kind is Kind.SEGFD:
            self._segfd(conn, req_id, payload)
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
            self._show(conn, getattr(grant.spans.pool, "segment", None), kind is Kind.WMAP)
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
