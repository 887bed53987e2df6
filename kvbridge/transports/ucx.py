"""ucx:// -- UCX (through ucxx): shared memory on one host, RDMA or TCP across hosts.

A server listens on ``host:port`` with a small TCP socket that speaks kvbridge frames
(:mod:`.sockets`): a client's hello (a MAP frame carrying ``HELLO`` and its UCX worker
address) returns the server's worker address and a client id, and the connection then
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

import atexit
import ctypes
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")   # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 ignores

try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array
except ImportError as exc:   # mapped by the registry to BackendUnavailable naming the extra
    raise ImportError(f"ucx:// needs ucxx: pip install 'kvbridge[ucx]' ({exc})") from exc

import torch

from ..errors import (ConfigError, ConnectionLost, FrameTooLarge, KVBridgeError, PeerUnavailable, ProtocolError,
                      StaleHandle, TransferTimeout)
from ..handle import KVHandle
from ..lease.base import Claim
from ..policy import Timeout
from .base import Chunk, ReadGrant, Server, Spans, SpansFor, Transport
from .sockets import SocketServer, connector, tune
from .tcp import parse_tcp_url
from .staging import copy_slices, device_slices
from .wire import (F_LAYERS, HEADER, LAYERS, MAX_CONTROL, Kind, decode_error, decode_layers, decode_request,
                   encode_error, encode_layers, encode_request, map_os_error, pack, recv_exact, unpack_header)

__all__ = ["UCXTransport", "UCXServer", "parse_ucx_url"]

log = logging.getLogger("kvbridge.ucx")

HELLO = b"KVB-UCX1"
DOORBELL_ID = 0xFFFFFFFF   # a PING frame with this id on the liveness socket: "look at your UCX worker"
CHUNK = 4 << 20          # DATA message size: pieces of the canonical byte stream
INLINE = 64 << 10        # transfers up to this ride inside the reply header
WINDOW = 4               # DATA messages in flight per transfer
SPIN = 0.0002           # seconds of polling before a wait sleeps on the worker's event fd
NAP = 0.01               # longest sleep between liveness/deadline checks in a wait
HANDLER_THREADS = 16

# tags: kind (8 bits) | client id (24 bits) | request id (32 bits)
T_REQ, T_HDR, T_DATA = 1, 2, 3
KIND_MASK = 0xFF << 56
DONE_BIT = 1 << 55   # a transfer's closing message (validation / checksums), on its DATA tag

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


def _tag(kind: int, cid: int, rid: int) -> int:
    return (kind << 56) | ((cid & 0xFFFFFF) << 32) | (rid & 0xFFFFFFFF)


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


class _Worker:
    """A UCX worker with a lock: every call into it is made under the lock. Waits poll
    for :data:`SPIN` seconds, then sleep on the worker's event fd (and extra fds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        try:
            self.w = _ucx.UCXWorker(_context())
            self.w.init_blocking_progress_mode()
        except _ucx.UCXError as exc:
            raise ConfigError(f"ucx:// cannot create a UCX worker: {exc}") from None
        self.efd = self.w.epoll_file_descriptor
        self.address = self.w.address.tobytes()

    def progress(self) -> None:
        with self.lock:
            self.w.progress()

    def endpoint(self, address: bytes) -> Any:
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
                self.w.progress()
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

    def recv(self, view: Any, tag: int) -> _Held:
        with self.worker.lock:
            if self.closed:
                raise ConnectionLost("connection closed")
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


def _send_stream(worker: _Worker, ep: _Ep, tag: int, stream: _Stream, deadline_s: float, what: str,
                 alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
                 nudge: Optional[Callable[[], None]] = None) -> None:
    """Send the stream as DATA messages, WINDOW in flight."""
    inflight: list[Any] = []
    bounces: list[bytearray] = []
    for k in range(stream.pieces()):
        a, b = stream.bounds(k)
        view = stream.direct(a, b)
        if view is None:
            buf = bounces.pop() if bounces else bytearray(CHUNK)
            view = stream.gather(a, b, buf)
        else:
            buf = None
        inflight.append((ep.send(view, tag), buf))
        if len(inflight) >= WINDOW:
            r, used = inflight.pop(0)
            _wait_reqs(worker, [r], deadline_s, what, alive, fds, nudge)
            if used is not None:
                bounces.append(used)
    _wait_reqs(worker, [r for r, _ in inflight], deadline_s, what, alive, fds, nudge)


