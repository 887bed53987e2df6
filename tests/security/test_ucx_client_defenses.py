"""ucx:// seen from its client against a hostile or broken peer: a fake ucx:// sender (a TCP
socket that answers the hello as a server would, and a real UCX worker that answers each
tagged request as its script says) that goes silent, trickles, never reads its liveness
socket, or lives at ever new URLs; and a fake receiver that takes a push's bytes slowly.
Real UCX workers over loopback/shared memory; every fetch and push ends in time."""

from __future__ import annotations

import dataclasses
import itertools
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

import pytest

pytest.importorskip("ucxx", reason="ucx:// needs ucxx: pip install 'kvbridge[ucx]'")

from loopback import Listener  # noqa: E402

from kvbridge import (ConnectionLost, HandleNotFound, KVBridgeError, KVHandle, KVLayout, KVPool, KVReceiver, KVSender,  # noqa: E402
                      Retry, Timeout, TransferCancelled, TransferTimeout)
from kvbridge.transports import ucx as U  # noqa: E402
from kvbridge.transports import ucx_core  # noqa: E402
from kvbridge.transports.base import Spans  # noqa: E402
from kvbridge.transports.ucx_server import _value  # noqa: E402
from kvbridge.transports.wire import HEADER, Kind, RateGuard, encode_error, pack, recv_exact, unpack_header  # noqa: E402

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 2, 64, block_size=16, dtype="float16")    # 16 KiB a block (8 KiB a layer)

Script = Callable[["FakeUCX", int, bytes], None]
_KEYS = itertools.count()


class FakeUCX(Listener):
    """A ucx:// "sender" on 127.0.0.1: the hello is answered with a key and this worker's
    address, then each tagged request of that key goes to ``script(fake, rid, request)`` (on a
    thread of its own). ``reads_socket=False``: the liveness socket is never read after the
    hello (doorbells pile up in it)."""

    def __init__(self, script: Script, reads_socket: bool = True, rcvbuf: int = 0) -> None:
        self.script, self.reads_socket, self.rcvbuf = script, reads_socket, rcvbuf
        self.w = U._Worker()
        self.key = 0x5EED + next(_KEYS)     # one of its own, as servers draw them (a client refuses a duplicate)
        self.eps: list[Any] = []
        self.held: list[Any] = []
        self.requests: list[tuple[int, bytes]] = []
        self.conns: list[socket.socket] = []
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.bind(("127.0.0.1", 0))
        super().__init__(s)
        self._loop = threading.Thread(target=self._ucx_loop, daemon=True)
        self._loop.start()

    @property
    def url(self) -> str:
        return f"ucx://127.0.0.1:{self.sock.getsockname()[1]}"

    def _conn(self, c: socket.socket) -> None:
        self.conns.append(c)
        try:
            self._hello(c)
        except (OSError, KVBridgeError):    # closed meanwhile (the test ended), or the client went
            return

    def _hello(self, c: socket.socket) -> None:
        c.settimeout(None)
        _, rid, n = unpack_header(recv_exact(c, HEADER.size))
        body = recv_exact(c, n)[len(U.HELLO):]
        (alen,) = struct.unpack_from("!H", body)
        self.eps.append(self.w.endpoint(bytes(body[2:2 + alen])))
        c.sendall(pack(Kind.MAPPED, rid, struct.pack("!Q", self.key) + self.w.address))
        while self.reads_socket and not self.stop.is_set():
            try:
                if not c.recv(4096):
                    return
            except OSError:
                return
        self.stop.wait()

    def send(self, kind: int, rid: int, msg: bytes, key: Optional[int] = None) -> None:
        buf = bytearray(msg)
        tag = U._tag(kind, self.key if key is None else key, rid)
        with self.w.lock:
            self.held.append((self.eps[-1].tag_send(U.Array(buf), U._ucx.UCXXTag(tag)), buf))

    def _ucx_loop(self) -> None:
        mask = U._ucx.UCXXTagMask(0xF << ucx_core.KIND_SHIFT | ucx_core.KEY_MASK << ucx_core.RID_BITS)
        while not self.stop.is_set():
            want = U._ucx.UCXXTag(U._tag(U.T_REQ, self.key, 0))
            with self.w.lock:
                self.w.w.progress()
                pr = self.w.w.tag_probe(want, mask, True)
                if pr.matched:
                    buf = bytearray(pr.length)
                    req = self.w.w.tag_recv_with_handle(U.Array(buf), pr)
            if not pr.matched:
                time.sleep(0.0005)
                continue
            while not req.completed:
                self.w.progress()
            rid = ucx_core._untag(_value(pr.sender_tag))[2]
            self.requests.append((rid, bytes(buf)))
            threading.Thread(target=self.script, args=(self, rid, bytes(buf)), daemon=True).start()

    def close(self) -> None:
        super().close()
        self._loop.join(2)
        for c in self.conns:
            c.close()


