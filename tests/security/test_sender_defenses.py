"""The sender's tcp server under peers that misbehave: what it answers, and what it keeps."""

from __future__ import annotations

import socket
import time

import pytest

from kvbridge import KVLayout, KVPool, KVSender
from kvbridge.transports.wire import FENCE, HEADER, TRAILER, Kind, decode_error, encode_request, pack

pytestmark = pytest.mark.timeout(60)


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _read_to_end(s: socket.socket, timeout: float = 5.0) -> tuple[bytes, str]:
    """Everything the server sends until it closes, and how it closed ("eof" or the error)."""
    s.settimeout(timeout)
    buf = bytearray()
    try:
        while True:
            d = s.recv(1 << 20)
            if not d:
                return bytes(buf), "eof"
            buf += d
    except OSError as exc:
        return bytes(buf), type(exc).__name__


def test_an_error_reply_and_the_reply_before_it_survive_unread_input_at_close() -> None:
    """A READ, then a malformed frame, then bytes the server never reads: it answers the READ,
    answers the malformed frame with ERROR and closes. Closing with unread input used to reset
    the connection, and the reset dropped what was still queued to send: the peer saw
    ConnectionResetError part-way through the READ's DATA, never the ERROR. Now the server ends
    its side and discards the peer's input (bounded) first: the whole DATA, the ERROR, then EOF."""
    layout = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")   # 64 KiB a block
    pool = KVPool.allocate(layout, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", pool.alloc(2), 32)
        s = socket.create_connection(_addr(snd.url), timeout=5)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)   # the reply waits in the server's queue
            bad = b"KB" + bytes([99]) + bytes(13)                          # a frame of an unknown version
            s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())) + bad + b"x" * (256 << 10))
            time.sleep(0.2)                                                # the server answers and closes meanwhile
            t0 = time.monotonic()
            got, how = _read_to_end(s)
        finally:
            s.close()
        want = HEADER.size + FENCE.size + 2 * layout.block_nbytes + TRAILER.size
        assert how == "eof" and len(got) > want + HEADER.size, (how, len(got), want)
        assert got[3] == Kind.DATA and got[want + 3] == Kind.ERROR
        assert "version 99" in decode_error(got[want + HEADER.size:]).message
        assert time.monotonic() - t0 < 3.0
