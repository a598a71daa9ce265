"""kiln's OpenAI-compatible server: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` in front
of a Triton model, for every target.

A small ASGI app (Starlette, served by uvicorn) that talks to Triton over gRPC streaming (tritonclient's
protocol on a ``grpc.aio`` channel; one stream per request, cancelled when the HTTP client goes away). It calls
a model with the ensemble's contract (``ensemble`` by default; ``tensorrt_llm_bls`` or any model with
``text_input``/``max_tokens`` -> ``text_output``) and reads the packaged repository, when given, for the served
model's name (the recipe's), its chat template and its tokenizer.

Run it with ``kiln serve RECIPE --openai`` (Triton and the app together) or ``kiln openai --triton-url
host:port --repo REPO`` (the app alone, e.g. as the sidecar the tensorrt target's deploy files run). Modules:
:mod:`.protocol` (requests, errors), :mod:`.chat` (chat templates), :mod:`.backend` (Triton),
:mod:`.app` (the routes).

Example::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:9000/v1", api_key="unused")
    out = client.completions.create(model="tiny-llama", prompt="def fibonacci(n):", max_tokens=32, temperature=0)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.serve.openai.app import ModelInfo, create_app
from kiln.serve.openai.backend import TritonBackend
from kiln.serve.openai.protocol import APIError

__all__ = ["APIError", "ModelInfo", "OpenAIConfig", "OpenAIServer", "TritonBackend", "build_app", "create_app"]


@dataclass(frozen=True)
class OpenAIConfig:
    """Where the app listens and what it serves.

    Attributes:
        triton_url: Triton's gRPC endpoint, ``host:port``.
        triton_model: The Triton model called (ensemble contract).
        repo: The packaged repository (kiln.json, preprocessing/1/tokenizer); None: no chat template, no tokenizer.
        model_name: The id in ``/v1/models``; default: the recipe's name from kiln.json, else ``triton_model``.
        host, port: Where the HTTP server binds.
    """

    triton_url: str
    triton_model: str = "ensemble"
    repo: Path | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 9000

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_app(cfg: OpenAIConfig) -> Any:
    """The ASGI app for ``cfg``."""
    info = ModelInfo.from_repository(cfg.repo, cfg.triton_model, cfg.model_name)
    return create_app(TritonBackend(cfg.triton_url, cfg.triton_model), info)


class OpenAIServer:
    """uvicorn serving :func:`build_app` in a background thread (``start``/``stop``), or in this one (``run``)."""

    def __init__(self, cfg: OpenAIConfig) -> None:
        import uvicorn

        self.cfg = cfg
        config = uvicorn.Config(build_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve in a thread (signals stay with the caller); returns once listening."""
        import time

        from kiln.util.errors import KilnError

        self._thread = threading.Thread(target=self._server.run, name="kiln-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise KilnError(f"the OpenAI server could not listen on {self.cfg.url} (port in use?)")
            time.sleep(0.02)

    def run(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM."""
        self._server.run()

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
