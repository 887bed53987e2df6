"""The OpenAI-compatible surface of the front door: request models, errors, chat template.

Requests are validated by pydantic models in strict mode: wrong types (``"max_tokens":
"4"``) are HTTP 422, arguments OpenAI does not know are 400 (``Unrecognized request
argument supplied``), OpenAI arguments this server does not implement are 400 unless
they hold their neutral value (``n: 1``, ``stop: null``, ``echo: false`` ...). Every
error answer is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, plus
kvbridge's ``action`` (what the client should do: ``fix``, ``retry``) and ``status``.

Chat: a checkpoint whose tokenizer ships a chat template uses it; otherwise (the seeded
presets) the **plain template** renders each message as ``"<role>: <content>\\n"`` and
appends ``"assistant:"`` for the model to continue. ``temperature`` defaults to 0 (greedy,
so the same request gives the same text in every mode), not OpenAI's 1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import Action, KVBridgeError, TransferTimeout
from .metrics import RequestMetrics
from .sampling import SamplingParams
from .tokenizer import HFTokenizer, Tokenizer

__all__ = ["APIError", "CompletionRequest", "ChatRequest", "parse_request", "error_json", "error_from_kvbridge",
           "Job", "usage", "whole_response", "chunk_response", "render_chat", "plain_chat_text", "prompt_ids",
           "sampling_params", "clip"]


class APIError(Exception):
    """An answer in OpenAI's error shape: ``status``, ``message``, ``param``, ``code``, ``action``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 action: str = Action.FIX.value) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.action = status, message, param, code, action

    def body(self) -> dict[str, Any]:
        kind = ("invalid_request_error" if self.status < 500 and self.status != 404 else
                "not_found_error" if self.status == 404 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code,
                          "action": self.action, "status": self.status}}


def clip(text: str, limit: int = 100) -> str:
    """``text`` as an error message may quote it: at most ``limit`` characters, else cut with a note
    of its length (a client's model name may be as long as the body limit)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_json(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               action: str = Action.FIX.value) -> dict[str, Any]:
    return APIError(status, message, param, code, action).body()


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;)]+")


def error_from_kvbridge(exc: KVBridgeError) -> APIError:
    """A kvbridge error at the front door: 503 when trying again may work, 504 on a timeout,
    the worker's 4xx for input a worker refused, else 500. Internal addresses (worker and
    transport URLs) are left out of the message; the proxy's log has them."""
    st = int(getattr(exc, "status", 0) or 0)
    if isinstance(exc, TransferTimeout):
        status = 504
    elif exc.action is Action.FIX:
        status = st if 400 <= st < 500 else 500
    else:
        status = 503
    return APIError(status, _ADDRESS.sub("<internal>", str(exc)), None, _snake(type(exc).__name__),
                    exc.action.value)


# -- request models ----------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: with include_usage, every chunk carries usage


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)             # vLLM's extension; -1 or 0: off
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: bool = False                               # extensions (as in vLLM)
    stop_token_ids: Optional[list[int]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for an OpenAI argument set to something this server does not do."""
        if self.n not in (None, 1):
            return "n", "n must be 1: this server returns one choice per request"
        if self.stop:
            return "stop", "stop strings are not supported; use stop_token_ids"
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty" if self.presence_penalty else "frequency_penalty",
                    "presence and frequency penalties are not supported")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().unsupported()


Req = Union[CompletionRequest, ChatRequest]


def parse_request(kind: type[Req], body: Any) -> Req:
    """Validate ``body`` as ``kind``; an :class:`APIError` (400 or 422) says what is wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(body, strict=True)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        extra = [e for e in errs if e["type"] == "extra_forbidden"]
        if extra:
            name = ".".join(str(x) for x in extra[0]["loc"])
            raise APIError(400, f"Unrecognized request argument supplied: {name}", name,
                           "unrecognized_argument") from None
        first = errs[0]
        loc = [str(x) for x in first["loc"]]
        param = loc[0] if loc else None
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc'][:1]) or 'body'}: {e['msg']}" for e in errs[:3])
        raise APIError(422, f"invalid request: {msgs}", param, "invalid_type"
                       if "type" in first["type"] else "invalid_value") from None
    bad = req.unsupported()
    if bad is not None:
        raise APIError(400, bad[1], bad[0], "unsupported_parameter")
    return req


# -- prompts -----------------------------------------------------------------------------------

def prompt_ids(req: CompletionRequest, tok: Tokenizer) -> list[int]:
    """The completion prompt as token ids: text, ids, or a batch of one of either."""
    p: Any = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, "batches of prompts are not supported: send one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
        return tok.encode(p)
    if not p:
        raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
    bad = [t for t in p if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})", "prompt",
                       "invalid_token_id")
    return list(p)


