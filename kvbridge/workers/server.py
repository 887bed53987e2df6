"""Shared plumbing of the worker processes: :class:`EngineLoop` (the thread that steps a
:class:`Scheduler`), the watches that carry a request's progress to a waiting thread or
event loop, and :class:`EngineWorker` (a model, its pool and a Starlette app).

Worker routes are ``async``: a request waits on the event loop for its tokens (the engine
thread wakes it with ``call_soon_threadsafe``), never on a thread of its own. Errors
travel as ``{"error": {"message", "type", "code", "action", "status"}}`` (see
:mod:`kvbridge.workers.http`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import Action, ConfigError, KVBridgeError, TransferTimeout
from ..pool import KVPool
from .engine import Engine, Request, RequestState, Scheduler
from .http import BodyError, HTTPServer, bind_socket, error_body, read_json, wait_or_disconnect, worker_body_limit
from .model import PRESETS, CausalLM, load_hf_checkpoint
from .signals import StopSignals
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["EngineLoop", "RequestWatch", "AsyncWatch", "WorkerConfig", "EngineWorker", "load_model", "status_for",
           "run_until_signal", "freeze_heap", "die_with_parent", "sse", "wall_stamps", "RECEIVED"]

log = logging.getLogger("kvbridge.workers")


RECEIVED = "kvbridge.received"  # ASGI scope key: perf_counter() when the worker's handler started


def wall_stamps(**perf: Optional[float]) -> dict[str, float]:
    """``perf_counter()`` instants of this process as ``time.time()`` values, which the proxy
    can compare with its own (same machine) or at least subtract from each other."""
    off = time.time() - time.perf_counter()
    return {k: v + off for k, v in perf.items() if v is not None}


def sse(obj: Any) -> bytes:
    """One server-sent event ``data: <json>`` (``obj`` may be pre-encoded bytes)."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


# -- the engine thread -------------------------------------------------------------------------

Listener = Callable[[Request, Optional[BaseException]], None]


@dataclass
class _Watch:
    req: Request
    listener: Listener
    admitted_at: Optional[float] = None


@dataclass
class RequestWatch:
    """A listener that lets another thread wait for a request's new tokens or its end."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    error: Optional[BaseException] = None
    done: bool = False
    admitted_at: Optional[float] = None  # scheduler clock: when the request got its engine slot

    def __call__(self, req: Request, error: Optional[BaseException] = None) -> None:
        with self.cond:
            self.error = self.error or error
            self.done = self.done or req.finished or error is not None
            self.cond.notify_all()

    def wait(self, req: Request, have: int, timeout: float) -> bool:
        """Wait until ``req`` has more than ``have`` tokens or ended; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.done or len(req.output_ids) > have, timeout=timeout)


class AsyncWatch:
    """A listener that wakes an asyncio task when its request gets new tokens or ends.

    The engine thread calls it; it only records the outcome and schedules the wake-up on
    the task's loop, so waiting costs no thread. A wait is one future (and one timer for
    its timeout): no task is created per token.
    """

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._waiter: Optional[asyncio.Future[None]] = None
        self.error: Optional[BaseException] = None
        self.done = False
        self.admitted_at: Optional[float] = None

    def __call__(self, req: Request, error: Optional[BaseException] = None) -> None:
        self.error = self.error or error
        self.done = self.done or req.finished or error is not None
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, req: Request, have: int, timeout: float) -> bool:
        """Wait until ``req`` has more than ``have`` tokens or ended; False on timeout."""
        deadline = time.monotonic() + timeout
        while not (self.done or len(req.output_ids) > have):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._waiter = w = self.loop.create_future()
            timer = self.loop.call_later(left, self._wake)
            try:
                await w  # a wake-up after the check above is not lost: it finds this future
            finally:
                timer.cancel()
                self._waiter = None
        return True


