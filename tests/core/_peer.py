"""Test-side helpers for the conformance suite: a sender host that runs in-process or in a
child process behind a JSON-lines pipe, deterministic pool contents, and byte comparisons.

``SenderHost`` owns pools and ``KVSender``s and executes small ops (new sender, publish,
revoke, corrupt, state). ``LocalPeer`` calls it directly; ``RemotePeer`` runs
``_sender_proc.py`` (same ``SenderHost``) in a child process so tcp/shm cross a real
process boundary, and can SIGKILL it.
"""

from __future__ import annotations

from jsonchild import JsonLinesChild
from waiting import wait_until  # noqa: F401  (re-exported: the core tests import it from here)
import base64
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from kvbridge import KVLayout, KVPool, KVSender, Timeout

HERE = os.path.dirname(os.path.abspath(__file__))
LISTEN = {"inproc": "inproc://", "tcp": "tcp://127.0.0.1:0", "shm": "shm://", "ucx": "ucx://127.0.0.1:0",
          "nvlink": "nvlink://"}


# -- pool contents ----------------------------------------------------------------------------
def fill_pool(pool: KVPool, seed: int, normal: bool = False) -> None:
    """Deterministic pseudo-random bytes in every buffer (any dtype; NaN patterns included),
    or with ``normal`` standard-normal values (what KV looks like to a quantizer)."""
    if normal:
        for i, buf in enumerate(pool.buffers):
            g = torch.Generator().manual_seed(seed * 1009 + i)
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
        return
    for i, buf in enumerate(pool.buffers):
        flat = buf.view(-1).view(torch.uint8)
        g = torch.Generator().manual_seed(seed * 1009 + i)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))


def reference_pool(layout: KVLayout, num_blocks: int, seed: int, normal: bool = False) -> KVPool:
    """What a sender created with (layout, num_blocks, seed) holds, rebuilt locally."""
    p = KVPool.allocate(layout, num_blocks)
    fill_pool(p, seed, normal)
    return p


def _parts(pool: KVPool, layer: int) -> list[torch.Tensor]:
    kv = pool.layer_kv(layer)
    return list(kv) if isinstance(kv, tuple) else [kv]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """(n_blocks, nbytes) uint8 view of a gathered (n_blocks, *part) tensor."""
    t = t.contiguous().cpu()
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def mismatched_blocks(dst_pool: KVPool, dst_ids: Sequence[int], src_pool: KVPool,
                      src_ids: Sequence[int]) -> list[int]:
    """Destination ids whose bytes (every layer and part, via torch views) differ from the source's."""
    assert len(dst_ids) == len(src_ids)
    if not dst_ids:
        return []
    d = torch.tensor(list(dst_ids), dtype=torch.long)
    s = torch.tensor(list(src_ids), dtype=torch.long)
    bad = torch.zeros(len(dst_ids), dtype=torch.bool)
    for layer in range(dst_pool.layout.num_layers):
        for dp, sp in zip(_parts(dst_pool, layer), _parts(src_pool, layer), strict=True):
            a, b = _bytes_of(dp.index_select(0, d.to(dp.device))), _bytes_of(sp.index_select(0, s.to(sp.device)))
            bad |= (a != b).any(dim=1)
    return [int(dst_ids[k]) for k in torch.nonzero(bad).flatten().tolist()]


def snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [b.clone() for b in pool.buffers]


def changed_blocks(pool: KVPool, snap: list[torch.Tensor]) -> list[int]:
    """Block ids whose bytes differ from ``snap`` (any layer/part)."""
    ref = KVPool.wrap(pool.layout, _group(pool.layout, snap))
    ids = list(range(pool.num_blocks))
    return mismatched_blocks(pool, ids, ref, ids)


def _group(layout: KVLayout, bufs: list[torch.Tensor]) -> list[Any]:
    if layout.buffers_per_layer == 2:
        return [(bufs[2 * i], bufs[2 * i + 1]) for i in range(layout.num_layers)]
    return list(bufs)