def plain_chat_text(messages: Sequence[tuple[str, str]]) -> str:
    """The plain chat template: ``"<role>: <content>\\n"`` per message, then ``"assistant:"``."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def render_chat(req: ChatRequest, tok: Tokenizer) -> list[int]:
    """Chat messages as prompt ids: the checkpoint's chat template if it has one, else the plain one."""
    msgs = [(m.role, m.text()) for m in req.messages]
    if isinstance(tok, HFTokenizer) and getattr(tok.tok, "chat_template", None):
        ids = tok.tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True,
                                          tokenize=True)
        return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]  # a BatchEncoding
    return tok.encode(plain_chat_text(msgs))


def sampling_params(req: Req, prompt_len: int, max_model_len: int, default_max: Optional[int],
                    vocab_size: Optional[int] = None) -> SamplingParams:
    """Sampling parameters, with ``max_tokens`` checked against the context length before any work.

    ``default_max`` None: the rest of the context; else that many, capped by the context (completions:
    16; chat: the proxy's ``chat_max_tokens``, 512 by default, since a request reserves its whole
    ``max_tokens`` of KV up front). ``stop_token_ids`` are kept once each (the workers take bodies of
    at most the whole vocabulary as stop tokens) and, given ``vocab_size``, must be in the vocabulary.
    """
    param = "max_tokens"
    mt = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        mt, param = req.max_completion_tokens, "max_completion_tokens"
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {prompt_len} tokens, which leaves no room for any output. Please reduce "
                            f"the length of the prompt.", "messages" if isinstance(req, ChatRequest) else "prompt",
                       "context_length_exceeded")
    if mt is None:
        mt = max_model_len - prompt_len if default_max is None else min(default_max, max_model_len - prompt_len)
    if prompt_len + mt > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + mt} tokens ({prompt_len} in the prompt, {mt} for the completion). "
                            f"Please reduce the length of the prompt or {param}.", param, "context_length_exceeded")
    top_k = req.top_k or 0
    stops = tuple(dict.fromkeys(req.stop_token_ids or ()))  # each once, in order
    if vocab_size is not None:
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            shown = str(bad[0]) if abs(bad[0]) < 10 ** 30 else "of over 30 digits"
            raise APIError(400, f"stop token id {shown} is outside the vocabulary [0, {vocab_size})",
                           "stop_token_ids", "invalid_token_id")
    return SamplingParams(max_tokens=mt, temperature=0.0 if req.temperature is None else req.temperature,
                          top_k=max(0, top_k), top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                          ignore_eos=req.ignore_eos, stop_token_ids=stops)


# -- responses ---------------------------------------------------------------------------------

@dataclass
class Job:
    """One request at the front door: what was asked and what came out so far."""

    rid: str
    kind: str                  # "completion" or "chat"
    ids: list[int]
    params: SamplingParams
    stream: bool
    usage: bool                # stream_options.include_usage
    m: RequestMetrics
    created: int
    out: list[int] = field(default_factory=list)
    reason: Optional[str] = None
    usage_every: bool = False  # stream_options.continuous_usage_stats (with include_usage)


def usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": len(job.ids), "completion_tokens": len(job.out),
            "total_tokens": len(job.ids) + len(job.out)}


def whole_response(job: Job, text: str, model: str) -> dict[str, Any]:
    """The non-streaming answer (``text`` is the decoded output)."""
    if job.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": job.reason, "token_ids": job.out}
    else:
        choice = {"index": 0, "text": text, "token_ids": job.out, "finish_reason": job.reason, "logprobs": None}
    m = job.m.to_dict()
    return {"id": job.rid, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created, "model": model, "choices": [choice], "usage": usage(job),
            "metrics": {k: m[k] for k in ("ttft", "tpot", "e2e", "queue_s", "prefill_s", "kv_transfer_s",
                                          "kv_bytes", "retries", "reprefills")}}


def chunk_response(job: Job, model: str, text: Optional[str], ids: list[int], reason: Optional[str],
                   first: bool = False) -> dict[str, Any]:
    """One streamed chunk (``text`` is the new text, ``ids`` the new tokens)."""
    if job.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason,
                                  "token_ids": ids}
    else:
        choice = {"index": 0, "text": text or "", "token_ids": ids, "finish_reason": reason, "logprobs": None}
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    c: dict[str, Any] = {"id": job.rid, "object": kind, "created": job.created, "model": model,
                         "choices": [choice]}
    if job.usage:
        c["usage"] = usage(job) if job.usage_every else None
    return c
