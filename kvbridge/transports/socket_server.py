"""The frame server side of the socket plumbing (tcp:// and shm://'s control channel):
:class:`SocketServer` accepts connections, serves them on a bounded pool of worker threads and
parks idle ones in one selector thread. It answers reads, push writes, releases and pings;
subclasses answer more frame kinds. The client side is :mod:`.sockets`; frames are defined in
:mod:`.wire`. The rate floor (``MIN_RATE`` after ``RATE_GRACE``) and :func:`tune` are shared
with the client side, which imports them from here."""

from __future__ import annotations

import errno
import logging
import queue
import select
import selectors
import socket
import threading
import time
from typing import Any, Callable, Optional, cast

import torch

from .. import blockcopy
from ..errors import ConfigError, ConnectionLost, KVBridgeError, ProtocolError
from ..logs import RateLimitedLog
from ..policy import Timeout
from .base import BlockSink, BlockSource, Server
from .staging import RingPool, copy_slices, device_slices, send_staged
from .wire import (FENCE, MAX_CONTROL, TRAILER, Budget, FrameReader, Kind, PacedSender, RateGuard, decode_releases,
                   decode_request, encode_error, encode_layers, encode_trailer, pack, send_all, send_iter,
                   set_os_timeouts, vouch_of)

__all__ = ["SocketServer", "tune"]

log = logging.getLogger("kvbridge.sockets")
_limited = RateLimitedLog(log)
IDLE_TIMEOUT = 300.0
DISCARD_LIMIT = 4 << 20    # a refused write's bytes up to this are skipped (at MIN_RATE at least, after
                           # RATE_GRACE); past it the connection closes
MAX_CONNECTIONS = 4096     # per server; one more is answered with an error and closed
WORKERS = 64               # threads serving active connections, per server
PARK_AFTER = 0.25          # seconds idle before a connection leaves its worker for the selector
PARK_LOOK = 0.1            # seconds between the selector's looks for parked connections past a deadline
CONTROL_BUDGET = 64 << 20  # control-frame bytes all connections of a server may buffer at once
MAX_PING = 64              # PING payload echoed back, at most
ACCEPT_BACKOFF = 0.05     # seconds the accept loop waits after a failed accept (no fds left)
LINGER = 1.0               # seconds a connection closed on an error reply goes on discarding input
MIN_RATE = 1 << 20         # bytes/s a transfer must keep up after RATE_GRACE seconds
RATE_GRACE = 2.0
SMALL_REPLY = 64 << 10     # host reads up to this are copied out, validated and sent in one call
_MORE = getattr(socket, "MSG_MORE", 0)   # tcp: hold a reply's tail until its trailer joins it in one segment


_NO_FENCE = FENCE.pack(0, 0)    # the reply to a read that was not leased


