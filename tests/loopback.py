"""A loopback listener for tests that play a hostile peer: each connection is served on a
thread of its own by the subclass's ``_conn``, until ``close()``."""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvbridge.transports.wire import Kind


class Listener:
    """Serves ``sock`` (bound, not yet listening): ``stop`` is set by :meth:`close`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.listen(16)
        sock.settimeout(0.2)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self._thread.join(2)
        self.sock.close()


class FakeSender(Listener):
    """A peer that reads each kvbridge frame a receiver sends and answers it with :meth:`answer`
    (a hostile sender's script), until the receiver hangs up or ``close()``: a tcp:// one on
    127.0.0.1, or with ``shm_name`` an shm:// control socket in Linux's abstract namespace."""

    def __init__(self, shm_name: str = "") -> None:
        self.shm_name = shm_name
        if shm_name:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\0" + shm_name)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
        super().__init__(s)

    @property
    def url(self) -> str:
        if self.shm_name:
            return f"shm://@{self.shm_name}"
        return f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, c: socket.socket, kind: "Kind", rid: int) -> None:
        raise NotImplementedError

    def _conn(self, c: socket.socket) -> None:
        from kvbridge.transports.wire import HEADER, recv_exact, unpack_header
        c.settimeout(None)
        with c:
            try:
                while not self.stop.is_set():
                    kind, rid, length = unpack_header(recv_exact(c, HEADER.size))
                    recv_exact(c, length)
                    self.answer(c, kind, rid)
            except Exception:                      # the receiver hung up
                pass


class Trickler(FakeSender):
    """Answers every request but RELEASES with ``reply(kind, request id)`` -- (the reply's bytes,
    how many of them to send at once) -- and the rest one byte every ``every`` seconds."""

    def __init__(self, reply: "Callable[[Kind, int], tuple[Any, ...]]", every: float,
                 shm_name: str = "") -> None:
        self.reply = reply
        self.every = every
        self.trickled = 0
        super().__init__(shm_name)

    def answer(self, c: socket.socket, kind: "Kind", rid: int) -> None:
        from kvbridge.transports.wire import Kind
        if kind is Kind.RELEASES:
            return
        out = self.reply(kind, rid)          # (bytes, at once[, descriptors to attach to them: one or a list])
        whole, at_once = out[0], out[1]
        if len(out) > 2:
            import array
            fds = [out[2]] if isinstance(out[2], int) else list(out[2])
            rights = array.array("i", fds).tobytes()
            sent = c.sendmsg([whole[:at_once]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            c.sendall(whole[sent:at_once])
        else:
            c.sendall(whole[:at_once])
        for i in range(at_once, len(whole)):
            if self.stop.wait(self.every):
                return
            c.sendall(whole[i:i + 1])
            self.trickled += 1


def held_descriptors(name: str) -> list[int]:
    """This process's descriptors of the memfd ``name`` (shm:// segments are memfds)."""
    import os
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} "):
                out.append(int(fd))
        except OSError:
            pass
    return out
