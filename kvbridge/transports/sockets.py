"""The socket plumbing shared by tcp:// and shm://'s control channel, client side: pooled
connections to frame servers (:class:`SocketClient`), one client per sender address
(:func:`client_for`), and the process-wide flusher that sends deferred releases no request
carried. The server side is :mod:`.socket_server` (re-exported here, with :func:`tune` and the
rate floor); frames are defined in :mod:`.wire`."""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from ..errors import (ConnectionLost, KVBridgeError, PeerUnavailable, ProtocolError, TransferCancelled,
                      TransferTimeout)
from ..handle import KVHandle
from ..policy import Timeout
from .deadline import CANCELLED, WATCHDOG
from .socket_server import DISCARD_LIMIT as DISCARD_LIMIT, MIN_RATE as MIN_RATE, RATE_GRACE as RATE_GRACE
from .socket_server import SMALL_REPLY as SMALL_REPLY, SocketServer as SocketServer, tune as tune
from .wire import (HEADER, Claim, Kind, decode_error, encode_releases, encode_request, map_os_error, pack, recv_exact,
                   set_os_timeouts, unpack_header)

__all__ = ["SocketServer", "SocketClient", "connector", "tune"]

log = logging.getLogger("kvbridge.sockets")
MAX_PEERS = 1024           # clients a transport keeps (one per sender address); the oldest beyond it retired
RELEASE_LINGER = 0.002  # seconds a deferred release waits for a request to ride on
# Deferred releases ride behind a request once this many wait, or once the oldest has waited
# RELEASE_RIDE seconds (else they go alone after the linger): the sender then ends them together
# (KVSender.release_many), its release path hot in cache, instead of one between every two
# reads -- and requests that come slower than RELEASE_BATCH per linger (large reads) still
# carry them, before the flusher would send them on a connection of its own.
RELEASE_BATCH = 16
RELEASE_RIDE = RELEASE_LINGER / 2

_arm, _disarm = WATCHDOG.arm, WATCHDOG.disarm   # bound once: every pooled exchange calls both



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
        self._rids = itertools.count(1)   # request ids (next() is atomic under the GIL)
        self.opened = 0
        self._pending: list[bytes] = []   # handles released without a reply: a RELEASES frame to send
        self._claimed: list[bytes] = []   # ... leased ones, with the claim the owner made: CRELEASES
        self._since = 0.0                 # when the oldest of them was released
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
        return next(self._rids) & 0xFFFFFFFF

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


    def release(self, handle: KVHandle, wait: bool, url: str, claim: Optional[Claim] = None) -> None:
        """RELEASE (and read the answer), or a release without a reply and without a send of its
        own: it rides, in one RELEASES frame with those waiting, behind one of this client's next
        requests (:meth:`riders`), or goes (with them) after ``RELEASE_LINGER``. With ``claim``
        (a leased handle whose owner claimed it inside the read: never waited for), a CRELEASES
        entry: the owner releases the lease in the store for that claim."""
        if not wait or claim is not None:
            raw = handle.to_bytes()
            with self._lock:
                if not (self._pending or self._claimed):
                    self._since = time.monotonic()
                if claim is None:
                    self._pending.append(raw)
                else:
                    self._claimed.append(encode_request(raw, None, claim))
                first = not self._scheduled      # one flusher visit per linger, not one per release
                self._scheduled = True
            if first:
                _FLUSHER.schedule(self)
            return
        self.control(Kind.RELEASE, handle.to_bytes(), f"release {url}")

    def frames(self, frame: bytes) -> bytes:
        """``frame`` followed by the deferred releases :meth:`riders` gives (served after it:
        they never delay it; claimed ones go to the sender's release thread as they arrive)."""
        return frame + self.riders() if self._pending or self._claimed else frame

    def riders(self, now: bool = False) -> bytes:
        """The deferred releases to send behind the next request: all of them once
        ``RELEASE_BATCH`` wait or the oldest has waited ``RELEASE_RIDE`` (or ``now``: behind a
        large read, whose own cost dwarfs theirs), else none."""
        if (not now and len(self._pending) + len(self._claimed) < RELEASE_BATCH
                and time.monotonic() - self._since < RELEASE_RIDE):
            return b""
        with self._lock:
            pending, self._pending = self._pending, []
            claimed, self._claimed = self._claimed, []
            self._waited = False   # carried; a visit already scheduled stays (it finds nothing, or the next ones)
        return _release_frames(pending, claimed)

    def take(self) -> tuple[socket.socket, int]:
        """A connection and a request id for an exchange the caller bounds itself (no
        :meth:`arm`): it ends with :meth:`give_back` or :meth:`fail`."""
        try:
            sock = self._idle.pop()      # atomic under the GIL; retire() swaps the list, never shrinks it
        except IndexError:
            sock = self.acquire()
        return sock, next(self._rids) & 0xFFFFFFFF

    def give_back(self, sock: socket.socket) -> None:
        """A connection from :meth:`take` whose exchange ended well: pooled again."""
        with self._lock:
            if len(self._idle) < 8 and not self._retired:
                self._idle.append(sock)
                return
        sock.close()

    def flush(self, idle_only: bool = False) -> bool:
        """Send the deferred releases now; False when ``idle_only``, no pooled connection is
        idle (perhaps a request in flight, which the releases will ride behind next) and the
        last visit did not wait already. A failure is logged: the sender frees at expiry."""
        with self._lock:
            if idle_only and not self._idle and (self._pending or self._claimed) and not self._waited:
                self._waited = True
                return False
            pending, self._pending = self._pending, []
            claimed, self._claimed = self._claimed, []
            self._scheduled = self._waited = False
        n = len(pending) + len(claimed)
        if not n:
            return True
        try:
            sock = self.acquire()
        except KVBridgeError as exc:
            log.info("deferred release of %d handle(s) not sent: %s", n, exc)
            return True
        frames = _release_frames(pending, claimed)
        self.arm(sock, len(frames))
        try:
            sock.sendall(frames)
        except OSError as exc:
            log.info("deferred release of %d handle(s) not sent: %s", n, self.fail(sock, exc, "release"))
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
        rid = next(self._rids) & 0xFFFFFFFF
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


def _release_frames(pending: list[bytes], claimed: list[bytes]) -> bytes:
    return ((encode_releases(pending) if pending else b"")
            + (encode_releases(claimed, Kind.CRELEASES) if claimed else b""))


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
