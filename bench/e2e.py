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
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from kvbridge.workers.metrics import RequestMetrics, percentile, summarize

MODES = ("colocated", "disaggregated")
VOCAB = 256  # draw prompt ids from the byte tokens 0..255 (BOS=256 and EOS=257 are special)

# Targets of issue 4 (long-prompt mix, headline rate).
TARGET_GOODPUT_RATIO = 1.5
TARGET_KV_FRACTION = 0.10
KV_PROMPT_MIN = 1024
LOSS_MARGIN = 0.10   # "PD lost" on a figure: worse than colocated by more than this


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================== traffic

@dataclass(frozen=True)
class Mix:
    """A traffic mix: length ranges (inclusive), arrival rates, SLOs and report buckets."""

    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    rates: tuple[float, ...]         # full run; the first is the headline
    quick_rate: float
    requests: int                    # per rate, full run
    quick_requests: int
    ttft_slo: float                  # seconds
    tpot_slo: float                  # seconds
    prompt_buckets: tuple[int, ...]  # upper edges for summarize(); the last bucket is open
    output_buckets: tuple[int, ...]
    note: str = ""


MIXES: dict[str, Mix] = {
    # Short chats: at most one 256-token chunk per prompt. SLOs: TTFT <= 0.5 s (~10x the
    # prefill of the longest prompt), TPOT <= 30 ms (~5x a lone decode step of the bench
    # model). Headline 8 req/s: the colocated engine uses ~1.2 of its 2 cores (~60%);
    # 4 req/s is light load, 12 req/s is past the colocated engine's knee.
    "short": Mix("short", prompt=(32, 256), output=(16, 128), rates=(8.0, 4.0, 12.0), quick_rate=8.0,
                 requests=160, quick_requests=40, ttft_slo=0.5, tpot_slo=0.030,
                 prompt_buckets=(64, 128, 192), output_buckets=(32, 64, 96),
                 note="short chats: where PD is not expected to pay"),
    # Long prompts: 4-8 chunks each, so colocated decode steps share steps with prompt chunks.
    # SLOs: TTFT <= 3 s (~3x a lone 2,048-token prefill on one core), TPOT <= 50 ms (~20
    # tokens/s; ~5-10x a lone decode step). Headline 1 req/s: colocated ~60% busy (1.2 of 2
    # cores); 0.75 and 0.5 req/s show the lighter side.
    "long": Mix("long", prompt=(1024, 2048), output=(64, 256), rates=(1.0, 0.75, 0.5), quick_rate=1.0,
                requests=40, quick_requests=14, ttft_slo=3.0, tpot_slo=0.050,
                prompt_buckets=(1280, 1536, 1792), output_buckets=(112, 160, 208),
                note="long prompts: where PD is expected to pay"),
}


@dataclass
class TraceReq:
    idx: int
    at: float                  # seconds after the start of the run (unit-rate time / rate)
    prompt_ids: list[int]
    max_tokens: int


def make_trace(mix: Mix, n: int, seed: int) -> tuple[list[float], list[list[int]], list[int]]:
    """The mix's seeded trace: unit-rate arrival times, prompts, output lengths."""
    rng = random.Random(f"kvbridge-e2e/{mix.name}/{seed}")
    t, unit_times, prompts, outs = 0.0, [], [], []
    for _ in range(n):
        unit_times.append(t)
        t += rng.expovariate(1.0)
        plen = rng.randint(*mix.prompt)
        prompts.append([rng.randrange(VOCAB) for _ in range(plen)])
        outs.append(rng.randint(*mix.output))
    return unit_times, prompts, outs


def at_rate(unit_times: Sequence[float], prompts: Sequence[list[int]], outs: Sequence[int],
            rate: float) -> list[TraceReq]:
    return [TraceReq(i, u / rate, p, o) for i, (u, p, o) in enumerate(zip(unit_times, prompts, outs))]


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


# ============================================================================== client

