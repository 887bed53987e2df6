"""The decode worker: fetches a request's KV through its handle and continues generating.

``POST /generate`` ``{"handle": {...}, "prompt_ids": [...], "output_ids": [first, ...],
"sampling": {...}, "request_id": "...", "stream": true}``: the handle's KV covers
``prompt_ids + output_ids[:-1]``; ``output_ids[-1]`` is fed next. The worker allocates
blocks, ``receiver.fetch(handle, blocks)`` (claim, read, verify, release), hands the
request to its continuous-batching scheduler with ``add_prefilled`` and streams new
tokens as SSE ``data: {"token_ids": [...]}`` events, then ``{"done": true, ...}`` and
``data: [DONE]``. A failed fetch answers before the stream starts with the error, its
code and ``action`` (``reprefill`` when the KV is gone: HTTP 410).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from typing import Any, Iterator, Optional, Sequence, Union

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from ..errors import ConfigError, KVBridgeError, PoolError
from ..handle import KVHandle
from ..lease import LeaseStore
from ..policy import Retry, Timeout
from ..receiver import FetchResult, KVReceiver
from .engine import Request
from .model import CausalLM
from .sampling import SamplingParams
from .server import AsyncWatch, EngineWorker, RequestWatch, WorkerConfig

__all__ = ["DecodeWorker"]


class DecodeWorker(EngineWorker):
    """Decode side: KV arrives by handle; tokens leave by stream."""

    role = "decode"

    def __init__(self, cfg: WorkerConfig, leases: Union[str, LeaseStore, None] = None,
                 model: Optional[CausalLM] = None, secret: Optional[bytes] = None,
                 timeout: Timeout = Timeout(connect=2.0, transfer=30.0), retry: Retry = Retry(deadline=10.0)) -> None:
        super().__init__(cfg, model)
        self.receiver = KVReceiver(self.pool, leases=leases, secret=secret, timeout=timeout, retry=retry)
        self.routes[("POST", "/generate")] = self._http_generate
        self.fetches = {"ok": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self._arriving: set[str] = set()  # request ids between arrival and the engine loop's watch
        self._ids_lock = threading.Lock()

    @contextlib.contextmanager
    def _request_id(self, request_id: Optional[str]) -> Iterator[None]:
        """Hold ``request_id`` from the request's arrival until the engine loop watches it (or it
        fails): an id in use here is refused (``ConfigError``) before its handle is fetched, which
        would use the handle up for a request that is then refused."""
        if request_id is None:
            yield
            return
        with self._ids_lock:
            if request_id in self._arriving or self.loop.watching(request_id):
                raise ConfigError(f"request_id {request_id[:80]!r} is already in use on this worker")
            self._arriving.add(request_id)
        try:
            yield
        finally:
            with self._ids_lock:
                self._arriving.discard(request_id)

    def _check(self, handle: Union[KVHandle, dict[str, Any]], prompt_ids: Sequence[int], output_ids: Sequence[int],
               sampling: SamplingParams) -> tuple[KVHandle, list[int], int]:
        """Everything about the request that can be wrong, checked before a block is allocated."""
        h = handle if isinstance(handle, KVHandle) else KVHandle.from_dict(handle)
        prompt = self.id_list(list(prompt_ids), "prompt_ids")
        if not output_ids:
            raise ConfigError("output_ids must hold at least the first token")
        outs = self.id_list(list(output_ids), "output_ids")
        # lengths first, at no cost; then a look at every id
        self.check_length(len(prompt) + sampling.max_tokens - 1, "prompt_ids plus max_tokens")
        if len(outs) >= sampling.max_tokens:
            raise ConfigError("nothing left to decode: output_ids already reach max_tokens")
        self.check_ids(prompt, "prompt_ids")
        self.check_ids(outs, "output_ids")
        num_cached = len(prompt) + len(outs) - 1
        if h.num_tokens != num_cached:
            raise ConfigError(f"handle holds {h.num_tokens} tokens of KV but prompt + outputs need {num_cached}")
        need = self.engine.blocks_needed(len(prompt_ids) + sampling.max_tokens - 1)
        if need > self.pool.num_blocks:
            raise PoolError(f"request needs {need} blocks, the decode pool has {self.pool.num_blocks}",
                            hint="lower max_tokens or start decode workers with more --num-blocks")
        if not self.engine.blocks_needed(num_cached) <= h.num_blocks <= need:
            raise ConfigError(f"handle has {h.num_blocks} blocks; {num_cached} cached tokens need "
                              f"{self.engine.blocks_needed(num_cached)}, the whole request {need}")
        return h, outs, num_cached

    def _try_alloc(self, n: int, deadline: float, timeout: float) -> Optional[list[int]]:
        try:
            return self.pool.alloc(n)
        except PoolError:
            if time.monotonic() >= deadline:
                raise PoolError(f"decode pool has no {n} free blocks after {timeout:.0f}s",
                                hint="add decode workers or --num-blocks") from None
            return None

    def _fetched(self, res: FetchResult, blocks: list[int]) -> None:
        if not res.ok:
            self.pool.free(blocks)
            self.fetches["failed"] += 1
            raise res.error or KVBridgeError("fetch failed")
        self.fetches["ok"] += 1
        self.fetches["bytes"] += res.nbytes
        self.fetches["seconds"] += res.seconds

    def _queue(self, prompt_ids: Sequence[int], outs: list[int], num_cached: int, blocks: list[int],
               sampling: SamplingParams, request_id: Optional[str], watch: Any) -> Request:
        """Hand the fetched blocks to the scheduler; on any failure before it took them, free them."""
        try:
            req = Request(list(prompt_ids) + outs[:-1], sampling, request_id=request_id or uuid.uuid4().hex)
            self.loop.submit_prefilled(req, blocks, num_cached, outs, watch)
        except BaseException:
            self.pool.free(blocks)
            raise
        return req

    def start(self, handle: Union[KVHandle, dict[str, Any]], prompt_ids: Sequence[int], output_ids: Sequence[int],
              sampling: SamplingParams, request_id: Optional[str] = None) -> tuple[Request, RequestWatch, FetchResult]:
        """Fetch the KV of ``handle`` and queue the request's remaining decode steps.

        Raises the fetch's error (with its ``action``) if the KV could not be fetched.
        """
        h, outs, num_cached = self._check(handle, prompt_ids, output_ids, sampling)
        with self._request_id(request_id):
            timeout = min(30.0, self.cfg.request_timeout)
            deadline = time.monotonic() + timeout
            while (blocks := self._try_alloc(h.num_blocks, deadline, timeout)) is None:
                time.sleep(0.01)
            try:
                res = self.receiver.fetch(h, blocks)
            except BaseException:
                self.pool.free(blocks)
                raise
            self._fetched(res, blocks)
            watch = RequestWatch()
            return self._queue(prompt_ids, outs, num_cached, blocks, sampling, request_id, watch), watch, res

    async def astart(self, handle: Union[KVHandle, dict[str, Any]], prompt_ids: Sequence[int],
                     output_ids: Sequence[int], sampling: SamplingParams,
                     request_id: Optional[str] = None) -> tuple[Request, AsyncWatch, FetchResult]:
        """Awaitable :meth:`start`: waits for blocks and fetches (``receiver.afetch``) on the event loop."""
        h, outs, num_cached = self._check(handle, prompt_ids, output_ids, sampling)
        with self._request_id(request_id):
            timeout = min(30.0, self.cfg.request_timeout)
            deadline = time.monotonic() + timeout
            while (blocks := self._try_alloc(h.num_blocks, deadline, timeout)) is None:
                await asyncio.sleep(0.01)
            try:
                res = await self.receiver.afetch(h, blocks)
            except BaseException:
                self.pool.free(blocks)
                raise
            self._fetched(res, blocks)
            watch = AsyncWatch()
            return self._queue(prompt_ids, outs, num_cached, blocks, sampling, request_id, watch), watch, res

    def generate(self, handle: Union[KVHandle, dict[str, Any]], prompt_ids: Sequence[int],
                 output_ids: Sequence[int], sampling: SamplingParams,
                 request_id: Optional[str] = None) -> tuple[list[int], dict[str, Any]]:
        """Blocking form of :meth:`start`: every output token (earlier ones included) and timings."""
        req, watch, res = self.start(handle, prompt_ids, output_ids, sampling, request_id)
        self.wait_done(req, watch, self.cfg.request_timeout)
        return list(req.output_ids), self._timings(req, res)

    @staticmethod
    def _timings(req: Request, res: FetchResult) -> dict[str, Any]:
        return {"kv_transfer_s": res.seconds, "kv_bytes": res.nbytes, "fetch_attempts": res.attempts,
                "decode_s": (req.finish_time or time.perf_counter()) - (req.arrival_time or 0.0),
                "finish_reason": req.finish_reason.value if req.finish_reason else None}

    async def _http_generate(self, request: HTTPRequest) -> Response:
        body = await self.body(request)
        if not isinstance(body.get("handle"), dict):
            raise ConfigError("handle (the prefill worker's handle dict) is required")
        prompt = self.id_list(body.get("prompt_ids"), "prompt_ids")  # its ids checked after its length (_check)
        outs = body.get("output_ids")
        if outs is None and "first_token" in body:
            outs = [body["first_token"]]
        if not isinstance(outs, list) or not outs:
            raise ConfigError("output_ids must be a non-empty list of token ids (the first token at least)")
        rid = body.get("request_id")
        if rid is not None and not isinstance(rid, str):
            raise ConfigError("request_id must be a string")
        params = SamplingParams.from_dict(body.get("sampling") or {})
        req, watch, res = await self.astart(body["handle"], prompt, outs, params, rid)
        return await self.respond(req, watch, len(outs), bool(body.get("stream", True)),
                                  lambda: self._timings(req, res), request=request)

    def health(self) -> dict[str, Any]:
        h = super().health()
        h.update(fetches=dict(self.fetches), receiver=self.receiver.stats.as_dict())
        return h

    def close(self) -> None:
        super().close()
        self.receiver.close()
        self.pool.close()
