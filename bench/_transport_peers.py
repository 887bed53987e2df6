"""The peers of the transport benchmark (:mod:`bench.transport`): the spawned sender process
(a :class:`kvbridge.KVSender` plus the plain-socket and bare-ucxx ceiling servers), the
ceilings' receiving clients, and the NIXL pair. Every function run in a child process is
defined at module level here, so ``multiprocessing`` 'spawn' can import it."""

from __future__ import annotations

import gc
import inspect
import multiprocessing as mp
import os
import random
import socket
import struct
import threading
import time
from typing import Any, Optional

from bench._plain import SizeServer
from bench._transport_cases import PLAIN_SEED, Case, fill_pool, host_buffer, tensor_view

REQ = struct.Struct("!Q")
UCX_REQ_TAG, UCX_DATA_TAG = 1, 2


# ============================================================================== sender process

class _PlainServer(SizeServer):
    """Request/response plain socket: read an 8-byte size, ``sendall`` that many bytes."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1")
        self.buf: Any = None

    def set_size(self, nbytes: int) -> None:
        self.view = memoryview(b"")
        self.buf = host_buffer(nbytes, seed=PLAIN_SEED)
        self.view = tensor_view(self.buf)


def ucx_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("ucxx") is not None


class _BareUCXServer:
    """The ucx ceiling's sending side: one worker, one endpoint to the receiver's worker
    (from its address, error handling off); per 8-byte request, one tagged send of that
    many bytes. Polls for SPIN seconds after each message, then sleeps on the worker's event fd."""

    def __init__(self, client_address: bytes) -> None:
        from kvbridge.transports.ucx import SPIN
        self.SPIN = SPIN
        import select
        from ucxx._lib import libucxx as l
        self.l = l
        self.ctx = l.UCXContext({}, (l.Feature.TAG, l.Feature.WAKEUP))
        self.w = l.UCXWorker(self.ctx)
        self.w.init_blocking_progress_mode()
        self.address = self.w.address.tobytes()
        self.ep = self.w.create_endpoint_from_worker_address(l.UCXAddress.create_from_buffer(client_address), False)
        self.buf: Any = None
        self.view = memoryview(b"")
        self.lock = threading.Lock()
        self._closed = False
        self._select = select
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bare-ucx")
        self.thread.start()

    def set_size(self, nbytes: int) -> None:
        with self.lock:
            self.buf = host_buffer(nbytes, seed=PLAIN_SEED)
            self.view = tensor_view(self.buf)

    def _loop(self) -> None:
        from ucxx._lib.arr import Array
        l, w = self.l, self.w
        req = bytearray(REQ.size)
        last = time.monotonic()
        while not self._closed:
            w.progress()
            pr = w.tag_probe(l.UCXXTag(UCX_REQ_TAG), l.UCXXTagMaskFull, True)
            if pr.matched:
                r = w.tag_recv_with_handle(Array(req), pr)
                while not r.completed:
                    w.progress()
                (n,) = REQ.unpack(req)
                with self.lock:
                    s = self.ep.tag_send(Array(self.view[:n]), l.UCXXTag(UCX_DATA_TAG))
                while not s.completed:
                    w.progress()
                last = time.monotonic()
                continue
            if time.monotonic() - last < self.SPIN:
                continue
            if w.arm():
                p = self._select.poll()
                p.register(w.epoll_file_descriptor, self._select.POLLIN)
                p.poll(100)

    def close(self) -> None:
        self._closed = True
        self.thread.join(timeout=2)
        self.ep.close()


def nixl_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("nixl") is not None


