"""inproc:// -- sender and receiver in one process (tests, colocated use): one memcpy."""

from __future__ import annotations

import itertools
import threading
from typing import Optional
from urllib.parse import urlsplit

from ..errors import ConfigError, PeerUnavailable
from ..handle import KVHandle
from ..policy import Timeout
from .base import BlockSource, Server, Spans, Transport, copy_runs
from .staging import copy_slices, device_slices
from .wire import Claim

__all__ = ["InprocTransport"]

_servers: dict[str, "InprocServer"] = {}
_lock = threading.Lock()
_names = itertools.count(1)


class InprocServer(Server):
    def __init__(self, url: str, source: BlockSource) -> None:
        self.url = url
        self.source = source

    def close(self) -> None:
        with _lock:
            if _servers.get(self.url) is self:
                del _servers[self.url]


class InprocTransport(Transport):
    scheme = "inproc"

    @classmethod
    def serve(cls, url: str, source: BlockSource, timeout: Timeout = Timeout()) -> Server:
        name = urlsplit(url).netloc
        with _lock:
            if not name:
                name = f"sender-{next(_names)}"
            full = f"inproc://{name}"
            if full in _servers:
                raise ConfigError(f"{full} is already served in this process")
            srv = _servers[full] = InprocServer(full, source)
        return srv

    def _server(self, url: str) -> InprocServer:
        srv = _servers.get(url)
        if srv is None:
            raise PeerUnavailable(f"no sender serves {url} in this process")
        return srv

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        grant = self._server(url).source.open_read(handle.to_bytes(), indices, claim)
        try:
            if not (dst.pool.is_host and grant.spans.pool.is_host):
                return copy_slices(device_slices(dst), device_slices(grant.spans))
            return copy_runs(dst.runs(), grant.spans.runs(), dst.landed if dst.verifier is not None else None)
        finally:
            grant.close()

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self._server(url).source.release_remote(handle.to_bytes())