def _readable(conn: socket.socket, timeout: float) -> bool:
    """Whether bytes (or EOF) came on ``conn`` within ``timeout`` seconds."""
    p = select.poll()
    p.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(timeout * 1000))


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
        # tcp: hold a large reply's tail for its trailer (accepted sockets share the listener's family)
        self._more = _MORE if listener.family in (socket.AF_INET, socket.AF_INET6) else 0
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
        self._parked: dict[socket.socket, tuple[float, FrameReader]] = {}   # since, reader
        self._partial: dict[socket.socket, FrameReader] = {}                 # those holding part of a frame
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
            # parked until its first bytes come: no thread and no buffer before then
            self._park(conn, FrameReader(conn, frame_timeout=self.timeout.transfer, budget=self._budget, nowait=True))

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
                item = None                         # nothing of it kept while this thread waits
        with self._lock:
            self._workers -= 1

    def _poll_loop(self) -> None:
        """Parked connections -- new ones, idle ones, and those waiting for the rest of a frame:
        back to a worker when bytes arrive; closed when idle past ``idle_timeout`` or when a
        frame begun is not whole within its deadline (``Timeout.transfer``)."""
        look = idle_look = 0.0
        while not self._closed.is_set():
            try:
                events = self._sel.select(timeout=max(0.005, look - time.monotonic()))
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
                if key.data.empty and self._closed_by_peer(conn):   # an idle peer left: no thread for that
                    self._unpark(conn)
                    self._drop(conn, reader=key.data)
                    continue
                self._unpark(conn)
                self._dispatch(conn, key.data)
            now = time.monotonic()
            if now < look:                          # deadlines are looked at every PARK_LOOK, not per event
                continue
            look = now + PARK_LOOK
            every = now >= idle_look                # idle ones once a second; frames begun every look
            if every:
                idle_look = now + 1.0
            with self._lock:
                if every:
                    stale = [(c, r) for c, (t, r) in self._parked.items()
                             if r.overdue(now) or now - t > self.idle_timeout(c)]
                else:
                    stale = [(c, r) for c, r in self._partial.items() if r.overdue(now)]
            for c, r in stale:
                self._unpark(c)
                self._drop(c, reader=r)

    @staticmethod
    def _closed_by_peer(conn: socket.socket) -> bool:
        """Whether what woke a parked connection is its peer closing it (nothing left to read)."""
        try:
            return not conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _park(self, conn: socket.socket, reader: FrameReader) -> None:
        reader.park()
        with self._lock:
            self._parked[conn] = (time.monotonic(), reader)
            if not reader.empty:
                self._partial[conn] = reader        # a frame begun: its deadline is looked at often
        try:
            self._sel.register(conn, selectors.EVENT_READ, reader)
        except (KeyError, ValueError, OSError):
            with self._lock:
                self._parked.pop(conn, None)
                self._partial.pop(conn, None)
            self._drop(conn, reader=reader)

    def _unpark(self, conn: socket.socket) -> None:
        with self._lock:
            self._parked.pop(conn, None)
            self._partial.pop(conn, None)
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
                        idle = 0.0             # received and, the usual reads, answered in one C call
                        continue
                    kind, req_id, payload = reader.read_frame(MAX_CONTROL)
                except BlockingIOError:
                    if not reader.empty:       # part of a frame, the rest not here yet
                        if self.can_park(conn):
                            self._park(conn, reader)     # waits for it without a thread
                            return
                        if not _readable(conn, self._tick) and reader.overdue(time.monotonic()):
                            break
                        continue
                    idle += self._tick
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
        self._drop(conn, linger, reader)

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

    def _drop(self, conn: socket.socket, linger: bool = False, reader: Optional[FrameReader] = None) -> None:
        if reader is not None:
            reader.release()            # the budget a frame begun held, and its buffer
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
        if kind is Kind.CRELEASES:       # no reply either: a claim that lapses unreleased ends at expiry
            # queued, and made by the source's release thread in one round trip to the store
            release_claimed = getattr(self.source, "release_claimed", None)
            try:
                claimed = [decode_request(e) for e in decode_releases(payload)]
            except ProtocolError as exc:
                log.info("claimed releases refused: %s", exc)
                return True
            if release_claimed is None:
                log.info("claimed releases refused: this server's source makes no claims")
                return True
            for refused in release_claimed([(r.ticket, r.claim) for r in claimed]):
                if refused is not None:
                    log.info("claimed release refused: %s", refused)
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
                send_iter(out, head, spans.iter_views(), None, self._more)
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
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)
        self._poller.join(timeout=2)
        with self._lock:                   # after the joins: the accept loop parks new connections
            parked = [(c, r) for c, (_, r) in self._parked.items()]
        for c, r in parked:
            self._unpark(c)
            self._drop(c, reader=r)
        while True:        # connections queued for a worker: none takes them now (they leaked)
            try:
                c, r = self._ready.get_nowait()
            except queue.Empty:
                break
            self._drop(c, reader=r)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