def _handle(url: str, nblocks: int, **kw: Any) -> KVHandle:
    with KVSender(KVPool.allocate(L, 64), "inproc://", leases=False) as snd:
        h = snd.publish("real", snd.pool.alloc(nblocks), 16 * nblocks, **kw)
    return dataclasses.replace(h, urls=(url,))


def _receiver(transfer: float, attempts: int = 3) -> KVReceiver:
    return KVReceiver(KVPool.allocate(L, 64), leases=False, timeout=Timeout(connect=2, transfer=transfer),
                      retry=Retry(attempts=attempts))


def _nbytes(nblocks: int) -> int:
    return Spans.of_blocks(KVPool.allocate(L, nblocks), list(range(nblocks))).nbytes


def _header_then(after: Optional[Callable[[FakeUCX, int, int], None]] = None) -> Script:
    """A script: an OK header declaring the bytes a read asks for, then ``after(fake, rid, n)``."""
    def script(fake: FakeUCX, rid: int, req: bytes) -> None:
        n = int(fake.nbytes)
        fake.send(U.T_HDR, rid, bytes([U.ST_OK]) + U._N.pack(n))
        if after is not None:
            after(fake, rid, n)
    return script


def _seen(pool: KVPool, ids: list[int]) -> set[int]:
    return set(b"".join(bytes(v) for v in Spans.of_blocks(pool, ids).views()))


# -- a sender that goes silent: a cancel ends the read at once, and nothing lands after it --------------
@pytest.mark.parametrize("how", ["no header", "header then silence", "bytes after the cancel"])
def test_cancel_of_a_read_from_a_silent_sender_returns_at_once(how):
    """Before, the waits looked only at the liveness socket: cancel() returned after every retry
    had waited out Timeout.transfer (3 x 2 s here), and the result was TransferTimeout (RETRY)."""
    nb = 16                                                         # 256 KiB: DATA messages
    late: list[float] = []

    def bytes_later(fake: FakeUCX, rid: int, n: int) -> None:
        time.sleep(1.2)
        late.append(time.monotonic())
        fake.send(U.T_DATA, rid, b"\x41" * n)
        fake.send(U.T_DONE, rid, bytes([U.ST_OK]))
    script: Script = {"no header": lambda f, r, q: None, "header then silence": _header_then(None),
                      "bytes after the cancel": _header_then(bytes_later)}[how]
    fake = FakeUCX(script)
    fake.nbytes = _nbytes(nb)
    rcv = _receiver(2.0)
    try:
        dst = rcv.pool.alloc(nb)
        t = rcv.start_fetch(_handle(fake.url, nb), dst, release=False)
        time.sleep(0.3)
        t0 = time.monotonic()
        assert t.cancel(timeout=10)
        took = time.monotonic() - t0
        res = t.result()
        assert took < 0.5, f"cancel took {took:.1f} s"
        assert isinstance(res.error, TransferCancelled), repr(res.error)
        assert len(fake.requests) == 1
        if late or how == "bytes after the cancel":
            time.sleep(1.3)
            assert late and _seen(rcv.pool, dst) == {0}, "bytes landed after cancel() returned"
    finally:
        rcv.close()
        fake.close()


def test_cancel_of_a_layer_read_waiting_for_its_reply_header_returns_at_once():
    """A layer-wise read's wait for its reply header has no destination yet (the reply says which
    layers come): it looks at the cancel of the transfer its thread runs. It waited out
    Timeout.transfer (30 s here) per attempt before."""
    fake = FakeUCX(lambda f, r, q: None)                            # asked, never answers
    rcv = _receiver(30.0)
    try:
        dst = rcv.pool.alloc(2)
        t = rcv.start_fetch(_handle(fake.url, 2, layers_ready=0), dst, release=False)
        time.sleep(0.3)
        assert len(fake.requests) == 1 and not t.done()
        t0 = time.monotonic()
        assert t.cancel(timeout=10)
        took = time.monotonic() - t0
        assert took < 0.5, f"cancel took {took:.1f} s"
        assert isinstance(t.result().error, TransferCancelled), repr(t.result().error)
        assert len(fake.requests) == 1                              # no retry after it
    finally:
        rcv.close()
        fake.close()


