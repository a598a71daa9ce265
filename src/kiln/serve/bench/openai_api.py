"""``kiln bench --openai URL``: the same load levels and report against any OpenAI-compatible server.

Each virtual client sends ``POST {url}/completions`` (``stream: true`` with ``stream_options.include_usage``, or
one JSON body with ``streaming`` off) over one shared HTTP connection pool (aiohttp: its C parser costs about
1 ms less CPU per request than httpx's pure-Python one, which would otherwise be measured as the server's
latency) and reads the server-sent events:
TTFT is the first event carrying text, each text event is a token-carrying response, E2E ends at ``[DONE]``.
Prompt tokens: the server's ``usage.prompt_tokens``, summed per level (``prompt_tokens``).
Output tokens: the server's ``usage.completion_tokens`` when it reports them (``token_basis`` ``"model"``;
events are then counted one token each, the last one taking the rest), else one per text event
(``"responses"``). Before the first level one short request checks the endpoint and the model and learns
which of the two applies. A server that stops answering ``GET {url}/models`` stops the run, as with Triton.

``cfg.model`` is the OpenAI model id (the first of ``GET {url}/models`` when ``BenchConfig.model`` is left at
its Triton default); ``cfg.sampling`` holds OpenAI fields, default ``{"temperature": 0}`` (greedy, like the
bench's Triton requests).
"""

from __future__ import annotations

import json
import time
from typing import Any

from kiln.serve.bench.config import BenchConfig, BenchError
from kiln.serve.bench.loadgen import PROBE_TIMEOUT_S, _Health
from kiln.serve.bench.stats import Outcome

_TRITON_DEFAULT_MODEL = BenchConfig.__dataclass_fields__["model"].default


class _HTTPHealth(_Health):
    """Liveness through ``GET {url}/models``."""

    def __init__(self, http: Any, url: str) -> None:
        import asyncio

        self._http = http
        self._url = f"{url}/models"
        self._lock = asyncio.Lock()
        self._last = None

    async def probe(self) -> tuple[str | None, bool]:
        import asyncio

        import aiohttp

        try:
            async with self._http.get(self._url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                status = resp.status
        except aiohttp.ClientConnectorError as exc:
            return f"cannot connect: {exc}", True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}", False
        return (None, False) if status < 500 else (f"GET /models answered {status}", False)


class OpenAISession:
    """An HTTP connection pool to the server, the model id and the request body shared by all levels."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.prompts = cfg.prompt_list()
        self.url = cfg.url.rstrip("/")
        self.model = cfg.model
        self.http: Any = None
        self.health: _HTTPHealth
        self.usage_reported = False

    async def open(self) -> None:
        import asyncio

        import aiohttp

        levels = max([int(level.value) for level in self.cfg.levels()] + [1])
        limit = max(levels, self.cfg.max_outstanding if self.cfg.rate is not None else 1) + 8
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                          timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, connect=10))
        self.health = _HTTPHealth(self.http, self.url)
        try:
            async with self.http.get(f"{self.url}/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                status, models = resp.status, (await resp.json(content_type=None) if resp.status == 200 else {})
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise BenchError(f"cannot reach the OpenAI-compatible server at {self.url} ({exc}); pass its base URL, "
                             "e.g. http://127.0.0.1:9000/v1") from exc
        ids = [m.get("id") for m in (models.get("data") or [])] if isinstance(models, dict) else []
        if self.model == _TRITON_DEFAULT_MODEL or not self.model:
            if not ids:
                raise BenchError(f"GET {self.url}/models lists no model ({status}); pass --model")
            self.model = ids[0]
        probe = await self.client("probe").request(self.prompts[0], max_tokens=1)
        if probe.error:
            raise BenchError(f"the OpenAI-compatible server at {self.url} refused a request for model "
                             f"{self.model!r}: {probe.error}")

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None

    def token_basis(self) -> str:
        return "model" if self.usage_reported else ("responses" if self.cfg.streaming else "unknown")

    def client(self, name: str) -> _OpenAIClient:
        return _OpenAIClient(self, name)

    def describe(self) -> dict[str, Any]:
        return {"name": self.model, "api": "openai", "url": self.url, "token_basis": self.token_basis()}

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                **(self.cfg.sampling or {"temperature": 0})}
        if self.cfg.streaming:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


class _OpenAIClient:
    """One request at a time, like the gRPC virtual clients."""

    def __init__(self, session: OpenAISession, name: str) -> None:
        self.session = session
        self.name = name

    async def close(self) -> None:
        pass

    async def settle(self, o: Outcome) -> None:
        import asyncio

        if o.error_kind == "stream":
            await self.session.health.confirm()
            await asyncio.sleep(0.05)

    async def request(self, prompt: str, max_tokens: int | None = None) -> Outcome:
        """Send one request and read it to its end; failures are in the outcome, not raised."""
        import asyncio

        import aiohttp

        s = self.session
        o = Outcome(prompt=prompt, t_send=time.perf_counter(), t_end=0.0)
        try:
            await self._exchange(s.body(prompt, max_tokens or s.cfg.output_len), o)
        except asyncio.TimeoutError:
            o.error_kind, o.error = "timeout", f"not finished after {s.cfg.request_timeout_s:g}s"
        except (aiohttp.ClientError, ValueError) as exc:
            o.error_kind, o.error = "stream", f"{type(exc).__name__}: {exc}"
        if not o.t_end:
            o.t_end = time.perf_counter()
        return o

    async def _exchange(self, body: dict[str, Any], o: Outcome) -> None:
        s = self.session
        o.t_send = time.perf_counter()
        async with s.http.post(f"{s.url}/completions", json=body) as resp:
            if resp.status >= 400:
                raw = await resp.read()
                o.t_end = time.perf_counter()
                o.error_kind, o.error = "model", f"HTTP {resp.status}: {_message(raw)}"
                return
            if not body.get("stream"):
                data = json.loads(await resp.read())
                o.t_end = o.t_first = time.perf_counter()
                o.text = "".join(c.get("text") or "" for c in data.get("choices") or [])
                o.token_times.append(o.t_end)
                o.token_counts.append(self._usage(data, o) or 0)
                return
            chunks: list[str] = []
            async for raw_line in resp.content:
                if not raw_line.startswith(b"data:"):
                    continue
                payload = raw_line[5:].strip().decode("utf-8")
                now = time.perf_counter()
                if payload == "[DONE]":
                    o.t_end = now
                    break
                event = json.loads(payload)
                if "error" in event:
                    o.t_end = now
                    o.error_kind, o.error = "model", _message(json.dumps(event).encode())
                    return
                text = "".join(c.get("text") or "" for c in event.get("choices") or [])
                if text:
                    o.t_first = o.t_first if o.t_first is not None else now
                    o.token_times.append(now)
                    o.token_counts.append(1)
                    chunks.append(text)
                used = self._usage(event, o)
                if used is not None and o.token_counts:  # the server's count: the last event takes the rest
                    o.token_counts[-1] = max(1, used - (len(o.token_counts) - 1))
            else:
                o.t_end = time.perf_counter()
                o.error_kind, o.error = "stream", "the server ended the stream without data: [DONE]"
            o.text = "".join(chunks)

    def _usage(self, data: dict[str, Any], o: Outcome | None = None) -> int | None:
        usage = data.get("usage")
        if o is not None and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            o.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.session.usage_reported = True
            return usage["completion_tokens"]
        return None


def _message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        return str((data.get("error") or {}).get("message") or data)
    except ValueError:
        return raw.decode("utf-8", errors="replace")[:300]

