"""ucx:// against hostile peers: hellos that would make the server (or client) parse a
malformed UCX address, clients that forge other clients' tags, hello floods, stalled and
slow transfers, messages nobody receives, clients that never take their replies, servers
that trickle their hello. Real UCX workers over loopback/shared memory, bounded in time."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch

pytest.importorskip("ucxx", reason="ucx:// needs ucxx: pip install 'kvbridge[ucx]'")

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Timeout  # noqa: E402
from kvbridge.policy import Retry  # noqa: E402
from kvbridge.transports import ucx as U  # noqa: E402
from kvbridge.transports import ucx_core  # noqa: E402
from kvbridge.transports.base import Spans  # noqa: E402
from kvbridge.transports.wire import (HEADER, MAX_CONTROL, Kind, decode_error, encode_request, pack,  # noqa: E402
                                      recv_exact, unpack_header)

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="float16")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pool(fill: int, n: int = 8, layout: KVLayout = L, alloc: bool = False) -> KVPool:
    p = KVPool.allocate(layout, n)
    for b in p.buffers:
        b.view(-1).view(torch.uint8).fill_(fill)
    if alloc:
        p.alloc(n)
    return p


def _seen(pool: KVPool, ids: list[int]) -> set[int]:
    return set(b"".join(bytes(v) for v in Spans.of_blocks(pool, ids, range(pool.layout.num_layers)).views()))


def _hello(address: bytes, ticket: bytes = b"") -> bytes:
    return U.HELLO + struct.pack("!H", len(address)) + address + (encode_request(ticket) if ticket else b"")


class Raw:
    """A bare ucxx client: hello (with a ticket) over the socket, then raw tagged messages."""

    def __init__(self, url: str, ticket: bytes) -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=5)
        self.w = U._Worker()
        self.held: list = []
        self.sock.sendall(pack(Kind.MAP, 1, _hello(self.w.address, ticket)))
        kind, _, n = unpack_header(recv_exact(self.sock, HEADER.size))
        body = recv_exact(self.sock, n)
        assert kind is Kind.MAPPED, decode_error(body)
        self.key = struct.unpack_from("!Q", body)[0]
        self.ep = self.w.endpoint(body[8:])

    def post(self, msg: bytes, tag: int) -> None:
        buf = bytearray(msg)
        with self.w.lock:
            self.held.append((self.ep.tag_send(U.Array(buf), U._ucx.UCXXTag(tag)), buf))

    def progress(self, secs: float) -> None:
        end = time.monotonic() + secs
        while time.monotonic() < end:
            self.w.progress()
            time.sleep(0.001)

    def reply(self, rid: int, timeout: float = 5) -> bytes:
        return U._recv_probed(self.w, U._tag(U.T_HDR, self.key, rid), MAX_CONTROL, timeout, "raw reply")

    def close(self) -> None:
        with self.w.lock:
            self.ep.close()
        self.sock.close()


def _neighbours(key: int) -> list[int]:
    """Keys an attacker would try: its own +-1..8 (sequential ids), and the low ids."""
    return sorted({(key + d) & ucx_core.KEY_MASK for d in range(-8, 9) if d} | set(range(1, 9)))


# -- D1: no UCX work before a live ticket; a malformed address is refused, not parsed ------------------
SERVER = """
    import os, sys, json
    from kvbridge import KVLayout, KVPool, KVSender
    pool = KVPool.allocate(KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="float16"), 4)
    with KVSender(pool, "ucx://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("x", pool.alloc(2), 8)
        print(json.dumps({"url": snd.url, "handle": h.to_bytes().hex()}), flush=True)
        sys.stdin.read()
"""


def test_hello_with_a_malformed_address_never_reaches_ucx():
    """A hello with another address version (with and without a live ticket): an ERROR reply
    and the connection closed; the server process lives on (it aborted before)."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, UCX_MODULES=os.environ.get("UCX_MODULES", "^ib"))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(child.stdout.readline())
        u = urlsplit(info["url"])
        bad = bytearray(U._Worker().address)
        bad[0] = (bad[0] & 0xF0) | 0x05
        for ticket in (b"", bytes.fromhex(info["handle"])):
            with socket.create_connection((u.hostname, u.port), timeout=5) as s:
                s.sendall(pack(Kind.MAP, 1, _hello(bytes(bad), ticket)))
                kind, _, n = unpack_header(recv_exact(s, HEADER.size))
                assert kind is Kind.ERROR and isinstance(decode_error(recv_exact(s, n)), ProtocolError)
                assert s.recv(1) == b""
        time.sleep(0.3)
        assert child.poll() is None, child.stderr.read()[-2000:]
    finally:
        child.stdin.close()
        child.wait(20)
    assert child.returncode == 0


def test_hello_without_a_live_ticket_makes_no_client():
    with KVSender(_pool(1, alloc=True), "ucx://127.0.0.1:0", leases=False) as snd:
        srv = snd.servers[0]
        u = urlsplit(snd.url)
        h = snd.publish("x", [0], 4)
        snd.revoke(h)
        own = U._Worker().address
        for ticket in (b"", os.urandom(120), h.to_bytes()):
            with socket.create_connection((u.hostname, u.port), timeout=5) as s:
                s.sendall(pack(Kind.MAP, 1, _hello(own, ticket)))
                kind, _, n = unpack_header(recv_exact(s, HEADER.size))
                recv_exact(s, n)
                assert kind is Kind.ERROR
        assert srv._clients == {}


def test_client_refuses_a_hostile_servers_malformed_address():
    bad = bytearray(U._Worker().address)
    bad[0] = (bad[0] & 0xF0) | 0x05
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        c, _ = lst.accept()
        _, rid, n = unpack_header(recv_exact(c, HEADER.size))
        recv_exact(c, n)
        c.sendall(pack(Kind.MAPPED, rid, struct.pack("!Q", 1) + bytes(bad)))
        time.sleep(2)
        c.close()
    threading.Thread(target=serve, daemon=True).start()
    with KVSender(_pool(1, alloc=True), "inproc://", leases=False) as snd:
        h = snd.publish("r", [0, 1], 8)
    import dataclasses
    h = dataclasses.replace(h, urls=(f"ucx://127.0.0.1:{lst.getsockname()[1]}",))
    with KVReceiver(_pool(0), leases=False, timeout=Timeout(connect=2, transfer=2), retry=Retry(attempts=1)) as r:
        res = r.fetch(h, [0, 1], release=False)
    assert not res.ok and isinstance(res.error, ProtocolError), res.error
    lst.close()


# -- D2/D3: tags carry a random per-connection key -----------------------------------------------------
def test_forged_tags_cannot_reach_another_clients_push():
    """An attacker with a reservation of its own floods DATA/DONE on the tags sequential ids
    would give the next client; the victim's push lands the genuine bytes."""
    src, dst = _pool(0x11), _pool(0)
    src.alloc(8)
    with KVReceiver(dst, leases=False, listen="ucx://127.0.0.1:0", timeout=Timeout(transfer=3)) as rcv, \
            KVSender(src, "tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=3)) as snd:
        url = [u for u in rcv.urls if u.startswith("ucx")][0]
        own = rcv.reserve([6, 7], "attacker")
        atk = Raw(url, own.reservation.to_bytes())
        nbytes = Spans.of_blocks(dst, [0, 1], range(L.num_layers)).nbytes
        for key in _neighbours(atk.key):
            for rid in range(1, 4):
                atk.post(b"\x41" * nbytes, U._tag(U.T_DATA, key, rid))
                atk.post(encode_request(b"", last=True, nbytes=0, sums=b""), U._tag(U.T_DONE, key, rid))
        atk.progress(0.2)
        rt = rcv.reserve([0, 1], "victim")
        pr = snd.push(rt.reservation, [2, 3]).result(10)
        rr = rt.result(10)
        assert pr.ok and rr.ok, (pr.error, rr.error)
        assert _seen(dst, [0, 1]) == {0x11}
        keys = list(rcv.servers[0]._clients) if hasattr(rcv, "servers") else []
        assert all(0 < k <= ucx_core.KEY_MASK for k in keys)
        atk.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_forged_requests_cannot_answer_another_clients_read(layerwise):
    """PINGs forged with the victim's tags (its key guessed from the attacker's own) would be
    echoed to the victim as its read's reply; with random keys nobody gets them."""
    from kvbridge.transports.wire import encode_layers
    src, dst = _pool(0x11), _pool(0)
    with KVSender(src, "ucx://127.0.0.1:0", leases=False, timeout=Timeout(transfer=3)) as snd, \
            KVReceiver(dst, leases=False, timeout=Timeout(transfer=3)) as rcv:
        assert rcv.fetch(snd.publish("first", src.alloc(2), 8), [0, 1]).ok      # the victim connects
        atk = Raw(snd.url, snd.publish("mine", src.alloc(1), 4).to_bytes())
        nb = Spans.of_blocks(dst, [0, 1], range(L.num_layers)).nbytes
        if layerwise:
            h = snd.publish("lw", src.alloc(2), 8, layers_ready=L.num_layers)
            body = U._N.pack(nb) + encode_layers(0, L.num_layers, b"") + b"\x41" * nb
        else:
            h = snd.publish("whole", src.alloc(2), 8)
            body = U._N.pack(nb) + b"\x41" * nb
        for key in _neighbours(atk.key):
            for rid in range(1, 12):
                atk.post(bytes([U.OP_PING]) + body, U._tag(U.T_REQ, key, rid))
        atk.progress(0.3)
        res = rcv.fetch(h, [2, 3], release=False)
        assert res.ok, res.error
        assert _seen(dst, [2, 3]) == {0x11}
        atk.close()


def test_ping_payload_is_capped():
    with KVSender(_pool(1, alloc=True), "ucx://127.0.0.1:0", leases=False) as snd:
        raw = Raw(snd.url, snd.publish("p", [0], 4).to_bytes())
        raw.post(bytes([U.OP_PING]) + b"x" * 65, U._tag(U.T_REQ, raw.key, 1))
        rep = raw.reply(1)
        assert rep[0] == U.ST_ERROR and isinstance(decode_error(rep[1:]), ProtocolError)
        raw.post(bytes([U.OP_PING]) + b"x" * 64, U._tag(U.T_REQ, raw.key, 2))
        assert raw.reply(2) == bytes([U.ST_OK]) + b"x" * 64
        raw.close()


# -- D5: one hello per connection, a cap on clients ------------------------------------------------------
def test_one_hello_per_connection_and_a_client_cap():
    with KVSender(_pool(1, alloc=True), "ucx://127.0.0.1:0", leases=False) as snd:
        srv = snd.servers[0]
        t = snd.publish("p", [0], 4).to_bytes()
        raw = Raw(snd.url, t)
        raw.sock.sendall(pack(Kind.MAP, 2, _hello(raw.w.address, t)))     # again, same connection
        kind, _, n = unpack_header(recv_exact(raw.sock, HEADER.size))
        recv_exact(raw.sock, n)
        assert kind is Kind.ERROR and raw.sock.recv(1) == b""
        time.sleep(0.2)
        assert srv._clients == {}          # the connection closed: its client went with it
        srv.max_clients = 2
        a, b = Raw(snd.url, t), Raw(snd.url, t)
        assert a.key != b.key
        with pytest.raises(AssertionError):
            Raw(snd.url, t)
        assert len(srv._clients) == 2
        for r in (raw, a, b):
            r.close()


# -- D4: a failed write's receives are cancelled before the reservation moves on ---------------------------
@pytest.mark.parametrize("layout", ["mla", "flash"])
def test_a_stalled_writes_receives_do_not_outlive_it(layout):
    lay = KVLayout.mla(1, 512, block_size=16, dtype="float16") if layout == "mla" else \
        KVLayout.vllm_flash(2, 2, 64, block_size=16, dtype="float16")
    src, dst = _pool(0x11, 4, lay), _pool(0, 4, lay)
    src.alloc(4)
    sp = Spans.of_blocks(dst, [0, 1], range(lay.num_layers))
    with KVReceiver(dst, leases=False, listen="ucx://127.0.0.1:0", timeout=Timeout(transfer=1)) as rcv, \
            KVSender(src, "tcp://127.0.0.1:0", leases=False, timeout=Timeout(transfer=3)) as snd:
        url = [u for u in rcv.urls if u.startswith("ucx")][0]
        rt = rcv.reserve([0, 1], "victim")
        stall = Raw(url, rt.reservation.to_bytes())
        stall.post(bytes([U.OP_WREQ]) + encode_request(rt.reservation.to_bytes(), None, None, (0, lay.num_layers),
                                                     nbytes=sp.nbytes), U._tag(U.T_REQ, stall.key, 1))
        assert stall.reply(1)[0] == U.ST_GO
        with pytest.raises(Exception):
            stall.reply(1, timeout=3)        # dropped: no answer, the connection closes
        pr = snd.push(rt.reservation, [2, 3]).result(10)
        assert pr.ok and rt.result(10).ok
        assert _seen(dst, [0, 1]) == {0x11}
        stall.post(b"\x41" * sp.nbytes, U._tag(U.T_DATA, stall.key, 1))   # the stalled write's own tag
        stall.progress(0.5)
        assert _seen(dst, [0, 1]) == {0x11}


# -- D6: every message is taken off the server's worker ----------------------------------------------------
def test_messages_nobody_receives_do_not_pile_up():
    with KVSender(_pool(1, alloc=True), "ucx://127.0.0.1:0", leases=False) as snd:
        srv = snd.servers[0]
        raw = Raw(snd.url, snd.publish("p", [0], 4).to_bytes())
        for i in range(64):
            raw.post(b"\x55" * 4096, U._tag(9, raw.key, i))         # a kind nobody receives
            raw.post(b"\x55" * 4096, U._tag(U.T_DATA, raw.key, i))  # DATA for no transfer
            raw.post(b"\x55" * 4096, U._tag(U.T_REQ, 12345, i))     # requests of no client
        raw.progress(0.5)
        with srv.worker.lock:
            left = srv.worker.w.tag_probe(U._ucx.UCXXTag(0), U._ucx.UCXXTagMask(0), False)
        assert not left.matched, f"a message of {left.length} bytes is still queued"
        raw.post(bytes([U.OP_PING]), U._tag(U.T_REQ, raw.key, 99))
        assert raw.reply(99) == bytes([U.ST_OK])
        raw.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_large_messages_nobody_receives_are_dropped_without_their_bytes():
    """Messages far above UCX's rendezvous threshold (8 MiB each: a kind nobody receives, DATA
    for no write, requests of no client) are received truncated into one byte each: the
    server's memory does not grow with them, the client's sends all end, the server answers."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, UCX_MODULES=os.environ.get("UCX_MODULES", "^ib"))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(child.stdout.readline())
        raw = Raw(info["url"], bytes.fromhex(info["handle"]))
        big = b"\x55" * (8 << 20)
        raw.post(bytes([U.OP_PING]), U._tag(U.T_REQ, raw.key, 1))
        assert raw.reply(1) == bytes([U.ST_OK])
        before = _rss_mib(child.pid)
        for i in range(16):
            raw.post(big, U._tag(9, raw.key, i))
            raw.post(big, U._tag(U.T_DATA, raw.key, i))
            raw.post(big, U._tag(U.T_REQ, (raw.key + 1) & ucx_core.KEY_MASK, i))
        deadline = time.monotonic() + 20
        while not all(r.completed for r, _ in raw.held) and time.monotonic() < deadline:
            raw.progress(0.05)
        assert all(r.completed for r, _ in raw.held), "some large sends were never taken off the server"
        raw.post(bytes([U.OP_PING]), U._tag(U.T_REQ, raw.key, 2))
        assert raw.reply(2) == bytes([U.ST_OK])
        grown = _rss_mib(child.pid) - before
        assert grown < 64, f"the server grew {grown:.0f} MiB over 384 MiB of dropped messages"
        raw.close()
    finally:
        child.stdin.close()
        child.wait(20)
    assert child.returncode == 0, child.stderr.read()[-2000:]


# -- D7: a client that never takes its replies cannot stall others -----------------------------------------
def test_a_client_that_never_takes_its_replies_does_not_stall_fetches():
    src = _pool(1, 16)
    with KVSender(src, "ucx://127.0.0.1:0", leases=False, timeout=Timeout(transfer=3)) as snd, \
            KVReceiver(_pool(0, 16), leases=False, timeout=Timeout(connect=3, transfer=3)) as rcv:
        big = snd.publish("big", src.alloc(12), 48)          # 12 blocks x 2 KiB: a 24 KiB inline reply
        assert rcv.fetch(snd.publish("warm", src.alloc(1), 4), [15]).ok
        atk = Raw(snd.url, big.to_bytes())
        for i in range(200):
            atk.post(bytes([U.OP_READ]) + encode_request(big.to_bytes()), U._tag(U.T_REQ, atk.key, i + 1))
        atk.progress(0.05)                                    # sent; never progressed again
        time.sleep(0.3)
        t0 = time.monotonic()
        res = rcv.fetch(snd.publish("honest", src.alloc(2), 8), [0, 1], release=False)
        assert res.ok, res.error
        assert time.monotonic() - t0 < 2.0
        assert atk.key not in snd.servers[0]._clients        # dropped past its outstanding replies
        atk.close()


# -- D8: a minimum rate on both server paths -----------------------------------------------------------------
def test_a_slow_reader_is_dropped_and_the_blocks_freed(monkeypatch):
    monkeypatch.setattr(ucx_core, "CHUNK", 64 << 10)
    monkeypatch.setattr(ucx_core, "RATE_GRACE", 0.3)
    monkeypatch.setattr(ucx_core, "MIN_RATE", 1 << 20)
    lay = KVLayout.vllm_flash(2, 2, 64, block_size=16, dtype="float16")     # 16 KiB a block
    pool = _pool(1, 64, lay)
    freed: list = []
    with KVSender(pool, "ucx://127.0.0.1:0", leases=False, timeout=Timeout(transfer=5),
                  on_free=lambda h, r: freed.append(time.monotonic())) as snd:
        h = snd.publish("slow", pool.alloc(64), 64 * 16)
        rd = Raw(snd.url, h.to_bytes())
        rd.post(bytes([U.OP_READ]) + encode_request(h.to_bytes()), U._tag(U.T_REQ, rd.key, 1))
        assert rd.reply(1)[0] == U.ST_OK
        t0 = time.monotonic()
        snd.revoke(h)
        scratch = bytearray(64 << 10)
        for _ in range(4):                                     # one 64 KiB piece every 0.4 s: 160 KB/s
            rd.progress(0.4)
            with rd.w.lock:
                rd.w.w.tag_recv(U.Array(scratch), U._ucx.UCXXTag(U._tag(U.T_DATA, rd.key, 1)), U._ucx.UCXXTagMaskFull)
            if freed:
                break
        deadline = time.monotonic() + 3
        while not freed and time.monotonic() < deadline:
            rd.progress(0.05)
        assert freed and freed[0] - t0 < 2.5, "the slow read kept the blocks"
        rd.close()


# -- D9: the client's hello read is bounded in time and size --------------------------------------------------
@pytest.mark.parametrize("how", ["trickle", "huge"])
def test_a_trickled_or_huge_hello_reply_is_refused_in_time(how):
    lst = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        c, _ = lst.accept()
        _, rid, n = unpack_header(recv_exact(c, HEADER.size))
        recv_exact(c, n)
        c.sendall(pack(Kind.MAPPED, rid, b"", length=(1 << 20) if how == "huge" else 4000)[:HEADER.size])
        while not stop.is_set():
            try:
                c.send(b"x")
            except OSError:
                return
            time.sleep(0.2)
    threading.Thread(target=serve, daemon=True).start()
    with KVSender(_pool(1, alloc=True), "inproc://", leases=False) as snd:
        h = snd.publish("r", [0, 1], 8)
    import dataclasses
    h = dataclasses.replace(h, urls=(f"ucx://127.0.0.1:{lst.getsockname()[1]}",))
    t0 = time.monotonic()
    out: dict = {}
    with KVReceiver(_pool(0), leases=False, timeout=Timeout(connect=1, transfer=1), retry=Retry(attempts=1)) as r:
        out["r"] = r.fetch(h, [0, 1], release=False)
    stop.set()
    lst.close()
    assert not out["r"].ok
    assert time.monotonic() - t0 < 4.0

