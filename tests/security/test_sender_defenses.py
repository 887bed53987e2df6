"""The sender's tcp server under peers that misbehave: what it answers, and what it keeps."""

from __future__ import annotations

import socket
import time

import pytest

from kvbridge import KVHandle, KVLayout, KVPool, KVSender, Timeout
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


def _big_read(snd: KVSender, pool: KVPool, nblocks: int, rcvbuf: int = 0) -> tuple[KVHandle, socket.socket]:
    """A raw connection that has asked for the whole of a freshly published ``nblocks`` handle."""
    h = snd.publish("big", pool.alloc(nblocks), nblocks * pool.layout.block_size)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(_addr(snd.url))
    s.settimeout(5)
    s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())))
    return h, s


BIG = KVLayout.vllm_flash(8, 8, 128, block_size=16, dtype="float16")    # 512 KiB a block


@pytest.mark.parametrize("pool_kind", ["host", "staged"])
def test_a_reader_that_pauses_is_not_dropped(pool_kind: str) -> None:
    """A reader that stops taking a 32 MiB reply for 1.5 s (a busy core, a collection) is well
    above the minimum rate: it gets the whole reply. The server's send used to give up at the
    first timeout of its 0.25 s tick once kernel buffers were full, dropping the read. (staged:
    a CPU stand-in for a device pool, served through the staging ring.)"""
    pool = KVPool.allocate(BIG, 64)
    pool._staged = pool_kind == "staged"
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        _, s = _big_read(snd, pool, 64)
        want = HEADER.size + FENCE.size + 64 * BIG.block_nbytes + TRAILER.size
        got, paused, buf = 0, False, bytearray(1 << 20)
        try:
            while got < want:
                k = s.recv_into(buf)
                if not k:
                    break
                got += k
                if not paused and got > want // 8:
                    time.sleep(1.5)
                    paused = True
        finally:
            s.close()
        assert got == want


def test_a_slow_reader_of_a_device_pool_is_dropped() -> None:
    """A reader taking a device pool's reply at ~40 KB/s is held to the minimum rate (1 MiB/s
    after the 2 s grace) like one of a host pool: dropped, its read no longer in flight, so a
    revoke frees at once. The staged path had no rate guard: the read, and its blocks, stayed in
    flight for as long as the trickle lasted. (A CPU stand-in for a device pool.)"""
    pool = KVPool.allocate(BIG, 128)
    pool._staged = True
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=10),
                  on_free=lambda h, why: freed.append(why)) as snd:
        h, s = _big_read(snd, pool, 128, rcvbuf=4096)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 4.5:                  # 4 KiB a tenth of a second
                try:
                    if not s.recv(4096):
                        break
                except OSError:
                    break
                time.sleep(0.1)
            assert snd.revoke(h) and freed == ["revoked"]      # nothing in flight any more: freed at once
        finally:
            s.close()
