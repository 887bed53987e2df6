"""``kvbridge up``: the embedded lease server, worker processes and the proxy, on this machine.

The parent first binds the proxy's port (a busy or invalid ``--port`` is reported before
anything starts), then starts the lease server (:class:`EmbeddedRedis`) and hands its URL
to every worker process; each worker prints one JSON ready line with its URL; the proxy
runs in the parent. Workers run the installed package whatever the current folder holds
(``python -P``: the current folder is not put on ``sys.path``). Their logs go to
``<log dir>/<role>-<n>.log``: by default ``$TMPDIR/kvbridge-<uid>/up-<pid>``, removed on a
clean exit unless ``keep_logs``; a ``log_dir`` you name is kept. Children get
``PR_SET_PDEATHSIG`` and a ``--parent-pid`` watchdog, so they exit if the parent dies;
SIGINT/SIGTERM stop everything in order (the proxy, which first answers requests in
flight with an error, then workers, then the lease server) with a bounded wait and
SIGKILL as the last resort.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, TextIO

from ..errors import ConfigError
from ..lease import EmbeddedRedis
from ..lease.credentials import private_folder
from .proxy import Proxy, ProxyConfig
from .http import bind_socket, get_json
from .server import freeze_heap
from .signals import StopSignals
from .model import PRESETS
from .server import die_with_parent
from .tokenizer import load_tokenizer

__all__ = ["UpConfig", "Cluster", "state_path", "running_states", "default_log_dir", "worker_command"]


def _user_dir() -> str:
    """``$TMPDIR/kvbridge-<uid>``: where ``kvbridge up`` keeps its state and default logs."""
    return os.path.join(tempfile.gettempdir(), f"kvbridge-{os.getuid()}")


def default_log_dir(pid: Optional[int] = None) -> str:
    """Where ``kvbridge up`` of process ``pid`` writes worker logs unless told otherwise (in
    :func:`_user_dir`, which must be this user's alone: checked when it is used)."""
    return os.path.join(_user_dir(), f"up-{pid or os.getpid()}")


def worker_command() -> list[str]:
    """How to run ``kvbridge`` in a child: this interpreter, the installed package, never a
    ``kvbridge/`` folder that happens to be in the current directory."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "kvbridge"]
    return [sys.executable, "-c", "import sys\nif sys.path and sys.path[0] in ('', '.'): del sys.path[0]\n"
            "from kvbridge.cli import main\nsys.exit(main())"]


def state_path(pid: Optional[int] = None) -> str:
    """Where the ``kvbridge up`` of process ``pid`` records its URLs and pids."""
    return os.path.join(_user_dir(), f"up-{pid or os.getpid()}.json")


def running_states() -> list[dict[str, Any]]:
    """States of the ``kvbridge up`` deployments of this user that are still running, newest
    first. Only this user's private folder is read; the states of deployments whose parent is
    gone (killed) are removed."""
    try:
        folder = private_folder(_user_dir(), "kvbridge up's state", close_readable=True)
    except (ConfigError, OSError):
        return []
    found = []
    for path in glob.glob(os.path.join(folder, "up-*.json")):
        try:
            with open(path) as f:
                state = json.load(f)
            pid = int(state["parent_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        except OSError:
            continue
        found.append((os.path.getmtime(path), state))
    return [s for _, s in sorted(found, key=lambda x: x[0], reverse=True)]


@dataclass
class UpConfig:
    """Everything ``kvbridge up`` starts."""

    host: str = "127.0.0.1"
    port: int = 8000
    colocated: bool = False
    transport: str = "tcp"
    prefill_workers: int = 1
    decode_workers: int = 1
    model: str = "small"
    seed: int = 0
    chunk_size: int = 256
    block_size: int = 16
    num_blocks: int = 2048
    threads: Optional[int] = None      # per worker; default 1 (same bits in both modes)
    leases: Optional[str] = None       # None: start the embedded lease server
    ttl: float = 30.0
    routing: str = "least-loaded"
    on_decode_failure: str = "retry"
    ttft_slo: Optional[float] = 2.0
    tpot_slo: Optional[float] = 0.1
    worker_timeout: float = 30.0
    request_timeout: float = 300.0
    max_num_seqs: int = 64
    step_delay: float = 0.0
    startup_timeout: float = 120.0
    max_body_bytes: int = 8 << 20
    max_connections: Optional[int] = None  # the front door's (None: http.default_max_connections)
    worker_connections: int = 512          # the front door's to the workers (ProxyConfig)
    worker_pool_timeout: float = 5.0
    log_dir: Optional[str] = None      # None: default_log_dir(), removed on a clean exit unless keep_logs
    keep_logs: bool = False
    extra_worker_args: list[str] = field(default_factory=list)


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen[str]
    log_path: str
    url: Optional[str] = None
    ready: threading.Event = field(default_factory=threading.Event)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


_forking = 0     # children being started by this process right now (see forking())


def forking() -> bool:
    """Whether this process is starting a child process right now. A stop signal's handler that
    raises then would raise inside the interpreter's at-fork hooks, which print the exception
    and drop it: it should only note the signal for ``Cluster.start``'s ``check`` to raise. (The
    stop signals are blocked in the main thread meanwhile, but another thread may take one.)"""
    return _forking > 0


@contextlib.contextmanager
def _starting_child() -> Any:
    """Around a fork: the stop signals blocked in this thread (the old mask is yielded, for the
    child to restore before exec) and :func:`forking` true."""
    global _forking
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _forking += 1
    try:
        yield old_mask
    finally:    # a signal that came meanwhile lands here, and is noted only
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _forking -= 1


def _worker_setup(mask: "set[int | signal.Signals]") -> None:
    """In the forked worker, before exec: die with the parent, and the parent's signal mask."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Cluster:
    """The processes of one ``kvbridge up``; ``start()`` then ``stop()`` (or use as a context manager)."""

    def __init__(self, cfg: UpConfig, out: TextIO = sys.stderr) -> None:
        if cfg.transport not in ("tcp", "shm"):
            raise ConfigError("kvbridge up runs workers as processes: --transport must be tcp or shm")
        if cfg.decode_workers < 1 or cfg.prefill_workers < 1:
            raise ConfigError("need at least one prefill and one decode worker")
        self.cfg = cfg
        self.out = out
        self.children: list[_Child] = []
        self.redis: Optional[EmbeddedRedis] = None
        self.lease_url: Optional[str] = cfg.leases
        self.proxy: Optional[Proxy] = None
        self.url = ""
        self.log_dir = os.path.abspath(cfg.log_dir) if cfg.log_dir else default_log_dir()
        self.keep_logs = cfg.keep_logs or cfg.log_dir is not None
        self.clean = True                   # False once something failed: the logs are kept
        self._sock: Optional[socket.socket] = None
        self._stopped = False

    def _say(self, msg: str) -> None:
        print(f"[kvbridge] {msg}", file=self.out, flush=True)

    def _engine_args(self, role: str) -> list[str]:
        c = self.cfg
        threads = c.threads or 1
        model = c.model if c.model in PRESETS or not os.path.isdir(c.model) else os.path.abspath(c.model)
        args = ["--model", model, "--seed", str(c.seed), "--chunk-size", str(c.chunk_size),
                "--block-size", str(c.block_size), "--num-blocks", str(c.num_blocks), "--threads", str(threads),
                "--max-num-seqs", str(c.max_num_seqs), "--request-timeout", str(c.request_timeout),
                "--host", c.host, "--port", "0", "--parent-pid", str(os.getpid())]
        if c.step_delay:
            args += ["--step-delay", str(c.step_delay)]
        return args + list(c.extra_worker_args)

    def _spawn(self, role: str, args: list[str], n: int) -> _Child:
        log_path = os.path.join(self.log_dir, f"{role}-{n}.log")
        # A stop signal waits while the worker is forked (forking()): a handler that raises
        # KeyboardInterrupt inside the interpreter's at-fork hooks has it printed and dropped, and
        # the start went on; Cluster.start's check() raises it. The child gets the mask back before exec.
        # Until the child is in self.children (stop() ends it), as well.
        with _starting_child() as old_mask:
            with open(log_path, "w") as log:
                # own session: a Ctrl-C in the terminal reaches only this process, which stops the
                # workers after the proxy has answered the requests in flight
                proc = subprocess.Popen([*worker_command(), role, *args], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=log, text=True,
                                        preexec_fn=partial(_worker_setup, old_mask), start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
            child = _Child(role, proc, log_path)
            self.children.append(child)
        threading.Thread(target=self._read_ready, args=(child,), daemon=True).start()
        return child

    @staticmethod
    def _read_ready(child: _Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:  # keep draining so the child never blocks on a full pipe
            if child.url is None and line.startswith("{"):
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("event") == "ready":
                    child.url = str(msg["url"])
                    child.ready.set()

    def _log_tail(self, child: _Child) -> str:
        try:
            with open(child.log_path) as f:
                return f.read()[-1500:]
        except OSError:
            return ""

    def start(self, check: Optional[Callable[[], None]] = None) -> str:
        """Start everything; return the proxy's URL once every worker answers ``/health``.
        ``check()`` runs between steps and while waiting: a stop asked for by a signal whose
        KeyboardInterrupt was swallowed (one raised inside the interpreter's at-fork hooks, as
        while a worker is being forked, is only printed) raises it again there."""
        c = self.cfg
        check = check or (lambda: None)
        t0 = time.monotonic()
        self._sock = bind_socket(c.host, c.port)  # before anything starts: a busy --port fails here
        try:
            private_folder(_user_dir(), "kvbridge up's logs and state", close_readable=True)
            os.makedirs(self.log_dir, exist_ok=True)
            self._say(f"logs in {self.log_dir}" + ("" if self.keep_logs else " (removed on a clean exit; "
                                                                            "--keep-logs keeps them)"))
            if self.lease_url is None:
                with _starting_child():
                    self.redis = EmbeddedRedis().start()
                self.lease_url = self.redis.url
                self._say(f"lease server (embedded) at {self.lease_url}")
            if c.colocated:
                self._spawn("colocated", self._engine_args("colocated"), 0)
            else:
                # all on this machine: with a wildcard --host, the KV is read over loopback
                local = ["--advertise-host", "127.0.0.1"] if c.host in ("0.0.0.0", "::", "") else []
                for i in range(c.prefill_workers):
                    check()
                    self._spawn("prefill", self._engine_args("prefill") + local + [
                        "--leases", self.lease_url, "--transport", c.transport, "--ttl", str(c.ttl)], i)
                for i in range(c.decode_workers):
                    check()
                    self._spawn("decode", self._engine_args("decode") + ["--leases", self.lease_url], i)
            deadline = time.monotonic() + c.startup_timeout
            for ch in self.children:
                while not ch.ready.wait(0.1):
                    check()
                    if ch.proc.poll() is not None:
                        raise ConfigError(f"{ch.role} worker exited at start (code {ch.proc.returncode}; "
                                          f"log {ch.log_path}):\n{self._log_tail(ch)}")
                    if time.monotonic() > deadline:
                        raise ConfigError(f"{ch.role} worker not ready within {c.startup_timeout:.0f}s")
                self._say(f"{ch.role} worker pid {ch.proc.pid} at {ch.url} ({time.monotonic() - t0:.1f}s)")
            check()
            urls = {r: [ch.url for ch in self.children if ch.role == r and ch.url] for r in
                    ("prefill", "decode", "colocated")}
            max_len = min(int(get_json(f"{ch.url}/health")["max_model_len"]) for ch in self.children)
            self.proxy = Proxy(ProxyConfig(
                prefill=urls["prefill"], decode=urls["decode"],
                colocated=urls["colocated"][0] if c.colocated else None, routing=c.routing,
                on_decode_failure=c.on_decode_failure, ttft_slo=c.ttft_slo, tpot_slo=c.tpot_slo,
                worker_timeout=c.worker_timeout, request_timeout=c.request_timeout, model_name=c.model,
                max_body_bytes=c.max_body_bytes, max_model_len=max_len, max_connections=c.max_connections,
                worker_connections=c.worker_connections, worker_pool_timeout=c.worker_pool_timeout),
                tokenizer=load_tokenizer(None if c.model in PRESETS or not os.path.isdir(c.model) else c.model))
            check()
            self.url = self.proxy.serve(c.host, c.port, sock=self._sock).url
            freeze_heap()  # as every worker and `kvbridge proxy` do before they say they are ready
            self._write_state()
            check()
        except BaseException:
            self.clean = False
            self.stop()
            raise
        mode = "colocated" if c.colocated else (f"disaggregated: {c.prefill_workers} prefill, "
                                                 f"{c.decode_workers} decode over {c.transport}")
        self._say(f"ready in {time.monotonic() - t0:.1f}s ({mode}; model {c.model}, chunk {c.chunk_size})")
        self._say(f"send requests to {self.url}/v1/completions   (health: {self.url}/health, "
                  f"metrics: {self.url}/metrics)")
        self._say(f"  curl -s {self.url}/v1/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        return self.url

    def _write_state(self) -> None:
        state = {"proxy": self.url, "leases": self.lease_url, "parent_pid": os.getpid(),
                 "workers": [{"role": ch.role, "url": ch.url, "pid": ch.proc.pid} for ch in self.children],
                 "logs": self.log_dir}
        try:
            with open(state_path(), "w") as f:
                json.dump(state, f)
        except OSError:
            pass

    def progress_line(self) -> str:
        assert self.proxy is not None
        s = self.proxy.summary()

        def ms(d: dict[str, Any], k: str) -> str:
            v = d.get(k)
            return "-" if v is None else f"{v * 1000:.0f}ms"
        return (f"{s['ok']} done, {s['in_flight']} in flight, {s['failed']} failed | "
                f"TTFT p50 {ms(s['ttft'], 'p50')} p99 {ms(s['ttft'], 'p99')} | "
                f"TPOT p50 {ms(s['tpot'], 'p50')} | {s['throughput_tok_s']:.0f} tok/s | "
                f"goodput {s['goodput_fraction'] * 100:.0f}%")

    def wait(self, progress: bool = True, interval: float = 5.0) -> None:
        """Block until SIGINT/SIGTERM/SIGHUP; report workers (and the embedded lease server) that
        exit, and show progress when it changes.

        A dead worker is not restarted: the proxy routes around it (decode) or answers with a
        clear error (prefill, colocated), and ``/health`` says ``degraded``.
        """
        stop = StopSignals((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
        last = ""
        reported: set[int] = set()
        next_progress = time.monotonic() + interval
        try:
            while not stop.wait(0.5):
                for ch in self.children:
                    if ch.proc.poll() is not None and ch.proc.pid not in reported:
                        reported.add(ch.proc.pid)
                        self.clean = False
                        self._say(f"{ch.role} worker pid {ch.proc.pid} exited with code {ch.proc.returncode} "
                                  f"(log: {ch.log_path})")
                if self.redis is not None and not self.redis.running and -1 not in reported:
                    reported.add(-1)
                    self.clean = False
                    self._say("the embedded lease server exited: every publish and fetch fails until "
                              "kvbridge up is restarted")
                if progress and self.proxy is not None and time.monotonic() >= next_progress:
                    next_progress = time.monotonic() + interval
                    line = self.progress_line()
                    if line != last:
                        self._say(line)
                        last = line
        finally:
            stop.restore()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the proxy, then the workers (SIGTERM, then SIGKILL), then the lease server."""
        if self._stopped:
            return
        self._stopped = True
        if self.proxy is not None:
            self.proxy.close()
        elif self._sock is not None:
            self._sock.close()
        for ch in self.children:
            if ch.proc.poll() is None:
                ch.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for ch in self.children:
            try:
                ch.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                ch.proc.kill()
                ch.proc.wait(timeout=5)
        if self.redis is not None:
            self.redis.close()
        try:
            os.unlink(state_path())
        except OSError:
            pass
        if self.clean and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.log_dir))  # only if no other deployment uses it
            self._say("stopped")
        else:
            self._say(f"stopped; logs kept in {self.log_dir}")

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
