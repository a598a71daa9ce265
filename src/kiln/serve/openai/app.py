"""The ASGI app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent events
ending with ``data: [DONE]``, or one JSON body) and ``/health``, in front of a Triton model (see :mod:`.backend`).

Response text. The Triton model streams deltas; the app forwards them, except that text which could be the start
of a ``stop`` sequence is held back until it is known not to be one: the returned text never contains a stop
sequence (OpenAI's rule; Triton's own ``stop_words`` keep it), and when one appears the Triton request is
cancelled and ``finish_reason`` is ``stop``. ``finish_reason`` is ``length`` when ``max_tokens`` tokens came back.

Usage. ``prompt_tokens``/``completion_tokens`` are the model's own counts (``num_input_tokens`` /
``num_output_tokens``, summed over streamed responses) when the Triton model reports them, as kiln's ensemble and
BLS do; otherwise they are counted with the repository's tokenizer (0 without one).

Log-probs (``logprobs`` true for chat, ``logprobs: 0`` for completions) are the chosen tokens' log-probabilities
the model returns (``output_log_probs``); a response carrying several tokens (a UTF-8 character spread over
tokens) gives its text to the last of them.

Token-id prompts are decoded with the repository's tokenizer and sent as text (the ensemble's contract takes text):
they are served when preprocessing's tokenization of that text gives back exactly the ids sent (after the special
tokens it adds itself, e.g. BOS), and refused naming the first position that differs otherwise; ids outside the
vocabulary are refused naming them. ``echo`` requests (prompt scoring) send the ids themselves to the model that
scores them (:meth:`~.backend.TritonBackend.score`) and answer as OpenAI's legacy completions API did: ``tokens``,
``token_logprobs`` (None for the first token), ``top_logprobs`` (the argmax alternative per position, with
``logprobs: 1``) and ``text_offset`` over the prompt and at most one greedy token.

Errors are OpenAI-shaped (:class:`~.protocol.APIError`): a bad request or a request the model refuses gets a
400 with the reason before any event is sent; an error after the stream started is sent as a last ``error``
event. A client that goes away mid-stream cancels the Triton request.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.serve.openai.backend import Chunk, TritonBackend
from kiln.serve.openai.chat import ChatTemplate, ChatTemplateError, load_chat_template
from kiln.serve.openai.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, APIError, GenerationRequest, bad, parse_request


def front_refusal(repo: Path, info: dict[str, Any]) -> str | None:
    """Why kiln's OpenAI front cannot serve ``repo`` (None when it can): it speaks the Triton ensemble's contract,
    which a target-pytorch repository (Triton's llmapi model) does not have; every request would answer 503."""
    if info.get("layout") != "llmapi":
        return None
    name = info.get("recipe") or repo.name
    return (f"{repo} is a target-pytorch repository (Triton's llmapi model), and kiln's OpenAI front speaks the "
            "ensemble's contract, which it does not have. Its OpenAI endpoints are trtllm-serve "
            f"(deploy/{name}/trtllm-serve/serve.sh on a GPU host) and Dynamo's frontend (deploy/{name}/dynamo/, or "
            f"here `kiln serve {repo} --stack dynamo`, in front of kiln's CPU reference worker); serve it without "
            "--openai for Triton's own HTTP/gRPC endpoints")


@dataclass
class ModelInfo:
    """What the server knows about the model behind Triton (from the packaged repository, when there is one)."""

    name: str
    template: ChatTemplate | None = None
    tokenizer: Any = None  # tokenizers.Tokenizer
    max_seq_len: int | None = None
    context_logits: bool | None = None  # whether the engine keeps prompt logits (None: unknown, no repository)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_repository(cls, repo: Path | None, triton_model: str, name: str | None = None) -> ModelInfo:
        """Name (the recipe's), chat template, tokenizer and max_seq_len from a kiln repository, where given."""
        if repo is None:
            return cls(name=name or triton_model)
        repo = Path(repo)
        info = json.loads((repo / "kiln.json").read_text()) if (repo / "kiln.json").is_file() else {}
        refused = front_refusal(repo, info)
        if refused:
            from kiln.util.errors import InputError

            raise InputError(refused)
        tok_dir = repo / "preprocessing" / "1" / "tokenizer"
        tokenizer = None
        if (tok_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        return cls(name=name or info.get("recipe") or repo.name, template=load_chat_template(tok_dir),
                   tokenizer=tokenizer, max_seq_len=(info.get("engine") or {}).get("max_seq_len"),
                   context_logits=_gathers_context_logits(repo, info))

    def count(self, text: str, special: bool) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=special).ids) if self.tokenizer else 0

    def check_ids(self, ids: list[int]) -> None:
        """Refuse token ids outside the tokenizer's vocabulary (naming them), or any ids without a tokenizer."""
        if self.tokenizer is None:
            raise bad("token-id prompts need the served repository's tokenizer: start the server with the "
                      "repository (kiln serve --openai, or kiln openai --repo)", "prompt")
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise bad(f"prompt: token ids outside the vocabulary [0, {vocab}): {outside[:10]}", "prompt")

    def ids_to_text(self, ids: list[int]) -> str:
        """The text whose tokenization by preprocessing (special tokens added) is exactly ``ids``."""
        self.check_ids(ids)
        prefix = self.tokenizer.encode("", add_special_tokens=True).ids  # what preprocessing adds (e.g. BOS)
        body = ids[len(prefix):] if prefix and ids[: len(prefix)] == prefix else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        again = self.tokenizer.encode(text, add_special_tokens=True).ids
        if again != prefix + body:
            expected = prefix + body
            at = next((i for i, (a, b) in enumerate(zip(again, expected)) if a != b), min(len(again), len(expected)))
            raise bad(f"prompt: these token ids are not how this model's tokenizer encodes their text (they differ "
                      f"from position {at}); the served model takes text, so send the text, or ids the tokenizer "
                      "produced", "prompt")
        return text

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else ""


