"""The HTTP servers of the reference deployment (front door and workers) under hostile clients:
slow or silent connections, request ids reused, a request that outlives ``--request-timeout``.

Real servers on 127.0.0.1, raw sockets for the clients; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any, AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from waiting import wait_until

from kvbridge.workers.http import LINGER, MAX_HEAD, BodyError, Deadlines, HTTPServer, bind_socket, read_json

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


def _post(path: str, body: bytes, length: int | None = None, close: bool = False) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body) if length is None else length, b"Connection: close\r\n" if close else b"")
            + body)


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


def _echo(s: socket.socket, n: int) -> bytes:
    """One keep-alive ``POST /echo`` on ``s``; the whole answer."""
    s.sendall(_post("/echo", b'{"n": %d}' % n))
    got = b""
    while not got.endswith(b'{"n":%d}' % n):
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return got


@pytest.mark.timeout(20)
def test_connections_past_the_cap_are_refused_at_once() -> None:
    """Past ``max_connections`` a connection is answered 503 (JSON, ``too_many_connections``) and
    closed at once, silent or not, so a flood cannot hold a descriptor each (before: no cap, every
    connection held until its idle deadline; uvicorn's ``limit_concurrency`` also keeps them open).
    The connections within the cap are served throughout; one that closes makes room. A refused
    connection lingers (up to 1 s) so its 503 is not reset away; past 64 lingering, one is cut."""
    app = _App()
    server = HTTPServer(app.starlette(), bind_socket("127.0.0.1", 0), name="test",
                        deadlines=Deadlines(idle=15.0, request=5.0, write=5.0), max_connections=4)
    held = [_connect(server) for _ in range(4)]
    flood: list[socket.socket] = []
    try:
        for i, s in enumerate(held):  # each one served: the server has counted all four
            assert _echo(s, i).startswith(b"HTTP/1.1 200")
        flood = [_connect(server) for _ in range(20)]
        for s in flood[:10]:
            s.sendall(_post("/echo", b'{"n": 99}'))
        t0 = time.monotonic()
        results = [_closed_within(s, 4.0) for s in flood]
        assert all(closed for closed, _ in results), sum(closed for closed, _ in results)
        assert time.monotonic() - t0 < 3.0  # refused at once, not at the 15 s idle deadline
        for closed, got in results:
            assert got.startswith(b"HTTP/1.1 503"), got[:200]
            err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "too_many_connections" and err["status"] == 503, err
        assert app.bodies == 4  # no refused request reached the app
        for s in flood:
            s.close()
        time.sleep(LINGER + 0.2)  # every refused one is gone by now
        flood = burst = [_connect(server) for _ in range(100)]  # more than linger (64): the rest are cut
        results = [_closed_within(s, 4.0) for s in burst]
        assert all(closed for closed, _ in results)
        assert 64 <= sum(got.startswith(b"HTTP/1.1 503") for _, got in results) < 100
        assert _echo(held[1], 7).startswith(b"HTTP/1.1 200")  # those within the cap go on
        held.pop(0).close()

        def one_more() -> bool:  # the closed one's place is free once the server saw it go
            with _connect(server) as s:
                try:
                    return _echo(s, 8).startswith(b"HTTP/1.1 200")
                except (AssertionError, OSError):
                    return False
        assert wait_until(one_more, 5.0)
    finally:
        for s in held + flood:
            s.close()
        server.close(timeout=5)


class _QueuedForever:
    """A worker whose every request stays queued: it sends an SSE keep-alive comment every
    0.2 s, never an event (what a worker does while a request waits for its slot)."""

    def __init__(self) -> None:
        self.streams_open = 0
        self.streams_ended = 0
        self.health_calls = 0

    async def health(self, request: HTTPRequest) -> Response:
        self.health_calls += 1
        return JSONResponse({"status": "ok", "role": "prefill", "max_model_len": 4096})

    async def queued(self, request: HTTPRequest) -> Response:
        await request.body()

        async def comments() -> AsyncIterator[bytes]:
            self.streams_open += 1
            try:
                while True:
                    yield b": queued\n\n"
                    await asyncio.sleep(0.2)
            finally:
                self.streams_ended += 1
        return StreamingResponse(comments(), media_type="text/event-stream")

    def starlette(self) -> Starlette:
        return Starlette(routes=[Route("/health", self.health, methods=["GET"]),
                                 Route("/prefill", self.queued, methods=["POST"]),
                                 Route("/generate", self.queued, methods=["POST"])])


@pytest.mark.timeout(30)
def test_request_timeout_holds_while_a_worker_keeps_the_request_queued() -> None:
    """``--request-timeout`` ends a request (504, or a last error event) also while its worker
    says it is queued, and the worker's stream is closed (so the worker aborts the request).
    Before, only tokens moved the deadline check: the request waited for as long as the worker."""
    from kvbridge.workers.proxy import Proxy, ProxyConfig

    fake = _QueuedForever()
    worker = HTTPServer(fake.starlette(), bind_socket("127.0.0.1", 0), name="fake-worker")
    proxy = Proxy(ProxyConfig(prefill=[worker.url], decode=[worker.url], model_name="m", worker_timeout=1.0,
                              request_timeout=1.5))
    proxy.serve("127.0.0.1", 0)
    try:
        for stream in (False, True):
            s = socket.create_connection((proxy.http.host, proxy.http.port), timeout=10)  # type: ignore[union-attr]
            body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": stream}).encode()
            t0 = time.monotonic()
            s.sendall(_post("/v1/completions", body, close=True))
            closed, got = _closed_within(s, 6.0)
            s.close()
            assert closed and time.monotonic() - t0 < 4.0, (stream, got[:300])
            if stream:
                assert b'"code": "transfer_timeout"' in got, got[-400:]
            else:
                assert got.startswith(b"HTTP/1.1 504"), got[:300]
        assert wait_until(lambda: fake.streams_ended == fake.streams_open == 2, 5.0), vars(fake)
        assert proxy.in_flight == 0
    finally:
        proxy.close()
        worker.close(timeout=5)


@pytest.mark.timeout(30)
def test_a_full_worker_pool_is_reported_as_overload() -> None:
    """With every connection of the proxy's pool to its workers in use, one more request waited
    ``worker_timeout`` per attempt (a prefill is tried twice: 8.4 s at 4 s) and got 504 blaming a
    silent worker, which was also marked down. Now it waits ``worker_pool_timeout`` and gets 503
    ``overloaded``; no worker is blamed, and a connection that comes free is used again."""
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    with _one_connection_proxy() as (fake, http, proxy, first):
        t0 = time.monotonic()
        st, err = _post_json(http.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert st == 503 and time.monotonic() - t0 < 3.0, (st, err)
        e = err["error"]
        assert e["code"] == "overloaded" and "at capacity" in e["message"], e  # type: ignore[index]
        assert not proxy._down_until and fake.streams_open == 1  # no worker blamed, none asked
        first.close()  # its stream ends: the connection comes free for the next request
        assert wait_until(lambda: fake.streams_ended == 1, 5.0)
        with socket.create_connection((http.host, http.port), timeout=10) as again:
            again.sendall(_post("/v1/completions", body, close=True))
            assert wait_until(lambda: fake.streams_open == 2, 5.0)


@contextlib.contextmanager
def _one_connection_proxy() -> Iterator[tuple[_QueuedForever, HTTPServer, Any, socket.socket]]:
    """A front door with one connection to a worker that keeps every request queued, and that
    connection held by a streaming request: its pool is full."""
    from kvbridge.workers.proxy import Proxy, ProxyConfig

    fake = _QueuedForever()
    worker = HTTPServer(fake.starlette(), bind_socket("127.0.0.1", 0), name="fake-worker")
    proxy = Proxy(ProxyConfig(prefill=[worker.url], decode=[worker.url], model_name="m", worker_timeout=5.0,
                              request_timeout=20.0, max_model_len=4096, worker_connections=1,
                              worker_pool_timeout=0.5))
    http = proxy.serve("127.0.0.1", 0)
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    first = socket.create_connection((http.host, http.port), timeout=10)
    try:
        first.sendall(_post("/v1/completions", body, close=True))  # holds the pool's one connection
        assert wait_until(lambda: fake.streams_open == 1, 5.0)
        yield fake, http, proxy, first
    finally:
        first.close()
        proxy.close()
        worker.close(timeout=5)


def _post_json(url: str, path: str, body: dict[str, object], timeout: float = 20.0) -> tuple[int, dict[str, object]]:
    host, port = url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(_post(path, json.dumps(body).encode(), close=True))
        closed, got = _closed_within(s, timeout)
    assert closed, got[:200]
    head, _, rest = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


@pytest.mark.timeout(30)
def test_a_request_id_in_use_on_a_worker_is_refused(tiny: object) -> None:
    """Two requests under one id on a worker: the second took over the first's watch (the first
    then waited out the whole request timeout, 20 s measured, and got 503) and was answered with
    tokens the first made. Now the second is refused (400) and the first goes on untouched."""
    from kvbridge.workers.colocated import ColocatedWorker
    from kvbridge.workers.server import WorkerConfig

    cw = ColocatedWorker(WorkerConfig(model="tiny", num_blocks=128, chunk_size=64, step_delay=0.005,
                                      request_timeout=20.0), model=tiny)  # type: ignore[arg-type]
    url = cw.serve().url
    first: dict[str, object] = {}
    body = {"prompt_ids": [65] * 20, "sampling": {"max_tokens": 150, "ignore_eos": True}, "request_id": "same",
            "stream": False}
    t = threading.Thread(target=lambda: first.update(zip(("status", "body"), _post_json(url, "/generate", body))))
    try:
        t.start()
        assert wait_until(lambda: cw.loop.load["running"] == 1, 10.0)
        st, err = _post_json(url, "/generate", {**body, "sampling": {"max_tokens": 5}})
        assert st == 400 and "already in use" in str(err["error"]), err  # type: ignore[index]
        t.join(15.0)
        assert first.get("status") == 200, first
        assert len(first["body"]["token_ids"]) == 150  # type: ignore[index]
        assert wait_until(lambda: cw.pool.num_free == cw.pool.num_blocks and cw.loop.load["watched"] == 0, 5.0)
        st, ok = _post_json(url, "/generate", {**body, "sampling": {"max_tokens": 3}})  # free again once it ended
        assert st == 200 and len(ok["token_ids"]) == 3, ok  # type: ignore[arg-type]
    finally:
        t.join(5.0)
        cw.close()


@pytest.mark.timeout(30)
def test_metrics_json_asked_in_a_loop_is_built_once_at_a_time() -> None:
    """Six clients asking ``/metrics.json?records=10000`` in a loop over 20,000 records: each call
    built the summary and records again (~0.5 s holding the GIL), and an event-loop route's
    latency went from 1.3 ms to 181 ms (p50). A build now serves every call for four times as
    long as it took, one build at a time; the answers stay whole and parse."""
    import urllib.request

    from kvbridge.workers.metrics import RequestMetrics
    from kvbridge.workers.proxy import Proxy, ProxyConfig

    proxy = Proxy(ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"], model_name="m",
                              max_model_len=4096))
    for i in range(20_000):
        proxy.metrics.add(RequestMetrics(f"r{i}", prompt_tokens=i % 3000, output_tokens=i % 600, arrival=i,
                                         first_token_at=i + 0.1, last_token_at=i + 1, finished_at=i + 1.1))
    builds = []
    summary = proxy.summary

    def counted() -> dict[str, object]:
        builds.append(1)
        return summary()
    proxy.summary = counted  # type: ignore[method-assign]  # a spy: the real summary, counted
    url = proxy.serve("127.0.0.1", 0).url + "/metrics.json?records=10000"
    served: list[int] = []

    def ask() -> None:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            with urllib.request.urlopen(url, timeout=20) as r:
                doc = json.loads(r.read())
            assert doc["requests"] == 20_000 and len(doc["records"]) == 10_000
            served.append(1)
    try:
        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20.0)
    finally:
        proxy.close()
    assert len(served) >= 6 and len(builds) <= len(served) / 2, (len(served), len(builds))


@pytest.mark.timeout(20)
def test_an_unknown_model_name_is_quoted_cut_short() -> None:
    """A 404 for an unknown model quoted the name whole (100,000 characters in, 100,000 out, on
    ``POST /v1/completions`` and ``GET /v1/models/{name}``); now at most 100 and its length."""
    from kvbridge.workers.proxy import Proxy, ProxyConfig

    proxy = Proxy(ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"], model_name="m",
                              max_model_len=4096))
    http = proxy.serve("127.0.0.1", 0)
    try:
        st, err = _post_json(http.url, "/v1/completions", {"model": "x" * 100_000, "prompt": "hi"})
        with socket.create_connection((http.host, http.port), timeout=10) as s:
            s.sendall(b"GET /v1/models/%s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (b"y" * 6000))
            closed, got = _closed_within(s, 10.0)
        head, _, rest = got.partition(b"\r\n\r\n")
        for status, e in ((st, err["error"]), (int(head.split()[1]), json.loads(rest)["error"])):
            assert status == 404 and e["code"] == "model_not_found", e  # type: ignore[index]
            assert len(e["message"]) < 300 and "characters)" in e["message"], e  # type: ignore[index]
    finally:
        proxy.close()


@pytest.mark.timeout(20)
def test_a_client_that_reads_a_stream_slowly_is_not_dropped(served: tuple[_App, HTTPServer]) -> None:
    """``Deadlines.write`` drops a client that takes *no* bytes for that long. It dropped one that
    reads steadily but slowly as well: the stall ended only when writing resumed, i.e. once the
    kernel's send queue (about 3 MB on loopback) had drained enough to take the write buffer, so a
    client reading 8 KiB every 0.3 s was cut after ``write`` seconds. Now any bytes the client
    took in that time (write buffer plus the socket's send queue, TIOCOUTQ) let it go on."""
    app, server = served
    with _connect(server, rcvbuf=4096) as s:
        s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        end = time.monotonic() + 4 * SHORT.write
        got = 0
        while time.monotonic() < end:
            chunk = s.recv(8192)
            assert chunk, f"dropped after {got} bytes while reading"
            got += len(chunk)
            time.sleep(0.3)
        assert not app.stream_ended.is_set()
    assert app.stream_ended.wait(8.0)


def _answers(s: socket.socket, seconds: float) -> list[bytes]:
    """Status lines and bodies of the answers on ``s`` until it closes (bounded)."""
    closed, got = _closed_within(s, seconds)
    assert closed, got[:300]
    out = []
    while got:
        head, _, rest = got.partition(b"\r\n\r\n")
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        out.append(head.split(b"\r\n")[0] + b" " + rest[:n])
        got = rest[n:]
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stall", ["body", "head"])
def test_a_pipelined_request_waits_for_the_answer_before_it(stall: str) -> None:
    """A request pipelined behind one whose answer takes longer than ``Deadlines.request``: its
    deadline ran from its first byte although uvicorn does not start it before that answer, so it
    was answered 408 -- written ahead of the first request's answer, which the client took as its
    answer (the first request had arrived whole). Now a queued request's time counts once the answer
    before it is out; one that still does not arrive in time is then answered 408, after it."""
    async def slow(request: HTTPRequest) -> Response:
        body = await read_json(request, 1 << 20)
        await asyncio.sleep(2.5)
        return JSONResponse(body)
    server = HTTPServer(Starlette(routes=[Route("/slow", slow, methods=["POST"])]), bind_socket("127.0.0.1", 0),
                        name="test", deadlines=SHORT)
    second = _post("/slow", b'{"n":2}')
    cut = second.index(b"\r\n\r\n") + 4 if stall == "body" else 20
    try:
        with _connect(server) as s:            # the second's rest comes 1.5 s later (request: 1 s)
            s.sendall(_post("/slow", b'{"n":1}') + second[:cut])
            time.sleep(1.5)
            s.sendall(second[cut:])
            assert _answers(s, 10.0) == [b'HTTP/1.1 200 OK {"n":1}', b'HTTP/1.1 200 OK {"n":2}']
        with _connect(server) as s:            # the second never completes: 408 after the first's answer
            s.sendall(_post("/slow", b'{"n":1}') + second[:cut])
            got = _answers(s, 10.0)
            assert len(got) == 2 and got[0] == b'HTTP/1.1 200 OK {"n":1}', got
            assert got[1].startswith(b"HTTP/1.1 408") and b"request_timeout" in got[1], got
    finally:
        server.close(timeout=5)


def _too_large(got: bytes) -> bool:
    """``got`` is a JSON 431 ``request_header_too_large`` (and nothing after it)."""
    head, _, body = got.partition(b"\r\n\r\n")
    return head.startswith(b"HTTP/1.1 431") and json.loads(body)["error"]["code"] == "request_header_too_large"


@pytest.mark.timeout(30)
def test_a_request_head_past_64_kib_is_answered_431() -> None:
    """A request head is held to ``MAX_HEAD`` (64 KiB) bytes, counted as they arrive: one byte past
    it is answered 431 (JSON, ``request_header_too_large``) and closed at once, though the client
    sent nothing more (before: the head was taken whole, whatever its length, until the 10 s
    request deadline). A head of exactly the limit is served, on a keep-alive connection again and
    pipelined (each head counts on its own); a pipelined head past it (twice the limit at most: one
    that begins in the piece of input where the request before it ends is counted from the next)
    is answered after the answer before it; a chunked body's trailer is held to the limit too (the
    same way: its handler hears that the client left)."""
    async def slow(request: HTTPRequest) -> Response:
        body = await read_json(request, 1 << 20)
        await asyncio.sleep(1.0)
        return JSONResponse(body)
    app = _App()
    server = HTTPServer(Starlette(routes=app.starlette().routes + [Route("/slow", slow, methods=["POST"])]),
                        bind_socket("127.0.0.1", 0), name="test")  # the default deadlines: 10 s a request

    def at_limit(n: int, path: str = "/echo", close: bool = False) -> bytes:
        """A request whose head is ``MAX_HEAD`` bytes, one header line making up the rest."""
        req = _post(path, b'{"n":%d}' % n, close=close)
        head, body = req.split(b"\r\n\r\n", 1)
        return head + b"\r\nX-Big: " + b"a" * (MAX_HEAD - len(head) - 13) + b"\r\n\r\n" + body
    try:
        assert len(at_limit(1).split(b"\r\n\r\n")[0]) + 4 == MAX_HEAD
        with _connect(server) as s:
            for n in (1, 2):                   # keep-alive: one after the other, then pipelined
                s.sendall(at_limit(n))
                got = b""
                while not got.endswith(b'{"n":%d}' % n):
                    chunk = s.recv(65536)
                    assert chunk, got
                    got += chunk
                assert got.startswith(b"HTTP/1.1 200"), got[:200]
            s.sendall(at_limit(3) + at_limit(4) + at_limit(5, close=True))
            assert _answers(s, 10.0) == [b'HTTP/1.1 200 OK {"n":%d}' % n for n in (3, 4, 5)]
        with _connect(server) as s:            # one byte past the limit, then nothing
            s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD - 40))
            closed, got = _closed_within(s, 0.5)
            assert not closed and not got      # within the limit: the head may go on
            t0 = time.monotonic()
            s.sendall(b"a" * 41)
            closed, got = _closed_within(s, 5.0)
            assert closed and _too_large(got) and time.monotonic() - t0 < 2.0, got[:300]
        with _connect(server) as s:            # pipelined behind a slow answer: 431 after it
            s.sendall(_post("/slow", b'{"n":6}') + b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (2 * MAX_HEAD))
            closed, got = _closed_within(s, 5.0)
            first, _, rest = got.partition(b'{"n":6}')
            assert closed and first.startswith(b"HTTP/1.1 200") and _too_large(rest), got[:300]
        with _connect(server) as s:            # a chunked body's trailer that goes on
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n8\r\n{\"n\": 7}\r\n0\r\nX-T: " + b"a" * (2 * MAX_HEAD))
            closed, got = _closed_within(s, 5.0)
            assert closed and _too_large(got), got[:300]
        assert app.bodies == 5
    finally:
        server.close(timeout=5)


