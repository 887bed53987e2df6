"""ucx:// beyond the shared conformance suite: its hello/liveness socket under malformed
frames, malformed UCX control messages from a raw ucxx peer, a missing extra, a clean
interpreter exit, and no CPU burnt while idle. Real sockets, real UCX workers, real
processes; skipped when ucxx is not installed."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from urllib.parse import urlsplit

import pytest

pytest.importorskip("ucxx", reason="ucx:// needs ucxx: pip install 'kvbridge[ucx]'")

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, ProtocolError, Timeout  # noqa: E402
from kvbridge.errors import FrameTooLarge  # noqa: E402
from kvbridge.transports import ucx as U  # noqa: E402
from kvbridge.transports import ucx_core, ucx_server  # noqa: E402
from kvbridge.transports.wire import (HEADER, MAX_CONTROL, Kind, decode_error, encode_request, pack,  # noqa: E402
                                      recv_exact, unpack_header)

from ._peer import fill_pool, mismatched_blocks  # noqa: E402
from .test_conformance import MALFORMED, check_malformed_answered  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SMALL = KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="float16")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def sender():
    pool = KVPool.allocate(SMALL, 8)
    fill_pool(pool, 99)
    pool.alloc(8)
    with KVSender(pool, "ucx://127.0.0.1:0", timeout=Timeout(transfer=1.0), leases=False) as snd:
        yield snd, pool


def _fetch_works(snd: KVSender, pool: KVPool) -> None:
    dpool = KVPool.allocate(SMALL, 8)
    with KVReceiver(dpool, leases=False, timeout=Timeout(connect=2, transfer=5)) as recv:
        res = recv.fetch(snd.publish("after", [4, 1], num_tokens=5), [0, 7])
        assert res.ok, res.error
        assert mismatched_blocks(dpool, [0, 7], pool, [4, 1]) == []


# -- the hello / liveness socket speaks kvbridge frames: the same malformed input as tcp ------------
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frames_on_the_ucx_socket(case, sender, monkeypatch):
    crashes: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    snd, pool = sender
    u = urlsplit(snd.url)
    check_malformed_answered(socket.create_connection((u.hostname, u.port), timeout=5), case)
    _fetch_works(snd, pool)
    assert crashes == []


def hello(address: bytes, ticket: bytes = b"") -> bytes:
    """A HELLO payload: worker address, then a request naming ``ticket``."""
    return U.HELLO + struct.pack("!H", len(address)) + address + (encode_request(ticket) if ticket else b"")


@pytest.mark.parametrize("case", ["no_address", "not_an_address", "no_ticket", "forged_ticket"])
def test_bad_hello_refused(case, sender):
    snd, pool = sender
    u = urlsplit(snd.url)
    own = U._Worker().address
    ticket = snd.publish("t", [2], 4).to_bytes()
    payload = {"no_address": U.HELLO, "not_an_address": hello(b"\x00" * 64, ticket),
               "no_ticket": hello(own), "forged_ticket": hello(own, ticket[:-1] + bytes([ticket[-1] ^ 1]))}[case]
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(pack(Kind.MAP, 3, payload))
        kind, rid, n = unpack_header(recv_exact(s, HEADER.size))
        assert kind is Kind.ERROR and isinstance(decode_error(recv_exact(s, n)), Exception)
        assert s.recv(1) == b""                                        # one hello per connection
    assert snd.servers[0]._clients == {}
    _fetch_works(snd, pool)


# -- malformed UCX control messages from a raw peer -------------------------------------------------
class RawPeer:
    """A bare ucxx client of a ucx:// server: hello over the socket, then raw tagged messages."""

    def __init__(self, url: str, ticket: bytes) -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=5)
        self.w = U._Worker()
        self.sock.sendall(pack(Kind.MAP, 1, hello(self.w.address, ticket)))
        kind, _, n = unpack_header(recv_exact(self.sock, HEADER.size))
        body = recv_exact(self.sock, n)
        assert kind is Kind.MAPPED, decode_error(body)
        self.cid = struct.unpack_from("!Q", body)[0]
        self.ep = self.w.endpoint(body[8:])

    def send(self, msg: bytes, rid: int, cid: int | None = None) -> None:
        with self.w.lock:
            req = self.ep.tag_send(U.Array(bytearray(msg) or bytearray(0)),
                                   U._ucx.UCXXTag(U._tag(U.T_REQ, self.cid if cid is None else cid, rid)))
        U._wait_reqs(self.w, [req], 10, "raw send")

    def reply(self, rid: int, timeout: float = 5) -> bytes:
        return U._recv_probed(self.w, U._tag(U.T_HDR, self.cid, rid), MAX_CONTROL, timeout, "raw reply")

    def close(self) -> None:
        with self.w.lock:
            self.ep.close()
        self.sock.close()


