"""The colocated worker: one engine does prefill and decode (the baseline PD is compared with).

Scheduled as a modern engine does it: every step runs the decode step of all running
requests first, then prompt chunks of ``chunk_size`` tokens, with continuous batching
(see :class:`~kvbridge.workers.engine.Scheduler`). ``POST /generate`` ``{"prompt_ids",
"sampling", "request_id", "stream"}`` streams every output token as SSE events (same
format as the decode worker's), then ``{"done": true, ...}`` and ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Sequence

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from ..errors import ConfigError
from .engine import Request
from .model import CausalLM
from .sampling import SamplingParams
from .server import RECEIVED, AsyncWatch, EngineWorker, RequestWatch, WorkerConfig

__all__ = ["ColocatedWorker"]


class ColocatedWorker(EngineWorker):
    """Prefill and decode in one engine with chunked prefill and continuous batching."""

    role = "colocated"

    def __init__(self, cfg: WorkerConfig, model: Optional[CausalLM] = None) -> None:
        super().__init__(cfg, model)
        self.routes[("POST", "/generate")] = self._http_generate

    def start(self, prompt_ids: Sequence[int], sampling: SamplingParams,
              request_id: Optional[str] = None) -> tuple[Request, RequestWatch]:
        req = Request(list(prompt_ids), sampling, request_id=request_id or uuid.uuid4().hex)
        watch = RequestWatch()
        self.loop.submit(req, watch)
        return req, watch

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                 request_id: Optional[str] = None) -> tuple[list[int], dict[str, Any]]:
        """Blocking: every output token and the request's timings."""
        req, watch = self.start(prompt_ids, sampling, request_id)
        self.wait_done(req, watch, self.cfg.request_timeout)
        return list(req.output_ids), self._timings(req, watch)

    @staticmethod
    def _timings(req: Request, watch: Any) -> dict[str, Any]:
        arrival = req.arrival_time or 0.0
        admitted = watch.admitted_at if watch.admitted_at is not None else arrival
        first = req.first_token_time
        return {"queue_s": max(0.0, admitted - arrival),
                "prefill_s": None if first is None else first - admitted,
                "decode_s": (req.finish_time or time.perf_counter()) - (first or arrival),
                "finish_reason": req.finish_reason.value if req.finish_reason else None}

    async def _http_generate(self, request: HTTPRequest) -> Response:
        body = await self.body(request)
        prompt = self.id_list(body.get("prompt_ids"), "prompt_ids")
        params = SamplingParams.from_dict(body.get("sampling") or {})
        self.check_length(len(prompt) + params.max_tokens - 1, "prompt_ids plus max_tokens")
        self.check_ids(prompt, "prompt_ids")  # after the length: a look at every id
        rid = body.get("request_id")
        if rid is not None and not isinstance(rid, str):
            raise ConfigError("request_id must be a string")
        req = Request(list(prompt), params, request_id=rid or uuid.uuid4().hex)
        watch = AsyncWatch()
        self.loop.submit(req, watch)
        return await self.respond(req, watch, 0, bool(body.get("stream", True)), lambda: self._timings(req, watch),
                                  request.scope.get(RECEIVED), request=request)