@pytest.mark.timeout(30)
def test_endless_request_heads_do_not_stall_the_server() -> None:
    """Clients sending one header line that never ends, at full speed: the parser took every byte,
    rebuilding the header whole on each piece (quadratic work), until the 10 s request deadline;
    one such client took a front door's ``/metrics`` from 3 ms to 3.3 s, eight a completion to
    10.9 s and its memory from 268 to 437 MiB. Now each is answered 431 and closed within 64 KiB,
    and the server reads nothing more of it; a legitimate client alongside is served at once."""
    app = _App()
    server = HTTPServer(app.starlette(), bind_socket("127.0.0.1", 0), name="test")  # 10 s a request
    stop = threading.Event()
    floods: list[tuple[bool, bytes, float]] = []

    def flood() -> None:
        while not stop.is_set():
            s = _connect(server)
            s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\nX-Big: ")

            def send() -> None:  # 64 MiB, or until the server closes or its buffers stay full
                with contextlib.suppress(OSError):
                    for _ in range(1024):
                        s.sendall(b"a" * (64 << 10))
            sender = threading.Thread(target=send)
            sender.start()
            t0 = time.monotonic()
            closed, got = _closed_within(s, 4.0)  # also bounds the sender's waits: the socket's timeout
            floods.append((closed, got, time.monotonic() - t0))
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            sender.join(10.0)
            s.close()
    flooders = [threading.Thread(target=flood) for _ in range(4)]
    waits = []
    try:
        for t in flooders:
            t.start()
        with _connect(server) as ok:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert _echo(ok, len(waits)).startswith(b"HTTP/1.1 200")
                waits.append(time.monotonic() - t0)
                time.sleep(0.05)
    finally:
        stop.set()
        for t in flooders:
            t.join(15.0)
        server.close(timeout=5)
    bad = [(closed, got[:300], round(took, 2)) for closed, got, took in floods
           if not (closed and _too_large(got) and took < 2.0)]
    assert len(floods) >= 4 and not bad, (len(floods), bad[:5])
    assert max(waits) < 1.0, sorted(waits)[-5:]


