"""The front door through the official ``openai`` client, and its refusals.

Real workers (tiny model) and the proxy are served over HTTP in this process; the
client is the ``openai`` package, streaming and not. Bad input must get OpenAI's error
shape with the right status, and must not reach a worker.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvbridge.pool import KVPool
from kvbridge.workers.colocated import ColocatedWorker
from kvbridge.workers.decode import DecodeWorker
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM
from kvbridge.workers.openai_api import plain_chat_text
from kvbridge.workers.prefill import PrefillWorker
from kvbridge.workers.proxy import Proxy, ProxyConfig
from kvbridge.workers.sampling import SamplingParams
from kvbridge.workers.server import WorkerConfig
from kvbridge.workers.tokenizer import ByteTokenizer

CFG = WorkerConfig(model="tiny", num_blocks=256, chunk_size=64)
TOK = ByteTokenizer()
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def stack(tiny_model: CausalLM, lease_url: str) -> Iterator[dict[str, Any]]:
    pw = PrefillWorker(CFG, "tcp", leases=lease_url, model=tiny_model)
    dw = DecodeWorker(CFG, leases=lease_url, model=tiny_model)
    proxy = Proxy(ProxyConfig(prefill=[pw.serve().url], decode=[dw.serve().url], model_name="tiny",
                              worker_timeout=10.0, max_body_bytes=LIMIT))
    url = proxy.serve("127.0.0.1", 0).url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30.0)
    yield {"url": url, "client": client, "prefill": pw, "decode": dw, "proxy": proxy}
    client.close()
    proxy.close()
    pw.close()
    dw.close()


def _ref(model: CausalLM, ids: list[int], max_tokens: int) -> list[int]:
    eng = Engine(model, KVPool.allocate(model.kv_layout(16), 128))
    return eng.generate(ids, SamplingParams(max_tokens=max_tokens), chunk_size=64, eos_id=model.config.eos_id)


@pytest.mark.timeout(60)
def test_completions_and_chat_with_the_openai_client(stack: dict[str, Any], tiny_model: CausalLM) -> None:
    c: openai.OpenAI = stack["client"]
    assert [m.id for m in c.models.list().data] == ["tiny"]
    prompt = "The quick brown fox"
    want = TOK.decode(_ref(tiny_model, TOK.encode(prompt), 12))

    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage is not None and r.usage.prompt_tokens == len(TOK.encode(prompt))
    n_out = r.usage.completion_tokens
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == n_out and all(ch.usage is None for ch in chunks[:-1])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    every = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in every if ch.usage is not None]  # vLLM's extension, as load
    assert len(counts) == len(every) and counts == sorted(counts) and counts[-1] == n_out  # generators send it
    plain = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert all(ch.usage is None for ch in plain) and plain[-1].choices  # no usage chunk unless asked

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat_ids = TOK.encode(plain_chat_text([(m["role"], m["content"]) for m in msgs]))
    want_chat = TOK.decode(_ref(tiny_model, chat_ids, 10))
    r2 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10)  # type: ignore[arg-type]
    assert r2.choices[0].message.role == "assistant" and r2.choices[0].message.content == want_chat
    assert r2.usage is not None and r2.usage.prompt_tokens == len(chat_ids)
    s = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, stream=True,  # type: ignore
                                       stream_options={"include_usage": True}))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == want_chat
    assert s[-1].usage is not None and s[-1].usage.completion_tokens == r2.usage.completion_tokens


def _raw(url: str, method: str, path: str, body: bytes, ctype: str = "application/json") -> httpx.Response:
    return httpx.request(method, url + path, content=body, headers={"Content-Type": ctype}, timeout=10.0)


BAD: list[tuple[str, str, Any, str, int, str]] = [
    # (name, method, json body or raw bytes, path, status, code)
    ("empty text prompt", "POST", {"prompt": "", "max_tokens": 4}, "/v1/completions", 400, "empty_prompt"),
    ("empty id prompt", "POST", {"prompt": [], "max_tokens": 4}, "/v1/completions", 400, "empty_prompt"),
    ("max_tokens as a string", "POST", {"prompt": "hi", "max_tokens": "4"}, "/v1/completions", 422, "invalid_type"),
    ("temperature as a string", "POST", {"prompt": "hi", "temperature": "0.5"}, "/v1/completions", 422,
     "invalid_type"),
    ("negative max_tokens", "POST", {"prompt": "hi", "max_tokens": -1}, "/v1/completions", 422, "invalid_value"),
    ("n > 1", "POST", {"prompt": "hi", "n": 3}, "/v1/completions", 400, "unsupported_parameter"),
    ("unknown field", "POST", {"prompt": "hi", "frobnicate": 1}, "/v1/completions", 400, "unrecognized_argument"),
    ("max_tokens past the context", "POST", {"prompt": "hi", "max_tokens": 10**9}, "/v1/completions", 400,
     "context_length_exceeded"),
    ("token id outside the vocabulary", "POST", {"prompt": [1, 99999]}, "/v1/completions", 400, "invalid_token_id"),
    ("batch of two", "POST", {"prompt": ["a", "b"]}, "/v1/completions", 400, None),
    ("unknown model", "POST", {"prompt": "hi", "model": "gpt-9"}, "/v1/completions", 404, "model_not_found"),
    ("chat without messages", "POST", {"messages": []}, "/v1/chat/completions", 422, "invalid_value"),
    ("chat with tools", "POST", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "/v1/chat/completions", 400, "unsupported_parameter"),
    ("not JSON", "POST", b"{prompt: hi", "/v1/completions", 400, "invalid_json"),
    ("JSON array", "POST", b"[1, 2]", "/v1/completions", 400, None),
    ("GET on completions", "GET", b"", "/v1/completions", 405, "method_not_allowed"),
    ("unknown path", "POST", {"prompt": "hi"}, "/v1/engines", 404, "not_found"),
]


@pytest.mark.timeout(60)
def test_bad_input_is_refused_before_any_work(stack: dict[str, Any]) -> None:
    url, pw = stack["url"], stack["prefill"]
    before = (pw.requests, stack["decode"].requests, len(stack["proxy"].metrics.records()))
    ctx = "x" * (pw.max_model_len + 5)  # the prompt alone is past the context length
    cases = BAD + [("prompt past the context", "POST", {"prompt": ctx, "max_tokens": 1}, "/v1/completions", 400,
                    "context_length_exceeded")]
    for name, method, body, path, status, code in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = _raw(url, method, path, raw)
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], name
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), name
        assert err["action"] == "fix" and err["status"] == status, name
        if code is not None:
            assert err["code"] == code, (name, err)
    r = _raw(url, "POST", "/v1/completions", b"hello", ctype="text/plain")
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert (pw.requests, stack["decode"].requests, len(stack["proxy"].metrics.records())) == before
    assert pw.sender.num_live == 0  # no prefill ran, so no KV is held
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    # the official client surfaces the same answers as typed errors
    c: openai.OpenAI = stack["client"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=10**9)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.UnprocessableEntityError):
        c.completions.create(model="tiny", prompt="hi", extra_body={"max_tokens": "4"})
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="hi")


@pytest.mark.timeout(30)
def test_oversized_body_is_413_before_it_is_read(stack: dict[str, Any]) -> None:
    """A 50 MB body announced by Content-Length is refused after the headers: the client has sent
    only its first bytes when the answer comes, and nothing reaches a worker."""
    url, pw = stack["url"], stack["prefill"]
    before = pw.requests
    host, port = url.split("//")[1].rsplit(":", 1)
    declared = 50_000_000
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{\"prompt\": \"" % declared + b"a" * 4096)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            got = s.recv(65536)
            if not got:
                break
            data += got
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    # a chunked body (no Content-Length) is cut off as soon as it passes the limit
    r = httpx.post(url + "/v1/completions", content=iter([b"{\"prompt\": \"" + b"a" * LIMIT, b"\"}"]),
                   headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert pw.requests == before


@pytest.mark.timeout(60)
def test_shutdown_answers_requests_in_flight(tiny_model: CausalLM) -> None:
    """Closing the front door gives each request in flight a JSON error, streaming or not."""
    slow = ColocatedWorker(WorkerConfig(model="tiny", num_blocks=256, chunk_size=64, step_delay=0.02),
                           model=tiny_model)
    proxy = Proxy(ProxyConfig(colocated=slow.serve().url, model_name="tiny", worker_timeout=10.0))
    url = proxy.serve("127.0.0.1", 0).url
    body = {"prompt": "a long answer", "max_tokens": 400, "ignore_eos": True}
    got: dict[str, Any] = {}
    streaming = threading.Event()

    def stream() -> None:
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()
        got["stream"] = events

    def whole() -> None:
        got["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=30)

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        assert streaming.wait(20)
        deadline = time.monotonic() + 10
        while proxy.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.close()
        for t in threads:
            t.join(20)
        deadline = time.monotonic() + 5  # the worker learns from the closed streams and frees the slots
        while slow.loop.load["watched"] and time.monotonic() < deadline:
            time.sleep(0.02)
        freed = slow.loop.load["watched"] == 0 and slow.pool.num_free == slow.pool.num_blocks
    finally:
        proxy.close()
        slow.close()
    ev = got["stream"]
    assert ev[-1] == "[DONE]"
    last = json.loads(ev[-2])
    assert last["error"]["action"] == "retry" and "shutting down" in last["error"]["message"]
    assert len(ev) >= 3  # some tokens came before the error
    r = got["whole"]
    assert r.status_code == 503 and r.json()["error"]["action"] == "retry"
    assert freed, "the engine still holds the aborted requests"


def test_chat_uses_the_checkpoint_template_else_the_plain_one(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvbridge.workers.openai_api import ChatRequest, parse_request, render_chat
    from kvbridge.workers.tokenizer import HFTokenizer, load_tokenizer

    chars = {chr(i): i for i in range(32, 127)}
    t = Tokenizer(models.WordLevel(vocab={**chars, "<unk>": 0}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    plain_dir, templ_dir = tmp_path / "plain", tmp_path / "templ"
    fast.save_pretrained(plain_dir)
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(templ_dir)
    req = parse_request(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert isinstance(req, ChatRequest)
    templ = load_tokenizer(templ_dir)
    assert isinstance(templ, HFTokenizer)
    assert render_chat(req, templ) == [ord(c) for c in "<user>hi<assistant>"]
    plain = load_tokenizer(plain_dir)
    assert render_chat(req, plain) == plain.encode(plain_chat_text([("user", "hi")]))
    assert render_chat(req, TOK) == TOK.encode("user: hi\nassistant:")
