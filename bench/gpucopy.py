"""Where a block-shaped device copy's time goes: ``python -m bench.gpucopy [--out FILE.json]``.

nvlink:// and device staging move a handle's pieces with one launch of ``native/kv_copy.cu``
(:mod:`kvbridge.transports.gpucopy`). This bench takes that path apart on one GPU, in one
process, for block-shaped handles (32 layers, pieces of 16 and 32 KiB, 128 MiB in all), each part
against a ceiling measured in the same run (medians of alternating rounds):

- the whole ``copy_pieces`` (the plan from the handle's piece lists, the table's upload, the
  launch, a synchronize) vs. one device-to-device ``copy_`` of the same bytes;
- the kernel alone (CUDA events around a launch over a table already on the device);
- the plan alone (host time: pieces to chunk table), from tuples and from arrays, and the
  handle's pieces as a list of tuples and as an array;
- a candidate kernel that keeps four 16-byte loads in flight per thread;
- the same gathers done by hand with torch (``dst[:, ids] = src[:, ids]`` per layer).

Without a CUDA device and CuPy it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

UNROLLED = r"""
typedef unsigned long long u64;
extern "C" __global__ void kvb_copy_chunks4(const u64* chunks, long long n) {
  for (long long c = blockIdx.x; c < n; c += gridDim.x) {
    const u64 s = chunks[3 * c], d = chunks[3 * c + 1], len = chunks[3 * c + 2];
    if (((s | d | len) & 15) == 0) {
      const uint4* __restrict__ src = reinterpret_cast<const uint4*>(s);
      uint4* __restrict__ dst = reinterpret_cast<uint4*>(d);
      const u64 words = len / 16, step = blockDim.x;
      u64 i = threadIdx.x;
      for (; i + 3 * step < words; i += 4 * step) {
        uint4 a = src[i], b = src[i + step], e = src[i + 2 * step], f = src[i + 3 * step];
        dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = e; dst[i + 3 * step] = f;
      }
      for (; i < words; i += step) dst[i] = src[i];
    } else {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(s);
      unsigned char* dst = reinterpret_cast<unsigned char*>(d);
      for (u64 i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
    }
  }
}
"""


def _med(fn: Callable[[], Any], rounds: int) -> float:
    xs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def _events(fn: Callable[[], Any], rounds: int) -> float:
    xs = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()  # type: ignore[no-untyped-call]
        fn()
        b.record()  # type: ignore[no-untyped-call]
        b.synchronize()  # type: ignore[no-untyped-call]
        xs.append(a.elapsed_time(b) / 1e3)  # type: ignore[no-untyped-call]
    return statistics.median(xs)


def measure(rounds: int) -> list[dict[str, Any]]:
    import cupy  # type: ignore[import-not-found,unused-ignore]

    from kvbridge import KVLayout, KVPool
    from kvbridge.codecs.gpu import NVRTC_OPTIONS
    from kvbridge.transports import Spans
    from kvbridge.transports.gpucopy import _kernel, plan
    from kvbridge.transports.staging import copy_pieces, flat_buffers

    rows: list[dict[str, Any]] = []
    unrolled = cupy.RawModule(code=UNROLLED, options=NVRTC_OPTIONS).get_function("kvb_copy_chunks4")
    rng = np.random.default_rng(0)
    for piece_kib, blocks in ((32, 64), (16, 128)):
        # block-shaped: K and V of 32 layers, each block's part in one layer `piece_kib` KiB
        layout = KVLayout(num_layers=32, block_size=16, num_kv_heads=piece_kib * 1024 // (16 * 2 * 128),
                          head_dim=128, dtype="float16")
        pool_blocks = blocks * 4
        src_pool = KVPool.allocate(layout, pool_blocks, device="cuda")
        dst_pool = KVPool.allocate(layout, pool_blocks, device="cuda")
        for b in src_pool.buffers:
            b.normal_()
        src_ids = rng.choice(pool_blocks, blocks, replace=False).tolist()
        dst_ids = rng.choice(pool_blocks, blocks, replace=False).tolist()
        nbytes = blocks * layout.block_nbytes
        fsrc, fdst = flat_buffers(src_pool.buffers), flat_buffers(dst_pool.buffers)
        ssegs, dsegs = Spans.of_blocks(src_pool, src_ids).segments, Spans.of_blocks(dst_pool, dst_ids).segments
        sarr, darr = np.asarray(ssegs, dtype=np.int64), np.asarray(dsegs, dtype=np.int64)
        chunks = plan(fdst, darr, fsrc, sarr)
        table = torch.from_numpy(np.ascontiguousarray(chunks).reshape(-1)).cuda()
        fn = _kernel(torch.cuda.current_device())
        scratch_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        scratch_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        grid = (min(len(chunks), 1 << 20),)

        def launch(f: Any = fn) -> None:
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                f(grid, (256,), (np.uint64(table.data_ptr()), np.int64(len(chunks))))

        def by_hand() -> None:
            for li in range(len(src_pool.buffers)):
                s, d = src_pool.buffers[li], dst_pool.buffers[li]     # [K/V, block, ...]
                d[:, dst_ids] = s[:, src_ids]

        for f in (lambda: copy_pieces(fdst, dsegs, fsrc, ssegs), launch, lambda: launch(unrolled), by_hand,
                  lambda: scratch_b.copy_(scratch_a)):
            f()                                               # warm (and compile)
        torch.cuda.synchronize()
        parts = {
            "copy_pieces (tuples, whole)": _med(lambda: copy_pieces(fdst, dsegs, fsrc, ssegs), rounds),
            "copy_pieces (arrays, whole)": _med(lambda: copy_pieces(fdst, darr, fsrc, sarr), rounds),
            "kernel alone (events)": _events(launch, rounds),
            "candidate kernel, 4 loads in flight (events)": _events(lambda: launch(unrolled), rounds),
            "torch gathers by hand (dst[:, ids] = src[:, ids] per layer)": _med(by_hand, rounds),
            "d2d copy_ of the same bytes (ceiling)": _med(lambda: scratch_b.copy_(scratch_a), rounds),
        }
        t0 = time.perf_counter()
        for _ in range(rounds):
            plan(fdst, dsegs, fsrc, ssegs)
        parts["plan alone from tuples (host)"] = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            Spans.of_blocks(src_pool, src_ids).segments
        parts["handle's piece list (Spans.of_blocks(...).segments, host)"] = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            Spans.of_blocks(src_pool, src_ids).segment_array
        parts["handle's piece array (Spans.of_blocks(...).segment_array, host)"] = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            plan(fdst, darr, fsrc, sarr)
        parts["plan alone from arrays (host)"] = (time.perf_counter() - t0) / rounds
        ok = all(torch.equal(d[:, dst_ids], s[:, src_ids]) for s, d in zip(src_pool.buffers, dst_pool.buffers))
        ceiling = parts["d2d copy_ of the same bytes (ceiling)"]
        for what, s in parts.items():
            rows.append({"shape": f"32 layers x {blocks} blocks, {piece_kib} KiB pieces ({len(ssegs)} pieces, "
                                  f"{len(chunks)} chunks)", "what": what, "seconds": s,
                         "GBps": nbytes / s / 1e9, "ceiling_time_over_this": ceiling / s, "bytes_equal": ok})
            print(f"  {piece_kib} KiB pieces: {what}: {s * 1e3:.3f} ms, {nbytes / s / 1e9:.1f} GB/s, "
                  f"ceiling/this {ceiling / s:.3f}", flush=True)
    return rows


def no_gpu() -> str:
    """Why the GPU benches cannot run here ("" where they can)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    why = no_gpu()
    if why:
        print(f"bench.gpucopy: {why}; nothing to measure")
        return 0
    rows = measure(a.rounds)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
