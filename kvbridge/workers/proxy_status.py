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
from .openai_api import _ADDRESS, APIError, clip
from .proxy_config import ProxyConfig

MAX_RECORDS = 10_000   # most records /metrics.json?records=N returns (the latest)
HEALTH_REUSE = 0.5     # seconds one round of worker health probes answers /health
STATUS_REUSE = 4.0     # one build of /metrics.json serves every caller for this many times as long as it took
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
    _status_lock: asyncio.Lock
    _status_cache: Optional[tuple[float, bytes, Optional[list[bytes]]]]   # (reuse until, summary, records)
    _health_round: Optional[tuple[float, asyncio.Future[list[dict[str, Any]]]]]   # (reuse until, its probes)

    async def _limits(self) -> int:
        raise NotImplementedError

    def _refuse(self, exc: APIError) -> Response:
        raise NotImplementedError

    async def workers(self) -> list[dict[str, Any]]:
        """Each worker's ``/health`` (``ok: False`` with the error for one that does not answer).
        One round of probes at a time, and its answers serve every caller for ``HEALTH_REUSE``
        seconds after it began (or until a request finds a worker down): ``/health`` asked in a
        loop does not become a loop of requests to every worker."""
        now = time.monotonic()
        last = self._health_round
        if last is None or (last[1].done() and now >= last[0]):
            last = self._health_round = (now + HEALTH_REUSE, asyncio.ensure_future(self._probe_workers()))
        # shielded: a caller that goes away does not cancel the round the others wait for
        return [{**w, "proxy_inflight": self._inflight.get(w["url"], 0)} for w in await asyncio.shield(last[1])]

    async def _probe_workers(self) -> list[dict[str, Any]]:
        assert self.client is not None
        roles = [("colocated", self.cfg.colocated)] if self.cfg.colocated else \
            [("prefill", u) for u in self.cfg.prefill] + [("decode", u) for u in self.cfg.decode]

        async def one(role: str, url: str) -> dict[str, Any]:
            try:
                h = dict(await self.client.get_json(url + "/health", timeout=2.0))  # type: ignore[union-attr]
                h.update(url=url, ok=True)
            except KVBridgeError as exc:
                h = {"url": url, "role": role, "ok": False, "error": str(exc)}
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
            return self._refuse(APIError(404, f"The model `{clip(name)}` does not exist", "model", "model_not_found"))
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
        """The summary, computed on a thread (not on the event loop every request waits on) and
        reused while building it again would cost too much (see :meth:`_status_json`);
        ``?records=N`` adds the latest N records (``1``: the latest 1000), at most ``MAX_RECORDS``."""
        raw = request.query_params.get("records")
        n = 0
        if raw is not None:
            try:
                n = int(raw)
            except ValueError:
                return self._refuse(APIError(400, "records must be a number of records", "records"))
            n = 1000 if n == 1 else min(max(0, n), MAX_RECORDS)

        summary, records = await self._status_json(with_records=n > 0)
        body = summary if not n else summary[:-1] + b', "records": [' + b", ".join(records[-n:]) + b"]}"
        return Response(body, media_type="application/json")

    async def _status_json(self, with_records: bool) -> tuple[bytes, list[bytes]]:
        """The summary as JSON and the latest ``MAX_RECORDS`` records, each as JSON, built once at
        a time and shared by every ``/metrics.json`` call for ``STATUS_REUSE`` times as long as the
        build took (a few records: fresh each call; 20,000: a build holds the GIL for ~0.5 s, and
        callers asking in a loop made every stream wait that long for the event loop)."""
        async with self._status_lock:
            now = time.monotonic()
            cached = self._status_cache
            if cached is None or now >= cached[0] or (with_records and cached[2] is None):
                def build() -> tuple[bytes, Optional[list[bytes]]]:
                    recs = [json.dumps(r.to_dict()).encode() for r in self.metrics.records(last=MAX_RECORDS)] \
                        if with_records else None
                    return json.dumps(self.summary()).encode(), recs
                summary, recs = await asyncio.to_thread(build)
                took = time.monotonic() - now
                cached = (time.monotonic() + STATUS_REUSE * took, summary, recs)
                self._status_cache = cached
        return cached[1], cached[2] or []
