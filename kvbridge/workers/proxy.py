"""The HTTP front door: OpenAI-style completions routed prefill -> decode (or to a colocated engine).

``POST /v1/completions`` takes ``prompt`` (text or token ids), ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``ignore_eos``, ``stream``. Disaggregated,
the proxy asks a prefill worker for the prompt's KV handle and first token, picks a
decode worker (least-loaded or round-robin) and passes it the handle; tokens stream
back as SSE ``data: {...}`` chunks and ``data: [DONE]``. ``GET /health``, ``GET /metrics``
(Prometheus text) and ``GET /metrics.json`` (``?records=1`` adds per-request records).

Failures: a decode worker that dies or times out is retried on another one with the
same handle (``on_decode_failure="retry"``) while the handle may still be live, else
the request is re-prefilled (prompt plus the tokens already delivered) and continues
where it stopped; ``"reprefill"`` always re-prefills. A dead prefill worker is retried
once, then the client gets HTTP 502 with the error and its ``action``. Every wait is
bounded, so a client gets a complete answer or a clear error.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, Optional, Sequence
from urllib.parse import parse_qs

from ..errors import (Action, ConfigError, KVBridgeError, PeerUnavailable, TransferTimeout, error_from_code)
from .metrics import MetricsLog, RequestMetrics, summarize, to_prometheus
from .sampling import SamplingParams
from .server import ClientGone, Ctx, JSONServer, error_body, http_json, http_stream
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Proxy", "ProxyConfig"]

log = logging.getLogger("kvbridge.proxy")


@dataclass
class ProxyConfig:
    """Where the workers are and how to treat them."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: Optional[str] = None
    routing: str = "least-loaded"          # or "round-robin"
    on_decode_failure: str = "retry"       # or "reprefill"
    ttft_slo: Optional[float] = 2.0        # seconds, for goodput
    tpot_slo: Optional[float] = 0.1
    worker_timeout: float = 30.0           # longest silence from a worker before it counts as failed
    request_timeout: float = 300.0
    max_attempts: int = 4                  # decode attempts per request
    model_name: str = "kvbridge"

    def __post_init__(self) -> None:
        if self.colocated is None and (not self.prefill or not self.decode):
            raise ConfigError("the proxy needs --prefill and --decode URLs, or --colocated URL")
        if self.routing not in ("least-loaded", "round-robin"):
            raise ConfigError(f"routing must be least-loaded or round-robin, not {self.routing!r}")
        if self.on_decode_failure not in ("retry", "reprefill"):
            raise ConfigError(f"on_decode_failure must be retry or reprefill, not {self.on_decode_failure!r}")

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"


def _rebuild(ev: dict[str, Any]) -> KVBridgeError:
    err = ev.get("error") or {}
    return error_from_code(int(err.get("code", 1)), str(err.get("message", "worker error")))


def _with_context(exc: KVBridgeError, context: str) -> KVBridgeError:
    new = type(exc)(f"{context}: {exc.message}")
    if hasattr(exc, "status"):
        new.status = exc.status  # type: ignore[attr-defined]
    return new


class _Done(Exception):
    """Internal: the generator finished with this finish reason."""


