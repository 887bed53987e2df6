"""``kvbridge up`` as real processes: HTTP correctness, PD vs colocated, faults, shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import openai
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
    # default model, chunk size and transport (tcp); several workers of each role
    up = UpProcess("--prefill-workers", "2", "--decode-workers", "2")
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
    served = {w["name"]: w["requests"] for w in pd.workers()}
    assert all(n > 0 for n in served.values()), f"a worker got no work: {served}"  # routing spreads the load


def _openai_texts(url: str) -> list[str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60.0)
    try:
        model = c.models.list().data[0].id
        prompt = "Disaggregated serving moves the KV cache"
        msgs: Any = [{"role": "user", "content": "What is a KV cache?"}]
        out = [c.completions.create(model=model, prompt=prompt, max_tokens=24).choices[0].text,
               "".join(ch.choices[0].text for ch in c.completions.create(model=model, prompt=prompt, max_tokens=24,
                                                                          stream=True)),
               c.chat.completions.create(model=model, messages=msgs, max_tokens=24).choices[0].message.content or "",
               "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                   model=model, messages=msgs, max_tokens=24, stream=True, stream_options={"include_usage": True})
                   if ch.choices)]
    finally:
        c.close()
    return out


@pytest.mark.timeout(120)
def test_openai_client_same_text_from_up_and_colocated(pd: UpProcess, colo: UpProcess) -> None:
    a, b = _openai_texts(pd.url), _openai_texts(colo.url)
    assert a == b
    assert a[0] == a[1] and a[2] == a[3] and a[0] != a[2]


@pytest.mark.timeout(60)
def test_up_health_metrics_stream(pd: UpProcess) -> None:
    status, body = get(pd.url + "/health")
    h = json.loads(body)
    assert status == 200 and h["mode"] == "disaggregated"
    assert sorted(w["role"] for w in h["workers"]) == ["decode", "decode", "prefill", "prefill"]
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


@pytest.mark.timeout(120)
def test_up_from_a_folder_with_a_kvbridge_dir_and_sigint_mid_request(tmp_path: Any) -> None:
    """Workers import the installed package even where ``./kvbridge`` exists (a clone's parent);
    Ctrl-C answers the requests in flight with a JSON error; the default log folder goes away."""
    fake = tmp_path / "kvbridge"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the kvbridge folder of the current directory')\n")
    (tmp_path / "kvbridge" / "kvbridge").mkdir()
    (tmp_path / "tiny").mkdir()  # a folder named like the preset: the preset still wins
    up = UpProcess("--model", "tiny", "--step-delay", "0.02", cwd=str(tmp_path))
    got: dict[str, Any] = {}
    body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
    first = __import__("threading").Event()

    def stream() -> None:
        req = urllib.request.Request(up.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            got["stream"] = []
            for line in r:
                if line.startswith(b"data: "):
                    got["stream"].append(line[6:].strip())
                    first.set()

    def whole() -> None:
        got["whole"] = post(up.url + "/v1/completions", body)

    threads = [__import__("threading").Thread(target=f) for f in (stream, whole)]
    try:
        for t in threads:
            t.start()
        assert first.wait(30)
        deadline = time.monotonic() + 10  # both requests are in the proxy's hands
        while json.loads(get(up.url + "/health")[1])["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        code, err = up.stop()
        for t in threads:
            t.join(20)
    assert code == 0, err[-2000:]
    assert got["stream"][-1] == b"[DONE]" and json.loads(got["stream"][-2])["error"]["action"] == "retry"
    status, out = got["whole"]
    assert status == 503 and out["error"]["action"] == "retry" and "shutting down" in out["error"]["message"]
    log_dir = next(ln.split("logs in ", 1)[1].split(" (")[0] for ln in err.splitlines() if "logs in " in ln)
    assert not os.path.exists(log_dir), "the default log folder outlived a clean exit"
    assert not [p for p in up.worker_pids if pid_alive(p)]


@pytest.mark.timeout(120)
def test_up_log_dir_kept_and_no_tracebacks_after_client_disconnects(tmp_path: Any) -> None:
    logs = tmp_path / "logs"
    up = UpProcess("--model", "tiny", "--step-delay", "0.01", "--log-dir", str(logs))
    try:
        for _ in range(3):  # clients that hang up mid-stream
            req = urllib.request.Request(up.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": "bye", "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True}).encode())
            r = urllib.request.urlopen(req, timeout=30)
            r.readline()
            r.close()
        status, out = post(up.url + "/v1/completions", {"prompt": "still here?", "max_tokens": 4})
        assert status == 200, out
        deadline = time.monotonic() + 10  # the abandoned requests are aborted, not run to the end
        while any(w["load"]["watched"] for w in up.workers("decode")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(w["load"]["watched"] for w in up.workers("decode"))
    finally:
        assert_stopped_cleanly(up)
    names = sorted(p.name for p in logs.iterdir())
    assert names == ["decode-0.log", "prefill-0.log"]
    for p in logs.iterdir():
        assert "Traceback" not in p.read_text(), p.read_text()[-2000:]


@pytest.mark.timeout(120)
def test_separate_commands_multi_host_recipe(lease_url: str) -> None:
    """``kvbridge prefill``/``decode``/``proxy`` as the README's multi-host recipe runs them
    (one shared lease server, workers by URL), here on one machine."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        p = subprocess.Popen([sys.executable, "-P", "-m", "kvbridge", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        return str(json.loads(line)["url"])
    try:
        pre = [start("prefill", "--model", "tiny", "--leases", lease_url, "--host", "127.0.0.1") for _ in range(2)]
        dec = start("decode", "--model", "tiny", "--leases", lease_url)
        args = ["proxy", "--port", "0", "--model", "tiny", "--decode", dec]
        for u in pre:
            args += ["--prefill", u]
        front = start(*args)
        c = openai.OpenAI(base_url=front + "/v1", api_key="none", max_retries=0, timeout=60.0)
        prompt = TOK.encode("several hosts")
        outs = [c.completions.create(model="tiny", prompt=prompt, max_tokens=12) for _ in range(4)]
        c.close()
        want = _reference(CausalLM.from_seed("tiny", seed=0), [prompt], [12])[0]
        assert all(o.choices[0].token_ids == want for o in outs)  # type: ignore[attr-defined]
        served = [json.loads(get(u + "/health")[1])["requests"] for u in pre]
        assert served == [2, 2]
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
    assert [p.returncode for p in procs] == [0] * len(procs)


@pytest.mark.timeout(120)
def test_workers_stop_on_a_burst_of_signals(lease_url: str) -> None:
    """A burst of SIGTERMs (a supervisor repeating itself, Ctrl-C pressed twice) stops every
    kind of process: no signal handler may wait for a lock its own thread holds."""
    for role in ("prefill", "decode", "proxy"):
        args = ["--model", "tiny"] + (["--leases", lease_url, "--host", "127.0.0.1"] if role != "proxy"
                                      else ["--port", "0", "--decode", "http://127.0.0.1:9", "--prefill", "http://127.0.0.1:9"])
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-P", "-m", "kvbridge", role, *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
            try:
                assert p.stdout is not None and "ready" in p.stdout.readline()
                end = time.monotonic() + 1.2      # across the old 0.5 s wait boundaries
                while time.monotonic() < end and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    time.sleep(0.0002)
                # stopped by the first signal (0), or by a later one that came during interpreter
                # shutdown (-SIGTERM); never stuck
                assert p.wait(timeout=15) in (0, -signal.SIGTERM), f"{role} exited with {p.returncode}"
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
