"""nvlink:// -- device pools of processes on one host: CUDA IPC mappings and batched device copies.

The control channel is shm://'s (a unix socket; ``nvlink:///path.sock`` or, by default,
``nvlink://@name`` in Linux's abstract namespace) with the same checks: MAP names a live
handle with its token (and the claim and fence of a leased one); the server holds an
in-flight count until DONE, so the blocks cannot be freed under the copy, and DONE
answers whether the handle is still valid (validate-after-read: a stale answer discards
the bytes). Push is WMAP / WDONE into the blocks a receiver reserved, verified there.

What MAPPED carries instead of a shared-memory name: for each pool buffer the read
touches, an export id, its CUDA IPC memory handle (``cudaIpcGetMemHandle`` of the
allocation that holds it) and the buffer's offset in that allocation; an interprocess
event the server records on its current stream at MAP time (the client's copy waits on
it, so it is ordered after every write the sender's stream had queued); and the byte runs.
The client opens each export once (``cudaIpcOpenMemHandle``, about 0.14 ms) and keeps it
open for the life of the transport (per (sender, buffer); closed with
``cudaIpcCloseMemHandle`` on :meth:`NVLinkTransport.close`), then moves the runs with
:func:`~kvbridge.transports.staging.copy_pieces` (one kernel over every piece,
``native/kv_copy.cu``; row gathers per run of pieces without CuPy) on the current CUDA
stream of the destination device, and waits for that copy before it sends DONE: when a
fetch returns, the bytes are in the destination pool for every stream.

A server and a client in one process (CUDA IPC cannot open a process's own exports) use
the buffers directly. Peer GPUs use the same code (``cudaIpcMemLazyEnablePeerAccess``).

Needs CuPy for the CUDA runtime calls (``pip install 'kvbridge[cupy]'``); without it a
CUDA pool cannot be served or mapped and the error names the extra. Host pools are
refused (use shm:// or tcp://).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..errors import BackendUnavailable, ConfigError, ProtocolError, StaleHandle
from ..policy import Timeout
from .base import Server, Spans
from .shm import ShmServer, ShmTransport
from .shm import _path_of as shm_path_of
from .shm_onesided import Peer
from .staging import copy_pieces, flat_buffers
from .wire import FENCE, encode_layers

__all__ = ["NVLinkTransport", "cupy_or_error"]

_PROC = struct.Struct("!16sI")        # unused (zeros): who the peer is comes from its socket
_EVENT = struct.Struct("!16s64s")     # event id, CUDA IPC event handle
_BUF = struct.Struct("!16s64sQQ")     # export id, CUDA IPC memory handle, offset in the allocation, nbytes
_RUN = struct.Struct("!QQ")           # offset in the concatenation of the buffers, nbytes
_RUNS_DTYPE = np.dtype(">u8")          # the same, read and written as arrays
_NO_EVENT = bytes(16)
MAX_OPEN = 64                         # IPC mappings a client keeps open (least recently used closed first)
_EVENT_FLAGS = 0x02 | 0x04            # cudaEventDisableTiming | cudaEventInterprocess
CUPY_HINT = ("pip install 'kvbridge[cupy]' (CuPy for the CUDA of your torch: cupy-cuda12x for CUDA 12, "
             "cupy-cuda13x for CUDA 13)")

# Exports of servers in this process, for clients in this process: export id -> flat buffer.
_LOCAL: dict[bytes, torch.Tensor] = {}
_LOCAL_EVENTS: dict[bytes, int] = {}
_local_lock = threading.Lock()


def cupy_or_error() -> Any:
    """CuPy, or :class:`BackendUnavailable` naming the extra (and a missing CUDA device)."""
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise BackendUnavailable(f"nvlink:// needs CuPy for CUDA IPC ({exc})", hint=CUPY_HINT) from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("nvlink:// needs a CUDA device; torch sees none",
                                 hint="use tcp:// or shm:// on machines without a GPU")
    return cupy


def _cuda_errors(cp: Any) -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [OSError]
    for mod, name in ((cp.cuda.runtime, "CUDARuntimeError"), (cp.cuda.driver, "CUDADriverError")):
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errs.append(cls)
    return tuple(errs)


_get_range: Any = None
_STREAM_LEGACY = 1                    # cudaStreamLegacy: what torch's default stream (handle 0) is


def _allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding ``ptr`` (``cuMemGetAddressRange``): an IPC
    handle names the whole allocation, and PyTorch's caching allocator carves tensors out of
    larger ones. A driver call: the caller makes the device's primary context current first
    (a server thread has none until a runtime call or ``cudaSetDevice`` binds it)."""
    global _get_range
    if _get_range is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuMemGetAddressRange_v2", None) or getattr(lib, "cuMemGetAddressRange", None)
        if fn is None:
            raise OSError("libcuda.so.1 has no cuMemGetAddressRange")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _get_range = fn
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _get_range(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc != 0:
        raise OSError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    if not base.value <= ptr < base.value + size.value:
        raise OSError(f"cuMemGetAddressRange({ptr:#x}) answered [{base.value:#x}, +{size.value})")
    return int(base.value), int(size.value)


def _stream(device: int) -> int:
    """torch's current stream on ``device`` as a handle for CuPy's runtime calls. torch's
    default stream is handle 0, the legacy default stream; it is passed as
    ``cudaStreamLegacy`` so it means that stream whatever default-stream mode CuPy's runtime
    was built with."""
    return int(torch.cuda.current_stream(device).cuda_stream) or _STREAM_LEGACY


def _path_of(url: str) -> str:
    return shm_path_of(url, "nvlink")


def check_pool(pool: Any) -> None:
    """Refuse what nvlink:// cannot serve: host pools; CUDA pools without CuPy."""
    if pool.is_host:
        raise ConfigError("nvlink:// serves device (CUDA) pools; this pool is in host memory",
                          hint="use shm:// (KVPool.allocate(..., shared=True)) or tcp://")
    if pool.device.type == "cuda":
        cupy_or_error()


@dataclass
class _Export:
    eid: bytes
    flat: torch.Tensor
    ipc: bytes          # b"" for memory CUDA IPC cannot name (a CPU stand-in for a device pool)
    offset: int         # of the buffer in its allocation


class _Exports:
    """A server's exports: one per pool buffer, made on first use and kept (the server holds the
    buffer, so its memory is not freed or reused while peers may have it mapped)."""

    def __init__(self) -> None:
        self._by_ptr: dict[tuple[int, int], _Export] = {}
        self._events: dict[int, tuple[bytes, int, bytes]] = {}   # device -> (id, event, IPC handle)
        self._lock = threading.Lock()

    def get(self, buf: torch.Tensor) -> _Export:
        flat = buf.reshape(-1).view(torch.uint8)
        key = (flat.data_ptr(), flat.numel())
        with self._lock:
            e = self._by_ptr.get(key)
            if e is not None:
                return e
        ipc, offset = b"", 0
        if flat.device.type == "cuda" and flat.numel():
            cp = cupy_or_error()
            idx = flat.device.index if flat.device.index is not None else torch.cuda.current_device()
            try:
                with cp.cuda.Device(idx):
                    cp.cuda.runtime.setDevice(idx)        # this thread: the primary context current
                    base = _allocation_range(flat.data_ptr())[0]
                    ipc = bytes(cp.cuda.runtime.ipcGetMemHandle(base))   # of the allocation's base
                    offset = flat.data_ptr() - base
            except _cuda_errors(cp) as exc:
                raise ConfigError(f"cannot export the pool's CUDA memory for IPC: {exc}",
                                  hint="memory from expandable segments or cudaMallocAsync pools cannot be "
                                       "shared with cudaIpcGetMemHandle; allocate the KV cache with PyTorch's "
                                       "default caching allocator") from None
        e = _Export(os.urandom(16), flat, ipc, offset)
        with self._lock:
            e = self._by_ptr.setdefault(key, e)
        with _local_lock:
            _LOCAL[e.eid] = e.flat
        return e

    def record(self, device: torch.device) -> tuple[bytes, bytes]:
        """Record this device's interprocess event on the current stream; (id, IPC handle)."""
        if device.type != "cuda":
            return _NO_EVENT, bytes(64)
        cp = cupy_or_error()
        idx = device.index if device.index is not None else torch.cuda.current_device()
        try:
            with cp.cuda.Device(idx):
                with self._lock:
                    ev = self._events.get(idx)
                    if ev is None:
                        ptr = cp.cuda.runtime.eventCreateWithFlags(_EVENT_FLAGS)
                        ev = self._events[idx] = (os.urandom(16), ptr, bytes(cp.cuda.runtime.ipcGetEventHandle(ptr)))
                        with _local_lock:
                            _LOCAL_EVENTS[ev[0]] = ptr
                cp.cuda.runtime.eventRecord(ev[1], _stream(idx))
        except _cuda_errors(cp) as exc:
            raise ConfigError(f"cannot record an interprocess CUDA event: {exc}") from None
        return ev[0], ev[2]

    def close(self) -> None:
        with self._lock:
            exports, events = list(self._by_ptr.values()), list(self._events.items())
            self._by_ptr.clear()
            self._events.clear()
        with _local_lock:
            for e in exports:
                _LOCAL.pop(e.eid, None)
            for _, (eid, _, _) in events:
                _LOCAL_EVENTS.pop(eid, None)
        if events:
            cp = cupy_or_error()
            for idx, (_, ptr, _) in events:
                try:
                    with cp.cuda.Device(idx):
                        cp.cuda.runtime.eventDestroy(ptr)
                except _cuda_errors(cp):
                    pass


class NVLinkServer(ShmServer):
    """shm://'s server with MAPPED bodies that name CUDA IPC exports instead of a segment."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.exports = _Exports()
        # per pool buffer list and set of buffers a read names: its MAPPED buffer table, built
        # once (32-64 export lookups and entries per read cost more than the rest of the body)
        self._tables: dict[tuple[int, tuple[int, ...]],
                           tuple[list[torch.Tensor], tuple[torch.Tensor, ...], bytes, np.ndarray]] = {}

    def close(self) -> None:
        super().close()
        self.exports.close()
        self._tables.clear()

    def _table(self, pool: Any, used: tuple[int, ...]) -> tuple[bytes, np.ndarray]:
        """The MAPPED body's buffer table for the buffers ``used`` of ``pool`` (their count and
        entries), and each buffer's start in their concatenation (indexed by buffer)."""
        bufs = pool.buffers
        key = (id(bufs), used)
        got = self._tables.get(key)
        if got is not None and got[0] is bufs and all(bufs[b] is t for b, t in zip(used, got[1])):
            return got[2], got[3]                       # the same list holding the same tensors
        exports = [self.exports.get(bufs[b]) for b in used]
        starts = np.zeros(max(used, default=-1) + 1, dtype=np.int64)
        base = 0
        for b, e in zip(used, exports):
            starts[b] = base
            base += e.flat.numel()
        table = b"".join([struct.pack("!H", len(exports))]
                         + [_BUF.pack(e.eid, e.ipc.ljust(64, b"\0"), e.offset, e.flat.numel()) for e in exports])
        if len(self._tables) >= 256:                  # pools and layer ranges come and go: bounded
            self._tables.clear()
        self._tables[key] = (bufs, tuple(bufs[b] for b in used), table, starts)
        return table, starts

    def _body(self, grant: Any, layers: tuple[int, int], sums: bytes, what: str = "") -> bytes:
        spans: Spans = grant.spans
        pool = spans.pool
        check_pool(pool)
        seg = spans.segment_array           # (n, 3): thousands of pieces, no Python loop over them
        table, starts = self._table(pool, tuple(np.unique(seg[:, 0]).tolist()))
        eid, ehandle = self.exports.record(pool.device)
        c = getattr(grant, "claim", None)
        return b"".join([FENCE.pack(c.epoch, c.counter) if c is not None else FENCE.pack(0, 0),
                         encode_layers(*layers, sums), _PROC.pack(bytes(16), 0), _EVENT.pack(eid, ehandle), table,
                         struct.pack("!I", len(seg)),
                         np.stack([starts[seg[:, 0]] + seg[:, 1], seg[:, 2]], axis=1).astype(_RUNS_DTYPE).tobytes()])


