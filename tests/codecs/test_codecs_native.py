"""The CUDA kernels in ``native/``: every ``.cu`` compiles with nvcc (no GPU needed), their element
conversions match torch bit for bit on the host, and on a GPU each fused kernel matches its torch
twin (int8 bit-exact; fp8 codes within one e4m3 step, stated below)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from kvcodec_helpers import LAYOUTS, assert_bits_equal, fill_pool

from kvbridge.codecs import gpu
from kvbridge.codecs.quant import FP8Codec, Int8Codec
from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool

pytestmark = pytest.mark.timeout(120)

NATIVE = gpu.native_dir()
CU_FILES = sorted(NATIVE.glob("*.cu"))
NVCC = shutil.which("nvcc")
ENTRIES = {"kv_codecs.cu": set(gpu.KERNEL_NAMES), "kv_copy.cu": {"kvb_copy_chunks"}}   # what each file defines
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (install the CUDA toolkit to compile native/)")


def test_native_sources_exist() -> None:
    assert [p.name for p in CU_FILES] == sorted(ENTRIES)
    assert "KVB_ROW_KERNELS(int8, QInt8, bf16, bf16)" in gpu.source()


@needs_nvcc
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_nvcc_compiles(cu: Path, tmp_path: Path) -> None:
    ptx = tmp_path / (cu.stem + ".ptx")
    r = subprocess.run([str(NVCC), "-std=c++17", "-arch=sm_90", "--ptx", str(cu), "-o", str(ptx)],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    entries = {line.split()[-1].rstrip("(") for line in ptx.read_text().splitlines() if ".entry" in line}
    assert ENTRIES[cu.name] <= entries, sorted(ENTRIES[cu.name] - entries)


def _nvrtc() -> "ctypes.CDLL | None":
    """NVRTC (what CuPy compiles with at run time): the nvidia-cuda-nvrtc wheel, or the system's."""
    import ctypes.util
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    bases = list(spec.submodule_search_locations or []) if spec is not None else []
    paths = [p for base in bases for p in sorted(glob.glob(f"{base}/cuda_nvrtc/lib/libnvrtc.so*"))
             if "builtins" not in p and ".alt." not in p]
    found = ctypes.util.find_library("nvrtc")
    for path in paths + ([found] if found else []):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_nvrtc_compiles(cu: Path) -> None:
    """The run-time path: NVRTC, without the CUDA headers nvcc would add, compiles every kernel."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12, or a CUDA toolkit with libnvrtc)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), cu.read_bytes(), cu.name.encode(), 0, None, None) == 0
    args = [o.encode() for o in gpu.NVRTC_OPTIONS] + [b"-arch=compute_80"]   # the options kvbridge passes
    rc = lib.nvrtcCompileProgram(prog, len(args), (ctypes.c_char_p * len(args))(*args))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode(errors="replace")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert all(f".entry {name}(" in ptx.value.decode() for name in ENTRIES[cu.name])


@needs_nvcc
def test_element_conversions_match_torch_bit_for_bit(tmp_path: Path) -> None:
    """The __host__ __device__ conversions of kv_codecs.cu, built for the host, against torch: every
    bfloat16 value and 100k float32 values over 32 binades, with random scales."""
    exe = tmp_path / "native_check"
    r = subprocess.run([str(NVCC), "-std=c++17", "-arch=sm_90", "-o", str(exe),
                        str(Path(__file__).with_name("native_check.cu"))], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    g = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    spread = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-20, 12, (100_000,), generator=g).float())
    x = torch.cat([every_bf16, spread])
    inv = torch.exp2(torch.rand(x.numel(), generator=g) * 20 - 10)
    n = x.numel()
    np.concatenate([x.numpy(), inv.numpy()]).astype(np.float32).tofile(tmp_path / "in.bin")
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True, timeout=60)
    o = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.uint8))
    e4, b16 = o[:n], o[n:3 * n].view(torch.int16)
    qi, qf, table = o[3 * n:4 * n].view(torch.int8), o[4 * n:5 * n], o[5 * n:].view(torch.float32)
    fin = torch.isfinite(x)
    assert torch.equal(e4[fin], x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)[fin])
    assert torch.equal(b16[fin], x.to(torch.bfloat16).view(torch.int16)[fin])
    p = x * inv
    ok = torch.isfinite(p)
    assert torch.equal(qi[ok], torch.round(p).clamp(-127, 127).to(torch.int8)[ok])
    assert torch.equal(qf[ok], p.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)[ok])
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert bool(((ref == table) | (ref.isnan() & table.isnan())).all())


def _kernel_formula(x: np.ndarray, qmax: float) -> tuple[np.ndarray, np.ndarray]:
    """kv_codecs.cu's arithmetic per row, in numpy float32 (IEEE, correctly rounded division):
    up = 2^64 when 0 < amax < 2^-96; inv = QMAX / (amax * up); y = clamp(x * up * inv);
    scale = amax * float32(1/QMAX)."""
    f32 = np.float32
    m = np.abs(x).max(-1, keepdims=True)
    up = np.where((m > 0) & (m < f32(2.0 ** -96)), f32(2.0 ** 64), f32(1.0)).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(m > 0, f32(qmax) / (m * up), f32(0.0)).astype(f32)
    y = np.clip((x * up).astype(f32) * inv, -qmax, qmax).astype(f32)
    inv_q = f32(float.fromhex("0x1.020408p-7") if qmax == 127 else float.fromhex("0x1.24924ap-9"))
    return y, (m[..., 0] * inv_q).astype(f32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mul", [1.0, 2.0 ** -110, 2.0 ** -125], ids=["normal", "tiny", "subnormal"])
def test_torch_twin_computes_the_kernels_formula(dtype: torch.dtype, mul: float) -> None:
    """On the host, without a GPU: the torch twin's codes and scales equal the kernels' formula
    bit for bit (a twin that multiplied by a rounded reciprocal instead of dividing differed in
    about one code in four; the GPU test then failed)."""
    from kvbridge.codecs.quant import quantize_fp8, quantize_int8
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4000, 128, generator=g) * mul).to(dtype)
    x[7] = 0                                            # an all-zero row: scale 0, codes 0
    xf = x.float().numpy()
    y, scale = _kernel_formula(xf, 127.0)
    q, s = quantize_int8(x)
    assert np.array_equal(s.numpy(), scale)
    assert np.array_equal(q.numpy(), np.rint(y).astype(np.int8))
    y, scale = _kernel_formula(xf, 448.0)
    q, s = quantize_fp8(x)
    assert np.array_equal(s.numpy(), scale)
    assert torch.equal(q.view(torch.uint8), torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_part_pointers_are_layout_offsets(kind: str) -> None:
    pool = KVPool.allocate(LAYOUTS[kind]("float16"), 7)
    ids = [6, 0, 3]
    ptrs = gpu.part_pointers(pool, torch.tensor(ids), range(1, 3)).tolist()
    L = pool.layout
    want = [pool.buffers[buf].data_ptr() + off for layer in range(1, 3) for part in range(L.num_parts)
            for b in ids for buf, off, _ in [L.segment(layer, b, part, pool.num_blocks)]]
    assert ptrs == want


def _gpu_or_skip() -> gpu.GpuKernels:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the fused kernels run on the GPU machine (bench/gpu_codecs.sh)")
    try:
        return gpu.load_kernels(torch.device("cuda"))
    except Exception as exc:  # BackendUnavailable without CuPy
        pytest.skip(f"GPU codec kernels unavailable: {exc}")


CODECS = {"int8": lambda k: Int8Codec(use_kernels=k), "fp8": lambda k: FP8Codec(False, use_kernels=k),
          "fp8-block": lambda k: FP8Codec(True, use_kernels=k)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CODECS))
def test_kernel_matches_torch_twin(name: str) -> None:
    """Stated tolerance: int8 frames and decoded blocks bit-identical; fp8 scales bit-identical,
    e4m3 codes equal (the conversion is bit-exact on the host) or at most one code apart; decoding
    one frame through the kernel and through the twin gives bit-identical blocks."""
    kernels = _gpu_or_skip()
    try:
        for vectorize in (True, False):  # 16-byte loads (head_dim 16 and 24 below) and the scalar kernels
            kernels.vectorize = vectorize
            for dtype in ["float32", "float16", "bfloat16"]:
                for kind in ["vllm_flash", "flashinfer_hnd", "split_kv", "mla", "llama"]:
                    _compare(name, dtype, kind)
    finally:
        kernels.vectorize = True


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CODECS))
def test_kernel_matches_torch_twin_on_tiny_groups(name: str) -> None:
    """Groups whose absmax is tiny (2^-110, normal) or subnormal (2^-135) in float32 and bfloat16:
    QMAX / amax overflows float32 there, and the twin scales such groups by 2^64 first; the
    kernels must do the same (before, they wrote inf or NaN codes). Same tolerance as above."""
    kernels = _gpu_or_skip()
    try:
        for vectorize in (True, False):
            kernels.vectorize = vectorize
            for dtype in ["float32", "bfloat16"]:
                for kind in ["vllm_flash", "mla"]:
                    _compare(name, dtype, kind, tiny=True)
    finally:
        kernels.vectorize = True


def _first_difference(a: torch.Tensor, b: torch.Tensor, as_type: torch.dtype) -> str:
    """Where two byte sections first differ, and the two values there (for the failure message)."""
    n = a.numel() // torch.empty((), dtype=as_type).element_size()
    va, vb = a[:n * (a.numel() // n)].view(as_type), b[:n * (b.numel() // n)].view(as_type)
    bad = (va != vb).nonzero()
    if not len(bad):
        return "equal"
    i = int(bad[0])
    return f"{int((va != vb).sum())} of {n} differ, first at {i}: kernel {va[i].item()!r} twin {vb[i].item()!r}"


def _compare(name: str, dtype: str, kind: str, tiny: bool = False) -> None:
    layout = KVLayout.vllm_flash(2, 8, 128, 16, dtype) if kind == "llama" else LAYOUTS[kind](dtype, 16)
    host = KVPool.allocate(layout, 64)
    fill_pool(host, seed=5)
    if tiny:      # buffers by turns tiny normal, partly subnormal, as filled (exact: powers of two)
        for i, buf in enumerate(host.buffers):
            buf.mul_((2.0 ** -110, 2.0 ** -125, 1.0)[i % 3])
        assert any(bool(((b != 0) & (b.abs().float() < 2.0 ** -96)).any()) for b in host.buffers)
    pool = KVPool.allocate(host.layout, 64, device="cuda")
    for a, b in zip(pool.buffers, host.buffers):
        a.copy_(b)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40].tolist()
    fused, twin = CODECS[name](True), CODECS[name](False)
    fused.name = twin.name = name
    f1, f2 = fused.encode(pool, ids), twin.encode(pool, ids)
    sb, _ = twin.sizes(pool.layout, len(ids), pool.layout.num_layers)
    assert f1.nbytes == f2.nbytes and torch.equal(f1.data[:96].cpu(), f2.data[:96].cpu())  # headers
    s1, s2 = f1.data[96:96 + sb].cpu(), f2.data[96:96 + sb].cpu()
    assert torch.equal(s1, s2), (dtype, kind, _first_difference(s1, s2, torch.float32))  # scales: bit-identical
    codes1, codes2 = f1.data[96 + sb:].cpu(), f2.data[96 + sb:].cpu()
    if name == "int8":
        assert torch.equal(codes1, codes2), (dtype, kind, _first_difference(codes1, codes2, torch.int8))
    else:
        assert int((codes1.int() - codes2.int()).abs().max()) <= 1, (dtype, kind)
    d1 = KVPool.allocate(pool.layout, 64, device="cuda")
    d2 = KVPool.allocate(pool.layout, 64, device="cuda")
    dst_ids = list(range(40))
    fused.decode(f2, d1, dst_ids)  # the same frame through the kernel and through the twin
    twin.decode(f2, d2, dst_ids)
    for a, b in zip(d1.buffers, d2.buffers):
        assert_bits_equal(a.cpu(), b.cpu())