@dataclass
class ClientRecord:
    idx: int
    prompt_tokens: int
    max_tokens: int
    scheduled: float               # seconds after run start
    sent: float = 0.0              # time.time() when the request was sent
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    token_times: list[float] = field(default_factory=list)   # time.time() per output token
    tokens: list[int] = field(default_factory=list)
    request_id: Optional[str] = None
    finish_reason: Optional[str] = None
    ok: bool = False
    error: Optional[str] = None
    late_s: float = 0.0            # sent - scheduled (client dispatch lag)


def _send(host: str, port: int, req: TraceReq, rec: ClientRecord, timeout: float) -> None:
    body = json.dumps({"prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        rec.sent = time.time()
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return
        while True:
            line = resp.readline()
            if not line:
                rec.error = rec.error or "stream ended before [DONE]"
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.time()
            ev = json.loads(data)
            if "error" in ev:
                rec.error = str(ev["error"].get("message", ev["error"]))
                continue
            rec.request_id = rec.request_id or ev.get("id")
            ch = (ev.get("choices") or [{}])[0]
            ids = ch.get("token_ids") or []
            if ids:
                if rec.first_token_at is None:
                    rec.first_token_at = now
                rec.tokens.extend(int(t) for t in ids)
                rec.token_times.extend([now] * len(ids))
            if ch.get("finish_reason"):
                rec.finish_reason = ch["finish_reason"]
        rec.finished_at = time.time()
        rec.ok = rec.error is None and len(rec.tokens) == req.max_tokens
        if rec.error is None and not rec.ok:
            rec.error = f"got {len(rec.tokens)} tokens, expected {req.max_tokens}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        if rec.finished_at is None:
            rec.finished_at = time.time()
        conn.close()


def run_trace(url: str, trace: Sequence[TraceReq], label: str, timeout: float = 300.0,
              progress_every: float = 10.0) -> list[ClientRecord]:
    """Send ``trace`` (one thread per request, each at its arrival time); wait for every answer."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    recs = [ClientRecord(r.idx, len(r.prompt_ids), r.max_tokens, r.at) for r in trace]
    threads: list[threading.Thread] = []
    t0 = time.monotonic()
    next_log = t0 + progress_every
    for r, rec in zip(trace, recs):
        while True:
            now = time.monotonic()
            if now >= next_log:
                done = sum(1 for x in recs if x.finished_at is not None)
                log(f"{label}: {done}/{len(recs)} done, {len(threads) - done} in flight, {now - t0:.0f}s")
                next_log = now + progress_every
            wait = t0 + r.at - now
            if wait <= 0:
                break
            time.sleep(min(wait, 0.05))
        rec.late_s = time.monotonic() - (t0 + r.at)
        th = threading.Thread(target=_send, args=(host, int(port), r, rec, timeout), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.5)
            now = time.monotonic()
            if now >= next_log:
                done = sum(1 for x in recs if x.finished_at is not None)
                log(f"{label}: {done}/{len(recs)} done, {len(threads) - done} in flight, {now - t0:.0f}s")
                next_log = now + progress_every
    return recs


def warm_up(url: str, mixes: Sequence[Mix], seed: int) -> None:
    """Untimed requests: every prompt shape once alone, then a small concurrent burst."""
    rng = random.Random(f"kvbridge-e2e/warmup/{seed}")
    reqs = []
    for m in mixes:
        for plen in (m.prompt[0], m.prompt[1]):
            reqs.append(TraceReq(len(reqs), 0.0, [rng.randrange(VOCAB) for _ in range(plen)], 8))
    for r in reqs:  # alone
        run_trace(url, [r], "warm-up", progress_every=1e9)
    burst = [TraceReq(i, 0.05 * i, r.prompt_ids, 24) for i, r in enumerate(reqs * 2)]
    bad = [r for r in run_trace(url, burst, "warm-up", progress_every=1e9) if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0].error}")


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


# ============================================================================== comparisons

def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _num(r: Any) -> Optional[float]:
    """A ratio as stored: a float, None, or "inf" (after a JSON round trip)."""
    return math.inf if r == "inf" else r


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b


def compare(colo: dict[str, Any], pd: dict[str, Any]) -> dict[str, Any]:
    """Ratios disaggregated / colocated (goodput: higher is better; latencies: lower is better)."""
    c, d = colo["summary"], pd["summary"]
    out: dict[str, Any] = {
        "goodput_requests": _ratio(d["good_requests"], c["good_requests"]),
        "goodput_req_s": _ratio(d["goodput_req_s"], c["goodput_req_s"]),
        "throughput_tok_s": _ratio(d["throughput_tok_s"], c["throughput_tok_s"]),
    }
    for k in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p95", "p99"):
            out[f"{k}_{q}"] = _ratio(d[k][q], c[k][q])
    # token agreement (greedy, same trace): per request, identical output ids?
    by_idx = {r["idx"]: r for r in colo["records"]}
    same = diff = 0
    first_div: list[int] = []
    for r in pd["records"]:
        o = by_idx.get(r["idx"])
        if o is None or not (r["ok"] and o["ok"]):
            continue
        if r["tokens"] == o["tokens"]:
            same += 1
        else:
            diff += 1
            first_div.append(next(i for i, (a, b) in enumerate(zip(r["tokens"], o["tokens"])) if a != b))
    out["tokens_identical"] = same
    out["tokens_different"] = diff
    out["first_divergence_positions"] = first_div
    return out


def targets(results: dict[str, Any], transport: str) -> list[dict[str, Any]]:
    """Pass/fail of the issue's targets at the long mix's headline rate (all rates in the tables)."""
    out: list[dict[str, Any]] = []
    long_ = results["mixes"].get("long")
    if long_:
        head = long_["cells"][0]
        cmp_ = head["compare"]
        colo, pd = head["colocated"]["summary"], head["disaggregated"]["summary"]
        g = cmp_["goodput_requests"]
        out.append({"target": f"long mix: goodput >= {TARGET_GOODPUT_RATIO}x colocated (rate {head['rate']:g} req/s)",
                    "measured": f"{pd['good_requests']}/{pd['requests']} vs {colo['good_requests']}/{colo['requests']}"
                                f" = {_fmt_ratio(g)}",
                    "met": g is not None and g >= TARGET_GOODPUT_RATIO})
        t99 = (pd["tpot"]["p99"], colo["tpot"]["p99"])
        out.append({"target": "long mix: disaggregated TPOT P99 below colocated",
                    "measured": f"{_ms(t99[0])} vs {_ms(t99[1])} ({_fmt_ratio(cmp_['tpot_p99'])})",
                    "met": None not in t99 and t99[0] < t99[1]})
        kv = head["disaggregated"]["extra"]["kv_over_ttft_long_prompts"]
        if transport == "tcp" and kv["count"]:
            out.append({"target": f"KV transfer <= {TARGET_KV_FRACTION:.0%} of TTFT, prompts >= {KV_PROMPT_MIN} "
                                  f"tokens, tcp (median; P95 also shown)",
                        "measured": f"median {kv['p50'] * 100:.1f}%, P95 {kv['p95'] * 100:.1f}%, "
                                    f"max-ish P99 {kv['p99'] * 100:.1f}% ({kv['count']} requests)",
                        "met": kv["p50"] <= TARGET_KV_FRACTION})
        else:
            out.append({"target": f"KV transfer <= {TARGET_KV_FRACTION:.0%} of TTFT over tcp",
                        "measured": f"not measured (transport {transport})", "met": None})
    short = results["mixes"].get("short")
    if short:
        rows = []
        for cell in short["cells"]:
            lost = pd_losses(cell["compare"])
            rows.append(f"{cell['rate']:g} req/s: " + (", ".join(lost) if lost else "none"))
        out.append({"target": f"short mix shows where PD does not pay (figures where PD is worse by "
                              f"> {LOSS_MARGIN:.0%})",
                    "measured": "; ".join(rows),
                    "met": any(pd_losses(c["compare"]) for c in short["cells"])})
    return out


def pd_losses(cmp_: dict[str, Any]) -> list[str]:
    """Figures where disaggregated is worse than colocated by more than LOSS_MARGIN."""
    out = []
    g = _num(cmp_.get("goodput_requests"))
    if g is not None and g < 1 - LOSS_MARGIN:
        out.append(f"goodput {_fmt_ratio(g)}")
    for k, lab in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        for q in ("p50", "p95", "p99"):
            r = _num(cmp_.get(f"{k}_{q}"))
            if r is not None and r > 1 + LOSS_MARGIN:
                out.append(f"{lab} {q.upper()} {_fmt_ratio(r)}")
    return out


def _fmt_ratio(r: Optional[float]) -> str:
    r = _num(r)
    if r is None:
        return "-"
    if math.isinf(r):
        return "inf"
    return f"{r:.2f}x"


# ============================================================================== report

def _s(v: Optional[float], unit: str = "ms") -> str:
    if v is None:
        return "-"
    if unit != "ms":
        return f"{v:.2f}"
    return f"{v * 1000:.1f}" if abs(v) < 0.01 else f"{v * 1000:.0f}"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    L: list[str] = []
    L.append("# kvbridge end-to-end: disaggregated vs colocated, equal cores\n")
    L.append(f"- model `{meta['model']}` (seeded weights), chunk {meta['chunk_size']} tokens in both modes, "
             f"{meta['num_blocks']} KV blocks per worker, transport `{meta['transport']}`, trace seed {meta['seed']}")
    L.append(f"- **colocated**: `kvbridge up --colocated --threads {meta['cores']}` (decode first, chunked "
             f"prefill, continuous batching); **disaggregated**: `kvbridge up --threads {max(1, meta['cores'] // 2)}` "
             f"(1 prefill + 1 decode worker) -- {meta['cores']} cores each")
    L.append(f"- machine: {meta['machine']}; started {meta['started']}; wall {meta['wall_s']:.0f} s"
             f"{' (quick)' if meta['quick'] else ''}")
    L.append("- client-side times (one thread per request, streaming, each token timestamped on arrival); "
             "TPOT = mean gap after the first token; ratios are disaggregated / colocated "
             "(goodput: > 1 favours PD; latencies: < 1 favours PD)")
    L.append("- the machine is shared: `other load` is CPU used by processes outside this benchmark "
             "during the run, in cores\n")
    if results.get("targets"):
        L.append("## Targets (long mix at its headline rate; short mix at every rate)\n")
        L.append("| target | measured | met |\n|---|---|---|")
        for t in results["targets"]:
            met = "n/a" if t["met"] is None else ("**yes**" if t["met"] else "**no**")
            L.append(f"| {t['target']} | {t['measured']} | {met} |")
        L.append("")
    cal = results.get("calibration")
    if cal:
        th = cal["threads"]
        L.append("## Engine calibration: one engine's operations at 1 vs "
                 f"{th[-1]} torch threads (same run, median of 5)\n")
        L.append("| operation | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}, ms" for t in th)
                 + f" | speed-up {th[-1]} vs 1 |")
        L.append("|---|" + "---:|" * (len(th) + 1))
        for name, v in cal["ops"].items():
            sp = v[str(th[0])] / v[str(th[-1])] if v[str(th[-1])] else 0.0
            L.append(f"| {name} | " + " | ".join(_s(v[str(t)]) for t in th) + f" | {sp:.2f}x |")
        L.append("")
    for name, mx in results["mixes"].items():
        mix = mx["mix"]
        L.append(f"## {name} mix -- {mix['note']}\n")
        L.append(f"prompts {mix['prompt'][0]}-{mix['prompt'][1]} tokens, outputs {mix['output'][0]}-"
                 f"{mix['output'][1]} tokens (uniform), {mx['requests']} requests per rate, Poisson arrivals; "
                 f"SLOs: TTFT <= {mix['ttft_slo']:g} s, TPOT <= {mix['tpot_slo'] * 1000:g} ms. "
                 f"Headline rate: {mx['cells'][0]['rate']:g} req/s.\n")
        for ci, cell in enumerate(mx["cells"]):
            L.extend(_cell_table(cell, headline=ci == 0))
            L.extend(_bucket_tables(cell))
    return "\n".join(L) + "\n"


def _cell_table(cell: dict[str, Any], headline: bool) -> list[str]:
    c, d = cell["colocated"], cell["disaggregated"]
    cs, ds, cm = c["summary"], d["summary"], cell["compare"]
    ce, de = c["extra"], d["extra"]
    L = [f"### {cell['rate']:g} req/s{' (headline)' if headline else ''}\n",
         "| metric | colocated | disaggregated | PD / colo |", "|---|---:|---:|---:|"]

    def row(name: str, a: str, b: str, r: str = "") -> None:
        L.append(f"| {name} | {a} | {b} | {r} |")

    row("requests ok / sent", f"{cs['ok']}/{cs['requests']}", f"{ds['ok']}/{ds['requests']}")
    row("goodput: requests within both SLOs", f"{cs['good_requests']} ({cs['goodput_fraction']:.0%})",
        f"{ds['good_requests']} ({ds['goodput_fraction']:.0%})", _fmt_ratio(cm["goodput_requests"]))
    row("goodput, req/s", f"{cs['goodput_req_s']:.2f}", f"{ds['goodput_req_s']:.2f}", _fmt_ratio(cm["goodput_req_s"]))
    for k, lab in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end")):
        for q in ("p50", "p95", "p99"):
            row(f"{lab} {q.upper()}, ms", _s(cs[k][q]), _s(ds[k][q]), _fmt_ratio(cm[f"{k}_{q}"]))
    row("throughput, output tok/s", f"{cs['throughput_tok_s']:.0f}", f"{ds['throughput_tok_s']:.0f}",
        _fmt_ratio(cm["throughput_tok_s"]))
    row("server queueing P50 / P95, ms", f"{_s(ce['queue_s']['p50'])} / {_s(ce['queue_s']['p95'])}",
        f"{_s(de['queue_s']['p50'])} / {_s(de['queue_s']['p95'])}")
    row("admission to 1st token (prefill, incl. waiting behind earlier prompts) P50 / P95, ms",
        f"{_s(ce['prefill_s']['p50'])} / {_s(ce['prefill_s']['p95'])}",
        f"{_s(de['prefill_s']['p50'])} / {_s(de['prefill_s']['p95'])}")
    row("TTFT - queueing - prefill (HTTP, publish, proxy) P50, ms", _s(ce["ttft_overhead_s"]["p50"]),
        _s(de["ttft_overhead_s"]["p50"]))
    row("gap 1st -> 2nd token P50 / P95, ms", f"{_s(ce['second_token_gap_s']['p50'])} / "
        f"{_s(ce['second_token_gap_s']['p95'])}",
        f"{_s(de['second_token_gap_s']['p50'])} / {_s(de['second_token_gap_s']['p95'])}")
    row("inter-token gap after the 2nd P50 / P99, ms", f"{_s(ce['itl_after_2nd_s']['p50'])} / "
        f"{_s(ce['itl_after_2nd_s']['p99'])}",
        f"{_s(de['itl_after_2nd_s']['p50'])} / {_s(de['itl_after_2nd_s']['p99'])}")
    kv = de["kv_transfer_s"]
    row("KV transfer P50 / P99, ms (fetch: claim, read, verify, release)", "-",
        f"{_s(kv['p50'])} / {_s(kv['p99'])}")
    row("KV per request P50, MiB; effective GiB/s", "-",
        f"{de['kv_mib']['p50']:.1f}; {de['kv_gib_s']:.2f}" if de["kv_mib"]["p50"] is not None else "-")
    kf = de["kv_over_ttft_long_prompts"]
    row(f"KV transfer / TTFT, prompts >= {KV_PROMPT_MIN} P50 / P95", "-",
        f"{kf['p50'] * 100:.1f}% / {kf['p95'] * 100:.1f}%" if kf["count"] else "-")
    cu, du = c["cpu"], d["cpu"]
    row("CPU, cores: engine(s)", f"colocated {cu.get('colocated_cores', 0):.2f}",
        f"prefill {du.get('prefill_cores', 0):.2f} + decode {du.get('decode_cores', 0):.2f}")
    row("CPU, cores: proxy / lease server / client", f"{cu['proxy_cores']:.2f} / - / {cu['bench_client_cores']:.2f}",
        f"{du['proxy_cores']:.2f} / {du['lease_server_cores']:.2f} / {du['bench_client_cores']:.2f}")
    row("other load on the machine, cores", f"{cu['other_cores']:.2f}", f"{du['other_cores']:.2f}")
    row("client dispatch lag P99, ms", _s(ce["client_late_s"]["p99"]), _s(de["client_late_s"]["p99"]))
    lost = pd_losses(cm)
    row(f"where PD is worse by > {LOSS_MARGIN:.0%}", "", ", ".join(lost) if lost else "nowhere")
    row("greedy tokens identical (same request)", "", f"{cm['tokens_identical']}/"
        f"{cm['tokens_identical'] + cm['tokens_different']}")
    L.append("")
    return L


def _bucket_tables(cell: dict[str, Any]) -> list[str]:
    c, d = cell["colocated"]["summary"], cell["disaggregated"]["summary"]
    L: list[str] = []
    for kind in ("prompt", "output"):
        L.append(f"by {kind} length ({cell['rate']:g} req/s): colocated | disaggregated\n")
        L.append("| bucket | n | TTFT P50, ms | TTFT P99, ms | TPOT P50, ms | TPOT P99, ms | goodput |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for b in sorted(set(c["buckets"][kind]) | set(d["buckets"][kind]),
                        key=lambda x: int(x.split("-")[0].rstrip("+"))):
            a, z = c["buckets"][kind].get(b), d["buckets"][kind].get(b)

            def pair(k: str, q: str) -> str:
                return f"{_s(a[k][q]) if a else '-'} \\| {_s(z[k][q]) if z else '-'}"
            n = (a or z)["requests"]  # type: ignore[index]
            good = f"{a['good_requests'] if a else '-'} \\| {z['good_requests'] if z else '-'}"
            L.append(f"| {b} | {n} | {pair('ttft', 'p50')} | {pair('ttft', 'p99')} | {pair('tpot', 'p50')} | "
                     f"{pair('tpot', 'p99')} | {good} |")
        L.append("")
    return L


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    mixes = list(results["mixes"].items())
    fig, axes = plt.subplots(len(mixes), 2, figsize=(12, 4.2 * len(mixes)), squeeze=False)
    colors = {"colocated": "tab:blue", "disaggregated": "tab:red"}
    styles = ["-", "--", ":", "-."]
    for row, (name, mx) in enumerate(mixes):
        mix = mx["mix"]
        for col, (key, slo, lab) in enumerate((("ttft", mix["ttft_slo"], "TTFT (s)"),
                                               ("tpot", mix["tpot_slo"], "TPOT (ms)"))):
            ax = axes[row][col]
            scale = 1000.0 if key == "tpot" else 1.0
            for ci, cell in enumerate(mx["cells"]):
                for mode in MODES:
                    vals = sorted(r[key] * scale for r in cell[mode]["records"] if r["ok"] and r[key] is not None)
                    if not vals:
                        continue
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step(vals, ys, where="post", color=colors[mode], linestyle=styles[ci % len(styles)],
                            label=f"{mode}, {cell['rate']:g} req/s")
            ax.axvline(slo * scale, color="gray", linewidth=1, linestyle="--", label="SLO")
            ax.set_xscale("log")
            fmt = FuncFormatter(lambda v, _: f"{v:g}")
            ax.xaxis.set_major_formatter(fmt)
            ax.xaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
            ax.set_xlabel(lab)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{name} mix: {key.upper()} CDF")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"kvbridge e2e, model {results['meta']['model']}, {results['meta']['cores']} cores per mode "
                 f"(colocated {results['meta']['cores']} threads vs prefill 1 + decode 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
