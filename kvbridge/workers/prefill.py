"""The prefill worker: computes prompts' KV with chunked prefill and publishes it as handles.

``POST /prefill`` ``{"prompt_ids": [...], "sampling": {...}, "request_id": "..."}`` runs
the prompt through the engine (``max_tokens=1``, ``keep_blocks=True``), samples the
first token, publishes the blocks with :class:`KVSender` and answers
``{"handle": {...} | null, "first_token", "num_tokens", "finish_reason", "timings"}``.
No handle is published when the first token already ends the request (stop token, or
``max_tokens == 1``). Unfetched handles are freed by the sender's TTL / lease expiry, or at
once by ``POST /release`` ``{"handle": {...}}`` (the proxy's, when its client left).
``"stream": true`` answers as SSE instead: an SSE comment every ``keepalive`` seconds while
the prompt waits for its slot, then one ``data:`` event with the answer (or its error).
A client that disconnects before the answer aborts the prefill (and ends a handle already
published for it). ``GET /health`` also reports the sender's URLs and counters.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Optional, Sequence, Union

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import ConfigError
from ..handle import KVHandle
from ..lease import LeaseStore
from ..sender import KVSender
from .engine import FinishReason, Request
from .model import CausalLM
from .sampling import SamplingParams
from .http import error_body, wait_or_disconnect
from .server import RECEIVED, AsyncWatch, EngineWorker, RequestWatch, WorkerConfig, sse, status_for, wall_stamps

__all__ = ["PrefillWorker", "listen_urls", "WILDCARD_HOSTS"]

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def listen_urls(transport: str, host: str = "127.0.0.1") -> list[str]:
    """KVSender listen URLs for ``--transport``: shm also listens on tcp as a fallback.

    ``host`` is where the KV listener binds and what the handles carry, so it must be an
    address decode workers can reach, not a wildcard (``0.0.0.0``): give the address to
    advertise (``kvbridge prefill --host 0.0.0.0 --advertise-host 10.0.0.2``)."""
    if host in WILDCARD_HOSTS:
        raise ConfigError(f"the KV listener cannot advertise the wildcard address {host!r}: decode workers "
                          f"could not reach it; give the address they reach (--advertise-host)")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if transport == "tcp":
        return [f"tcp://{host}:0"]
    if transport == "shm":
        return ["shm://", f"tcp://{host}:0"]
    if transport == "inproc":
        return [f"inproc://prefill-{os.getpid()}-{os.urandom(4).hex()}"]
    raise ConfigError(f"--transport must be tcp, shm or inproc, not {transport!r}")


class PrefillWorker(EngineWorker):
    """Prefill side: an engine whose finished prompts become published :class:`KVHandle` s."""

    role = "prefill"

    def __init__(self, cfg: WorkerConfig, transport: Union[str, Sequence[str]] = "tcp",
                 leases: Union[str, LeaseStore, None] = None, ttl: float = 30.0,
                 model: Optional[CausalLM] = None, secret: Optional[bytes] = None, host: str = "127.0.0.1") -> None:
        """``host``: the address the KV listener binds and advertises in handles (see :func:`listen_urls`)."""
        urls = listen_urls(transport, host) if isinstance(transport, str) else list(transport)
        super().__init__(cfg, model, shared_pool=any(u.startswith("shm://") for u in urls))
        self.transport = transport if isinstance(transport, str) else ",".join(urls)
        self.sender = KVSender(self.pool, urls, ttl=ttl, leases=leases, secret=secret)
        self.routes[("POST", "/prefill")] = self._http_prefill
        self.routes[("POST", "/release")] = self._http_release

    def _submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: Optional[str],
                watch: Any) -> Request:
        req = Request(list(prompt_ids), replace(sampling, max_tokens=1), keep_blocks=True,
                      request_id=request_id or uuid.uuid4().hex)
        self.loop.submit(req, watch)
        return req

    def _publish(self, req: Request, sampling: SamplingParams, admitted_at: Optional[float], publish: bool,
                 force: bool, t_in: float) -> dict[str, Any]:
        """After the prompt ran: publish its blocks (or free them) and describe the result."""
        if req.finish_reason is FinishReason.ABORTED:
            self._reclaim(req)
            raise ConfigError(f"prefill of {req.request_id} was aborted")
        first = req.output_ids[0]
        done = not force and (req.finish_reason is FinishReason.STOP or sampling.max_tokens <= 1)
        t_pub = time.perf_counter()
        handle = None
        if done or not publish:
            self.pool.free(req.block_ids)
        else:
            try:
                handle = self.sender.publish(req.request_id, req.block_ids, len(req.prompt_ids))
            except BaseException:
                self.pool.free(req.block_ids)
                raise
        req.block_ids = []
        t_done = time.perf_counter()
        admitted = admitted_at if admitted_at is not None else req.arrival_time
        arrival = req.arrival_time or t_in
        return {
            "request_id": req.request_id,
            "handle": handle.to_dict() if handle is not None else None,
            "first_token": first, "num_tokens": len(req.prompt_ids),
            "finish_reason": "stop" if req.finish_reason is FinishReason.STOP else (
                "length" if done else None),
            "timings": {"queue_s": max(0.0, (admitted or arrival) - arrival),
                        "prefill_s": (req.token_times[0] - (admitted or arrival)),
                        "publish_s": t_done - t_pub, "total_s": t_done - t_in,
                        "stamps": wall_stamps(w_submitted=arrival, w_first_token=req.token_times[0],
                                              w_published=t_done)},
        }

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                request_id: Optional[str] = None, publish: bool = True, force: bool = False,
                timeout: Optional[float] = None) -> dict[str, Any]:
        """Run one prompt to its first token; publish its KV unless the request is already done.

        ``force`` publishes even then (a re-prefill, whose first token the caller already has).
        """
        t_in = time.perf_counter()
        watch = RequestWatch()
        req = self._submit(prompt_ids, sampling, request_id, watch)
        try:
            self.wait_done(req, watch, timeout or self.cfg.request_timeout)
        except BaseException:
            self._reclaim(req)
            raise
        return self._publish(req, sampling, watch.admitted_at, publish, force, t_in)

    async def aprefill(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                       request_id: Optional[str] = None, publish: bool = True, force: bool = False,
                       timeout: Optional[float] = None) -> dict[str, Any]:
        """Awaitable :meth:`prefill`: waits on the event loop; the publish runs on a thread."""
        t_in = time.perf_counter()
        watch = AsyncWatch()
        req = self._submit(prompt_ids, sampling, request_id, watch)
        try:
            await self.await_done(req, watch, timeout or self.cfg.request_timeout)
        except BaseException:
            asyncio.get_running_loop().run_in_executor(None, self._reclaim, req)  # not awaited: may be cancelled
            raise
        return await asyncio.to_thread(self._publish, req, sampling, watch.admitted_at, publish, force, t_in)

    def _reclaim(self, req: Request) -> None:
        """Free the blocks of a prefill that failed or was aborted (``keep_blocks`` keeps them)."""
        deadline = time.monotonic() + 5.0
        while not req.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []

    async def _http_prefill(self, request: HTTPRequest) -> Response:
        body = await self.body(request)
        ids = self.id_list(body.get("prompt_ids"), "prompt_ids")
        self.check_length(len(ids), "the prompt")  # before a look at every id
        self.check_ids(ids, "prompt_ids")
        params = SamplingParams.from_dict(body.get("sampling") or {})
        rid, timeout = body.get("request_id"), body.get("timeout")
        if rid is not None and not isinstance(rid, str):
            raise ConfigError("request_id must be a string")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            raise ConfigError("timeout must be a positive number of seconds")
        task = asyncio.ensure_future(self.aprefill(ids, params, request_id=rid, publish=bool(body.get("publish", True)),
                                                   force=bool(body.get("force", False)), timeout=timeout))
        received = request.scope.get(RECEIVED)
        if body.get("stream"):
            return StreamingResponse(self._answer_events(task, received), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if not await wait_or_disconnect(request, task):
            return JSONResponse(error_body(ConfigError("the client disconnected"), 499), status_code=499)
        out = self._answer(task.result(), received)
        if await request.is_disconnected():  # it left while the answer was made: nobody fetches the KV
            self._revoke(out)
        return JSONResponse(out)

    @staticmethod
    def _answer(out: dict[str, Any], received: Optional[float]) -> dict[str, Any]:
        out["timings"]["stamps"].update(wall_stamps(w_received=received, w_answered=time.perf_counter()))
        return out

    def _revoke(self, out: dict[str, Any]) -> None:
        if out.get("handle"):
            self.sender.revoke(KVHandle.from_dict(out["handle"]))

    async def _answer_events(self, task: "asyncio.Future[dict[str, Any]]",
                             received: Optional[float]) -> AsyncIterator[bytes]:
        """``/prefill`` as SSE: comments while the prompt waits (the proxy then knows this worker
        lives), one event with the answer or the error, ``[DONE]``. A client that leaves (the
        stream is cancelled) aborts the prefill or ends the handle it got."""
        delivered = False
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.cfg.keepalive)
                if not task.done():
                    yield b": queued\n\n"
            exc = task.exception()
            if exc is not None:
                yield sse(error_body(exc, status_for(exc))) + sse(b"[DONE]")
                return
            data = sse(self._answer(task.result(), received)) + sse(b"[DONE]")
            delivered = True
            yield data
        finally:
            if not task.done():
                task.cancel()  # await_done aborts the request; its blocks are reclaimed
            elif not delivered and not task.cancelled() and task.exception() is None:
                self._revoke(task.result())

    async def _http_release(self, request: HTTPRequest) -> Response:
        """End a handle this worker published (its blocks are freed once reads drain)."""
        body = await self.body(request)
        if not isinstance(body.get("handle"), dict):
            raise ConfigError("handle (a handle dict this worker published) is required")
        ended = self.sender.revoke(KVHandle.from_dict(body["handle"]))
        return JSONResponse({"released": bool(ended)})

    def health(self) -> dict[str, Any]:
        h = super().health()
        h.update(transport=self.transport, sender_urls=list(self.sender.urls), live_handles=self.sender.num_live,
                 sender=self.sender.stats.as_dict())
        return h

    def close(self) -> None:
        super().close()
        self.sender.close()
        self.pool.close()
