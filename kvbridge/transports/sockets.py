"""The socket plumbing shared by tcp:// and shm://'s control channel: a threaded frame
server and pooled client connections. Frames are defined in :mod:`.wire`."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable, Optional, cast

import torch

from .. import blockcopy
from ..errors import (ConfigError, ConnectionLost, KVBridgeError, PeerUnavailable, ProtocolError, TransferCancelled,
                      TransferTimeout)
from ..handle import KVHandle
from ..logs import RateLimitedLog
from ..policy import Timeout
from .base import BlockSink, BlockSource, Server
from .deadline import CANCELLED, WATCHDOG
from .staging import RingPool, copy_slices, device_slices, send_staged
from .wire import (FENCE, HEADER, MAX_CONTROL, TRAILER, Budget, FrameReader, Kind, PacedSender, RateGuard, decode_error,
                   decode_releases, decode_request, encode_error, encode_layers, encode_releases, encode_trailer,
                   map_os_error, pack, recv_exact, send_all, send_iter, set_os_timeouts, unpack_header, vouch_of)

__all__ = ["SocketServer", "SocketClient", "connector", "tune"]

log = logging.getLogger("kvbridge.sockets")
_limited = RateLimitedLog(log)
IDLE_TIMEOUT = 300.0
DISCARD_LIMIT = 4 << 20    # a refused write's bytes up to this are skipped (at MIN_RATE at least, after
                           # RATE_GRACE); past it the connection closes
MAX_CONNECTIONS = 4096     # per server; one more is answered with an error and closed
WORKERS = 64               # threads serving active connections, per server
PARK_AFTER = 0.25          # seconds idle before a connection leaves its worker for the selector
CONTROL_BUDGET = 64 << 20  # control-frame bytes all connections of a server may buffer at once
MAX_PING = 64              # PING payload echoed back, at most
ACCEPT_BACKOFF = 0.05     # seconds the accept loop waits after a failed accept (no fds left)
LINGER = 1.0               # seconds a connection closed on an error reply goes on discarding input
MAX_PEERS = 1024           # clients a transport keeps (one per sender address); the oldest beyond it retired
MIN_RATE = 1 << 20         # bytes/s a transfer must keep up after RATE_GRACE seconds
RATE_GRACE = 2.0
RELEASE_LINGER = 0.002  # seconds a deferred release waits for a request to ride on
# Deferred releases ride behind a request once this many wait (or go alone after the linger):
# the sender then ends them together (KVSender.release_many), its release path hot in cache,
# instead of one between every two reads.
RELEASE_BATCH = 16
SMALL_REPLY = 64 << 10     # host reads up to this are copied out, validated and sent in one call
_MORE = getattr(socket, "MSG_MORE", 0)   # tcp: hold a reply's tail until its trailer joins it in one segment


_NO_FENCE = FENCE.pack(0, 0)    # the reply to a read that was not leased
_arm, _disarm = WATCHDOG.arm, WATCHDOG.disarm   # bound once: every pooled exchange calls both


def tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)



class SocketServer(Server):
    """A frame server on a listening socket, for an endpoint that is a :class:`BlockSource`
    (reads), a :class:`BlockSink` (push writes), or both. Subclasses answer more frame kinds.

    Threads are for active connections only: at most ``WORKERS`` serve frames; a connection
    idle for ``PARK_AFTER`` seconds leaves its worker and waits in one selector thread until
    its next frame arrives, so thousands of idle peers cost file descriptors, not threads."""

    def __init__(self, listener: socket.socket, url: str, endpoint: Any, timeout: Timeout) -> None:
        self.url = url
        self.endpoint = endpoint
        self._source: Optional[BlockSource] = endpoint if hasattr(endpoint, "open_read") else None
        self._serve_small: Optional[Callable[[int, bytes, int], bool]] = getattr(endpoint, "serve_small", None)
        self._serve_next: Optional[Callable[[int, FrameReader], bool]] = (
            getattr(endpoint, "serve_next", None) if blockcopy.serve_next is not None else None)
        self._release_many: Optional[Callable[[list[bytes]], list[Optional[KVBridgeError]]]] = \
            getattr(endpoint, "release_many", None)
        self.timeout = timeout
        self._listener = listener
        self._closed = threading.Event()
        self._rings = RingPool()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._budget = Budget(CONTROL_BUDGET)
        self.max_connections = MAX_CONNECTIONS
        self.refused_connections = 0
        self._tick = max(0.05, min(self.timeout.transfer, PARK_AFTER))
        self._ready: queue.SimpleQueue[tuple[socket.socket, FrameReader]] = queue.SimpleQueue()
        self._workers = 0
        self._waiting = 0                       # workers waiting for a connection to serve
        self._queued = 0                        # connections put in _ready and not yet taken
        try:
            self._sel = selectors.DefaultSelector()
            try:
                self._wake_r, self._wake_w = socket.socketpair()     # close() wakes the selector at once
            except OSError:
                self._sel.close()
                raise
        except OSError as exc:     # no file descriptors left: nothing left open, a mapped error
            listener.close()
            raise ConfigError(f"cannot serve {url}: {exc}") from None
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._parked: dict[socket.socket, float] = {}
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvb-accept {url}", daemon=True)
        self._thread.start()
        self._poller = threading.Thread(target=self._poll_loop, name=f"kvb-idle {url}", daemon=True)
        self._poller.start()

    @property
    def source(self) -> BlockSource:
        if self._source is None:
            raise ProtocolError("this endpoint serves no reads (it is a receiver's push endpoint)")
        return self._source

    @property
    def sink(self) -> BlockSink:
        if not hasattr(self.endpoint, "open_write"):
            raise ProtocolError("this endpoint takes no writes (it is a sender's endpoint)")
        return self.endpoint  # type: ignore[no-any-return]

    @property
    def threads(self) -> int:
        """Worker threads started so far (at most ``WORKERS``)."""
        return self._workers

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    break
                # out of file descriptors or memory (EMFILE, ENOBUFS, ...), or a peer gone before it
                # was taken: the server goes on (it used to stop accepting for good)
                _limited.log(logging.WARNING, "accept", "%s: accept failed: %s", self.url, exc)
                time.sleep(ACCEPT_BACKOFF)
                continue
            tune(conn)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self.refused_connections += 1
                conn.settimeout(0.1)
                self._reply_error(conn, 0, ProtocolError(
                    f"server at its limit of {self.max_connections} connections; retry later"))
                conn.close()
                continue
            set_os_timeouts(conn, self._tick)
            self._dispatch(conn, FrameReader(conn, frame_timeout=self.timeout.transfer, budget=self._budget))

    def _dispatch(self, conn: socket.socket, reader: FrameReader) -> None:
        """Hand a connection with work (or a new one) to a worker, starting one unless a waiting
        worker is left for it: each waiting worker takes one connection, so connections that
        arrive together start as many workers (up to ``WORKERS``) rather than queue behind one."""
        with self._lock:
            self._ready.put((conn, reader))
            self._queued += 1
            start = self._queued > self._waiting and self._workers < WORKERS
            if start:
                self._workers += 1
        if start:
            threading.Thread(target=self._work_loop, name=f"kvb-conn {self.url}", daemon=True).start()

    def _work_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                self._waiting += 1
            try:
                item: Optional[tuple[socket.socket, FrameReader]] = self._ready.get(timeout=5.0)
            except queue.Empty:
                item = None
            with self._lock:
                self._waiting -= 1
                if item is not None:
                    self._queued -= 1
                if item is None and self._ready.empty():   # idle a while: give the thread back
                    self._workers -= 1
                    return
            if item is not None:
                self._serve_conn(*item)
        with self._lock:
            self._workers -= 1

    def _poll_loop(self) -> None:
        """Parked (idle) connections: back to a worker when a frame arrives; closed when idle
        past ``idle_timeout``."""
        while not self._closed.is_set():
            try:
                events = self._sel.select(timeout=1.0)
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                time.sleep(0.01)
                continue
            for key, _ in events:
                if key.data is None:                # the wake-up socket: closing
                    return
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                self._unpark(conn)
                self._dispatch(conn, key.data)
            now = time.monotonic()
            with self._lock:
                stale = [c for c, t in self._parked.items() if now - t > self.idle_timeout(c)]
            for c in stale:
                self._unpark(c)
                self._drop(c)

    def _park(self, conn: socket.socket, reader: FrameReader) -> None:
        with self._lock:
            self._parked[conn] = time.monotonic()
        try:
            self._sel.register(conn, selectors.EVENT_READ, reader)
        except (KeyError, ValueError, OSError):
            with self._lock:
                self._parked.pop(conn, None)
            self._drop(conn)

    def _unpark(self, conn: socket.socket) -> None:
        with self._lock:
            self._parked.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError, OSError):
            pass

    def can_park(self, conn: socket.socket) -> bool:
        """Whether an idle ``conn`` may leave its worker (it holds nothing open)."""
        return True

    def _serve_conn(self, conn: socket.socket, reader: FrameReader) -> None:
        # Blocking socket with kernel timeouts (one tick): a peer that stalls mid-frame for
        # `transfer` seconds is dropped; an idle one parks after PARK_AFTER.
        idle, linger = 0.0, False
        closed, small, step, fd = self._closed, self._serve_small, self._serve_next, conn.fileno()
        try:
            while not closed.is_set():
                try:
                    if step is not None and reader.start == reader.end and step(fd, reader):
                        idle = 0.0             # received and, the usual read, answered in one C call
                        continue
                    kind, req_id, payload = reader.read_frame(MAX_CONTROL)
                except BlockingIOError:
                    idle += self._tick
                    if not reader.empty:
                        if idle >= self.timeout.transfer:
                            break
                        continue
                    if idle >= PARK_AFTER and self.can_park(conn):
                        self._park(conn, reader)
                        return
                    if idle >= self.idle_timeout(conn):
                        break
                    continue
                except (ConnectionLost, OSError):
                    break
                except ProtocolError as exc:   # includes FrameTooLarge: peers never send data here
                    self._reply_error(conn, 0, exc)
                    linger = True
                    break    # framing is lost: close
                idle = 0.0
                if kind is Kind.READ and small is not None and small(fd, payload, req_id):
                    continue                   # the usual read, answered in one C call
                if not self.handle(conn, reader, kind, req_id, payload):
                    linger = True              # an error reply ends it
                    break
        except (OSError, KVBridgeError) as exc:
            log.debug("connection closed: %s", exc)
        except Exception:      # a bug: say so loudly, drop this connection, keep the worker
            log.exception("serving %s failed", self.url)
        self._drop(conn, linger)

    def _linger(self, conn: socket.socket) -> None:
        """Before closing on an error reply (what the connection held is let go already): end our
        side (FIN behind the reply), then discard what the peer sent meanwhile, until it is quiet
        for a tick, closes, or ``LINGER`` seconds or ``DISCARD_LIMIT`` bytes pass. Closing with
        unread input resets the connection, and a reset drops all still queued to send: the
        reply saying why, and even the tail of an earlier read's reply."""
        scratch = bytearray(64 << 10)
        left, end = DISCARD_LIMIT, time.monotonic() + LINGER
        try:
            conn.shutdown(socket.SHUT_WR)
            while left > 0 and time.monotonic() < end:
                k = conn.recv_into(scratch)
                if not k:
                    return
                left -= k
        except OSError:                # BlockingIOError: a quiet tick; or the peer is gone
            pass

    def _drop(self, conn: socket.socket, linger: bool = False) -> None:
        self.connection_closed(conn)
        with self._lock:
            self._conns.discard(conn)
        if linger:
            self._linger(conn)
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

    def handle(self, conn: socket.socket, reader: FrameReader, kind: Kind, req_id: int, payload: bytes) -> bool:
        """Answer one frame; return False to close the connection."""
        if kind is Kind.READ:
            return self._serve_read(conn, req_id, payload)
        if kind is Kind.WRITE:
            return self._serve_write(conn, reader, req_id, payload)
        if kind is Kind.RELEASES:        # no reply, whatever happens: the sender frees at expiry anyway
            try:
                many = decode_releases(payload)
            except ProtocolError as exc:
                log.info("releases refused: %s", exc)
                return True
            for refused in self._end_many(many):
                if refused is not None:
                    log.info("release refused: %s", refused)
            return True
        if kind in (Kind.RELEASE, Kind.WABORT):
            try:
                if kind is Kind.WABORT:
                    req = decode_request(payload)
                    self.sink.abort_remote(req.ticket, req.claim)
                else:
                    self.source.release_remote(payload)
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            conn.sendall(pack(Kind.OK, req_id))
            return True
        if kind is Kind.PING:
            if len(payload) > MAX_PING:
                self._reply_error(conn, req_id, ProtocolError(f"PING payload over {MAX_PING} bytes"))
                return True
            conn.sendall(pack(Kind.PONG, req_id, payload))
            return True
        self._reply_error(conn, req_id, ProtocolError(f"unexpected {kind.name} frame"))
        return True

    def _end_many(self, many: list[bytes]) -> list[Optional[KVBridgeError]]:
        """The releases that came in one frame, ended in one pass where the source can."""
        if self._release_many is not None:
            return self._release_many(many)
        out: list[Optional[KVBridgeError]] = []
        for raw in many:
            try:
                self.source.release_remote(raw)
                out.append(None)
            except KVBridgeError as exc:
                out.append(exc)
        return out

    def _serve_read(self, conn: socket.socket, req_id: int, payload: bytes) -> bool:
        try:
            req = decode_request(payload)
            grant = self.source.open_read(req.ticket, req.indices, req.claim, req.layers)
        except KVBridgeError as exc:
            self._reply_error(conn, req_id, exc)
            return True
        try:
            spans = grant.spans
            c = grant.claim
            prefix = FENCE.pack(c.epoch, c.counter) if c is not None else _NO_FENCE
            if req.layers is not None:
                prefix += encode_layers(*grant.layers, grant.sums)
            head = pack(Kind.DATA if req.layers is None else Kind.LDATA, req_id, prefix,
                        length=len(prefix) + spans.nbytes + TRAILER.size)
            if spans.pool.is_host and spans.nbytes <= SMALL_REPLY:
                # copied out first, validated after the copy, sent whole: one send per small read
                if blockcopy.NATIVE and spans.block_ids is not None:   # built in one buffer, in C
                    pool, pinned = spans.pool, spans.pool.buffers       # held across the C copy
                    out = blockcopy.gather_blocks(blockcopy.planes(pool), spans.block_ids, pool.layout.part_nbytes,
                                                  len(head), TRAILER.size)
                    del pinned
                    out[:len(head)] = head
                    out[len(out) - TRAILER.size:] = encode_trailer(vouch_of(grant))
                    conn.sendall(out)
                    return True
                body = b"".join(spans.views())
                conn.sendall(b"".join((head, body, encode_trailer(vouch_of(grant)))))
                return True
            # a reader that pauses is waited out; one slower than MIN_RATE after RATE_GRACE (or
            # taking nothing for Timeout.transfer) is dropped, its read no longer in flight
            out = cast(socket.socket, PacedSender(conn, RateGuard(MIN_RATE, RATE_GRACE), self.timeout.transfer))
            if spans.pool.is_host:
                send_iter(out, head, spans.iter_views(), None,
                          _MORE if conn.family in (socket.AF_INET, socket.AF_INET6) else 0)
            else:
                ring = self._rings.take()
                try:
                    send_staged(out, spans, ring, head)
                finally:
                    self._rings.give(ring)
            # validate-after-read: every byte has been handed to the kernel, so no later change
            # to the pool can alter what was sent; the grant still holds the blocks
            send_all(out, [encode_trailer(vouch_of(grant))])
        finally:
            grant.close()
        return True

    def _serve_write(self, conn: socket.socket, reader: FrameReader, req_id: int, payload: bytes) -> bool:
        """Push: authorize, then take the bytes that follow the frame straight into the
        reserved blocks, hashing as they land; answer OK only once they verified."""
        try:
            req = decode_request(payload)
            if req.layers is None:
                raise ProtocolError("WRITE frame names no layers")
        except KVBridgeError as exc:
            self._reply_error(conn, req_id, exc)
            return False                      # the data length is unknown: framing is lost
        try:
            grant = self.sink.open_write(req.ticket, req.layers, req.claim)
        except KVBridgeError as exc:
            if req.nbytes > DISCARD_LIMIT:
                self._reply_error(conn, req_id, exc)
                return False
            reader.skip(req.nbytes, RateGuard(MIN_RATE, RATE_GRACE))   # refused: drop its bytes, keep the connection
            self._reply_error(conn, req_id, exc)
            return True
        try:
            spans = grant.spans
            if req.nbytes != spans.nbytes:
                self._reply_error(conn, req_id, ProtocolError(
                    f"WRITE carries {req.nbytes} bytes, the reserved blocks hold {spans.nbytes}"))
                return False
            guard = RateGuard(MIN_RATE, RATE_GRACE)
            landed = spans.on_landed

            def progress(n: int) -> None:
                guard(n)
                if landed is not None:
                    landed(n)
            try:
                if spans.pool.is_host:
                    reader.read_into(spans.views(), progress, self.timeout.transfer)
                else:    # a device pool: land in host memory (the same guard and cancel checks), copy up
                    bounce = torch.empty(spans.nbytes, dtype=torch.uint8)
                    reader.read_into([bounce.numpy().data], progress, self.timeout.transfer)
                    spans.landed(spans.nbytes)   # not cancelled meanwhile: the blocks are still the write's
                    copy_slices(device_slices(spans), [bounce])
            except KVBridgeError as exc:      # cancelled mid-write: the rest of the frame is unread
                self._reply_error(conn, req_id, exc)
                return False
            try:
                grant.finish(req.sums, req.last)
            except KVBridgeError as exc:
                self._reply_error(conn, req_id, exc)
                return True
            conn.sendall(pack(Kind.OK, req_id))
            return True
        finally:
            grant.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
            parked = list(self._parked)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)
        self._poller.join(timeout=2)
        for c in parked:
            self._unpark(c)
            self._drop(c)
        while True:        # connections queued for a worker: none takes them now (they leaked)
            try:
                c, _ = self._ready.get_nowait()
            except queue.Empty:
                break
            self._drop(c)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


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
    """Pooled connections to frame servers, keyed by address.

    Every exchange on a connection it hands out may be held to a whole-reply deadline
    (:mod:`.deadline`): :meth:`arm` it, end it with :meth:`put_back` (pooled again, unless the
    deadline cut it) or :meth:`fail` (closed; the error to raise, a cut one a
    ``TransferTimeout``). ``expect=`` on :meth:`prepare`, :meth:`send` and :meth:`call` arms it
    there; without it the caller bounds the exchange itself."""

    def __init__(self, connect: Callable[[float], socket.socket], timeout: Timeout) -> None:
        self._connect = connect
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._req = 0
        self.opened = 0
        self._pending: list[bytes] = []   # handles released without a reply: a RELEASES frame to send
        self._scheduled = False           # the flusher will visit this client
        self._waited = False              # ... and has already put its sending off once
        self._retired = False             # dropped from its transport's table: pools nothing more

    def acquire(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = self._connect(self.timeout.connect)
        self.opened += 1
        tune(sock)
        set_os_timeouts(sock, self.timeout.transfer)
        return sock

    def deadline(self, expect: int, start: Optional[float] = None) -> float:
        """When an exchange begun at ``start`` (now) whose reply (and request data) is ``expect``
        bytes must have ended: ``Timeout.transfer`` plus those bytes at ``MIN_RATE``."""
        return (time.monotonic() if start is None else start) + self.timeout.transfer + expect / MIN_RATE

    def arm(self, sock: socket.socket, expect: int, start: Optional[float] = None) -> None:
        """Hold the exchange on ``sock`` to :meth:`deadline` (re-arming moves it)."""
        _arm(sock, self.deadline(expect, start))

    def put_back(self, sock: socket.socket) -> None:
        """The exchange on ``sock`` ended well: pooled again (closed if its deadline cut it)."""
        if _disarm(sock):
            sock.close()
            return
        with self._lock:
            if len(self._idle) < 8 and not self._retired:
                self._idle.append(sock)
                return
        sock.close()

    def drop(self, sock: socket.socket) -> None:
        """The exchange on ``sock`` ended and the connection is not to be reused: closed."""
        _disarm(sock)
        sock.close()

    def fail(self, sock: socket.socket, exc: BaseException, what: str) -> KVBridgeError:
        """The exchange on ``sock`` failed with ``exc``: the connection closed and the error to
        raise (as :func:`.wire.map_os_error`; a lost connection that the deadline cut is a
        ``TransferTimeout``)."""
        cut = _disarm(sock)
        sock.close()
        if cut and isinstance(exc, (OSError, ConnectionLost)):
            return self.cut_error(what, cut)
        return map_os_error(exc, what)

    def cut_error(self, what: str, cut: int = True) -> KVBridgeError:
        """The error of an exchange the watchdog cut (``cut``, its verdict): at the transfer's
        cancel, or at its deadline."""
        if cut == CANCELLED:
            return TransferCancelled(f"{what}: transfer cancelled")
        return TransferTimeout(f"{what}: the whole reply did not come within Timeout.transfer "
                               f"({self.timeout.transfer:g} s) plus its bytes at the minimum rate: "
                               "the peer trickles it")

    def next_id(self) -> int:
        with self._lock:
            self._req = (self._req + 1) & 0xFFFFFFFF
            return self._req

    def close(self) -> None:
        self.flush()
        self.retire()

    def retire(self) -> None:
        """Its transport forgot it (:func:`remember`): idle connections closed now, those in use
        as they come back; deferred releases still go (the flusher holds the client)."""
        with self._lock:
            self._retired = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


    def release(self, handle: KVHandle, wait: bool, url: str) -> None:
        """RELEASE (and read the answer), or a release without a reply and without a send of its
        own: it rides, in one RELEASES frame with ``RELEASE_BATCH`` - 1 others, behind one of this
        client's next requests, or goes (with those waiting) after ``RELEASE_LINGER``."""
        if not wait:
            raw = handle.to_bytes()
            with self._lock:
                self._pending.append(raw)
                first = not self._scheduled      # one flusher visit per linger, not one per release
                self._scheduled = True
            if first:
                _FLUSHER.schedule(self)
            return
        self.control(Kind.RELEASE, handle.to_bytes(), f"release {url}")

    def frames(self, frame: bytes) -> bytes:
        """``frame`` followed by the deferred releases once ``RELEASE_BATCH`` of them wait (served
        after it: they never delay it)."""
        if len(self._pending) < RELEASE_BATCH:
            return frame
        with self._lock:
            pending, self._pending = self._pending, []
            self._waited = False   # carried; a visit already scheduled stays (it finds nothing, or the next ones)
        return frame + encode_releases(pending)

    def flush(self, idle_only: bool = False) -> bool:
        """Send the deferred releases now; False when ``idle_only``, no pooled connection is
        idle (perhaps a request in flight, which the releases will ride behind next) and the
        last visit did not wait already. A failure is logged: the sender frees at expiry."""
        with self._lock:
            if idle_only and not self._idle and self._pending and not self._waited:
                self._waited = True
                return False
            pending, self._pending = self._pending, []
            self._scheduled = self._waited = False
        if not pending:
            return True
        try:
            sock = self.acquire()
        except KVBridgeError as exc:
            log.info("deferred release of %d handle(s) not sent: %s", len(pending), exc)
            return True
        frames = encode_releases(pending)
        self.arm(sock, len(frames))
        try:
            sock.sendall(frames)
        except OSError as exc:
            log.info("deferred release of %d handle(s) not sent: %s", len(pending), self.fail(sock, exc, "release"))
            return True
        self.put_back(sock)
        return True

    def control(self, kind: Kind, payload: bytes, what: str) -> tuple[Kind, bytes]:
        """One control round trip: the reply's kind and body; an ERROR reply is raised. The
        deadline grows with the body the reply declares (``MAX_CONTROL`` at most)."""
        start = time.monotonic()
        sock, k, _, length = self.call(kind, payload, what, 0)
        try:
            if length:
                self.arm(sock, length, start)
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            raise self.fail(sock, exc, what) from None
        self.put_back(sock)
        if k is Kind.ERROR:
            raise decode_error(body)
        return k, body

    def prepare(self, kind: Kind, payload: bytes, expect: Optional[int] = None) -> tuple[socket.socket, int, bytes]:
        """A connection, a request id and the bytes to send on it: one frame and the deferred
        releases behind it (the caller sends them, then :meth:`put_back` or :meth:`fail`). With
        ``expect`` (the reply's bytes) the exchange is armed, from now."""
        with self._lock:
            sock = self._idle.pop() if self._idle else None
            self._req = rid = (self._req + 1) & 0xFFFFFFFF
        if sock is None:
            sock = self.acquire()
        frame = self.frames(pack(kind, rid, payload))
        if expect is not None:
            _arm(sock, time.monotonic() + self.timeout.transfer + (expect + len(frame)) / MIN_RATE)
        return sock, rid, frame

    def send(self, kind: Kind, payload: bytes, what: str,
             expect: Optional[int] = None) -> tuple[socket.socket, int]:
        """Send one frame (and the deferred releases behind it); the caller reads the reply."""
        sock, rid, frame = self.prepare(kind, payload, expect)
        try:
            sock.sendall(frame)
            return sock, rid
        except BaseException as exc:
            raise self.fail(sock, exc, what) from None

    def call(self, kind: Kind, payload: bytes, what: str,
             expect: Optional[int] = None) -> tuple[socket.socket, Kind, int, int]:
        """Send one control frame and read the reply header (the caller reads the body)."""
        sock, rid = self.send(kind, payload, what, expect)
        try:
            k, got_id, length = unpack_header(recv_exact(sock, HEADER.size), data_ok=kind is Kind.READ)
            if got_id != rid and k is not Kind.ERROR:
                raise ProtocolError(f"{what}: reply for request {got_id}, expected {rid}")
            return sock, k, got_id, length
        except BaseException as exc:
            raise self.fail(sock, exc, what) from None


def client_for(clients: dict[Any, SocketClient], by_url: dict[str, SocketClient], key: Any, url: str,
               make: Callable[[], SocketClient]) -> SocketClient:
    """The client of the sender at ``key`` (made by ``make`` the first time), remembered under
    ``url`` too; the transport's lock held. At most ``MAX_PEERS`` clients and four times as many
    URLs are kept: handles naming ever new addresses or spellings (unsigned ones from a hostile
    source) retire the oldest clients and empty the URL cache instead of growing them."""
    c = clients.get(key)
    if c is None:
        c = clients[key] = make()
        while len(clients) > MAX_PEERS:
            clients.pop(next(iter(clients))).retire()
            by_url.clear()
    if len(by_url) >= 4 * MAX_PEERS:
        by_url.clear()
    by_url[url] = c
    return c


class _Flusher:
    """One daemon thread per process that sends deferred releases no request has carried
    within ``RELEASE_LINGER`` (twice that when every connection was busy at the first visit):
    a released handle's blocks are freed at most that much later. While releases keep coming
    it wakes every linger by itself; only once nothing is due does it wait to be woken, so a
    release costs its caller a lock and an append, not a wake-up of this thread every linger."""

    def __init__(self, linger: float = RELEASE_LINGER) -> None:
        self.linger = linger
        self._lock = threading.Lock()
        self._due: list[SocketClient] = []
        self._wake = threading.Event()
        self._waiting = False          # the thread waits on _wake (both set under _lock)
        self._recent = False           # schedule() was called since the thread last looked
        self._thread: Optional[threading.Thread] = None

    def schedule(self, client: SocketClient) -> None:
        with self._lock:
            self._due.append(client)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvbridge-release-flush", daemon=True)
                self._thread.start()
            wake, self._waiting, self._recent = self._waiting, False, True
        if wake:
            self._wake.set()

    def _loop(self) -> None:
        while True:
            with self._lock:           # cleared under the lock that schedule() sets it after: no lost wake-up
                if not self._due and not self._recent:     # a whole linger without a release
                    self._waiting = True
                    self._wake.clear()
                self._recent = False
                waiting = self._waiting
            if waiting:
                self._wake.wait()
            time.sleep(self.linger)
            try:
                self.flush_all()
            except Exception:      # never let one bad client stop every later release
                log.exception("sending deferred releases failed")

    def flush_all(self, final: bool = False) -> None:
        """Send what is due. A client whose connections are all busy is visited again after
        the next linger (never opening a connection beside a busy one), unless ``final``."""
        with self._lock:
            due, self._due = self._due, []
        later = [c for c in dict.fromkeys(due) if not c.flush(idle_only=not final)]
        if later:
            with self._lock:
                self._due.extend(later)     # the loop finds them due (and wakes if it waits)
                wake, self._waiting = self._waiting, False
            if wake:
                self._wake.set()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._due, self._thread = [], None
        self._wake = threading.Event()
        self._waiting = self._recent = False


_FLUSHER = _Flusher()
os.register_at_fork(after_in_child=_FLUSHER._after_fork)
atexit.register(_FLUSHER.flush_all, True)
