"""What the engine-facing faces cost: ``start_fetch(...).result()`` against ``fetch(...)``,
and how long ``await receiver.afetch(...)`` can keep an event loop from running.

(a) **Per-call cost.** One 4 KiB handle (one block, leases off), fetched with
``release=False`` so the same handle serves every call, over ``inproc://`` (sender in
this process) and ``tcp://`` (sender in a spawned process, as ``bench.transport``).
``fetch`` (A) and ``start_fetch(...).result()`` (B) alternate call by call (A B, then
B A, ...); each repetition reports the median of each and the median of the paired
differences B − A. Target: B costs ≤ 10 µs more than A.

(b) **Event-loop lag.** A probe coroutine sleeps 0.1 ms in a loop and records how late
each wake-up is, while the loop awaits ``receiver.afetch`` of a 1,000-block, 32-layer
handle over tcp (sender in the spawned process, a fresh handle per fetch, released),
back to back. The ceiling is the same probe on the same loop with nothing else
running, in alternating windows of the same length (idle, busy, idle, busy, ...).
The loop is an ``asyncio.SelectorEventLoop`` over ``selectors.SelectSelector``:
``select`` takes microsecond timeouts, whereas the default epoll loop rounds every
timeout up to a whole millisecond, so an idle default loop is already ~1 ms late and
could not show a 1 ms stall. For context, also: the same after ``gc.freeze()`` (as
engines do after start-up, so that the cyclic garbage collector no longer scans the
start-up heap), and the default epoll loop.
Target: the loop never stalls more than 1 ms (max lateness during afetch ≤ 1 ms).

Run::

    python -m bench.api_overhead [--quick] [--reps N] [--out bench/results/api_overhead]

Progress to stderr, the Markdown table to stdout; JSON (raw per-repetition figures)
and Markdown to ``--out`` + ``.json``/``.md`` (default: a scratch path under /tmp).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import selectors
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import transport as bt  # noqa: E402
from bench._report import emit, log, summarize  # noqa: E402

SCRATCH = "/tmp/kvbridge-bench/api_overhead"
PERCALL_TARGET_US = 10.0
LAG_TARGET_MS = 1.0
PROBE_SLEEP = 1e-4






def pctl(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ============================================================================== (a) per-call cost

def _abab(fetch: Callable[[], Any], start: Callable[[], Any], iters: int) -> tuple[list[int], list[int]]:
    a: list[int] = []
    b: list[int] = []
    perf = time.perf_counter_ns
    for i in range(iters):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = perf()
            r = fetch() if which == 0 else start()
            dt = perf() - t0
            if not r.ok:
                raise RuntimeError(f"fetch failed: {r.error!r}")
            (a if which == 0 else b).append(dt)
    return a, b


def percall(transport: str, iters: int, reps: int, sender: Optional[bt.SenderProc]) -> dict[str, Any]:
    from kvbridge import KVPool, KVReceiver, KVSender
    from kvbridge.layout import KVLayout
    case = bt.contig_case(4096)
    layout = KVLayout.from_dict(case.layout)
    rpool = KVPool.allocate(layout, 1)
    rx = KVReceiver(rpool, leases=False)
    own_sender = None
    spool = None
    try:
        if transport == "inproc":
            spool = KVPool.allocate(layout, 1)
            bt.fill_pool(spool, 1)
            own_sender = KVSender(spool, f"inproc://kvb-api-{os.getpid()}", leases=False, ttl=3600.0)
            h = own_sender.publish("api", spool.alloc(1), 16)
        else:
            assert sender is not None
            sender.call("setup", {"layout": case.layout, "pool_blocks": 1, "transport": "tcp", "seed": 1})
            from kvbridge.handle import KVHandle
            h = KVHandle.from_bytes(sender.call("publish", {"block_ids": [0], "count": 1})[0])
        dst = [0]

        def fetch() -> Any:
            return rx.fetch(h, dst, release=False)

        def start() -> Any:
            return rx.start_fetch(h, dst, release=False).result()
        _abab(fetch, start, max(50, iters // 10))             # warm-up: connection, worker threads
        per: list[dict[str, float]] = []
        for rep in range(reps):
            gc.collect()
            a, b = _abab(fetch, start, iters)
            d = [y - x for x, y in zip(a, b)]
            per.append({"fetch_us": statistics.median(a) / 1e3, "start_result_us": statistics.median(b) / 1e3,
                        "diff_us": statistics.median(d) / 1e3,
                        "fetch_p90_us": pctl(a, 0.9) / 1e3, "start_result_p90_us": pctl(b, 0.9) / 1e3})
            log(f"  {transport} rep {rep + 1}/{reps}: fetch {per[-1]['fetch_us']:.1f} us, "
                f"start_fetch().result() {per[-1]['start_result_us']:.1f} us, paired diff {per[-1]['diff_us']:+.1f} us")
        diff = summarize([p["diff_us"] for p in per])
        return {"transport": transport, "nbytes": 4096, "iters_per_rep": iters, "reps": reps,
                "fetch_us": summarize([p["fetch_us"] for p in per]),
                "start_result_us": summarize([p["start_result_us"] for p in per]),
                "ratio": summarize([p["start_result_us"] / p["fetch_us"] for p in per]),
                "diff_us": diff, "target_us": PERCALL_TARGET_US, "pass": diff["median"] <= PERCALL_TARGET_US,
                "per_rep": per}
    finally:
        rx.close()
        if own_sender is not None:
            own_sender.close()
        rpool.close()
        if spool is not None:
            spool.close()


# ============================================================================== (b) loop lag

class Probe:
    """Sleeps ``PROBE_SLEEP`` in a loop; records each wake-up's lateness (seconds)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.stop = False

    async def run(self) -> None:
        perf = time.perf_counter
        while not self.stop:
            t0 = perf()
            await asyncio.sleep(PROBE_SLEEP)
            self.late.append(perf() - t0 - PROBE_SLEEP)


