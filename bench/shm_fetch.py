"""Where an shm fetch's time goes: ``python -m bench.shm_fetch``.

One block of each size, in a sender process's shared pool (``shm://``), read by this
process; every mode runs once per round, the order rotating, each right after a ``memmove``
(as in the interleaved transfer benchmark): every call starts from the caches a copy of other
buffers left, never from the same blocks just read by another mode:

- ``memmove``: ``ctypes.memmove`` of the same size between two private buffers (the ceiling);
- ``shm_read``: the one-sided read's C call alone (the handle's key computed and looked up in
  the live-handle table, the generation checks, the copy hashed as it lands, the re-check);
- ``+ compare``: the same with the landed checksums compared with the handle's in the call
  (a fetch's one C call, ``shm_fetch``, also takes and re-checks the destination's ids,
  generations and landing marks: the step from this row to ``fetch (keep)``);
- ``fetch (keep)`` / ``fetch``: ``KVReceiver.fetch`` of a fresh verified handle, without and
  with its release.

Each row's ratio is memmove's median time over the row's, per repetition (higher is better).
The steps between two rows are what a fetch adds around the copy.
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
from bench._transport_cases import KiB, MiB, contig_case, fmt_size, host_buffer
from bench._transport_peers import SenderProc

SIZES = [4 * KiB, 1 * MiB]
PER_BATCH = 2000          # handles published at a time (well inside the sender's live-handle table)


def main(argv: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes in bytes")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    ap.add_argument("--iters", type=int, default=1000, help="rounds per repetition (default 1000)")
    ap.add_argument("--out", default="/tmp/kvbridge-bench/shm_fetch.json")
    args = ap.parse_args(argv)
    from kvbridge.blockcopy import planes, shm_read
    from kvbridge.handle import KVHandle
    from kvbridge.layout import KVLayout
    from kvbridge.pool import KVPool
    from kvbridge.receiver import KVReceiver
    if shm_read is None:
        raise SystemExit("the one-call shm read needs the C extension")

    sender = SenderProc()
    rows: list[dict[str, Any]] = []
    try:
        for size in [int(x) for x in args.sizes.split(",")]:
            case = contig_case(size)
            sender.call("setup", {"layout": case.layout, "pool_blocks": case.pool_blocks, "transport": "shm",
                                  "seed": 1})
            pool = KVPool.allocate(KVLayout.from_dict(case.layout), 1)
            recv = KVReceiver(pool, leases=False)
            src, dst = host_buffer(size, seed=3), host_buffer(size, value=0)
            fresh: list[KVHandle] = []

            def handle() -> KVHandle:
                if not fresh:
                    fresh.extend(KVHandle.from_bytes(b) for b in sender.call(
                        "publish", {"block_ids": case.src_ids, "count": PER_BATCH, "ttl": 3600}))
                return fresh.pop()

            first = handle()
            assert recv.fetch(first, case.dst_ids).ok               # maps the sender (one OPEN)
            url = first.urls[0]
            m = recv.transport(url)._senders[url]                   # type: ignore[attr-defined]
            h = handle()                                            # a live handle the C call reads again and again
            raw, pl = h.to_bytes(), planes(pool)

            def c_only() -> None:
                code, _ = shm_read(m.native, raw, h.block_ids, h.generations, pl, case.dst_ids, True, None, None)
                assert code == 0

            def c_compare() -> None:
                code, sums = shm_read(m.native, raw, h.block_ids, h.generations, pl, case.dst_ids, True, h.checksums,
                                      None)
                assert code == 0 and sums is None

            kept: list[KVHandle] = []

            def fetch(release: bool) -> Callable[[], None]:
                def run() -> None:
                    hh = handle()
                    res = recv.fetch(hh, case.dst_ids, release=release)
                    assert res.ok, res.error
                    if not release:
                        kept.append(hh)
                return run

            modes: dict[str, Callable[[], None]] = {
                "memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), size),
                "shm_read": c_only, "+ compare": c_compare,
                "fetch (keep)": fetch(False), "fetch": fetch(True),
            }
            names = list(modes)
            others = names[1:]
            samples: dict[str, list[float]] = {n: [] for n in names}
            for rep in range(args.reps):
                per: dict[str, list[float]] = {n: [] for n in names}
                for i in range(args.iters):
                    k = (rep + i) % len(others)
                    for name in others[k:] + others[:k]:
                        for step in ("memmove", name):
                            f = modes[step]
                            t0 = time.perf_counter()
                            f()
                            per[step].append(time.perf_counter() - t0)
                for name in names:
                    samples[name].append(statistics.median(per[name]))
                for hh in kept:                                     # untimed: the table stays far from full
                    recv.release(hh, wait=False)
                kept.clear()
            for name in names:
                ratios = [a / b for a, b in zip(samples["memmove"], samples[name])]
                rows.append({"size": size, "mode": name, "us": summarize([t * 1e6 for t in samples[name]]),
                             "ratio": summarize(ratios)})
            log(f"{fmt_size(size)}: " + ", ".join(f"{n} {statistics.median(samples[n]) * 1e6:.1f} us"
                                                   for n in names))
            recv.close()
            pool.close()
    finally:
        sender.close()
    md = ["| size | mode | µs (median) | memmove time / this [min–max] |", "|---|---|---:|---|"]
    for r in rows:
        q = r["ratio"]
        md.append(f"| {fmt_size(r['size'])} | {r['mode']} | {r['us']['median']:.2f} | "
                  f"{q['median']:.2f} [{q['min']:.2f}–{q['max']:.2f}] |")
    data = {"reps": args.reps, "iters": args.iters, "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "rows": rows}
    emit("\n".join(md) + "\n", data, args.out)
    return data


if __name__ == "__main__":
    main()