def _recv_stream(worker: _Worker, post: Callable[[memoryview, int], Any], stream: _Stream, deadline_s: float,
                 what: str, alive: Optional[Callable[[], None]] = None, fds: Sequence[int] = (),
                 nudge: Optional[Callable[[], None]] = None) -> int:
    """Receive the stream's DATA messages (``post(view, tag)`` posts one receive), WINDOW
    posted ahead; calls ``landed`` in order. On any failure every posted receive has
    completed (or the caller closes the endpoint) before the error propagates; the
    messages not received yet are drained into a scratch buffer so the peer's sends end."""
    n = stream.pieces()
    posted: list[tuple[Any, Optional[bytearray], int, int]] = []
    bounces: list[bytearray] = []
    nxt = 0

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
            _wait_reqs(worker, [req], deadline_s, what, alive, fds, nudge)
            posted.pop(0)
            if buf is not None:
                stream.scatter(a, b, buf)
                bounces.append(buf)
            stream.landed(b)
            if nxt < n:
                post_next()
    except BaseException:
        # let what is posted finish (it may land; the grant/fetch still owns the memory), then
        # drain the rest into scratch so the peer's sends complete
        try:
            if posted:
                worker.wait(lambda: all(r.completed for r, *_ in posted), min(deadline_s, 5.0), what, alive, fds)
            scratch = bytearray(CHUNK)
            while nxt < n:
                a, b = stream.bounds(nxt)
                r = post(memoryview(scratch)[:b - a], nxt)
                nxt += 1
                worker.wait(lambda: r.completed, min(deadline_s, 5.0), what, alive, fds)
        except KVBridgeError:
            pass
        raise
    return stream.nbytes


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
                        self.sink.abort_remote(payload)
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


# -- client -------------------------------------------------------------------------------------
class _Peer:
    """One server as seen by a client: liveness socket, endpoint, client id."""

    def __init__(self, url: str, sock: socket.socket, ep: _Ep, cid: int) -> None:
        self.url, self.sock, self.ep, self.cid = url, sock, ep, cid
        self.broken = False
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
        """Wake the server's UCX side (a doorbell frame on the liveness socket)."""
        try:
            with self._ring_lock:
                self.sock.sendall(_DOORBELL)
        except OSError:
            self.broken = True
            raise ConnectionLost(f"{self.url}: the sender's process closed the connection") from None