def _get(url: str, path: str, timeout: float = 10.0) -> tuple[int, dict[str, object]]:
    host, port = url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
        closed, got = _closed_within(s, timeout)
    assert closed, got[:200]
    head, _, rest = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


@pytest.mark.timeout(30)
def test_health_of_workers_whose_connections_are_all_in_use_is_ok() -> None:
    """``/health`` asked each worker over the pool its requests use: with that pool full (a busy
    front door, nothing wrong with the workers) every worker was shown ``ok: false`` ("at
    capacity") and ``/health`` answered 503 ``degraded``. Health probes now have connections
    of their own; many ``/health`` callers at once share one round of probes."""
    with _one_connection_proxy() as (fake, http, _, _):
        st, health = _get(http.url, "/health")
        assert st == 200 and health["status"] == "ok", health
        assert all(w["ok"] for w in health["workers"]), health  # type: ignore[attr-defined]
        probes = fake.health_calls
        results: list[tuple[int, dict[str, object]]] = []
        callers = [threading.Thread(target=lambda: results.append(_get(http.url, "/health"))) for _ in range(20)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(10)
        assert len(results) == 20 and all(st == 200 for st, _ in results), results[:2]
        assert fake.health_calls - probes <= 2 * 2, fake.health_calls - probes  # not 20 callers x 2 workers


@pytest.mark.timeout(40)
def test_the_proxy_command_takes_its_worker_pool_options() -> None:
    """``kvbridge proxy --worker-connections N --worker-pool-timeout S`` (and ``up``) set the front
    door's pool to the workers; they were ProxyConfig fields only, so a deployment could not
    size the pool to its workers. One connection, 0.5 s: the second request is 503 within it."""
    import subprocess
    import sys

    fake = _QueuedForever()
    worker = HTTPServer(fake.starlette(), bind_socket("127.0.0.1", 0), name="fake-worker")
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "proxy", "--port", "0", "--model", "m",
                             "--prefill", worker.url, "--decode", worker.url, "--worker-connections", "1",
                             "--worker-pool-timeout", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = None
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", proc.stderr.read() if proc.poll() is not None else ready  # type: ignore[union-attr]
        host, port = ready["url"].split("//")[1].rsplit(":", 1)
        first = socket.create_connection((host, int(port)), timeout=10)
        body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
        first.sendall(_post("/v1/completions", body, close=True))  # holds the pool's one connection
        assert wait_until(lambda: fake.streams_open == 1, 10.0)
        t0 = time.monotonic()
        st, err = _post_json(ready["url"], "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert st == 503 and err["error"]["code"] == "overloaded", err  # type: ignore[index]
        assert time.monotonic() - t0 < 3.0
    finally:
        if first is not None:
            first.close()
        proc.terminate()
        proc.communicate(timeout=15)
        worker.close(timeout=5)


def _handle(num_blocks: int, top: int = 0) -> Any:
    """A signed handle of ``num_blocks`` blocks whose ids and generations are ``top`` and below (0:
    the widest the format takes), with the text fields a deployment's handles carry."""
    from kvbridge.handle import KVHandle

    top = top or (1 << 32) - 1
    return KVHandle(handle_id=b"\x01" * 16, request_id="cmpl-0123456789abcdef01234567-p1-1", layout_hash="0" * 16,
                    urls=("tcp://prefill-worker-0.example.internal:45678",),
                    block_ids=tuple(range(top - num_blocks, top)),
                    generations=(top,) * num_blocks, checksums=((1 << 64) - 1,) * num_blocks, num_tokens=num_blocks,
                    lease_id="f" * 32, lease_url="redis://lease-server.example.internal:6379/0",
                    expires_at_ms=(1 << 63) - 1).signed(b"k" * 32)


def test_the_worker_body_limit_holds_the_largest_body_the_proxy_sends() -> None:
    """``worker_body_limit`` against the largest body the front door passes on, for models of
    several shapes: a decode request of the whole context (prompt and outputs, every id of the
    most digits), a handle of its blocks at the widest (ids, generations, checksums, lease and
    URLs), every token of the vocabulary a stop token."""
    from kvbridge.workers.http import worker_body_limit
    from kvbridge.workers.sampling import SamplingParams

    for max_len, block_size, vocab in ((256, 4, 258), (8192, 16, 258), (32768, 1, 256_000), (131072, 16, 152_064)):
        top = vocab - 1
        body = {"handle": _handle(-(-max_len // block_size)).to_dict(), "prompt_ids": [top] * (max_len - 2),
                "output_ids": [top] * 2, "sampling": SamplingParams(
                    max_tokens=3, temperature=0.7, top_k=50, top_p=0.95, seed=(1 << 63) - 1, ignore_eos=True,
                    stop_token_ids=tuple(range(vocab))).to_dict(),
                "request_id": "chatcmpl-0123456789abcdef01234567-d9", "stream": True}
        size = len(json.dumps(body, separators=(",", ":")))
        limit = worker_body_limit(max_len, block_size, vocab)
        assert size <= limit < 4 * size + (512 << 10), (max_len, block_size, vocab, size, limit)


@pytest.mark.timeout(60)
def test_a_worker_takes_the_bodies_of_its_context_and_no_more(tiny: Any) -> None:
    """Worker ports took JSON bodies of up to 64 MiB whatever the model's context: a 60 MiB
    ``/prefill`` (31M token ids) held a worker's ``/health`` up 3.1 s and grew it 342 -> 760 MiB,
    then was refused for its length -- after every id had been checked. A worker's limit now
    follows from its context, block size and vocabulary: a larger body is refused 413 by its
    ``Content-Length`` before it is read, and a prompt past the context is refused for its length
    before its ids are looked at (prefill and decode). The largest request the front door takes
    still goes through both workers: a prompt and output of the whole context, every other token
    of the vocabulary a stop token, each named 400 times (the proxy passes each on once; one
    outside the vocabulary is refused at the front door)."""
    from kvbridge.workers.decode import DecodeWorker
    from kvbridge.workers.prefill import PrefillWorker
    from kvbridge.workers.proxy import Proxy, ProxyConfig
    from kvbridge.workers.server import WorkerConfig

    cfg = WorkerConfig(model="tiny", num_blocks=256, block_size=16, chunk_size=512)
    pw, dw = PrefillWorker(cfg, "tcp", model=tiny), DecodeWorker(cfg, model=tiny)
    seen: dict[str, int] = {}
    for name, w in (("prefill", pw), ("decode", dw)):
        async def spy(request: HTTPRequest, read: Any = w.body, name: str = name) -> dict[str, Any]:
            seen[name] = max(seen.get(name, 0), int(request.headers["content-length"]))
            return await read(request)  # type: ignore[no-any-return]
        w.body = spy  # type: ignore[method-assign]
    pu, du = pw.serve().url, dw.serve().url
    proxy = Proxy(ProxyConfig(prefill=[pu], decode=[du], model_name="tiny", worker_timeout=20.0))
    http = proxy.serve("127.0.0.1", 0)
    try:
        max_len, limit, vocab = pw.max_model_len, pw.max_body_bytes, int(tiny.config.vocab_size)
        # past the limit (a 1 MiB body: no request of a 4,096-token context needs one): 413 from
        # the Content-Length alone, the body never sent
        for url, path in ((pu, "/prefill"), (du, "/generate")):
            for size in (1 << 20, limit + 1):
                host, port = url.split("//")[1].rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall(_post(path, b"", length=size))
                    closed, got = _closed_within(s, 2.0)
                head, _, rest = got.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 413"), (path, size, got[:300])
                assert f"{limit}-byte limit" in json.loads(rest)["error"]["message"], got
        assert max_len == 4096 and limit == dw.max_body_bytes < 512 << 10
        # a body of the whole limit is read; a prompt past the context (its last id not in the
        # vocabulary) is refused for its length, before a look at its ids
        too_long = [65] * max_len + [vocab]
        handle = _handle(1, top=7).to_dict()
        for url, path, body in ((pu, "/prefill", {"prompt_ids": too_long}),
                                (du, "/generate", {"handle": handle, "prompt_ids": too_long, "output_ids": [65],
                                                   "sampling": {"max_tokens": 2}, "stream": False})):
            raw = json.dumps(body).encode()
            raw += b" " * (limit - len(raw))
            host, port = url.split("//")[1].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(_post(path, raw, close=True))
                closed, got = _closed_within(s, 10.0)
            head, _, rest = got.partition(b"\r\n\r\n")
            msg = json.loads(rest)["error"]["message"]
            assert head.startswith(b"HTTP/1.1 400") and "tokens of context" in msg, (path, got[:400])
        # the largest request: the whole context, every token a stop token but the two it makes
        seen.clear()
        prompt = [200 + i % 56 for i in range(max_len - 2)]
        st, plain = _post_json(http.url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert st == 200, plain
        made = plain["choices"][0]["token_ids"]  # type: ignore[index]
        stops = [t for t in range(vocab) if t not in made] * 400
        st, out = _post_json(http.url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                                          "stop_token_ids": stops})
        assert st == 200 and out["choices"][0]["token_ids"] == made, out  # type: ignore[index]
        assert len(json.dumps(stops)) > limit and set(seen) == {"prefill", "decode"}, seen
        assert max(seen.values()) < limit, (seen, limit)
        st, err = _post_json(http.url, "/v1/completions", {"prompt": "hi", "stop_token_ids": [1, vocab]})
        assert st == 400 and err["error"]["code"] == "invalid_token_id", err  # type: ignore[index]
    finally:
        proxy.close()
        pw.close()
        dw.close()


def test_a_pipelined_head_past_the_limit_is_answered_after_every_request_before_it() -> None:
    """Three pipelined requests arriving in one read -- slow, fast, then a head over MAX_HEAD: the
    431 went out as soon as the first answer was done, while the second's handler ran, whose own
    answer then failed (write after EOF); the client took the 431 for the second's answer."""
    import re as _re

    from kvbridge.workers.http import MAX_HEAD
    served: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/block":          # holds the loop: the next connection's bytes pile up
            time.sleep(0.5)
        if scope["path"] == "/slow":
            await asyncio.sleep(0.3)
        served.append(scope["path"])
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    lsock = bind_socket("127.0.0.1", 0)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    srv = HTTPServer(app, lsock)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port))
        a = socket.create_connection(("127.0.0.1", srv.port))
        time.sleep(0.2)
        a.sendall(b"GET /block HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.1)
        s.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\nGET /fast HTTP/1.1\r\nhost: x\r\n\r\n"
                  b"GET /big HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (3 * MAX_HEAD) + b"\r\n\r\n")
        s.settimeout(5)
        got = b""
        while True:
            try:
                k = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not k:
                break
            got += k
        statuses = [x.split()[1] for x in _re.findall(rb"HTTP/1.1 \d+", got)]
        assert statuses == [b"200", b"200", b"431"], (statuses, served)
        assert b"/slow" in got and b"/fast" in got
        s.close()
        a.close()
    finally:
        srv.close()