class Proxy:
    """Routes completions to workers and keeps per-request metrics."""

    def __init__(self, cfg: ProxyConfig, tokenizer: Optional[Tokenizer] = None) -> None:
        self.cfg = cfg
        self.tok: Tokenizer = tokenizer or ByteTokenizer()
        self.metrics = MetricsLog()
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {u: 0 for u in cfg.decode}
        self._down_until: dict[str, float] = {}
        self._rr = itertools.count()
        self._prr = itertools.count()
        self.http: Optional[JSONServer] = None
        self.started = time.time()

    # -- routing ---------------------------------------------------------------------------
    def _pick_decode(self, exclude: set[str]) -> Optional[str]:
        now = time.monotonic()
        with self._lock:
            cands = [u for u in self.cfg.decode if u not in exclude]
            up = [u for u in cands if self._down_until.get(u, 0.0) <= now] or cands
            if not up:
                return None
            if self.cfg.routing == "round-robin":
                return up[next(self._rr) % len(up)]
            start = next(self._rr)
            order = [up[(start + i) % len(up)] for i in range(len(up))]
            return min(order, key=lambda u: self._inflight.get(u, 0))

    def _mark_down(self, url: str, seconds: float = 5.0) -> None:
        with self._lock:
            self._down_until[url] = time.monotonic() + seconds

    # -- prefill ---------------------------------------------------------------------------
    def _prefill(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                 force: bool) -> dict[str, Any]:
        urls = self.cfg.prefill
        first = next(self._prr)
        last: Optional[KVBridgeError] = None
        for attempt in range(2):  # a dead prefill worker is retried once (on the next one, if any)
            url = urls[(first + attempt) % len(urls)]
            try:
                return dict(http_json("POST", url + "/prefill",
                                      {"prompt_ids": ids, "sampling": params.to_dict(), "force": force,
                                       "request_id": f"{rid}-p{m.retries + m.reprefills}-{attempt}"},
                                      timeout=self.cfg.worker_timeout))
            except KVBridgeError as exc:
                last = exc
                if exc.action is not Action.RETRY:
                    break
                m.retries += 1
                log.warning("prefill on %s failed (%s); %s", url, exc, "retrying" if attempt == 0 else "giving up")
                time.sleep(0.2)
        assert last is not None
        err = _with_context(last, "prefill failed")
        if last.action is Action.RETRY:
            err.status = 502  # type: ignore[attr-defined]
        raise err

    # -- generation ------------------------------------------------------------------------
    def _generate(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                  deadline: float) -> Generator[list[int], None, None]:
        """Yield new output tokens as they arrive; raise ``_Done(reason)`` at the end."""
        if self.cfg.colocated:
            yield from self._generate_colocated(ids, params, rid, m, deadline)
            return
        out: list[int] = []
        handle: Optional[dict[str, Any]] = None
        failed: set[str] = set()
        attempts = 0
        while True:
            if time.monotonic() > deadline:
                raise TransferTimeout(f"request did not finish within {self.cfg.request_timeout:.0f}s")
            if handle is None:
                ctx_ids = ids + out[:-1] if out else ids
                pr = self._prefill(ctx_ids, params, rid, m, force=bool(out))
                if m.queue_s is None:
                    m.queue_s = pr["timings"]["queue_s"]
                    m.prefill_s = pr["timings"]["prefill_s"]
                if not out:
                    out.append(int(pr["first_token"]))
                    yield out[-1:]
                    if pr["handle"] is None:
                        raise _Done(pr.get("finish_reason") or "stop")
                handle = pr["handle"]
            if len(out) >= params.max_tokens:
                raise _Done("length")
            url = self._pick_decode(failed)
            if url is None:
                raise PeerUnavailable(f"no decode worker left to try ({len(failed)} failed for this request)")
            attempts += 1
            got = 0
            with self._lock:
                self._inflight[url] = self._inflight.get(url, 0) + 1
            try:
                body = {"handle": handle, "prompt_ids": ids, "output_ids": out, "sampling": params.to_dict(),
                        "request_id": f"{rid}-d{attempts}", "stream": True}
                for ev in http_stream(url + "/generate", body, timeout=self.cfg.worker_timeout):
                    if "error" in ev:
                        raise _rebuild(ev)
                    new = [int(t) for t in ev.get("token_ids", ())]
                    if new:
                        got += len(new)
                        out.extend(new)
                        yield new
                    if ev.get("done"):
                        t = ev.get("timings") or {}
                        m.kv_transfer_s = (m.kv_transfer_s or 0.0) + float(t.get("kv_transfer_s") or 0.0)
                        m.kv_bytes += int(t.get("kv_bytes") or 0)
                        raise _Done(ev.get("finish_reason") or "length")
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"request did not finish within {self.cfg.request_timeout:.0f}s")
            except KVBridgeError as exc:
                if attempts >= self.cfg.max_attempts or exc.action is Action.FIX:
                    raise _with_context(exc, f"decode on {url} failed (attempt {attempts})")
                if exc.action is Action.RETRY:  # the worker died, hung or is unreachable
                    failed.add(url)
                    self._mark_down(url)
                    m.retries += 1
                    keep = self.cfg.on_decode_failure == "retry" and got == 0
                    log.warning("decode on %s failed: %s; %s", url, exc,
                                "retrying with the same handle" if keep else "re-prefilling")
                    if not keep:
                        handle = None
                        m.reprefills += 1
                elif exc.action is Action.REFETCH:  # integrity failure twice: the KV cannot be trusted
                    handle = None
                    m.reprefills += 1
                else:  # REPREFILL: the handle was consumed or expired
                    log.info("decode on %s: %s; re-prefilling", url, exc)
                    handle = None
                    m.reprefills += 1
            finally:
                with self._lock:
                    self._inflight[url] -= 1

    def _generate_colocated(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                            deadline: float) -> Iterator[list[int]]:
        url = self.cfg.colocated
        assert url is not None
        out: list[int] = []
        for attempt in range(2):  # retried once, only while no token was delivered
            try:
                body = {"prompt_ids": ids, "sampling": params.to_dict(), "request_id": f"{rid}-c{attempt}",
                        "stream": True}
                for ev in http_stream(url + "/generate", body, timeout=self.cfg.worker_timeout):
                    if "error" in ev:
                        raise _rebuild(ev)
                    new = [int(t) for t in ev.get("token_ids", ())]
                    if new:
                        out.extend(new)
                        yield new
                    if ev.get("done"):
                        t = ev.get("timings") or {}
                        m.queue_s, m.prefill_s = t.get("queue_s"), t.get("prefill_s")
                        raise _Done(ev.get("finish_reason") or "length")
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"request did not finish within {self.cfg.request_timeout:.0f}s")
            except KVBridgeError as exc:
                if out or attempt == 1 or exc.action is not Action.RETRY:
                    err = _with_context(exc, f"colocated worker {url} failed")
                    if exc.action is Action.RETRY:
                        err.status = 502  # type: ignore[attr-defined]
                    raise err
                m.retries += 1
                time.sleep(0.2)

    # -- HTTP ------------------------------------------------------------------------------
    def __call__(self, ctx: Ctx) -> None:
        route = {("POST", "/v1/completions"): self._completions, ("GET", "/health"): self._health,
                 ("GET", "/metrics"): self._metrics_prom, ("GET", "/metrics.json"): self._metrics_json,
                 ("GET", "/v1/models"): self._models}.get((ctx.method, ctx.path))
        if route is None:
            ctx.send_json(404, {"error": {"message": f"no route {ctx.method} {ctx.path}", "type": "NotFound",
                                          "code": 1, "action": "fix", "status": 404}})
            return
        route(ctx)

    def _parse(self, body: dict[str, Any]) -> tuple[list[int], SamplingParams, bool]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # OpenAI allows a batch of one
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.tok.vocab_size for t in ids):
                raise ConfigError(f"token ids must be in [0, {self.tok.vocab_size})")
        else:
            raise ConfigError("prompt must be a string or a non-empty list of token ids")
        if not ids:
            raise ConfigError("the prompt is empty")
        try:
            params = SamplingParams(
                max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 0.0)),
                top_k=int(body.get("top_k", 0)), top_p=float(body.get("top_p", 1.0)),
                seed=None if body.get("seed") is None else int(body["seed"]),
                ignore_eos=bool(body.get("ignore_eos", False)),
                stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids", ()) or ()))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad sampling parameters: {exc}") from None
        return ids, params, bool(body.get("stream", False))

    def _completions(self, ctx: Ctx) -> None:
        arrival = time.time()
        try:
            body = ctx.json()
            if not isinstance(body, dict):
                raise ConfigError("the request body must be a JSON object")
            ids, params, stream = self._parse(body)
        except KVBridgeError as exc:
            ctx.send_error(exc, 400)
            return
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        m = RequestMetrics(rid, self.cfg.mode, prompt_tokens=len(ids), arrival=arrival)
        deadline = time.monotonic() + self.cfg.request_timeout
        with self._lock:
            self.metrics.in_flight += 1
        gen = self._generate(ids, params, rid, m, deadline)
        out: list[int] = []
        emitted = ""
        reason: Optional[str] = None
        created = int(arrival)
        try:
            if stream:
                ctx.start_stream()
            try:
                for new in gen:
                    now = time.time()
                    out.extend(new)
                    if stream:
                        text = self.tok.decode(out)
                        delta = ""
                        if not text.endswith("\ufffd") and text.startswith(emitted):
                            delta, emitted = text[len(emitted):], text
                        ctx.event(self._chunk(rid, created, delta, new, None))
                    if m.first_token_at is None:
                        m.first_token_at = time.time() if stream else now
                    m.token_times.extend([now] * len(new))
            except _Done as d:
                reason = str(d.args[0]) if d.args else None
            m.finished_at = time.time()
            m.output_tokens, m.finish_reason = len(out), reason
            if stream:
                text = self.tok.decode(out)
                ctx.event(self._chunk(rid, created, text[len(emitted):] if text.startswith(emitted) else "",
                                      [], reason))
                ctx.event(b"[DONE]")
                ctx.end_stream()
            else:
                ctx.send_json(200, {
                    "id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_name,
                    "choices": [{"index": 0, "text": self.tok.decode(out), "token_ids": out,
                                 "finish_reason": reason, "logprobs": None}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                              "total_tokens": len(ids) + len(out)},
                    "metrics": {k: v for k, v in m.to_dict().items()
                                if k in ("ttft", "tpot", "e2e", "queue_s", "prefill_s", "kv_transfer_s", "kv_bytes",
                                         "retries", "reprefills")}})
        except ClientGone:
            m.ok, m.error, m.finished_at = False, "ClientGone: the client disconnected", time.time()
        except KVBridgeError as exc:
            status = int(getattr(exc, "status", 0) or (502 if exc.action is not Action.FIX else 500))
            m.ok, m.error, m.finished_at = False, f"{type(exc).__name__}: {exc}", time.time()
            m.output_tokens = len(out)
            log.warning("request %s failed: %s", rid, exc)
            try:
                if ctx.responded:  # mid-stream: the error is the last event
                    ctx.event(error_body(exc, status))
                    ctx.event(b"[DONE]")
                    ctx.end_stream()
                else:
                    ctx.send_error(exc, status)
            except ClientGone:
                pass
        finally:
            gen.close()
            with self._lock:
                self.metrics.in_flight -= 1
            self.metrics.add(m)

    def _chunk(self, rid: str, created: int, text: str, ids: Sequence[int], reason: Optional[str]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_name,
                "choices": [{"index": 0, "text": text, "token_ids": list(ids), "finish_reason": reason,
                             "logprobs": None}]}

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's ``/health`` (``ok: False`` with the error for one that does not answer)."""
        out = []
        roles = [("colocated", self.cfg.colocated)] if self.cfg.colocated else \
            [("prefill", u) for u in self.cfg.prefill] + [("decode", u) for u in self.cfg.decode]
        for role, url in roles:
            assert url is not None
            try:
                h = dict(http_json("GET", url + "/health", timeout=2.0))
                h.update(url=url, ok=True)
            except KVBridgeError as exc:
                h = {"url": url, "role": role, "ok": False, "error": str(exc)}
            h["proxy_inflight"] = self._inflight.get(url, 0)
            out.append(h)
        return out

    def _health(self, ctx: Ctx) -> None:
        ws = self.workers()
        ok = all(w["ok"] for w in ws)
        ctx.send_json(200 if ok else 503, {"status": "ok" if ok else "degraded", "mode": self.cfg.mode,
                                           "in_flight": self.metrics.in_flight, "workers": ws})

    def _models(self, ctx: Ctx) -> None:
        ctx.send_json(200, {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model"}]})

    def summary(self) -> dict[str, Any]:
        s = summarize(self.metrics.records(), self.cfg.ttft_slo, self.cfg.tpot_slo)
        s.update(mode=self.cfg.mode, in_flight=self.metrics.in_flight, uptime_s=time.time() - self.started)
        return s

    def _metrics_prom(self, ctx: Ctx) -> None:
        s = self.summary()
        text = to_prometheus(s, labels={"mode": self.cfg.mode})
        text += (f"# HELP kvbridge_in_flight Requests in progress.\n# TYPE kvbridge_in_flight gauge\n"
                 f"kvbridge_in_flight{{mode=\"{self.cfg.mode}\"}} {s['in_flight']}\n")
        ctx.send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _metrics_json(self, ctx: Ctx) -> None:
        s = self.summary()
        if "1" in parse_qs(ctx.query).get("records", []):
            s["records"] = [r.to_dict() for r in self.metrics.records()]
        ctx.send(200, json.dumps(s).encode(), "application/json")

    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> JSONServer:
        self.http = JSONServer(self, host, port)
        return self.http

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
