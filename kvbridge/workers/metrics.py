"""Per-request serving metrics and their aggregation: percentiles, throughput, goodput.

A :class:`RequestMetrics` is one request as a client saw it (times in seconds on one
clock, ``time.time()`` by convention). :func:`summarize` turns a list of them into a
JSON-safe dict (P50/P95/P99 of TTFT, TPOT, end-to-end latency, queueing and KV
transfer time; throughput; goodput under TTFT/TPOT targets; the same per prompt- and
output-length bucket); :func:`to_prometheus` renders that dict as Prometheus text.
:class:`MetricsLog` is a bounded, thread-safe collection for a long-running proxy.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Optional, Sequence

__all__ = ["RequestMetrics", "summarize", "to_prometheus", "percentile", "MetricsLog",
           "DEFAULT_PROMPT_BUCKETS", "DEFAULT_OUTPUT_BUCKETS"]

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
    token_times: list[float] = field(default_factory=list, repr=False)

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
        last = self.token_times[-1] if self.token_times else self.finished_at
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
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "p99": percentile(values, 99),
            "mean": (sum(values) / len(values)) if values else None, "max": max(values) if values else None,
            "count": float(len(values))}


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
    for name in _TIMED:
        vals = [v for v in (_value(r, name) for r in ok) if v is not None]
        d[name] = _stats(vals)
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


def _prom_num(v: Optional[float]) -> str:
    return "NaN" if v is None else repr(float(v))


def to_prometheus(summary: dict[str, Any], prefix: str = "kvbridge_", labels: Optional[dict[str, str]] = None) -> str:
    """Render a :func:`summarize` dict as Prometheus text exposition format (0.0.4)."""
    base = dict(labels or {})
    lines: list[str] = []

    def lab(extra: dict[str, str]) -> str:
        m = {**base, **extra}
        if not m:
            return ""
        return "{" + ",".join(f'{k}="{str(v)}"' for k, v in m.items()) + "}"

    def emit(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], Optional[float]]]) -> None:
        lines.append(f"# HELP {prefix}{name} {help_}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        for ls, v in samples:
            lines.append(f"{prefix}{name}{lab(ls)} {_prom_num(v)}")

    emit("requests_total", "counter", "Requests finished (ok or failed).",
         [({"outcome": "ok"}, summary["ok"]), ({"outcome": "failed"}, summary["failed"])])
    emit("output_tokens_total", "counter", "Output tokens delivered.", [({}, summary["output_tokens"])])
    emit("prompt_tokens_total", "counter", "Prompt tokens of successful requests.", [({}, summary["prompt_tokens"])])
    emit("kv_transfer_bytes_total", "counter", "KV bytes moved prefill to decode.", [({}, summary["kv_bytes"])])
    emit("retries_total", "counter", "Worker attempts after the first.", [({}, summary["retries"])])
    emit("reprefills_total", "counter", "Requests whose KV was recomputed.", [({}, summary["reprefills"])])
    emit("throughput_tokens_per_second", "gauge", "Output tokens per second over the window.",
         [({}, summary["throughput_tok_s"])])
    emit("goodput_requests_per_second", "gauge", "Requests meeting both SLOs per second.",
         [({}, summary["goodput_req_s"])])
    emit("goodput_fraction", "gauge", "Fraction of requests meeting both SLOs.", [({}, summary["goodput_fraction"])])
    for name, help_ in (("ttft", "Time to first token"), ("tpot", "Time per output token after the first"),
                        ("e2e", "End-to-end latency"), ("queue", "Queueing time before an engine slot"),
                        ("prefill", "Prefill compute time"), ("kv_transfer", "KV transfer time")):
        st = summary[name]
        samples: list[tuple[dict[str, str], Optional[float]]] = [
            ({"quantile": q}, st[k]) for q, k in (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99"))]
        lines.append(f"# HELP {prefix}{name}_seconds {help_} (seconds).")
        lines.append(f"# TYPE {prefix}{name}_seconds summary")
        for ls, v in samples:
            lines.append(f"{prefix}{name}_seconds{lab(ls)} {_prom_num(v)}")
        total = (st["mean"] or 0.0) * st["count"]
        lines.append(f"{prefix}{name}_seconds_sum{lab({})} {_prom_num(total)}")
        lines.append(f"{prefix}{name}_seconds_count{lab({})} {_prom_num(st['count'])}")
    for kind in ("prompt", "output"):
        lines.append(f"# HELP {prefix}bucket_ttft_p99_seconds TTFT P99 by {kind}-length bucket.")
        lines.append(f"# TYPE {prefix}bucket_ttft_p99_seconds gauge")
        for b, agg in summary["buckets"][kind].items():
            lines.append(f"{prefix}bucket_ttft_p99_seconds{lab({'by': kind, 'bucket': b})} "
                         f"{_prom_num(agg['ttft']['p99'])}")
    return "\n".join(lines) + "\n"


class MetricsLog:
    """Thread-safe, bounded store of finished requests plus live gauges for a proxy."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._records: deque[RequestMetrics] = deque(maxlen=maxlen)
        self.in_flight = 0

    def add(self, r: RequestMetrics) -> None:
        with self._lock:
            self._records.append(r)

    def records(self) -> list[RequestMetrics]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
