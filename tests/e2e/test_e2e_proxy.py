"""The proxy's HTTP API and failure policy, against workers served over HTTP in this process."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.pool import KVPool
from kvbridge.workers.decode import DecodeWorker
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM
from kvbridge.workers.prefill import PrefillWorker
from kvbridge.workers.proxy import Proxy, ProxyConfig
from kvbridge.workers.sampling import SamplingParams
from kvbridge.workers.server import WorkerConfig
from kvbridge.workers.tokenizer import ByteTokenizer

from .conftest import free_port, get, post

CFG = WorkerConfig(model="tiny", num_blocks=512, chunk_size=64)


@pytest.fixture(scope="module")
def workers(tiny_model: CausalLM, lease_url: str) -> Iterator[tuple[str, str]]:
    pw = PrefillWorker(CFG, "tcp", leases=lease_url, model=tiny_model)
    dw = DecodeWorker(CFG, leases=lease_url, model=tiny_model)
    yield pw.serve().url, dw.serve().url
    pw.close()
    dw.close()


def _proxy(**kw: Any) -> tuple[Proxy, str]:
    p = Proxy(ProxyConfig(worker_timeout=10.0, **kw))
    return p, p.serve("127.0.0.1", 0).url


def _ref(model: CausalLM, text: str, max_tokens: int) -> list[int]:
    eng = Engine(model, KVPool.allocate(model.kv_layout(16), 128))
    return eng.generate(ByteTokenizer().encode(text), SamplingParams(max_tokens=max_tokens), chunk_size=64,
                        eos_id=model.config.eos_id)


def _sse(url: str, body: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


@pytest.mark.timeout(60)
def test_completions_stream_and_metrics(workers: tuple[str, str], tiny_model: CausalLM) -> None:
    p, url = _proxy(prefill=[workers[0]], decode=[workers[1]])
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": 12}
        status, full = post(url + "/v1/completions", body)
        assert status == 200, full
        ch = full["choices"][0]
        assert ch["token_ids"] == _ref(tiny_model, body["prompt"], 12)
        assert full["usage"]["completion_tokens"] == len(ch["token_ids"])
        assert full["metrics"]["kv_bytes"] > 0 and full["metrics"]["ttft"] > 0
        events = _sse(url + "/v1/completions", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len(chunks) >= 2
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ch["token_ids"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == ch["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == ch["finish_reason"]
        status, ids_answer = post(url + "/v1/completions", {"prompt": ByteTokenizer().encode(body["prompt"]),
                                                             "max_tokens": 12})
        assert ids_answer["choices"][0]["token_ids"] == ch["token_ids"]
        status, bad = post(url + "/v1/completions", {"prompt": 5})
        assert status == 422 and bad["error"]["action"] == "fix" and bad["error"]["param"] == "prompt"
        status, health = get(url + "/health")
        assert status == 200 and json.loads(health)["status"] == "ok"
        status, prom = get(url + "/metrics")
        text = prom.decode()
        assert status == 200 and 'kvbridge_requests_total{mode="disaggregated",outcome="ok"} 3.0' in text
        assert "kvbridge_ttft_seconds_bucket{" in text and "kvbridge_kv_transfer_seconds_count{" in text
        fams = {f.name: f for f in text_string_to_metric_families(text)}  # the official parser accepts it
        for name in ("ttft", "tpot", "e2e", "queue", "prefill", "kv_transfer"):
            f = fams[f"kvbridge_{name}_seconds"]
            assert f.type == "histogram"
            n = sum(x.value for x in f.samples if x.name.endswith("_count"))
            assert n == 3 if name != "tpot" else 1 <= n <= 3, (name, n)
        rejected = [x for x in fams["kvbridge_rejected_requests"].samples if x.name.endswith("_total")]
        assert [(x.labels["status"], x.value) for x in rejected] == [("422", 1.0)]
        status, js = get(url + "/metrics.json?records=1")
        s = json.loads(js)
        assert s["ok"] == 3 and s["failed"] == 0 and len(s["records"]) == 3  # a 400 is not a served request
        assert s["ttft"]["p99"] >= s["ttft"]["p50"] > 0 and s["throughput_tok_s"] > 0
    finally:
        p.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["retry", "reprefill"])
def test_dead_decode_worker_is_skipped(workers: tuple[str, str], tiny_model: CausalLM, policy: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p, url = _proxy(prefill=[workers[0]], decode=[dead, workers[1]], routing="round-robin",
                    on_decode_failure=policy)
    try:
        status, out = post(url + "/v1/completions", {"prompt": "retry me", "max_tokens": 10})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == _ref(tiny_model, "retry me", 10)
        assert out["metrics"]["retries"] == 1
        assert out["metrics"]["reprefills"] == (0 if policy == "retry" else 1)
        status, health = get(url + "/health")
        assert status == 503 and json.loads(health)["status"] == "degraded"
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_dead_prefill_worker_is_a_clear_error(workers: tuple[str, str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p, url = _proxy(prefill=[dead], decode=[workers[1]])
    try:
        t0 = time.monotonic()
        status, out = post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 4})
        assert time.monotonic() - t0 < 10
        assert status == 503
        assert "prefill failed" in out["error"]["message"] and out["error"]["action"] == "retry"
        assert dead.split("//")[1] not in out["error"]["message"]  # no internal address for the client
        events = _sse(url + "/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True})
        assert events[-1] == "[DONE]" and events[0]["error"]["action"] == "retry"
    finally:
        p.close()
