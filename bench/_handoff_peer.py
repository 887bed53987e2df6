"""One side of ``bench.handoff``: the prefill worker or the decode worker.

Run as ``python3 -m bench._handoff_peer prefill|decode``, usually under
``ip netns exec NS`` so that the two sides talk over a shaped veth pair. Commands
arrive as JSON lines on stdin; each gets one JSON line on stdout
(``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ...}``); logs go to stderr.

The two peers also hold a direct control connection (decode listens, prefill connects)
over the same link, carrying handles and reservations as ``KVHandle.to_dict()``: the
control hop of a handoff crosses the shaped link too.

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC): one clock for every process
on the machine, namespaces included, so the parent subtracts a prefill-side time from
a decode-side time.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from bench._plain import SizeServer

now = time.monotonic
REQ_LEN = 8


# ============================================================================== in-process token bucket

class TokenBucket:
    """Egress shaping without a kernel qdisc (the fallback when no namespace can be made).

    Every ``send``/``sendall``/``sendmsg`` of this process is cut into pieces of at most
    ``piece`` bytes, and each piece waits for its tokens *before* it is sent (so the bytes
    arrive at the shaped pace instead of leaving at memory speed and the sender sleeping
    afterwards). One bucket per process: all its sockets share the link, as they would share
    a NIC. Unsent bytes of a partial send are refunded."""

    def __init__(self, rate_bytes_s: float, burst: int, piece: int = 64 << 10) -> None:
        self.rate = float(rate_bytes_s)
        self.burst = float(burst)
        self.piece = piece
        self.tokens = float(burst)
        self.t = now()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            t = now()
            self.tokens = min(self.burst, self.tokens + (t - self.t) * self.rate)
            self.t = t
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    def refund(self, n: int) -> None:
        if n > 0:
            with self.lock:
                self.tokens = min(self.burst, self.tokens + n)

    def install(self) -> None:
        """Patch ``socket.socket``'s send methods in this process."""
        cls = socket.socket
        o_send, o_sendall, o_sendmsg = cls.send, cls.sendall, cls.sendmsg
        bucket = self

        def _trim(buffers: Any) -> tuple[list[memoryview], int]:
            out, total = [], 0
            for b in buffers:
                mv = memoryview(b).cast("B")
                if not len(mv):
                    continue
                take = min(len(mv), bucket.piece - total)
                out.append(mv[:take])
                total += take
                if total >= bucket.piece:
                    break
            return out, total

        def send(self: socket.socket, data: Any, *a: Any) -> int:
            mv = memoryview(data).cast("B")[:bucket.piece]
            bucket.take(len(mv))
            k = o_send(self, mv, *a)
            bucket.refund(len(mv) - k)
            return k

        def sendall(self: socket.socket, data: Any, *a: Any) -> None:
            mv = memoryview(data).cast("B")
            for off in range(0, len(mv), bucket.piece):
                piece = mv[off:off + bucket.piece]
                bucket.take(len(piece))
                o_sendall(self, piece, *a)

        def sendmsg(self: socket.socket, buffers: Any, *a: Any) -> int:
            bufs, total = _trim(buffers)
            if not total:
                return o_sendmsg(self, buffers, *a)
            bucket.take(total)
            k = o_sendmsg(self, bufs, *a)
            bucket.refund(total - k)
            return k

        cls.send, cls.sendall, cls.sendmsg = send, sendall, sendmsg  # type: ignore[method-assign,assignment]


# ============================================================================== plain-socket ceiling

