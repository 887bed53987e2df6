"""The HTTP servers of the reference deployment (front door and workers) under hostile clients:
slow or silent connections, request ids reused, a request that outlives ``--request-timeout``.

Real servers on 127.0.0.1, raw sockets for the clients; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.workers.http import BodyError, Deadlines, HTTPServer, bind_socket, read_json

SHORT = Deadlines(idle=1.0, request=1.0, write=1.0)


class _App:
    """A JSON echo route and an endless stream; records when a stream's generator ends."""

    def __init__(self) -> None:
        self.stream_ended = threading.Event()
        self.bodies = 0

    async def echo(self, request: HTTPRequest) -> Response:
        try:
            body = await read_json(request, 64 << 10)
        except BodyError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status)
        self.bodies += 1
        return JSONResponse(body)

    async def forever(self, request: HTTPRequest) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: " + b"x" * 8192 + b"\n\n"
                    await asyncio.sleep(0)
            finally:
                self.stream_ended.set()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    def starlette(self) -> Starlette:
        return Starlette(routes=[Route("/echo", self.echo, methods=["POST"]),
                                 Route("/forever", self.forever, methods=["GET"])])


@pytest.fixture
def served() -> Iterator[tuple[_App, HTTPServer]]:
    app = _App()
    server = HTTPServer(app.starlette(), bind_socket("127.0.0.1", 0), name="test", deadlines=SHORT)
    yield app, server
    server.close(timeout=5)


def _connect(server: HTTPServer, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(5)
    s.connect((server.host, server.port))
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(True, what came) when the server closed ``s`` within ``seconds``."""
    s.settimeout(0.1)
    got = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def _post(path: str, body: bytes, length: int | None = None) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), len(body) if length is None else length) + body)


@pytest.mark.timeout(20)
def test_slow_or_silent_clients_cannot_hold_connections(served: tuple[_App, HTTPServer]) -> None:
    """uvicorn alone keeps each of these connections for good (measured: all alive after 40 s)."""
    app, server = served
    silent = _connect(server)                              # opens, sends nothing
    head = _connect(server)                                # a request head that never ends
    head.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    body = _connect(server)                                # a body that stops short of its length
    body.sendall(_post("/echo", b'{"a":', length=1000))
    refused = _connect(server)                             # refused by its length, then trickled
    refused.sendall(_post("/echo", b"{", length=10 << 20))
    blank = _connect(server)                               # blank lines, which begin no request
    t0 = time.monotonic()
    for _ in range(12):
        for s in (blank, refused):
            try:
                s.sendall(b"\r\n" if s is blank else b" ")
            except OSError:
                pass
        time.sleep(0.2)
    results = {name: _closed_within(s, 3.0) for name, s in
               (("silent", silent), ("head", head), ("body", body), ("refused", refused), ("blank", blank))}
    elapsed = time.monotonic() - t0
    assert all(closed for closed, _ in results.values()), {k: v[0] for k, v in results.items()}
    assert elapsed < 6.0
    for name in ("head", "body"):  # an unfinished request hears why before the connection closes
        assert results[name][1].startswith(b"HTTP/1.1 408"), results[name][1][:200]
        assert json.loads(results[name][1].split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert results["refused"][1].startswith(b"HTTP/1.1 413")
    assert app.bodies == 0
    # a client that keeps its side moving is served, twice on one connection, and may pause between
    with _connect(server) as ok:
        for _ in range(2):
            ok.sendall(_post("/echo", b'{"n": 1}'))
            got = ok.recv(65536)
            assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"n":1}'), got
            time.sleep(0.5)
    assert app.bodies == 2


@pytest.mark.timeout(20)
def test_a_client_that_stops_reading_a_stream_is_dropped(served: tuple[_App, HTTPServer]) -> None:
    """An answer the client never takes ends (its generator closed) once no byte moved for
    ``Deadlines.write``, instead of holding the handler, its worker stream and sockets for good."""
    app, server = served
    with _connect(server, rcvbuf=4096) as s:
        s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        assert app.stream_ended.wait(8.0), "the stream still runs for a client that stopped reading"
