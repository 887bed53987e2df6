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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

__all__ = ["Mailbox", "MailboxClient"]

log = logging.getLogger("kvbridge_sglang")
KINDS = ("reservation", "aux", "fail")
MAX_BODY = 16 << 20


class Mailbox:
    """``PUT``/``GET``/``DELETE /kvbridge/<kind>/<room>``, JSON bodies, in memory."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl: float = 600.0) -> None:
        self.ttl = ttl
        self._data: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._lock = threading.Lock()
        box = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:   # quiet
                return

            def _key(self) -> Optional[tuple[str, str]]:
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "kvbridge" or parts[1] not in KINDS + ("room",):
                    return None
                return parts[1], parts[2]

            def _reply(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                key = self._key()
                n = int(self.headers.get("Content-Length") or 0)
                if key is None or key[0] == "room" or not 0 < n <= MAX_BODY:
                    return self._reply(400, b'{"error": "bad request"}')
                body = self.rfile.read(n)
                try:
                    json.loads(body)
                except ValueError:
                    return self._reply(400, b'{"error": "body is not JSON"}')
                box._put(key, body)
                self._reply(204)

            def do_GET(self) -> None:
                key = self._key()
                got = box._get(key) if key is not None else None
                if got is None:
                    return self._reply(404)
                self._reply(200, got)

            def do_DELETE(self) -> None:
                key = self._key()
                if key is None or key[0] != "room":
                    return self._reply(400)
                box._drop(key[1])
                self._reply(204)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvbridge-sglang-bootstrap",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _sweep(self) -> None:
        now = time.monotonic()
        for k in [k for k, (t, _) in self._data.items() if now - t > self.ttl]:
            del self._data[k]

    def _put(self, key: tuple[str, str], body: bytes) -> None:
        with self._lock:
            self._sweep()
            self._data[key] = (time.monotonic(), body)

    def _get(self, key: tuple[str, str]) -> Optional[bytes]:
        with self._lock:
            got = self._data.get(key)
        return None if got is None else got[1]

    def _drop(self, room: str) -> None:
        with self._lock:
            for kind in KINDS:
                self._data.pop((kind, room), None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=2)


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