def nixl_main(conn: Any, role: str) -> None:
    """A NIXL agent (UCX backend) in its own process: NIXL bundles its own UCX, which must not
    share a process with ucxx's. The initiator READs the target's pieces into its own and
    times each transfer itself."""
    os.environ.setdefault("UCX_MODULES", "^ib")      # NIXL crashes at exit here without it
    import torch
    from nixl._api import nixl_agent, nixl_agent_config
    torch.set_num_threads(1)
    # progress thread off: it would burn a core for the whole run (the initiator polls instead)
    agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf: Any = None
    handle: Any = None
    while True:
        # With the progress thread off, the target progresses its agent between commands:
        # every 1 ms while idle, continuously between "spin" and the next command (while the
        # initiator's timed transfer runs), as NIXL's progress thread would.
        while not conn.poll(0.001):
            if role == "target":
                agent.get_new_notifs()
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        if cmd == "spin":
            while not conn.poll(0):
                agent.get_new_notifs()
            continue
        try:
            if cmd == "setup":
                buf = host_buffer(arg["nbytes"], seed=PLAIN_SEED if role == "target" else None)
                agent.register_memory(buf)
                descs = agent.get_xfer_descs([(buf.data_ptr() + o, n, 0) for o, n in arg["pieces"]], "DRAM")
                if role == "target":
                    conn.send(("ok", (agent.get_agent_metadata(), agent.get_serialized_descs(descs))))
                else:
                    name = agent.add_remote_agent(arg["meta"])
                    handle = agent.initialize_xfer("READ", descs, agent.deserialize_descs(arg["descs"]), name)
                    conn.send(("ok", None))
            elif cmd == "run":
                t0 = time.perf_counter()
                agent.transfer(handle)
                while (st := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
                    pass
                dt = time.perf_counter() - t0
                conn.send(("ok", dt) if st == "DONE" else ("err", "NIXL transfer failed"))
            elif cmd == "exit":
                conn.send(("ok", None))
                return
            elif cmd != "noop":
                conn.send(("err", f"unknown command {cmd!r}"))
        except Exception as exc:  # report, keep serving
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class NixlPair:
    """A NIXL target and initiator (two spawned processes) moving ``pieces`` of a buffer."""

    def __init__(self, nbytes: int, src_pieces: list[tuple[int, int]], dst_pieces: list[tuple[int, int]]) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for role in ("target", "initiator"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=nixl_main, args=(child, role), daemon=True, name=f"kvb-bench-nixl-{role}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        meta, descs = self._call(0, "setup", {"nbytes": nbytes, "pieces": src_pieces})
        self._call(1, "setup", {"nbytes": nbytes, "pieces": dst_pieces, "meta": meta, "descs": descs})

    def _call(self, k: int, cmd: str, arg: Any = None, timeout: float = 120.0) -> Any:
        self.conns[k].send((cmd, arg))
        if not self.conns[k].poll(timeout):
            raise TimeoutError(f"NIXL {cmd} did not answer within {timeout} s")
        status, val = self.conns[k].recv()
        if status != "ok":
            raise RuntimeError(f"NIXL: {val}")
        return val

    def run(self, i: int = 0) -> float:
        self.conns[0].send(("spin", None))        # the target progresses until the next command
        try:
            return float(self._call(1, "run"))
        finally:
            self.conns[0].send(("noop", None))

    def close(self) -> None:
        for k, p in enumerate(self.procs):
            try:
                self._call(k, "exit", timeout=10)
            except Exception:
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def mooncake_main(conn: Any, role: str) -> None:
    """A Mooncake Transfer Engine (tcp protocol, P2P handshake: no metadata server) in its own
    process. The target registers a buffer and serves; the initiator READs 4 KiB of it into its
    own registered buffer with ``transfer_sync_read`` and times each read itself. The engine
    needs ``libcuda.so.1``, ``libibverbs.so.1`` and ``libcudart.so.12`` at import even for tcp
    (README: how to provide them on a machine without CUDA or RDMA)."""
    try:
        import torch
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]
        torch.set_num_threads(1)
        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
    except Exception as exc:                 # not installed, or its native libraries are missing
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    buf: Any = None
    peer, remote = "", 0
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "setup":
                buf = host_buffer(arg["nbytes"], seed=PLAIN_SEED if role == "target" else None)
                if engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
                    raise RuntimeError("register_memory failed")
                if role == "target":
                    conn.send(("ok", (f"127.0.0.1:{engine.get_rpc_port()}", buf.data_ptr())))
                else:
                    peer, remote = arg["peer"], arg["addr"]
                    conn.send(("ok", None))
            elif cmd == "run":
                t0 = time.perf_counter()
                rc = engine.transfer_sync_read(peer, buf.data_ptr(), remote, arg)
                dt = time.perf_counter() - t0
                conn.send(("ok", dt) if rc == 0 else ("err", f"transfer_sync_read returned {rc}"))
            elif cmd == "check":
                want = host_buffer(arg, seed=PLAIN_SEED)
                conn.send(("ok", bool(torch.equal(buf[:arg], want[:arg]))))
            elif cmd == "exit":
                conn.send(("ok", None))
                return
            else:
                conn.send(("err", f"unknown command {cmd!r}"))
        except Exception as exc:  # report, keep serving
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class MooncakePair:
    """A Mooncake Transfer Engine target and initiator (two spawned processes), reading
    ``nbytes`` from the target's buffer. :meth:`start` returns None when the engine cannot
    run here (not installed, or its native libraries missing), saying why."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.nbytes = 0
        for role in ("target", "initiator"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=mooncake_main, args=(child, role), daemon=True, name=f"kvb-bench-mooncake-{role}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    @classmethod
    def start(cls, nbytes: int) -> tuple[Optional["MooncakePair"], str]:
        pair = cls()
        try:
            for k in (0, 1):
                pair._call(k, None)                  # the engine's own start-up answer
            peer, addr = pair._call(0, "setup", {"nbytes": nbytes})
            pair._call(1, "setup", {"nbytes": nbytes, "peer": peer, "addr": addr})
            pair.nbytes = nbytes
            return pair, ""
        except Exception as exc:
            pair.close()
            return None, str(exc)

    def _call(self, k: int, cmd: Optional[str], arg: Any = None, timeout: float = 120.0) -> Any:
        if cmd is not None:
            self.conns[k].send((cmd, arg))
        if not self.conns[k].poll(timeout):
            raise TimeoutError(f"Mooncake {cmd} did not answer within {timeout} s")
        status, val = self.conns[k].recv()
        if status != "ok":
            raise RuntimeError(f"Mooncake: {val}")
        return val

    @property
    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self.procs]

    def run(self, i: int = 0) -> float:
        return float(self._call(1, "run", self.nbytes))

    def check(self) -> bool:
        return bool(self._call(1, "check", self.nbytes))

    def close(self) -> None:
        for k, p in enumerate(self.procs):
            try:
                if p.is_alive():
                    self._call(k, "exit", timeout=10)
            except Exception:
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def nixl_pieces(case: Case, seed: int) -> tuple[int, list[tuple[int, int]]]:
    """Buffer size and pieces for NIXL: one piece for a contiguous case; for a block-shaped
    one, its runs as every-other piece of a buffer twice the size, shuffled (scattered)."""
    if case.group == "contiguous":
        return case.nbytes, [(0, case.nbytes)]
    part = case.nbytes // case.segments
    order = list(range(case.segments))
    random.Random(seed).shuffle(order)
    return 2 * case.nbytes, [(2 * k * part, part) for k in order]


def sender_main(conn: Any) -> None:
    """Entry point of the sender process: answers commands from the receiver over ``conn``."""
    import torch  # noqa: F401  (imported once, before timing)
    from kvbridge.layout import KVLayout
    from kvbridge.pool import KVPool
    from kvbridge.sender import KVSender

    torch.set_num_threads(1)
    plain = _PlainServer()
    bare_ucx: Optional[_BareUCXServer] = None
    pool: Optional[KVPool] = None
    sender: Optional[KVSender] = None

    def teardown() -> None:
        nonlocal pool, sender
        if sender is not None:
            sender.close()
        if pool is not None:
            pool.close()
        sender = pool = None
        gc.collect()

    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                return
            try:
                if cmd == "setup":
                    teardown()
                    L = KVLayout.from_dict(arg["layout"])
                    pool = KVPool.allocate(L, arg["pool_blocks"], shared=arg["transport"] == "shm")
                    fill_pool(pool, arg["seed"])
                    pool.alloc(arg["pool_blocks"])          # the engine's reference: never freed here
                    listen = {"tcp": "tcp://127.0.0.1:0", "shm": "shm://", "ucx": "ucx://127.0.0.1:0"}[arg["transport"]]
                    # Leases are a separate subsystem (bench them elsewhere): measure the transport alone.
                    kw = {"leases": False} if "leases" in inspect.signature(KVSender).parameters else {}
                    sender = KVSender(pool, listen, ttl=3600.0, **kw)
                    if arg.get("plain_nbytes"):
                        plain.set_size(arg["plain_nbytes"])
                    if arg.get("ucx_nbytes"):
                        assert bare_ucx is not None, "ucx_hello first"
                        bare_ucx.set_size(arg["ucx_nbytes"])
                    conn.send(("ok", {"url": sender.url, "plain_port": plain.port, "pid": os.getpid()}))
                elif cmd == "publish":
                    assert pool is not None and sender is not None
                    ids = arg["block_ids"]
                    out = []
                    for _ in range(arg["count"]):
                        pool.ref(ids)                       # each handle pins its own reference
                        h = sender.publish(arg.get("request_id", "bench"), ids,
                                           len(ids) * pool.layout.block_size, ttl=arg.get("ttl", 3600.0))
                        out.append(h.to_bytes())
                    conn.send(("ok", out))
                elif cmd == "ucx_hello":
                    if bare_ucx is not None:
                        bare_ucx.close()
                    bare_ucx = _BareUCXServer(arg)
                    conn.send(("ok", bare_ucx.address))
                elif cmd == "stats":
                    conn.send(("ok", None if sender is None else dict(vars(sender.stats))))
                elif cmd == "teardown":
                    teardown()
                    conn.send(("ok", None))
                elif cmd == "exit":
                    conn.send(("ok", None))
                    return
                else:
                    conn.send(("err", f"unknown command {cmd!r}"))
            except Exception as exc:  # report, keep serving
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    finally:
        teardown()
        plain.close()
        if bare_ucx is not None:
            bare_ucx.close()


class SenderProc:
    """The spawned sender process, driven over a pipe. Always ``close()`` it (kills on failure)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sender_main, args=(child,), name="kvb-bench-sender", daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> Any:
        self.conn.send((cmd, arg))
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"sender process died (exit code {self.proc.exitcode}) during {cmd!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sender did not answer {cmd!r} within {timeout}s")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"sender: {val}")
        return val

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                try:
                    self.call("exit", timeout=10.0)
                except Exception:
                    pass
                self.proc.join(timeout=10.0)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5.0)
            self.conn.close()

    def __enter__(self) -> "SenderProc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ============================================================================== receiver-side primitives

