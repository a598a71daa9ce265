"""``kiln bench`` settings: what to load, how hard and with what (:class:`BenchConfig`), its load levels, and
the error the bench stops with (:class:`BenchError`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.serve.bench.prompts import synthetic_prompts
from kiln.util.errors import InputError, KilnError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kiln.serve.bench.report import BenchReport

#: The upstream optional token-count tensors (ensemble, tensorrt_llm and BLS).
COUNT_REQUEST_TENSOR = "return_num_output_tokens"
COUNT_TENSOR = "num_output_tokens"

#: Triton data types of the ensemble's optional sampling inputs (GUIDE §3); other names are typed by value.
SAMPLING_DTYPES: dict[str, str] = {
    "top_k": "INT32",
    "beam_width": "INT32",
    "num_return_sequences": "INT32",
    "min_tokens": "INT32",
    "end_id": "INT32",
    "pad_id": "INT32",
    "top_p": "FP32",
    "temperature": "FP32",
    "length_penalty": "FP32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "seed": "UINT64",
    "exclude_input_in_output": "BOOL",
    "return_log_probs": "BOOL",
    "return_context_logits": "BOOL",
    "return_generation_logits": "BOOL",
    "bad_words": "BYTES",
    "stop_words": "BYTES",
}
_NUMPY_DTYPES = {"INT32": "int32", "UINT64": "uint64", "INT64": "int64", "FP32": "float32", "BOOL": "bool"}


class BenchError(KilnError):
    """The bench could not run or had to stop (server unreachable or died, model missing, bad contract).

    ``report`` holds the levels finished before the failure (``None`` when none finished).
    """

    def __init__(self, message: str, report: BenchReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Level:
    """One load level: ``mode`` ``"concurrency"`` (``value`` clients) or ``"rate"`` (``value`` requests/s)."""

    mode: Literal["concurrency", "rate"]
    value: float

    @property
    def label(self) -> str:
        """Short name used in tables, CSV and plots: ``c16`` or ``r12.5/s``."""
        return f"c{int(self.value)}" if self.mode == "concurrency" else f"r{self.value:g}/s"


@dataclass(frozen=True)
class BenchConfig:
    """What to load, how hard, and with what.

    Attributes:
        url: The server's gRPC address, ``host:port`` (``TritonServer.urls()["grpc"]``).
        model: The model to call: ``ensemble`` or ``tensorrt_llm_bls`` (same tensor contract).
        concurrency: Fixed-concurrency levels, run in order (ignored when ``rate`` is set).
        rate: Requests per second for an open-loop run (one level) instead of fixed concurrency.
        poisson: With ``rate``: exponential inter-arrival times (seeded) instead of even spacing.
        max_outstanding: With ``rate``: the most requests in flight at once (streams in the pool).
        duration_s: How long each level issues new requests (in-flight ones then finish).
        max_requests: Stop a level after this many requests, even before ``duration_s``.
        prompts: The prompts, used in turn; ``None`` for synthetic prompts of ``input_len`` words.
        num_prompts: How many synthetic prompts to make when ``prompts`` is ``None``.
        input_len: Synthetic prompt length: in tokens of ``tokenizer_dir``'s tokenizer (the served model's), else
            in words (see :func:`synthetic_prompts`).
        tokenizer_dir: The served model's tokenizer folder (``tokenizer.json``), e.g. the repository's
            ``preprocessing/1/tokenizer``; ``kiln bench`` takes it from the running ``kiln serve``.
        output_len: ``max_tokens`` sent with every request.
        streaming: Send ``stream=true`` (one response per token). Off: one response per request; TTFT is then
            the whole latency and token figures need the model's token count.
        expected: Expected full output text per prompt (e.g. greedy references); a response whose text
            differs is a *mismatch*, counted as an error. Prompts without an entry are not checked.
        cumulative_output: Each streamed response carries the whole text so far (BLS ``accumulate_tokens``)
            rather than only the new text: the final text is then the last response's.
        record_outputs: Keep the first output text seen per prompt in ``LevelResult.outputs``.
        request_timeout_s: A request not finished this long after it was sent is an error (its stream is
            reset); it also bounds how long a level waits for in-flight requests after ``duration_s``.
        sampling: Extra input tensors sent with every request, e.g. ``{"temperature": 0.0, "top_k": 1}``;
            types follow the ensemble's contract (``top_k`` INT32, ``temperature`` FP32, ``seed`` UINT64, …).
        seed: Seed for synthetic prompts and Poisson arrivals.
        input_tensor, max_tokens_tensor, stream_tensor, output_tensor: The contract's tensor names.
        api: ``"triton"`` (gRPC streaming to a Triton model) or ``"openai"``: any OpenAI-compatible server (kiln's,
            vLLM, trtllm-serve, ...) through ``POST {url}/completions``; ``url`` is then its base URL
            (``http://host:port/v1``), ``model`` the model id (empty: the first of ``GET {url}/models``) and
            ``sampling`` OpenAI fields (default ``{"temperature": 0}``: greedy, as the Triton requests are).
    """

    url: str
    model: str = "ensemble"
    api: Literal["triton", "openai"] = "triton"
    concurrency: tuple[int, ...] = (1,)
    rate: float | None = None
    poisson: bool = False
    max_outstanding: int = 256
    duration_s: float = 20.0
    max_requests: int | None = None
    prompts: tuple[str, ...] | None = None
    num_prompts: int = 64
    input_len: int = 64
    output_len: int = 32
    streaming: bool = True
    expected: Mapping[str, str] | None = None
    cumulative_output: bool = False
    record_outputs: bool = False
    request_timeout_s: float = 60.0
    sampling: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    input_tensor: str = "text_input"
    max_tokens_tensor: str = "max_tokens"
    stream_tensor: str = "stream"
    output_tensor: str = "text_output"
    tokenizer_dir: str | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.api == "openai":
            if not self.url.startswith(("http://", "https://")):
                problems.append(f"an OpenAI-compatible server's url is its base URL, e.g. http://127.0.0.1:9000/v1, "
                                f"got {self.url!r}")
        elif not self.url or ":" not in self.url or "://" in self.url:
            problems.append(f"url must be the gRPC address as host:port (e.g. 127.0.0.1:8001), got {self.url!r}")
        elif not self.model:
            problems.append("model must name the model to call (ensemble or tensorrt_llm_bls)")
        if self.rate is None:
            if not self.concurrency:
                problems.append("concurrency needs at least one level (e.g. 1,4,16,64)")
            bad = [c for c in self.concurrency if not isinstance(c, int) or isinstance(c, bool) or c < 1]
            if bad:
                problems.append(f"concurrency levels must be integers >= 1, got {bad}")
        elif not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0):
            problems.append(f"rate must be a positive number of requests per second, got {self.rate!r}")
        if self.max_outstanding < 1:
            problems.append(f"max_outstanding must be >= 1, got {self.max_outstanding}")
        if not (self.duration_s > 0):
            problems.append(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            problems.append(f"max_requests must be >= 1 when set, got {self.max_requests}")
        if self.prompts is not None and (not self.prompts or not all(isinstance(p, str) for p in self.prompts)):
            problems.append("prompts must be a non-empty tuple of strings (or None for synthetic prompts)")
        if self.expected is not None:
            if self.prompts is None:
                problems.append("expected texts need the prompts they belong to: give prompts as well")
            elif not any(p in self.expected for p in self.prompts):
                problems.append("none of the prompts has an expected text (the expected keys must be the prompts)")
        if self.num_prompts < 1 or self.input_len < 1:
            problems.append("num_prompts and input_len must be >= 1")
        if self.output_len < 1:
            problems.append(f"output_len (max_tokens) must be >= 1, got {self.output_len}")
        if not (self.request_timeout_s > 0):
            problems.append(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        reserved = {self.input_tensor, self.max_tokens_tensor, self.stream_tensor, COUNT_REQUEST_TENSOR}
        if self.api == "openai":
            reserved = {"model", "prompt", "max_tokens", "stream", "stream_options"}
        clash = sorted(set(self.sampling) & reserved)
        if clash:
            problems.append(f"sampling must not set the bench's own inputs {clash}")
        for name, value in self.sampling.items() if self.api == "triton" else ():
            try:
                sampling_array(name, value)
            except (TypeError, ValueError) as exc:
                problems.append(f"sampling.{name}: {exc}")
        if problems:
            raise InputError("invalid bench settings:\n  - " + "\n  - ".join(problems))

    def levels(self) -> list[Level]:
        """The levels this configuration runs, in order."""
        if self.rate is not None:
            return [Level("rate", float(self.rate))]
        return [Level("concurrency", float(c)) for c in self.concurrency]

    def prompt_list(self) -> tuple[str, ...]:
        """The prompts requests cycle through (the given ones, or the synthetic set)."""
        if self.prompts is not None:
            return self.prompts
        tokenizer = None
        if self.tokenizer_dir is not None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))
        return tuple(synthetic_prompts(self.num_prompts, self.input_len, self.seed, tokenizer))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (prompts and expected texts summarised by count, not copied)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "prompts":
                out["prompts"] = None if value is None else f"{len(value)} given"
            elif f.name == "expected":
                out["expected"] = None if value is None else f"{len(value)} references"
            elif isinstance(value, Mapping):
                out[f.name] = dict(value)
            elif isinstance(value, tuple):
                out[f.name] = list(value)
            else:
                out[f.name] = value
        return out


def sampling_array(name: str, value: Any) -> Any:
    """A [1]-shaped numpy array for a sampling input, typed by the contract (or by the Python value)."""
    import numpy as np

    dtype = SAMPLING_DTYPES.get(name)
    if dtype is None:
        if isinstance(value, bool):
            dtype = "BOOL"
        elif isinstance(value, int):
            dtype = "INT32"
        elif isinstance(value, float):
            dtype = "FP32"
        elif isinstance(value, (str, bytes)):
            dtype = "BYTES"
        else:
            raise TypeError(f"unsupported value {value!r}; use a bool, int, float or string")
    if dtype == "BYTES":
        items = value if isinstance(value, (list, tuple)) else [value]
        return np.array([v.encode() if isinstance(v, str) else v for v in items], dtype=object), "BYTES"
    if isinstance(value, (list, tuple, dict, str, bytes)) or value is None:
        raise ValueError(f"expected one number for a {dtype} input, got {value!r}")
    if dtype == "BOOL" and not isinstance(value, (bool, int)):
        raise ValueError(f"expected true or false, got {value!r}")
    return np.array([value], dtype=_NUMPY_DTYPES[dtype]), dtype
