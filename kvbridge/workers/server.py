"""Shared plumbing of the worker processes: a small JSON/SSE HTTP server and client
(stdlib only), and :class:`EngineLoop`, the thread that steps a :class:`Scheduler`.

HTTP carries control messages only (prompts, handles, tokens); KV bytes move through
kvbridge transports. Every client call has a socket timeout, so no wait is unbounded.
Errors travel as ``{"error": {"message", "type", "code", "action"}}`` and are rebuilt
on the client side as the matching :mod:`kvbridge.errors` class.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

import torch

from ..errors import (Action, ConfigError, ConnectionLost, KVBridgeError, PeerUnavailable, TransferTimeout,
                      error_from_code)
from ..pool import KVPool
from .engine import Engine, Request, RequestState, Scheduler
from .model import PRESETS, CausalLM, load_hf_checkpoint
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["Ctx", "JSONServer", "ClientGone", "error_body", "http_json", "http_stream", "EngineLoop",
           "RequestWatch", "WorkerConfig", "EngineWorker", "load_model", "status_for", "run_until_signal",
           "die_with_parent"]

log = logging.getLogger("kvbridge.workers")
MAX_BODY = 64 << 20


class ClientGone(Exception):
    """The HTTP client closed the connection while we were writing to it."""


def error_body(exc: BaseException, status: int = 500) -> dict[str, Any]:
    """The JSON error object for ``exc`` (kvbridge errors keep their code and action)."""
    if isinstance(exc, KVBridgeError):
        return {"error": {"message": str(exc), "type": type(exc).__name__, "code": exc.code,
                          "action": exc.action.value, "status": status}}
    return {"error": {"message": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__, "code": 1,
                      "action": Action.FIX.value, "status": status}}


class Ctx:
    """One HTTP request: parsed JSON body, and ways to answer (JSON, or a chunked SSE stream)."""

    def __init__(self, h: BaseHTTPRequestHandler, method: str) -> None:
        self._h = h
        self.method = method
        u = urlsplit(h.path)
        self.path = u.path.rstrip("/") or "/"
        self.query = u.query
        self._streaming = False
        self.responded = False

    def json(self) -> Any:
        n = int(self._h.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ConfigError(f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        raw = self._h.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError as exc:
            raise ConfigError(f"request body is not JSON: {exc}") from None

    def send(self, status: int, body: bytes, ctype: str) -> None:
        h = self._h
        try:
            h.send_response(status)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            h.wfile.flush()
        except OSError as exc:
            raise ClientGone(str(exc)) from None
        finally:
            self.responded = True

    def send_json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode(), "application/json")

    def send_error(self, exc: BaseException, status: int = 500) -> None:
        self.send_json(status, error_body(exc, status))

    def start_stream(self, status: int = 200) -> None:
        """Begin a chunked ``text/event-stream`` response."""
        h = self._h
        try:
            h.send_response(status)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.flush()
        except OSError as exc:
            raise ClientGone(str(exc)) from None
        self._streaming = True
        self.responded = True

    def _chunk(self, data: bytes) -> None:
        try:
            self._h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self._h.wfile.flush()
        except OSError as exc:
            raise ClientGone(str(exc)) from None

    def event(self, obj: Any) -> None:
        """One SSE event ``data: <json>``."""
        self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def end_stream(self) -> None:
        if self._streaming:
            self._chunk(b"")
            self._streaming = False


class JSONServer:
    """A ``ThreadingHTTPServer`` on a background thread that hands every request to ``app(ctx)``."""

    def __init__(self, app: Callable[[Ctx], None], host: str = "127.0.0.1", port: int = 0) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("%s " + fmt, self.address_string(), *args)

            def _dispatch(self, method: str) -> None:
                ctx = Ctx(self, method)
                try:
                    app(ctx)
                except ClientGone:
                    self.close_connection = True
                except Exception as exc:  # an answer, never a dropped connection
                    status = 400 if isinstance(exc, ConfigError) else 500
                    if not isinstance(exc, KVBridgeError):
                        log.exception("handler error on %s %s", method, ctx.path)
                    if not ctx.responded:
                        try:
                            ctx.send_error(exc, status)
                        except ClientGone:
                            pass
                    self.close_connection = True

            def do_GET(self) -> None:
                self._dispatch("GET")

            def do_POST(self) -> None:
                self._dispatch("POST")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"http-{self.port}", daemon=True)
        self._thread.start()
        outer.url = f"http://{host}:{self.port}"

    url: str

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


# -- client ----------------------------------------------------------------------------------

def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ConfigError(f"worker URL must be http://host:port, got {url!r}")
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), (u.path or "/")


def _raise_for(status: int, data: bytes, url: str) -> None:
    try:
        err = json.loads(data)["error"]
        exc = error_from_code(int(err.get("code", 1)), str(err.get("message", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        exc = PeerUnavailable(f"{url} answered HTTP {status}: {data[:200]!r}")
    exc.status = status  # type: ignore[attr-defined]
    raise exc


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    """One JSON request; a non-2xx answer raises its kvbridge error, a dead peer ``PeerUnavailable``."""
    conn, _ = _conn(url, timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, urlsplit(url).path or "/", body=payload, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    except socket.timeout:
        raise TransferTimeout(f"{method} {url} took longer than {timeout}s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise PeerUnavailable(f"{method} {url} failed: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    if resp.status >= 300:
        _raise_for(resp.status, data, url)
    return json.loads(data) if data else None


def http_stream(url: str, body: Any, timeout: float = 30.0) -> Iterator[Any]:
    """POST ``body`` and yield each SSE ``data:`` event as parsed JSON (``"[DONE]"`` ends it).

    ``timeout`` bounds every wait for the next bytes. A connection that breaks or ends
    before ``[DONE]`` raises ``ConnectionLost``; an error answer raises its kvbridge error.
    """
    conn, _ = _conn(url, timeout)
    try:
        try:
            conn.request("POST", urlsplit(url).path or "/", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
        except socket.timeout:
            raise TransferTimeout(f"POST {url} got no answer within {timeout}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerUnavailable(f"POST {url} failed: {type(exc).__name__}: {exc}") from None
        if resp.status >= 300:
            _raise_for(resp.status, resp.read(), url)
        while True:
            try:
                line = resp.readline()
            except socket.timeout:
                raise TransferTimeout(f"stream from {url} was silent for {timeout}s") from None
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionLost(f"stream from {url} broke: {type(exc).__name__}: {exc}") from None
            if not line:
                raise ConnectionLost(f"stream from {url} ended before [DONE]")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    finally:
        conn.close()


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
        with self._cond:
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
                if isinstance(w.listener, RequestWatch):
                    w.listener.admitted_at = w.admitted_at
            for r in touched:
                tw = self._watch.get(r.request_id)
                if tw is None:
                    continue
                if r.finished:
                    self._forget(r.request_id)
                tw.listener(r, None)
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


class EngineWorker:
    """A model, its pool, a :class:`Scheduler` stepped by an :class:`EngineLoop`, and HTTP routes."""

    role = "worker"

    def __init__(self, cfg: WorkerConfig, model: Optional[CausalLM] = None, shared_pool: bool = False) -> None:
        self.cfg = cfg
        self.model = model if model is not None else load_model(cfg.model, cfg.seed)[0]
        self.pool = KVPool.allocate(self.model.kv_layout(cfg.block_size), cfg.num_blocks, shared=shared_pool)
        self.engine = Engine(self.model, self.pool)
        self.scheduler = Scheduler(self.engine, chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs)
        self.loop = EngineLoop(self.scheduler, name=f"{self.role}-engine", step_delay=cfg.step_delay)
        self.http: Optional[JSONServer] = None
        self.routes: dict[tuple[str, str], Callable[[Ctx], None]] = {
            ("GET", "/health"): lambda ctx: ctx.send_json(200, self.health())}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "role": self.role, "pid": os.getpid(), "model": self.cfg.model,
                "chunk_size": self.cfg.chunk_size, "threads": torch.get_num_threads(),
                "load": self.loop.load, "pool": {"num_blocks": self.pool.num_blocks, "free": self.pool.num_free}}

    def __call__(self, ctx: Ctx) -> None:
        route = self.routes.get((ctx.method, ctx.path))
        if route is None:
            ctx.send_json(404, {"error": {"message": f"no route {ctx.method} {ctx.path}", "code": 1,
                                          "action": "fix", "type": "NotFound", "status": 404}})
            return
        try:
            route(ctx)
        except (KVBridgeError, ValueError, TypeError, KeyError) as exc:
            if ctx.responded:
                raise
            err = exc if isinstance(exc, KVBridgeError) else ConfigError(f"bad request: {exc}")
            ctx.send_error(err, status_for(err))

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> JSONServer:
        self.http = JSONServer(self, host, port)
        return self.http

    def wait_done(self, req: Request, watch: RequestWatch, timeout: float) -> None:
        """Block until ``req`` finished; abort it and raise ``TransferTimeout`` after ``timeout``."""
        with watch.cond:
            ok = watch.cond.wait_for(lambda: watch.done, timeout=timeout)
        if not ok:
            self.loop.abort(req.request_id)
            raise TransferTimeout(f"request {req.request_id} did not finish within {timeout:.0f}s")
        if watch.error is not None:
            raise watch.error

    def stream(self, ctx: Ctx, req: Request, watch: RequestWatch, sent: int, stream: bool,
               timings: Callable[[], dict[str, Any]]) -> None:
        """Answer with ``req``'s tokens after the first ``sent`` ones, as SSE events or one JSON."""
        deadline = time.monotonic() + self.cfg.request_timeout
        if stream:
            ctx.start_stream()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.loop.abort(req.request_id)
                    err = TransferTimeout(f"request {req.request_id} did not finish within "
                                          f"{self.cfg.request_timeout:.0f}s")
                    if not stream:
                        raise err
                    ctx.event(error_body(err, 504))
                    ctx.event(b"[DONE]")
                    ctx.end_stream()
                    return
                watch.wait(req, sent, min(left, 1.0))
                out = req.output_ids[:]
                if stream and len(out) > sent:
                    ctx.event({"token_ids": out[sent:], "index": sent})
                    sent = len(out)
                if watch.error is not None:
                    if not stream:
                        raise watch.error
                    ctx.event(error_body(watch.error, status_for(watch.error)))
                    ctx.event(b"[DONE]")
                    ctx.end_stream()
                    return
                if req.finished and not stream:
                    ctx.send_json(200, {"request_id": req.request_id, "token_ids": out[sent:],
                                        "finish_reason": req.finish_reason.value if req.finish_reason else None,
                                        "num_output": len(out), "timings": timings()})
                    return
                if req.finished and len(out) == len(req.output_ids):
                    ctx.event({"done": True, "finish_reason": req.finish_reason.value if req.finish_reason else None,
                               "num_output": len(out), "timings": timings()})
                    ctx.event(b"[DONE]")
                    ctx.end_stream()
                    return
        except ClientGone:
            self.loop.abort(req.request_id)
            raise

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        self.loop.close()


def run_until_signal(worker: Any, host: str, port: int, parent_pid: Optional[int] = None) -> int:
    """Serve ``worker`` until SIGINT/SIGTERM (or the parent process dies); print one ready line."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = worker.serve(host, port)
    print(json.dumps({"event": "ready", "role": worker.role, "url": server.url, "pid": os.getpid()}), flush=True)
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