class PlainServer(SizeServer):
    """The link's ceiling, prefill side: read an 8-byte size, ``sendall`` that many bytes."""

    def __init__(self, host: str, nbytes: int) -> None:
        super().__init__(host)
        self.buf = bytearray(os.urandom(1 << 16)) * max(1, -(-nbytes // (1 << 16)))
        self.view = memoryview(self.buf)


class PlainClient:
    """The ceiling's decode side: request ``n`` bytes, ``recv_into`` a preallocated buffer."""

    def __init__(self, host: str, port: int, nbytes: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(max(nbytes, 1))
        self.view = memoryview(self.buf)

    def fetch(self, n: int) -> float:
        t0 = now()
        self.sock.sendall(n.to_bytes(REQ_LEN, "big"))
        got = 0
        while got < n:
            k = self.sock.recv_into(self.view[got:n], n - got)
            if not k:
                raise ConnectionError("plain server closed the connection")
            got += k
        return now() - t0

    def close(self) -> None:
        self.sock.close()


# ============================================================================== control channel

class Ctl:
    """JSON lines over a TCP connection between the two peers."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(300)
        self.sock = sock
        self.r = sock.makefile("rb")

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self) -> Any:
        line = self.r.readline()
        if not line:
            raise ConnectionError("control connection closed by the peer")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.r.close()
            self.sock.close()
        except OSError:
            pass


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# ============================================================================== prefill side

class PrefillPeer:
    def __init__(self) -> None:
        self.sender: Any = None
        self.pool: Any = None
        self.plain: Optional[PlainServer] = None
        self.ctl: Optional[Ctl] = None
        self._on_layer: Optional[Callable[[int], None]] = None

    def cmd_setup(self, host: str, model: str, max_tokens: int, threads: int,
                  bucket: Optional[dict[str, Any]] = None, layer_wait: Optional[float] = None) -> dict[str, Any]:
        if bucket:
            TokenBucket(**bucket).install()
        import torch
        torch.set_num_threads(threads)
        import kvbridge.sender
        from kvbridge import KVPool, KVSender
        default_wait = kvbridge.sender.LAYER_WAIT
        if layer_wait:
            # Workaround (see bench.handoff): a tcp layer read that finds no layer ready within
            # LAYER_WAIT is answered with an empty layer range, which the tcp client rejects.
            kvbridge.sender.LAYER_WAIT = layer_wait
        from kvbridge.workers.engine import Engine
        from kvbridge.workers.model import CausalLM
        self.model = CausalLM.from_seed(model)
        layout = self.model.kv_layout()
        self.L = layout.num_layers
        self.bs = layout.block_size
        nb = _blocks(max_tokens, self.bs)
        # Room for a handle being freed while the next one is prefilled.
        self.pool = KVPool.allocate(layout, 3 * nb + 8)
        self.engine = Engine(self.model, self.pool)
        self.sender = KVSender(self.pool, f"tcp://{host}:0", leases=False, ttl=600.0)
        self.plain = PlainServer(host, nb * layout.block_nbytes)
        # The engine learns "layer i is computed" from a forward hook on each decoder layer.
        for i, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(lambda mod, args, out, i=i: self._hook(i))
        return {"url": self.sender.url, "plain_port": self.plain.port, "layout": layout.to_dict(),
                "num_layers": self.L, "block_size": self.bs, "block_nbytes": layout.block_nbytes,
                "kv_bytes_per_token": layout.block_nbytes // self.bs, "pid": os.getpid(),
                "layer_wait_default_s": default_wait, "layer_wait_s": kvbridge.sender.LAYER_WAIT}

    def cmd_connect(self, host: str, port: int) -> None:
        self.ctl = Ctl(socket.create_connection((host, port), timeout=60))

    def _hook(self, i: int) -> None:
        if self._on_layer is not None:
            self._on_layer(i)

    def _prompt(self, n: int) -> list[int]:
        return [(7 * j + 3) % 256 for j in range(n)]     # deterministic: the same KV every trial

    def _wait_idle(self) -> None:
        """The previous trial's blocks are back in the pool (frees run on the sender's threads)."""
        deadline = now() + 30
        while self.sender.num_live and now() < deadline:
            time.sleep(0.001)

    def cmd_trial(self, mode: str, tokens: int, rid: str) -> dict[str, Any]:
        from kvbridge.integrity import block_checksums
        assert self.ctl is not None
        L, n = self.L, tokens
        self._wait_idle()
        ids = self.pool.alloc(_blocks(n, self.bs))
        prompt = self._prompt(n)
        t: dict[str, Any] = {"layer_done": []}
        sender, ctl = self.sender, self.ctl
        pt = None
        mode, _, codec = mode.partition(":")       # "whole:int8": the same mode with a codec
        codec = codec or None

        if mode == "whole":
            def on_layer(i: int) -> None:
                t["layer_done"].append(now())
                if i == L - 1:                        # the KV is complete: publish it, send the handle
                    t["kv_done"] = t["layer_done"][-1]
                    h = sender.publish(rid, ids, n, codec=codec)
                    t["published"] = now()
                    ctl.send({"handle": h.to_dict()})
        elif mode == "layerwise":
            h = sender.publish(rid, ids, n, layers_ready=0, codec=codec)
            ctl.send({"handle": h.to_dict()})
            ctl.recv()                                # the decode side has started its fetch

            def on_layer(i: int) -> None:
                t["layer_done"].append(now())
                if i == L - 1:
                    t["kv_done"] = t["layer_done"][-1]
                sender.mark_ready(h, i + 1)
        elif mode == "push":
            res = ctl.recv()["reservation"]
            pt = sender.push(res, ids, layers_ready=0)

            def on_layer(i: int) -> None:
                t["layer_done"].append(now())
                if i == L - 1:
                    t["kv_done"] = t["layer_done"][-1]
                sender.mark_ready(pt, i + 1)
        else:
            raise ValueError(f"unknown mode {mode!r}")

        t["prefill_start"] = now()
        self._on_layer = on_layer
        try:
            self.engine.prefill(prompt, ids)
        finally:
            self._on_layer = None
        t["prefill_end"] = now()
        if pt is not None:
            r = pt.result(timeout=120)
            if not r.ok:
                raise RuntimeError(f"push failed: {r.error!r}")
        # The prompt is fixed, so is its KV: the decode side's digests must equal these. The
        # blocks may already be back in the pool; nothing in this process writes them meanwhile.
        t["sums"] = [f"{x:016x}" for x in block_checksums(self.pool, ids)]
        return t

    def close(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
        if self.sender is not None:
            self.sender.close()
        if self.plain is not None:
            self.plain.close()


# ============================================================================== decode side

class DecodePeer:
    def __init__(self) -> None:
        self.receiver: Any = None
        self.ctl: Optional[Ctl] = None
        self.plain: Optional[PlainClient] = None
        self._lst: Optional[socket.socket] = None

    def cmd_setup(self, host: str, layout: dict[str, Any], max_tokens: int,
                  bucket: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        if bucket:
            TokenBucket(**bucket).install()
        import torch
        torch.set_num_threads(1)
        from kvbridge import KVLayout, KVPool, KVReceiver
        lay = KVLayout.from_dict(layout)
        self.L, self.bs = lay.num_layers, lay.block_size
        nb = _blocks(max_tokens, self.bs)
        self.pool = KVPool.allocate(lay, nb + 8)
        self.dst = self.pool.alloc(nb)               # the decode engine's blocks for the request
        self.receiver = KVReceiver(self.pool, listen=f"tcp://{host}:0", leases=False)
        self.maxbytes = nb * lay.block_nbytes
        self._lst = socket.create_server((host, 0))
        self._lst.settimeout(60)
        return {"ctl_port": self._lst.getsockname()[1], "url": self.receiver.urls[0], "pid": os.getpid()}

    def cmd_accept(self) -> None:
        assert self._lst is not None
        conn, _ = self._lst.accept()
        self.ctl = Ctl(conn)

    def cmd_plain(self, host: str, port: int) -> None:
        self.plain = PlainClient(host, port, self.maxbytes)
        self.plain.fetch(self.maxbytes)              # warm: connection, pages, window

    def cmd_ceiling(self, sizes: list[int], pings: int) -> dict[str, Any]:
        """The link's own figures: ``sizes`` bytes each over the plain socket; a 1-byte round trip."""
        assert self.plain is not None
        out: dict[str, Any] = {"seconds": [self.plain.fetch(n) for n in sizes]}
        rtt = sorted(self.plain.fetch(1) for _ in range(pings))
        out["rtt_s"] = rtt[len(rtt) // 2]
        out["rtt_min_s"] = rtt[0]
        return out

    def cmd_trial(self, mode: str, tokens: int, rid: str) -> dict[str, Any]:
        from kvbridge.integrity import block_checksums
        assert self.ctl is not None
        dst = self.dst[:_blocks(tokens, self.bs)]
        t: dict[str, Any] = {"layer_landed": []}
        rx, ctl = self.receiver, self.ctl
        mode = mode.partition(":")[0]
        if mode == "whole":
            h = ctl.recv()["handle"]
            t["handle_recv"] = now()
            r = rx.fetch(h, dst)
            t["done"] = t["landed"] = now()
        elif mode in ("layerwise", "push"):
            if mode == "layerwise":
                tr = rx.start_fetch(ctl.recv()["handle"], dst)
                ctl.send({"started": True})
            else:
                tr = rx.reserve(dst, rid, num_tokens=tokens)
                ctl.send({"reservation": tr.reservation.to_dict()})
            for i in range(self.L):
                if not tr.wait_layer(i, timeout=120):
                    break
                t["layer_landed"].append(now())
            t["landed"] = now()
            r = tr.result(timeout=120)
            t["done"] = now()
        else:
            raise ValueError(f"unknown mode {mode!r}")
        if not r.ok:
            raise RuntimeError(f"{mode}: transfer failed: {r.error!r}")
        t["nbytes"] = r.nbytes
        t["sums"] = [f"{x:016x}" for x in block_checksums(self.pool, dst)]
        return t

    def close(self) -> None:
        for x in (self.ctl, self.plain):
            if x is not None:
                x.close()
        if self._lst is not None:
            self._lst.close()
        if self.receiver is not None:
            self.receiver.close()


def main() -> int:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role not in ("prefill", "decode"):
        print("usage: python3 -m bench._handoff_peer prefill|decode", file=sys.stderr)
        return 2
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr                          # stray prints must not corrupt the protocol
    peer: Any = PrefillPeer() if role == "prefill" else DecodePeer()
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "exit":
                out.write(json.dumps({"ok": True, "result": None}) + "\n")
                break
            try:
                res = getattr(peer, "cmd_" + msg["cmd"])(**msg.get("args", {}))
                out.write(json.dumps({"ok": True, "result": res}) + "\n")
            except Exception as exc:
                out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()}) + "\n")
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
