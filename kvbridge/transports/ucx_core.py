"""ucx:// internals: the UCX context and workers, endpoints, bounded waits, and the
streams that move a transfer's bytes as tagged messages (see :mod:`.ucx`)."""


from __future__ import annotations

import atexit
import ctypes
import logging
import os
import select
import struct
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")   # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 ignores

try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array
except ImportError as exc:   # mapped by the registry to BackendUnavailable naming the extra
    raise ImportError(f"ucx:// needs ucxx: pip install 'kvbridge[ucx]' ({exc})") from exc

import torch

from ..errors import (ConfigError, ConnectionLost, KVBridgeError, PeerUnavailable, ProtocolError,
                      TransferTimeout)
from .sockets import MIN_RATE as MIN_RATE, RATE_GRACE as RATE_GRACE   # the transports' minimum rate
from .base import Spans
from .tcp import parse_tcp_url
from .staging import copy_slices, device_slices
from .wire import (F_LAYERS, MAX_CONTROL, Kind, pack)


log = logging.getLogger("kvbridge.ucx")

HELLO = b"KVB-UCX2"       # + address length (2 bytes) + UCX worker address + a request naming a live ticket
DOORBELL_ID = 0xFFFFFFFF   # a PING frame with this id on the liveness socket: "look at your UCX worker"
CHUNK = 4 << 20          # DATA message size: pieces of the canonical byte stream
INLINE = 64 << 10        # transfers up to this ride inside the reply header
WINDOW = 4               # DATA messages in flight per transfer
SPIN = 0.0002           # seconds of polling before a wait sleeps on the worker's event fd
NAP = 0.01               # longest sleep between liveness/deadline checks in a wait
HANDLER_THREADS = 16
ADDRESS_MAX = 8192       # the longest UCX worker address accepted from a peer
HELLO_MAX = 64 << 10     # the longest hello reply a client takes

# tags: kind (4 bits) | client key (44 bits) | request id (16 bits). UCX matches tags worker-wide
# and tells a receiver nothing about the sending endpoint, so the key is the only identity: the
# server draws it at random per connection (never one that is live) and tells it to that client
# only, over its TCP connection. A third party must guess it: one chance in 2**44 per message.
KIND_SHIFT, KEY_BITS, RID_BITS = 60, 44, 16
KEY_MASK = (1 << KEY_BITS) - 1
RID_MASK = (1 << RID_BITS) - 1
T_REQ, T_HDR, T_DATA, T_DONE = 1, 2, 3, 4   # T_DONE: a transfer's closing message (validation / checksums)
KIND_MASK = 0xF << KIND_SHIFT

# request ops (first byte of a REQ message)
OP_READ, OP_WREQ, OP_WDONE, OP_RELEASE, OP_RELEASE_NOREPLY, OP_WABORT, OP_PING = 1, 2, 3, 4, 5, 6, 7
# reply status (first byte of a HDR message)
ST_OK, ST_ERROR, ST_GO = 0, 1, 2
_N = struct.Struct("!Q")
_DOORBELL = pack(Kind.PING, DOORBELL_ID)
_REQ_HEAD = struct.Struct("!B")


def _wants_layers(msg: bytearray) -> bool:
    """Whether a READ request names a layer range (peeks at its flags; malformed -> False)."""
    if len(msg) < 6:
        return False
    (hn,) = struct.unpack_from("!I", msg, 1)
    return len(msg) > 5 + hn and bool(msg[5 + hn] & F_LAYERS)


def _tag(kind: int, key: int, rid: int) -> int:
    return (kind << KIND_SHIFT) | ((key & KEY_MASK) << RID_BITS) | (rid & RID_MASK)


def _untag(tag: int) -> tuple[int, int, int]:
    """(kind, key, request id) of a tag."""
    return tag >> KIND_SHIFT, (tag >> RID_BITS) & KEY_MASK, tag & RID_MASK


