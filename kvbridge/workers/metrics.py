"""Per-request serving metrics and their aggregation: percentiles, throughput, goodput.

A :class:`RequestMetrics` is one request as a client saw it (times in seconds on one
clock, ``time.time()`` by convention). :func:`summarize` turns a list of them into a
JSON-safe dict (P50/P95/P99 of TTFT, TPOT, end-to-end latency, queueing and KV
transfer time; throughput; goodput under TTFT/TPOT targets; the same per prompt- and
output-length bucket) for ``/metrics.json``, the progress line and the benchmarks.
:class:`PromMetrics` keeps the same facts as Prometheus histograms and counters for
``/metrics``; :class:`MetricsLog` is a bounded, thread-safe collection of records.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Optional, Sequence

__all__ = ["RequestMetrics", "summarize", "percentile", "MetricsLog", "PromMetrics",
           "DEFAULT_PROMPT_BUCKETS", "DEFAULT_OUTPUT_BUCKETS", "LATENCY_BUCKETS"]

DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (128, 512, 1024, 2048)   # upper edges; the last bucket is open
DEFAULT_OUTPUT_BUCKETS: tuple[int, ...] = (32, 128, 512)
_TIMED = ("ttft", "tpot", "e2e", "queue", "prefill", "kv_transfer")


@dataclass
class RequestMetrics:
    """One request. ``ok`` False means the client got an error (``error`` says which)."""

    request_id: str
    mode: str = "disaggregated"          # or "colocated"
    prompt_tokens: int = 0
    output_tokens: int = 0
    arrival: float = 0.0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None  # the proxy keeps first and last, not a time per token
    finished_at: Optional[float] = None
    queue_s: Optional[float] = None      # waiting for an engine slot (prefill side, or colocated engine)
    prefill_s: Optional[float] = None    # prompt compute on the prefill side (chunked)
    kv_transfer_s: Optional[float] = None
    kv_bytes: int = 0
    retries: int = 0                     # decode or prefill attempts after the first
    reprefills: int = 0
    ok: bool = True
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    # a client's trace (bench/) may keep a time per token; the proxy leaves this empty
    token_times: list[float] = field(default_factory=list, repr=False)
    # the first token's path: seconds after ``arrival`` at which the proxy and the worker passed
    # each stage ("parsed", "prefill_sent", "w_received", "w_submitted", "w_first_token",
    # "w_published", "w_answered", "answered", "first_sent"); see bench/frontdoor.py
    hops: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.arrival

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first."""
        if self.output_tokens < 2 or self.first_token_at is None or self.finished_at is None:
            return None
        last = self.last_token_at or (self.token_times[-1] if self.token_times else self.finished_at)
        return (last - self.first_token_at) / (self.output_tokens - 1)

    def to_dict(self, with_token_times: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_token_times:
            d.pop("token_times")
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestMetrics":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (``q`` in 0..100) of ``values``; None when empty."""
    return _sorted_pct(sorted(values), q)


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    xs = sorted(values)  # once, not once per percentile
    return {"p50": _sorted_pct(xs, 50), "p95": _sorted_pct(xs, 95), "p99": _sorted_pct(xs, 99),
            "mean": (sum(xs) / len(xs)) if xs else None, "max": xs[-1] if xs else None,
            "count": float(len(xs))}


def _sorted_pct(xs: Sequence[float], q: float) -> Optional[float]:
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _value(r: RequestMetrics, name: str) -> Optional[float]:
    return {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "queue": r.queue_s, "prefill": r.prefill_s,
            "kv_transfer": r.kv_transfer_s}[name]


def _meets(r: RequestMetrics, ttft_slo: Optional[float], tpot_slo: Optional[float]) -> bool:
    if not r.ok:
        return False
    t, p = r.ttft, r.tpot
    return (ttft_slo is None or (t is not None and t <= ttft_slo)) and \
           (tpot_slo is None or p is None or p <= tpot_slo)


def _bucket_label(n: int, edges: Sequence[int]) -> str:
    lo = 0
    for e in edges:
        if n <= e:
            return f"{lo}-{e}"
        lo = e + 1
    return f"{lo}+"


def _aggregate(records: Sequence[RequestMetrics], ttft_slo: Optional[float],
               tpot_slo: Optional[float]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    starts = [r.arrival for r in records]
    ends = [r.finished_at for r in records if r.finished_at is not None]
    duration = (max(ends) - min(starts)) if starts and ends else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in records if _meets(r, ttft_slo, tpot_slo))
    d: dict[str, Any] = {
        "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "throughput_req_s": len(ok) / duration if duration > 0 else 0.0,
        "good_requests": good,
        "goodput_req_s": good / duration if duration > 0 else 0.0,
        "goodput_fraction": good / len(records) if records else 0.0,
        "kv_bytes": sum(r.kv_bytes for r in ok),
        "retries": sum(r.retries for r in records), "reprefills": sum(r.reprefills for r in records),
    }
    cols: dict[str, list[float]] = {name: [] for name in _TIMED}
    for r in ok:
        for name, v in zip(_TIMED, (r.ttft, r.tpot, r.e2e, r.queue_s, r.prefill_s, r.kv_transfer_s)):
            if v is not None:
                cols[name].append(v)
    for name in _TIMED:
        d[name] = _stats(cols[name])
    return d


def summarize(records: Iterable[RequestMetrics], ttft_slo: Optional[float] = None,
              tpot_slo: Optional[float] = None, buckets: Optional[dict[str, Sequence[int]]] = None) -> dict[str, Any]:
    """Aggregate ``records``: totals, percentiles, throughput, goodput; also per bucket.

    ``buckets`` maps ``"prompt"``/``"output"`` to upper bucket edges in tokens (the
    defaults are :data:`DEFAULT_PROMPT_BUCKETS` and :data:`DEFAULT_OUTPUT_BUCKETS`).
    Goodput counts requests that succeeded with TTFT <= ``ttft_slo`` and TPOT <=
    ``tpot_slo`` (a missing target always holds), per second of the run.
    """
    recs = list(records)
    edges = {"prompt": DEFAULT_PROMPT_BUCKETS, "output": DEFAULT_OUTPUT_BUCKETS, **(buckets or {})}
    out = _aggregate(recs, ttft_slo, tpot_slo)
    out["slo"] = {"ttft_s": ttft_slo, "tpot_s": tpot_slo}
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            key = (r.error or "error").split(":")[0][:80]
            errors[key] = errors.get(key, 0) + 1
    out["errors"] = errors
    by: dict[str, dict[str, Any]] = {}
    for kind, attr in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
        groups: dict[str, list[RequestMetrics]] = {}
        for r in recs:
            groups.setdefault(_bucket_label(getattr(r, attr), edges[kind]), []).append(r)
        by[kind] = {k: _aggregate(v, ttft_slo, tpot_slo) for k, v in sorted(groups.items(), key=_bucket_key)}
    out["buckets"] = by
    out["bucket_edges"] = {k: list(v) for k, v in edges.items()}
    return out


def _bucket_key(item: tuple[str, Any]) -> int:
    return int(item[0].split("-")[0].rstrip("+"))


# Latency histogram edges in seconds: from a fast decode step to a long prefill under load.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                                      0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)


class PromMetrics:
    """The proxy's Prometheus metrics (``prometheus_client``, one registry per proxy).

    Every latency is a histogram, so it aggregates across proxies (``histogram_quantile``
    over ``sum by (le)``); each carries ``mode`` and the request's ``prompt_len`` and
    ``output_len`` bucket (see :func:`summarize`) as labels. Goodput is the counter
    ``kvbridge_good_requests_total`` (requests within both SLOs) over
    ``kvbridge_requests_total``.
    """

    def __init__(self, mode: str, ttft_slo: Optional[float] = None, tpot_slo: Optional[float] = None,
                 buckets: Optional[dict[str, Sequence[int]]] = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: one family per metric, as scrapers expect
        self.mode = mode
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.edges = {"prompt": DEFAULT_PROMPT_BUCKETS, "output": DEFAULT_OUTPUT_BUCKETS, **(buckets or {})}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lab = ["mode", "prompt_len", "output_len"]
        self.hist = {name: Histogram(f"kvbridge_{name}_seconds", help_, lab, registry=r, buckets=LATENCY_BUCKETS)
                     for name, help_ in (
                         ("ttft", "Time to first token, seconds."),
                         ("tpot", "Mean time per output token after the first, seconds."),
                         ("e2e", "End-to-end request latency, seconds."),
                         ("queue", "Queueing before an engine slot (prefill side, or colocated), seconds."),
                         ("prefill", "Prompt compute on the prefill side (chunked), seconds."),
                         ("kv_transfer", "KV transfer prefill to decode (claim, read, verify, release), seconds."))}
        self.requests = Counter("kvbridge_requests", "Requests finished, by outcome (ok, failed).",
                                ["mode", "outcome"], registry=r)
        self.good = Counter("kvbridge_good_requests", "Requests that met both SLOs (goodput).", ["mode"], registry=r)
        self.prompt_tokens = Counter("kvbridge_prompt_tokens", "Prompt tokens of successful requests.", ["mode"],
                                     registry=r)
        self.output_tokens = Counter("kvbridge_output_tokens", "Output tokens delivered.", ["mode"], registry=r)
        self.kv_bytes = Counter("kvbridge_kv_transfer_bytes", "KV bytes moved prefill to decode.", ["mode"],
                                registry=r)
        self.retries = Counter("kvbridge_retries", "Worker attempts after the first.", ["mode"], registry=r)
        self.reprefills = Counter("kvbridge_reprefills", "Requests whose KV was recomputed.", ["mode"], registry=r)
        self.rejected = Counter("kvbridge_rejected_requests", "Requests refused before any work (4xx), by status.",
                                ["mode", "status"], registry=r)
        self.in_flight = Gauge("kvbridge_in_flight", "Requests in progress.", ["mode"], registry=r)
        self.in_flight.labels(mode).set(0)
        self.requests.labels(mode, "ok")
        self.requests.labels(mode, "failed")
        slo = Gauge("kvbridge_slo_seconds", "The SLO targets goodput is counted against.", ["mode", "target"],
                    registry=r)
        for name, v in (("ttft", ttft_slo), ("tpot", tpot_slo)):
            if v is not None:
                slo.labels(mode, name).set(v)

    def observe(self, r: RequestMetrics) -> None:
        m = self.mode
        self.requests.labels(m, "ok" if r.ok else "failed").inc()
        self.retries.labels(m).inc(r.retries)
        self.reprefills.labels(m).inc(r.reprefills)
        if not r.ok:
            return
        if _meets(r, self.ttft_slo, self.tpot_slo):
            self.good.labels(m).inc()
        self.prompt_tokens.labels(m).inc(r.prompt_tokens)
        self.output_tokens.labels(m).inc(r.output_tokens)
        self.kv_bytes.labels(m).inc(r.kv_bytes)
        pl = _bucket_label(r.prompt_tokens, self.edges["prompt"])
        ol = _bucket_label(r.output_tokens, self.edges["output"])
        for name, h in self.hist.items():
            v = _value(r, name)
            if v is not None:
                h.labels(m, pl, ol).observe(max(0.0, v))

    def exposition(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class MetricsLog:
    """Thread-safe, bounded store of finished requests plus live gauges for a proxy."""

    def __init__(self, maxlen: int = 20_000) -> None:
        self._lock = threading.Lock()
        self._records: deque[RequestMetrics] = deque(maxlen=maxlen)
        self.in_flight = 0

    def add(self, r: RequestMetrics) -> None:
        with self._lock:
            self._records.append(r)

    def records(self, last: Optional[int] = None) -> list[RequestMetrics]:
        """The records kept (the most recent ``last`` of them)."""
        with self._lock:
            if last is None or last >= len(self._records):
                return list(self._records)
            return list(itertools.islice(self._records, len(self._records) - max(0, last), None))

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
