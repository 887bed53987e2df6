"""The latency that leases add to a one-block 4 KiB fetch over tcp.

The sender lives in another process (``multiprocessing`` 'spawn') with two
:class:`kvbridge.KVSender`\\ s on one pool: one without leases (``leases=False``:
local TTL, direct release) and one with leases on a Redis-protocol server that this
process starts (``EmbeddedRedis``) and hands over by URL. This process is the
receiver and does all the timing, around ``receiver.fetch(handle, [block])``.

Handles are published in batches through a pipe, outside the timed region. The two
modes are interleaved fetch by fetch (the order alternates), so machine noise hits
both alike. A leased fetch's critical path has one lease round trip: READ (the owner
claims on the reader's behalf in Redis as it serves it, and ends the reply with its
validate-after-read trailer); the release goes to Redis after ``fetch`` has returned,
through the sender, which makes it for the claim it made (``docs/LEASES.md``). A lease round trip is measured
here too (``PING`` and a ``validate`` call, single round trips from this process).
Script calls on the server are counted (``INFO commandstats``): in total per leased fetch,
and on its critical path (the total less the releases sent after the fetch returned).
Target (unchanged, from when the release was on the critical path too): leased <= plain +
2 lease round trips + 30 µs.

    python bench/lease_fetch.py [--n 2000] [--reps 3] [--batch 200]
                                [--out /tmp/kvbridge-bench/lease_fetch.json] [--md ...]

Results go to a scratch path by default; ``--out bench/results/lease_fetch.json --md
bench/results/lease_fetch.md`` updates the committed ones.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender  # noqa: E402
from kvbridge.lease import EmbeddedRedis, Fence, RedisLeaseStore  # noqa: E402

# 1 layer x 2 tokens x 1024 latent dims x fp16 = 4096 bytes per block
LAYOUT = KVLayout.mla(1, 1024, block_size=2, dtype="float16")
NS = "benchlf"


def _sender_main(conn: Any, url: str, pool_blocks: int) -> None:
    import torch
    pool = KVPool.allocate(LAYOUT, pool_blocks)
    flat = pool.buffers[0].view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    plain = KVSender(pool, "tcp://127.0.0.1:0", leases=False, ttl=120.0)
    leased = KVSender(pool, "tcp://127.0.0.1:0", leases=url, lease_namespace=NS, ttl=120.0)
    senders = {"plain": plain, "leased": leased}
    conn.send({"plain": plain.url, "leased": leased.url})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        mode, n = msg
        s = senders[mode]
        deadline = time.monotonic() + 30
        while pool.num_free < n and time.monotonic() < deadline:   # released blocks come back
            time.sleep(0.005)
        out = []
        for _ in range(n):
            ids = pool.alloc(1)
            out.append(s.publish(f"{mode}", ids, LAYOUT.block_size).to_bytes())
        conn.send(out)
    for s in senders.values():
        s.close()
    conn.send("bye")


def _evals(r: Any) -> int:
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median_us": statistics.median(xs) * 1e6, "p99_us": _pct(xs, 0.99) * 1e6,
            "p10_us": _pct(xs, 0.10) * 1e6, "p90_us": _pct(xs, 0.90) * 1e6, "min_us": min(xs) * 1e6}


def _one_rep(args: Any, rep: int, parent: Any, plain_r: KVReceiver, leased_r: KVReceiver,
             store: RedisLeaseStore, fence: Fence, times: dict[str, list[float]], t_start: float) -> int:
    """One repetition: warm-up + ``args.n`` fetches per mode, interleaved; returns failures."""
    total = args.warmup + args.n
    done = failures = 0
    while done < total:
        k = min(args.batch, total - done)
        batches = {}
        for mode in ("plain", "leased"):     # published outside the timed region
            parent.send((mode, k))
            batches[mode] = [KVHandle.from_bytes(b) for b in parent.recv()]
        for i in range(k):
            timed = done + i >= args.warmup
            order = ("plain", "leased") if (done + i) % 2 == 0 else ("leased", "plain")
            for mode in order:
                r = plain_r if mode == "plain" else leased_r
                t0 = time.perf_counter()
                res = r.fetch(batches[mode][i], [i % 2])
                dt = time.perf_counter() - t0
                failures += 0 if res.ok else 1
                if timed:
                    times[mode].append(dt)
            if timed:   # ceilings, in the same loop: one Redis round trip, one lease script call
                t0 = time.perf_counter()
                store._redis.ping()
                times["redis_ping"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                store.validate("probe", "bench-r", fence)
                times["lease_validate"].append(time.perf_counter() - t0)
        done += k
        print(f"  rep {rep + 1}/{args.reps}: {done}/{total} fetches per mode "
              f"({time.monotonic() - t_start:.1f}s)", file=sys.stderr)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="timed fetches per mode and repetition (>= 1000)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (the spread of their medians is reported)")
    ap.add_argument("--batch", type=int, default=200, help="handles published per round trip to the sender")
    ap.add_argument("--out", default="/tmp/kvbridge-bench/lease_fetch.json",
                    help="write JSON here (default: scratch; the committed results are bench/results/)")
    ap.add_argument("--md", default="", help="write the Markdown table here too (default: next to --out)")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    with EmbeddedRedis(unix_socket=False) as srv:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_sender_main, args=(child, srv.url, 4 * args.batch + 16), daemon=True)
        proc.start()
        parent.recv()
        rpool = KVPool.allocate(LAYOUT, 4)
        plain_r = KVReceiver(rpool, leases=False)
        leased_r = KVReceiver(rpool, leases=srv.url, lease_namespace=NS)
        store = RedisLeaseStore(srv.url, namespace=NS)
        times: dict[str, list[float]] = {"plain": [], "leased": [], "redis_ping": [], "lease_validate": []}
        per_rep: dict[str, list[float]] = {k: [] for k in times}
        failures = 0
        t_start = time.monotonic()
        admin = store._redis
        evals0 = _evals(admin)
        store.publish("probe", "bench", ttl_s=3600)
        probe = store.claim("probe", "bench-r", 3600)
        for rep in range(args.reps):
            marks = {name: len(v) for name, v in times.items()}
            failures += _one_rep(args, rep, parent, plain_r, leased_r, store, probe.fence, times, t_start)
            for name, v in times.items():
                per_rep[name].append(statistics.median(v[marks[name]:]))
        plain_r.close()
        leased_r.close()                  # sends the releases still pending
        released_later = leased_r.stats.released_later
        evals = _evals(admin) - evals0
        parent.send(None)
        parent.recv()
        proc.join(10)
        store.close()

    s = {k: _summary(v) for k, v in times.items()}
    n_leased = args.reps * (args.warmup + args.n)
    # every script call but the leased handles' publishes, the probes and the probe's setup
    per_fetch = (evals - n_leased - len(times["lease_validate"]) - 2) / n_leased
    critical = per_fetch - released_later / n_leased    # the releases sent after fetch returned are off it
    budget = s["plain"]["median_us"] + 2 * s["lease_validate"]["median_us"] + 30
    added_med = s["leased"]["median_us"] - s["plain"]["median_us"]
    added_p99 = s["leased"]["p99_us"] - s["plain"]["p99_us"]
    result = {
        "bench": "lease_fetch", "block_bytes": LAYOUT.block_nbytes, "transport": "tcp (sender in another process)",
        "iterations_per_mode": args.n, "warmup": args.warmup, "failures": failures,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "reps": args.reps, "summary": s,
        "rep_medians_us": {k: [x * 1e6 for x in v] for k, v in per_rep.items()},
        "added_by_leases_us": {"median": added_med, "p99": added_p99,
                               "ratio_median": s["leased"]["median_us"] / s["plain"]["median_us"],
                               "in_lease_round_trips": added_med / s["lease_validate"]["median_us"]},
        "script_calls_per_leased_fetch": per_fetch, "script_calls_on_critical_path": critical,
        "releases_after_return_per_fetch": released_later / n_leased,
        "target_us": budget, "target_met": s["leased"]["median_us"] <= budget,
        "samples_us": {k: [round(x * 1e6, 2) for x in v] for k, v in times.items()},
    }
    lines = [
        f"One-block {LAYOUT.block_nbytes} B fetch over tcp, sender in another process, "
        f"{args.reps} x {args.n} interleaved fetches per mode (+{args.warmup} warm-up each), failures={failures}",
        "",
        "| what | median µs | p99 µs | p10 µs | p90 µs | medians of the reps µs |",
        "|---|---:|---:|---:|---:|---|",
    ]
    names = {"plain": "`fetch`, leases=False", "leased": "`fetch`, leases (embedded Redis)",
             "redis_ping": "Redis PING (one round trip)", "lease_validate": "lease `validate` (one script call)"}
    for k in ("plain", "leased", "redis_ping", "lease_validate"):
        v = s[k]
        reps = ", ".join(f"{x * 1e6:.0f}" for x in per_rep[k])
        lines.append(f"| {names[k]} | {v['median_us']:.1f} | {v['p99_us']:.1f} | {v['p10_us']:.1f} "
                     f"| {v['p90_us']:.1f} | {reps} |")
    ratio = result["added_by_leases_us"]["ratio_median"]
    lines += ["", f"Added by leases: median **{added_med:.1f} µs** (×{ratio:.2f}),"
              f" difference of the p99s {added_p99:.1f} µs (each p99 is its own mode's tail);"
              f" = {result['added_by_leases_us']['in_lease_round_trips']:.1f}"
              f" × one lease script round trip. Script calls per leased fetch on the server:"
              f" {critical:.2f} on its critical path (the owner's claim inside the READ; its trailer is"
              f" the validate-after-read), {per_fetch:.2f} in all (the release goes after fetch returns,"
              f" through the sender, which makes it for the claim it made: {released_later / n_leased:.2f}"
              f" per fetch).",
              f"Target (plain + 2 × lease `validate` + 30 µs; the critical path now holds one lease"
              f" round trip): {budget:.1f} µs; leased median {s['leased']['median_us']:.1f} µs:"
              f" {'met' if result['target_met'] else 'missed'}."]
    table = "\n".join(lines)
    print(table)
    md = args.md or (os.path.splitext(args.out)[0] + ".md" if args.out else "")
    if md:
        os.makedirs(os.path.dirname(md) or ".", exist_ok=True)
        with open(md, "w") as f:
            f.write(table + "\n")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