def check_address(addr: bytes, own: bytes) -> None:
    """A cheap structural filter on a peer's UCX worker address before UCX parses it: its
    first byte (UCX's address version and flags) must equal this process's own, its length
    bounded. A filter, not a proof: UCX still parses the rest (peers reach this only after
    showing a live ticket, or through a URL in a signed handle)."""
    if not 16 <= len(addr) <= ADDRESS_MAX:
        raise ProtocolError(f"UCX worker address of {len(addr)} bytes (16 to {ADDRESS_MAX} expected)")
    if addr[0] != own[0]:
        raise ProtocolError(f"UCX worker address header {addr[0]:#04x}, this UCX writes {own[0]:#04x}")


def parse_ucx_url(url: str) -> tuple[str, int]:
    return parse_tcp_url(url, "ucx")


# -- one UCX context per process, workers per server / client ---------------------------------
_ctx_lock = threading.Lock()
_ctx: Any = None
_live: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _context() -> Any:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            try:
                _ctx = _ucx.UCXContext({}, (_ucx.Feature.TAG, _ucx.Feature.WAKEUP))
            except _ucx.UCXError as exc:
                raise ConfigError(f"ucx:// cannot initialise UCX: {exc}") from None
        return _ctx


@atexit.register
def _close_all() -> None:
    """Close endpoints and workers before the interpreter tears modules down."""
    for obj in list(_live):
        try:
            obj.close()
        except Exception:   # best effort at exit
            pass


_ANY, _ANY_MASK = _ucx.UCXXTag(0), _ucx.UCXXTagMask(0)   # a probe for any message


class _Worker:
    """A UCX worker with a lock: every call into it is made under the lock. Waits poll
    for :data:`SPIN` seconds, then sleep on the worker's event fd (and extra fds).

    ``sort(worker, probe)``, when given, is handed every message that reaches the worker's
    unexpected queue, taken off it (under the lock, after every progress): it must receive or
    keep each one -- a message left there holds its bytes in UCX's memory for the worker's life."""

    def __init__(self, sort: Optional[Callable[[Any, Any], None]] = None) -> None:
        self.lock = threading.Lock()
        self.sort = sort
        try:
            self.w = _ucx.UCXWorker(_context())
            self.w.init_blocking_progress_mode()
        except _ucx.UCXError as exc:
            raise ConfigError(f"ucx:// cannot create a UCX worker: {exc}") from None
        self.efd = self.w.epoll_file_descriptor
        self.address = self.w.address.tobytes()

    def progress(self) -> None:
        with self.lock:
            self._progress_locked()

    def _progress_locked(self) -> None:
        self.w.progress()
        if self.sort is not None:
            while True:
                pr = self.w.tag_probe(_ANY, _ANY_MASK, True)
                if not pr.matched:
                    return
                self.sort(self.w, pr)

    def endpoint(self, address: bytes) -> Any:
        check_address(address, self.address)
        with self.lock:
            return self.w.create_endpoint_from_worker_address(_ucx.UCXAddress.create_from_buffer(address), False)

    def wait(self, cond: Callable[[], bool], deadline_s: float, what: str,
             alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
             nudge: Optional[Callable[[], None]] = None) -> None:
        """Progress until ``cond()``; ``alive()`` raises when the peer is gone. Raises
        TransferTimeout after ``deadline_s`` seconds. Before sleeping (at most once per NAP)
        ``nudge()`` rings the peer, in case it sleeps too."""
        t0 = time.monotonic()
        end = t0 + deadline_s
        spin_end = t0 + SPIN
        next_check = t0 + NAP
        next_nudge = t0
        while True:
            with self.lock:
                self._progress_locked()
            if cond():
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + NAP
                if alive is not None:
                    alive()
                if now >= end:
                    raise TransferTimeout(f"{what}: no progress within {deadline_s} s")
            if now < spin_end:
                continue
            if nudge is not None and now >= next_nudge:
                next_nudge = now + NAP
                nudge()
            with self.lock:
                armed = self.w.arm()
            if armed and not cond():
                p = select.poll()
                p.register(self.efd, select.POLLIN)
                for fd in fds:
                    p.register(fd, select.POLLIN)
                events = p.poll(max(0.0, min(NAP, end - now)) * 1000)
                if alive is not None and any(fd != self.efd for fd, _ in events):
                    alive()            # a doorbell (drained) or the peer's death (raises)
                spin_end = time.monotonic() + SPIN   # woken: poll again before sleeping

    def close(self) -> None:
        with self.lock:
            try:
                self.w.cancel_inflight_requests()
            except Exception:
                pass


