"""Traffic and client of the end-to-end benchmark (:mod:`bench.e2e`): the mixes, their seeded
traces (Poisson arrivals scaled by the rate), and the streaming client that sends a trace to a
deployment's proxy and timestamps every token as it arrives."""

from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

MODES = ("colocated", "disaggregated")
VOCAB = 256  # draw prompt ids from the byte tokens 0..255 (BOS=256 and EOS=257 are special)


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