class EngineLoop:
    """Steps ``scheduler`` on its own thread while it has work; tells listeners of progress.

    ``admitted_at(rid)`` is when a queued request got its slot (the start of the step that
    admitted it), so queueing time = admitted_at - arrival_time (scheduler clock).
    """

    def __init__(self, scheduler: Scheduler, name: str = "engine", step_delay: float = 0.0) -> None:
        self.scheduler = scheduler
        self.step_delay = step_delay
        self._cond = threading.Condition()
        self._watch: dict[str, _Watch] = {}
        self._stop = False
        self.step_lock = threading.Lock()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _register(self, req: Request, listener: Listener) -> None:
        """Watch ``req``; a request id already in use here is refused (``ConfigError``): the second
        request would take over the first's watch (which then waited for its timeout) and an
        abort of either would end the other."""
        with self._cond:
            if req.request_id in self._watch:
                raise ConfigError(f"request_id {req.request_id[:80]!r} is already in use on this worker")
            self._watch[req.request_id] = _Watch(req, listener)

    def submit(self, req: Request, listener: Listener) -> Request:
        """Queue ``req`` for prefill (and decode)."""
        self._register(req, listener)
        try:
            self.scheduler.add_request(req)
        except BaseException:
            self._forget(req.request_id)
            raise
        with self._cond:
            self._cond.notify_all()
        return req

    def submit_prefilled(self, req: Request, block_ids: list[int], num_tokens: int, output_ids: list[int],
                         listener: Listener) -> Request:
        """Continue ``req`` from KV already in ``block_ids``; ``output_ids`` were produced elsewhere
        (the last one is fed next; KV covers the prompt plus all but the last)."""
        self._register(req, listener)
        with self.step_lock:  # no step runs between add_prefilled and restoring earlier outputs
            try:
                self.scheduler.add_prefilled(req, block_ids, num_tokens, output_ids[-1])
            except BaseException:
                self._forget(req.request_id)
                raise
            if len(output_ids) > 1:
                t = req.token_times[0]
                req.output_ids[:] = [int(x) for x in output_ids]
                req.token_times[:] = [t] * len(output_ids)
        if req.finished:
            self._forget(req.request_id)
            listener(req, None)
        with self._cond:
            self._cond.notify_all()
        return req

    def watching(self, request_id: str) -> bool:
        """Whether a request under ``request_id`` is queued or running here."""
        with self._cond:
            return request_id in self._watch

    def admitted_at(self, request_id: str) -> Optional[float]:
        w = self._watch.get(request_id)
        return None if w is None else w.admitted_at

    def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self.scheduler.abort(request_id)

    def _forget(self, request_id: str) -> Optional[_Watch]:
        with self._cond:
            return self._watch.pop(request_id, None)

    @property
    def load(self) -> dict[str, int]:
        s = self.scheduler
        return {"waiting": len(s.waiting), "ready": len(s.ready), "running": len(s.running),
                "watched": len(self._watch)}

    def _run(self) -> None:
        s = self.scheduler
        while True:
            with self._cond:
                while not self._stop and not s.has_work:
                    self._cond.wait(timeout=0.5)
                if self._stop:
                    return
            t0 = s.clock()
            try:
                with self.step_lock:
                    touched = s.step()
            except Exception as exc:  # a bug or an exhausted pool: fail every watched request
                log.exception("engine step failed")
                with self._cond:
                    watches = list(self._watch.values())
                    self._watch.clear()
                for w in watches:
                    s.abort(w.req.request_id)
                    w.listener(w.req, exc)
                continue
            self.steps += 1
            with self._cond:
                fresh = [w for w in self._watch.values()
                         if w.admitted_at is None and w.req.state is not RequestState.WAITING]
            for w in fresh:
                w.admitted_at = max(t0, w.req.arrival_time or t0)
                if hasattr(w.listener, "admitted_at"):
                    w.listener.admitted_at = w.admitted_at
            for r in touched:
                tw = self._watch.get(r.request_id)
                if tw is None:
                    continue
                if r.finished:
                    self._forget(r.request_id)
                tw.listener(r, r.error)  # error: the scheduler aborted this request alone
            if not touched and not s.running:
                time.sleep(0.002)  # queued work waits for blocks held outside the scheduler
            if self.step_delay:
                time.sleep(self.step_delay)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


# -- worker runtime ----------------------------------------------------------------------------