class _Held:
    """A request with the buffer it reads from or writes into, kept alive until it completes."""

    __slots__ = ("req", "buf")

    def __init__(self, req: Any, buf: Any) -> None:
        self.req, self.buf = req, buf

    @property
    def completed(self) -> bool:
        return bool(self.req.completed)

    def check_error(self) -> None:
        self.req.check_error()


class _Ep:
    """An endpoint that is never used after it is closed: every call takes the worker's
    lock and checks, so a thread racing a close gets ConnectionLost, not a dead handle."""

    __slots__ = ("worker", "ep", "closed")

    def __init__(self, worker: _Worker, ep: Any) -> None:
        self.worker, self.ep, self.closed = worker, ep, False

    def send(self, buf: Any, tag: int) -> _Held:
        with self.worker.lock:
            if self.closed:
                raise ConnectionLost("connection closed")
            return _Held(self.ep.tag_send(Array(buf), _ucx.UCXXTag(tag)), buf)

    def recv(self, view: Any, tag: int, taken: Optional[Callable[[], Any]] = None) -> _Held:
        """Receive the next message tagged ``tag`` into ``view``: the oldest that ``taken()``
        returns (one already taken off the worker, see :class:`_Worker`), else one to come."""
        with self.worker.lock:
            if self.closed:
                raise ConnectionLost("connection closed")
            pr = taken() if taken is not None else None
            if pr is not None:
                return _Held(self.ep.tag_recv_with_handle(Array(view), pr), view)
            return _Held(self.ep.tag_recv(Array(view), _ucx.UCXXTag(tag)), view)

    def close(self) -> None:
        with self.worker.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.ep.close()
            except Exception as exc:   # closing a connection whose peer is gone
                log.debug("endpoint close: %s", exc)


def _wait_reqs(worker: _Worker, reqs: Sequence[Any], deadline_s: float, what: str,
               alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
               nudge: Optional[Callable[[], None]] = None) -> None:
    worker.wait(lambda: all(r.completed for r in reqs), deadline_s, what, alive, fds, nudge)
    for r in reqs:
        _check(r, what)


def _check(req: Any, what: str) -> None:
    try:
        req.check_error()
    except _ucx.UCXMessageTruncatedError:
        raise ProtocolError(f"{what}: message larger than expected") from None
    except _ucx.UCXCanceledError:
        raise ConnectionLost(f"{what}: cancelled (connection closed)") from None
    except _ucx.UCXError as exc:
        raise ConnectionLost(f"{what}: {type(exc).__name__}: {exc}") from None


def _recv_probed(worker: _Worker, tag: int, limit: int, deadline_s: float, what: str,
                 alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
                 nudge: Optional[Callable[[], None]] = None) -> bytes:
    """Wait for the message tagged ``tag`` and receive it whole (at most ``limit`` bytes:
    a longer one is received truncated, i.e. dropped, and refused)."""
    utag = _ucx.UCXXTag(tag)
    box: list[Any] = []

    def probe() -> bool:
        with worker.lock:
            pr = worker.w.tag_probe(utag, _ucx.UCXXTagMaskFull, True)
        if pr.matched:
            box.append(pr)
        return bool(box)
    worker.wait(probe, deadline_s, what, alive, fds, nudge)
    pr = box[0]
    ok = 0 < pr.length <= limit
    buf = bytearray(pr.length if ok else 1)
    with worker.lock:
        req = worker.w.tag_recv_with_handle(Array(buf), pr)
    worker.wait(lambda: req.completed, deadline_s, what, alive, fds, nudge)
    if not ok:
        raise ProtocolError(f"{what}: message of {pr.length} bytes (at most {limit})")
    _check(req, what)
    return bytes(buf)


