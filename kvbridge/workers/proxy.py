"""The HTTP front door: an OpenAI-compatible API routed prefill -> decode (or to a colocated engine).

``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming with
``stream_options.include_usage`` too), ``GET /v1/models``; ``GET /health`` (workers by role
and index, without their internal URLs unless ``health_internal``), ``GET /metrics``
(Prometheus histograms) and ``GET /metrics.json`` (computed on a thread; ``?records=N`` adds
the latest N per-request records, ``1`` the latest 1000, at most ``proxy_status.MAX_RECORDS``). Request
validation and the error shape are in :mod:`kvbridge.workers.openai_api`; every refusal (bad
JSON, body over ``max_body_bytes``, unknown argument, prompt past the context length) is
answered before any worker is asked.

Disaggregated, the proxy asks a prefill worker (least-loaded, or round-robin) for the
prompt's KV handle and first token, picks a decode worker the same way and passes it the
handle; tokens stream back over ``httpcore`` (pooled connections, a timeout on every wait).
A decode worker that dies or times out is retried on another one with the same handle
(``on_decode_failure="retry"``) while the handle may still be live, else the request is
re-prefilled (prompt plus the tokens already delivered) and continues where it stopped;
``"reprefill"`` always re-prefills. A dead prefill worker is retried once (on the next
one), then the client gets HTTP 503 with ``action: "retry"``. Workers send SSE comments while
a request waits in their queue, so only a worker silent for ``worker_timeout`` counts as
failed. A client that disconnects (streaming or not) aborts its request, and a KV handle no
decode worker took is released on its prefill worker at once (``POST /release``). On shutdown, requests in
flight get a JSON error (503, or a last ``error`` event on a stream), never an empty reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Union

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import Action, KVBridgeError, PeerUnavailable, TransferTimeout, error_from_code
from .http import BodyError, HTTPServer, Overloaded, WorkerClient, bind_socket, read_json, wait_or_disconnect
from .metrics import MetricsLog, PromMetrics, RequestMetrics
from .openai_api import (APIError, ChatRequest, CompletionRequest, Job, chunk_response, clip, error_from_kvbridge,
                         error_json, parse_request, prompt_ids, render_chat, sampling_params, usage,
                         whole_response)
from .proxy_config import ProxyConfig
from .proxy_status import StatusRoutes
from .sampling import SamplingParams
from .server import sse
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Proxy", "ProxyConfig"]

log = logging.getLogger("kvbridge.proxy")

# A request body may take this many bytes per token of the model's context (plus the slack),
# enough for any prompt that fits (a JSON-escaped character is at most 12 bytes; a token id 7);
# larger bodies get 413 before they are read.
BODY_BYTES_PER_TOKEN = 128
BODY_SLACK = 64 << 10


def _rebuild(ev: dict[str, Any]) -> KVBridgeError:
    err = ev.get("error") or {}
    exc = error_from_code(int(err.get("code", 1)), str(err.get("message", "worker error")))
    exc.status = int(err.get("status") or 0)  # type: ignore[attr-defined]
    return exc


def _with_context(exc: KVBridgeError, context: str) -> KVBridgeError:
    new = type(exc)(f"{context}: {exc.message}")
    if hasattr(exc, "status"):
        new.status = exc.status  # type: ignore[attr-defined]
    return new


def _stamp(m: RequestMetrics, stamps: Optional[dict[str, float]]) -> None:
    """Record the proxy's receipt of the first token and the worker's stamps, after ``m.arrival``."""
    now = time.time()
    m.hops.update({k: float(v) - m.arrival for k, v in (stamps or {}).items()}, answered=now - m.arrival)


class _Done(Exception):
    """Internal: the generator finished with this finish reason."""


class ShuttingDown(PeerUnavailable):
    """The front door is stopping; the request may be sent again (to another instance)."""

    hint = "retry the request (this server is stopping)"


class Proxy(StatusRoutes):
    """Routes completions to workers and keeps per-request metrics."""

    def __init__(self, cfg: ProxyConfig, tokenizer: Optional[Tokenizer] = None) -> None:
        self.cfg = cfg
        self.tok: Tokenizer = tokenizer or ByteTokenizer()
        self.metrics = MetricsLog()
        self.prom = PromMetrics(cfg.mode, cfg.ttft_slo, cfg.tpot_slo)
        self._inflight: dict[str, int] = {u: 0 for u in cfg.decode + cfg.prefill}
        self._down_until: dict[str, float] = {}
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._max_len = cfg.max_model_len
        self.client: Optional[WorkerClient] = None
        self._stopping: Optional[asyncio.Event] = None
        self._waiting: set[asyncio.Task[Any]] = set()
        self._stop_cancelled: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._status_lock = asyncio.Lock()
        self._status_cache: Optional[tuple[float, bytes, Optional[list[bytes]]]] = None
        self._health_round: Optional[tuple[float, asyncio.Future[list[dict[str, Any]]]]] = None
        self.http: Optional[HTTPServer] = None
        self.started = time.time()

    # -- app -------------------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self._completions, methods=["POST"]),
                  Route("/v1/chat/completions", self._chat, methods=["POST"]),
                  Route("/v1/models", self._models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                  Route("/health", self._health, methods=["GET"]),
                  Route("/metrics", self._metrics_prom, methods=["GET"]),
                  Route("/metrics.json", self._metrics_json, methods=["GET"])]

        async def http_error(request: HTTPRequest, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            st = exc.status_code
            msg = (f"Invalid URL ({request.method} {request.url.path})" if st == 404 else
                   f"method {request.method} is not allowed on {request.url.path}" if st == 405 else str(exc.detail))
            self.prom.rejected.labels(self.cfg.mode, str(st)).inc()
            return JSONResponse(error_json(st, msg, code="not_found" if st == 404 else
                                           "method_not_allowed" if st == 405 else None),
                                status_code=st, headers=exc.headers)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.client = WorkerClient(timeout=self.cfg.worker_timeout, max_connections=self.cfg.worker_connections,
                                       pool_timeout=self.cfg.worker_pool_timeout)
            self._stopping = asyncio.Event()
            try:
                yield
            finally:
                await self.client.aclose()
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)

    def serve(self, host: str = "127.0.0.1", port: int = 8000, sock: Any = None) -> HTTPServer:
        """Serve on ``sock`` (already bound, as ``kvbridge up`` does) or on ``host:port``."""
        self.http = HTTPServer(self.app(), sock or bind_socket(host, port), name="proxy",
                               graceful=self.cfg.shutdown_grace, max_connections=self.cfg.max_connections)
        return self.http

    @property
    def in_flight(self) -> int:
        return self.metrics.in_flight

    def close(self) -> None:
        """Give every request in flight its error answer, then stop serving."""
        if self.http is None:
            return
        if self._stopping is not None:
            self.http.call_soon(self._begin_stop)
            deadline = time.monotonic() + self.cfg.shutdown_grace
            while self.metrics.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        self.http.close(timeout=self.cfg.shutdown_grace + 5)
        self.http = None

    # -- routing ---------------------------------------------------------------------------
    def _pick(self, role: str, exclude: set[str]) -> Optional[str]:
        urls = self.cfg.prefill if role == "prefill" else self.cfg.decode
        now = time.monotonic()
        cands = [u for u in urls if u not in exclude]
        up = [u for u in cands if self._down_until.get(u, 0.0) <= now] or cands
        if not up:
            return None
        start = next(self._rr[role])
        if self.cfg.routing == "round-robin":
            return up[start % len(up)]
        order = [up[(start + i) % len(up)] for i in range(len(up))]
        return min(order, key=lambda u: self._inflight.get(u, 0))

    def _mark_down(self, url: str, seconds: float = 5.0) -> None:
        self._down_until[url] = time.monotonic() + seconds
        last = self._health_round
        if last is not None and last[1].done():
            self._health_round = None          # the next /health asks the workers again

    @contextlib.contextmanager
    def _busy(self, url: str) -> Any:
        self._inflight[url] = self._inflight.get(url, 0) + 1
        try:
            yield
        finally:
            self._inflight[url] -= 1

    async def _body_limit(self) -> int:
        """``max_body_bytes``, lowered to what a prompt of the whole context can take (see
        :data:`BODY_BYTES_PER_TOKEN`): a larger body cannot be a request this model serves, and
        parsing it would stall the event loop for every request in flight."""
        try:
            max_len = await self._limits()
        except KVBridgeError:
            return self.cfg.max_body_bytes
        return min(self.cfg.max_body_bytes, BODY_SLACK + BODY_BYTES_PER_TOKEN * max_len)

    async def _limits(self) -> int:
        """The context length: from the config, or the first worker that answers ``/health``."""
        if self._max_len is None:
            assert self.client is not None
            lens = []
            for url in ([self.cfg.colocated] if self.cfg.colocated else self.cfg.prefill + self.cfg.decode):
                assert url is not None
                with contextlib.suppress(KVBridgeError):
                    lens.append(int((await self.client.get_json(url + "/health"))["max_model_len"]))
            if not lens:
                raise PeerUnavailable("no worker answers /health, so the model's context length is unknown",
                                      hint="retry once the workers are up")
            self._max_len = min(lens)
        return self._max_len

    # -- prefill ---------------------------------------------------------------------------
    async def _prefill(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                       force: bool) -> dict[str, Any]:
        """The prefill worker's answer (``"_url"``: which worker). Asked as a stream: a worker sends
        SSE comments while the prompt waits for its slot, so only a silent worker counts as failed."""
        assert self.client is not None
        last: Optional[KVBridgeError] = None
        tried: set[str] = set()
        for attempt in range(2):  # a dead prefill worker is retried once (on another one, if any)
            url = self._pick("prefill", tried) or self.cfg.prefill[0]
            tried.add(url)
            try:
                with self._busy(url):
                    m.hops.setdefault("prefill_sent", time.time() - m.arrival)
                    pr = await self._first_event(url + "/prefill", {
                        "prompt_ids": ids, "sampling": params.to_dict(), "force": force, "stream": True,
                        "request_id": f"{rid}-p{m.retries + m.reprefills}-{attempt}"})
                    pr["_url"] = url
                    if "answered" not in m.hops:
                        _stamp(m, pr["timings"].get("stamps"))
                    return pr
            except KVBridgeError as exc:
                last = exc
                if exc.action is not Action.RETRY or isinstance(exc, Overloaded):  # not the worker's fault
                    break
                self._mark_down(url)
                m.retries += 1
                log.warning("prefill on %s failed (%s); %s", url, exc, "retrying" if attempt == 0 else "giving up")
                await asyncio.sleep(0.2)
        assert last is not None
        raise _with_context(last, "prefill failed")

    async def _first_event(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        async with contextlib.aclosing(self.client.stream(url, body)) as events:
            async for ev in events:
                if "error" in ev:
                    raise _rebuild(ev)
                return dict(ev)
        raise PeerUnavailable(f"{url} ended its answer without an event")

    def _release(self, url: str, handle: dict[str, Any]) -> None:
        """End a handle nobody will fetch (the client left, or the request ended without it), in
        the background: its prefill blocks come back now rather than at its TTL."""
        async def release() -> None:
            assert self.client is not None
            try:
                await self.client.post_json(url + "/release", {"handle": handle}, timeout=5.0)
            except KVBridgeError as exc:
                log.info("releasing a handle on %s failed: %s (it ends at its TTL)", url, exc)
        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- generation ------------------------------------------------------------------------
    async def _generate(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                        deadline: float) -> AsyncGenerator[list[int], None]:
        """Yield new output tokens as they arrive; raise ``_Done(reason)`` at the end."""
        if self.cfg.colocated:
            async for new in self._generate_colocated(ids, params, rid, m, deadline):
                yield new
            return
        assert self.client is not None
        out: list[int] = []
        handle: Optional[dict[str, Any]] = None
        holder = ""              # the prefill worker that published ``handle``
        unclaimed = False        # ``handle`` is ours: no decode worker has fetched it yet
        failed: set[str] = set()
        attempts = 0
        try:
            while True:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"request did not finish within {self.cfg.request_timeout:.0f}s")
                if handle is None:
                    ctx_ids = ids + out[:-1] if out else ids
                    pr = await self._prefill(ctx_ids, params, rid, m, force=bool(out))
                    handle, holder, unclaimed = pr["handle"], str(pr["_url"]), pr["handle"] is not None
                    if m.queue_s is None:
                        m.queue_s = pr["timings"]["queue_s"]
                        m.prefill_s = pr["timings"]["prefill_s"]
                    if not out:
                        out.append(int(pr["first_token"]))
                        yield out[-1:]
                        if handle is None:
                            raise _Done(pr.get("finish_reason") or "stop")
                if len(out) >= params.max_tokens:
                    raise _Done("length")
                url = self._pick("decode", failed)
                if url is None:
                    raise PeerUnavailable(f"no decode worker left to try ({len(failed)} failed for this request)",
                                          hint="retry the request; the server's log names the workers that failed")
                attempts += 1
                got = 0
                try:
                    with self._busy(url):
                        body = {"handle": handle, "prompt_ids": ids, "output_ids": out,
                                "sampling": params.to_dict(), "request_id": f"{rid}-d{attempts}", "stream": True}
                        async with contextlib.aclosing(self.client.stream(url + "/generate", body)) as events:
                            async for ev in events:
                                unclaimed = False  # the stream started: the decode worker fetched the KV
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
                                    raise TransferTimeout(
                                        f"request did not finish within {self.cfg.request_timeout:.0f}s")
                except KVBridgeError as exc:
                    if attempts >= self.cfg.max_attempts or exc.action is Action.FIX or isinstance(exc, Overloaded):
                        raise _with_context(exc, f"decode on {url} failed (attempt {attempts})")
                    if exc.action is Action.RETRY:  # the worker died, hung or is unreachable
                        failed.add(url)
                        self._mark_down(url)
                        m.retries += 1
                        keep = self.cfg.on_decode_failure == "retry" and got == 0
                        log.warning("decode on %s failed: %s; %s", url, exc,
                                    "retrying with the same handle" if keep else "re-prefilling")
                        if not keep:
                            if unclaimed:
                                self._release(holder, handle)
                            handle, unclaimed = None, False
                            m.reprefills += 1
                    elif exc.action is Action.REFETCH:  # integrity failure twice: the KV cannot be trusted
                        handle, unclaimed = None, False
                        m.reprefills += 1
                    else:  # REPREFILL: the handle was consumed or expired
                        log.info("decode on %s: %s; re-prefilling", url, exc)
                        handle, unclaimed = None, False
                        m.reprefills += 1
        finally:  # the client left, the request failed, or it ended before a decode worker took the KV
            if handle is not None and unclaimed:
                self._release(holder, handle)

    async def _generate_colocated(self, ids: list[int], params: SamplingParams, rid: str, m: RequestMetrics,
                                  deadline: float) -> AsyncIterator[list[int]]:
        url = self.cfg.colocated
        assert url is not None and self.client is not None
        out: list[int] = []
        for attempt in range(2):  # retried once, only while no token was delivered
            try:
                body = {"prompt_ids": ids, "sampling": params.to_dict(), "request_id": f"{rid}-c{attempt}",
                        "stream": True}
                m.hops.setdefault("prefill_sent", time.time() - m.arrival)
                async with contextlib.aclosing(self.client.stream(url + "/generate", body)) as events:
                    async for ev in events:
                        if "error" in ev:
                            raise _rebuild(ev)
                        new = [int(t) for t in ev.get("token_ids", ())]
                        if "stamps" in ev and "answered" not in m.hops:
                            _stamp(m, ev["stamps"])
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
                if out or attempt == 1 or exc.action is not Action.RETRY or isinstance(exc, Overloaded):
                    raise _with_context(exc, f"colocated worker {url} failed")
                m.retries += 1
                await asyncio.sleep(0.2)

    async def _tokens(self, job: Job) -> AsyncIterator[list[int]]:
        """``_generate``, stopped with :class:`ShuttingDown` as soon as the proxy is closing, and
        with ``TransferTimeout`` at ``request_timeout`` whatever the workers are doing.

        While it waits for the next tokens a request is in ``_waiting``; closing cancels
        those waits (and only those: a request busy writing to its client checks the flag
        before it waits again), so every client gets the error answer.
        """
        assert self._stopping is not None
        deadline = time.monotonic() + self.cfg.request_timeout
        gen = self._generate(job.ids, job.params, job.rid, job.m, deadline)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._stopping.is_set():
                    raise ShuttingDown("the server is shutting down; send the request again")
                self._waiting.add(task)
                try:  # the deadline holds also while a worker only says the request waits in its queue
                    async with asyncio.timeout_at(loop.time() + deadline - time.monotonic()):
                        new = await gen.__anext__()
                except TimeoutError:
                    raise TransferTimeout(f"request did not finish within {self.cfg.request_timeout:.0f}s") from None
                except StopAsyncIteration:
                    return
                except _Done as d:
                    job.reason = str(d.args[0]) if d.args else None
                    return
                except asyncio.CancelledError:
                    if task not in self._stop_cancelled:
                        raise
                    if hasattr(task, "uncancel"):
                        task.uncancel()
                    raise ShuttingDown("the server is shutting down; send the request again") from None
                finally:
                    self._waiting.discard(task)
                now = time.time()
                job.out.extend(new)
                if job.m.first_token_at is None:
                    job.m.first_token_at = now
                job.m.last_token_at = now
                yield new
        finally:
            with contextlib.suppress(BaseException):
                await gen.aclose()

    def _begin_stop(self) -> None:
        """On the event loop: refuse new work and interrupt every request waiting for tokens."""
        assert self._stopping is not None
        self._stopping.set()
        for task in list(self._waiting):
            self._stop_cancelled.add(task)
            task.cancel()

    # -- HTTP: completions and chat ----------------------------------------------------------
    async def _completions(self, request: HTTPRequest) -> Response:
        return await self._serve_request(request, "completion")

    async def _chat(self, request: HTTPRequest) -> Response:
        return await self._serve_request(request, "chat")

    def _refuse(self, exc: APIError) -> Response:
        self.prom.rejected.labels(self.cfg.mode, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _serve_request(self, request: HTTPRequest, kind: str) -> Response:
        arrival = time.time()
        try:
            try:
                body = await read_json(request, await self._body_limit())
            except BodyError as exc:
                raise APIError(exc.status, exc.message, None, exc.code) from None
            req: Union[CompletionRequest, ChatRequest] = parse_request(
                CompletionRequest if kind == "completion" else ChatRequest, body)
            if req.model is not None and req.model != self.cfg.model_name:
                raise APIError(404, f"The model `{clip(req.model)}` does not exist; this server serves "
                                    f"`{self.cfg.model_name}` (GET /v1/models)", "model", "model_not_found")
            ids = prompt_ids(req, self.tok) if isinstance(req, CompletionRequest) else render_chat(req, self.tok)
            max_len = await self._limits()
            params = sampling_params(req, len(ids), max_len, 16 if kind == "completion" else self.cfg.chat_max_tokens,
                                     self.tok.vocab_size)
            parsed = time.time() - arrival
        except APIError as exc:
            return self._refuse(exc)
        except KVBridgeError as exc:
            return self._refuse(error_from_kvbridge(exc))
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
        opts = req.stream_options
        job = Job(rid, kind, ids, params, bool(req.stream), bool(opts and opts.include_usage),
                   RequestMetrics(rid, self.cfg.mode, prompt_tokens=len(ids), arrival=arrival,
                                  hops={"parsed": parsed}), int(arrival),
                  usage_every=bool(opts and opts.include_usage and opts.continuous_usage_stats))
        self.metrics.in_flight += 1
        self.prom.in_flight.labels(self.cfg.mode).inc()
        if job.stream:
            return StreamingResponse(self._stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        task = asyncio.ensure_future(self._drain(job))
        try:
            if not await wait_or_disconnect(request, task):  # the client left: its request is aborted
                self._finish(job, asyncio.CancelledError())
                return Response(status_code=499)
            task.result()
            self._finish(job, None)
        except KVBridgeError as exc:
            err = self._finish(job, exc)
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as exc:  # a bug: logged, and a JSON error without its text
            err = self._finish(job, exc)
            return JSONResponse(err.body(), status_code=err.status)
        except BaseException as exc:
            if job.m.finished_at is None:
                self._finish(job, exc)
            raise
        return JSONResponse(whole_response(job, self.tok.decode(job.out), self.cfg.model_name),
                            headers={"X-Request-Id": rid})

    async def _drain(self, job: Job) -> None:
        async for _ in self._tokens(job):
            pass

    def _finish(self, job: Job, exc: Optional[BaseException]) -> APIError:
        """Record the request's outcome once; the error answer for ``exc``."""
        m = job.m
        m.finished_at = time.time()
        m.output_tokens, m.finish_reason = len(job.out), job.reason
        err = APIError(500, "ok")
        if isinstance(exc, KVBridgeError):
            err = error_from_kvbridge(exc)
            m.ok, m.error = False, f"{type(exc).__name__}: {exc}"
            log.warning("request %s failed: %s", job.rid, exc)
        elif isinstance(exc, asyncio.CancelledError):
            m.ok, m.error = False, "ClientGone: the client disconnected"
        elif exc is not None:
            m.ok, m.error = False, f"{type(exc).__name__}: {exc}"
            log.error("request %s failed", job.rid, exc_info=exc)
            err = APIError(500, f"internal error; the server's log has the details (request {job.rid})", None,
                           "internal_error")
        self.metrics.in_flight -= 1
        self.prom.in_flight.labels(self.cfg.mode).dec()
        self.metrics.add(m)
        self.prom.observe(m)
        return err

    async def _stream(self, job: Job) -> AsyncIterator[bytes]:
        emitted = ""
        first = True
        try:
            async for new in self._tokens(job):
                text = self.tok.decode(job.out)
                delta = ""
                if not text.endswith("\ufffd") and text.startswith(emitted):
                    delta, emitted = text[len(emitted):], text
                yield sse(chunk_response(job, self.cfg.model_name, delta, new, None, first))
                if first:
                    job.m.hops["first_sent"] = time.time() - job.m.arrival
                first = False
            text = self.tok.decode(job.out)
            rest = text[len(emitted):] if text.startswith(emitted) else ""
            tail = sse(chunk_response(job, self.cfg.model_name, rest, [], job.reason, first))
            if job.usage:
                last = chunk_response(job, self.cfg.model_name, None, [], None)
                tail += sse({**last, "choices": [], "usage": usage(job)})
            self._finish(job, None)
            yield tail + sse(b"[DONE]")
        except KVBridgeError as exc:  # mid-stream: the error is the last event
            err = self._finish(job, exc)
            yield sse(err.body()) + sse(b"[DONE]")
        except Exception as exc:  # a bug: logged, and an error event without its text
            err = self._finish(job, exc)
            yield sse(err.body()) + sse(b"[DONE]")
        except BaseException as exc:  # the client went away (cancelled) or a bug
            if job.m.finished_at is None:
                self._finish(job, exc)
            raise
