"""Batched device copies: a list of pieces moved by one kernel (``native/kv_copy.cu``).

:func:`plan` turns two byte streams — the destination's and the source's pieces, each
``(buffer index, byte offset, nbytes)`` of its own flat buffers — into chunks of at most
:data:`CHUNK` bytes, ``(source address, destination address, nbytes)``, with numpy (no Python
loop per piece), after checking every piece against its buffer. :func:`copy` launches the
kernel over such a plan on the current CUDA stream: one host-to-device copy of the plan and
one launch, whatever the number of pieces. Without CuPy, or when the kernel cannot be
compiled, :func:`copy` returns ``None`` and the caller uses its row gathers
(:func:`kvbridge.transports.staging.copy_pieces` does). :func:`run_on_host` runs a plan with
``memmove``: how plans are tested without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["CHUNK", "plan", "copy", "run_on_host"]

CHUNK = 64 << 10
_THREADS = 256
_MAX_GRID = 1 << 20
_log = logging.getLogger("kvbridge.gpucopy")
_lock = threading.Lock()
_kernels: dict[int, Any] = {}          # device index -> the compiled kernel, or None (cannot load)


def _addresses(flats: Sequence[torch.Tensor], pieces: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(start address, nbytes) of each piece, after checking it lies inside its buffer."""
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    bases = np.array([t.data_ptr() for t in flats], dtype=np.int64)
    sizes = np.array([t.numel() * t.element_size() for t in flats], dtype=np.int64)
    buf, off, n = p[:, 0], p[:, 1], p[:, 2]
    if len(p) and not (((buf >= 0) & (buf < len(flats))).all() and (off >= 0).all() and (n >= 0).all()
                       and (off + n <= sizes[np.clip(buf, 0, max(len(flats) - 1, 0))]).all()):
        raise ValueError(f"a {what} piece lies outside its buffer")
    return bases[buf] + off, n


def plan(dst_flats: Sequence[torch.Tensor], dst: Any, src_flats: Sequence[torch.Tensor], src: Any,
         chunk: int = CHUNK) -> np.ndarray:
    """Chunks ``(n, 3)`` int64 copying stream ``src`` into stream ``dst`` (as far as both reach),
    cut at both streams' piece boundaries and every ``chunk`` bytes within a piece."""
    sp, sn = _addresses(src_flats, src, "source")
    dp, dn = _addresses(dst_flats, dst, "destination")
    if len(sn) == len(dn) and np.array_equal(sn, dn):          # the usual case: the same cuts
        s0, d0, lens = sp, dp, sn
    else:
        s_end, d_end = np.cumsum(sn), np.cumsum(dn)
        total = min(int(s_end[-1]) if len(s_end) else 0, int(d_end[-1]) if len(d_end) else 0)
        cuts = np.concatenate([s_end, d_end])       # both sorted: one sort, duplicates dropped
        cuts.sort(kind="stable")
        cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]]) & (cuts > 0) & (cuts <= total)]
        starts = np.concatenate([np.zeros(1, np.int64), cuts[:-1]])
        lens = cuts - starts
        si = np.searchsorted(s_end, starts, side="right")
        di = np.searchsorted(d_end, starts, side="right")
        s0 = sp[si] + (starts - (s_end[si] - sn[si]))
        d0 = dp[di] + (starts - (d_end[di] - dn[di]))
    keep = lens > 0
    s0, d0, lens = s0[keep], d0[keep], lens[keep]
    k = (lens + chunk - 1) // chunk
    if not len(k) or int(k.max()) == 1:
        return np.stack([s0, d0, lens], axis=1)
    idx = np.repeat(np.arange(len(k)), k)
    off = (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)) * chunk
    return np.stack([s0[idx] + off, d0[idx] + off, np.minimum(chunk, lens[idx] - off)], axis=1)


def run_on_host(chunks: np.ndarray) -> int:
    """Run a plan over host memory with ``memmove``, chunk by chunk (what the kernel does)."""
    for s, d, n in chunks.tolist():
        ctypes.memmove(d, s, n)
    return int(chunks[:, 2].sum()) if len(chunks) else 0


def _kernel(device: int) -> Any:
    with _lock:
        if device in _kernels:
            return _kernels[device]
    fn = None
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]

        from ..codecs.gpu import NVRTC_OPTIONS, source
        with cupy.cuda.Device(device):
            fn = cupy.RawModule(code=source("kv_copy.cu"), options=NVRTC_OPTIONS).get_function("kvb_copy_chunks")
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - any compile or load failure: the row gathers still work
        _log.warning("native/kv_copy.cu could not be loaded (%s); device copies use row gathers", exc)
    with _lock:
        return _kernels.setdefault(device, fn)


def copy(dst_flats: Sequence[torch.Tensor], dst: Any, src_flats: Sequence[torch.Tensor], src: Any) -> Optional[int]:
    """Copy stream ``src`` into ``dst`` with one kernel on the current stream of their device
    (every buffer on one CUDA device); the bytes moved, or ``None`` when the kernel is unavailable
    (no CuPy) or the buffers are not all on one CUDA device. The caller synchronizes."""
    devs = {t.device for t in list(dst_flats) + list(src_flats)}
    if len(devs) != 1:
        return None
    (dev,) = devs
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    fn = _kernel(index)
    if fn is None:
        return None
    chunks = plan(dst_flats, dst, src_flats, src)
    if not len(chunks):
        return 0
    table = torch.from_numpy(np.ascontiguousarray(chunks).reshape(-1)).to(dev)
    import cupy
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream):
        fn((min(len(chunks), _MAX_GRID),), (_THREADS,), (np.uint64(table.data_ptr()), np.int64(len(chunks))))
    return int(chunks[:, 2].sum())