# -- a client's inbox: every message taken off its worker ------------------------------------
# Messages of one request in flight taken off the worker before it asked for them (their bytes are
# held to _stash_bytes apart). A layer read learns its reply's size from its header, and an honest
# sender's DATA pieces small enough for UCX to send eagerly may all arrive before the reading
# thread has read that header: at 64, a loaded client dropped an honest read of 512 small pieces
# as a flood. 1,024 held messages cost tens of KiB of bookkeeping.
STASH_MSGS = 1024
TRAILER_MAX = 8192  # a read's trailer (T_DONE)


def _stash_bytes() -> int:
    """The bytes of those messages (their declared lengths) a request may have waiting: a
    reply header, a window of DATA pieces and a trailer (an honest server sends no more ahead)."""
    return WINDOW * CHUNK + MAX_CONTROL + INLINE + TRAILER_MAX


class Discards:
    """Receives UCX may still write into, held until they complete: messages taken off a worker
    into one byte (a longer one ends truncated, its bytes dropped) and receives given up on.
    Completed ones are forgotten as more come. Under the worker's lock."""

    def __init__(self) -> None:
        self.held: list[tuple[Any, bytearray]] = []
        self._prune_at = 64

    def hold_locked(self, req: Any, buf: bytearray) -> None:
        if len(self.held) >= self._prune_at:
            self.held = [d for d in self.held if not d[0].completed]
            self._prune_at = max(64, 2 * len(self.held))
        self.held.append((req, buf))

    def take_locked(self, w: Any, pr: Any) -> None:
        """Receive the probed message ``pr`` into one byte."""
        buf = bytearray(1)
        self.hold_locked(w.tag_recv_with_handle(Array(buf), pr), buf)