def loop_lag(loop_kind: str, sender: bt.SenderProc, blocks: int, layers: int, fetches: int,
             reps: int, freeze: bool = False) -> dict[str, Any]:
    from kvbridge import KVPool, KVReceiver
    from kvbridge.handle import KVHandle
    from kvbridge.layout import KVLayout
    lay = bt.flash_layout(layers, 1, 32)                 # 1 KiB parts: 64 KiB a block
    pool_blocks = 2 * blocks
    src_ids = bt.scattered_ids(pool_blocks, blocks, 11)  # block-shaped: no two blocks merge
    dst_ids = bt.scattered_ids(pool_blocks, blocks, 12)
    sender.call("setup", {"layout": lay, "pool_blocks": pool_blocks, "transport": "tcp", "seed": 2})
    pool = KVPool.allocate(KVLayout.from_dict(lay), pool_blocks)
    for b in pool.buffers:
        b.view(-1).view(__import__("torch").uint8).fill_(1)
    nbytes = blocks * KVLayout.from_dict(lay).block_nbytes
    rx = KVReceiver(pool, leases=False)
    loop = (asyncio.SelectorEventLoop(selectors.SelectSelector()) if loop_kind == "select"
            else asyncio.new_event_loop())
    per: list[dict[str, Any]] = []

    async def window_busy(hs: list[Any]) -> tuple[list[float], float]:
        probe = Probe()
        task = asyncio.ensure_future(probe.run())
        await asyncio.sleep(0.002)
        probe.late.clear()
        t0 = time.perf_counter()
        for h in hs:
            r = await rx.afetch(h, dst_ids)
            if not r.ok:
                raise RuntimeError(f"afetch failed: {r.error!r}")
        dt = time.perf_counter() - t0
        probe.stop = True
        await task
        return probe.late, dt

    async def window_idle(seconds: float) -> list[float]:
        probe = Probe()
        task = asyncio.ensure_future(probe.run())
        await asyncio.sleep(0.002)
        probe.late.clear()
        await asyncio.sleep(seconds)
        probe.stop = True
        await task
        return probe.late

    if freeze:
        gc.collect()
        gc.freeze()          # what engines do after start-up: the heap so far is never scanned again
    try:
        warm = [KVHandle.from_bytes(x) for x in sender.call("publish", {"block_ids": src_ids, "count": 2})]
        loop.run_until_complete(window_busy(warm))
        for rep in range(reps):
            hs = [KVHandle.from_bytes(x) for x in sender.call("publish", {"block_ids": src_ids, "count": fetches})]
            gc.collect()
            busy, busy_s = loop.run_until_complete(window_busy(hs))
            idle = loop.run_until_complete(window_idle(busy_s))
            per.append({"busy_max_ms": max(busy) * 1e3, "busy_p99_ms": pctl(busy, 0.99) * 1e3,
                        "busy_p50_ms": statistics.median(busy) * 1e3, "busy_wakeups": len(busy),
                        "idle_max_ms": max(idle) * 1e3, "idle_p99_ms": pctl(idle, 0.99) * 1e3,
                        "idle_p50_ms": statistics.median(idle) * 1e3, "idle_wakeups": len(idle),
                        "afetch_gbps": nbytes * fetches / busy_s / 1e9, "window_s": busy_s})
            p = per[-1]
            log(f"  loop {loop_kind}{' gc.freeze()' if freeze else ''} rep {rep + 1}/{reps}: "
                f"during afetch max {p['busy_max_ms']:.2f} ms, "
                f"p99 {p['busy_p99_ms']:.3f} ms; idle max {p['idle_max_ms']:.2f} ms, p99 {p['idle_p99_ms']:.3f} ms; "
                f"afetch {p['afetch_gbps']:.2f} GB/s")
        mx = max(p["busy_max_ms"] for p in per)
        primary = loop_kind == "select" and not freeze
        return {"loop": loop_kind + (" + gc.freeze()" if freeze else ""), "gc_frozen": freeze, "blocks": blocks,
                "layers": layers, "nbytes": nbytes, "fetches_per_rep": fetches,
                "reps": reps, "busy_max_ms": mx,
                "busy_p99_ms": summarize([p["busy_p99_ms"] for p in per]),
                "idle_max_ms": max(p["idle_max_ms"] for p in per),
                "idle_p99_ms": summarize([p["idle_p99_ms"] for p in per]),
                "busy_max_over_idle_max": summarize([p["busy_max_ms"] / p["idle_max_ms"] for p in per]),
                "afetch_gbps": summarize([p["afetch_gbps"] for p in per]),
                "target_ms": LAG_TARGET_MS if primary else None,
                "pass": (mx <= LAG_TARGET_MS) if primary else None, "per_rep": per}
    finally:
        if freeze:
            gc.unfreeze()
        loop.close()
        rx.close()
        pool.close()


