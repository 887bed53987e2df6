"""Metrics aggregation: percentiles, goodput, buckets, Prometheus text."""

from __future__ import annotations

import pytest

from kvbridge.workers.metrics import RequestMetrics, percentile, summarize, to_prometheus


def _rec(i: int, ttft: float, tpot: float, n_out: int, prompt: int, ok: bool = True) -> RequestMetrics:
    first = 10.0 + i + ttft
    return RequestMetrics(f"r{i}", prompt_tokens=prompt, output_tokens=n_out, arrival=10.0 + i,
                          first_token_at=first, finished_at=first + tpot * (n_out - 1), queue_s=0.01,
                          kv_transfer_s=0.002, kv_bytes=1000, ok=ok, error=None if ok else "PeerUnavailable: x")


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 95) == pytest.approx(95)


def test_summarize_goodput_and_buckets() -> None:
    recs = [_rec(0, 0.1, 0.01, 11, 100), _rec(1, 0.5, 0.01, 11, 600),   # ttft over target
            _rec(2, 0.1, 0.05, 11, 3000),                                  # tpot over target
            _rec(3, 0.1, 0.01, 1, 50), _rec(4, 0.1, 0.01, 5, 50, ok=False)]
    s = summarize(recs, ttft_slo=0.2, tpot_slo=0.02)
    assert s["requests"] == 5 and s["ok"] == 4 and s["failed"] == 1
    assert s["good_requests"] == 2 and s["goodput_fraction"] == pytest.approx(0.4)
    assert s["duration_s"] == pytest.approx(max(r.finished_at or 0 for r in recs) - 10.0)
    assert s["goodput_req_s"] == pytest.approx(2 / s["duration_s"])
    assert s["output_tokens"] == 34 and s["throughput_tok_s"] == pytest.approx(34 / s["duration_s"])
    assert s["ttft"]["p50"] == pytest.approx(0.1) and s["tpot"]["count"] == 3
    assert s["errors"] == {"PeerUnavailable": 1}
    assert set(s["buckets"]["prompt"]) == {"0-128", "513-1024", "2049+"}
    assert s["buckets"]["prompt"]["0-128"]["requests"] == 3
    text = to_prometheus(s, labels={"mode": "disaggregated"})
    assert 'kvbridge_requests_total{mode="disaggregated",outcome="failed"} 1.0' in text
    assert 'kvbridge_ttft_seconds{mode="disaggregated",quantile="0.99"}' in text
    assert 'kvbridge_bucket_ttft_p99_seconds{mode="disaggregated",by="prompt",bucket="2049+"}' in text
    for line in text.splitlines():  # every sample line is "name{labels} value"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_record_roundtrip() -> None:
    r = _rec(0, 0.1, 0.01, 11, 100)
    d = r.to_dict()
    assert d["ttft"] == pytest.approx(0.1) and d["tpot"] == pytest.approx(0.01)
    assert RequestMetrics.from_dict(d) == r
    assert summarize([])["requests"] == 0
