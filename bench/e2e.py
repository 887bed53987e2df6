"""End-to-end benchmark: does prefill/decode disaggregation pay on this machine and traffic?

The same seeded request trace is sent to two deployments of the reference workers,
both started with ``python -m kvbridge up`` (the command users run), with EQUAL CORES:

* **colocated**: ``kvbridge up --colocated --threads T`` -- one engine with ``T`` torch
  threads that does prefill and decode as a modern engine schedules them: decode steps
  first, prompts prefilled in chunks of ``--chunk-size`` tokens, continuous batching;
* **disaggregated**: ``kvbridge up --threads T/2`` -- one prefill and one decode worker
  with ``T/2`` threads each, the embedded lease server, KV moved over ``--transport``.

``T`` defaults to the machine's core count (2 here). Everything else is the same: model
and weights, chunk size, KV pool size, the proxy (OpenAI-style ``POST /v1/completions``,
streaming), the client.

Traffic: one trace per mix (``short`` chats, ``long`` prompts): prompt and output lengths
drawn uniformly from the mix's ranges, token ids drawn uniformly from the byte vocabulary
(0..255), ``ignore_eos`` so every output has exactly its drawn length, greedy. Arrivals
are a Poisson process: unit-rate exponential gaps drawn once per mix and divided by the
arrival rate, so every rate of a mix sends the same requests, only closer together.

The client (this process) opens one thread per request at its arrival time, streams the
answer and timestamps every token as it arrives; TTFT, TPOT (mean gap after the first
token) and goodput are computed from those client-side times with
:func:`kvbridge.workers.metrics.summarize`, joined (by request id) with the proxy's
server-side record of each request: queueing, prefill compute, KV transfer time and
bytes. CPU time of every process of each deployment, and of everything else running on
the machine, is sampled around each run (the machine is shared and noisy: other load is
reported, not hidden). Both deployments are up for the whole benchmark (the idle one
costs nothing) and, per rate, the two modes run back to back, alternating which goes first.

Run::

    python -m bench.e2e [--quick] [--model bench] [--mix short|long|both] [--requests N]
                        [--rate R] [--seed S] [--transport tcp|shm] [--ttft-slo S] [--tpot-slo S]
                        [--out PATH.json] [--md PATH.md] [--png PATH.png]

Results go to a scratch file under the temp directory unless ``--out`` names one
(``--out bench/results/e2e.json`` regenerates the committed results; ``--md`` and
``--png`` default to the same path with their suffix).
Progress goes to stderr; the Markdown report to stdout and ``--md``; every per-request
record (client times, server timings, tokens) and the summaries to ``--out``; CDFs of
TTFT and TPOT of both modes for each mix to ``--png``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from bench._e2e_report import (  # noqa: F401  (re-exported: tests and other benches use e2e.<name>)
    KV_PROMPT_MIN,
    LOSS_MARGIN,
    TARGET_GOODPUT_RATIO,
    TARGET_KV_FRACTION,
    _bucket_tables,
    _cell_table,
    _fmt_ratio,
    _ms,
    _num,
    _ratio,
    _s,
    compare,
    markdown,
    pd_losses,
    plot,
    targets,
)
from bench._e2e_trace import (  # noqa: F401  (re-exported, as above)
    MIXES,
    MODES,
    VOCAB,
    ClientRecord,
    Mix,
    TraceReq,
    _send,
    at_rate,
    log,
    make_trace,
    run_trace,
    warm_up,
)
from kvbridge.workers.metrics import RequestMetrics, percentile, summarize


# ============================================================================== CPU accounting

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> Optional[float]:
    """utime + stime of ``pid`` in seconds (None if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _machine_busy() -> float:
    """CPU seconds the whole machine spent busy (all cores) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / _TICK


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


class CpuSample:
    """CPU seconds of named process groups and of the whole machine, between two instants."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.t0 = time.monotonic()
        self.m0 = _machine_busy()
        self.c0 = {k: sum(_proc_cpu(p) or 0.0 for p in pids) for k, pids in groups.items()}

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        used = {k: sum(_proc_cpu(p) or 0.0 for p in pids) - self.c0[k] for k, pids in self.groups.items()}
        out = {"wall_s": wall, "machine_busy_cores": (_machine_busy() - self.m0) / wall if wall > 0 else 0.0}
        for k, v in used.items():
            out[f"{k}_cores"] = v / wall if wall > 0 else 0.0
        return out


# ============================================================================== deployments

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str, timeout: float = 10.0) -> Any:
    u = url.split("/", 3)
    host, port = u[2].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/" + u[3])
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status}: {data[:200]!r}")
        return json.loads(data)
    finally:
        conn.close()


