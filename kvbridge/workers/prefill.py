"""The prefill worker: computes prompts' KV with chunked prefill and publishes it as handles.

``POST /prefill`` ``{"prompt_ids": [...], "sampling": {...}, "request_id": "..."}`` runs
the prompt through the engine (``max_tokens=1``, ``keep_blocks=True``), samples the
first token, publishes the blocks with :class:`KVSender` and answers
``{"handle": {...} | null, "first_token", "num_tokens", "finish_reason", "timings"}``.
No handle is published when the first token already ends the request (stop token, or
``max_tokens == 1``). Unfetched handles are freed by the sender's TTL / lease expiry.
``GET /health`` also reports the sender's URLs and counters.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ..errors import ConfigError
from ..lease import LeaseStore
from ..sender import KVSender
from .engine import FinishReason, Request
from .model import CausalLM
from .sampling import SamplingParams
from .server import RECEIVED, AsyncWatch, EngineWorker, RequestWatch, WorkerConfig, wall_stamps

__all__ = ["PrefillWorker", "listen_urls"]


def listen_urls(transport: str, host: str = "127.0.0.1") -> list[str]:
    """KVSender listen URLs for ``--transport``: shm also listens on tcp as a fallback."""
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
                 model: Optional[CausalLM] = None, secret: Optional[bytes] = None) -> None:
        urls = listen_urls(transport) if isinstance(transport, str) else list(transport)
        super().__init__(cfg, model, shared_pool=any(u.startswith("shm://") for u in urls))
        self.transport = transport if isinstance(transport, str) else ",".join(urls)
        self.sender = KVSender(self.pool, urls, ttl=ttl, leases=leases, secret=secret)
        self.routes[("POST", "/prefill")] = self._http_prefill

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
        ids = body.get("prompt_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ConfigError("prompt_ids must be a non-empty list of token ids")
        params = SamplingParams.from_dict(body.get("sampling") or {})
        out = await self.aprefill(ids, params, request_id=body.get("request_id"),
                                  publish=bool(body.get("publish", True)), force=bool(body.get("force", False)),
                                  timeout=body.get("timeout"))
        t = out["timings"]
        t["stamps"].update(wall_stamps(w_received=request.scope.get(RECEIVED), w_answered=time.perf_counter()))
        return JSONResponse(out)

    def health(self) -> dict[str, Any]:
        h = super().health()
        h.update(transport=self.transport, sender_urls=list(self.sender.urls), live_handles=self.sender.num_live,
                 sender=self.sender.stats.as_dict())
        return h

    def close(self) -> None:
        super().close()
        self.sender.close()
        self.pool.close()
