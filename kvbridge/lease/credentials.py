"""Passwords of this user's embedded lease servers, kept in 0600 files, never on a command line.

An embedded server (:class:`~kvbridge.lease.embedded.EmbeddedRedis`) starts with a random
password and records it under ``$XDG_RUNTIME_DIR/kvbridge-leases-<uid>/`` (else the temp
directory), a folder only this user can enter. Its URL, as handles and command lines carry
it, has no password; a store opened on a URL naming exactly the server's address
(``redis://127.0.0.1:<port>`` or its unix socket) finds the password there. So other users'
processes -- and anyone who only sees a handle or a process list -- cannot read or change a
lease, and the password only goes to the address the server listens on. A password is
recorded once the server holds its port and forgotten when it stops; files of servers whose
process died (with their owner, or alone) are swept.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import urllib.parse
from typing import Optional

from ..errors import ConfigError

__all__ = ["credentials_dir", "save_password", "forget_password", "with_password", "address_of", "sweep"]


def private_folder(path: str, purpose: str, close_readable: bool = False) -> str:
    """``path``, created 0700 if missing; refused unless it is a folder (not a link) of this user
    that nobody else may use -- in a shared temp directory anyone may have made it first. With
    ``close_readable``, one of this user's that others could only read and enter (e.g. 0755:
    nobody else can have put anything in it) is closed to them (0700) instead."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (0o022 if close_readable else 0o077):
        raise ConfigError(f"{path} must be a folder owned by this user with mode 0700; refusing to keep "
                          f"{purpose} there")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def credentials_dir() -> str:
    """This user's private folder for lease server passwords."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return private_folder(os.path.join(base, f"kvbridge-leases-{os.getuid()}"), "lease server passwords")


def address_of(url: str) -> Optional[str]:
    """``127.0.0.1:port`` of a redis:// URL naming exactly that host, or the socket path of a
    unix:// URL; None otherwise.

    An embedded server listens on 127.0.0.1 only (and speaks no TLS). ``localhost`` may resolve
    to ``::1`` and ``[::1]:port`` is a different socket that any local user may bind, so a URL
    naming either never gets the password: it would be sent to whoever listens there.
    """
    p = urllib.parse.urlsplit(url)
    if p.scheme == "unix":
        return p.path
    if p.scheme != "redis" or p.hostname != "127.0.0.1":
        return None
    try:
        return f"127.0.0.1:{p.port or 6379}"
    except ValueError:   # a port out of range: no server of ours, and the client refuses the URL
        return None


def _name(address: str) -> str:
    return "lease-" + hashlib.sha256(address.encode()).hexdigest()[:20]


def save_password(address: str, password: str, server_pid: Optional[int] = None) -> str:
    """Record ``password`` for ``address`` (0600); returns the file's path. The file lives as long
    as process ``server_pid`` (the server; default this process): a server that died while its
    owner lives no longer has its password sent to whoever holds its address next."""
    path = os.path.join(credentials_dir(), f"{_name(address)}-{server_pid or os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    return path


def forget_password(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (dead, not yet reaped by its parent) answers kill(0) too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _live_files() -> list[str]:
    """This user's password files, after sweeping those whose server process died."""
    try:
        folder = credentials_dir()
        names = os.listdir(folder)
    except (OSError, ConfigError):
        return []
    out = []
    for n in names:
        if not n.startswith("lease-"):
            continue
        pid = n.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            forget_password(os.path.join(folder, n))
            continue
        out.append(n)
    return out


def sweep() -> None:
    _live_files()


def _lookup(address: str) -> Optional[str]:
    prefix = _name(address) + "-"
    folder = credentials_dir()
    for n in _live_files():
        if n.startswith(prefix):
            try:
                with open(os.path.join(folder, n)) as f:
                    return f.read().strip()
            except OSError:
                return None
    return None


def with_password(url: str) -> str:
    """``url`` with the password of this user's embedded server at that address filled in;
    unchanged when it carries credentials already or no such server is known."""
    p = urllib.parse.urlsplit(url)
    if p.password is not None or p.username is not None:
        return url
    address = address_of(url)
    pw = _lookup(address) if address else None
    if pw is None:
        return url
    netloc = f":{urllib.parse.quote(pw, safe='')}@{p.netloc}"
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