@dataclass
class DeployConfig:
    model: str = "bench"
    seed: int = 0
    chunk_size: int = 256
    num_blocks: int = 4096
    transport: str = "tcp"
    cores: int = 2
    ttft_slo: float = 2.0
    tpot_slo: float = 0.1


class Deployment:
    """``python -m kvbridge up [--colocated]`` as a child process."""

    def __init__(self, mode: str, cfg: DeployConfig, log_dir: str) -> None:
        self.mode = mode
        self.cfg = cfg
        self.threads = cfg.cores if mode == "colocated" else max(1, cfg.cores // 2)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"up-{mode}.log")
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.workers: list[dict[str, Any]] = []

    @property
    def argv(self) -> list[str]:
        c = self.cfg
        a = ["up", "--port", str(self.port), "--no-progress", "--model", c.model, "--seed", str(c.seed),
             "--chunk-size", str(c.chunk_size), "--num-blocks", str(c.num_blocks), "--threads", str(self.threads),
             "--ttft-slo", str(c.ttft_slo), "--tpot-slo", str(c.tpot_slo)]
        return a + (["--colocated"] if self.mode == "colocated" else ["--transport", c.transport])

    def start(self, timeout: float = 180.0) -> "Deployment":
        from kvbridge.workers.server import die_with_parent

        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge", *self.argv], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=logf, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbridge up ({self.mode}) exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                h = _get_json(self.url + "/health", timeout=2.0)
                if h.get("status") == "ok":
                    self.workers = h["workers"]
                    return self
            except (OSError, RuntimeError, ValueError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvbridge up ({self.mode}) not healthy within {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def cpu_groups(self) -> dict[str, list[int]]:
        assert self.proc is not None
        g: dict[str, list[int]] = {}
        wpids = set()
        for w in self.workers:
            g.setdefault(w["role"], []).append(int(w["pid"]))
            wpids.add(int(w["pid"]))
        tree = _descendants(self.proc.pid)
        g["proxy"] = [self.proc.pid]
        g["lease_server"] = [p for p in tree if p != self.proc.pid and p not in wpids]
        g["all"] = tree
        return g

    def records(self) -> dict[str, dict[str, Any]]:
        s = _get_json(self.url + "/metrics.json?records=1", timeout=30.0)
        return {r["request_id"]: r for r in s.get("records", [])}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ============================================================================== one run

def to_metrics(rec: ClientRecord, server: Optional[dict[str, Any]], mode: str) -> RequestMetrics:
    """A client-timed RequestMetrics with the proxy's server-side timings joined in."""
    s = server or {}
    return RequestMetrics(
        request_id=rec.request_id or f"client-{rec.idx}", mode=mode, prompt_tokens=rec.prompt_tokens,
        output_tokens=len(rec.tokens), arrival=rec.sent, first_token_at=rec.first_token_at,
        finished_at=rec.finished_at, queue_s=s.get("queue_s"), prefill_s=s.get("prefill_s"),
        kv_transfer_s=s.get("kv_transfer_s"), kv_bytes=int(s.get("kv_bytes") or 0),
        retries=int(s.get("retries") or 0), reprefills=int(s.get("reprefills") or 0), ok=rec.ok,
        error=rec.error, finish_reason=rec.finish_reason, token_times=list(rec.token_times))


def run_cell(dep: Deployment, mix: Mix, trace: list[TraceReq], rate: float) -> dict[str, Any]:
    label = f"{mix.name} @ {rate:g} req/s, {dep.mode}"
    log(f"{label}: {len(trace)} requests over {trace[-1].at:.0f}s")
    cpu = CpuSample({**dep.cpu_groups(), "bench_client": [os.getpid()]})
    t0 = time.time()
    recs = run_trace(dep.url, trace, label)
    usage = cpu.stop()
    usage["other_cores"] = max(0.0, usage["machine_busy_cores"] - usage["all_cores"] - usage["bench_client_cores"])
    server = dep.records()
    rows = []
    for rec in recs:
        s = server.get(rec.request_id or "")
        m = to_metrics(rec, s, dep.mode)
        d = m.to_dict()
        d.update(idx=rec.idx, scheduled_s=rec.scheduled, late_s=rec.late_s, max_tokens=rec.max_tokens,
                 token_times=[round(t - rec.sent, 6) for t in rec.token_times], tokens=rec.tokens,
                 server=s)
        rows.append((m, d))
    mets = [m for m, _ in rows]
    buckets = {"prompt": mix.prompt_buckets, "output": mix.output_buckets}
    summ = summarize(mets, mix.ttft_slo, mix.tpot_slo, buckets=buckets)
    ok = sum(m.ok for m in mets)
    log(f"{label}: {ok}/{len(mets)} ok, good {summ['good_requests']}, TTFT p50 {_ms(summ['ttft']['p50'])} "
        f"p99 {_ms(summ['ttft']['p99'])}, TPOT p50 {_ms(summ['tpot']['p50'])} p99 {_ms(summ['tpot']['p99'])}, "
        f"{time.time() - t0:.0f}s")
    return {"mode": dep.mode, "rate": rate, "summary": summ, "extra": extra_stats(mets, rows, usage, dep),
            "cpu": usage, "records": [d for _, d in rows]}


def _q(vals: Sequence[float]) -> dict[str, Optional[float]]:
    return {"p50": percentile(vals, 50), "p95": percentile(vals, 95), "p99": percentile(vals, 99),
            "mean": statistics.fmean(vals) if vals else None, "count": len(vals)}


def extra_stats(mets: Sequence[RequestMetrics], rows: Sequence[tuple[RequestMetrics, dict[str, Any]]],
                usage: dict[str, float], dep: Deployment) -> dict[str, Any]:
    """What summarize() does not give: where TTFT goes, the 2nd-token gap, KV/TTFT, ITLs."""
    ok = [m for m in mets if m.ok and m.ttft is not None]
    kv_frac = [m.kv_transfer_s / m.ttft for m in ok
               if m.prompt_tokens >= KV_PROMPT_MIN and m.kv_transfer_s is not None and m.ttft]
    overhead = [m.ttft - (m.queue_s or 0.0) - (m.prefill_s or 0.0) for m in ok
                if m.queue_s is not None and m.prefill_s is not None]
    gap2 = [m.token_times[1] - m.token_times[0] for m in ok if len(m.token_times) >= 2]
    itl = [b - a for m in ok for a, b in zip(m.token_times[1:], m.token_times[2:])]
    kv_mib = [m.kv_bytes / (1 << 20) for m in ok if m.kv_bytes]
    late = [d["late_s"] for _, d in rows]
    return {
        "kv_over_ttft_long_prompts": _q(kv_frac),
        "kv_transfer_s": _q([m.kv_transfer_s for m in ok if m.kv_transfer_s is not None]),
        "kv_mib": _q(kv_mib),
        "kv_gib_s": (sum(m.kv_bytes for m in ok) / (1 << 30)) / s if (s := sum(
            m.kv_transfer_s or 0.0 for m in ok)) > 0 else None,
        "queue_s": _q([m.queue_s for m in ok if m.queue_s is not None]),
        "prefill_s": _q([m.prefill_s for m in ok if m.prefill_s is not None]),
        "ttft_overhead_s": _q(overhead),   # TTFT minus server queueing and prefill compute
        "second_token_gap_s": _q(gap2),     # disaggregated: includes the KV fetch and decode admission
        "itl_after_2nd_s": _q(itl),
        "client_late_s": _q(late),
        "threads": dep.threads,
    }


# ============================================================================== engine calibration

def engine_calibration(model: str, seed: int, chunk: int, cores: int, reps: int = 5) -> dict[str, Any]:
    """Median seconds of the engine's unit operations at 1 and ``cores`` torch threads, in this
    process, before the deployments start: how well does one engine use more threads?"""
    import torch

    from kvbridge.pool import KVPool
    from kvbridge.workers.engine import Engine
    from kvbridge.workers.model import CausalLM, SeqPiece

    before = torch.get_num_threads()
    m = CausalLM.from_seed(model, seed=seed)
    pool = KVPool.allocate(m.kv_layout(16), 2048)
    e = Engine(m, pool)
    rng = random.Random(1)
    ids = [rng.randrange(VOCAB) for _ in range(2048 + chunk)]
    tables = {ctx: [pool.alloc(e.blocks_needed(ctx + 1)) for _ in range(b)]
              for ctx, b in ((200, 32), (1500, 8))}
    big = pool.alloc(e.blocks_needed(2048 + chunk))
    ops: dict[str, Any] = {
        f"prefill chunk {chunk} tokens at position 0": lambda: e.forward([SeqPiece(big, 0, ids[:chunk])]),
        f"prefill chunk {chunk} tokens at position 1536":
            lambda: e.forward([SeqPiece(big, 1536, ids[1536:1536 + chunk])]),
        "prefill 144-token prompt": lambda: e.forward([SeqPiece(big, 0, ids[:144])]),
    }
    for ctx, bs in ((200, (1, 8, 32)), (1500, (1, 8))):
        for b in bs:
            ops[f"decode step, batch {b}, context {ctx}"] = (
                lambda ctx=ctx, b=b: e.decode_step([(t, ctx, 5) for t in tables[ctx][:b]]))
    out: dict[str, Any] = {"threads": sorted({1, cores}), "ops": {}}
    try:
        with torch.inference_mode():
            for th in out["threads"]:
                torch.set_num_threads(th)
                for name, fn in ops.items():
                    fn()
                    ts = []
                    for _ in range(reps):
                        t = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t)
                    out["ops"].setdefault(name, {})[str(th)] = statistics.median(ts)
    finally:
        torch.set_num_threads(before)
        pool.close()
    return out


# ============================================================================== main

def _machine() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}, " \
           f"torch {torch.__version__}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests, the headline rate only (<= ~3 min)")
    ap.add_argument("--model", default="bench", help="model preset (default bench)")
    ap.add_argument("--mix", choices=["short", "long", "both"], default="both")
    ap.add_argument("--requests", type=int, default=None, help="requests per rate (default: per mix)")
    ap.add_argument("--rate", type=float, action="append", default=None,
                    help="arrival rate, req/s (repeat for several; default: per mix). The first is the headline")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (weights use --model-seed)")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    ap.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds (default: per mix)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO in seconds (default: per mix)")
    ap.add_argument("--cores", type=int, default=None,
                    help="cores per mode: colocated threads; half each for prefill and decode (default: CPU count)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="override the mix's prompt length range (tests)")
    ap.add_argument("--output-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="override the mix's output length range (tests)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default: a scratch file under the temp directory; the committed "
                         "results are bench/results/e2e.json)")
    ap.add_argument("--md", default=None, help="Markdown report (default: next to --out, .md; '' for none)")
    ap.add_argument("--png", default=None, help="CDF plots (default: next to --out, .png; '' for none)")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="no run: re-render the Markdown and PNG from a results JSON written earlier")
    return ap