class PlainClient:
    """The ceiling's receiving side: request ``n`` bytes, ``recv_into`` a preallocated buffer."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fetch(self, view: memoryview, n: int) -> int:
        sock = self.sock
        sock.sendall(REQ.pack(n))
        got = 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("plain server closed the connection")
            got += k
        return got

    def close(self) -> None:
        self.sock.close()


class BareUCXClient:
    """The ucx ceiling's receiving side: post a tagged receive into a preallocated buffer,
    send the 8-byte request, poll the worker until both complete."""

    def __init__(self, sender: "SenderProc") -> None:
        import select
        from ucxx._lib import libucxx as l
        from ucxx._lib.arr import Array
        from kvbridge.transports.ucx import SPIN
        self.l, self.Array, self.spin, self.select = l, Array, SPIN, select
        self.ctx = l.UCXContext({}, (l.Feature.TAG, l.Feature.WAKEUP))
        self.w = l.UCXWorker(self.ctx)
        self.w.init_blocking_progress_mode()
        addr = sender.call("ucx_hello", self.w.address.tobytes())
        self.ep = self.w.create_endpoint_from_worker_address(l.UCXAddress.create_from_buffer(addr), False)
        self.req = bytearray(REQ.size)

    def fetch(self, view: memoryview, n: int) -> int:
        l, w = self.l, self.w
        REQ.pack_into(self.req, 0, n)
        r = w.tag_recv(self.Array(view[:n]), l.UCXXTag(UCX_DATA_TAG), l.UCXXTagMaskFull)
        s = self.ep.tag_send(self.Array(self.req), l.UCXXTag(UCX_REQ_TAG))
        # the same wait as kvbridge's: poll for SPIN seconds, then sleep on the worker's event fd
        end = time.monotonic() + self.spin
        while True:
            w.progress()
            if r.completed and s.completed:
                break
            if time.monotonic() > end and w.arm():
                p = self.select.poll()
                p.register(w.epoll_file_descriptor, self.select.POLLIN)
                p.poll(10)
        r.check_error()
        return n

    def close(self) -> None:
        self.ep.close()


def _pin_all(pid: Optional[int], cpus: set[int]) -> bool:
    """Set the CPU affinity of every thread of ``pid`` (threads started later inherit it)."""
    if pid is None:
        return False
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)
        return True
    except (OSError, AttributeError):
        return False
