"""A hostile sender against the receiver: a real receiver reads from a scripted server on
loopback that answers its reads as an attacker would. Every fetch must end in a clear
kvbridge error within the configured timeouts."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Callable

import pytest

from loopback import FakeSender

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout, TransferTimeout
from kvbridge.transports.wire import FENCE, LAYERS, TRAILER, Kind, pack

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")    # 64 KiB blocks: past the small-read path


class Scripted(FakeSender):
    """Answers every READ with ``script(conn, request id, stop)``."""

    def __init__(self, script: Callable[[socket.socket, int, threading.Event], None]) -> None:
        self.script = script
        super().__init__()

    def answer(self, c: socket.socket, kind: Kind, rid: int) -> None:
        if kind is Kind.READ:
            self.script(c, rid, self.stop)


def _handle(url: str, layerwise: bool) -> KVHandle:
    with KVSender(KVPool.allocate(L, 8), "inproc://", leases=False) as snd:
        h = snd.publish("real", snd.pool.alloc(4), 64, layers_ready=0 if layerwise else None)
    return dataclasses.replace(h, urls=(url,))


@pytest.mark.parametrize("face", ["fetch", "start_fetch", "fetch_many", "layers"])
def test_a_trickling_sender_ends_the_fetch_in_time(face: str) -> None:
    """A reply whose bytes come a few at a time (each receive well inside the socket's timeout)
    is given up once it has taken Timeout.transfer plus its bytes at the minimum rate since
    its first bytes landed: TransferTimeout in the result, not a fetch held for hours."""
    nbytes = 4 * L.block_nbytes

    def trickle(c: socket.socket, rid: int, stop: threading.Event) -> None:
        if face == "layers":
            head = FENCE.pack(0, 0) + LAYERS.pack(0, L.num_layers, 0)
            c.sendall(pack(Kind.LDATA, rid, head, length=len(head) + nbytes + TRAILER.size))
        else:
            c.sendall(pack(Kind.DATA, rid, FENCE.pack(0, 0), length=FENCE.size + nbytes + TRAILER.size))
        while not stop.is_set():                   # ~20 bytes a second
            c.sendall(b"\x01\x02")
            time.sleep(0.1)

    srv = Scripted(trickle)
    h = _handle(srv.url, face == "layers")
    out: list = []
    rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=1),
                     retry=Retry(attempts=1))
    try:
        t0 = time.monotonic()
        if face in ("fetch", "fetch_many"):
            def run() -> None:
                out.append(rcv.fetch(h, [0, 1, 2, 3], release=False) if face == "fetch"
                           else rcv.fetch_many([(h, [0, 1, 2, 3])], release=False)[0])
            th = threading.Thread(target=run, daemon=True)
            th.start()
            th.join(8)
        else:
            t = rcv.start_fetch(h, [0, 1, 2, 3], release=False)
            if t.wait(8):
                out.append(t.result())
            else:
                t.cancel(5)
        took = time.monotonic() - t0
        assert out, f"the fetch still runs after {took:.1f} s (Timeout.transfer is 1 s)"
        assert isinstance(out[0].error, TransferTimeout), repr(out[0].error)
        assert "trickles" in str(out[0].error)
        assert took < 6.0
    finally:
        srv.close()            # ends the trickle: a fetch still stuck ends with the connection
        rcv.close()
