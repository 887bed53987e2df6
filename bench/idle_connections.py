"""A real fetch while thousands of peers hold idle connections: ``python -m bench.idle_connections``.

A tcp:// sender in its own process (the transport benchmark's); this process fetches one 4 KiB
block (verified, with release) again and again, in rounds that alternate between a quiet sender
and one that also holds ``--idle`` connections that opened and sent nothing (from a third
process, so their sockets cost this process nothing). Per round the median latency; the
ratio is each idle round's median over the quiet round's before it, and the target is the
median ratio at most 1.2. The sender's thread count and RSS with the idle connections open
are reported beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from bench._report import emit, log, summarize
from bench._transport_cases import contig_case
from bench._transport_peers import SenderProc

TARGET = 1.2
_HOLDER = """
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = [socket.create_connection((host, port)) for _ in range(n)]
print("open", flush=True)
sys.stdin.read()
"""


def _proc_stat(pid: int) -> tuple[int, int]:
    """(threads, RSS bytes) of process ``pid``."""
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return threads, rss


def main(argv: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=2000, help="idle connections (default 2000)")
    ap.add_argument("--rounds", type=int, default=4, help="quiet/idle round pairs (default 4)")
    ap.add_argument("--fetches", type=int, default=1000, help="fetches per round (default 1000)")
    ap.add_argument("--out", default="/tmp/kvbridge-bench/idle_connections.json")
    args = ap.parse_args(argv)
    from kvbridge.handle import KVHandle
    from kvbridge.layout import KVLayout
    from kvbridge.pool import KVPool
    from kvbridge.receiver import KVReceiver

    sender = SenderProc()
    holder = None
    try:
        case = contig_case(4096)
        info = sender.call("setup", {"layout": case.layout, "pool_blocks": case.pool_blocks, "transport": "tcp",
                                     "seed": 1})
        pool = KVPool.allocate(KVLayout.from_dict(case.layout), case.pool_blocks)
        recv = KVReceiver(pool, leases=False)
        host, port = info["url"].removeprefix("tcp://").rsplit(":", 1)
        pid = info["pid"]

        def round_us() -> float:
            hs = [KVHandle.from_bytes(b) for b in sender.call(
                "publish", {"block_ids": case.src_ids, "count": args.fetches, "ttl": 3600})]
            for h in hs[:20]:                         # warm: connection, caches
                recv.fetch(h, case.dst_ids)
            times = []
            for h in hs[20:]:
                t0 = time.perf_counter()
                r = recv.fetch(h, case.dst_ids)
                times.append(time.perf_counter() - t0)
                if not r.ok:
                    raise RuntimeError(f"fetch failed: {r.error!r}")
            return statistics.median(times) * 1e6

        rows: list[dict[str, Any]] = []
        base = _proc_stat(pid)
        for rnd in range(args.rounds):
            quiet = round_us()
            holder = subprocess.Popen([sys.executable, "-c", _HOLDER, host, port, str(args.idle)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None
            if holder.stdout.readline().strip() != "open":
                raise RuntimeError("the idle connections did not open")
            time.sleep(1.0)                           # every connection accepted (and parked) by now
            held = _proc_stat(pid)
            idle = round_us()
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(30)
            holder = None
            rows.append({"round": rnd, "quiet_us": quiet, "idle_us": idle, "ratio": idle / quiet,
                         "threads_quiet": base[0], "threads_idle": held[0],
                         "rss_quiet": base[1], "rss_idle": held[1]})
            log(f"round {rnd + 1}/{args.rounds}: quiet {quiet:.1f} us, with {args.idle} idle connections "
                f"{idle:.1f} us ({idle / quiet:.2f}x); sender threads {base[0]} -> {held[0]}, "
                f"RSS {base[1] >> 20} -> {held[1] >> 20} MiB")
            time.sleep(1.0)
        recv.close()
        pool.close()
    finally:
        if holder is not None:
            holder.kill()
        sender.close()
    ratio = summarize([r["ratio"] for r in rows])
    ok = ratio["median"] <= TARGET
    md = [f"4 KiB tcp fetch (verified, with release), {args.fetches - 20} per round, medians; "
          f"{args.idle} idle connections held by another process in the idle rounds",
          "", "| round | quiet µs | idle µs | idle / quiet | sender threads quiet → idle "
          "| sender RSS MiB quiet → idle |", "|---:|---:|---:|---:|---|---|"]
    for r in rows:
        md.append(f"| {r['round'] + 1} | {r['quiet_us']:.1f} | {r['idle_us']:.1f} | {r['ratio']:.2f} | "
                  f"{r['threads_quiet']} → {r['threads_idle']} | {r['rss_quiet'] >> 20} → {r['rss_idle'] >> 20} |")
    md += ["", f"Median ratio **{ratio['median']:.2f}** [{ratio['min']:.2f}–{ratio['max']:.2f}]; target ≤ {TARGET}: "
               f"**{'met' if ok else 'missed'}**.", ""]
    data = {"idle": args.idle, "fetches": args.fetches, "rows": rows, "ratio": ratio, "target": TARGET, "met": ok,
            "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    emit("\n".join(md), data, args.out)
    return data


if __name__ == "__main__":
    main()
