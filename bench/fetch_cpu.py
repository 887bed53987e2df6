"""Where a 4 KiB tcp fetch spends its CPU: ``python -m bench.fetch_cpu``.

The transport benchmark's sender process and this receiver, both pinned to one core (as its
latency rows are), run the plain 4 KiB ping-pong and then each mode over ``--n`` handles:

- ``read``: ``transport.read`` of one long-lived handle (the read alone);
- ``keep``: ``fetch(release=False)`` of fresh handles (the whole pipeline, no release);
- ``release``: ``fetch`` of fresh handles (with release).

For each: the median and mean latency per call, and the CPU each thread of each process used
per call (``/proc/<pid>/task/<tid>/schedstat``): with both processes on one core, the sum of
the two processes' CPU is what a call costs. Linux only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from typing import Any, Callable

from bench._transport_cases import KiB, contig_case, host_buffer, tensor_view
from bench._transport_peers import PlainClient, SenderProc, _pin_all
from bench.transport import Bench


def thread_cpu(pid: int) -> dict[str, int]:
    """CPU nanoseconds so far of each thread of ``pid``, keyed by ``tid:name``."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                out[f"{os.path.basename(task)}:{name}"] = int(f.read().split()[0])
        except OSError:                  # a thread that ended meanwhile
            continue
    return out


def per_call(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, float]:
    """µs of CPU per call of each thread that ran."""
    used = {k: (v - before.get(k, 0)) / n / 1e3 for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0.005}


def measure(n: int, run: Callable[[int], None], pids: dict[str, int]) -> dict[str, Any]:
    before = {who: thread_cpu(pid) for who, pid in pids.items()}
    times = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        run(i)
        times.append(time.perf_counter_ns() - t0)
    time.sleep(0.05)                     # let releases still riding land on the sender's side
    cpu = {who: per_call(before[who], thread_cpu(pid), n) for who, pid in pids.items()}
    return {"median_us": statistics.median(times) / 1e3, "mean_us": statistics.fmean(times) / 1e3,
            "cpu_us_per_call": cpu, "cpu_us_per_call_total": round(sum(sum(c.values()) for c in cpu.values()), 2)}


def main(argv: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="calls per mode (default 4000)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    from kvbridge.receiver import KVReceiver
    case = contig_case(4 * KiB)
    sender = SenderProc()
    b = Bench(reps=1, quick=True)
    b.sender = sender
    results: dict[str, Any] = {"n": args.n}
    try:
        info = b._setup(case, "tcp", plain=True)
        pool = b._recv_pool(case)
        rv = KVReceiver(pool)
        pids = {"sender": info["pid"], "receiver": os.getpid()}
        cpu = sorted(os.sched_getaffinity(0))[0]
        results["pinned_to_one_core"] = _pin_all(info["pid"], {cpu}) and _pin_all(os.getpid(), {cpu})
        client = PlainClient(info["plain_port"])     # its server thread starts pinned
        buf = host_buffer(4096, value=0)             # kept alive: the view does not own it
        view = tensor_view(buf)
        handles = b._handles(case, 2 * args.n + 400)
        long_h = handles.pop()
        url = info["url"]
        tr = rv.transport(url)
        from kvbridge.transports.base import Spans
        spans = Spans.of_blocks(pool, case.dst_ids)
        for h in handles[:200]:                      # connections, caches, warm-up
            rv.fetch(h, case.dst_ids)
        fresh = iter(handles[200:])

        def ok(res: Any) -> None:
            if not res.ok:
                raise RuntimeError(f"fetch failed: {res.error!r}")
        modes: dict[str, Callable[[int], None]] = {
            "plain 4 KiB ping-pong": lambda _: client.fetch(view, 4096),
            "read (transport.read)": lambda _: tr.read(url, long_h, spans),
            "keep (fetch, release=False)": lambda _: ok(rv.fetch(next(fresh), case.dst_ids, release=False)),
            "release (fetch)": lambda _: ok(rv.fetch(next(fresh), case.dst_ids)),
        }
        for name, run in modes.items():
            for i in range(100):
                modes["plain 4 KiB ping-pong"](i)
            results[name] = r = measure(args.n, run, pids)
            print(f"{name}: median {r['median_us']:.1f} us, mean {r['mean_us']:.1f} us, CPU per call "
                  f"{r['cpu_us_per_call_total']:.1f} us: " + "; ".join(
                      f"{who} " + ", ".join(f"{k.split(':', 1)[1]} {v:.1f}" for k, v in list(c.items())[:3])
                      for who, c in r["cpu_us_per_call"].items()))
        client.close()
        rv.close()
        pool.close()
    finally:
        sender.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