def status_for(exc: BaseException) -> int:
    """HTTP status of an error: 503 retry, 410 KV gone (re-prefill), 502 refetch, 400 bad input."""
    if not isinstance(exc, KVBridgeError):
        return 500
    return {Action.RETRY: 503, Action.REPREFILL: 410, Action.REFETCH: 502}.get(exc.action, 400)


def load_model(spec: str, seed: int = 0) -> tuple[CausalLM, Tokenizer]:
    """A preset name (seeded random weights) or a local HF checkpoint directory, with its tokenizer."""
    if spec in PRESETS:
        return CausalLM.from_seed(spec, seed=seed), ByteTokenizer()
    if os.path.isdir(spec):
        return load_hf_checkpoint(spec), load_tokenizer(spec)
    raise ConfigError(f"--model {spec!r} is neither a preset {sorted(PRESETS)} nor a checkpoint directory")


@dataclass
class WorkerConfig:
    """Engine settings shared by the prefill, decode and colocated workers."""

    model: str = "small"
    seed: int = 0
    num_blocks: int = 2048
    block_size: int = 16
    chunk_size: int = 256
    max_num_seqs: int = 64
    request_timeout: float = 300.0   # a request that has not finished by then is aborted
    step_delay: float = 0.0          # seconds slept after each engine step (fault drills)
    keepalive: float = 5.0           # a stream silent this long (request queued) gets an SSE comment
    max_connections: Optional[int] = None  # HTTP connections open at once (None: http.default_max_connections)


Handler = Callable[[HTTPRequest], Awaitable[Response]]


def _error_response(exc: BaseException, status: int) -> JSONResponse:
    return JSONResponse(error_body(exc, status), status_code=status)