# -- the sender side --------------------------------------------------------------------------
class _SlowGrant:
    """Delays validate-after-read (shm's DONE) so a kill lands while a transfer is open."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner, self._delay = inner, delay
        self.spans = inner.spans

    def still_valid(self) -> bool:
        time.sleep(self._delay)
        return self._inner.still_valid()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SenderHost:
    """Executes sender-side ops; the same code runs in-process and in the child process."""

    def __init__(self) -> None:
        self.senders: dict[str, KVSender] = {}
        self.pools: dict[str, KVPool] = {}
        self.events: dict[str, list[list[Any]]] = {}
        self.handles: dict[str, Any] = {}
        self.pushes: dict[str, Any] = {}
        self._closing: list[threading.Thread] = []
        self._n = 0

    def op(self, name: str, **kw: Any) -> Any:
        return getattr(self, "op_" + name)(**kw)

    def op_new_sender(self, layout: dict, num_blocks: int, listen: str, seed: int, ttl: float = 60.0,
                      secret: Optional[str] = None, reserve_all: bool = False,
                      timeout: Optional[dict] = None, allocator: str = "kvbridge", normal: bool = False,
                      leases: bool = True) -> dict:
        self._n += 1
        sid = f"s{self._n}"
        L = KVLayout.from_dict(layout)
        pool = KVPool.allocate(L, num_blocks, shared=listen.startswith("shm:"), allocator=allocator,
                               device="cuda" if listen.startswith("nvlink:") else "cpu")   # nvlink: device pools
        fill_pool(pool, seed, normal)
        if reserve_all and allocator == "kvbridge":
            pool.alloc(num_blocks)
        ev: list[list[Any]] = []

        def on_free(h: Any, reason: str) -> None:
            ev.append([h.request_id, reason, list(h.block_ids)])
        s = KVSender(pool, listen, secret=bytes.fromhex(secret) if secret else None, ttl=ttl,
                     timeout=Timeout(**(timeout or {})), on_free=on_free, **({} if leases else {"leases": False}))
        self.senders[sid], self.pools[sid], self.events[sid] = s, pool, ev
        return {"sid": sid, "url": s.url}

    def op_alloc(self, sid: str, n: int) -> list[int]:
        return self.pools[sid].alloc(n)

    def op_publish(self, sid: str, request_id: str, block_ids: list[int], num_tokens: int,
                   ttl: Optional[float] = None, layers_ready: Optional[int] = None,
                   codec: Optional[str] = None) -> str:
        h = self.senders[sid].publish(request_id, block_ids, num_tokens, ttl=ttl, layers_ready=layers_ready,
                                      codec=codec)
        self.handles[h.id] = h
        return base64.b64encode(h.to_bytes()).decode()

    def op_mark_ready(self, sid: str, handle_id: str, layers: int) -> None:
        self.senders[sid].mark_ready(self.handles[handle_id], layers)

    def op_push(self, sid: str, reservation: str, block_ids: list[int], layers_ready: Optional[int] = None) -> str:
        t = self.senders[sid].push(base64.b64decode(reservation), block_ids, layers_ready=layers_ready)
        assert t.handle is not None
        self.handles[t.handle.id] = t
        self.pushes[t.handle.id] = t
        return t.handle.id

    def op_push_result(self, push_id: str, timeout: float = 10.0) -> dict:
        r = self.pushes[push_id].result(timeout)
        return {"ok": r.ok, "error": type(r.error).__name__ if r.error else None, "nbytes": r.nbytes,
                "layers_done": self.pushes[push_id].layers_done}

    def op_push_state(self, push_id: str) -> dict:
        t = self.pushes[push_id]
        return {"state": t.state.value, "layers_done": t.layers_done}

    def op_corrupt_frames(self, sid: str, handle_id: str) -> None:
        """Flip a byte in the body of every codec frame a coded handle holds (after their hashes)."""
        rec = self.senders[sid]._records[bytes.fromhex(handle_id)]
        for off, n in rec.frames.pieces:
            rec.frames.data[off + n - 1] ^= 0xFF

    def op_retire(self, sid: str, block_ids: list[int]) -> list[int]:
        return self.pools[sid].retire(block_ids)

    def op_revoke(self, sid: str, handle_id: str) -> bool:
        return self.senders[sid].revoke(bytes.fromhex(handle_id))

    def op_corrupt(self, sid: str, block_ids: list[int]) -> None:
        """Flip one byte of every layer/part of each block (after publish, so checksums mismatch)."""
        pool = self.pools[sid]
        for b in block_ids:
            for layer in range(pool.layout.num_layers):
                for part in _parts(pool, layer):
                    flat = part[b].view(-1).view(torch.uint8)
                    flat[0] ^= 0xFF

    def op_state(self, sid: str) -> dict:
        pool, s = self.pools[sid], self.senders[sid]
        return {"num_free": pool.num_free, "num_live": s.num_live, "events": list(self.events[sid]),
                "generations": pool.generations(range(pool.num_blocks)),
                "refcounts": [pool.refcount(b) for b in range(pool.num_blocks)]}

    def op_close_sender(self, sid: str, wait: bool = True) -> None:
        s = self.senders.pop(sid)
        if wait:
            s.close()
        else:   # closing joins the lease watcher (~0.2 s): don't make every test wait for it
            t = threading.Thread(target=s.close, daemon=True)
            t.start()
            self._closing.append(t)

    def op_slow(self, on: bool, chunk: int = 256 << 10, pause: float = 0.01, done_delay: float = 2.0) -> None:
        """Throttle this process's socket sends and delay validate-after-read."""
        import socket as _socket
        orig_send = getattr(_socket.socket, "_kvb_orig_sendmsg", None)
        if orig_send is None:
            orig_send = _socket.socket.sendmsg
            _socket.socket._kvb_orig_sendmsg = orig_send  # type: ignore[attr-defined]
        orig_open = getattr(KVSender, "_kvb_orig_open_read", None)
        if orig_open is None:
            orig_open = KVSender.open_read
            KVSender._kvb_orig_open_read = orig_open  # type: ignore[attr-defined]
        if not on:
            _socket.socket.sendmsg = orig_send  # type: ignore[method-assign]
            KVSender.open_read = orig_open  # type: ignore[method-assign]
            return

        def slow_sendmsg(sock: Any, buffers: Any, *a: Any) -> int:
            budget, out = chunk, []
            for b in buffers:
                mv = memoryview(b).cast("B")
                if budget <= 0:
                    break
                out.append(mv[:budget])
                budget -= len(out[-1])
            time.sleep(pause)
            return orig_send(sock, out, *a)

        def slow_open(self_: Any, *a: Any, **k: Any) -> Any:
            return _SlowGrant(orig_open(self_, *a, **k), done_delay)
        _socket.socket.sendmsg = slow_sendmsg  # type: ignore[method-assign]
        KVSender.open_read = slow_open  # type: ignore[method-assign]
        # shm:// one-sided reads never reach this process: withdraw them, so reads take the
        # (slowed) MAP/DONE exchange
        for snd in self.senders.values():
            for srv in snd.servers:
                table = getattr(srv, "table", None)
                if table is not None:
                    for hid in list(table._slots):
                        table.remove(hid)
                    table.add = lambda handle_id, raw: False

    def close(self) -> None:
        for sid in list(self.senders):
            self.op_close_sender(sid, wait=False)
        for t in self._closing:
            t.join(timeout=5)
        self._closing.clear()


