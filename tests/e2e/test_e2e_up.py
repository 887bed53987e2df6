"""``kvbridge up`` as real processes: HTTP correctness, PD vs colocated, faults, shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM
from kvbridge.workers.sampling import SamplingParams
from kvbridge.workers.tokenizer import ByteTokenizer

from .conftest import UpProcess, assert_stopped_cleanly, get, pid_alive, post

TOK = ByteTokenizer()


def _reference(model: CausalLM, prompts: list[list[int]], max_tokens: list[int], chunk: int = 256) -> list[list[int]]:
    eng = Engine(model, KVPool.allocate(model.kv_layout(16), 512))
    return [eng.generate(p, SamplingParams(max_tokens=m), chunk_size=chunk, eos_id=model.config.eos_id)
            for p, m in zip(prompts, max_tokens)]


def _random_requests(n: int, seed: int, hi: int = 300) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randint(1, hi))] for _ in range(n)]
    return prompts, [rng.randint(1, 24) for _ in range(n)]


def _complete_all(url: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    def one(i: int) -> list[int]:
        status, out = post(url + "/v1/completions", {"prompt": prompts[i], "max_tokens": max_tokens[i]})
        assert status == 200, out
        return list(out["choices"][0]["token_ids"])
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(one, range(len(prompts))))


@pytest.fixture(scope="module")
def pd() -> Iterator[UpProcess]:
    up = UpProcess("--decode-workers", "2")  # default model, chunk size and transport (tcp)
    yield up
    assert_stopped_cleanly(up)


@pytest.fixture(scope="module")
def colo() -> Iterator[UpProcess]:
    up = UpProcess("--colocated")
    yield up
    assert_stopped_cleanly(up)


@pytest.mark.timeout(120)
def test_up_and_colocated_agree_on_a_prompt_alone(pd: UpProcess, colo: UpProcess) -> None:
    for body in ({"prompt": "Hello, kvbridge! Tell me about KV caches.", "max_tokens": 48},
                 {"prompt": "x" * 700, "max_tokens": 16, "ignore_eos": True},           # 3 prefill chunks
                 {"prompt": "seeded sampling", "max_tokens": 24, "temperature": 0.9, "seed": 7}):
        s1, a = post(pd.url + "/v1/completions", body)
        s2, b = post(colo.url + "/v1/completions", body)
        assert s1 == s2 == 200, (a, b)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["choices"][0]["text"] == b["choices"][0]["text"]


@pytest.mark.timeout(120)
def test_up_random_prompts_match_reference(pd: UpProcess, colo: UpProcess) -> None:
    prompts, mt = _random_requests(16, seed=11)
    want = _reference(CausalLM.from_seed("small", seed=0), prompts, mt)
    assert _complete_all(pd.url, prompts, mt) == want
    assert _complete_all(colo.url, prompts, mt) == want


@pytest.mark.timeout(60)
def test_up_health_metrics_stream(pd: UpProcess) -> None:
    status, body = get(pd.url + "/health")
    h = json.loads(body)
    assert status == 200 and h["mode"] == "disaggregated"
    assert sorted(w["role"] for w in h["workers"]) == ["decode", "decode", "prefill"]
    req = urllib.request.Request(pd.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "stream", "max_tokens": 8, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = [ln.strip() for ln in r if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]" and len(lines) >= 3
    status, prom = get(pd.url + "/metrics")
    assert status == 200 and b"kvbridge_ttft_seconds_bucket{" in prom and b"kvbridge_good_requests_total" in prom
    s = json.loads(get(pd.url + "/metrics.json")[1])
    assert s["ok"] >= 1 and s["kv_bytes"] > 0 and s["kv_transfer"]["p50"] > 0


@pytest.mark.timeout(120)
def test_up_shm_then_prefill_killed(lease_url: str) -> None:
    up = UpProcess("--transport", "shm", "--model", "tiny")
    try:
        prompts, mt = _random_requests(16, seed=12)
        assert _complete_all(up.url, prompts, mt) == _reference(CausalLM.from_seed("tiny", seed=0), prompts, mt)
        (pf,) = up.workers("prefill")
        os.kill(pf["pid"], signal.SIGKILL)
        _remove_shm_of(pf["pid"])
        t0 = time.monotonic()
        status, out = post(up.url + "/v1/completions", {"prompt": "anyone there?", "max_tokens": 8}, timeout=30)
        assert time.monotonic() - t0 < 15
        assert status == 503 and out["error"]["action"] == "retry" and "prefill" in out["error"]["message"]
        assert get(up.url + "/health")[0] == 503
    finally:
        assert_stopped_cleanly(up)


def _remove_shm_of(pid: int) -> None:
    """A SIGKILLed shm sender cannot unlink its pool segment; the test cleans up after itself."""
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if name.startswith(f"kvb-{pid}-"):
            os.unlink(os.path.join("/dev/shm", name))


def _stream_tokens(url: str, body: dict[str, Any], on_event: Any) -> tuple[list[int], Any]:
    req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({**body, "stream": True}).encode())
    toks: list[int] = []
    last = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for i, line in enumerate(ln for ln in r if ln.startswith(b"data: ")):
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            last = json.loads(data)
            assert "error" not in last, last
            toks += last["choices"][0]["token_ids"]
            on_event(i)
    return toks, last


@pytest.mark.timeout(150)
@pytest.mark.parametrize("policy", ["retry", "reprefill"])
def test_up_decode_killed_mid_request(lease_url: str, policy: str) -> None:
    # External lease server, so that killing the parent at the end leaves nothing behind.
    up = UpProcess("--model", "tiny", "--decode-workers", "2", "--step-delay", "0.01", "--leases", lease_url,
                   "--on-decode-failure", policy)
    try:
        prompt = TOK.encode("Tell me a long story about blocks that moved between workers.")
        body = {"prompt": prompt, "max_tokens": 120, "ignore_eos": True}
        killed: list[int] = []

        def on_event(i: int) -> None:
            if i == 10 and not killed:
                busy = [w for w in up.workers("decode") if w.get("proxy_inflight")]
                assert busy, "no decode worker is serving the request"
                os.kill(busy[0]["pid"], signal.SIGKILL)
                killed.append(busy[0]["pid"])
        toks, last = _stream_tokens(up.url, body, on_event)
        assert killed and last["choices"][0]["finish_reason"] == "length"
        assert toks == _reference(CausalLM.from_seed("tiny", seed=0), [prompt], [120])[0]
        s = json.loads(get(up.url + "/metrics.json")[1])
        assert s["reprefills"] >= 1 and s["failed"] == 0
        status, out = post(up.url + "/v1/completions", body)  # the survivor serves the next one
        assert status == 200 and out["choices"][0]["token_ids"] == toks
    finally:
        # The parent dies without cleaning up: its children must exit on their own.
        up.proc.kill()
        up.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in up.worker_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in up.worker_pids if pid_alive(p)], "workers outlived a killed parent"
