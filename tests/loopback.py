"""A loopback listener for tests that play a hostile peer: each connection is served on a
thread of its own by the subclass's ``_conn``, until ``close()``."""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING

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
    """A tcp:// peer on 127.0.0.1 that reads each kvbridge frame a receiver sends and answers it
    with :meth:`answer` (a hostile sender's script), until the receiver hangs up or ``close()``."""

    def __init__(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        super().__init__(s)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, c: socket.socket, kind: "Kind", rid: int) -> None:
        raise NotImplementedError

    def _conn(self, c: socket.socket) -> None:
        from kvbridge.transports.wire import HEADER, recv_exact, unpack_header
        with c:
            try:
                while not self.stop.is_set():
                    kind, rid, length = unpack_header(recv_exact(c, HEADER.size))
                    recv_exact(c, length)
                    self.answer(c, kind, rid)
            except Exception:                      # the receiver hung up
                pass
