"""The bootstrap server: a small HTTP mailbox per bootstrap room, where the decode side leaves its
reservation (the signed ticket naming its pre-allocated pages) and the prefill side leaves the
request's aux data (first output token, logprobs...) and either side leaves a failure.

Runs on the prefill host (SGLang starts it next to the prefill server at
``--disaggregation-bootstrap-port``). Entries expire after ``ttl`` seconds. Only metadata
passes through it; the KV bytes move over kvbridge's transports.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge.workers.http import BodyError, Deadlines, HTTPServer, bind_socket, read_json

__all__ = ["Mailbox", "MailboxClient"]

log = logging.getLogger("kvbridge_sglang")
KINDS = ("reservation", "aux", "fail")
MAX_BODY = 16 << 20        # one entry: a reservation names every page of its request (page size 1: 128 K ids ~ 1 MB)
BUDGET = 256 << 20         # every entry kept and every body being received, together
ENTRY_COST = 256           # what an entry costs beyond its body (key, tuple, dict slot), counted against BUDGET
MAX_ROOM_DIGITS = 20       # SGLang's rooms are 63-bit integers


class Mailbox:
    """``PUT``/``GET``/``DELETE /kvbridge/<kind>/<room>``, JSON object bodies, in memory.

    The bootstrap port faces anyone who can reach it (SGLang binds it on every interface), so it
    is served as kvbridge's workers are (:class:`kvbridge.workers.http.HTTPServer`: one event
    loop, no thread per connection, at most ``max_connections``, clients slower than ``deadlines``
    dropped)
    and nothing is taken before it fits: a body must declare its length, at most ``max_body``
    bytes, and is read only while the entries kept plus the bodies being received stay within
    ``budget`` bytes (else 503 with ``Retry-After``); a room is a decimal integer. Entries expire
    after ``ttl`` seconds."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl: float = 600.0, max_body: int = MAX_BODY,
                 budget: int = BUDGET, max_connections: Optional[int] = None,
                 deadlines: Deadlines = Deadlines()) -> None:
        self.ttl, self.max_body, self.budget = ttl, max_body, budget
        self._data: dict[tuple[str, str], tuple[float, bytes]] = {}     # oldest first
        self._held = 0              # bytes of entries kept and of bodies being received
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/kvbridge/{kind}/{room}", self._serve, methods=["GET", "PUT", "DELETE"])])
        self.http = HTTPServer(app, bind_socket(host, port, "--disaggregation-bootstrap-port"),
                               name="kvbridge-sglang-bootstrap", deadlines=deadlines, max_connections=max_connections)
        self.host, self.port = self.http.host, self.http.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, request: Request) -> Response:
        kind, room = request.path_params["kind"], request.path_params["room"]
        if not (room.isdecimal() and room.isascii() and len(room) <= MAX_ROOM_DIGITS):
            return JSONResponse({"error": "a room is a decimal integer"}, 400)
        if request.method == "DELETE":
            if kind != "room":
                return JSONResponse({"error": "DELETE /kvbridge/room/<room> only"}, 400)
            self._drop(room)
            return Response(status_code=204)
        if kind not in KINDS:
            return JSONResponse({"error": f"no such kind {kind!r}"}, 404)
        if request.method == "GET":
            got = self._get((kind, room))
            return Response(status_code=404) if got is None else Response(got, media_type="application/json")
        return await self._put(request, (kind, room))

    async def _put(self, request: Request, key: tuple[str, str]) -> Response:
        try:
            n = int(request.headers["content-length"])
        except (KeyError, ValueError):
            return JSONResponse({"error": "a body must declare its Content-Length"}, 411)
        if not 0 < n <= self.max_body:
            return JSONResponse({"error": f"a body is 1 to {self.max_body} bytes, not {n}"}, 413)
        cost = n + ENTRY_COST
        with self._lock:
            self._sweep()
            if self._held + cost > self.budget:
                return JSONResponse({"error": "the bootstrap server holds as much as it may; try again"}, 503,
                                    headers={"Retry-After": "1"})
            self._held += cost          # taken before a byte of the body is read
        try:
            body = await read_json(request, n)
        except BodyError as exc:
            with self._lock:
                self._held -= cost
            return JSONResponse({"error": exc.message}, exc.status)
        if not isinstance(body, dict):
            with self._lock:
                self._held -= cost
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
        raw = json.dumps(body).encode()
        with self._lock:
            old = self._data.pop(key, None)
            self._held += len(raw) + ENTRY_COST - cost - (0 if old is None else len(old[1]) + ENTRY_COST)
            self._data[key] = (time.monotonic(), raw)
        return Response(status_code=204)

    def _sweep(self) -> None:
        """Drop expired entries (oldest first: the dict keeps them in the order they came)."""
        now = time.monotonic()
        while self._data:
            key, (t, raw) = next(iter(self._data.items()))
            if now - t <= self.ttl:
                break
            del self._data[key]
            self._held -= len(raw) + ENTRY_COST

    def _get(self, key: tuple[str, str]) -> Optional[bytes]:
        with self._lock:
            self._sweep()
            got = self._data.get(key)
        return None if got is None else got[1]

    def _drop(self, room: str) -> None:
        with self._lock:
            for kind in KINDS:
                old = self._data.pop((kind, room), None)
                if old is not None:
                    self._held -= len(old[1]) + ENTRY_COST

    def close(self) -> None:
        self.http.close()


class MailboxClient:
    """Talks to the mailbox at ``host:port`` (SGLang's bootstrap address)."""

    def __init__(self, address: str, timeout: float = 2.0) -> None:
        self.base = f"http://{address}/kvbridge"
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise ConnectionError(f"bootstrap server {self.base}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectionError(f"bootstrap server {self.base} unreachable: {exc}") from None
        return json.loads(raw) if raw else {}

    def put(self, kind: str, room: int, body: dict[str, Any]) -> None:
        self._call("PUT", f"{kind}/{room}", body)

    def get(self, kind: str, room: int) -> Optional[dict[str, Any]]:
        return self._call("GET", f"{kind}/{room}")

    def drop(self, room: int) -> None:
        try:
            self._call("DELETE", f"room/{room}")
        except ConnectionError:
            pass
