"""A loopback listener for tests that play a hostile peer: each connection is served on a
thread of its own by the subclass's ``_conn``, until ``close()``."""

from __future__ import annotations

import socket
import threading


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
