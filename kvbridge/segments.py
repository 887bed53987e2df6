"""Shared memory for kvbridge's pools, handle tables and coded frames: :class:`SharedSegment`, an
anonymous memfd sealed against shrinking and growing whose descriptor peers get over the shm://
control socket (``SEGFD``), and what a peer's side checks of one (:func:`check_segment_name`,
:func:`peer_cred`, :meth:`SharedSegment.adopt`)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import threading
import warnings
import weakref
from typing import Any, Optional

import torch

from .errors import ConfigError, PoolError, ProtocolError, StaleHandle
from .hostlimits import memory_available

__all__ = ["SharedSegment", "check_segment_name", "close_fds", "peer_cred", "sweep_dead_segments"]


def sweep_dead_segments() -> list[str]:
    """Unlink ``/dev/shm/kvb-<pid>-*`` segments whose creating process is gone: files that killed
    senders of kvbridge versions before sealed memfds left behind (memfds leave none)."""
    removed: list[str] = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvb" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue                      # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink("/dev/shm/" + name)
            removed.append(name)
        except OSError:
            pass
    return removed


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` and empty it (a second call closes nothing twice)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


_PEER_SEGMENT = re.compile(r"kvb-[0-9]{1,10}-[0-9a-f]{12}")
_SEALS = ("F_ADD_SEALS", "F_GET_SEALS", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket (``SO_PEERCRED``): who the
    peer is, from the kernel, never from what it says."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid), int(uid)


def check_segment_name(name: Any) -> str:
    """A segment name a peer gave: only a kvbridge one (``kvb-<pid>-<12 hex>``); ProtocolError
    otherwise. The name only identifies a segment within a connection: the bytes come with the
    descriptor the peer passes (:meth:`SharedSegment.adopt`)."""
    if not isinstance(name, str) or not _PEER_SEGMENT.fullmatch(name):
        raise ProtocolError(f"peer named a shared-memory segment that is not kvbridge's: {name!r:.80}")
    return name


class SharedSegment:
    """Shared memory mapped into this process: an anonymous ``memfd`` sealed against shrinking
    and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so no process -- its owner
    included -- can cut its pages from under a peer's mapping (a copy past a shrunk file's end
    is SIGBUS), and a killed owner leaves no file behind. Peers get its descriptor over the
    shm:// control socket (``SCM_RIGHTS``; opened read-only for readers; mode 0600: this user's
    processes only) and :meth:`adopt` it.

    Unlike :mod:`multiprocessing.shared_memory` it registers nothing with a resource tracker.
    """

    def __init__(self, name: str, size: int = 0) -> None:
        """A new segment of ``size`` bytes, made by this process (a peer's: :meth:`adopt`)."""
        if not hasattr(os, "memfd_create") or not all(hasattr(fcntl, c) for c in _SEALS):
            raise ConfigError("shared-memory pools need Linux's sealed memfds (os.memfd_create, fcntl.F_ADD_SEALS)")
        left = memory_available() if size else None
        if left is not None and size > left:
            # its pages are reserved at once and a memfd has no size limit of its own: past what is
            # left, the kernel's OOM killer ends some process instead of an error
            raise PoolError(f"cannot make shared memory {name} of {size} bytes: {left} left to this process",
                            hint="allocate fewer blocks")
        self.name = name
        self.writable = True
        self.owner = True
        self._ro_fd = -1
        self._lock = threading.Lock()     # the descriptors: handed out (peer_fd) and closed (close) apart
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ConfigError(f"cannot create shared memory {name}: {exc}") from None
        try:
            os.fchmod(fd, 0o600)  # a memfd is 0777: another user holding a descriptor could reopen it writable
            os.ftruncate(fd, size)
            if size:    # its pages reserved now: no memory left is an error here, not SIGBUS at a write
                os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map(fd, size)
        except OSError as exc:      # no memory or descriptors left: nothing left behind, a mapped error
            os.close(fd)
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise PoolError(f"cannot make shared memory {name} of {size} bytes: {exc}",
                                hint="allocate fewer blocks") from None
            raise ConfigError(f"cannot make shared memory {name} of {size} bytes: {exc}") from None
        self.fd = fd
        self._fds = [fd]                  # every descriptor this segment holds: closed once, by close or GC
        self._finalizer = weakref.finalize(self, close_fds, self._fds)

    @classmethod
    def adopt(cls, fd: int, name: str, writable: bool, owner_uid: Optional[int] = None) -> "SharedSegment":
        """Map the segment behind a descriptor a peer passed (this call owns ``fd``: closed on
        every outcome). Refused with ProtocolError unless it is a regular file sealed against
        shrinking (a memfd with ``F_SEAL_SHRINK``: no one can make a copy from it fault) and,
        with ``owner_uid``, one that user owns."""
        self = cls.__new__(cls)
        self.name, self.writable, self.owner, self._ro_fd, self.fd = name, writable, False, -1, -1
        self._lock, self._fds = threading.Lock(), []
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ProtocolError(f"the peer passed a descriptor for {name} that is not shared memory")
            if owner_uid is not None and st.st_uid != owner_uid:
                raise ProtocolError(f"shared memory {name} is not the peer's own (owner uid {st.st_uid}, "
                                    f"the peer's {owner_uid})")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ProtocolError(f"shared memory {name} is not sealed against shrinking: a copy from it "
                                    "could fault (SIGBUS) if its owner cut it")
            self._map(fd, st.st_size)
        except OSError as exc:
            raise ConfigError(f"cannot map shared memory {name}: {exc}") from None
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, close_fds, self._fds)
        return self

    def _map(self, fd: int, size: int) -> None:
        self.size = size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        self.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot) if size else None
        self._tensor: Optional[torch.Tensor] = None
        self.view = memoryview(self.mmap) if self.mmap is not None else memoryview(bytearray(0))
        if self.mmap is None:
            self.address = 0
        elif self.writable:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mmap))
        else:   # a read-only mapping: ctypes wants writable buffers, torch only warns
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)
            self.address = self._tensor.data_ptr()

    def peer_fd(self, writable: bool) -> int:
        """A new descriptor to pass a peer (the caller closes it once sent; the owner's only):
        writable for a writer, else a duplicate of one opened read-only (made once). The
        segment is its owner's user's alone (mode 0600): a process of that user could reopen a
        read-only descriptor writable, as it could always reach the owner's memory; another
        user cannot. StaleHandle once the segment is closed; ConfigError where no descriptor can
        be made (no /proc to reopen it read-only through, no descriptors left)."""
        with self._lock:
            if not self.owner or self.fd < 0:
                raise StaleHandle(f"shared memory {self.name} is closed or not this process's to pass on")
            try:
                if writable:
                    return os.dup(self.fd)
                if self._ro_fd < 0:
                    self._ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
                    self._fds.append(self._ro_fd)
                return os.dup(self._ro_fd)
            except OSError as exc:
                raise ConfigError(f"cannot hand out a descriptor of shared memory {self.name} (a read-only one "
                                  f"is opened through /proc/self/fd): {exc}") from None

    def tensor(self) -> torch.Tensor:
        """The whole segment as a uint8 tensor (no copy)."""
        if self._tensor is None:
            self._tensor = torch.frombuffer(self.mmap, dtype=torch.uint8) if self.mmap else torch.empty(0)
        return self._tensor

    def close(self) -> None:
        """Unmap (the owner also closes its descriptors). Views handed out must be gone first."""
        self._tensor = None
        self.view.release()
        if self.mmap is not None:
            try:
                self.mmap.close()
            except BufferError:  # tensors still map it; the OS unmaps at exit
                pass
        with self._lock:                  # no descriptor handed out from here on (peer_fd)
            self.fd = self._ro_fd = -1
            self._finalizer()
