"""A kiln worker for NVIDIA Dynamo: kiln's CPU reference runtime registered with Dynamo's runtime, the place
``python -m dynamo.trtllm`` takes on a GPU. A CPU TEST AND DEVELOPMENT VEHICLE, not a serving path.

``python -m kiln.serve.dynamo.worker --model-dir CHECKPOINT --served-model-name NAME [--llm-args FILE]``

It registers the model (token input; chat and completions) with ``dynamo.llm.register_model`` on the endpoint
``<namespace>.<component>.generate`` and serves it with ``Endpoint.serve_endpoint``: the frontend tokenizes (with the
checkpoint's tokenizer and chat template), routes a request here as ``{"token_ids", "stop_conditions",
"sampling_options", ...}``, and this worker streams back ``{"token_ids": [new tokens], "finish_reason": ...}`` deltas,
as dynamo.trtllm's handler does (dynamo/trtllm/request_handlers/handler_base.py in the ai-dynamo 1.6.1 wheel). A
client that goes away stops the generation (the request context's ``async_killed_or_stopped``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, AsyncIterator

log = logging.getLogger("kiln.dynamo.worker")

#: What this worker says about itself wherever a user meets it (logs, /v1/models' owner is Dynamo's).
VEHICLE = "kiln's CPU reference runtime behind Dynamo: a test and development vehicle, not a serving path"


def _reference_module(model_dir: str):
    """kiln's reference runtime: the copy the packaged repository serves with (beside model.yaml and the
    kiln_dequantize.json it reads, one directory above the checkpoint), else kiln's own."""
    path = Path(model_dir).resolve().parent / "kiln_llmapi_reference.py"
    if not path.is_file():
        path = Path(__file__).resolve().parents[2] / "triton" / "models" / "llmapi" / "kiln_llmapi_reference.py"
    spec = importlib.util.spec_from_file_location("kiln_llmapi_reference", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class Handler:
    """Dynamo's request → kiln reference runtime → Dynamo's response deltas."""

    def __init__(self, llm: Any, reference: Any) -> None:
        self.llm, self.ref = llm, reference
        self.active = 0

    def _params(self, request: dict) -> Any:
        stop = request.get("stop_conditions") or {}
        sampling = request.get("sampling_options") or {}
        kwargs: dict[str, Any] = {"max_tokens": int(stop.get("max_tokens") or 16)}
        for key in ("temperature", "top_k", "top_p", "seed"):
            if sampling.get(key) is not None:
                kwargs[key] = sampling[key]
        return self.ref.SamplingParams(**kwargs)

    async def generate(self, request: dict, context: Any) -> AsyncIterator[dict]:
        ids = request.get("token_ids") or []
        if not isinstance(ids, list):
            ids = list(ids)
        try:
            params = self._params(request)
            handle = self.llm.generate_async([int(i) for i in ids], sampling_params=params, streaming=True)
        except (ValueError, TypeError) as err:
            yield {"token_ids": [], "finish_reason": {"error": str(err)}}
            return
        self.active += 1
        log.info("request %s: %d prompt tokens, max_tokens %d (active %d)", context.id(), len(ids), params.max_tokens,
                 self.active)
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        sent, finished = 0, False
        try:
            async for out in handle:
                if stopped.done():
                    break
                o = out.outputs[0]
                new = list(o.token_ids[sent:])
                sent = len(o.token_ids)
                delta: dict[str, Any] = {"token_ids": new, "index": 0}
                if out.finished:
                    finished = True
                    delta["finish_reason"] = o.finish_reason or "stop"
                    delta["completion_usage"] = {"prompt_tokens": len(ids), "completion_tokens": sent,
                                                 "total_tokens": len(ids) + sent}
                yield delta
                if out.finished:
                    return
        except self.ref.ReferenceError as err:
            yield {"token_ids": [], "finish_reason": {"error": str(err)}}
        finally:
            if not finished:  # the client went away (or the stream was closed): stop the generation thread
                handle.abort()
                final = await _last_output(handle)
                o = final.outputs[0] if final is not None and final.outputs else None
                log.info("request %s: %s: the generation stopped with finish_reason %s after %d tokens", context.id(),
                         "cancelled by the client" if stopped.done() else "closed early",
                         o.finish_reason if o else "unknown", len(o.token_ids) if o else -1)
            stopped.cancel()
            self.active -= 1


async def _last_output(handle: Any, timeout_s: float = 30.0) -> Any:
    """The last output a request handle still delivers (its final one), or None when none comes in time."""
    last = None

    async def drain() -> None:
        nonlocal last
        async for out in handle:
            last = out

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - a failed request has no final output to report
        pass
    return last


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.serve.dynamo.worker", description=VEHICLE)
    p.add_argument("--model-dir", required=True, help="the unified checkpoint (with its tokenizer) the pytorch "
                   "target wrote")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--llm-args", help="a YAML/JSON file of LLM arguments (model.yaml's); those the reference "
                   "runtime does not apply are logged")
    p.add_argument("--chat-template", help="a Jinja chat template for the frontend (when the tokenizer has none)")
    p.add_argument("--namespace", default="kiln")
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"))
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    return p.parse_args(argv)


def _llm_args(path: str | None) -> dict:
    if not path:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return {k: v for k, v in data.items() if k not in ("triton_config", "model", "backend")}


async def _serve(args: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    reference = _reference_module(args.model_dir)
    llm = reference.ReferenceLLM(args.model_dir, num_threads=args.num_threads, **_llm_args(args.llm_args))
    log.info("%s; LLM arguments not applied on the CPU: %s", VEHICLE, ", ".join(llm.not_applied) or "none")
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery_backend, args.request_plane)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
    config = ModelRuntimeConfig()
    if llm.max_seq_len:
        config.context_length = int(llm.max_seq_len)
    config.max_num_seqs = 1  # one request at a time (the reference runtime's generation thread)
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, args.model_dir,
                         args.served_model_name, worker_type=WorkerType.Aggregated, runtime_config=config,
                         custom_template_path=args.chat_template)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    handler = Handler(llm, reference)
    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate))
    print(json.dumps({"kiln_dynamo_worker": "ready", "model": args.served_model_name,
                      "endpoint": f"{args.namespace}.{args.component}.{args.endpoint}"}), flush=True)
    await asyncio.wait([serving, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    runtime.shutdown()
    llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kiln-dynamo-worker %(levelname)s %(message)s")
    args = _parse(sys.argv[1:] if argv is None else argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