class EngineWorker:
    """A model, its pool, a :class:`Scheduler` stepped by an :class:`EngineLoop`, and HTTP routes.

    Subclasses add routes to ``self.routes`` (``(method, path) -> async handler``).
    """

    role = "worker"

    def __init__(self, cfg: WorkerConfig, model: Optional[CausalLM] = None, shared_pool: bool = False) -> None:
        self.cfg = cfg
        self.model = model if model is not None else load_model(cfg.model, cfg.seed)[0]
        self.pool = KVPool.allocate(self.model.kv_layout(cfg.block_size), cfg.num_blocks, shared=shared_pool)
        self.engine = Engine(self.model, self.pool)
        self.scheduler = Scheduler(self.engine, chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs)
        self.loop = EngineLoop(self.scheduler, name=f"{self.role}-engine", step_delay=cfg.step_delay)
        self.http: Optional[HTTPServer] = None
        self.requests = 0
        self.routes: dict[tuple[str, str], Handler] = {("GET", "/health"): self._http_health}

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one request may hold: the model's positions, capped by the pool."""
        return min(int(self.model.config.max_position_embeddings), self.pool.num_blocks * self.cfg.block_size)

    @property
    def max_body_bytes(self) -> int:
        """The largest request body this worker reads (:func:`~kvbridge.workers.http.worker_body_limit`
        of its context, block size and vocabulary): a larger one is refused 413 before it is read."""
        return worker_body_limit(self.max_model_len, self.cfg.block_size, int(self.model.config.vocab_size))

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "role": self.role, "pid": os.getpid(), "model": self.cfg.model,
                "max_model_len": self.max_model_len, "vocab_size": int(self.model.config.vocab_size),
                "chunk_size": self.cfg.chunk_size, "threads": torch.get_num_threads(), "requests": self.requests,
                "load": self.loop.load, "pool": {"num_blocks": self.pool.num_blocks, "free": self.pool.num_free}}

    async def _http_health(self, request: HTTPRequest) -> Response:
        return JSONResponse(self.health())

    # -- input checks (before anything is allocated) ----------------------------------------
    @staticmethod
    def id_list(ids: Any, name: str) -> list[Any]:
        """``ids`` as a non-empty list, or a ``ConfigError`` (400); its entries are not looked at:
        check the request's length (:meth:`check_length`) first, then :meth:`check_ids`."""
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{name} must be a non-empty list of token ids")
        return ids

    def check_ids(self, ids: Any, name: str) -> list[int]:
        """``ids`` as a non-empty list of token ids in ``[0, vocab_size)``, or a ``ConfigError`` (400).
        It looks at every id: a request's length is checked before, at no cost."""
        checked = self.id_list(ids, name)
        vocab = int(self.model.config.vocab_size)
        for t in checked:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ConfigError(f"{name}: {t!r} is not a token id in the vocabulary [0, {vocab})")
        return checked

    def check_length(self, num_tokens: int, what: str) -> None:
        """Refuse (400) a request that needs more than ``max_model_len`` tokens of context."""
        if num_tokens > self.max_model_len:
            raise ConfigError(f"{what} needs {num_tokens} tokens of context; this worker's max_model_len is "
                              f"{self.max_model_len}")

    # -- HTTP ------------------------------------------------------------------------------
    def app(self) -> Starlette:
        """The worker's ASGI app: every route answers JSON, errors included."""
        by_path: dict[str, dict[str, Handler]] = {}
        for (method, path), fn in self.routes.items():
            by_path.setdefault(path, {})[method] = fn
        routes = [Route(path, self._guard(fns), methods=list(fns)) for path, fns in by_path.items()]

        async def http_error(request: HTTPRequest, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            return JSONResponse({"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                                           "type": "HTTPError", "code": 1, "action": "fix",
                                           "status": exc.status_code}}, status_code=exc.status_code)
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error})

    def _guard(self, fns: dict[str, Handler]) -> Handler:
        async def endpoint(request: HTTPRequest) -> Response:
            request.scope[RECEIVED] = time.perf_counter()
            if request.method == "POST":
                self.requests += 1
            try:
                return await fns[request.method](request)
            except BodyError as exc:
                return _error_response(ConfigError(exc.message), exc.status)
            except KVBridgeError as exc:
                return _error_response(exc, status_for(exc))
            except (ValueError, TypeError, KeyError) as exc:
                return _error_response(ConfigError(f"bad request: {exc}"), 400)
            except Exception as exc:  # a bug: logged here, a JSON error (without its text) for the caller
                log.exception("%s %s failed", request.method, request.url.path)
                return _error_response(exc, 500)
        return endpoint

    async def body(self, request: HTTPRequest) -> dict[str, Any]:
        body = await read_json(request, self.max_body_bytes)
        if not isinstance(body, dict):
            raise ConfigError("the request body must be a JSON object")
        return body

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
        self.http = HTTPServer(self.app(), bind_socket(host, port), name=self.role,
                               max_connections=self.cfg.max_connections)
        return self.http

    # -- waiting ---------------------------------------------------------------------------
    def wait_done(self, req: Request, watch: RequestWatch, timeout: float) -> None:
        """Block until ``req`` finished; abort it and raise ``TransferTimeout`` after ``timeout``."""
        with watch.cond:
            ok = watch.cond.wait_for(lambda: watch.done, timeout=timeout)
        if not ok:
            self.loop.abort(req.request_id)
            raise TransferTimeout(f"request {req.request_id} did not finish within {timeout:.0f}s")
        if watch.error is not None:
            raise watch.error

    async def await_done(self, req: Request, watch: AsyncWatch, timeout: float) -> None:
        """Awaitable :meth:`wait_done`; a cancelled wait aborts the request too."""
        deadline = time.monotonic() + timeout
        try:
            while not watch.done:
                left = deadline - time.monotonic()
                if left <= 0 or not await watch.wait(req, len(req.output_ids), left):
                    self.loop.abort(req.request_id)
                    raise TransferTimeout(f"request {req.request_id} did not finish within {timeout:.0f}s")
        except asyncio.CancelledError:
            self.loop.abort(req.request_id)
            raise
        if watch.error is not None:
            raise watch.error

    async def respond(self, req: Request, watch: AsyncWatch, sent: int, stream: bool,
                      timings: Callable[[], dict[str, Any]], received: Optional[float] = None,
                      request: Optional[HTTPRequest] = None) -> Response:
        """Answer with ``req``'s tokens after the first ``sent`` ones: SSE events, or one JSON at the end.

        A stream's event with the request's first token carries ``stamps`` (see :func:`wall_stamps`);
        a stream with nothing to say for ``keepalive`` seconds (the request waits for a slot) sends
        an SSE comment, so the proxy does not take a queued request for a dead worker. Without a
        stream, a client that disconnects (``request`` given) aborts the request.
        """
        if stream:
            return StreamingResponse(self._events(req, watch, sent, timings, received),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        task = asyncio.ensure_future(self.await_done(req, watch, self.cfg.request_timeout))
        if request is not None and not await wait_or_disconnect(request, task):
            return JSONResponse(error_body(ConfigError("the client disconnected"), 499), status_code=499)
        await task
        out = req.output_ids[:]
        return JSONResponse({"request_id": req.request_id, "token_ids": out[sent:],
                             "finish_reason": req.finish_reason.value if req.finish_reason else None,
                             "num_output": len(out), "timings": timings()})

    async def _events(self, req: Request, watch: AsyncWatch, sent: int,
                      timings: Callable[[], dict[str, Any]], received: Optional[float]) -> AsyncIterator[bytes]:
        deadline = time.monotonic() + self.cfg.request_timeout
        quiet_since = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now - quiet_since >= self.cfg.keepalive:
                    quiet_since = now
                    yield b": queued\n\n"
                left = deadline - now
                if left <= 0:
                    self.loop.abort(req.request_id)
                    err = TransferTimeout(f"request {req.request_id} did not finish within "
                                          f"{self.cfg.request_timeout:.0f}s")
                    yield sse(error_body(err, 504)) + sse(b"[DONE]")
                    return
                await watch.wait(req, sent, min(left, 1.0, self.cfg.keepalive))
                out = req.output_ids[:]
                chunk = b""
                if len(out) > sent:
                    ev: dict[str, Any] = {"token_ids": out[sent:], "index": sent}
                    if sent == 0:
                        ev["stamps"] = wall_stamps(w_received=received, w_submitted=req.arrival_time,
                                                   w_first_token=req.first_token_time,
                                                   w_answered=time.perf_counter())
                    chunk = sse(ev)
                    sent = len(out)
                if watch.error is not None:
                    yield chunk + sse(error_body(watch.error, status_for(watch.error))) + sse(b"[DONE]")
                    return
                if req.finished and len(out) == len(req.output_ids):
                    yield chunk + sse({"done": True,
                                       "finish_reason": req.finish_reason.value if req.finish_reason else None,
                                       "num_output": len(out), "timings": timings()}) + sse(b"[DONE]")
                    return
                if chunk:
                    quiet_since = time.monotonic()
                    yield chunk
        finally:
            if not req.finished:  # the client went away (or the server stops): free the slot
                self.loop.abort(req.request_id)

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        self.loop.close()


def freeze_heap() -> int:
    """Once a serving process has started (model, torch, web stack loaded): collect, then move
    every object alive now out of the collector's reach (``gc.freeze``), as vLLM does. With
    torch loaded a full collection walks ~200k start-up objects -- 70-90 ms here, a stall of
    every request in flight -- and only objects made afterwards are walked from then on.
    Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_until_signal(worker: Any, host: str, port: int, parent_pid: Optional[int] = None,
                     advertise: Optional[str] = None) -> int:
    """Serve ``worker`` until SIGINT/SIGTERM (or the parent process dies); print one ready line
    (after :func:`freeze_heap`) whose URL names ``advertise`` when given, else the bound address."""
    stop = StopSignals()
    try:
        server = worker.serve(host, port)
    except BaseException:
        worker.close()
        raise
    freeze_heap()
    url = server.url
    if advertise:
        url = f"http://{f'[{advertise}]' if ':' in advertise else advertise}:{server.port}"
    print(json.dumps({"event": "ready", "role": worker.role, "url": url, "pid": os.getpid()}), flush=True)
    while not stop.wait(0.5):
        if parent_pid is not None and os.getppid() != parent_pid:
            log.warning("parent %d is gone; exiting", parent_pid)
            break
    worker.close()
    return 0


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGTERM this process when its parent dies (``preexec_fn``)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
