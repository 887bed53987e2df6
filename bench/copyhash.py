"""A verified copy against the copy alone: ``python -m bench.copyhash``.

What the receiver's C pass costs per block size, one process, one thread, all buffers
preallocated and touched, interleaved per repetition (the order rotates) so load hits all
alike:

- ``memmove``: ``ctypes.memmove`` of the block (the ceiling);
- ``copy``: ``copy_blocks`` without a hash;
- ``copy+hash``: ``copy_blocks`` with the xxh3 of what landed, the fastest path the extension
  has here (one pass where ``_kvcopy.FUSED``: with AVX-512F where it is 2);
- ``copy+hash (AVX2)``: the same one pass with AVX2 registers (where ``FUSED`` is 2; where it is 1
  this is the row above again);
- ``copy then hash``: the same with the chunked path (copy 64 KiB, hash it while in cache);
- ``hash``: ``hash_blocks`` of the block alone;
- ``copy+hash, 2 parts`` / ``..., 2 threads``: the same bytes as a block of two parts (K and V
  halves, as a one-layer KV block is), copied and hashed on the calling thread alone, then with
  the extension's helper thread (``copy_threads(2)``: from 1 MiB, each part on its own thread;
  a block's checksum combines its parts' digests, ``kvbridge.integrity.combine``).

Each row's ratio is memmove's median time over the row's (higher is better). With
``--evict``, a 4 MiB copy runs before every timed call, so each starts with its bytes out of
the core's L2 (as in an interleaved transfer benchmark).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import time
from typing import Any, Callable

from bench._report import emit, log, summarize
from bench._transport_cases import KiB, MiB, fmt_size, host_buffer

SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]


def main(argv: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes in bytes")
    ap.add_argument("--reps", type=int, default=7, help="repetitions (default 7)")
    ap.add_argument("--evict", action="store_true", help="evict L2 before every timed call")
    ap.add_argument("--out", default="/tmp/kvbridge-bench/copyhash.json")
    args = ap.parse_args(argv)
    from kvbridge import _kvcopy
    from kvbridge.blockcopy import copy_blocks, copy_threads, hash_blocks, pack_planes

    ev_src, ev_dst = host_buffer(4 * MiB, seed=5), host_buffer(4 * MiB, value=0)
    before = copy_threads()
    rows: list[dict[str, Any]] = []
    for size in [int(x) for x in args.sizes.split(",")]:
        src, dst = host_buffer(size, seed=1), host_buffer(size, value=0)
        sp = pack_planes([(src.data_ptr(), size, src.data_ptr() + size)])
        dp = pack_planes([(dst.data_ptr(), size, dst.data_ptr() + size)])
        half = size // 2
        sp2 = pack_planes([(src.data_ptr(), half, src.data_ptr() + half),
                           (src.data_ptr() + half, half, src.data_ptr() + size)])
        dp2 = pack_planes([(dst.data_ptr(), half, dst.data_ptr() + half),
                           (dst.data_ptr() + half, half, dst.data_ptr() + size)])

        def two_parts(threads: int) -> Callable[[], Any]:
            def run() -> Any:
                return copy_blocks(dp2, [0], sp2, [0], half, 1)
            run.threads = threads        # type: ignore[attr-defined]  # set before the timer starts
            return run
        modes: dict[str, Callable[[], Any]] = {
            "memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), size),
            "copy": lambda: copy_blocks(dp, [0], sp, [0], size, 0),
            "copy+hash": lambda: copy_blocks(dp, [0], sp, [0], size, 1),
            "copy+hash (AVX2)": lambda: copy_blocks(dp, [0], sp, [0], size, 3),
            "copy then hash": lambda: copy_blocks(dp, [0], sp, [0], size, 2),
            "hash": lambda: hash_blocks(sp, [0], size, 1),
            "copy+hash, 2 parts": two_parts(1),
            "copy+hash, 2 parts, 2 threads": two_parts(2),
        }
        iters = max(20, min(4000, (64 * MiB) // size))
        samples: dict[str, list[float]] = {m: [] for m in modes}
        names = list(modes)
        for f in modes.values():
            f()
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            acc = dict.fromkeys(names, 0.0)
            for _ in range(iters):
                for name in order:
                    if args.evict:
                        ctypes.memmove(ev_dst.data_ptr(), ev_src.data_ptr(), 4 * MiB)
                    copy_threads(getattr(modes[name], "threads", 1), before["spin_us"])
                    t0 = time.perf_counter()
                    modes[name]()
                    acc[name] += time.perf_counter() - t0
            for name in names:
                samples[name].append(acc[name] / iters)
        want = copy_blocks(dp, [0], sp, [0], size, 1)
        if (want != copy_blocks(dp, [0], sp, [0], size, 2) or want != copy_blocks(dp, [0], sp, [0], size, 3)
                or want != hash_blocks(sp, [0], size, 1)):
            raise AssertionError(f"{fmt_size(size)}: the paths disagree")
        copy_threads(1, before["spin_us"])
        one = two_parts(1)()
        copy_threads(2, before["spin_us"])
        if one != two_parts(2)():
            raise AssertionError(f"{fmt_size(size)}: one and two threads disagree")
        copy_threads(before["threads"], before["spin_us"])
        for name in names:
            ratios = [m / t for m, t in zip(samples["memmove"], samples[name])]
            rows.append({"size": size, "mode": name, "us": summarize([t * 1e6 for t in samples[name]]),
                         "ratio": summarize(ratios)})
        log(f"{fmt_size(size)}: " + ", ".join(f"{n} {statistics.median(samples[n]) * 1e6:.1f} us" for n in names))
    md = ["| size | mode | µs (median) | memmove time / this [min–max] |", "|---|---|---:|---|"]
    for r in rows:
        q = r["ratio"]
        md.append(f"| {fmt_size(r['size'])} | {r['mode']} | {r['us']['median']:.2f} | "
                  f"{q['median']:.2f} [{q['min']:.2f}–{q['max']:.2f}] |")
    data = {"fused": _kvcopy.FUSED, "evict": args.evict, "copy_threads": before, "reps": args.reps,
            "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "rows": rows}
    emit("\n".join(md) + "\n", data, args.out)
    return data


if __name__ == "__main__":
    main()