class UCXTransport(Transport):
    scheme = "ucx"

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        self._lock = threading.Lock()
        self._worker: Optional[_Worker] = None
        self._peers: dict[str, _Peer] = {}
        self._rid = 0
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
                self._worker = _Worker()
            return self._worker

    def _next(self) -> int:
        with self._lock:
            self._rid = (self._rid + 1) & 0xFFFFFFFF
            return self._rid

    def _peer(self, url: str) -> _Peer:
        with self._lock:
            if self._closed:
                raise ConnectionLost(f"{url}: this transport is closed")
            p = self._peers.get(url)
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
            sock.sendall(pack(Kind.MAP, 1, HELLO + worker.address))
            kind, _, length = unpack_header(recv_exact(sock, HEADER.size))
            body = recv_exact(sock, length) if length else b""
            if kind is Kind.ERROR:
                raise decode_error(body)
            if kind is not Kind.MAPPED or len(body) < 5:
                raise ProtocolError(f"{url}: not a ucx:// server (reply {kind.name})")
            cid = struct.unpack_from("!I", body)[0]
            try:
                ep = _Ep(worker, worker.endpoint(body[4:]))
            except _ucx.UCXError as exc:
                raise PeerUnavailable(f"cannot reach {url} over UCX: {exc}") from None
            sock.settimeout(None)
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc, f"connect to {url}") from None
        p = _Peer(url, sock, ep, cid)
        with self._lock:
            closed = self._closed
            old = self._peers.get(url)
            if not closed and old is not None and not old.broken:
                keep = old
            elif not closed:
                self._peers[url] = keep = p
                self.opened += 1
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
        try:
            p.sock.close()
        except OSError:
            pass

    # one exchange
    def _send(self, p: _Peer, tag: int, msg: bytes) -> Any:
        """Post a tagged send; the returned request holds ``msg`` (UCX reads it until the
        send completes: a rendezvous send reads it from the peer long after posting)."""
        return p.ep.send(msg, tag)

    def _recv_header(self, p: _Peer, rid: int, limit: int, what: str, tag: Optional[int] = None) -> bytes:
        return _recv_probed(self._w(), _tag(T_HDR, p.cid, rid) if tag is None else tag, limit,
                            self.timeout.transfer, what, p.alive, (p.sock.fileno(),), p.ring)

    def _exchange(self, url: str, op: int, payload: bytes, what: str,
                  body: Callable[[_Peer, int, bytes], Any], limit: int = MAX_CONTROL + INLINE) -> Any:
        """Send one request; ``body(peer, rid, reply)`` handles an OK/GO reply. Errors that
        leave the connection in an unknown state drop it."""
        if len(payload) + 1 > MAX_CONTROL:
            raise FrameTooLarge(f"{what}: request of {len(payload)} bytes exceeds {MAX_CONTROL}")
        p = self._peer(url)
        rid = self._next()
        try:
            sreq = self._send(p, _tag(T_REQ, p.cid, rid), _REQ_HEAD.pack(op) + payload)
            reply = self._recv_header(p, rid, limit, what)
            _wait_reqs(self._w(), [sreq], self.timeout.transfer, what, p.alive, (p.sock.fileno(),), p.ring)
            if reply[0] == ST_ERROR:
                raise decode_error(reply[1:])
            if reply[0] not in (ST_OK, ST_GO):
                raise ProtocolError(f"{what}: unknown reply status {reply[0]}")
            return body(p, rid, reply)
        except KVBridgeError as exc:
            if exc.retryable or isinstance(exc, ProtocolError):
                self._drop(p)
            raise

    def _take_data(self, p: _Peer, rid: int, reply: bytes, pos: int, dst: Spans, what: str) -> int:
        n = int(_N.unpack_from(reply, 1)[0])
        if n != dst.nbytes:
            raise ProtocolError(f"{what}: sender offers {n} bytes, destination holds {dst.nbytes}")
        stream = _Stream(dst)
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
        dtag = _tag(T_DATA, p.cid, rid)

        def post(view: memoryview, k: int) -> Any:
            return p.ep.recv(view, dtag)
        _recv_stream(w, post, stream, self.timeout.transfer, what, p.alive, (p.sock.fileno(),), p.ring)
        trailer = self._recv_header(p, rid, 8192, what, _tag(T_DATA, p.cid, rid) | DONE_BIT)
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
        return int(self._exchange(url, OP_READ, encode_request(handle.to_bytes(), indices, claim), what, body))

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        what = f"read layers of {url}"
        nb = len(indices) if indices is not None else handle.num_blocks

        def body(p: _Peer, rid: int, reply: bytes) -> Chunk:
            if len(reply) < 1 + _N.size + LAYERS.size:
                raise ProtocolError(f"{what}: truncated reply")
            lo, hi, sums, used = decode_layers(reply[1 + _N.size:], nb, (first, end))
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
            _send_stream(w, p.ep, _tag(T_DATA, p.cid, rid), stream, self.timeout.transfer, what, p.alive,
                         (p.sock.fileno(),), p.ring)
            done = self._send(p, _tag(T_DATA, p.cid, rid) | DONE_BIT,
                              encode_request(b"", last=last, nbytes=0, sums=sums))
            final = self._recv_header(p, rid, MAX_CONTROL, what)
            _wait_reqs(w, [done], self.timeout.transfer, what, p.alive, (p.sock.fileno(),), p.ring)
            if final[0] == ST_ERROR:
                raise decode_error(final[1:])
            if final[0] != ST_OK:
                raise ProtocolError(f"{what}: unexpected reply status {final[0]}")
            return src.nbytes
        return int(self._exchange(url, OP_WREQ, encode_request(ticket.to_bytes(), None, claim, layers,
                                                               nbytes=src.nbytes), what, body))

    def abort_write(self, url: str, ticket: KVHandle) -> None:
        self._exchange(url, OP_WABORT, ticket.to_bytes(), f"abort write to {url}", lambda p, r, b: None)

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        what = f"release {url}"
        if not wait:
            p = self._peer(url)
            try:
                req = self._send(p, _tag(T_REQ, p.cid, self._next()),
                                 _REQ_HEAD.pack(OP_RELEASE_NOREPLY) + handle.to_bytes())
                p.ring()
                _wait_reqs(self._w(), [req], self.timeout.transfer, what, p.alive)
            except KVBridgeError:
                self._drop(p)
                raise
            return
        self._exchange(url, OP_RELEASE, handle.to_bytes(), what, lambda p, r, b: None)

    def ping(self, url: str, payload: bytes = b"") -> bytes:
        return self._exchange(url, OP_PING, payload, f"ping {url}", lambda p, r, b: bytes(b[1:]))  # type: ignore[no-any-return]

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