@dataclass
class _Mapped:
    """A parsed MAPPED body: whose exports, which event, which buffers (not opened yet)."""

    local: bool
    event: tuple[bytes, bytes]
    buffers: list[tuple[bytes, bytes, int, int]]     # (export id, IPC handle, offset, nbytes)
    bases: list[int]

    def pieces(self, runs: np.ndarray) -> np.ndarray:
        """The runs (offsets into the concatenation of the buffers) as ``(buffer, offset, nbytes)``
        pieces, ``(n, 3)``; runs may jump back and forth between buffers."""
        bases = np.asarray(self.bases, dtype=np.int64)
        i = np.searchsorted(bases, runs[:, 0], side="right") - 1
        return np.stack([i, runs[:, 0] - bases[i], runs[:, 1]], axis=1)


def _parse_mapped(body: bytes, pos: int, local: bool) -> tuple[_Mapped, np.ndarray]:
    """``local``: the peer is this process (from the kernel, ``SO_PEERCRED``: a peer that only
    says so would have this process copy into and out of its own exports where it chose)."""
    try:
        eid, ehandle = _EVENT.unpack_from(body, pos + _PROC.size)
        p = pos + _PROC.size + _EVENT.size
        (nbuf,) = struct.unpack_from("!H", body, p)
        p += 2
        bufs = [_BUF.unpack_from(body, p + k * _BUF.size) for k in range(nbuf)]
        p += nbuf * _BUF.size
        (nruns,) = struct.unpack_from("!I", body, p)
        p += 4
        if len(body) != p + nruns * _RUN.size:
            raise ProtocolError("MAPPED frame has the wrong length")
        raw = np.frombuffer(body, dtype=_RUNS_DTYPE, count=2 * nruns, offset=p).reshape(-1, 2)
    except (struct.error, ValueError):
        raise ProtocolError("MAPPED frame is malformed") from None
    bases, total = [], 0
    for _, _, _, n in bufs:
        bases.append(total)
        total += n
    # every run inside one buffer (compared as unsigned first: the peer's numbers may be anything)
    if len(raw) and not (int(raw[:, 0].max()) <= total and int(raw[:, 1].max()) <= total):
        raise ProtocolError("peer named bytes outside the buffers it exported")
    runs = raw.astype(np.int64)
    if len(runs):
        ends = np.asarray(bases, dtype=np.int64) + np.asarray([b[3] for b in bufs], dtype=np.int64)
        k = np.searchsorted(np.asarray(bases, dtype=np.int64), runs[:, 0], side="right") - 1
        if (k < 0).any() or (runs[:, 0] + runs[:, 1] > ends[np.maximum(k, 0)]).any():
            raise ProtocolError("peer named bytes outside the buffers it exported")
    return _Mapped(local, (eid, ehandle), [(e, h, o, n) for e, h, o, n in bufs], bases), runs


