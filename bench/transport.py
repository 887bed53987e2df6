"""Transport benchmark: kvbridge tcp://, shm:// and ucx:// against ceilings measured in the same run.

Two processes: a *sender* process (spawned, ``multiprocessing`` 'spawn') owns the
sender pool, a :class:`kvbridge.KVSender` and a plain-socket server; this process
is the *receiver* and does all the timing, around ``receiver.fetch`` and around
the plain-socket receive. Handles travel from the sender to the receiver over a
pipe, outside the timed region.

Every figure is a ratio against a ceiling measured in the same repetition,
interleaved with it (a ceiling transfer before every kvbridge transfer, the variants'
order rotating each repetition), so machine noise and cache state hit both sides alike:

* tcp   vs. plain socket: the receiver sends an 8-byte request, the sender
  ``sendall``s that many bytes from a preallocated buffer, the receiver
  ``recv_into``s a preallocated buffer in a loop (TCP_NODELAY both sides).
  ratio = ceiling time / kvbridge time (a throughput ratio, higher is better).
* shm   vs. memcpy: ``ctypes.memmove`` between two preallocated buffers of the
  same size in the receiver process.
* ucx   vs. a bare ucxx loop with the same settings (a worker per process, endpoints
  from worker addresses with error handling off, polling): the receiver posts a tagged
  receive into a preallocated buffer and sends an 8-byte request; the sender's thread
  answers with one tagged send of that many bytes from a preallocated buffer. Both sides
  wait as kvbridge's do: they poll for ``kvbridge.transports.ucx.SPIN`` seconds, then
  sleep on the worker's event fd. (ucx needs ``kvbridge[ucx]``; skipped without it.)
* NIXL (when ``nixl`` is installed): a peer column in the ucx sections, a NIXL READ of the
  same bytes (same pieces for block-shaped handles) between two more processes (NIXL
  carries its own UCX; run with ``UCX_MODULES=^ib``, set by default), timed by its initiator;
  kvbridge ucx vs. NIXL is reported as NIXL seconds / kvbridge seconds per repetition.
* latency: one-block 4 KiB tcp read / fetch vs. a plain 4 KiB ping-pong;
  ratio = kvbridge median / ping-pong median (lower is better). ucx: read / fetch vs.
  the bare ucxx 4 KiB ping-pong (not pinned: both sides poll).

Run::

    python -m bench.transport [--quick] [--reps N] [--out bench/results/transport.json]
                              [--md bench/results/transport.md] [--transports tcp,shm,ucx]

UCX settings come from the environment as usual (``UCX_TLS``, ``UCX_MODULES=^ib`` ...);
the run records them.

Progress goes to stderr, the Markdown table to stdout (and ``--md``), every raw
sample and the summaries to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import gc
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Optional

from kvbridge.blockcopy import copy_threads
from bench._report import log
from bench._transport_cases import (  # noqa: F401  (re-exported: tests and other benches use bt.<name>)
    CONTIG_SIZES,
    LATENCY_TARGET,
    NIXL_LATENCY_TARGET,
    PLAIN_SEED,
    QUICK_MAX,
    SHM_TARGET,
    TCP_TARGET_BLOCKS,
    TCP_TARGET_CONTIG,
    UCX_LATENCY_TARGET,
    UCX_TARGET_BLOCKS,
    UCX_TARGET_CONTIG,
    Case,
    KiB,
    MiB,
    _iters_for,
    block_cases,
    contig_case,
    contig_layout,
    fill_bytes,
    fill_pool,
    flash_layout,
    fmt_size,
    host_buffer,
    make_case,
    memcpy,
    scattered_ids,
    scattered_pairs,
    summarize,
    tensor_view,
)
from bench._transport_latency import PEERS, LatencyRuns
from bench._transport_peers import (  # noqa: F401  (re-exported, as above)
    REQ,
    UCX_DATA_TAG,
    UCX_REQ_TAG,
    BareUCXClient,
    NixlPair,
    PlainClient,
    SenderProc,
    _BareUCXServer,
    _pin_all,
    _PlainServer,
    nixl_available,
    nixl_main,
    nixl_pieces,
    sender_main,
    ucx_available,
)


# ============================================================================== the benchmark

class Bench(LatencyRuns):
    def __init__(self, reps: int, quick: bool, lat_iters: int = 1000, lat_reps: int = 5,
                 sizes: Optional[list[int]] = None, blocks: bool = True, latency: bool = True,
                 max_iters: int = 400, transports: Optional[list[str]] = None) -> None:
        self.max_iters = max_iters
        self.transports = transports if transports is not None else (
            ["tcp", "shm", "ucx"] if ucx_available() else ["tcp", "shm"])
        self.ucx_client: Optional[BareUCXClient] = None
        self.nixl = "ucx" in self.transports and nixl_available()
        self.nixl_shm = "shm" in self.transports and nixl_available()   # NIXL over UCX, same host
        # Mooncake's Transfer Engine over tcp as the peer of the tcp 4 KiB rows, when it imports
        self.mooncake = "tcp" in self.transports and importlib.util.find_spec("mooncake") is not None
        self.reps = reps
        self.quick = quick
        self.lat_iters = lat_iters
        self.lat_reps = lat_reps
        self.sizes = sizes if sizes is not None else [s for s in CONTIG_SIZES if not quick or s <= QUICK_MAX]
        self.blocks = blocks
        self.latency = latency
        self.results: list[dict[str, Any]] = []
        self.latency_results: list[dict[str, Any]] = []
        self.sender: Optional[SenderProc] = None

    # -- plumbing -----------------------------------------------------------------------
    def _setup(self, case: Case, transport: str, plain: bool) -> dict[str, Any]:
        assert self.sender is not None
        return self.sender.call("setup", {"layout": case.layout, "pool_blocks": case.pool_blocks,
                                          "transport": transport, "seed": 1,
                                          "plain_nbytes": case.nbytes if plain and transport == "tcp" else 0,
                                          "ucx_nbytes": case.nbytes if plain and transport == "ucx" else 0})

    def _handles(self, case: Case, count: int, ttl: float = 3600.0) -> list[Any]:
        from kvbridge.handle import KVHandle
        assert self.sender is not None
        raws = self.sender.call("publish", {"block_ids": case.src_ids, "count": count, "ttl": ttl})
        return [KVHandle.from_bytes(r) for r in raws]

    def _recv_pool(self, case: Case) -> Any:
        from kvbridge.layout import KVLayout
        from kvbridge.pool import KVPool
        pool = KVPool.allocate(KVLayout.from_dict(case.layout), case.pool_blocks)
        for b in pool.buffers:
            b.view(-1).view(__import__("torch").uint8).fill_(1)   # touch every page up front
        return pool

    def _check_dst(self, pool: Any, case: Case, handle: Any) -> None:
        """The destination blocks hold exactly the sender's bytes (xxh3 per block)."""
        from kvbridge.integrity import block_checksums
        got = block_checksums(pool, case.dst_ids)
        if list(got) != list(handle.checksums):
            raise AssertionError(f"{case.name}: destination bytes differ from the sender's")

    # -- one throughput comparison --------------------------------------------------------
    def _compare(self, case: Case, transport: str, ceiling_name: str,
                 ceiling: Callable[[int], None], variants: dict[str, Callable[[int], Callable[[int], None]]],
                 targets: dict[str, float]) -> None:
        """Time ``ceiling`` and each variant ``reps`` times, interleaved: every variant's
        transfer right after a ceiling transfer (C A C B ...), the variants' order rotating
        each repetition.

        ``variants[name](iters)`` prepares (publishes handles) and returns ``run(i)``
        doing one transfer; ``ceiling(i)`` does one ceiling transfer. Each transfer then
        starts from the caches a ceiling transfer left, the ceiling's from those a variant
        left: a variant that followed another variant of the same blocks would find them
        in cache (two variants of one shm fetch share source and destination blocks).
        """
        iters = _iters_for(case.nbytes, self.quick, self.max_iters)
        names = [ceiling_name, *variants]
        samples: dict[str, list[float]] = {n: [] for n in names}
        # warm-up: connections, mappings, page faults
        ceiling(0)
        for name, prep in variants.items():
            run = prep(2)
            run(0), run(1)
        vnames = list(variants)
        for rep in range(self.reps):
            order = vnames[rep % len(vnames):] + vnames[:rep % len(vnames)]
            runners: dict[str, Callable[[int], None]] = {ceiling_name: ceiling}
            for name in variants:
                runners[name] = variants[name](iters)
            # Interleave single transfers (C A C B ...) so background load hits all alike.
            acc = dict.fromkeys(names, 0.0)
            seq = [step for name in order for step in ((ceiling_name, ceiling), (name, runners[name]))]
            perf = time.perf_counter
            gc.collect()
            for i in range(iters):
                for name, run in seq:
                    t0 = perf()
                    out = run(i)
                    # a runner in another process times itself and returns its seconds
                    acc[name] += out if type(out) is float else perf() - t0
            for name in names:
                samples[name].append(acc[name] / (iters * len(vnames) if name == ceiling_name else iters))
            log(f"  {case.name:>28} {transport} rep {rep + 1}/{self.reps}: " + ", ".join(
                f"{n} {case.nbytes / samples[n][-1] / 1e9:.2f} GB/s" for n in names))
        for name in variants:
            ratios = [c / k for c, k in zip(samples[ceiling_name], samples[name])]
            target = targets.get(name)
            rs = summarize(ratios)
            self.results.append({
                "case": case.name, "group": case.group, "nbytes": case.nbytes, "segments": case.segments,
                "part_nbytes": case.extra.get("part_nbytes"), "transport": name, "ceiling": ceiling_name,
                "iters_per_rep": iters, "reps": self.reps,
                "kvbridge_s": samples[name], "ceiling_s": samples[ceiling_name],
                "kvbridge_gbps": summarize([case.nbytes / s / 1e9 for s in samples[name]]),
                "ceiling_gbps": summarize([case.nbytes / s / 1e9 for s in samples[ceiling_name]]),
                "ratio": rs, "ratios": ratios, "target": target,
                "pass": None if target is None else rs["median"] >= target,
                "loadavg": os.getloadavg(),
            })

    def run_tcp(self, case: Case, target: Optional[float]) -> None:
        from kvbridge.receiver import KVReceiver
        info = self._setup(case, "tcp", plain=True)
        pool = self._recv_pool(case)
        plain_buf = host_buffer(case.nbytes, value=0)
        plain_view = tensor_view(plain_buf)
        client = PlainClient(info["plain_port"])
        recv_v, recv_nv = KVReceiver(pool), KVReceiver(pool, verify=False)
        last: dict[str, Any] = {}
        try:
            def ceiling(i: int) -> None:
                client.fetch(plain_view, case.nbytes)

            def variant(receiver: KVReceiver) -> Callable[[int], Callable[[int], None]]:
                def prep(iters: int) -> Callable[[int], None]:
                    hs = self._handles(case, iters)
                    last["h"] = hs[-1]
                    dst = case.dst_ids
                    fetch = receiver.fetch

                    def run(i: int) -> None:
                        r = fetch(hs[i], dst)
                        if not r.ok:
                            raise RuntimeError(f"fetch failed: {r.error!r}")
                    return run
                return prep
            self._compare(case, "tcp", "plain socket", ceiling,
                          {"tcp (verify)": variant(recv_v), "tcp (verify=False)": variant(recv_nv)},
                          {"tcp (verify)": target, "tcp (verify=False)": target} if target else {})
            self._check_dst(pool, case, last["h"])
        finally:
            client.close()
            recv_v.close()
            recv_nv.close()
            pool.close()

    def run_shm(self, case: Case, target: Optional[float]) -> None:
        from kvbridge.receiver import KVReceiver
        self._setup(case, "shm", plain=False)
        pool = self._recv_pool(case)
        src, dst = host_buffer(case.nbytes, seed=3), host_buffer(case.nbytes, value=0)
        recv_v, recv_nv = KVReceiver(pool), KVReceiver(pool, verify=False)
        last: dict[str, Any] = {}
        ceiling_name = "memcpy"
        extra: list[Any] = []
        try:
            def ceiling(i: int) -> None:
                memcpy(dst, src, case.nbytes)
            if case.group == "blocks":
                # the same scattered copies by hand: one memcpy per part, between two pools of the
                # same layout, source and destination parts where kvbridge finds them
                ceiling_name = "scattered memcpy"
                src_pool, dst_pool = self._recv_pool(case), self._recv_pool(case)
                extra += [src_pool, dst_pool]
                pairs = scattered_pairs(src_pool, case.src_ids, dst_pool, case.dst_ids)

                def ceiling(i: int) -> None:   # noqa: F811
                    for d, s in pairs:
                        d[:] = s

            def variant(receiver: KVReceiver) -> Callable[[int], Callable[[int], None]]:
                def prep(iters: int) -> Callable[[int], None]:
                    hs = self._handles(case, iters)
                    last["h"] = hs[-1]
                    dst_ids = case.dst_ids
                    fetch = receiver.fetch

                    def run(i: int) -> None:
                        r = fetch(hs[i], dst_ids)
                        if not r.ok:
                            raise RuntimeError(f"fetch failed: {r.error!r}")
                    return run
                return prep
            self._compare(case, "shm", ceiling_name, ceiling,
                          {"shm (verify)": variant(recv_v), "shm (verify=False)": variant(recv_nv)},
                          {"shm (verify)": target, "shm (verify=False)": target} if target else {})
            self._check_dst(pool, case, last["h"])
        finally:
            recv_v.close()
            recv_nv.close()
            pool.close()
            for p in extra:
                p.close()

    def _ucx_client(self) -> BareUCXClient:
        if self.ucx_client is None:
            assert self.sender is not None
            self.ucx_client = BareUCXClient(self.sender)
        return self.ucx_client

    def run_ucx(self, case: Case, target: Optional[float]) -> None:
        from kvbridge.receiver import KVReceiver
        client = self._ucx_client()
        self._setup(case, "ucx", plain=True)
        pool = self._recv_pool(case)
        bare_buf = host_buffer(case.nbytes, value=0)
        bare_view = tensor_view(bare_buf)
        recv_v, recv_nv = KVReceiver(pool), KVReceiver(pool, verify=False)
        last: dict[str, Any] = {}
        nixl: Optional[NixlPair] = None
        if self.nixl:
            size, src_p = nixl_pieces(case, 1)
            nixl = NixlPair(size, src_p, nixl_pieces(case, 2)[1])
        try:
            def ceiling(i: int) -> None:
                client.fetch(bare_view, case.nbytes)

            def variant(receiver: KVReceiver) -> Callable[[int], Callable[[int], None]]:
                def prep(iters: int) -> Callable[[int], None]:
                    hs = self._handles(case, iters)
                    last["h"] = hs[-1]
                    dst_ids = case.dst_ids
                    fetch = receiver.fetch

                    def run(i: int) -> None:
                        r = fetch(hs[i], dst_ids)
                        if not r.ok:
                            raise RuntimeError(f"fetch failed: {r.error!r}")
                    return run
                return prep
            variants = {"ucx (verify)": variant(recv_v), "ucx (verify=False)": variant(recv_nv)}
            if nixl is not None:
                n = nixl
                variants["NIXL READ (UCX)"] = lambda iters: n.run
            self._compare(case, "ucx", "bare ucxx", ceiling, variants,
                          {"ucx (verify)": target, "ucx (verify=False)": target} if target else {})
            self._check_dst(pool, case, last["h"])
            if nixl is not None:
                self._vs_nixl(case)
        finally:
            if nixl is not None:
                nixl.close()
            recv_v.close()
            recv_nv.close()
            pool.close()

    def _vs_nixl(self, case: Case) -> None:
        """kvbridge ucx against NIXL in the same repetitions: NIXL seconds / kvbridge seconds."""
        rows = {r["transport"]: r for r in self.results if r["case"] == case.name and r["ceiling"] == "bare ucxx"}
        peer = rows["NIXL READ (UCX)"]
        for name in ("ucx (verify)", "ucx (verify=False)"):
            r = rows[name]
            ratios = [n / k for n, k in zip(peer["kvbridge_s"], r["kvbridge_s"])]
            rs = summarize(ratios)
            target = 1.0 if case.nbytes >= MiB else None
            self.results.append({**r, "ceiling": "NIXL", "ceiling_s": peer["kvbridge_s"],
                                 "ceiling_gbps": peer["kvbridge_gbps"], "ratio": rs, "ratios": ratios,
                                 "target": target, "pass": None if target is None else rs["median"] >= target})

    # -- driver -------------------------------------------------------------------------------
    def run(self, sender: Optional[SenderProc] = None) -> None:
        """Run every section; spawns (and always kills) a sender process unless given one."""
        import torch
        torch.set_num_threads(1)     # no OpenMP workers spinning on the second core between fills
        t0 = time.perf_counter()
        own = sender is None
        self.sender = SenderProc() if sender is None else sender
        try:
            for size in self.sizes:
                case = contig_case(size)
                target_tcp = TCP_TARGET_CONTIG if size >= MiB else None
                target_shm = SHM_TARGET if size >= MiB else None
                if "tcp" in self.transports:
                    log(f"[contiguous {case.name}] tcp vs plain socket")
                    self.run_tcp(case, target_tcp)
                if "shm" in self.transports:
                    log(f"[contiguous {case.name}] shm vs memcpy")
                    self.run_shm(case, target_shm)
                if "ucx" in self.transports:
                    log(f"[contiguous {case.name}] ucx vs bare ucxx")
                    self.run_ucx(case, UCX_TARGET_CONTIG if size >= MiB else None)
            if self.blocks:
                for case in block_cases(self.quick):
                    log(f"[blocks {case.name}: {case.segments} runs of {fmt_size(case.extra['part_nbytes'])}]")
                    if "tcp" in self.transports:
                        self.run_tcp(case, TCP_TARGET_BLOCKS)
                    if "shm" in self.transports:
                        self.run_shm(case, SHM_TARGET)
                    if "ucx" in self.transports:
                        self.run_ucx(case, UCX_TARGET_BLOCKS)
            if self.latency:
                log(f"[latency 4 KiB, {self.lat_reps} reps x {self.lat_iters} iterations]")
                if "tcp" in self.transports:
                    self.run_latency()
                if "ucx" in self.transports:
                    self.run_latency_ucx()
                if "shm" in self.transports:
                    self.run_latency_shm()
            self.sender.call("teardown")
        finally:
            if self.ucx_client is not None:
                self.ucx_client.close()
                self.ucx_client = None
            if own:
                self.sender.close()
            self.sender = None
        self.elapsed = time.perf_counter() - t0

    # -- output ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        import torch
        import kvbridge
        return {
            "benchmark": "kvbridge transport",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "quick": self.quick, "reps": self.reps, "elapsed_s": getattr(self, "elapsed", None),
            "machine": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "torch": torch.__version__,
                        "kvbridge": getattr(kvbridge, "__version__", "?"),
                        "loadavg_at_end": os.getloadavg(),   # other tenants' load: judge the spread by it
                        # threads sharing large host copies, and how often the helper took part
                        "copy_threads": copy_threads(),
                        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX")}},
            "method": {
                "throughput_ratio": "ceiling seconds / kvbridge seconds, paired per repetition "
                                    "(interleaved, rotating order); pass = median ratio >= target",
                "latency_ratio": "kvbridge median / plain ping-pong median, per repetition; "
                                 "pass = median ratio <= target",
                "tcp_ceiling": "plain loopback socket, 8-byte request then sendall/recv_into, TCP_NODELAY",
                "shm_ceiling": "ctypes.memmove between two preallocated buffers in the receiver process",
                "ucx_ceiling": "bare ucxx: one tagged send of the same bytes per 8-byte tagged request, "
                               "worker-address endpoints, error handling off, polling",
                "kvbridge_timed": "receiver.fetch(handle, dst) with default release=True, fresh handle each",
            },
            "throughput": self.results,
            "latency": self.latency_results,
        }

    def markdown(self) -> str:
        ct = copy_threads()
        lines = [f"Copies of 1 MiB or more in two parts or more on {ct['threads']} thread(s) "
                 f"(`--copy-threads`); the helper took part in {ct['helped']} of {ct['jobs']} shared copies, "
                 f"{ct['helper_units']} of their {ct['units']} units.", "",
                 "| size / shape | transport | kvbridge GB/s (median) | ceiling GB/s (median) | "
                 "ratio median [min–max] | target | pass/fail |",
                 "|---|---|---:|---:|---|---|---|"]
        for r in self.results:
            shape = r["case"] if r["group"] == "contiguous" else \
                f"{r['case']} ({fmt_size(r['nbytes'])}, {r['segments']} runs)"
            tgt = f"≥ {r['target']:.1f}× {r['ceiling']}" if r["target"] else f"— (vs {r['ceiling']})"
            pf = "—" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
            rt = r["ratio"]
            lines.append(f"| {shape} | {r['transport']} | {r['kvbridge_gbps']['median']:.2f} | "
                         f"{r['ceiling_gbps']['median']:.2f} | {rt['median']:.2f} "
                         f"[{rt['min']:.2f}–{rt['max']:.2f}] | {tgt} | {pf} |")
        if self.latency_results:
            lines += ["", "| 4 KiB latency | kvbridge µs (median) | ping-pong µs (median) | "
                      "ratio median [min–max] | target | pass/fail |",
                      "|---|---:|---:|---|---|---|"]
            base = 0.0
            for r in self.latency_results:
                if r["target"] is None and r["case"].startswith(PEERS):
                    rt = r["ratio_vs_pingpong"]
                    lines.append(f"| {r['case']} (peer) | {r['median_us']['median']:.1f} | {base:.1f} | "
                                 f"{rt['median']:.2f} [{rt['min']:.2f}–{rt['max']:.2f}] | — | — |")
                    continue
                if r["target"] is None and not r.get("is_base", True):   # no target of its own
                    rt = r["ratio_vs_pingpong"]
                    lines.append(f"| {r['case']} | {r['median_us']['median']:.1f} | {base:.1f} | "
                                 f"{rt['median']:.2f} [{rt['min']:.2f}–{rt['max']:.2f}] | — | — |")
                    continue
                if r["target"] is None:
                    base = r["median_us"]["median"]
                    lines.append(f"| {r['case']} (baseline) | {base:.1f} | {base:.1f} | 1.00 | — | — |")
                    continue
                if r.get("vs_peer"):
                    rt = r["ratio_vs_pingpong"]
                    who = r.get("peer", "NIXL")
                    lines.append(f"| {r['case']} | {r['median_us']['median']:.1f} | "
                                 f"{r['peer_median_us']['median']:.1f} ({who}) | {rt['median']:.2f} "
                                 f"[{rt['min']:.2f}–{rt['max']:.2f}] | ≤ {r['target']:.1f}× {who} | "
                                 f"{'PASS' if r['pass'] else 'FAIL'} |")
                    continue
                rt = r["ratio_vs_pingpong"]
                pf = "PASS" if r["pass"] else "FAIL"
                lines.append(f"| {r['case']} | {r['median_us']['median']:.1f} | {base:.1f} | "
                             f"{rt['median']:.2f} [{rt['min']:.2f}–{rt['max']:.2f}] | "
                             f"≤ {r['target']:.1f}× | {pf} |")
            every = [r for r in self.latency_results if "mean_us" in r]
            if every:     # the mean counts work done in batches (deferred releases) in full
                lines += ["", "| 4 KiB latency, every call | mean µs | median µs | p99 µs |", "|---|---:|---:|---:|"]
                lines += [f"| {r['case']} | {r['mean_us']:.1f} | {r['all_samples_median_us']:.1f} | "
                          f"{r['p99_us']:.1f} |" for r in every]
        return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 7, quick 3)")
    ap.add_argument("--out", default="/tmp/kvbridge-bench/transport.json",
                    help="results JSON (default: scratch; the committed results are bench/results/transport.json)")
    ap.add_argument("--md", default="/tmp/kvbridge-bench/transport.md")
    ap.add_argument("--lat-iters", type=int, default=1000, help="latency iterations per repetition (>= 1000)")
    ap.add_argument("--sizes", default=None, help="comma-separated contiguous sizes in bytes (override)")
    ap.add_argument("--max-iters", type=int, default=400, help="cap on transfers per repetition")
    ap.add_argument("--no-blocks", action="store_true")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--no-nixl", action="store_true", help="skip the NIXL peer column even if nixl is installed")
    ap.add_argument("--no-mooncake", action="store_true",
                    help="skip the Mooncake Transfer Engine peer row even if mooncake is installed")
    ap.add_argument("--copy-threads", type=int, default=None, choices=(1, 2),
                    help="threads that share a copy of 1 MiB or more in two parts or more (default: "
                    "kvbridge's, 2 where this process may run on two CPUs)")
    ap.add_argument("--transports", default=None, help="comma-separated subset of tcp,shm,ucx (default: all "
                    "available)")
    a = ap.parse_args(argv)
    if a.copy_threads is not None:
        copy_threads(a.copy_threads)
    reps = a.reps or (3 if a.quick else 7)
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else None
    b = Bench(reps, a.quick, lat_iters=a.lat_iters, lat_reps=3 if a.quick else 5, sizes=sizes,
              blocks=not a.no_blocks, latency=not a.no_latency, max_iters=a.max_iters,
              transports=a.transports.split(",") if a.transports else None)
    if a.no_nixl:
        b.nixl = b.nixl_shm = False
    if a.no_mooncake:
        b.mooncake = False
    b.run()
    emit(b, a.out, a.md)
    return 0


def emit(b: Bench, out: Optional[str], md_path: Optional[str]) -> None:
    """Print the Markdown table to stdout; write it and the JSON (raw samples + summaries)."""
    md = b.markdown()
    sys.stdout.write(md)
    for path, text in ((out, json.dumps(b.to_json(), indent=1)), (md_path, md)):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            log(f"wrote {path}")

if __name__ == "__main__":
    sys.exit(main())
