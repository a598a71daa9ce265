"""Thin clients for a served kiln repository: gRPC streaming and the HTTP generate endpoint.

Both speak the ensemble's (and ``tensorrt_llm_bls``'s) input names: ``text_input``, ``max_tokens`` and the
optional sampling inputs below, passed as keyword arguments.

Example::

    for piece in generate_stream("127.0.0.1:8001", "Hello", 32, temperature=0.8, top_k=40, seed=1):
        print(piece, end="", flush=True)
    text = generate_http("http://127.0.0.1:8000", "Hello", 32)
"""

from __future__ import annotations

import codecs
import queue
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.util.errors import InputError, KilnError

#: Optional ensemble inputs: name -> Triton datatype. Lists of strings go to the BYTES word-list inputs.
SAMPLING_INPUTS: dict[str, str] = {
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "seed": "UINT64",
    "min_tokens": "INT32",
    "beam_width": "INT32",
    "end_id": "INT32",
    "pad_id": "INT32",
    "length_penalty": "FP32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "exclude_input_in_output": "BOOL",
    "return_log_probs": "BOOL",
    "num_draft_tokens": "INT32",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
}
_NUMPY = {"FP32": np.float32, "INT32": np.int32, "UINT64": np.uint64, "BOOL": np.bool_}


class GenerationError(KilnError):
    """The server refused or failed a generation request; the message is the server's."""


def _check_sampling(sampling: dict[str, Any]) -> None:
    unknown = sorted(set(sampling) - set(SAMPLING_INPUTS))
    if unknown:
        raise InputError(f"unknown generation option(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_INPUTS)}")


def _grpc_inputs(prompt: str, max_tokens: int, stream: bool, sampling: dict[str, Any]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    def make(name: str, datatype: str, value: np.ndarray) -> Any:
        tensor = grpcclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        return tensor

    inputs = [
        make("text_input", "BYTES", np.array([[prompt.encode("utf-8")]], dtype=np.object_)),
        make("max_tokens", "INT32", np.array([[max_tokens]], dtype=np.int32)),
        make("stream", "BOOL", np.array([[stream]], dtype=np.bool_)),
    ]
    for name, value in sampling.items():
        if value is None:
            continue
        datatype = SAMPLING_INPUTS[name]
        if datatype == "BYTES":
            words = [value] if isinstance(value, str) else list(value)
            array = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)
        else:
            array = np.array([[value]], dtype=_NUMPY[datatype])
        inputs.append(make(name, datatype, array))
    return inputs


def generate_stream(
    url_grpc: str,
    prompt: str,
    max_tokens: int,
    model: str = "ensemble",
    timeout_s: float = 300.0,
    **sampling: Any,
) -> Iterator[str]:
    """Stream generated text pieces from ``model`` over gRPC (the model, or the ensemble's, must be decoupled).

    Args:
        url_grpc: ``host:port`` of the server's gRPC endpoint.
        prompt: The prompt text.
        max_tokens: Tokens to generate at most.
        model: ``ensemble`` or ``tensorrt_llm_bls``.
        timeout_s: Longest wait for the next response.
        **sampling: Optional inputs, named as in ``SAMPLING_INPUTS`` (e.g. ``temperature``, ``top_k``, ``seed``).

    Yields:
        Text pieces in order; their concatenation is the completion. Bytes are decoded incrementally, so a
        character split across responses is still decoded whole.

    Raises:
        GenerationError: the server answered with an error (or nothing within ``timeout_s``).
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _check_sampling(sampling)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(result: Any = None, error: Any = None) -> None:  # tritonclient passes keyword arguments
        results.put((result, error))

    client = grpcclient.InferenceServerClient(url_grpc)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    finished = False
    try:
        client.start_stream(callback=callback)
        client.async_stream_infer(
            model,
            _grpc_inputs(prompt, max_tokens, True, sampling),
            request_id=uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerationError(f"no response from {model} at {url_grpc} within {timeout_s:.0f}s") from None
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                raise GenerationError(f"{model}: {message}")
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                piece = decoder.decode(b"".join(_as_bytes(t) for t in text.reshape(-1)))
                if piece:
                    yield piece
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                finished = True
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield tail
                return
    finally:
        try:
            client.stop_stream(cancel_requests=not finished)
        finally:
            client.close()


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def generate_http(
    url_http: str,
    prompt: str,
    max_tokens: int,
    model: str = "ensemble",
    timeout_s: float = 300.0,
    **sampling: Any,
) -> str:
    """Generate text with one ``POST /v2/models/<model>/generate`` (non-streaming; one response).

    Args:
        url_http: The server's HTTP URL, e.g. ``http://127.0.0.1:8000``.
        prompt, max_tokens, model, **sampling: as for :func:`generate_stream`.
        timeout_s: Request timeout.

    Raises:
        GenerationError: the server answered with an error status; the message is the server's.
    """
    import requests

    _check_sampling(sampling)
    body: dict[str, Any] = {"text_input": prompt, "max_tokens": max_tokens}
    for name, value in sampling.items():
        if value is not None:
            body[name] = [value] if SAMPLING_INPUTS[name] == "BYTES" and isinstance(value, str) else value
    url = f"{url_http.rstrip('/')}/v2/models/{model}/generate"
    try:
        resp = requests.post(url, json=body, timeout=timeout_s)
    except requests.RequestException as err:
        raise GenerationError(f"could not reach {url}: {err}") from err
    try:
        payload = resp.json()
    except ValueError:
        payload = {"error": resp.text}
    if resp.status_code != 200:
        raise GenerationError(f"{model} answered {resp.status_code}: {payload.get('error', payload)}")
    text = payload.get("text_output")
    if isinstance(text, list):
        text = "".join(text)
    if not isinstance(text, str):
        raise GenerationError(f"{model} answered without text_output: {payload}")
    return text
