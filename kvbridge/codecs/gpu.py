"""CUDA kernels of the lossy codecs, compiled at run time from ``native/*.cu`` by CuPy (NVRTC).

Users need no ``nvcc``: ``pip install 'kvbridge[cupy]'`` and a CUDA device. The kernels
fuse the gather of scattered pool blocks with quantization (encode) and dequantization
with the scatter back into the destination pool (decode); their results are defined by
the torch functions in :mod:`kvbridge.codecs.quant` (int8 bit for bit; fp8 likewise by
construction, tested within one e4m3 step). Device addresses of the parts come from
:class:`~kvbridge.layout.KVLayout`'s byte offsets, one per (layer, part, block), built with
tensor arithmetic (no Python object per block).

Without CuPy the lossy codecs run their torch definitions on the device instead
(:func:`kernels_or_none` returns ``None``); :func:`load_kernels` raises
:class:`BackendUnavailable` naming the extra.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import BackendUnavailable, ConfigError
from ..pool import KVPool

__all__ = ["native_dir", "source", "GpuKernels", "load_kernels", "kernels_or_none", "part_pointers",
           "KERNEL_NAMES", "supports"]

_TYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_KINDS = {"int8": ("int8", "rows"), "fp8": ("fp8", "rows"), "fp8-block": ("fp8", "parts")}
KERNEL_NAMES = tuple(f"{op}_{g}_{q}_{t}" for op in ("gather_quant", "dequant_scatter")
                     for g in ("rows", "vrows", "parts") for q in ("int8", "fp8") for t in ("f32", "f16", "bf16"))
_WARPS_PER_CTA = 8
_PART_THREADS = 256
_lock = threading.Lock()
_cache: dict[int, "GpuKernels"] = {}


def native_dir() -> Path:
    """The ``native/`` directory of the source tree this package was loaded from."""
    return Path(__file__).resolve().parents[2] / "native"


def source(name: str = "kv_codecs.cu") -> str:
    path = native_dir() / name
    try:
        return path.read_text()
    except OSError as exc:
        raise BackendUnavailable(f"CUDA kernel source {path} not found ({exc})",
                                 hint="install kvbridge from its source tree (pip install -e .)") from None


def part_pointers(pool: KVPool, idx: torch.Tensor, layers: range) -> torch.Tensor:
    """Device address of each part of blocks ``idx`` in canonical order (layer, part, block), int64,
    from :meth:`KVLayout.part_base_stride` and :meth:`KVLayout.buffer_index`."""
    L = pool.layout
    out = []
    for layer in layers:
        for part in range(L.num_parts):
            base, stride = L.part_base_stride(part, pool.num_blocks)
            addr = pool.buffers[L.buffer_index(layer, part)].data_ptr() + base
            out.append(idx * stride + addr)
    return torch.cat(out).to(device=pool.device, dtype=torch.int64)


# IEEE arithmetic spelled out (NVRTC's defaults today, but the twin's bit-exactness rests on it):
# subnormals kept (a tiny group's scale is often subnormal), correctly rounded QMAX / amax, and no
# multiply-add contraction.
NVRTC_OPTIONS = ("--std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")


class GpuKernels:
    """The compiled module for one device, and launchers for the codecs in ``quant.py``."""

    def __init__(self, device: torch.device) -> None:
        try:
            import cupy  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise BackendUnavailable("GPU codec kernels need CuPy", hint="pip install 'kvbridge[cupy]'") from None
        self.cupy: Any = cupy
        self.device = device
        self.vectorize = True  # 16-byte loads when the geometry allows (tests turn it off to compare)
        with cupy.cuda.Device(device.index or 0):
            try:
                self.module = cupy.RawModule(code=source(), options=NVRTC_OPTIONS)
                self.kernels = {n: self.module.get_function(n) for n in KERNEL_NAMES}
            except cupy.cuda.compiler.CompileException as exc:
                raise ConfigError(f"native/kv_codecs.cu does not compile with NVRTC: {exc}") from None

    def _stream(self) -> Any:
        return self.cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)

    def _launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        with self.cupy.cuda.Device(self.device.index or 0), self._stream():
            self.kernels[name]((grid,), (block,), args)

    def _lanes(self, pool: KVPool, q: torch.Tensor) -> int:
        """Threads per row for the vectorized row kernels, or 0 when they do not apply."""
        L = pool.layout
        width = 16 // L.itemsize
        lanes = L.head_dim // width
        aligned = (L.part_nbytes % 16 == 0 and q.data_ptr() % 8 == 0
                   and all(b.data_ptr() % 16 == 0 for b in pool.buffers))
        ok = self.vectorize and aligned and L.head_dim % width == 0 and 0 < lanes <= 32 and lanes & (lanes - 1) == 0
        return lanes if ok else 0

    def encode(self, kind: str, pool: KVPool, idx: torch.Tensor, layers: range, group: int,
               scales: torch.Tensor, q: torch.Tensor) -> None:
        """Gather blocks ``idx`` of ``layers`` and quantize them into ``scales`` and ``q``."""
        import numpy as np

        qn, g = _KINDS[kind]
        L = pool.layout
        t = _TYPE_NAMES.get(L.torch_dtype)
        if t is None:
            raise ConfigError(f"GPU codec kernels take float32/float16/bfloat16 pools, not {L.dtype}")
        ptrs = part_pointers(pool, idx, layers)
        bad = torch.zeros(1, dtype=torch.int32, device=pool.device)
        rows_per_part = L.block_size * L.num_kv_heads
        lanes = self._lanes(pool, q)
        if g == "rows" and lanes:
            rows = ptrs.numel() * rows_per_part
            args: tuple[Any, ...] = (np.uint64(ptrs.data_ptr()), np.int64(rows), np.int32(rows_per_part),
                                     np.int32(L.head_dim), np.int32(lanes), np.uint64(q.data_ptr()),
                                     np.uint64(scales.data_ptr()), np.uint64(bad.data_ptr()))
            self._launch(f"gather_quant_vrows_{qn}_{t}", -(-rows * lanes // 256), 256, args)
        elif g == "rows":
            rows = ptrs.numel() * rows_per_part
            grid = -(-rows // _WARPS_PER_CTA)
            args = (np.uint64(ptrs.data_ptr()), np.int64(rows), np.int32(rows_per_part),
                    np.int32(L.head_dim), np.uint64(q.data_ptr()), np.uint64(scales.data_ptr()),
                    np.uint64(bad.data_ptr()))
            self._launch(f"gather_quant_rows_{qn}_{t}", grid, 32 * _WARPS_PER_CTA, args)
        else:
            args = (np.uint64(ptrs.data_ptr()), np.int32(group), np.uint64(q.data_ptr()),
                    np.uint64(scales.data_ptr()), np.uint64(bad.data_ptr()))
            self._launch(f"gather_quant_parts_{qn}_{t}", ptrs.numel(), _PART_THREADS, args)
        if int(bad.item()):
            raise ConfigError("KV holds non-finite values (inf/nan) that a scaled codec cannot encode; "
                              "use a lossless codec")

    def decode(self, kind: str, pool: KVPool, idx: torch.Tensor, layers: range, group: int,
               scales: torch.Tensor, q: torch.Tensor) -> None:
        """Dequantize ``scales``/``q`` and scatter into blocks ``idx`` of ``layers`` in the pool's dtype."""
        import numpy as np

        qn, g = _KINDS[kind]
        L = pool.layout
        t = _TYPE_NAMES.get(L.torch_dtype)
        if t is None:
            raise ConfigError(f"GPU codec kernels take float32/float16/bfloat16 pools, not {L.dtype}")
        ptrs = part_pointers(pool, idx, layers)
        rows_per_part = L.block_size * L.num_kv_heads
        lanes = self._lanes(pool, q)
        if g == "rows" and lanes:
            rows = ptrs.numel() * rows_per_part
            args: tuple[Any, ...] = (np.uint64(ptrs.data_ptr()), np.int64(rows), np.int32(rows_per_part),
                                     np.int32(L.head_dim), np.int32(lanes), np.uint64(q.data_ptr()),
                                     np.uint64(scales.data_ptr()))
            self._launch(f"dequant_scatter_vrows_{qn}_{t}", -(-rows * lanes // 256), 256, args)
        elif g == "rows":
            rows = ptrs.numel() * rows_per_part
            args = (np.uint64(ptrs.data_ptr()), np.int64(rows), np.int32(rows_per_part),
                    np.int32(L.head_dim), np.uint64(q.data_ptr()), np.uint64(scales.data_ptr()))
            self._launch(f"dequant_scatter_rows_{qn}_{t}", -(-rows // _WARPS_PER_CTA), 32 * _WARPS_PER_CTA, args)
        else:
            args = (np.uint64(ptrs.data_ptr()), np.int32(group), np.uint64(q.data_ptr()),
                    np.uint64(scales.data_ptr()))
            self._launch(f"dequant_scatter_parts_{qn}_{t}", ptrs.numel(), _PART_THREADS, args)


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels read and write pools of ``dtype``."""
    return dtype in _TYPE_NAMES


def load_kernels(device: Optional[torch.device] = None) -> GpuKernels:
    """The kernels compiled for ``device`` (cached). Raises :class:`BackendUnavailable` without CuPy
    or CUDA."""
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise BackendUnavailable("GPU codec kernels need a CUDA device", hint="run on a machine with a GPU")
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    with _lock:
        k = _cache.get(key)
        if k is None:
            k = _cache[key] = GpuKernels(torch.device("cuda", key))
    return k


def kernels_or_none(device: torch.device) -> Optional[GpuKernels]:
    """:func:`load_kernels`, or ``None`` when CuPy is not installed (codecs then run their torch
    definitions on the device)."""
    try:
        return load_kernels(device)
    except BackendUnavailable:
        return None