class LocalPeer:
    """The sender host in this process (inproc, or in-process tcp/shm servers)."""

    remote = False

    def __init__(self) -> None:
        self.host = SenderHost()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda **kw: self.host.op(name, **kw)

    def close(self) -> None:
        self.host.close()


class PeerError(RuntimeError):
    pass


class RemotePeer(JsonLinesChild):
    """``SenderHost`` in a child process, driven by JSON lines; ``kill()`` SIGKILLs it."""

    remote = True
    error = PeerError
    what = "sender process"

    def __init__(self, reply_timeout: float = 30.0) -> None:
        self._orphans: list[int] = []
        super().__init__(os.path.join(HERE, "_sender_proc.py"), reply_timeout)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda **kw: self.call(name, **kw)

    def _descendants(self) -> list[int]:
        """Pids of processes the child started (e.g. its embedded lease server)."""
        kids: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.proc.pid]
        while todo:
            for k in kids.get(todo.pop(), []):
                out.append(k)
                todo.append(k)
        return out

    def reap_orphans(self) -> None:
        """End what a SIGKILLed child left running (it could not clean up after itself)."""
        for pid in self._orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._orphans = []

    def kill(self) -> None:
        if self.proc.poll() is None:
            self._orphans = self._descendants()
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        # a killed sender cannot unlink its shared memory or control socket: do it for it
        import glob
        import tempfile
        for path in (glob.glob(f"/dev/shm/kvb-{self.proc.pid}-*")
                     + glob.glob(os.path.join(tempfile.gettempdir(), f"kvb-{self.proc.pid}-*.sock"))):
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        if self.proc.poll() is None:
            self.kill()
        self.reap_orphans()