class _DeviceMemory:
    """A device pointer as ``__cuda_array_interface__`` (no ownership), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


class NVLinkTransport(ShmTransport):
    """CUDA IPC between processes on one host (and direct copies within one process)."""

    scheme = "nvlink"
    server_class = NVLinkServer
    claims_on_read = True
    validates_after_read = False   # not shm's re-check: its leased fetches keep the store's validate

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        super().__init__(timeout, secret)
        # export id -> (device, opened base, the opened allocation's size)
        self._ipc: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()
        self._ipc_events: dict[bytes, tuple[int, int]] = {}              # event id -> (device, opened event)
        self._busy: dict[bytes, int] = {}
        self.opened = 0          # cudaIpcOpenMemHandle calls made (the cache's misses)

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Timeout = Timeout()) -> Server:
        pool = getattr(source, "pool", None)
        if pool is not None:
            check_pool(pool)
        return super().serve(url, source, timeout)

    def _runs(self, body: bytes, pos: int, writable: bool, peer: Peer) -> tuple[Any, Any]:
        return _parse_mapped(body, pos, peer.pid == os.getpid())

    # -- mappings ------------------------------------------------------------------------------
    def _device_of(self, pool: Any) -> int:
        if pool.device.type == "cuda":
            return int(pool.device.index if pool.device.index is not None else torch.cuda.current_device())
        return torch.cuda.current_device()

    def _flats(self, m: _Mapped, device: int) -> tuple[list[torch.Tensor], list[bytes]]:
        """The peer's buffers as flat uint8 tensors: its own tensors in this process, else IPC
        mappings opened on ``device`` (once per export, cached); and the exports now held busy
        (release them with :meth:`_release` once the copy has completed)."""
        if m.local:
            with _local_lock:
                try:
                    return [_LOCAL[eid] for eid, _, _, _ in m.buffers], []
                except KeyError:
                    raise StaleHandle("the sender's exports are gone (its server closed)") from None
        if any(n and not any(h) for _, h, _, n in m.buffers):
            raise ConfigError("the peer's pool is not CUDA memory; nvlink:// maps such a pool only "
                              "within its own process")
        cp = cupy_or_error()
        out: list[torch.Tensor] = []
        held: list[bytes] = []
        try:
            for eid, handle, offset, nbytes in m.buffers:
                if not nbytes:
                    out.append(torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}"))
                    continue
                base, size = self._open(cp, eid, handle, device)
                held.append(eid)
                if offset > size or nbytes > size - offset:    # the peer's numbers, held to the mapping
                    raise ProtocolError(f"peer named {nbytes} bytes at {offset} of a {size}-byte CUDA allocation")
                t = torch.as_tensor(_DeviceMemory(base + offset, nbytes), device=torch.device("cuda", device))
                if t.data_ptr() != base + offset or t.numel() != nbytes or t.dtype != torch.uint8:
                    raise ConfigError("torch did not wrap the mapped CUDA memory in place "
                                      f"(got {t.dtype} x {t.numel()} at {t.data_ptr():#x} on {t.device})")
                out.append(t)
        except BaseException:
            self._release(held)
            raise
        return out, held

    def _open(self, cp: Any, eid: bytes, handle: bytes, device: int) -> tuple[int, int]:
        """(base, size) of the peer's allocation ``handle``, opened on ``device`` once (cached)."""
        with self._lock:
            got = self._ipc.get(eid)
            if got is not None:
                self._ipc.move_to_end(eid)
                self._busy[eid] = self._busy.get(eid, 0) + 1
                return got[1], got[2]
        try:
            with cp.cuda.Device(device):
                base = int(cp.cuda.runtime.ipcOpenMemHandle(handle))
        except _cuda_errors(cp) as exc:
            raise StaleHandle(f"cannot open the sender's CUDA memory: {exc}",
                              hint="the sender process may have exited") from None
        try:
            with cp.cuda.Device(device):
                size = _allocation_range(base)[1]     # how far the mapping reaches, from the driver
        except _cuda_errors(cp) as exc:
            self._close_ipc(cp, device, base)
            raise StaleHandle(f"cannot size the sender's CUDA memory: {exc}") from None
        evict: list[tuple[bytes, tuple[int, int, int]]] = []
        with self._lock:
            old = self._ipc.get(eid)
            if old is not None:               # another thread opened it meanwhile: keep one
                evict.append((eid, (device, base, size)))
                base, size = old[1], old[2]
            else:
                self._ipc[eid] = (device, base, size)
                self.opened += 1
            self._busy[eid] = self._busy.get(eid, 0) + 1
            for k in list(self._ipc):
                if len(self._ipc) <= MAX_OPEN:
                    break
                if not self._busy.get(k):
                    evict.append((k, self._ipc.pop(k)))
        for _, (dev, ptr, _) in evict:
            self._close_ipc(cp, dev, ptr)
        return base, size

    def _release(self, eids: list[bytes]) -> None:
        with self._lock:
            for eid in eids:
                n = self._busy.get(eid, 0) - 1
                if n > 0:
                    self._busy[eid] = n
                else:
                    self._busy.pop(eid, None)

    @staticmethod
    def _close_ipc(cp: Any, device: int, ptr: int) -> None:
        try:
            with cp.cuda.Device(device):
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
        except _cuda_errors(cp):
            pass

    def _wait_event(self, m: _Mapped, device: int) -> None:
        """Order this device's current stream after the writes the peer's stream had queued at MAP."""
        eid, handle = m.event
        if eid == _NO_EVENT:
            return
        cp = cupy_or_error()
        try:
            with cp.cuda.Device(device):
                if m.local:
                    with _local_lock:
                        ptr = _LOCAL_EVENTS.get(eid)
                    if ptr is None:
                        raise StaleHandle("the sender's server closed")
                else:
                    with self._lock:
                        got = self._ipc_events.get(eid)
                    if got is None:
                        ptr = int(cp.cuda.runtime.ipcOpenEventHandle(handle))
                        with self._lock:
                            self._ipc_events.setdefault(eid, (device, ptr))
                            ptr = self._ipc_events[eid][1]
                    else:
                        ptr = got[1]
                cp.cuda.runtime.streamWaitEvent(_stream(device), ptr)
        except _cuda_errors(cp) as exc:
            raise StaleHandle(f"cannot wait on the sender's CUDA event: {exc}") from None

    def _move(self, m: _Mapped, device_pool: Any, into_peer: bool, mine: Any,
              theirs: Any) -> int:
        """Copy between this side's pool and the peer's mapped buffers; complete on return."""
        cuda = device_pool.device.type == "cuda" or not m.local
        if cuda:
            cupy_or_error()                     # a peer in another process needs CUDA IPC: say so, plainly
        dev = self._device_of(device_pool) if cuda else -1
        peer, held = self._flats(m, dev)
        try:
            if cuda:
                self._wait_event(m, dev)
            own = flat_buffers(device_pool.buffers)
            if into_peer:
                n = copy_pieces(peer, theirs, own, mine)
            else:
                n = copy_pieces(own, mine, peer, theirs)
            if cuda:                                       # the copy is done before DONE says so
                for d in {t.device for t in peer + own if t.device.type == "cuda"}:
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record(torch.cuda.current_stream(d))
                    ev.synchronize()
        finally:
            del peer
            self._release(held)
        return n

    def _copy_in(self, dst: Spans, m: Any, runs: Any) -> int:  # type: ignore[override]
        return self._move(m, dst.pool, False, dst.segment_array, m.pieces(runs))

    def _copy_out(self, src: Spans, m: Any, runs: Any) -> int:  # type: ignore[override]
        return self._move(m, src.pool, True, src.segment_array, m.pieces(runs))

    def extra(self, name: str, default: Any = None) -> Any:
        if name == "ipc_mappings":
            return len(self._ipc)
        if name == "ipc_opened":
            return self.opened
        return super().extra(name, default)

    def close(self) -> None:
        with self._lock:
            maps, events = list(self._ipc.values()), list(self._ipc_events.values())
            self._ipc.clear()
            self._ipc_events.clear()
            self._busy.clear()
        if maps or events:
            cp = cupy_or_error()
            for dev, ptr, _ in maps:
                self._close_ipc(cp, dev, ptr)
            for dev, ptr in events:
                try:
                    with cp.cuda.Device(dev):
                        cp.cuda.runtime.eventDestroy(ptr)
                except _cuda_errors(cp):
                    pass
        super().close()

