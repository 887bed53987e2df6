"""inproc:// -- both ends in one process (tests, colocated use): one memcpy per move."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import ConfigError, PeerUnavailable, ProtocolError
from ..handle import KVHandle
from ..lease.base import Claim
from ..policy import Timeout
from .base import Chunk, Server, Spans, SpansFor, Transport, copy_runs
from .staging import copy_slices, device_slices
from .wire import settle_vouch, vouch_of

__all__ = ["InprocTransport"]

_servers: dict[str, "InprocServer"] = {}
_lock = threading.Lock()
_names = itertools.count(1)


class InprocServer(Server):
    def __init__(self, url: str, endpoint: Any) -> None:
        self.url = url
        self.endpoint = endpoint

    def close(self) -> None:
        with _lock:
            if _servers.get(self.url) is self:
                del _servers[self.url]


def _copy(dst: Spans, src: Spans) -> int:
    if not (dst.pool.is_host and src.pool.is_host):
        return copy_slices(device_slices(dst), device_slices(src))
    return copy_runs(dst.runs(), src.runs(), dst.on_landed)


class InprocTransport(Transport):
    scheme = "inproc"
    claims_on_read = True
    # the owner's validate-after-read runs right after each copy, as tcp's trailer (see .wire)
    validates_after_read = True
    vouches_lease_ttl = True

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Timeout = Timeout()) -> Server:
        name = urlsplit(url).netloc
        with _lock:
            if not name:
                name = f"endpoint-{next(_names)}"
            full = f"inproc://{name}"
            if full in _servers:
                raise ConfigError(f"{full} is already served in this process")
            srv = _servers[full] = InprocServer(full, source)
        return srv

    def _endpoint(self, url: str, role: str) -> Any:
        srv = _servers.get(url)
        if srv is None:
            raise PeerUnavailable(f"nothing serves {url} in this process")
        if not hasattr(srv.endpoint, role):
            raise ProtocolError(f"{url} does not take {role.replace('_', ' ')} requests")
        return srv.endpoint

    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        grant = self._endpoint(url, "open_read").open_read(handle.to_bytes(), indices, claim)
        try:
            dst.claimed = grant.claim
            n = _copy(dst, grant.spans)
            settle_vouch(vouch_of(grant), grant.claim or claim, f"read {url}")
            return n
        finally:
            grant.close()

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        grant = self._endpoint(url, "open_read").open_read(handle.to_bytes(), indices, claim, (first, end))
        try:
            lo, hi = grant.layers
            n = _copy(spans_for(lo, hi, grant.spans.nbytes), grant.spans)
            settle_vouch(vouch_of(grant), grant.claim or claim, f"read layers of {url}")
            return Chunk(lo, hi, grant.sums, n, grant.claim)
        finally:
            grant.close()

    def write(self, url: str, ticket: KVHandle, src: Spans, layers: tuple[int, int], claim: Optional[Claim],
              sums: bytes, last: bool) -> int:
        grant = self._endpoint(url, "open_write").open_write(ticket.to_bytes(), layers, claim)
        try:
            n = _copy(grant.spans, src)
            grant.finish(sums, last)
            return n
        finally:
            grant.close()

    def abort_write(self, url: str, ticket: KVHandle, claim: Optional[Claim]) -> None:
        self._endpoint(url, "abort_remote").abort_remote(ticket.to_bytes(), claim)

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self._endpoint(url, "release_remote").release_remote(handle.to_bytes())