def output_paths(a: argparse.Namespace) -> tuple[str, str, str]:
    """(json, md, png): ``--out`` or a scratch file; the others next to it unless named."""
    out = a.out or os.path.join(tempfile.gettempdir(), f"kvbridge-bench-{os.getuid()}", "e2e.json")
    stem = out[:-5] if out.endswith(".json") else out
    return (out, stem + ".md" if a.md is None else a.md, stem + ".png" if a.png is None else a.png)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    a.out, a.md, a.png = output_paths(a)
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)
        md = markdown(results)
        if a.md:
            with open(a.md, "w") as f:
                f.write(md)
        if a.png:
            plot(results, a.png)
        print(md)
        return 0
    cores = a.cores or os.cpu_count() or 2
    if cores < 2:
        print("need at least 2 cores (1 prefill + 1 decode)", file=sys.stderr)
        return 2
    names = ["short", "long"] if a.mix == "both" else [a.mix]
    mixes: list[Mix] = []
    for n in names:
        m = MIXES[n]
        kw: dict[str, Any] = {}
        if a.ttft_slo is not None:
            kw["ttft_slo"] = a.ttft_slo
        if a.tpot_slo is not None:
            kw["tpot_slo"] = a.tpot_slo
        if a.prompt_range:
            kw["prompt"] = tuple(a.prompt_range)
        if a.output_range:
            kw["output"] = tuple(a.output_range)
        mixes.append(Mix(**{**asdict(m), **kw}))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.monotonic()
    cfg = DeployConfig(model=a.model, seed=a.model_seed, chunk_size=a.chunk_size, num_blocks=a.num_blocks,
                       transport=a.transport, cores=cores)
    log_dir = tempfile.mkdtemp(prefix="kvbridge-e2e-")
    deps = {mode: Deployment(mode, cfg, log_dir) for mode in MODES}
    log("engine calibration (1 vs %d threads)" % cores)
    calibration = engine_calibration(a.model, a.model_seed, a.chunk_size, cores)
    results: dict[str, Any] = {"calibration": calibration, "meta": {
        "model": a.model, "model_seed": a.model_seed, "seed": a.seed, "chunk_size": a.chunk_size,
        "num_blocks": a.num_blocks, "transport": a.transport, "cores": cores, "quick": a.quick,
        "machine": _machine(), "started": started, "argv": list(argv) if argv is not None else sys.argv[1:],
        "commands": {m: "kvbridge " + " ".join(d.argv) for m, d in deps.items()}, "logs": log_dir,
    }, "mixes": {}}
    try:
        for mode, dep in deps.items():
            t = time.monotonic()
            dep.start()
            log(f"{mode} up at {dep.url} in {time.monotonic() - t:.1f}s: "
                + ", ".join(f"{w['role']} pid {w['pid']} ({w.get('threads')} threads)" for w in dep.workers))
        for mode, dep in deps.items():
            t = time.monotonic()
            warm_up(dep.url, mixes, a.seed)
            log(f"{mode} warmed up in {time.monotonic() - t:.1f}s")
        flip = False
        for mix in mixes:
            n = a.requests or (mix.quick_requests if a.quick else mix.requests)
            rates = a.rate or ([mix.quick_rate] if a.quick else list(mix.rates))
            unit, prompts, outs = make_trace(mix, n, a.seed)
            mx: dict[str, Any] = {"mix": asdict(mix), "requests": n, "cells": []}
            results["mixes"][mix.name] = mx
            for rate in rates:
                trace = at_rate(unit, prompts, outs, rate)
                cell: dict[str, Any] = {"rate": rate}
                order = MODES[::-1] if flip else MODES
                flip = not flip
                for mode in order:
                    cell[mode] = run_cell(deps[mode], mix, trace, rate)
                    time.sleep(1.0)
                cell["compare"] = compare(cell["colocated"], cell["disaggregated"])
                mx["cells"].append(cell)
    finally:
        for dep in deps.values():
            dep.stop()
    results["meta"]["wall_s"] = time.monotonic() - t_start
    results["targets"] = targets(results, a.transport)
    md = markdown(results)
    for path in (a.out, a.md, a.png):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(_clean(results), f, indent=1, allow_nan=False)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if a.png:
        plot(results, a.png)
    print(md)
    log(f"wrote {a.out}" + (f", {a.md}" if a.md else "") + (f", {a.png}" if a.png else "")
        + f" in {results['meta']['wall_s']:.0f}s")
    return 0


def _clean(o: Any) -> Any:
    """JSON-safe copy: infinite ratios become the string "inf", NaN becomes null."""
    if isinstance(o, float):
        return "inf" if math.isinf(o) else (None if math.isnan(o) else o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