@pytest.mark.parametrize("stall", ["no GO", "no answer to DONE"])
def test_cancel_of_a_push_to_a_silent_receiver_returns_at_once(stall):
    """A push's waits -- for the receiver's GO, and for its answer to DONE once the bytes are
    sent -- look at the cancel of the transfer their thread runs (the push's source carries no
    flag of its own): ``cancel()`` returns at once, the push ends TransferCancelled, and it is not
    tried again; with Timeout.transfer at 30 s each wait would otherwise hold the push that long."""
    nb = 2
    n = _nbytes(nb)
    got = [0]

    def silent(fake: FakeUCX, rid: int, req: bytes) -> None:
        if req[0] != U.OP_WREQ or stall == "no GO":
            return                                                 # never answers
        fake.send(U.T_HDR, rid, bytes([U.ST_GO]))
        scratch = bytearray(n)
        while got[0] < n and not fake.stop.is_set():               # takes the bytes, then says nothing
            with fake.w.lock:
                r = fake.eps[-1].tag_recv(U.Array(scratch), U._ucx.UCXXTag(U._tag(U.T_DATA, fake.key, rid)))
            end = time.monotonic() + 5
            while not r.completed and time.monotonic() < end:
                fake.w.progress()
                time.sleep(0.001)
            if not r.completed:
                return
            got[0] += int(r.recv_length) if hasattr(r, "recv_length") else n
    fake = FakeUCX(silent)
    src = KVPool.allocate(L, 64)
    try:
        with KVSender(src, "inproc://", leases=False, timeout=Timeout(connect=2, transfer=30),
                      retry=Retry(attempts=3)) as snd:
            res = dataclasses.replace(_handle(fake.url, nb), reservation=True)
            t = snd.push(res, src.alloc(nb))
            wait = (lambda: len(fake.requests) >= 1) if stall == "no GO" else (lambda: got[0] >= n)
            end = time.monotonic() + 10
            while not wait() and time.monotonic() < end:
                time.sleep(0.01)
            assert wait() and not t.done(), (len(fake.requests), got[0])
            time.sleep(0.2)
            t0 = time.monotonic()
            assert t.cancel(timeout=10)
            took = time.monotonic() - t0
            assert took < 0.5, f"cancel took {took:.1f} s"
            assert isinstance(t.result().error, TransferCancelled), repr(t.result().error)
            writes = [r for r in fake.requests if r[1][0] == U.OP_WREQ]
            assert len(writes) == 1, f"the push was tried again after its cancel: {len(writes)} writes"
    finally:
        fake.close()


# -- a sender that never reads its liveness socket: doorbells never block the client --------------------
def test_a_sender_that_never_reads_its_socket_cannot_block_a_read_past_its_deadline(monkeypatch):
    """Doorbells went out with a blocking sendall: once a server that never reads its socket had
    let them fill both buffers (minutes of waits at the real sizes; here the buffers are shrunk and
    the doorbells rung every 0.2 ms), a read hung in sendall with no deadline, holding the peer's
    ring lock. Now a doorbell that cannot go is not sent, and the read ends at Timeout.transfer."""
    monkeypatch.setattr(ucx_core, "NAP", 0.0002)

    def script(fake: FakeUCX, rid: int, req: bytes) -> None:
        if len(fake.requests) == 1:                  # the first read: a clean refusal (the peer is kept)
            fake.send(U.T_HDR, rid, bytes([U.ST_ERROR]) + encode_error(HandleNotFound("not here")))
    fake = FakeUCX(script, reads_socket=False, rcvbuf=4096)
    rcv = _receiver(2.0, attempts=1)
    out: dict[str, Any] = {}
    try:
        h = _handle(fake.url, 2)
        assert isinstance(rcv.fetch(h, rcv.pool.alloc(2), release=False).error, HandleNotFound)
        rcv.transport(fake.url)._peers[fake.url].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        dst = rcv.pool.alloc(2)
        th = threading.Thread(target=lambda: out.setdefault("res", rcv.fetch(h, dst, release=False)), daemon=True)
        t0 = time.monotonic()
        th.start()
        th.join(5)
        assert not th.is_alive(), "the read is still blocked 5 s into a 2 s deadline"
        assert time.monotonic() - t0 < 3.5
        assert isinstance(out["res"].error, (TransferTimeout, ConnectionLost)), repr(out["res"].error)
    finally:
        fake.close()           # (unblocks a read stuck in sendall)
        rcv.close()