BAD_MESSAGES = {
    "unknown_op": (bytes([99]) + b"xyz", ProtocolError),
    "reply_status_as_op": (bytes([0]), ProtocolError),
    "read_garbage": (bytes([U.OP_READ]) + b"\xff\xff\xff\xff", ProtocolError),
    "read_truncated_handle": (bytes([U.OP_READ]) + struct.pack("!I", 40) + os.urandom(10), ProtocolError),
    "read_random_handle": (bytes([U.OP_READ]) + encode_request(os.urandom(80)), Exception),
    "read_with_write_fields": (bytes([U.OP_READ]) + encode_request(b"x" * 8, nbytes=5), ProtocolError),
    "write_without_layers": (bytes([U.OP_WREQ]) + encode_request(b"x" * 8), ProtocolError),
    "release_garbage": (bytes([U.OP_RELEASE]) + b"\x00\x01", Exception),
    "oversized": (bytes([U.OP_READ]) + b"\0" * (MAX_CONTROL + 8), FrameTooLarge),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_malformed_ucx_messages_get_an_error_reply(case, sender, monkeypatch):
    crashes: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    snd, pool = sender
    msg, want = BAD_MESSAGES[case]
    raw = RawPeer(snd.url, snd.publish("raw", [3], 4).to_bytes())
    try:
        raw.send(msg, rid=11)
        rep = raw.reply(11)
        assert rep[0] == U.ST_ERROR, f"{case}: status {rep[0]}"
        err = decode_error(rep[1:])
        assert isinstance(err, want), repr(err)
        # the connection keeps working
        raw.send(bytes([U.OP_PING]) + b"still here", rid=12)
        assert raw.reply(12) == bytes([U.ST_OK]) + b"still here"
    finally:
        raw.close()
    _fetch_works(snd, pool)
    assert crashes == []


def test_messages_from_unknown_clients_are_dropped(sender):
    snd, pool = sender
    raw = RawPeer(snd.url, snd.publish("raw", [3], 4).to_bytes())
    try:
        raw.send(bytes([U.OP_PING]) + b"who", rid=5, cid=raw.cid + 1000)   # no such client: no answer, no crash
        with pytest.raises(Exception):
            raw.reply(5, timeout=0.3)
        raw.send(bytes([U.OP_PING]), rid=6)
        assert raw.reply(6) == bytes([U.ST_OK])
    finally:
        raw.close()
    _fetch_works(snd, pool)


# -- the extra, exit and idle behaviour, in fresh interpreters -----------------------------------------
def _run(code: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_missing_ucxx_names_the_extra():
    out = _run("""
        import sys
        sys.modules["ucxx"] = None          # as if the extra were not installed
        from kvbridge import BackendUnavailable, KVPool, KVLayout, KVSender
        from kvbridge.transports import get_transport_class
        try:
            get_transport_class("ucx://127.0.0.1:1")
        except BackendUnavailable as exc:
            print("HINT", exc.hint)
        try:
            KVSender(KVPool.allocate(KVLayout.vllm_flash(1, 1, 2, block_size=1), 2), "ucx://127.0.0.1:0", leases=False)
        except BackendUnavailable as exc:
            print("SENDER", type(exc).__name__)
    """)
    assert out.returncode == 0, out.stderr
    assert "kvbridge[ucx]" in out.stdout and "SENDER BackendUnavailable" in out.stdout


EXIT_SCRIPT = """
    import sys
    from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, Timeout
    L = KVLayout.vllm_flash(2, 2, 8, block_size=16, dtype="float16")
    src = KVPool.allocate(L, 64); src.alloc(64)
    snd = KVSender(src, "ucx://127.0.0.1:0", leases=False)
    dst = KVPool.allocate(L, 64)
    recv = KVReceiver(dst, leases=False, listen="ucx://127.0.0.1:0")
    for ids in ([0], list(range(1, 60))):     # inline, then chunked
        assert recv.fetch(snd.publish("r", ids, 16 * len(ids)), ids).ok
    rt = recv.reserve([1, 2], "p")
    assert snd.push(rt.reservation, [60, 61]).result(10).ok and rt.result(10).ok
    if sys.argv[-1] == "close":
        recv.close(); snd.close()
    print("DONE", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "leave-open"])
def test_clean_interpreter_exit(how):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), how], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert "DONE" in out.stdout, out.stderr[-2000:]
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    for bad in ("Segmentation", "Fatal", "Aborted", "core dumped", "Traceback"):
        assert bad not in out.stderr, out.stderr[-2000:]


def test_idle_sender_and_receiver_use_no_cpu():
    """A sender and a receiver with ucx open, one fetch done, then idle: CPU seconds of the
    whole process (every thread) over 3 s of wall time."""
    out = _run("""
        import time
        from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
        L = KVLayout.vllm_flash(2, 2, 8, block_size=16, dtype="float16")
        src = KVPool.allocate(L, 8); src.alloc(8)
        snd = KVSender(src, "ucx://127.0.0.1:0", leases=False)
        recv = KVReceiver(KVPool.allocate(L, 8), leases=False, listen="ucx://127.0.0.1:0")
        assert recv.fetch(snd.publish("r", [1, 2], 32), [3, 4]).ok
        time.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(3)
        print("IDLE", (time.process_time() - c0) / (time.monotonic() - t0))
        recv.close(); snd.close()
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    share = float(out.stdout.split("IDLE")[1])
    assert share < 0.05, f"idle sender+receiver used {share:.1%} of a core"


# -- device pools (a CPU pool marked staged stands in for CUDA memory) ---------------------------------

def _patch_ucx(monkeypatch, name, value):
    """Set a ucx:// constant in every module of the backend that reads it."""
    for m in (U, ucx_core, ucx_server):
        if hasattr(m, name):
            monkeypatch.setattr(m, name, value)

STAGED = KVLayout.vllm_flash(3, 2, 64, 8, dtype="float16")   # 2 KiB parts, 12 KiB blocks


@pytest.mark.parametrize("staged_side", ["sender", "receiver", "both"])
@pytest.mark.parametrize("nblocks", [3, 30])                    # inline reply, then DATA messages
def test_staged_pools_move_exact_bytes(staged_side, nblocks, monkeypatch):
    _patch_ucx(monkeypatch, "INLINE", 16 << 10)
    _patch_ucx(monkeypatch, "CHUNK", 50_000)                   # odd chunk boundaries
    src, dst = KVPool.allocate(STAGED, 40), KVPool.allocate(STAGED, 80)
    fill_pool(src, 5)
    src._staged = staged_side in ("sender", "both")
    dst._staged = staged_side in ("receiver", "both")
    src.alloc(40)
    import random
    ids = random.Random(1).sample(range(40), nblocks)
    out = random.Random(2).sample(range(80), nblocks)
    src.ref(ids)                                  # a second reference: the push publishes them again
    with KVSender(src, "ucx://127.0.0.1:0", leases=False) as snd, \
            KVReceiver(dst, leases=False, listen="ucx://127.0.0.1:0") as rcv:
        res = rcv.fetch(snd.publish("staged", ids, nblocks * 8), out)
        assert res.ok, res.error
        assert mismatched_blocks(dst, out, src, ids) == []
        # push: the sender writes its blocks into blocks the receiver reserved
        dst2 = random.Random(3).sample(sorted(set(range(80)) - set(out)), nblocks)
        rt = rcv.reserve(dst2, "staged-push")
        assert snd.push(rt.reservation, ids).result(10).ok and rt.result(10).ok
        assert mismatched_blocks(dst, dst2, src, ids) == []


def test_chunked_transfer_with_differing_arrangements(monkeypatch):
    """The sender's runs and the receiver's runs cut the stream at different places (vLLM vs
    split K/V buffers); chunks straddle both: bounce buffers on both sides."""
    _patch_ucx(monkeypatch, "INLINE", 1024)
    _patch_ucx(monkeypatch, "CHUNK", 3000)
    sl = KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="bfloat16")
    rl = KVLayout.split_kv(2, 2, 4, block_size=4, dtype="bfloat16")
    src, dst = KVPool.allocate(sl, 24), KVPool.allocate(rl, 30)
    fill_pool(src, 8)
    src.alloc(24)
    with KVSender(src, "ucx://127.0.0.1:0", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        ids, out = [5, 1, 17, 9, 22, 3], [29, 0, 4, 11, 2, 7]
        res = rcv.fetch(snd.publish("mixed", ids, 24), out)
        assert res.ok, res.error
        assert mismatched_blocks(dst, out, src, ids) == []
