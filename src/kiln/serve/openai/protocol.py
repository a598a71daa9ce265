"""The OpenAI API's request bodies as kiln reads them, and its error shape.

Requests are validated into :class:`GenerationRequest` (one shape for ``/v1/completions`` and
``/v1/chat/completions``); anything kiln cannot honour is refused with :class:`APIError` (status 4xx), never
silently ignored: ``n`` > 1, ``best_of``, ``echo``, top-k alternatives in ``logprobs``/``top_logprobs``, tools,
``response_format`` other than text, ``logit_bias``. Fields the API defines that change nothing here (``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` false) are accepted and ignored, as are
fields the API does not define (as OpenAI's own server does).

Sampling follows the OpenAI API, not TensorRT-LLM's defaults: ``temperature`` and ``top_p`` default to 1, so a
request without them samples; ``temperature: 0`` is greedy (sent to Triton as ``top_k=1``, greedy on every
target).

Error bodies: ``{"error": {"message", "type", "param", "code"}}`` with ``type`` ``invalid_request_error`` (400,
404) or ``service_unavailable`` / ``server_error`` (503, 500), as the official SDK expects.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

#: OpenAI's default ``max_tokens`` for /v1/completions (chat defaults to what fits the model).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, offending parameter and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else
                             "service_unavailable" if status == 503 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """A completions or chat request, validated. ``prompt`` is set for completions, ``messages`` for chat."""

    chat: bool
    model: str
    prompt: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    explicit: frozenset[str] = frozenset()  # the sampling fields the client set itself

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"{name} must be a number, got {json.dumps(value)}", name)
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {json.dumps(value)}", name)
    if value < lo or (hi is not None and value > hi):
        raise bad(f"{name} must be {'at least ' + str(lo) if hi is None else f'between {lo} and {hi}'}, got {value}",
                  name)
    return value


def _text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]  # a one-prompt batch
    if isinstance(value, list) and len(value) > 1:
        raise bad(f"{name}: one prompt per request (n=1); send the prompts as separate requests", name)
    raise bad(f"{name} must be a string", name)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}].content: only text parts are supported (got {kind!r}); kiln serves "
                          "text-only models", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        if m.get("tool_calls") or m["role"] == "tool":
            raise bad("tool calls are not supported: kiln's OpenAI server serves plain text generation",
                      f"messages[{i}]")
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def parse_request(raw: bytes, chat: bool) -> GenerationRequest:
    """Validate a request body; raises :class:`APIError` (400) naming the parameter."""
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the id that GET /v1/models lists", "model")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad(f"n={n} is not supported: one choice per request (n=1)", "n")
    if _int(body, "best_of", 1) not in (None, 1):
        raise bad("best_of is not supported (only 1)", "best_of")
    if body.get("echo"):
        raise bad("echo is not supported: the completion never includes the prompt", "echo")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        raise bad("tools are not supported: kiln's OpenAI server serves plain text generation", "tools")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise bad(f"{name} is not supported (only 0)", name)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise bad("stop must be a string or a list of at most 4 strings", "stop")
    stops = [s for s in stops if s]
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise bad("logprobs must be true or false", "logprobs")
        if _int(body, "top_logprobs", 0, 20):
            raise bad("top_logprobs is not supported: the Triton model returns the chosen tokens' log-probabilities "
                      "only (send top_logprobs 0 or leave it out)", "top_logprobs")
        max_tokens = _int(body, "max_completion_tokens", 1)
        max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1)
    else:
        top = _int(body, "logprobs", 0, 5)
        if top:
            raise bad("logprobs > 0 (top alternatives) is not supported: the Triton model returns the chosen "
                      "tokens' log-probabilities only; send logprobs: 0", "logprobs")
        logprobs = top == 0
        max_tokens = _int(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    seed = _int(body, "seed", 0, 2**64 - 1)
    explicit = frozenset(k for k in ("temperature", "top_p", "seed") if body.get(k) is not None)
    req = GenerationRequest(
        chat=chat, model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0), seed=seed, stop=stops, stream=stream,
        include_usage=bool(options.get("include_usage")) and stream, logprobs=logprobs, explicit=explicit,
    )
    if req.top_p == 0.0:
        raise bad("top_p must be greater than 0", "top_p")
    if chat:
        req.messages = _messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        req.prompt = _text(body["prompt"], "prompt")
    return req
