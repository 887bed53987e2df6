"""The front door's read-only routes: ``/health``, ``/v1/models``, ``/metrics`` and ``/metrics.json``
(a part of :class:`kvbridge.workers.proxy.Proxy`, kept apart from request routing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Optional

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ..errors import KVBridgeError
from .http import WorkerClient
from .metrics import MetricsLog, PromMetrics, summarize
from .openai_api import _ADDRESS, APIError
from .proxy_config import ProxyConfig

MAX_RECORDS = 10_000   # most records /metrics.json?records=N returns (the latest)
_INTERNAL_HEALTH_KEYS = frozenset({"url", "sender_urls", "transport"})


class StatusRoutes:
    """Worker health, the model card and the metrics, over the proxy's state."""

    cfg: ProxyConfig
    client: Optional[WorkerClient]
    metrics: MetricsLog
    prom: PromMetrics
    started: float
    _inflight: dict[str, int]
    _max_len: Optional[int]

    async def _limits(self) -> int:
        raise NotImplementedError

    def _refuse(self, exc: APIError) -> Response:
        raise NotImplementedError

    async def workers(self) -> list[dict[str, Any]]:
        """Each worker's ``/health`` (``ok: False`` with the error for one that does not answer)."""
        assert self.client is not None
        roles = [("colocated", self.cfg.colocated)] if self.cfg.colocated else \
            [("prefill", u) for u in self.cfg.prefill] + [("decode", u) for u in self.cfg.decode]

        async def one(role: str, url: str) -> dict[str, Any]:
            try:
                h = dict(await self.client.get_json(url + "/health", timeout=2.0))  # type: ignore[union-attr]
                h.update(url=url, ok=True)
            except KVBridgeError as exc:
                h = {"url": url, "role": role, "ok": False, "error": str(exc)}
            h["proxy_inflight"] = self._inflight.get(url, 0)
            return h
        return list(await asyncio.gather(*(one(r, u) for r, u in roles if u)))

    @staticmethod
    def _public(ws: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Workers as ``/health`` shows them: no internal address (worker and KV listener URLs,
        transport details); each is named by role and index instead."""
        seen: dict[str, int] = {}
        out = []
        for w in ws:
            role = str(w.get("role", "worker"))
            n = seen[role] = seen.get(role, -1) + 1
            p = {k: v for k, v in w.items() if k not in _INTERNAL_HEALTH_KEYS}
            if "error" in p:
                p["error"] = _ADDRESS.sub("<internal>", str(p["error"]))
            p["name"] = f"{role}-{n}"
            out.append(p)
        return out

    async def _health(self, request: HTTPRequest) -> Response:
        ws = await self.workers()
        if not self.cfg.health_internal:
            ws = self._public(ws)
        ok = all(w["ok"] for w in ws)
        return JSONResponse({"status": "ok" if ok else "degraded", "mode": self.cfg.mode, "model": self.cfg.model_name,
                             "in_flight": self.metrics.in_flight, "workers": ws}, status_code=200 if ok else 503)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": int(self.started), "owned_by": "kvbridge",
                "max_model_len": self._max_len}

    async def _models(self, request: HTTPRequest) -> Response:
        with contextlib.suppress(KVBridgeError):
            await self._limits()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: HTTPRequest) -> Response:
        name = request.path_params["model"]
        if name != self.cfg.model_name:
            return self._refuse(APIError(404, f"The model `{name}` does not exist", "model", "model_not_found"))
        return JSONResponse(self._model_card())

    def summary(self) -> dict[str, Any]:
        """``summarize`` over the records kept (the latest ``MetricsLog.maxlen``)."""
        s = summarize(self.metrics.records(), self.cfg.ttft_slo, self.cfg.tpot_slo)
        s.update(mode=self.cfg.mode, in_flight=self.metrics.in_flight, uptime_s=time.time() - self.started)
        return s

    async def _metrics_prom(self, request: HTTPRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.prom.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _metrics_json(self, request: HTTPRequest) -> Response:
        """The summary, computed on a thread (not on the event loop every request waits on);
        ``?records=N`` adds the latest N records (``1``: the latest 1000), at most ``MAX_RECORDS``."""
        raw = request.query_params.get("records")
        n = 0
        if raw is not None:
            try:
                n = int(raw)
            except ValueError:
                return self._refuse(APIError(400, "records must be a number of records", "records"))
            n = 1000 if n == 1 else min(max(0, n), MAX_RECORDS)

        def build() -> bytes:
            s = self.summary()
            if n:
                s["records"] = [r.to_dict() for r in self.metrics.records(last=n)]
            return json.dumps(s).encode()
        return Response(await asyncio.to_thread(build), media_type="application/json")
