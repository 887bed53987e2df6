"""The plain-socket ceiling's serving side, shared by the benchmarks: read an 8-byte
big-endian size, ``sendall`` that many bytes of :attr:`SizeServer.view`; a thread per
connection (the ceiling is a plain loop, not a server to defend)."""

from __future__ import annotations

import socket
import struct
import threading

REQ = struct.Struct("!Q")


class SizeServer:
    """Listen on ``host`` (a free port: :attr:`port`); answer each size with that many bytes."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.lst = socket.create_server((host, 0))
        self.port = self.lst.getsockname()[1]
        self.view = memoryview(b"")
        threading.Thread(target=self._accept, daemon=True, name="plain-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.lst.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="plain-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        req = bytearray(REQ.size)
        try:
            while True:
                got = 0
                while got < REQ.size:
                    k = conn.recv_into(memoryview(req)[got:])
                    if not k:
                        return
                    got += k
                (n,) = REQ.unpack(req)
                conn.sendall(self.view[:n])
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        try:
            self.lst.close()
        except OSError:
            pass