class _Want:
    """A request in flight: its messages taken off the worker before a receive asked for them.

    It may have STASH_MSGS / :func:`_stash_bytes` of them waiting, or, once the bytes of its
    reply are known (``expect``), that reply whole: DATA pieces small enough for UCX to send
    eagerly complete at the sender at once, so an honest sender's window does not bound them."""

    __slots__ = ("kinds", "count", "held", "room", "msgs")

    def __init__(self, nbytes: int = 0) -> None:
        self.kinds: dict[int, list[Any]] = {T_HDR: [], T_DATA: [], T_DONE: []}
        self.count = 0
        self.held = 0
        self.room, self.msgs = _stash_bytes(), STASH_MSGS
        self.expect(nbytes)

    def expect(self, nbytes: int) -> None:
        """The reply carries ``nbytes`` of data: all of it may arrive before its receives."""
        self.room = max(self.room, nbytes + MAX_CONTROL + INLINE + TRAILER_MAX)
        self.msgs = max(self.msgs, -(-nbytes // CHUNK) + 2)    # its pieces, a header and a trailer


class _Inbox:
    """Every message that reaches a client's worker is taken off it (the worker's ``sort``, under
    its lock): one for a request in flight on a live connection (header, DATA, trailer) is kept
    for the receive that will ask for it, at most STASH_MSGS / :func:`_stash_bytes` a request or
    its whole reply once its size is known (:class:`_Want`; more: the connection is broken, its
    requests fail); any other -- a key of no connection (a dropped or evicted one), a request not
    in flight, a kind a client never receives -- is received into one byte and forgotten (a large
    one without its bytes). Before, they stayed queued on the worker, their bytes in UCX's memory,
    for the client's life."""

    def __init__(self) -> None:
        self.peers: dict[int, Any] = {}            # key -> connection
        self.discards = Discards()

    def sort_locked(self, w: Any, pr: Any) -> None:
        kind, key, rid = _untag(int(pr.sender_tag.value))
        p = self.peers.get(key)                       # a client's connection (ucx._Peer)
        want = p.wants.get(rid) if p is not None and not p.broken else None
        box = want.kinds.get(kind) if want is not None else None
        if p is None or want is None or box is None:      # a stray: nobody will ask for it
            self.discard_locked(w, pr)
            return
        if want.count >= want.msgs or want.held + pr.length > want.room:
            log.info("%s: over %d messages / %d bytes ahead of request %d: connection dropped",
                     p.url, want.msgs, want.room, rid)
            self.discard_locked(w, pr)
            p.broken = True        # its waits raise ConnectionLost; the exchange drops it
            return
        box.append(pr)
        want.count += 1
        want.held += pr.length

    def discard_locked(self, w: Any, pr: Any) -> None:
        self.discards.take_locked(w, pr)

    def take_locked(self, p: Any, rid: int, kind: int) -> Any:
        """The oldest message of that kind kept for the request, or None."""
        want = p.wants.get(rid)
        if want is None or not want.kinds[kind]:
            return None
        pr = want.kinds[kind].pop(0)
        want.count -= 1
        want.held -= pr.length
        return pr

    def add_locked(self, p: Any) -> None:
        if p.cid in self.peers:
            raise PeerUnavailable(f"{p.url}: the server gave the key of another connection: tags would "
                                  "be ambiguous (a new connection draws another)")
        self.peers[p.cid] = p

    def remove_locked(self, w: Any, p: Any) -> None:
        key = p.cid
        if self.peers.get(key) is p:
            del self.peers[key]
        for rid in list(p.wants):
            self.forget_locked(w, p, rid)

    def forget_locked(self, w: Any, p: Any, rid: int) -> None:
        want = p.wants.pop(rid, None)
        if want is not None:
            for box in want.kinds.values():
                for pr in box:
                    self.discard_locked(w, pr)


# -- the canonical byte stream in chunks ------------------------------------------------------
class _Stream:
    """Spans cut into CHUNK-sized pieces of the canonical byte stream. A piece inside one
    contiguous run moves directly from/to pool memory; others through a bounce buffer."""

    def __init__(self, spans: Spans) -> None:
        self.spans = spans
        self.nbytes = spans.nbytes
        self.host = spans.pool.is_host
        if self.host:
            self.views = [v for v in spans.views() if len(v)]
            self.runs = [r for r in spans.runs() if r[1]]
        else:   # a device pool: staged whole through host memory (see the README)
            self.bounce = torch.empty(self.nbytes, dtype=torch.uint8)
            self.views = [memoryview(self.bounce.numpy())] if self.nbytes else []  # type: ignore[arg-type]
            self.runs = [(self.bounce.data_ptr(), self.nbytes)] if self.nbytes else []
        self.starts: list[int] = []
        self.unsettled: list[Any] = []   # receives still posted after a failure (see _recv_stream)
        pos = 0
        for _, n in self.runs:
            self.starts.append(pos)
            pos += n

    def stage_out(self) -> None:
        if not self.host and self.nbytes:
            copy_slices([self.bounce], device_slices(self.spans))

    def stage_in(self) -> None:
        if not self.host and self.nbytes:
            copy_slices(device_slices(self.spans), [self.bounce])

    def pieces(self) -> int:
        return (self.nbytes + CHUNK - 1) // CHUNK

    def bounds(self, k: int) -> tuple[int, int]:
        a = k * CHUNK
        return a, min(self.nbytes, a + CHUNK)

    def _locate(self, pos: int) -> int:
        import bisect
        return bisect.bisect_right(self.starts, pos) - 1

    def direct(self, a: int, b: int) -> Optional[memoryview]:
        i = self._locate(a)
        off = a - self.starts[i]
        if off + (b - a) <= self.runs[i][1]:
            return self.views[i][off:off + (b - a)]
        return None

    def subruns(self, a: int, b: int) -> list[tuple[int, int]]:
        out = []
        i = self._locate(a)
        pos = a
        while pos < b:
            addr, n = self.runs[i]
            off = pos - self.starts[i]
            k = min(n - off, b - pos)
            out.append((addr + off, k))
            pos += k
            i += 1
        return out

    def gather(self, a: int, b: int, buf: bytearray) -> memoryview:
        dst = _addr(buf)
        for addr, n in self.subruns(a, b):
            ctypes.memmove(dst, addr, n)
            dst += n
        return memoryview(buf)[:b - a]

    def scatter(self, a: int, b: int, buf: bytearray) -> None:
        src = _addr(buf)
        for addr, n in self.subruns(a, b):
            ctypes.memmove(addr, src, n)
            src += n

    def landed(self, upto: int) -> None:
        if self.host:
            self.spans.landed(upto)


def _addr(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _guarded(alive: Optional[Callable[[], None]], guard: Optional[Callable[[int], None]],
             moved: list[int]) -> Optional[Callable[[], None]]:
    """``alive`` plus the rate guard, fed the bytes moved so far (checked at every NAP)."""
    if guard is None:
        return alive

    def check() -> None:
        if alive is not None:
            alive()
        guard(moved[0])
    return check


def _send_stream(worker: _Worker, ep: _Ep, tag: int, stream: _Stream, deadline_s: float, what: str,
                 alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
                 nudge: Optional[Callable[[], None]] = None, guard: Optional[Callable[[int], None]] = None) -> None:
    """Send the stream as DATA messages, WINDOW in flight. ``guard(bytes_moved)`` (a
    :class:`~.wire.RateGuard`) raises when the peer takes them too slowly."""
    inflight: list[Any] = []
    bounces: list[bytearray] = []
    moved = [0]
    check = _guarded(alive, guard, moved)
    for k in range(stream.pieces()):
        a, b = stream.bounds(k)
        view = stream.direct(a, b)
        if view is None:
            buf = bounces.pop() if bounces else bytearray(CHUNK)
            view = stream.gather(a, b, buf)
        else:
            buf = None
        inflight.append((ep.send(view, tag), buf, b - a))
        if len(inflight) >= WINDOW:
            r, used, n = inflight.pop(0)
            _wait_reqs(worker, [r], deadline_s, what, check, fds, nudge)
            moved[0] += n
            if used is not None:
                bounces.append(used)
    _wait_reqs(worker, [r for r, _, _ in inflight], deadline_s, what, check, fds, nudge)


def _recv_stream(worker: _Worker, post: Callable[[memoryview, int], Any], stream: _Stream, deadline_s: float,
                 what: str, alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
                 nudge: Optional[Callable[[], None]] = None, guard: Optional[Callable[[int], None]] = None,
                 cancel: Optional[Callable[[], None]] = None) -> int:
    """Receive the stream's DATA messages (``post(view, tag)`` posts one receive), WINDOW
    posted ahead; calls ``landed`` in order. On any failure ``cancel()`` cancels what is
    posted (it closes the endpoint the receives were posted on) and the receives are waited
    for (bounded): ``stream.unsettled`` then lists those that still had not completed, whose
    memory must not be given back (nothing may land in it after the error)."""
    n = stream.pieces()
    posted: list[tuple[Any, Optional[bytearray], int, int]] = []
    bounces: list[bytearray] = []
    nxt = 0
    moved = [0]
    check = _guarded(alive, guard, moved)

    def post_next() -> None:
        nonlocal nxt
        a, b = stream.bounds(nxt)
        view = stream.direct(a, b)
        buf = None
        if view is None:
            buf = bounces.pop() if bounces else bytearray(CHUNK)
            view = memoryview(buf)[:b - a]
        posted.append((post(view, nxt), buf, a, b))
        nxt += 1

    try:
        while nxt < n and len(posted) < WINDOW:
            post_next()
        while posted:
            req, buf, a, b = posted[0]
            _wait_reqs(worker, [req], deadline_s, what, check, fds, nudge)
            posted.pop(0)
            moved[0] = b
            if buf is not None:
                stream.scatter(a, b, buf)
                bounces.append(buf)
            stream.landed(b)
            if nxt < n:
                post_next()
    except BaseException:
        if cancel is not None and posted:
            cancel()
        try:
            if posted:
                worker.wait(lambda: all(r.completed for r, *_ in posted), min(deadline_s, 5.0), what)
        except KVBridgeError:
            pass
        stream.unsettled = [(r, buf) for r, buf, *_ in posted if not r.completed]
        if stream.unsettled:
            log.error("%s: %d receive(s) still posted after the transfer failed", what, len(stream.unsettled))
        raise
    return stream.nbytes


# -- server -------------------------------------------------------------------------------------
