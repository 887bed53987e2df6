"""HTTP plumbing of the reference deployment: uvicorn serving, JSON bodies, worker calls.

Servers are Starlette apps served by uvicorn on a socket bound up front (so a busy or
invalid port is reported before anything else starts). The proxy talks to workers with
``httpcore`` (pooled connections, a timeout on every wait). HTTP carries control messages
only (prompts, handles, tokens); KV bytes move through kvbridge transports.

Between the proxy and the workers an error travels as ``{"error": {"message", "type",
"code", "action", "status"}}`` (``code`` is the :mod:`kvbridge.errors` code) and is
rebuilt on the client side as the matching error class. The front door answers in
OpenAI's error shape instead (see :mod:`kvbridge.workers.openai`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional

import httpcore
import httpx
import uvicorn
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import Action, ConfigError, ConnectionLost, KVBridgeError, PeerUnavailable, TransferTimeout, \
    error_from_code

__all__ = ["HTTPServer", "Deadlines", "bind_socket", "error_body", "BodyError", "read_json", "WorkerClient", "get_json",
           "worker_body_limit", "wait_or_disconnect", "default_max_connections", "LINGER", "Overloaded", "MAX_HEAD"]

log = logging.getLogger("kvbridge.workers")
try:  # the kernel's send queue of a socket (Linux, macOS): what a client has not taken yet
    import fcntl
    import termios
    _TIOCOUTQ: Optional[int] = termios.TIOCOUTQ
except (ImportError, AttributeError):  # Windows
    _TIOCOUTQ = None
# The largest body a worker takes (token ids, a handle, sampling) follows from its model: see
# worker_body_limit. Past this many bytes a request head (request line and headers), or a chunked
# body's trailer, is refused 431 (h11, uvicorn's other parser, stops at 16 KiB; llhttp has no cap).
MAX_HEAD = 64 << 10
WORKER_BODY_SLACK = 256 << 10     # the fields besides the token lists (sampling, request id, a handle's
#                                   fixed part, URLs and lease), with room to spare: a few KB in practice
WORKER_BODY_PER_ID = 16           # a token id in JSON: up to 11 digits and a comma, with room to spare
WORKER_BODY_PER_BLOCK = 32        # a handle's block: id, generation, checksum (at most 16 bytes) in base64


def worker_body_limit(max_model_len: int, block_size: int, vocab_size: int) -> int:
    """The largest request body a worker of this model takes: the body of a request of the whole
    context (``max_model_len`` token ids of prompt and outputs), a handle of its blocks (one per
    ``block_size`` tokens), every token of the vocabulary as a stop token, and
    :data:`WORKER_BODY_SLACK` for the rest. Bodies the proxy sends stay under it; a larger one
    cannot be a request this worker serves, and reading and parsing it (at 64 MiB, seconds of a
    stalled event loop and hundreds of MiB) would hold up every request in flight."""
    blocks = -(-max(1, max_model_len) // max(1, block_size))
    return (WORKER_BODY_SLACK + WORKER_BODY_PER_ID * (max_model_len + vocab_size)
            + WORKER_BODY_PER_BLOCK * blocks)


def bind_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening TCP socket on ``host:port``, or a ``ConfigError`` that names ``flag``."""
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag} {port} is not a TCP port (0-65535; 0 picks a free one)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise ConfigError(f"{flag} {port}: {host}:{port} is already in use; stop what listens there "
                              f"or pick another {flag}") from None
        raise ConfigError(f"cannot listen on --host {host} {flag} {port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


@dataclass(frozen=True)
class Deadlines:
    """How long a client of an :class:`HTTPServer` may take over its side of a connection.

    ``idle``: a connection that opened (or got its last answer) and has not begun a request
    since is closed (stray bytes that begin none, such as blank lines, do not count).
    ``request``: a request must arrive whole -- head and body -- within this many seconds of
    its first byte, plus 1 s per ``body_rate`` bytes of body received; else it is answered
    408 (when no answer was started) and the connection closed. ``write``: a client that takes
    no bytes of an answer for this long while more wait is dropped (its request then ends as
    a client that left). uvicorn alone bounds none of these.
    """

    idle: float = 30.0
    request: float = 10.0
    body_rate: float = float(1 << 20)
    write: float = 30.0


_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s")
_HEAD_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
             b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_FULL_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
LINGER = 1.0  # seconds a refused connection is kept so its client gets the answer (503, 431) before the close


def default_max_connections() -> int:
    """The connection cap when none is given: 1024, or half this process's open-file limit when
    that is lower (the rest is for worker connections, KV transports, logs)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return 1024
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1024
    return max(16, min(1024, soft // 2))


_HEAD, _BODY, _CHUNK = 0, 1, 2  # what _GuardedProtocol feeds its parser now (counted: _HEAD, _CHUNK)


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol held to :class:`Deadlines` (set on a subclass per server)."""

    deadlines = Deadlines()
    max_connections = 1024
    lingering = [0]  # refused connections not yet closed (one list per server: set with max_connections)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: Optional[asyncio.TimerHandle] = None
        self._stall: Optional[asyncio.TimerHandle] = None
        self._receiving = self._headers_done = self._refused = self._lingers = self._too_large = False
        self._begun = 0.0
        self._body_bytes = self._unsent = 0
        self._counted = _HEAD    # what the bytes fed now are: a head, a body, or what follows a chunk's size line
        self._head_bytes = 0     # bytes of the head (or of what follows the chunk's size line) so far
        if len(self.connections) > self.max_connections:
            self._refuse()
            return
        self._set(self.deadlines.idle, self._expired_idle)

    def _refuse(self) -> None:
        """Past ``max_connections``: answer 503 at once and close. The connection leaves the
        count; it lingers up to :data:`LINGER` seconds reading (and dropping) what the client
        sends, so the close does not reset the 503 away. Past as many lingering as the cap
        (at least 64), it is cut outright: open descriptors stay under twice the cap."""
        self._refused = True
        self.connections.discard(self)
        if self.lingering[0] >= max(64, self.max_connections):
            self.transport.abort()
            return
        log.warning("HTTP client %s refused: %d connections open, the limit", self.client, self.max_connections)
        body = json.dumps({"error": {"message": f"the server has its limit of {self.max_connections} connections "
                                                "open; try again shortly", "type": "server_error",
                                     "code": "too_many_connections", "action": "retry", "status": 503}}).encode()
        self._answer_and_linger(_FULL_503 % (len(body), body))

    def _answer_and_linger(self, answer: bytes, read: bool = True) -> None:
        """Write ``answer`` and end the connection: it lingers up to :data:`LINGER` seconds, so the
        close does not reset the answer away, reading (and dropping) what the client sends, or
        with ``read`` False reading nothing more (the close then resets what the client sent
        meanwhile, after the answer arrived); past as many lingering as the cap (at least 64) it is
        cut outright."""
        if self.lingering[0] >= max(64, self.max_connections):
            self.transport.abort()
            return
        self.lingering[0] += 1
        self._lingers = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if read:
            self.flow.resume_reading()
        else:
            self.flow.pause_reading()
        self._set(LINGER, self.transport.close)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting the bytes of each request head (and of a chunked body's
        trailer) as they go in: past :data:`MAX_HEAD` the request is answered 431. The
        parser alone takes a head of any length and rebuilds its URL or header value whole on each
        piece (quadratic: one client sending one endless header stalled the server for seconds).
        Bytes go in at most ``MAX_HEAD`` at a time, so a head that begins within a piece after a
        body is counted from at most that far into it."""
        while data and not self._refused:
            if self._counted == _BODY:
                part = data if len(data) <= MAX_HEAD else data[:MAX_HEAD]
            else:
                room = MAX_HEAD - self._head_bytes
                if room <= 0:
                    self._head_too_large()
                    return
                part = data if len(data) <= room else data[:room]
                self._head_bytes += len(part)
            super().data_received(part)
            if len(part) == len(data) or self.parser is None or self.transport.is_closing() or \
                    self.transport.get_protocol() is not self:  # done, an error answered, an upgrade
                return
            data = data[len(part):]

    def _head_too_large(self) -> None:
        """Answer 431 and close: a request head (or a chunked body's trailer) past :data:`MAX_HEAD`.
        Nothing more of the connection is read. A pipelined head behind an answer still being
        written gets its 431 once that answer is out; a trailer ends its request as a client that
        left (its handler's answer goes nowhere), with the 431 when no answer was started."""
        self._refused = self._too_large = True
        self._receiving = False
        self._clear()
        log.info("HTTP client %s sent a request head or trailer over %d bytes; closing", self.client, MAX_HEAD)
        cycle = self.cycle
        if self._counted == _HEAD and cycle is not None and not cycle.response_complete:
            self.flow.pause_reading()  # the answer before it goes out first (on_response_complete)
            return
        if self._counted == _CHUNK and cycle is not None:
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if started:
                self.transport.close()
                return
        self._answer_431()

    def _answer_431(self) -> None:
        if self.transport.is_closing():
            return
        body = json.dumps({"error": {"message": f"the request head (request line and headers) or trailer is over "
                                                f"the {MAX_HEAD}-byte limit", "type": "invalid_request_error",
                                     "code": "request_header_too_large", "action": "fix", "status": 431}}).encode()
        self._answer_and_linger(_HEAD_431 % (len(body), body), read=False)  # no work for its sender

    def _set(self, delay: float, fn: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(max(0.0, delay), fn)

    def _clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired_idle(self) -> None:
        self._timer = None
        if not self._receiving and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()

    def _expired_request(self) -> None:
        self._timer = None
        if not self._receiving:
            return
        left = self._begun + self.deadlines.request + self._body_bytes / self.deadlines.body_rate - time.monotonic()
        if left > 0:  # body bytes came since the timer was set
            self._set(left, self._expired_request)
            return
        cycle = self.cycle
        queued = cycle is not None and (any(c is cycle for c, _ in self.pipeline) if self._headers_done
                                        else not cycle.response_complete)
        if queued or self.flow.read_paused:
            # a pipelined request waits for the answer before it (a 408 now would cut into that
            # answer), or uvicorn stopped reading (a body its handler has not taken yet): the
            # client is not late; its time counts again from now
            self._begun, self._body_bytes = time.monotonic(), 0
            self._set(self.deadlines.request, self._expired_request)
            return
        log.info("HTTP client %s did not send its whole request in time; closing", self.client)
        answered = cycle is not None and (cycle.response_started if self._headers_done else not cycle.response_complete)
        if not answered and not self.transport.is_closing():
            body = json.dumps({"error": {"message": "the request did not arrive whole in time", "type":
                                         "invalid_request_error", "code": "request_timeout", "action": "fix",
                                         "status": 408}}).encode()
            self.transport.write(_TIMEOUT_408 % (len(body), body))
        if cycle is not None and self._headers_done:
            cycle.keep_alive = False
        self._receiving = False
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._receiving, self._headers_done, self._body_bytes = True, False, 0
        self._begun = time.monotonic()
        self._set(self.deadlines.request, self._expired_request)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._counted, self._head_bytes = _BODY, 0
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        # a chunk's size line has come: its data follows (on_body), or, after the last one, the
        # trailer (header fields, which the parser also rebuilds whole on each piece) up to
        # on_chunk_complete: counted like a head until then
        self._counted, self._head_bytes = _CHUNK, 0

    def on_chunk_complete(self) -> None:
        self._counted = _BODY

    def on_body(self, body: bytes) -> None:
        self._counted = _BODY
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._receiving = False
        self._counted, self._head_bytes = _HEAD, 0  # the next request's head begins
        self._clear()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._too_large:  # a pipelined head over the limit waited for the answers before it to go out
            if not self.pipeline and (self.cycle is None or self.cycle.response_complete):
                self._answer_431()      # (uvicorn has just started the next queued request otherwise)
        elif not self._receiving and not self.transport.is_closing():
            self._set(self.deadlines.idle, self._expired_idle)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._unsent = self._unsent_bytes()
            self._stall = self.loop.call_later(self.deadlines.write, self._expired_write)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _unsent_bytes(self) -> int:
        """Bytes of answers the client has not taken: the write buffer's and the kernel's send queue."""
        n = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _TIOCOUTQ is not None:
            try:
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
            except (OSError, ValueError):  # closed meanwhile
                pass
        return n

    def _expired_write(self) -> None:
        self._stall = None
        unsent = self._unsent_bytes()
        if unsent < self._unsent:  # the client took bytes: writing stays paused until the kernel's
            # send buffer has room for the write buffer's bytes (the client took ~half of it)
            self._unsent = unsent
            self._stall = self.loop.call_later(self.deadlines.write, self._expired_write)
            return
        log.info("HTTP client %s took no bytes for %.0fs; dropping it", self.client, self.deadlines.write)
        self.transport.abort()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._clear()
        if self._lingers:
            self._lingers = False
            self.lingering[0] -= 1
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)


class HTTPServer:
    """uvicorn serving ``app`` on its own thread and event loop, on an already bound socket; its
    clients are held to ``deadlines`` (slow or silent clients cannot hold connections for good),
    and at most ``max_connections`` are open at once (None: :func:`default_max_connections`):
    one past it is answered 503 (``code: "too_many_connections"``, ``Retry-After: 1``) and closed.
    A request head (or a chunked body's trailer) past :data:`MAX_HEAD` bytes is answered 431
    (``code: "request_header_too_large"``) and closed.
    uvicorn's own ``limit_concurrency`` is not used: it keeps every connection past its limit open
    (answering each request on it 503), so a flood still held a descriptor per connection."""

    def __init__(self, app: Any, sock: socket.socket, name: str = "http", graceful: float = 5.0,
                 start_timeout: float = 30.0, deadlines: Deadlines = Deadlines(),
                 max_connections: Optional[int] = None) -> None:
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        self.port = int(port)
        fmt_host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{fmt_host}:{self.port}"
        self.max_connections = default_max_connections() if max_connections is None else int(max_connections)
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, not {max_connections}")
        protocol = type("GuardedProtocol", (_GuardedProtocol,), {"deadlines": deadlines, "lingering": [0],
                                                                 "max_connections": self.max_connections})
        cfg = uvicorn.Config(self._wrap(app), log_config=None, log_level="warning", access_log=False, http=protocol,
                             lifespan="on", timeout_graceful_shutdown=max(1, round(graceful)),
                             timeout_keep_alive=max(1, round(deadlines.idle)))
        self.server = uvicorn.Server(cfg)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise ConfigError(f"HTTP server on {self.url} failed to start: {self._error}")
            if time.monotonic() > deadline:
                raise ConfigError(f"HTTP server on {self.url} did not start within {start_timeout:.0f}s")
            time.sleep(0.005)

    def _wrap(self, app: Any) -> Any:
        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            if self.loop is None:  # the lifespan startup comes first
                self.loop = asyncio.get_running_loop()
            await app(scope, receive, send)
        return asgi

    def _run(self) -> None:
        try:  # uvicorn picks uvloop and httptools when they are installed (uvicorn[standard])
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # reported by the constructor or close()
            self._error = exc
            log.exception("HTTP server on %s failed", self.url)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the server's event loop (from any thread)."""
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open requests finish (bounded), stop the loop."""
        self.server.should_exit = True
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout=5)
        try:
            self.sock.close()
        except OSError:
            pass


def error_body(exc: BaseException, status: int = 500) -> dict[str, Any]:
    """The worker-to-proxy JSON error for ``exc`` (kvbridge errors keep their code and action)."""
    if isinstance(exc, KVBridgeError):
        return {"error": {"message": str(exc), "type": type(exc).__name__, "code": exc.code,
                          "action": exc.action.value, "status": status}}
    # anything else is a bug: its text (paths, internals) stays in the log of whoever caught it
    return {"error": {"message": f"internal error ({type(exc).__name__}); the server's log has the details",
                      "type": type(exc).__name__, "code": 1, "action": Action.FIX.value, "status": status}}


class BodyError(Exception):
    """A request body that cannot be taken: ``status`` 400, 413 or 415, with a message."""

    def __init__(self, status: int, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


async def read_json(request: HTTPRequest, limit: int) -> Any:
    """The parsed JSON body, refused early: over ``limit`` bytes (413, by ``Content-Length``
    before reading, or as soon as a chunked body passes it), not JSON (415, 400)."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise BodyError(415, f"the request body must be JSON (Content-Type: application/json), not {ctype!r}",
                        "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise BodyError(400, f"bad Content-Length {declared!r}") from None
        if n > limit:
            raise BodyError(413, f"the request body of {n} bytes is over the {limit}-byte limit",
                            "request_too_large")
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"the request body is over the {limit}-byte limit", "request_too_large")
            parts.append(chunk)
    except ClientDisconnect:  # the answer goes nowhere; this only ends the request quietly
        raise BodyError(400, "the client disconnected before sending the whole body", "client_disconnected") from None
    raw = b"".join(parts)
    if not raw:
        raise BodyError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BodyError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise BodyError(400, "the request body is not valid JSON: nested too deeply", "invalid_json") from None


async def wait_or_disconnect(request: HTTPRequest, task: "asyncio.Future[Any]") -> bool:
    """Wait for ``task``; True when it is done, False (and ``task`` cancelled) when the client
    disconnected first. For handlers that answer once at the end: uvicorn does not cancel them
    when their client leaves, so without this the work goes on for nobody. The body must have
    been read (``read_json``): what ``receive`` gives after it is the disconnect."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(BaseException):  # its own error, if any, is of no use to a client that left
        await task
    return False


# -- client ----------------------------------------------------------------------------------

class Overloaded(PeerUnavailable):
    """Every connection of the caller's pool to its workers is in use and none came free in
    time: the caller is at capacity, no worker failed (the front door answers 503)."""

    hint = "retry with backoff; the proxy's worker_connections bounds the requests it serves at once"


def _raise_for(status: int, data: bytes, url: str) -> None:
    try:
        err = json.loads(data)["error"]
        exc = error_from_code(int(err.get("code", 1)), str(err.get("message", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        exc = PeerUnavailable(f"{url} answered HTTP {status}: {data[:200]!r}")
    exc.status = status  # type: ignore[attr-defined]
    raise exc


PROBE_CONNECTIONS = 16   # WorkerClient's connections for health probes, apart from its requests


class WorkerClient:
    """Calls from the proxy to workers over pooled connections (``httpcore``, the engine under
    ``httpx``, used directly: the proxy's calls are plain JSON POSTs and SSE streams, and
    ``httpx.AsyncClient``'s per-request layers -- URL and header models, cookies, auth, event
    hooks -- cost about 0.2 ms per call on the first token's path).

    ``timeout`` bounds every wait (connect, each read, each write); a worker that does not
    answer raises ``PeerUnavailable``, one that goes silent ``TransferTimeout``, a stream
    that breaks ``ConnectionLost``, an error answer its own kvbridge error. At most
    ``max_connections`` are open at once; a call that finds none free within ``pool_timeout``
    raises :class:`Overloaded` (the caller is at capacity, not the worker silent).
    """

    def __init__(self, timeout: float = 30.0, connect_timeout: float = 5.0, max_connections: int = 512,
                 pool_timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self.max_connections = max_connections
        self.pool_timeout = min(pool_timeout, timeout)
        self.pool = httpcore.AsyncConnectionPool(max_connections=max_connections, max_keepalive_connections=64,
                                                 keepalive_expiry=20.0)
        # health probes (get_json) have connections of their own: a pool full of requests is a
        # busy front door, and its probes must not wait behind it and report the workers down
        self.probes = httpcore.AsyncConnectionPool(max_connections=PROBE_CONNECTIONS,
                                                   max_keepalive_connections=PROBE_CONNECTIONS, keepalive_expiry=20.0)

    def _ext(self, timeout: Optional[float]) -> dict[str, Any]:
        t = timeout or self.timeout
        return {"timeout": {"connect": min(self.connect_timeout, t), "read": t, "write": t,
                            "pool": min(self.pool_timeout, t)}}

    def _overloaded(self) -> Overloaded:
        return Overloaded(f"the server is at capacity: its {self.max_connections} connections to the workers "
                          f"are all in use and none came free within {self.pool_timeout:g}s")

    @staticmethod
    def _headers(url: str, body: bytes, accept: bytes = b"application/json") -> list[tuple[bytes, bytes]]:
        host = url.split("/", 3)[2].encode()
        return [(b"Host", host), (b"Content-Type", b"application/json"), (b"Accept", accept),
                (b"Content-Length", str(len(body)).encode())]

    async def post_json(self, url: str, body: Any, timeout: Optional[float] = None) -> Any:
        data = json.dumps(body, separators=(",", ":")).encode()
        try:
            r = await self.pool.request(b"POST", url, headers=self._headers(url, data), content=data,
                                        extensions=self._ext(timeout))
        except httpcore.PoolTimeout:
            raise self._overloaded() from None
        except httpcore.TimeoutException:
            raise TransferTimeout(f"POST {url} got no answer within {timeout or self.timeout:.0f}s") from None
        except _HTTP_ERRORS as exc:
            raise PeerUnavailable(f"POST {url} failed: {type(exc).__name__}: {exc}") from None
        if r.status >= 300:
            _raise_for(r.status, r.content, url)
        return json.loads(r.content)

    async def get_json(self, url: str, timeout: float = 2.0) -> Any:
        """GET ``url`` (a worker's ``/health``) over the probes' own connections."""
        try:
            r = await self.probes.request(b"GET", url, headers=[(b"Host", url.split("/", 3)[2].encode())],
                                          extensions=self._ext(timeout))
        except httpcore.PoolTimeout:
            raise Overloaded(f"GET {url}: the {PROBE_CONNECTIONS} connections for health probes are all in use "
                             f"and none came free within {min(self.pool_timeout, timeout):g}s") from None
        except httpcore.TimeoutException:
            raise TransferTimeout(f"GET {url} got no answer within {timeout:.0f}s") from None
        except _HTTP_ERRORS as exc:
            raise PeerUnavailable(f"GET {url} failed: {type(exc).__name__}: {exc}") from None
        if r.status >= 300:
            _raise_for(r.status, r.content, url)
        return json.loads(r.content)

    async def stream(self, url: str, body: Any) -> AsyncGenerator[Any, None]:
        """POST ``body``; yield each SSE ``data:`` event as parsed JSON until ``[DONE]``."""
        data = json.dumps(body, separators=(",", ":")).encode()
        try:
            async with self.pool.stream(b"POST", url, headers=self._headers(url, data, b"text/event-stream"),
                                        content=data, extensions=self._ext(None)) as r:
                if r.status >= 300:
                    _raise_for(r.status, await r.aread(), url)
                buf = b""
                async for chunk in r.aiter_stream():  # the workers send bare "data: ...\n\n" events
                    buf += chunk
                    while (end := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[:end], buf[end + 2:]
                        for line in event.split(b"\n"):
                            if line.startswith(b"data:"):
                                payload = line[5:].strip()
                                if payload == b"[DONE]":
                                    return
                                yield json.loads(payload)
                raise ConnectionLost(f"stream from {url} ended before [DONE]")
        except httpcore.ConnectError as exc:
            raise PeerUnavailable(f"POST {url} failed: {type(exc).__name__}: {exc}") from None
        except httpcore.PoolTimeout:
            raise self._overloaded() from None
        except httpcore.TimeoutException:
            raise TransferTimeout(f"stream from {url} was silent for {self.timeout:.0f}s") from None
        except _HTTP_ERRORS as exc:
            raise ConnectionLost(f"stream from {url} broke: {type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.probes.aclose()


_HTTP_ERRORS = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                httpcore.ConnectionNotAvailable)


def get_json(url: str, timeout: float = 5.0) -> Any:
    """Blocking GET of a JSON document (startup checks, tools); errors as in :class:`WorkerClient`."""
    try:
        r = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.TimeoutException:
        raise TransferTimeout(f"GET {url} got no answer within {timeout:.0f}s") from None
    except httpx.HTTPError as exc:
        raise PeerUnavailable(f"GET {url} failed: {type(exc).__name__}: {exc}") from None
    if r.status_code >= 300:
        _raise_for(r.status_code, r.content, url)
    return r.json()
