"""The OpenAI API's request bodies as kiln reads them, and its error shape.

Requests are validated into :class:`GenerationRequest` (one shape for ``/v1/completions`` and
``/v1/chat/completions``); anything kiln cannot honour is refused with :class:`APIError` (status 4xx), never
silently ignored: ``n`` > 1, ``best_of``, ``suffix``, top-k alternatives beyond 1 in ``logprobs`` and
``top_logprobs``, tools, ``response_format`` other than text, ``logit_bias``. Fields the API defines that change
nothing here (``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` false) are accepted and
ignored. A field the API does not define is a 400 naming it, as OpenAI's own server answers ("Unrecognized request
argument supplied"), except the extensions benchmark and evaluation tools send (:data:`EXTENSIONS`, from the
recorded requests of AIPerf, guidellm and lm-eval in tests/fixtures/openai_tools): ``ignore_eos`` and
``min_tokens`` (vLLM's names), which are honoured through the Triton model's ``end_id`` (-1: no end token) and
``min_tokens`` inputs, or refused when the model has no such input. ``stream_options.continuous_usage_stats``
(vLLM's, which guidellm sends) puts the running ``usage`` in every streamed chunk. A chat role other than system,
developer, user and assistant is a 400.

Prompts are text or token ids (a list of ints, or a list holding one list of ints), as OpenAI accepts them.
``echo`` (completions) returns the prompt's tokens with their log-probabilities (and, with ``logprobs: 1``, the
top-1 alternative at each position) followed by at most one greedy token: the loglikelihood request lm-eval
sends (``max_tokens`` 0 or 1).

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

#: Top-level fields of OpenAI's completions and chat completions APIs kiln reads or accepts.
COMPLETIONS_FIELDS = frozenset({
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "user", "seed"})
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
    "user", "seed", "response_format", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "metadata", "store", "service_tier"})
#: Fields outside OpenAI's API that the tools send (vLLM's extension names): honoured or refused, never ignored.
EXTENSIONS = frozenset({"ignore_eos", "min_tokens"})
#: Chat roles a message may have (``tool`` is refused separately: no tool calls).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


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
    prompt_ids: list[int] | None = None  # a token-id prompt (as sent)
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's; guidellm sends it): usage per chunk
    logprobs: bool = False
    top_logprobs: int = 0  # completions with echo: the top-1 alternative at each position
    echo: bool = False
    ignore_eos: bool = False
    min_tokens: int | None = None
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


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompt(value: Any, name: str) -> str | list[int]:
    """A text prompt, or a token-id prompt (a list of ints, or a batch holding one)."""
    if isinstance(value, str):
        return value
    if _is_ids(value):
        return list(value)
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_ids(value[0])):
        return value[0] if isinstance(value[0], str) else list(value[0])  # a one-prompt batch
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise bad(f"{name}: one prompt per request (n=1); send the prompts as separate requests", name)
    raise bad(f"{name} must be a string, a list of token ids, or a list holding one of either", name)


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
        if m["role"] not in CHAT_ROLES:
            raise bad(f"messages[{i}].role: {m['role']!r} is not a role; use one of "
                      f"{', '.join(sorted(CHAT_ROLES - {'tool'}))}", f"messages[{i}].role")
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
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETIONS_FIELDS) - EXTENSIONS)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the id that GET /v1/models lists", "model")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad(f"n={n} is not supported: one choice per request (n=1)", "n")
    if _int(body, "best_of", 1) not in (None, 1):
        raise bad("best_of is not supported (only 1)", "best_of")
    if body.get("suffix"):
        raise bad("suffix is not supported: kiln serves left-to-right completion (no insertion)", "suffix")
    echo = body.get("echo") or False
    if not isinstance(echo, bool) or (echo and chat):
        raise bad("echo must be true or false (completions only)", "echo")
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos must be true or false", "ignore_eos")
    min_tokens = _int(body, "min_tokens", 0)
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
        if top and top > 1:
            raise bad(f"logprobs={top}: only the top-1 alternative is computed (logprobs 0 or 1)", "logprobs")
        if top == 1 and not echo:
            raise bad("logprobs: 1 (the top-1 alternative) is served with echo (prompt scoring); for generated "
                      "tokens send logprobs: 0", "logprobs")
        logprobs = top is not None
        max_tokens = _int(body, "max_tokens", 0 if echo else 1)
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        if echo and max_tokens > 1:
            raise bad(f"echo with max_tokens={max_tokens}: echo scores the prompt and returns at most one greedy "
                      "token (max_tokens 0 or 1, as lm-eval's loglikelihood requests send)", "max_tokens")
    seed = _int(body, "seed", 0, 2**64 - 1)
    explicit = frozenset(k for k in ("temperature", "top_p", "seed", "min_tokens") if body.get(k) is not None)
    req = GenerationRequest(
        chat=chat, model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0), seed=seed, stop=stops, stream=stream,
        include_usage=bool(options.get("include_usage")) and stream, logprobs=logprobs, explicit=explicit,
        continuous_usage=bool(options.get("continuous_usage_stats")) and stream,
        echo=echo, ignore_eos=ignore_eos, min_tokens=min_tokens,
    )
    if not chat and logprobs:
        req.top_logprobs = int(body["logprobs"])
    if echo and stream:
        raise bad("echo is not served streamed: send stream false", "stream")
    if echo and max_tokens == 1 and not req.greedy:
        raise bad("echo with max_tokens 1 returns the greedy token: send temperature 0 (or max_tokens 0)",
                  "temperature")
    if req.top_p == 0.0:
        raise bad("top_p must be greater than 0", "top_p")
    if chat:
        req.messages = _messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        prompt = _prompt(body["prompt"], "prompt")
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_ids = prompt
    return req