def _gathers_context_logits(repo: Path, info: dict[str, Any]) -> bool | None:
    """kiln.json's ``engine.gather_context_logits``, else the engine config's ``build_config`` (what the Triton
    backend reads); a repository with neither (older kiln, no engine config) says the engine lacks them."""
    recorded = (info.get("engine") or {}).get("gather_context_logits")
    if recorded is not None:
        return bool(recorded)
    cfg = repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    if cfg.is_file():
        return bool((json.loads(cfg.read_text()).get("build_config") or {}).get("gather_context_logits", False))
    return False if info else None


def echo_body(completion: Completion, ids: list[int], score: Any) -> dict[str, Any]:
    """The legacy completions answer to an echo request: the prompt's tokens (and at most one greedy token) with
    their log-probs and, with ``logprobs: 1``, the top-1 alternative at each position."""
    req, info = completion.req, completion.info
    n = len(ids)
    tokens = [info.token_text(t) for t in ids]
    lps: list[float | None] = [None] + [float(v) for v in score.log_probs[1:n]]
    tops: list[dict[str, float] | None] = [None] + [{info.token_text(score.top_ids[j]): float(score.top_log_probs[j])}
                                                    for j in range(1, n)]
    generated = completion.max_tokens == 1
    if generated:  # the greedy next token: the argmax after the whole prompt
        nxt = info.token_text(score.top_ids[n])
        tokens.append(nxt)
        lps.append(float(score.top_log_probs[n]))
        tops.append({nxt: float(score.top_log_probs[n])})
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if req.top_logprobs else None,
                "text_offset": offsets} if req.logprobs else None
    text = "".join(tokens) if req.prompt_ids is not None else req.prompt + (tokens[-1] if generated else "")
    body = completion._envelope([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
                                chunk=False)
    body["usage"] = {"prompt_tokens": n, "completion_tokens": int(generated), "total_tokens": n + int(generated)}
    return body


class StopCutter:
    """Cuts the text at the first stop sequence; holds back a tail that may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Completion:
    """One request's running state: text, counts, log-probs, and the OpenAI objects it turns into."""

    def __init__(self, req: GenerationRequest, info: ModelInfo, prompt: str, max_tokens: int) -> None:
        self.req, self.info, self.prompt, self.max_tokens = req, info, prompt, max_tokens
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.cutter = StopCutter(req.stop)
        self.text = ""
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.tokens: list[tuple[str, float]] = []
        self.chunks = 0
        # a text chunk without log-probs is the same JSON but for its text: pre-rendered around it
        envelope = json.dumps(self._envelope([{"index": 0, "logprobs": None, "finish_reason": None}], chunk=True),
                              ensure_ascii=False)
        head = envelope[: -len("}]}")] + (', "delta": {"content": ' if req.chat else ', "text": ')
        self._head, self._tail = b"data: " + head.encode("utf-8"), (b"}}]}\n\n" if req.chat else b"}]}\n\n")

    def add(self, chunk: Chunk) -> tuple[str, list[tuple[str, float]]]:
        """Take a Triton response; return the text to send now and its (token, logprob) pairs."""
        if chunk.input_tokens is not None:
            self.input_tokens = chunk.input_tokens
        if chunk.output_tokens is not None:
            self.output_tokens = (self.output_tokens or 0) + chunk.output_tokens
        self.chunks += bool(chunk.text)
        piece = self.cutter.feed(chunk.text)
        pairs = [("", lp) for lp in chunk.logprobs[:-1]] + ([(chunk.text, chunk.logprobs[-1])] if chunk.logprobs else [])
        self.tokens += pairs
        self.text += piece
        return piece, pairs

    def finish(self) -> str:
        rest = "" if self.cutter.stopped else self.cutter.flush()
        self.text += rest
        return rest

    @property
    def finish_reason(self) -> str:
        if self.cutter.stopped:
            return "stop"
        return "length" if self.usage()["completion_tokens"] >= self.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.input_tokens if self.input_tokens is not None else self.info.count(self.prompt, True)
        if self.output_tokens is not None:
            completion = self.output_tokens
        elif self.tokens:
            completion = len(self.tokens)
        elif self.info.tokenizer is not None:
            completion = self.info.count(self.text, False)
        else:
            completion = self.chunks
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, pairs: list[tuple[str, float]], offset: int = 0) -> Any:
        if not self.req.logprobs:
            return None
        if self.req.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                for t, lp in pairs]}
        offsets, at = [], offset
        for t, _ in pairs:
            offsets.append(at)
            at += len(t)
        return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs], "top_logprobs": None,
                "text_offset": offsets}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.req.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.info.name, "choices": choices}

    def chunk(self, text: str | None, pairs: list[tuple[str, float]], finish: str | None = None,
              role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(pairs, len(self.text) - len(text or "")) if
                                  pairs else None, "finish_reason": finish}
        if self.req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._envelope([choice], chunk=True)

    def text_event(self, text: str) -> bytes:
        """The SSE event of a text chunk without log-probs (the common case, pre-rendered)."""
        return self._head + json.dumps(text, ensure_ascii=False).encode("utf-8") + self._tail

    def whole(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(self.tokens), "finish_reason": self.finish_reason}
        if self.req.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        body = self._envelope([choice], chunk=False)
        body["usage"] = self.usage()
        return body


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def create_app(backend: TritonBackend, info: ModelInfo) -> Any:
    """The Starlette app serving ``info.name`` through ``backend``; the backend opens and closes with the app."""
    import contextlib

    import asyncio

    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def model_object() -> dict[str, Any]:
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "kiln"}

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def model(request: Request) -> Response:
        if request.path_params["model"] != info.name:
            raise APIError(404, f"the model {request.path_params['model']!r} does not exist; this server serves "
                                f"{info.name!r}", param="model", code="model_not_found")
        return JSONResponse(model_object())

    async def health(_: Request) -> Response:
        ok = await backend.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    def prepare(req: GenerationRequest) -> tuple[str, int]:
        if req.model != info.name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {info.name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        if not req.chat:
            if req.prompt_ids is not None and not req.echo:
                req.prompt = info.ids_to_text(req.prompt_ids)
            return req.prompt, req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        if info.template is None:
            raise bad(f"the model {info.name!r} has no chat template (its tokenizer defines none), so it cannot "
                      "serve chat completions; use /v1/completions with your own prompt format", "messages",
                      code="chat_template_missing")
        try:
            prompt = info.template.render(req.messages)
        except ChatTemplateError as exc:
            raise bad(str(exc), "messages") from None
        if req.max_tokens is not None:
            return prompt, req.max_tokens
        if info.max_seq_len and info.tokenizer is not None:  # what fits the model, as other servers default to
            return prompt, max(1, info.max_seq_len - info.count(prompt, True))
        return prompt, COMPLETIONS_DEFAULT_MAX_TOKENS

    class Generate:
        """``POST /v1/completions`` or ``/v1/chat/completions`` as a plain ASGI app (no Request/Response objects
        on the hot path): errors before the first event propagate to the app's OpenAI error handlers."""

        def __init__(self, chat: bool) -> None:
            self.chat = chat

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            raw = b""
            while True:
                message = await receive()
                raw += message.get("body", b"")
                if not message.get("more_body"):
                    break
            req = parse_request(raw, self.chat)
            prompt, max_tokens = prepare(req)
            done = Completion(req, info, prompt, max_tokens)
            if req.echo:
                if req.prompt_ids is not None:
                    info.check_ids(req.prompt_ids)
                    ids = req.prompt_ids
                elif info.tokenizer is not None:
                    ids = info.tokenizer.encode(prompt, add_special_tokens=True).ids  # as preprocessing does
                else:
                    raise bad("echo needs the served repository's tokenizer: start the server with the repository",
                              "echo")
                await JSONResponse(echo_body(done, ids, await backend.score(ids, info.context_logits)))(scope, receive, send)
                return
            gen = backend.generate(req, prompt, max_tokens)
            if not req.stream:
                try:
                    async for chunk in gen:
                        done.add(chunk)
                        if done.cutter.stopped:
                            break
                finally:
                    await gen.aclose()
                done.finish()
                await JSONResponse(done.whole())(scope, receive, send)
                return
            try:
                first = await gen.__anext__()  # errors before the first event are plain 4xx responses
            except StopAsyncIteration:
                first = Chunk(final=True)
            except BaseException:
                await gen.aclose()
                raise
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            task = asyncio.current_task()
            gone = asyncio.Event()

            async def until_disconnect() -> None:  # uvicorn drops what is sent after a disconnect: watch for it
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()
                task.cancel()

            watcher = asyncio.ensure_future(until_disconnect())
            try:
                async for data in events(done, first, gen):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise
                # the client went away: events() closed the Triton request on its way out; nothing more to send
            finally:
                watcher.cancel()

    async def events(done: Completion, first: Chunk, gen: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        try:
            if done.req.chat:
                yield _sse(done.chunk(None, [], role=True))
            chunk: Chunk | None = first
            while chunk is not None:
                text, pairs = done.add(chunk)
                if pairs or (text and done.req.continuous_usage):
                    event = done.chunk(text, pairs)
                    if done.req.continuous_usage:
                        event["usage"] = done.usage()
                    yield _sse(event)
                elif text:
                    yield done.text_event(text)
                if done.cutter.stopped or chunk.final:
                    break
                chunk = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except APIError as exc:
            yield _sse(exc.body())
            yield b"data: [DONE]\n\n"
            return
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()  # cancels the Triton request if it is still running (client gone, stop)
        rest = done.finish()
        yield _sse(done.chunk(rest, [], finish=done.finish_reason))
        if done.req.include_usage:
            final = done._envelope([], chunk=True)
            final["usage"] = done.usage()
            yield _sse(final)
        yield b"data: [DONE]\n\n"

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        await backend.open()
        try:
            yield
        finally:
            await backend.close()

    routes = [
        Route("/v1/models", models), Route("/v1/models/{model:path}", model),
        Route("/v1/completions", Generate(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", Generate(chat=True), methods=["POST"]),
        Route("/health", health),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={APIError: api_error, HTTPException: http_error})