# ============================================================================== driver and output

class Bench:
    def __init__(self, quick: bool, reps: int, iters: int, blocks: int, layers: int, fetches: int) -> None:
        self.quick, self.reps, self.iters = quick, reps, iters
        self.blocks, self.layers, self.fetches = blocks, layers, fetches
        self.percall: list[dict[str, Any]] = []
        self.lag: list[dict[str, Any]] = []

    def run(self) -> None:
        import torch
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        with bt.SenderProc() as sender:
            for tr in ("inproc", "tcp"):
                log(f"[per call: {tr}, 4 KiB, {self.reps} reps x {self.iters} pairs]")
                self.percall.append(percall(tr, self.iters, self.reps, sender))
            for kind, freeze in (("select", False), ("select", True), ("default", False)):
                log(f"[loop lag: {kind} loop{', gc.freeze()' if freeze else ''}, afetch of {self.blocks} blocks x "
                    f"{self.layers} layers over tcp]")
                self.lag.append(loop_lag(kind, sender, self.blocks, self.layers, self.fetches, self.reps, freeze))
            sender.call("teardown")
        self.elapsed = time.perf_counter() - t0

    def to_json(self) -> dict[str, Any]:
        import torch
        return {"benchmark": "kvbridge API overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "quick": self.quick, "reps": self.reps, "elapsed_s": getattr(self, "elapsed", None),
                "machine": {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "torch": torch.__version__, "loadavg_at_end": os.getloadavg()},
                "method": {
                    "percall": "fetch(h, dst, release=False) vs start_fetch(h, dst, release=False).result(), "
                               "alternating call by call (AB BA ...); per repetition the medians and the median "
                               "of paired differences; leases off; not pinned",
                    "loop_lag": f"probe coroutine: asyncio.sleep({PROBE_SLEEP}) in a loop, lateness of each wake-up;"
                                " windows of back-to-back afetch (fresh handle each, release=True) alternate with "
                                "idle windows of the same length; leases off",
                },
                "percall": self.percall, "loop_lag": self.lag}

    def markdown(self) -> str:
        lines = ["| 4 KiB handle, leases off | fetch µs | start_fetch().result() µs | ratio | paired difference µs "
                 "median [min–max] | target | pass/fail |", "|---|---:|---:|---|---|---|---|"]
        for r in self.percall:
            d = r["diff_us"]
            lines.append(f"| {r['transport']} | {r['fetch_us']['median']:.1f} | {r['start_result_us']['median']:.1f} | "
                         f"{r['ratio']['median']:.2f}× | {d['median']:+.1f} [{d['min']:+.1f}–{d['max']:+.1f}] | "
                         f"≤ +{r['target_us']:.0f} µs | {'PASS' if r['pass'] else 'FAIL'} |")
        lines += ["", "| event loop | handle | afetch GB/s | lateness during afetch: max ms / p99 ms | "
                  "idle loop (ceiling): max ms / p99 ms | target | pass/fail |", "|---|---|---:|---|---|---|---|"]
        for r in self.lag:
            tgt = f"max ≤ {r['target_ms']:.0f} ms" if r["target_ms"] else "— (context)"
            pf = "—" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
            lines.append(f"| {r['loop']} | {r['blocks']} blocks × {r['layers']} layers, "
                         f"{r['nbytes'] / (1 << 20):.1f} MiB, {r['fetches_per_rep']} × {r['reps']} fetches | "
                         f"{r['afetch_gbps']['median']:.2f} | "
                         f"{r['busy_max_ms']:.2f} / {r['busy_p99_ms']['median']:.3f} | "
                         f"{r['idle_max_ms']:.2f} / {r['idle_p99_ms']['median']:.3f} | {tgt} | {pf} |")
        return "\n".join(lines) + "\n"




def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.api_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few iterations, a short loop-lag run")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick 2)")
    ap.add_argument("--iters", type=int, default=None, help="call pairs per repetition (default 2000; quick 200)")
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--fetches", type=int, default=None, help="afetch calls per window (default 10; quick 2)")
    ap.add_argument("--out", default=SCRATCH, help=f"output path without extension (default {SCRATCH})")
    a = ap.parse_args(argv)
    b = Bench(a.quick, a.reps or (2 if a.quick else 5), a.iters or (200 if a.quick else 2000), a.blocks, a.layers,
              a.fetches or (2 if a.quick else 10))
    b.run()
    emit(b.markdown(), b.to_json(), a.out)
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