# -- handles naming ever new ucx:// URLs: the client keeps a bounded set of connections --------------------
def test_handles_naming_ever_new_urls_do_not_grow_the_clients_connections(monkeypatch):
    """Every URL a handle named kept its liveness socket and UCX endpoint for the transport's life
    (unsigned handles from a hostile source: a descriptor and an endpoint each, without bound).
    Now at most MAX_PEERS (3 here) are kept, the least recently used closed first."""
    monkeypatch.setattr(U, "MAX_PEERS", 3)

    def refuse(fake: FakeUCX, rid: int, req: bytes) -> None:
        fake.send(U.T_HDR, rid, bytes([U.ST_ERROR]) + encode_error(HandleNotFound("not here")))
    fakes = [FakeUCX(refuse) for _ in range(5)]
    rcv = _receiver(2.0, attempts=1)
    try:
        tr = None
        socks = []
        for i, f in enumerate(fakes):
            assert isinstance(rcv.fetch(_handle(f.url, 2), rcv.pool.alloc(2), release=False).error, HandleNotFound)
            tr = rcv.transport(f.url)
            socks.append(tr._peers[f.url].sock)
            if i == 2:                 # the first one used again: the second is now the oldest
                assert isinstance(rcv.fetch(_handle(fakes[0].url, 2), rcv.pool.alloc(2), release=False).error,
                                  HandleNotFound)
        assert tr is not None
        assert list(tr._peers) == [fakes[0].url, fakes[3].url, fakes[4].url]
        assert [s.fileno() == -1 for s in socks] == [False, True, True, False, False]
        assert isinstance(rcv.fetch(_handle(fakes[1].url, 2), rcv.pool.alloc(2), release=False).error,
                          HandleNotFound)      # a forgotten one connects again
        assert len(tr._peers) == 3
    finally:
        rcv.close()
        for f in fakes:
            f.close()


# -- push: a receiver that takes the bytes slowly -------------------------------------------------------------
def test_a_receiver_taking_a_push_slowly_is_dropped(monkeypatch):
    """The writer waited Timeout.transfer for each DATA message and no more: a receiver that said
    GO and then took one 64 KiB piece every 0.6 s held the push (and its source blocks) for
    pieces x 0.6 s (10 s here; a 64 MiB write at a 30 s timeout: 8 minutes). Now the writer holds
    it to MIN_RATE after RATE_GRACE, as the server's paths are."""
    monkeypatch.setattr(ucx_core, "CHUNK", 64 << 10)
    monkeypatch.setattr(ucx_core, "RATE_GRACE", 0.3)
    monkeypatch.setattr(ucx_core, "MIN_RATE", 1 << 20)
    nb = 64                                                        # 1 MiB: 16 pieces
    n = _nbytes(nb)
    taken = [0]

    def slow(fake: FakeUCX, rid: int, req: bytes) -> None:
        if req[0] != U.OP_WREQ:
            fake.send(U.T_HDR, rid, bytes([U.ST_OK]))
            return
        fake.send(U.T_HDR, rid, bytes([U.ST_GO]))
        scratch = bytearray(64 << 10)
        while taken[0] < n and not fake.stop.is_set():
            time.sleep(0.6)
            with fake.w.lock:
                r = fake.eps[-1].tag_recv(U.Array(scratch), U._ucx.UCXXTag(U._tag(U.T_DATA, fake.key, rid)))
            end = time.monotonic() + 2
            while not r.completed and time.monotonic() < end:
                time.sleep(0.001)
            if not r.completed:
                return
            taken[0] += len(scratch)
        fake.send(U.T_HDR, rid, bytes([U.ST_OK]))
    guards: list[RateGuard] = []

    class Recorded(RateGuard):         # the guard's own clock: the time to connect and be told GO is not its
        def __init__(self, min_rate: float, grace: float) -> None:
            super().__init__(min_rate, grace)
            guards.append(self)
    monkeypatch.setattr(U, "RateGuard", Recorded)
    fake = FakeUCX(slow)
    src = KVPool.allocate(L, nb)
    try:
        with KVSender(src, "inproc://", leases=False, timeout=Timeout(connect=2, transfer=2),
                      retry=Retry(attempts=1)) as snd:
            res = _handle(fake.url, nb)
            tr = snd._transport_after_close(fake.url)[0]
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="under the minimum"):
                tr.write(fake.url, res, Spans.of_blocks(src, list(range(nb))), (0, L.num_layers), None, b"", True)
            end = time.monotonic()
    finally:
        fake.close()
    # unguarded, the write lasts 16 x 0.6 s (more under load); guarded, it ends at the first check past
    # RATE_GRACE (0.3 s) of the guard's clock, within a NAP -- bounds wide enough for a loaded machine
    assert guards, "the write has no rate guard"
    assert end - guards[-1].t0 < 1.5, f"the write went on {end - guards[-1].t0:.1f} s past its guard's start"
    assert end - t0 < 5, f"the write went on for {end - t0:.1f} s ({taken[0]} bytes taken)"
    assert taken[0] < n


