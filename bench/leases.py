"""Lease store throughput and latency: publish, claim, release, one client.

Single round-trip calls (non-pipelined) and pipelined batches, each against a
ceiling measured in the same run (PING and a trivial EVALSHA, single and
pipelined). Prints a Markdown table; ``--out results.json`` writes JSON.

    python bench/leases.py                 # embedded server
    python bench/leases.py --url redis://host:6379/0 --n 5000 --reps 5 --out leases.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from functools import partial
from typing import Any, Callable, Optional

import redis

from kvbridge.lease import EmbeddedRedis, Fence, Lease, RedisLeaseStore


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Row:
    """Ops/s per repetition and per-round-trip latencies (seconds)."""

    def __init__(self, name: str, mode: str, ops_per_rt: int) -> None:
        self.name, self.mode, self.ops_per_rt = name, mode, ops_per_rt
        self.rates: list[float] = []
        self.lat: list[float] = []

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.name, "mode": self.mode, "ops_per_round_trip": self.ops_per_rt,
                "ops_per_s_median": statistics.median(self.rates),
                "ops_per_s_min": min(self.rates), "ops_per_s_max": max(self.rates),
                "latency_p50_us": _pct(self.lat, 0.50) * 1e6,
                "latency_p99_us": _pct(self.lat, 0.99) * 1e6, "reps": len(self.rates)}


def timed(row: Row, ops: int, calls: list[Callable[[], Any]]) -> None:
    t0 = time.perf_counter()
    for call in calls:
        s = time.perf_counter()
        call()
        row.lat.append(time.perf_counter() - s)
    row.rates.append(ops / (time.perf_counter() - t0))


def run(url: str, n: int, reps: int, batch: int) -> dict[str, Row]:
    rows: dict[str, Row] = {}

    def row(name: str, mode: str, k: int) -> Row:
        return rows.setdefault(f"{name}/{mode}", Row(name, mode, k))

    raw = redis.Redis.from_url(url)
    sha = raw.script_load("return 1")
    n = n - n % batch or batch
    for rep in range(reps):
        print(f"rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
        # ceilings: what one round trip costs without any lease logic
        timed(row("PING (ceiling)", "single", 1), n, [raw.ping] * n)
        timed(row("EVALSHA return 1 (ceiling)", "single", 1), n,
              [lambda: raw.evalsha(sha, 0)] * n)

        def ping_batch() -> None:
            p = raw.pipeline(transaction=False)
            for _ in range(batch):
                p.ping()
            p.execute()
        timed(row("PING (ceiling)", f"pipelined x{batch}", batch), n, [ping_batch] * (n // batch))

        with RedisLeaseStore(url, namespace="bench" + uuid.uuid4().hex[:10]) as s:
            ids = [f"s{i}" for i in range(n)]
            fences: dict[str, Fence] = {}
            timed(row("publish", "single", 1), n,
                  [partial(s.publish, i, "owner", 60, 8) for i in ids])

            def claim(i: str) -> None:
                fences[i] = s.claim(i, "dec", 30).fence

            def release(i: str) -> None:
                s.release(i, "dec", fences[i])
            timed(row("claim", "single", 1), n, [partial(claim, i) for i in ids])
            timed(row("release", "single", 1), n,
                  [partial(release, i) for i in ids])

            chunks = [[f"b{c}_{j}" for j in range(batch)] for c in range(n // batch)]
            claimed: dict[int, list[Any]] = {}
            timed(row("publish", f"pipelined x{batch}", batch), n,
                  [partial(s.publish_many, "owner", ch, 60, 8) for ch in chunks])

            def claim_chunk(c: int) -> None:
                claimed[c] = s.claim_many("dec", chunks[c], 30)

            def release_chunk(c: int) -> None:
                s.release_many("dec", [(x.lease_id, x.fence) for x in claimed[c]])
            timed(row("claim", f"pipelined x{batch}", batch), n,
                  [partial(claim_chunk, c) for c in range(len(chunks))])
            timed(row("release", f"pipelined x{batch}", batch), n,
                  [partial(release_chunk, c) for c in range(len(chunks))])

            # one round trip per step: publish batch k, claim batch k-1, release batch k-2
            mixed = [[f"m{c}_{j}" for j in range(batch)] for c in range(n // batch + 2)]
            held: dict[int, list[Any]] = {}

            def step(c: int) -> None:
                b = s.batch()
                if c < len(mixed) - 2:
                    for i in mixed[c]:
                        b.publish(i, "owner", 60, 8)
                if 1 <= c < len(mixed) - 1:
                    for i in mixed[c - 1]:
                        b.claim(i, "dec", 30)
                if c >= 2:
                    for x in held.pop(c - 2):
                        b.release(x.lease_id, "dec", x.fence)
                res = b.execute()
                if 1 <= c < len(mixed) - 1:
                    start = len(mixed[c]) if c < len(mixed) - 2 else 0
                    held[c - 1] = [x for x in res[start:start + batch] if isinstance(x, Lease)]
            timed(row("publish+claim+release cycle", f"mixed batch x{batch}", 3 * batch), 3 * n,
                  [partial(step, c) for c in range(len(mixed))])
            assert not held and s.stats.released == 3 * n, s.stats
    raw.close()
    return rows


def table(rows: dict[str, Row], ceiling_single: float) -> str:
    out = ["| op | mode | ops/s (median) | spread (min–max) | p50 µs / round trip "
           "| p99 µs / round trip | vs PING single |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        d = r.as_dict()
        rate = d["ops_per_s_median"]
        out.append(f"| {r.name} | {r.mode} | {rate:,.0f} | {d['ops_per_s_min']:,.0f}–"
                   f"{d['ops_per_s_max']:,.0f} | {d['latency_p50_us']:,.0f} | "
                   f"{d['latency_p99_us']:,.0f} | {rate / ceiling_single:.2f}x |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="lease server URL (default: start an embedded server)")
    ap.add_argument("--n", type=int, default=3200, help="operations per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", help="write JSON results here")
    a = ap.parse_args(argv)
    srv = None if a.url else EmbeddedRedis().start()
    try:
        rows = run(a.url or srv.url, a.n, a.reps, a.batch)  # type: ignore[union-attr]
    finally:
        if srv is not None:
            srv.close()
    ceiling = rows["PING (ceiling)/single"].as_dict()["ops_per_s_median"]
    print(table(rows, ceiling))
    cyc = rows[f"publish+claim+release cycle/mixed batch x{a.batch}"].as_dict()
    print(f"\ncycles/s (publish+claim+release, one client, pipelined): "
          f"{cyc['ops_per_s_median'] / 3:,.0f} median")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bench": "leases", "python": platform.python_version(),
                       "machine": platform.machine(), "n": a.n, "reps": a.reps,
                       "batch": a.batch, "server": "embedded" if srv else "external",
                       "rows": [r.as_dict() for r in rows.values()],
                       "cycles_per_s_median": cyc["ops_per_s_median"] / 3}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
