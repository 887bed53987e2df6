"""Metrics aggregation (percentiles, goodput, buckets) and the Prometheus exposition."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.workers.metrics import PromMetrics, RequestMetrics, percentile, summarize


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


def test_prometheus_histograms_parse_and_aggregate() -> None:
    recs = [_rec(0, 0.1, 0.01, 11, 100), _rec(1, 0.5, 0.01, 11, 600), _rec(2, 0.1, 0.05, 11, 3000),
            _rec(3, 0.1, 0.01, 1, 50), _rec(4, 0.1, 0.01, 5, 50, ok=False)]
    pm = PromMetrics("disaggregated", ttft_slo=0.2, tpot_slo=0.02)
    for r in recs:
        pm.observe(r)
    text = pm.exposition().decode()
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a metric family has two TYPE lines"
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ttft", "tpot", "e2e", "queue", "kv_transfer"):
        assert fams[f"kvbridge_{name}_seconds"].type == "histogram"
    ttft = fams["kvbridge_ttft_seconds"].samples
    counts = {(s.labels["prompt_len"], s.labels["output_len"]): s.value for s in ttft if s.name.endswith("_count")}
    assert counts == {("0-128", "0-32"): 2.0, ("513-1024", "0-32"): 1.0, ("2049+", "0-32"): 1.0}
    total = sum(s.value for s in ttft if s.name.endswith("_sum"))
    assert total == pytest.approx(sum(r.ttft or 0 for r in recs if r.ok))
    # cumulative buckets: the 0.25 s bucket holds the three 0.1 s TTFTs of the ok requests, +Inf all four
    le = {s.labels["le"]: s.value for s in ttft
          if s.name.endswith("_bucket") and s.labels["prompt_len"] == "0-128"}
    assert le["0.05"] == 0 and le["0.15"] == 2 and le["+Inf"] == 2
    req = {s.labels["outcome"]: s.value for s in fams["kvbridge_requests"].samples if s.name.endswith("_total")}
    assert req == {"ok": 4.0, "failed": 1.0}
    good = [s.value for s in fams["kvbridge_good_requests"].samples if s.name.endswith("_total")]
    assert good == [float(summarize(recs, ttft_slo=0.2, tpot_slo=0.02)["good_requests"])]


def test_record_roundtrip() -> None:
    r = _rec(0, 0.1, 0.01, 11, 100)
    d = r.to_dict()
    assert d["ttft"] == pytest.approx(0.1) and d["tpot"] == pytest.approx(0.01)
    assert RequestMetrics.from_dict(d) == r
    assert summarize([])["requests"] == 0