# -- messages the client never asked for: taken off its worker, never queued there ---------------------
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _flood(fake: FakeUCX, ep: Any, tags: Callable[[int], int], n: int, size: int = 4096) -> bool:
    """Send ``n`` eager messages (one shared buffer) tagged ``tags(i)``; True once all went."""
    buf = bytearray(size)
    held: list[Any] = []
    for i in range(n):
        with fake.w.lock:
            held.append(ep.tag_send(U.Array(buf), U._ucx.UCXXTag(tags(i))))
            fake.w.w.progress()
        if len(held) >= 512:
            held = [r for r in held if not r.completed]
    end = time.monotonic() + 5
    while held and time.monotonic() < end:
        fake.w.progress()
        held = [r for r in held if not r.completed]
        time.sleep(0.001)
    return not held


FLOODS = ["tags nobody receives", "a dropped connection's tags", "the request's own DATA tag"]


@pytest.mark.parametrize("how", FLOODS)
def test_messages_the_client_never_asked_for_do_not_pile_up(how):
    """A sender posting messages under tags the client never receives (a kind it has none of, DATA /
    headers / trailers of no request in flight, another key), under the key of a connection the
    client dropped, or DATA of the request in flight before its header: each stayed queued on the
    client's UCX worker, its bytes in UCX's memory, for the client's life (20,000 x 4 KiB: ~100 MiB
    more). Now every one is taken off the worker: the strays received into one byte and forgotten,
    a request's own kept only up to STASH_MSGS (more: the connection is dropped)."""
    n = 20_000
    old: list[Any] = []        # the first connection's key and endpoint
    flooded = threading.Event()

    def script(fake: FakeUCX, rid: int, req: bytes) -> None:
        refuse = bytes([U.ST_ERROR]) + encode_error(HandleNotFound("not here"))
        key, ep = fake.key, fake.eps[-1]
        if how == "tags nobody receives":
            kinds = (9, U.T_DATA, U.T_HDR, U.T_DONE, U.T_HDR)
            flooded.set() if _flood(fake, ep, lambda i: U._tag(kinds[i % 5], key + (i % 5 == 4), (
                rid if i % 5 == 0 else rid + 1 + i // 5)), n) else None
            fake.send(U.T_HDR, rid, refuse)
        elif how == "the request's own DATA tag":
            flooded.set() if _flood(fake, ep, lambda i: U._tag(U.T_DATA, key, rid), n) else None
            fake.send(U.T_HDR, rid, refuse)
        elif not old:          # a dropped connection's: the first read ends in a reply the client drops it for
            old.append(key)
            fake.key += 1000   # the next connection's key
            fake.send(U.T_HDR, rid, bytes([7]), key)
            time.sleep(0.3)
            flooded.set() if _flood(fake, ep, lambda i: U._tag((U.T_HDR, U.T_DATA, U.T_DONE)[i % 3], key,
                                                                  rid + i % 3), n) else None
        else:
            flooded.wait(5)
            fake.send(U.T_HDR, rid, refuse)
    fake = FakeUCX(script)
    rcv = _receiver(5.0, attempts=1)
    try:
        h = _handle(fake.url, 2)
        tr = rcv.transport(fake.url)

        def read() -> Exception:
            with pytest.raises(KVBridgeError) as info:
                tr.read(fake.url, h, Spans.of_blocks(rcv.pool, rcv.pool.alloc(2)))
            return info.value
        before = _rss_mib()
        err = read()
        if how == "a dropped connection's tags":
            assert type(err).__name__ == "ProtocolError", repr(err)
            err = read()       # a new connection, whose waits progress the worker
        assert isinstance(err, ConnectionLost if how == "the request's own DATA tag" else HandleNotFound), repr(err)
        w = tr._w()
        end = time.monotonic() + 5
        while not flooded.is_set() and time.monotonic() < end:   # the rest of a flood (the read ended first)
            w.progress()
        assert flooded.is_set(), "the client never took the messages sent to it"
        for _ in range(100):          # whatever is still on its way in
            w.progress()
            time.sleep(0.001)
        with w.lock:
            left = w.w.tag_probe(U._ucx.UCXXTag(0), U._ucx.UCXXTagMask(0), False)
        assert not left.matched, "messages are still queued on the client's worker"
        grown = _rss_mib() - before
        assert grown < 40, f"the client grew {grown:.0f} MiB over {n} x 4 KiB messages"
    finally:
        rcv.close()
        fake.close()


# -- replies that lie: refused, nothing outside the destination, nothing counted good ---------------------
LIES = {   # name: (blocks, expected error)
    "inline, wrong bytes": (2, "IntegrityError"), "inline, bytes past the declared size": (2, "ProtocolError"),
    "declares a size the read did not ask for": (16, "ProtocolError"), "streamed, wrong bytes": (16, "IntegrityError"),
    "streamed, DATA longer than its piece": (16, "ProtocolError"), "streamed, trailer says stale": (16, "StaleHandle"),
    "streamed, unknown trailer status": (16, "ProtocolError")}


@pytest.mark.parametrize("how", list(LIES))
def test_a_lying_reply_is_refused_and_lands_nothing_outside_the_destination(how):
    nb, want = LIES[how]
    n = _nbytes(nb)

    def script(fake: FakeUCX, rid: int, req: bytes) -> None:
        head = bytes([U.ST_OK]) + U._N.pack(n + (1 if how.startswith("declares") else 0))
        if how.startswith("inline"):
            fake.send(U.T_HDR, rid, head + b"\x41" * (n + (100 if "past" in how else 0)))
            return
        fake.send(U.T_HDR, rid, head)
        if how.startswith("declares"):
            return
        fake.send(U.T_DATA, rid, b"\x42" * (n + (100 if "longer" in how else 0)))
        from kvbridge.errors import StaleHandle
        fake.send(U.T_DONE, rid, bytes([U.ST_ERROR]) + encode_error(StaleHandle("retired")) if "stale" in how
                  else bytes([7 if "unknown" in how else U.ST_OK]))
    fake = FakeUCX(script)
    rcv = _receiver(2.0, attempts=2)
    try:
        around = rcv.pool.alloc(1)
        dst = rcv.pool.alloc(nb)
        around += rcv.pool.alloc(1)
        res = rcv.fetch(_handle(fake.url, nb), dst, release=False)
        assert not res.ok and type(res.error).__name__ == want, repr(res.error)
        assert res.failed_block_ids == dst
        assert _seen(rcv.pool, around) == {0}
    finally:
        rcv.close()
        fake.close()


# -- an honest sender's pieces are no flood ------------------------------------------------------------
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_read_of_many_eager_pieces_is_not_taken_for_a_flood(layerwise, monkeypatch):
    """DATA pieces small enough for UCX to send eagerly complete at the sender at once, so an honest
    sender's window does not hold them back: a read of 512 x 1 KiB pieces had hundreds on the client's
    worker before it posted their receives, over STASH_MSGS: the connection was dropped as a flood and
    every retry met the same (ConnectionLost). A request may have its whole reply waiting once its size
    is known (a read's destination; a layer read's header)."""
    from kvbridge.transports import ucx_server
    for m, name in itertools.product((U, ucx_core, ucx_server), ("CHUNK", "INLINE")):
        if hasattr(m, name):
            monkeypatch.setattr(m, name, 1024)
    src, dst = KVPool.allocate(L, 96), KVPool.allocate(L, 32)
    src.alloc(96)
    with KVSender(src, "ucx://127.0.0.1:0", leases=False) as snd, \
            KVReceiver(dst, leases=False, retry=Retry(attempts=1),
                       timeout=Timeout(connect=2, transfer=5)) as rcv:
        for i in range(3):            # 512 KiB: 512 pieces each
            h = snd.publish(f"eager{i}", list(range(32 * i, 32 * i + 32)), 32 * 16,
                            layers_ready=L.num_layers if layerwise else None)
            res = rcv.fetch(h, list(range(32)))
            assert res.ok, res.error
