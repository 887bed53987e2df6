"""The 4 KiB latency sections of the transport benchmark, a mixin of :class:`bench.transport.Bench`:
kvbridge tcp against a plain ping-pong (both processes pinned to one core), ucx against the bare
ucxx ping-pong, shm against a 4 KiB memcpy, NIXL as a peer column when it is installed."""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable, Optional

from bench._report import log
from bench._transport_cases import (
    LATENCY_TARGET,
    NIXL_LATENCY_TARGET,
    UCX_LATENCY_TARGET,
    Case,
    KiB,
    contig_case,
    host_buffer,
    memcpy,
    summarize,
    tensor_view,
)
from bench._transport_peers import MooncakePair, NixlPair, PlainClient, SenderProc, _pin_all



def kvbridge_variants(name: str, rv: Any, rnv: Any, tr: Any, url: str, handle: Any, spans: Any,
                      dst: list[int]) -> dict[str, Callable[[Any], None]]:
    """The four kvbridge rows of a 4 KiB latency run over transport ``name``: the read alone,
    fetches kept (verified and not) of one long-lived handle, and a fetch with release of a
    fresh handle (the argument). A failed fetch stops the run."""
    def ok(res: Any) -> None:
        if not res.ok:
            raise RuntimeError(f"fetch failed: {res.error!r}")
    return {
        f"{name} read only (transport.read)": lambda _: tr.read(url, handle, spans),
        f"{name} fetch(release=False), verify": lambda _: ok(rv.fetch(handle, dst, release=False)),
        f"{name} fetch(release=False), verify=False": lambda _: ok(rnv.fetch(handle, dst, release=False)),
        f"{name} fetch (with release), verify": lambda h: ok(rv.fetch(h, dst)),
    }

# the peers' rows (names start with these), who they are, and kvbridge's target against them:
# within 2x of NIXL; faster than Mooncake's Transfer Engine
PEERS = ("NIXL", "Mooncake")
PEERS_TARGET = {"NIXL": ("NIXL", NIXL_LATENCY_TARGET), "Mooncake": ("Mooncake", 1.0)}


class LatencyRuns:
    """The latency sections; :class:`bench.transport.Bench` supplies the plumbing
    (``_setup``, ``_handles``, ``_recv_pool``, ``_check_dst``, ``_ucx_client``) and the settings."""

    sender: Optional[SenderProc]
    nixl: bool
    nixl_shm: bool
    mooncake: bool
    lat_iters: int
    lat_reps: int
    latency_results: list[dict[str, Any]]

    # -- latency ----------------------------------------------------------------------------
    def run_latency(self) -> None:
        """Both processes pinned to one core: on this VM a loopback round trip costs ~15 us
        when the woken thread runs on the waker's core and ~55 us when it must be woken on
        the other one, and the scheduler's choice flips between runs. Pinning makes the
        ceiling and kvbridge pay the same wake-up."""
        assert self.sender is not None
        cpus = sorted(os.sched_getaffinity(0))
        pinned = _pin_all(self.sender.proc.pid, {cpus[0]}) and _pin_all(os.getpid(), {cpus[0]})
        try:
            self._run_latency()
        finally:
            if pinned:
                _pin_all(self.sender.proc.pid, set(cpus))
                _pin_all(os.getpid(), set(cpus))
        for r in self.latency_results:
            r.setdefault("pinned_to_one_core", pinned)

    def _run_latency(self) -> None:
        from kvbridge.receiver import KVReceiver
        case = contig_case(4 * KiB)
        info = self._setup(case, "tcp", plain=True)
        pool = self._recv_pool(case)
        plain_buf = host_buffer(case.nbytes, value=0)
        plain_view = tensor_view(plain_buf)
        client = PlainClient(info["plain_port"])
        rv, rnv = KVReceiver(pool), KVReceiver(pool, verify=False)
        url = info["url"]
        mc: Optional[MooncakePair] = None
        if self.mooncake:     # spawned from this pinned process: its two processes share the core
            mc, why = MooncakePair.start(4096)
            if mc is None:
                log(f"  Mooncake Transfer Engine peer skipped: {why}")
        try:
            rows, long_h = self._kvbridge_rows("tcp", case, pool, rv, rnv, url)
            variants: dict[str, Callable[[Any], None]] = {
                "plain 4 KiB ping-pong": lambda _: client.fetch(plain_view, 4096),
                **rows,
            }
            if mc is not None:
                m = mc
                variants["Mooncake TE READ 4 KiB (tcp)"] = lambda _: m.run()
            self._latency_rounds(case, variants, "tcp fetch (with release), verify", LATENCY_TARGET,
                                 "plain ping-pong", pinned=None)
            self._check_dst(pool, case, long_h)
            if mc is not None and not mc.check():
                raise RuntimeError("Mooncake's reads did not deliver the target's bytes")
        finally:
            if mc is not None:
                mc.close()
            client.close()
            rv.close()
            rnv.close()
            pool.close()

    def run_latency_ucx(self) -> None:
        """4 KiB over ucx vs. the bare ucxx ping-pong, interleaved in chunks of 10, not pinned."""
        from kvbridge.receiver import KVReceiver
        case = contig_case(4 * KiB)
        client = self._ucx_client()
        info = self._setup(case, "ucx", plain=True)
        pool = self._recv_pool(case)
        bare_buf = host_buffer(case.nbytes, value=0)     # kept alive: the view does not own it
        bare_view = tensor_view(bare_buf)
        rv, rnv = KVReceiver(pool), KVReceiver(pool, verify=False)
        url = info["url"]
        try:
            rows, long_h = self._kvbridge_rows("ucx", case, pool, rv, rnv, url)
            variants: dict[str, Callable[[Any], None]] = {
                "bare ucxx 4 KiB ping-pong": lambda _: client.fetch(bare_view, 4096),
                **rows,
            }
            nixl = None
            if self.nixl:
                nixl = NixlPair(4096, [(0, 4096)], [(0, 4096)])
                variants["NIXL READ 4 KiB (UCX)"] = lambda _: nixl.run()
            try:
                self._latency_rounds(case, variants, "ucx fetch (with release), verify", UCX_LATENCY_TARGET,
                                     "bare ucxx ping-pong")
            finally:
                if nixl is not None:
                    nixl.close()
            self._check_dst(pool, case, long_h)
        finally:
            rv.close()
            rnv.close()
            pool.close()

    def run_latency_shm(self) -> None:
        """4 KiB over shm: one-sided read, fetch without and with release, against a 4 KiB memcpy
        and (when nixl is installed) a NIXL READ of 4 KiB between two processes of this host."""
        from kvbridge.receiver import KVReceiver
        case = contig_case(4 * KiB)
        info = self._setup(case, "shm", plain=False)
        pool = self._recv_pool(case)
        src, dst_buf = host_buffer(4096, seed=3), host_buffer(4096, value=0)
        rv, rnv = KVReceiver(pool), KVReceiver(pool, verify=False)
        url = info["url"]
        nixl = NixlPair(4096, [(0, 4096)], [(0, 4096)]) if self.nixl_shm else None
        try:
            rows, long_h = self._kvbridge_rows("shm", case, pool, rv, rnv, url)
            variants: dict[str, Callable[[Any], None]] = {
                "memcpy 4 KiB": lambda _: memcpy(dst_buf, src, 4096),
                **rows,
            }
            if nixl is not None:
                n = nixl
                variants["NIXL READ 4 KiB (UCX, same host)"] = lambda _: n.run()
            self._latency_rounds(case, variants, "shm fetch (with release), verify", None, "memcpy 4 KiB")
            self._check_dst(pool, case, long_h)
        finally:
            if nixl is not None:
                nixl.close()
            rv.close()
            rnv.close()
            pool.close()

    def _kvbridge_rows(self, name: str, case: Case, pool: Any, rv: Any, rnv: Any,
                       url: str) -> tuple[dict[str, Callable[[Any], None]], Any]:
        """The kvbridge rows over ``url`` and the long-lived handle they fetch."""
        from kvbridge.transports.base import Spans
        long_h = self._handles(case, 1)[0]
        rows = kvbridge_variants(name, rv, rnv, rv.transport(url), url, long_h, Spans.of_blocks(pool, case.dst_ids),
                                 case.dst_ids)
        return rows, long_h

    def _latency_rounds(self, case: Case, variants: dict[str, Callable[[Any], None]], fresh_name: str,
                        target_ratio: Optional[float], base_name: str, pinned: Optional[bool] = False) -> None:
        """Interleave ``variants`` in chunks of 10 calls, rotating the order; the first is the
        baseline. ``fresh_name`` takes a fresh handle per call. ``pinned=None``: the caller
        records whether the processes were pinned."""
        names = list(variants)
        n_it, chunk = self.lat_iters, 10
        for name in names:
            hs = self._handles(case, 50) if name == fresh_name else [None] * 50
            for h in hs:
                variants[name](h)
        samples: dict[str, list[list[int]]] = {n: [] for n in names}
        for rep in range(self.lat_reps):
            fresh = iter(self._handles(case, n_it))
            per: dict[str, list[int]] = {n: [] for n in names}
            gc.collect()
            for start in range(0, n_it, chunk):
                k = min(chunk, n_it - start)
                rot = (start // chunk + rep) % len(names)
                for name in names[rot:] + names[:rot]:
                    fn = variants[name]
                    out = per[name]
                    for _ in range(k):
                        arg = next(fresh) if name == fresh_name else None
                        t0 = time.perf_counter_ns()
                        got = fn(arg)
                        out.append(int(got * 1e9) if type(got) is float else time.perf_counter_ns() - t0)
            for n in names:
                samples[n].append(per[n])
            log(f"  latency rep {rep + 1}/{self.lat_reps}: " + ", ".join(
                f"{n} {statistics.median(per[n]) / 1e3:.1f} us" for n in names))
        base = [statistics.median(x) for x in samples[names[0]]]
        for n in names:
            meds = [statistics.median(x) for x in samples[n]]
            ratios = [m / b for m, b in zip(meds, base)]
            target = None if n == names[0] else target_ratio
            rs = summarize(ratios)
            if n.startswith(PEERS):
                target = None                      # a peer, not kvbridge
            self.latency_results.append({
                "case": n, "nbytes": 4096, "iters_per_rep": n_it, "reps": self.lat_reps, "baseline": base_name,
                "median_us_per_rep": [m / 1e3 for m in meds],
                "median_us": summarize([m / 1e3 for m in meds]),
                "all_samples_median_us": statistics.median([v for x in samples[n] for v in x]) / 1e3,
                # the mean over every call: work deferred and done in batches (releases) counts in full
                "mean_us": statistics.fmean([v for x in samples[n] for v in x]) / 1e3,
                "p99_us": sorted(v for x in samples[n] for v in x)[int(0.99 * n_it * self.lat_reps) - 1] / 1e3,
                "ratio_vs_pingpong": rs, "ratios": ratios, "target": target,
                "pass": None if target is None else rs["median"] <= target,
                "is_base": n == names[0], "samples_ns": samples[n],
                **({} if pinned is None else {"pinned_to_one_core": pinned}),
            })
        for peer in (n for n in names if n.startswith(PEERS)):   # kvbridge vs a peer, paired per repetition
            who, goal = PEERS_TARGET[next(p for p in PEERS if peer.startswith(p))]
            pm = [statistics.median(x) for x in samples[peer]]
            for n in names[1:]:
                if n.startswith(PEERS):
                    continue
                meds = [statistics.median(x) for x in samples[n]]
                ratios = [m / b for m, b in zip(meds, pm)]
                rs = summarize(ratios)
                self.latency_results.append({
                    "case": f"{n} vs {who}", "nbytes": 4096, "baseline": peer, "vs_peer": True, "peer": who,
                    "median_us": summarize([m / 1e3 for m in meds]), "peer_median_us": summarize([m / 1e3 for m in pm]),
                    "ratio_vs_pingpong": rs, "ratios": ratios, "target": goal,
                    "pass": rs["median"] <= goal, **({} if pinned is None else {"pinned_to_one_core": pinned})})
