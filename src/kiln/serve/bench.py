"""``kiln bench``'s engine: a streaming load generator for a served LLM (Triton ensemble or BLS).

Each *virtual client* owns one gRPC bidirectional stream (``ModelStreamInfer``) and has at most one request
in flight on it, so every response is attributed to its request without guessing. Two ways to load the server:

- **Fixed concurrency** (``BenchConfig.concurrency``, e.g. ``(1, 4, 16, 64)``): N clients each send a request,
  read its responses to the end, and send the next one (closed loop), one level after the other.
- **Request rate** (``BenchConfig.rate``): requests arrive on an open-loop schedule, evenly spaced or Poisson
  (seeded), whatever the server's speed; at most ``max_outstanding`` are in flight (a pool of streams). When
  the pool is exhausted an arrival waits for a free stream: that wait is reported as ``send_lag`` and not
  hidden in the latency figures, which are measured from the moment a request is sent.

What is measured, per request (``time.perf_counter``): **TTFT** from send to the first response that carries
text; **ITL** from each token-carrying response to the next, divided by the tokens that response carries;
**E2E** from send to the final response. Per level: p50/p90/p99 of each (ms), output tokens/s and requests/s
over the level's wall time (from its first send to its last completion), completed requests and errors.

Counting output tokens (``LevelResult.token_basis``):

- ``"model"``: the model declares the upstream optional tensors ``return_num_output_tokens`` (BOOL input)
  and ``num_output_tokens`` (INT32 output); the bench asks for them and sums the values over a request's
  responses (each streamed response reports the tokens it carries; a non-streamed one reports all of them).
- ``"responses"``: otherwise, in streaming mode, each response that carries text counts as one token (what
  the upstream ensemble and BLS send per generated token).
- ``"unknown"``: non-streaming without the model's count: token figures (tokens/s, ITL) are left empty
  rather than guessed.

Errors are counted by kind and never hidden: a model error response, a request that exceeds
``request_timeout_s``, a broken stream, and an output that differs from ``BenchConfig.expected`` (a
*mismatch*) all count as errors; the first messages are kept as samples. A server that dies mid-run is
detected by a liveness probe (after any broken stream, and every second by a watchdog), and the run stops
with :class:`BenchError` within a few seconds instead of hanging.

Decoupled models: a decoupled Python model (kiln's BLS, upstream's too) may end a request with a flags-only
final response. The bench sets the request parameter ``triton_enable_empty_final_response`` so that the
server turns it into an empty response marked ``triton_final_response``, the only reliable end-of-request
signal. tritonclient's asyncio ``stream_infer`` refuses ``triton_``-prefixed parameters, so requests are
built with tritonclient's generated gRPC protocol (``tritonclient.grpc.service_pb2``) on a ``grpc.aio``
channel instead; the wire format is exactly tritonclient's.

Example::

    cfg = BenchConfig(url="127.0.0.1:8001", concurrency=(1, 4, 16), duration_s=20)
    report = run_bench(cfg)
    report.write(Path("bench-out"))       # bench.json, bench.csv, bench.png
    print(format_report(report))
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import datetime as _dt
import hashlib
import io
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.util.errors import InputError, KilnError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kiln.plan import Plan

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchReport",
    "IdealComparison",
    "Level",
    "LevelResult",
    "PromptSet",
    "compare_with_plan",
    "format_comparison",
    "format_report",
    "load_prompts",
    "mock_expected_text",
    "run_bench",
    "run_bench_async",
    "run_level",
    "synthetic_prompts",
    "write_mock_repository",
]

#: How many error messages a level keeps as samples.
ERROR_SAMPLES = 5
#: Liveness probe: per-probe timeout, watchdog period, and how long probes may fail before the bench gives up.
PROBE_TIMEOUT_S = 2.0
WATCHDOG_PERIOD_S = 1.0
DEAD_AFTER_S = 4.0
#: Pause before a client opens a new stream after its stream broke (the server was live).
STREAM_RETRY_S = 0.05
#: gRPC message size limit (tritonclient's).
MAX_GRPC_MESSAGE_SIZE = 2**31 - 1
#: Request parameter asking Triton to send an empty response for a flags-only final response.
EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"
FINAL_PARAM = "triton_final_response"
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


class _ServerGone(Exception):
    """Internal: the liveness probe says the server is gone; carries the reason."""


# ============================================================================================== configuration


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
        input_len: Synthetic prompt length, in words (see :func:`synthetic_prompts`).
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
    """

    url: str
    model: str = "ensemble"
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

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.url or ":" not in self.url or "://" in self.url:
            problems.append(f"url must be the gRPC address as host:port (e.g. 127.0.0.1:8001), got {self.url!r}")
        if not self.model:
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
        clash = sorted(set(self.sampling) & reserved)
        if clash:
            problems.append(f"sampling must not set the bench's own inputs {clash}")
        for name, value in self.sampling.items():
            try:
                _sampling_array(name, value)
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
        return tuple(synthetic_prompts(self.num_prompts, self.input_len, self.seed))

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


# ============================================================================================== prompts

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which are this be or have had not "
    "one their were all but been they has more when will there would who its into time can only other new "
    "some could these two may first then do any like my now over such our man me even most made after also "
    "did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go "
    "came right used take three small place part found light water river city house music field story word"
).split()


def synthetic_prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``input_len`` common English words each, reproducible from ``seed``.

    Length is in words, which the server's tokenizer turns into roughly as many tokens (about one per
    common word for byte-level BPE vocabularies; more for small ones such as the built-in tiny model's).
    Each prompt starts with its index, so no two share a prefix beyond it (no accidental KV-cache reuse).
    """
    if n < 1 or input_len < 1:
        raise InputError(f"synthetic prompts need n >= 1 and input_len >= 1, got n={n}, input_len={input_len}")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [f"item{i}"] + [rng.choice(_WORDS) for _ in range(input_len - 1)]
        prompts.append(" ".join(words))
    return prompts


@dataclass(frozen=True)
class PromptSet:
    """Prompts read from a file, and the expected outputs the file gives for some of them (else ``None``)."""

    prompts: tuple[str, ...]
    expected: dict[str, str] | None = None


def load_prompts(path: Path) -> PromptSet:
    """Read prompts from ``path``.

    Formats: ``.jsonl`` (one JSON string per line, or an object with ``prompt`` — or ``text_input`` — and
    optionally ``expected``), ``.json`` (a list of strings or such objects, or an object mapping each prompt to
    its expected text), anything else plain text with one prompt per non-empty line.

    Raises:
        InputError: the file is missing, unreadable, malformed, or holds no prompt; the message names the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts file {path} is not UTF-8 text: {exc}") from exc
    prompts: list[str] = []
    expected: dict[str, str] = {}

    def add(item: Any, where: str) -> None:
        if isinstance(item, str):
            prompts.append(item)
            return
        if isinstance(item, dict):
            prompt = item.get("prompt", item.get("text_input"))
            if not isinstance(prompt, str):
                raise InputError(f"{where}: an object needs a string 'prompt' (or 'text_input') field")
            prompts.append(prompt)
            ref = item.get("expected")
            if ref is not None:
                if not isinstance(ref, str):
                    raise InputError(f"{where}: 'expected' must be a string")
                expected[prompt] = ref
            return
        raise InputError(f"{where}: expected a string or an object with 'prompt', got {type(item).__name__}")

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    add(json.loads(line), f"{path}:{no}")
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{no}: not valid JSON ({exc.msg})") from exc
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
        if isinstance(data, dict):
            for prompt, ref in data.items():
                if not isinstance(ref, str):
                    raise InputError(f"{path}: the expected text for prompt {prompt[:40]!r} must be a string")
                prompts.append(prompt)
                expected[prompt] = ref
        elif isinstance(data, list):
            for i, item in enumerate(data):
                add(item, f"{path}[{i}]")
        else:
            raise InputError(f"{path}: expected a list of prompts or an object mapping prompts to expected text")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"prompts file {path} holds no prompt")
    return PromptSet(tuple(prompts), expected or None)


# ============================================================================================== results


@dataclass
class LevelResult:
    """Figures for one level. Latencies in milliseconds; ``None`` where nothing was measured.

    ``errors`` counts every failed request, mismatches included (``error_kinds`` splits them: ``model``,
    ``timeout``, ``stream``, ``mismatch``). Token figures follow ``token_basis`` (see the module docstring).
    ``sent`` counts requests issued, ``completed`` those that ended well; ``responses`` the token-carrying
    responses received (final-only responses excluded). ``inconsistent`` counts completed requests whose
    text differs from the first text seen for the same prompt: not an error (sampling may be on), but with
    greedy decoding it should be 0. ``send_lag`` (rate levels): how late requests left against the schedule.
    """

    label: str
    mode: str
    concurrency: int | None
    rate: float | None
    duration_s: float
    sent: int
    completed: int
    errors: int
    mismatches: int
    error_kinds: dict[str, int]
    error_samples: list[str]
    token_basis: str
    output_tokens: int | None
    output_tokens_per_s: float | None
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    e2e_mean_ms: float | None
    responses: int
    inconsistent: int
    send_lag_p50_ms: float | None = None
    send_lag_p99_ms: float | None = None
    outputs: dict[str, str] | None = None

    #: Fields that are not one number (left out of the CSV).
    NON_SCALAR = ("error_kinds", "error_samples", "outputs")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        data = dataclasses.asdict(self)
        if data["outputs"] is None:
            del data["outputs"]
        return data

    def csv_row(self) -> dict[str, Any]:
        """Scalar figures for one CSV row (error kinds flattened as ``errors_<kind>``)."""
        row = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NON_SCALAR}
        for kind in ("model", "timeout", "stream", "mismatch"):
            row[f"errors_{kind}"] = self.error_kinds.get(kind, 0)
        return row


@dataclass
class BenchReport:
    """All levels of one run, with the settings and what was learned about the model's contract."""

    config: dict[str, Any]
    model: dict[str, Any]
    levels: list[LevelResult]
    started_at: str
    wall_s: float

    @property
    def total_errors(self) -> int:
        """Errors over all levels (mismatches included): a run with any is not a clean run."""
        return sum(level.errors for level in self.levels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready content."""
        return {
            "kiln_bench_version": 1,
            "started_at": self.started_at,
            "wall_s": self.wall_s,
            "config": self.config,
            "model": self.model,
            "total_errors": self.total_errors,
            "levels": [level.to_dict() for level in self.levels],
        }

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def to_csv(self) -> str:
        """One row per level, scalar figures only."""
        rows = [level.csv_row() for level in self.levels]
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue()

    def write(self, out_dir: Path, stem: str = "bench") -> dict[str, Path]:
        """Write ``<stem>.json``, ``<stem>.csv`` and ``<stem>.png`` into ``out_dir``; returns their paths."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"json": out_dir / f"{stem}.json", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
        paths["json"].write_text(self.to_json() + "\n", encoding="utf-8")
        paths["csv"].write_text(self.to_csv(), encoding="utf-8")
        plot_report(self, paths["png"])
        return paths


def plot_report(report: BenchReport, path: Path) -> None:
    """Throughput against latency across levels, one labelled point per level (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = report.levels
    title = f"kiln bench: {report.config.get('model')} @ {report.config.get('url')}"
    fig.suptitle(title)
    _plot_pairs(
        left, levels, "output_tokens_per_s", "output tokens/s", [("e2e_p50_ms", "E2E p50"), ("itl_p50_ms", "ITL p50")]
    )
    _plot_pairs(
        right, levels, "requests_per_s", "requests/s", [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")]
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_pairs(
    ax: Any, levels: Sequence[LevelResult], x_key: str, x_label: str, series: list[tuple[str, str]]
) -> None:
    plotted = False
    for key, name in series:
        pts = [
            (getattr(lv, x_key), getattr(lv, key), lv.label)
            for lv in levels
            if getattr(lv, x_key) is not None and getattr(lv, key) is not None and getattr(lv, key) > 0
        ]
        if not pts:
            continue
        plotted = True
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(x_label)
    ax.set_ylabel("latency (ms, log scale)" if plotted else "latency (ms)")
    if plotted:
        ax.set_yscale("log")  # TTFT/E2E and ITL differ by orders of magnitude
    ax.grid(True, alpha=0.3)
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: BenchReport) -> str:
    """A plain-text table of the report (one row per level) followed by error samples, if any."""
    head = (
        "level",
        "req/s",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "e2e p50",
        "e2e p99",
        "done",
        "errors",
    )
    rows = [head]
    for lv in report.levels:
        rows.append(
            (
                lv.label,
                _fmt(lv.requests_per_s),
                _fmt(lv.output_tokens_per_s),
                _fmt(lv.ttft_p50_ms),
                _fmt(lv.ttft_p99_ms),
                _fmt(lv.itl_p50_ms, 2),
                _fmt(lv.itl_p99_ms, 2),
                _fmt(lv.e2e_p50_ms),
                _fmt(lv.e2e_p99_ms),
                str(lv.completed),
                str(lv.errors),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    basis = {lv.token_basis for lv in report.levels}
    lines.append(f"(latencies in ms; output tokens counted from: {', '.join(sorted(basis))})")
    for lv in report.levels:
        if lv.errors:
            kinds = ", ".join(f"{k}={v}" for k, v in sorted(lv.error_kinds.items()))
            lines.append(f"{lv.label}: {lv.errors} errors ({kinds})")
            lines.extend(f"    {msg}" for msg in lv.error_samples)
    return "\n".join(lines)


# ============================================================================================== planner ideal


@dataclass(frozen=True)
class IdealComparison:
    """One measured figure next to the planner's ideal for it (``ratio`` = measured / ideal)."""

    level: str
    metric: str
    measured: float | None
    ideal: float
    ratio: float | None
    basis: str


def _decode_step(plan: Plan, batch: int) -> tuple[float, float] | None:
    """(step_ms, tokens/s) at ``batch``: the planner's point or a linear interpolation; None outside its range."""
    points = sorted(plan.limits.decode, key=lambda p: p.batch)
    for p in points:
        if p.batch == batch:
            return p.step_ms, p.tokens_per_s
    for lo, hi in zip(points, points[1:], strict=False):
        if lo.batch < batch < hi.batch:
            frac = (batch - lo.batch) / (hi.batch - lo.batch)
            step = lo.step_ms + frac * (hi.step_ms - lo.step_ms)
            return step, batch / (step / 1e3)
    return None


def compare_with_plan(report: BenchReport, plan: Plan) -> list[IdealComparison]:
    """Each level's figures against the planner's roofline ideal, where the planner has one.

    Fixed-concurrency levels only (a rate level has no fixed batch). Compared: ITL p50 against the decode step
    time at batch = concurrency, output tokens/s against the decode throughput at that batch, and E2E p50
    against ``output_len`` decode steps (prefill left out, so a lower bound). The planner's decode figures
    assume every sequence at ``max_seq_len`` (worst case) and ignore overheads: see ``plan.limits.decode_basis``.
    Levels whose concurrency exceeds what the plan can batch have no ideal.
    """
    out_len = int(report.config.get("output_len", 0) or 0)
    basis = "planner decode roofline at batch = concurrency (" + plan.limits.decode_basis + ")"
    rows: list[IdealComparison] = []
    for lv in report.levels:
        if lv.mode != "concurrency" or lv.concurrency is None:
            continue
        point = _decode_step(plan, lv.concurrency)
        if point is None:
            continue
        step_ms, tok_s = point
        pairs: list[tuple[str, float | None, float]] = [
            ("itl_p50_ms", lv.itl_p50_ms, step_ms),
            ("output_tokens_per_s", lv.output_tokens_per_s, tok_s),
        ]
        if out_len:
            pairs.append(("e2e_p50_ms", lv.e2e_p50_ms, out_len * step_ms))
        for metric, measured, ideal in pairs:
            ratio = measured / ideal if measured is not None and ideal else None
            rows.append(IdealComparison(lv.label, metric, measured, ideal, ratio, basis))
    return rows


def format_comparison(rows: Sequence[IdealComparison]) -> str:
    """A plain-text table of :func:`compare_with_plan`'s rows (``x ideal`` = measured / ideal)."""
    if not rows:
        return "(the planner has no ideal for these levels)"
    lines = [f"{'level':>6}  {'metric':<20} {'measured':>10} {'ideal':>10} {'x ideal':>8}"]
    for r in rows:
        lines.append(f"{r.level:>6}  {r.metric:<20} {_fmt(r.measured, 2):>10} {r.ideal:>10.2f} {_fmt(r.ratio, 2):>8}")
    lines.append("ideal: " + rows[0].basis)
    return "\n".join(lines)


# ============================================================================================== statistics


def _percentiles(samples: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not samples:
        return None, None, None
    import numpy as np

    p50, p90, p99 = np.percentile(np.asarray(samples, dtype=float), [50, 90, 99])
    return float(p50), float(p90), float(p99)


@dataclass
class _Outcome:
    """One request, as the client saw it (times from ``time.perf_counter``)."""

    prompt: str
    t_send: float
    t_end: float
    t_first: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    text: str = ""
    error_kind: str | None = None
    error: str | None = None


class _Recorder:
    """Collects outcomes of one level and turns them into a :class:`LevelResult`."""

    def __init__(self, cfg: BenchConfig, level: Level, token_basis: str) -> None:
        self.cfg = cfg
        self.level = level
        self.token_basis = token_basis
        self.sent = 0
        self.completed = 0
        self.responses = 0
        self.inconsistent = 0
        self.errors: Counter[str] = Counter()
        self.samples: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.send_lag: list[float] = []
        self.tokens = 0
        self.first_text: dict[str, str] = {}
        self.t_start: float | None = None
        self.t_last: float | None = None

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < ERROR_SAMPLES:
            self.samples.append(f"[{kind}] {message}")

    def add(self, o: _Outcome) -> None:
        self.t_last = o.t_end if self.t_last is None else max(self.t_last, o.t_end)
        self.responses += len(o.token_times)
        if o.error_kind is not None:
            self.error(o.error_kind, o.error or "")
            return
        expected = self.cfg.expected.get(o.prompt) if self.cfg.expected is not None else None
        if expected is not None and o.text != expected:
            self.error("mismatch", _mismatch_message(o.prompt, expected, o.text))
            return
        seen = self.first_text.setdefault(o.prompt, o.text)
        if seen != o.text:
            self.inconsistent += 1
        self.completed += 1
        self.e2e.append((o.t_end - o.t_send) * 1e3)
        if o.t_first is not None:
            self.ttft.append((o.t_first - o.t_send) * 1e3)
        for i in range(1, len(o.token_times)):
            gap = (o.token_times[i] - o.token_times[i - 1]) * 1e3
            count = o.token_counts[i] if i < len(o.token_counts) else 1
            self.itl.append(gap / max(count, 1))
        if self.token_basis == "model":
            self.tokens += sum(o.token_counts)
        elif self.token_basis == "responses":
            self.tokens += len(o.token_times)

    def result(self) -> LevelResult:
        start = self.t_start if self.t_start is not None else 0.0
        elapsed = max((self.t_last or start) - start, 1e-9) if self.t_last is not None else 0.0
        ttft, itl, e2e = _percentiles(self.ttft), _percentiles(self.itl), _percentiles(self.e2e)
        lag = _percentiles(self.send_lag) if self.level.mode == "rate" else (None, None, None)
        known_tokens = self.token_basis != "unknown"
        return LevelResult(
            label=self.level.label,
            mode=self.level.mode,
            concurrency=int(self.level.value) if self.level.mode == "concurrency" else None,
            rate=self.level.value if self.level.mode == "rate" else None,
            duration_s=elapsed,
            sent=self.sent,
            completed=self.completed,
            errors=sum(self.errors.values()),
            mismatches=self.errors.get("mismatch", 0),
            error_kinds=dict(self.errors),
            error_samples=list(self.samples),
            token_basis=self.token_basis,
            output_tokens=self.tokens if known_tokens else None,
            output_tokens_per_s=(self.tokens / elapsed if elapsed > 0 else 0.0) if known_tokens else None,
            requests_per_s=self.completed / elapsed if elapsed > 0 else 0.0,
            ttft_p50_ms=ttft[0],
            ttft_p90_ms=ttft[1],
            ttft_p99_ms=ttft[2],
            itl_p50_ms=itl[0] if known_tokens else None,
            itl_p90_ms=itl[1] if known_tokens else None,
            itl_p99_ms=itl[2] if known_tokens else None,
            e2e_p50_ms=e2e[0],
            e2e_p90_ms=e2e[1],
            e2e_p99_ms=e2e[2],
            e2e_mean_ms=sum(self.e2e) / len(self.e2e) if self.e2e else None,
            responses=self.responses,
            inconsistent=self.inconsistent,
            send_lag_p50_ms=lag[0],
            send_lag_p99_ms=lag[2],
            outputs=dict(self.first_text) if self.cfg.record_outputs else None,
        )


def _mismatch_message(prompt: str, expected: str, got: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), min(len(expected), len(got)))
    return (
        f"output differs from the expected text for prompt {prompt[:40]!r} at character {at}: "
        f"expected {expected[at : at + 30]!r}, got {got[at : at + 30]!r} "
        f"(lengths {len(expected)} vs {len(got)})"
    )


# ============================================================================================== wire protocol


def _sampling_array(name: str, value: Any) -> Any:
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


@dataclass(frozen=True)
class _Contract:
    """What the bench learned about the model from the server: batching, optional inputs, decoupling."""

    batched: bool
    has_stream: bool
    has_counts: bool
    decoupled: bool | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _RequestFactory:
    """Builds ``ModelInferRequest`` messages: one template per prompt, copied with a fresh id per request."""

    def __init__(self, cfg: BenchConfig, contract: _Contract) -> None:
        import numpy as np
        from tritonclient.grpc import service_pb2
        from tritonclient.utils import serialize_byte_tensor

        self._pb = service_pb2
        self._serialize = serialize_byte_tensor
        self._np = np
        self.cfg = cfg
        self.contract = contract
        self._templates: dict[str, Any] = {}
        base = service_pb2.ModelInferRequest(model_name=cfg.model)
        base.parameters[EMPTY_FINAL_PARAM].bool_param = True
        self._add(base, cfg.max_tokens_tensor, np.array([cfg.output_len], dtype=np.int32), "INT32")
        if contract.has_stream:
            self._add(base, cfg.stream_tensor, np.array([cfg.streaming], dtype=bool), "BOOL")
        if contract.has_counts:
            self._add(base, COUNT_REQUEST_TENSOR, np.array([True], dtype=bool), "BOOL")
        for name, value in cfg.sampling.items():
            arr, dtype = _sampling_array(name, value)
            self._add(base, name, arr, dtype)
        base.outputs.add().name = cfg.output_tensor
        if contract.has_counts:
            base.outputs.add().name = COUNT_TENSOR
        self._base = base

    def _add(self, req: Any, name: str, arr: Any, dtype: str) -> None:
        if self.contract.batched:
            arr = arr.reshape((1,) + arr.shape)
        tensor = req.inputs.add()
        tensor.name = name
        tensor.datatype = dtype
        tensor.shape.extend(arr.shape)
        if dtype == "BYTES":
            raw = self._serialize(arr)  # a 0-d object array holding the serialized bytes
            req.raw_input_contents.append(raw.item() if raw.size > 0 else b"")
        else:
            req.raw_input_contents.append(arr.tobytes())

    def build(self, prompt: str, request_id: str) -> Any:
        template = self._templates.get(prompt)
        if template is None:
            template = self._pb.ModelInferRequest()
            template.CopyFrom(self._base)
            # The prompt goes first, as the contract lists it; order does not matter to Triton.
            self._add(template, self.cfg.input_tensor, self._np.array([prompt.encode("utf-8")], dtype=object), "BYTES")
            self._templates[prompt] = template
        req = self._pb.ModelInferRequest()
        req.CopyFrom(template)
        req.id = request_id
        return req


def _join_bytes_tensor(raw: bytes) -> bytes:
    """The elements of a serialized BYTES tensor (each a 4-byte little-endian length, then the bytes), joined."""
    parts = []
    i, n = 0, len(raw)
    while i + 4 <= n:
        size = int.from_bytes(raw[i : i + 4], "little")
        parts.append(raw[i + 4 : i + 4 + size])
        i += 4 + size
    return b"".join(parts)


def _parse_response(resp: Any, output_name: str, want_counts: bool) -> tuple[bytes | None, int | None, bool]:
    """(text bytes or None when the response carries no text, token count or None, final flag)."""
    final = False
    param = resp.parameters.get(FINAL_PARAM)
    if param is not None:
        final = bool(param.bool_param)
    text: bytes | None = None
    count: int | None = None
    for i, out in enumerate(resp.outputs):
        if out.name == output_name:
            if i < len(resp.raw_output_contents):
                text = _join_bytes_tensor(resp.raw_output_contents[i])
            else:  # typed contents (unusual for Triton's own server)
                text = b"".join(out.contents.bytes_contents)
        elif want_counts and out.name == COUNT_TENSOR:
            import numpy as np

            if i < len(resp.raw_output_contents):
                vals = np.frombuffer(resp.raw_output_contents[i], dtype=np.int32)
            else:
                vals = np.asarray(out.contents.int_contents, dtype=np.int32)
            count = int(vals.sum()) if vals.size else 0
    return text, count, final


# ============================================================================================== the client side


class _Health:
    """Liveness probes over the bench's channel; ``confirm`` dedupes concurrent probes."""

    def __init__(self, stub: Any) -> None:
        from tritonclient.grpc import service_pb2

        self._stub = stub
        self._req = service_pb2.ServerLiveRequest()
        self._lock = asyncio.Lock()
        self._last: tuple[float, str | None] | None = None

    async def probe(self) -> tuple[str | None, bool]:
        """(None, _) when live, else (reason, definite): definite when the server refused or is not live."""
        import grpc

        try:
            resp = await self._stub.ServerLive(self._req, timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            definite = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            return f"{exc.code().name}: {exc.details()}", definite
        except (asyncio.TimeoutError, OSError) as exc:  # pragma: no cover - grpc reports these as AioRpcError
            return f"{type(exc).__name__}: {exc}", False
        if not resp.live:
            return "the server reports it is not live (shutting down?)", True
        return None, False

    async def confirm(self) -> None:
        """Probe now (or reuse a probe from the last 0.25 s); raise :class:`_ServerGone` when definitely gone."""
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] > 0.25:
                reason, definite = await self.probe()
                self._last = (time.monotonic(), reason if definite else None)
            reason = self._last[1]
        if reason is not None:
            raise _ServerGone(reason)

    async def watch(self) -> None:
        """Probe every second; raise :class:`_ServerGone` once probes have failed for ``DEAD_AFTER_S``."""
        failing_since: float | None = None
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            started = time.monotonic()
            reason, definite = await self.probe()
            if reason is None:
                failing_since = None
                continue
            failing_since = failing_since if failing_since is not None else started
            if definite or time.monotonic() - failing_since >= DEAD_AFTER_S:
                raise _ServerGone(reason)


class _VirtualClient:
    """One gRPC stream, one request at a time on it; a broken or timed-out stream is replaced."""

    def __init__(self, session: _Session, name: str) -> None:
        self.session = session
        self.name = name
        self.seq = 0
        self._call: Any = None

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            try:
                await asyncio.wait_for(call.done_writing(), timeout=1.0)
            except Exception:  # noqa: BLE001 - closing a stream that may already be broken
                pass
            call.cancel()

    async def request(self, prompt: str) -> _Outcome:
        """Send one request and read its responses to the final one; failures are in the outcome, not raised."""
        import grpc

        s = self.session
        self.seq += 1
        rid = f"{self.name}-{self.seq}"
        req = s.factory.build(prompt, rid)
        o = _Outcome(prompt=prompt, t_send=time.perf_counter(), t_end=0.0)
        try:
            await asyncio.wait_for(self._exchange(req, rid, o), timeout=s.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            self.reset()
            o.error_kind, o.error = "timeout", f"request {rid} not finished after {s.cfg.request_timeout_s:g}s"
        except grpc.aio.AioRpcError as exc:
            self.reset()
            o.error_kind, o.error = "stream", f"request {rid}: stream failed: {exc.code().name}: {exc.details()}"
        except (_StreamEnded, asyncio.InvalidStateError) as exc:  # the stream had ended before or during the request
            self.reset()
            o.error_kind, o.error = "stream", f"request {rid}: {exc or type(exc).__name__}"
        if not o.t_end:
            o.t_end = time.perf_counter()
        return o

    async def settle(self, o: _Outcome) -> None:
        """After a broken stream: raise :class:`_ServerGone` if the server is gone, else pause before retrying."""
        if o.error_kind == "stream":
            await self.session.health.confirm()
            await asyncio.sleep(STREAM_RETRY_S)

    async def _exchange(self, req: Any, rid: str, o: _Outcome) -> None:
        import grpc

        s = self.session
        if self._call is None:
            self._call = s.stub.ModelStreamInfer()
        call = self._call
        o.t_send = time.perf_counter()
        await call.write(req)
        chunks: list[bytes] = []
        while True:
            msg = await call.read()
            now = time.perf_counter()
            if msg is grpc.aio.EOF:
                raise _StreamEnded("the server closed the stream before the final response")
            resp = msg.infer_response
            if resp.id and resp.id != rid:
                continue  # a late response of an earlier request on this stream (after an error): not ours
            if msg.error_message:
                o.t_end = now
                o.error_kind, o.error = "model", f"request {rid}: {msg.error_message}"
                final = resp.parameters.get(FINAL_PARAM)
                if final is None or not final.bool_param:
                    self.reset()  # more may follow for this request: start afresh rather than misattribute
                return
            text, count, final = _parse_response(resp, s.cfg.output_tensor, s.contract.has_counts)
            if text is not None or count:
                if o.t_first is None:
                    o.t_first = now
                o.token_times.append(now)
                o.token_counts.append(count if count is not None else 1)
                if text is not None:
                    if s.cfg.cumulative_output:
                        chunks = [text]
                    else:
                        chunks.append(text)
            if final:
                o.t_end = now
                o.text = b"".join(chunks).decode("utf-8", errors="replace")
                return


class _StreamEnded(Exception):
    """The server ended a stream while a request was in flight."""


class _Session:
    """A channel, its stub, the model's contract and the request factory, shared by all levels of a run."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.channel: Any = None
        self.stub: Any = None
        self.health: _Health
        self.contract: _Contract
        self.factory: _RequestFactory
        self.prompts = cfg.prompt_list()

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.channel = grpc.aio.insecure_channel(
            self.cfg.url,
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ],
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = _Health(self.stub)
        self.contract = await self._discover()
        self.factory = _RequestFactory(self.cfg, self.contract)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def _discover(self) -> _Contract:
        """Read the model's metadata and config; check the contract's tensors are there."""
        import grpc
        from tritonclient.grpc import service_pb2

        cfg = self.cfg
        try:
            meta = await self.stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=cfg.model), timeout=10)
            mcfg = (await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=cfg.model), timeout=10)).config
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BenchError(
                    f"cannot reach the Triton server at {cfg.url} ({exc.code().name}: {exc.details()}). "
                    "Start it (`kiln serve`) and pass its gRPC address as host:port."
                ) from exc
            raise BenchError(
                f"model {cfg.model!r} is not available on {cfg.url}: {exc.details()}. "
                "Check the model name (ensemble or tensorrt_llm_bls) and that it loaded."
            ) from exc
        inputs = tuple(t.name for t in meta.inputs)
        outputs = tuple(t.name for t in meta.outputs)
        missing = [n for n in (cfg.input_tensor, cfg.max_tokens_tensor) if n not in inputs]
        missing += [n for n in cfg.sampling if n not in inputs]
        if cfg.output_tensor not in outputs:
            missing.append(cfg.output_tensor)
        if missing:
            raise BenchError(
                f"model {cfg.model!r} does not have the tensors {missing} the bench needs "
                f"(it has inputs {list(inputs)}, outputs {list(outputs)}). Call the ensemble or the BLS model, "
                "or set the tensor names."
            )
        has_stream = cfg.stream_tensor in inputs
        if cfg.streaming and not has_stream:
            raise BenchError(
                f"model {cfg.model!r} has no {cfg.stream_tensor!r} input, so it cannot stream; "
                "run without streaming or call a model that can"
            )
        decoupled = bool(mcfg.model_transaction_policy.decoupled) if mcfg is not None else None
        return _Contract(
            batched=mcfg.max_batch_size > 0,
            has_stream=has_stream,
            has_counts=COUNT_REQUEST_TENSOR in inputs and COUNT_TENSOR in outputs,
            decoupled=decoupled,
            inputs=inputs,
            outputs=outputs,
        )

    def token_basis(self) -> str:
        if self.contract.has_counts:
            return "model"
        return "responses" if self.cfg.streaming else "unknown"


async def _closed_loop(session: _Session, level: Level, rec: _Recorder, deadline: float) -> None:
    """``level.value`` clients, each sending its next request as soon as the previous one ends."""
    cfg = session.cfg
    counter = iter(range(cfg.max_requests if cfg.max_requests is not None else 2**62))
    prompts = session.prompts

    async def client(n: int) -> None:
        vc = _VirtualClient(session, f"{level.label}-{n}")
        try:
            while time.perf_counter() < deadline:
                idx = next(counter, None)
                if idx is None:
                    return
                rec.sent += 1
                outcome = await vc.request(prompts[idx % len(prompts)])
                rec.add(outcome)
                await vc.settle(outcome)
        finally:
            await vc.close()

    await _gather_or_fail([client(n) for n in range(int(level.value))])


async def _open_loop(session: _Session, level: Level, rec: _Recorder, deadline: float) -> None:
    """Requests at ``level.value``/s (even or Poisson), each on a free stream of a bounded pool."""
    cfg = session.cfg
    rng = random.Random(cfg.seed)
    prompts = session.prompts
    pool: asyncio.Queue[_VirtualClient] = asyncio.Queue()
    made = 0
    inflight: set[asyncio.Task[None]] = set()
    failure: list[BaseException] = []

    async def run(vc: _VirtualClient, prompt: str) -> None:
        try:
            outcome = await vc.request(prompt)
            rec.add(outcome)
            await vc.settle(outcome)
        except Exception as exc:  # _ServerGone (or a bug): the dispatcher stops and raises it
            failure.append(exc)
        finally:
            pool.put_nowait(vc)

    t0 = time.perf_counter()
    next_at = t0
    n = 0
    try:
        while not failure:
            if cfg.max_requests is not None and n >= cfg.max_requests:
                break
            gap = rng.expovariate(level.value) if cfg.poisson else 1.0 / level.value
            if n:
                next_at += gap
            if next_at >= deadline:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if pool.empty() and made < cfg.max_outstanding:
                made += 1
                pool.put_nowait(_VirtualClient(session, f"{level.label}-{made}"))
            vc = await pool.get()
            rec.send_lag.append(max(0.0, time.perf_counter() - next_at) * 1e3)
            rec.sent += 1
            task = asyncio.ensure_future(run(vc, prompts[n % len(prompts)]))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            n += 1
        if inflight:
            await _gather_or_fail(list(inflight))
        if failure:
            raise failure[0]
    finally:
        for task in list(inflight):
            task.cancel()
        while not pool.empty():
            await pool.get_nowait().close()


async def _gather_or_fail(coros: Iterable[Any]) -> None:
    """Run all; on the first exception cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_level(session: _Session, level: Level) -> LevelResult:
    rec = _Recorder(session.cfg, level, session.token_basis())
    rec.t_start = time.perf_counter()
    deadline = rec.t_start + session.cfg.duration_s
    body = _closed_loop if level.mode == "concurrency" else _open_loop
    work = asyncio.ensure_future(body(session, level, rec, deadline))
    watchdog = asyncio.ensure_future(session.health.watch())
    try:
        await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        for task in (watchdog, work):
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    except _ServerGone as exc:
        res = rec.result()
        raise BenchError(
            f"the server at {session.cfg.url} stopped answering during level {level.label} ({exc}); "
            f"{res.completed} requests had completed and {res.errors} failed in this level. "
            "Check the server log."
        ) from exc
    finally:
        for task in (work, watchdog):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watchdog, return_exceptions=True)
    return rec.result()


async def run_level(cfg: BenchConfig, level: Level | int | float) -> LevelResult:
    """Run one level on its own connection.

    ``level`` is a :class:`Level`, or a number: a request rate when ``cfg.rate`` is set, else a concurrency.

    Raises:
        BenchError: the server cannot be reached, lacks the model or its tensors, or died during the level.
    """
    if not isinstance(level, Level):
        level = Level("rate", float(level)) if cfg.rate is not None else Level("concurrency", float(int(level)))
    session = _Session(cfg)
    try:
        await session.open()
        return await _run_level(session, level)
    finally:
        await session.close()


async def run_bench_async(cfg: BenchConfig) -> BenchReport:
    """All of ``cfg``'s levels, in order, on one connection (see :func:`run_bench`)."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    session = _Session(cfg)
    results: list[LevelResult] = []

    def report() -> BenchReport:
        model = {"name": cfg.model, "token_basis": None}
        if getattr(session, "contract", None) is not None and hasattr(session, "factory"):
            model.update(session.contract.to_dict())
            model["token_basis"] = session.token_basis()
        return BenchReport(cfg.to_dict(), model, list(results), started, time.perf_counter() - t0)

    try:
        await session.open()
        for level in cfg.levels():
            results.append(await _run_level(session, level))
    except BenchError as exc:
        exc.report = report() if results else None
        raise
    finally:
        await session.close()
    return report()


def run_bench(cfg: BenchConfig) -> BenchReport:
    """Run every level of ``cfg`` and return the report (errors are in it, counted per level).

    Raises:
        BenchError: the server cannot be reached, lacks the model or its tensors, or died mid-run (then
            ``exc.report`` holds the levels that finished).
    """
    return asyncio.run(run_bench_async(cfg))


# ============================================================================================== mock model
# A deterministic stand-in for the LLM, with the ensemble's tensor contract, to test the bench and to measure
# the client and the serving stack without a model: `write_mock_repository`. The same Python file serves the
# roles `llm` (text in, text out, streamed: the ensemble/BLS contract), and `pre`/`generate`/`post`, the three
# steps of a mock ensemble (text → ids → streamed ids → text).

_MOCK_MODEL = r'''"""kiln bench's mock LLM (written by kiln.serve.bench.write_mock_repository): deterministic tokens."""
import hashlib
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


FAIL_PREFIX = b"kiln-mock-fail"


def token_ids(prompt_bytes, n):
    seed = hashlib.sha256(prompt_bytes).digest()
    return [int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "little")).digest()[:2], "little") for i in range(n)]


def token_text(token_id):
    return f" {token_id:04x}"


def _input(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.role = params.get("role", "llm")
        self.token_delay = float(params.get("token_delay_ms", "0")) / 1e3
        self.compute = float(params.get("compute_ms", "0")) / 1e3
        self.final_with_last = params.get("final_with_last", "false") == "true"
        self.batched = config.get("max_batch_size", 0) > 0

    def _shape(self, arr):
        return arr.reshape((1,) + arr.shape) if self.batched else arr

    def execute(self, requests):
        if self.role in ("pre", "post"):
            return [self._convert(r) for r in requests]
        for request in requests:
            if self.token_delay > 0:
                threading.Thread(target=self._generate, args=(request,), daemon=True).start()
            else:
                self._generate(request)
        return None

    def _convert(self, request):
        if self.role == "pre":
            text = _input(request, "text_input")[0]
            ids = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.int32)
            out = [pb_utils.Tensor("input_ids", self._shape(ids)),
                   pb_utils.Tensor("input_lengths", self._shape(np.array([ids.size], dtype=np.int32)))]
        else:
            ids = _input(request, "output_ids")
            text = "".join(token_text(int(t)) for t in ids).encode()
            out = [pb_utils.Tensor("text_output", self._shape(np.array([text], dtype=object)))]
        return pb_utils.InferenceResponse(output_tensors=out)

    def _busy(self, seconds):
        # Sleep most of it (a spinning thread holding the GIL would stall the stub's own thread, and a spinning
        # process loses the CPU on a busy machine), then spin the last millisecond for an exact end.
        end = time.perf_counter() + seconds
        if seconds > 0.001:
            time.sleep(seconds - 0.001)
        while time.perf_counter() < end:
            pass

    def _generate(self, request):
        sender = request.get_response_sender()
        try:
            if self.role == "generate":
                prompt = bytes(_input(request, "input_ids").astype(np.uint8))
                n = int(_input(request, "request_output_len")[0])
                stream = bool(_input(request, "streaming", [False])[0])
            else:
                prompt = bytes(_input(request, "text_input")[0])
                n = int(_input(request, "max_tokens")[0])
                stream = bool(_input(request, "stream", [False])[0])
            want_count = bool(_input(request, "return_num_output_tokens", [False])[0])
            if prompt.startswith(FAIL_PREFIX):
                raise ValueError("this prompt asks the mock to fail")
            if self.compute > 0:
                self._busy(self.compute)
            ids = token_ids(prompt, max(n, 0))
            groups = [[t] for t in ids] if stream else [ids]
            for i, group in enumerate(groups):
                if self.token_delay > 0:
                    time.sleep(self.token_delay * (len(group) if not stream else 1))
                if self.role == "generate":
                    out = [pb_utils.Tensor("output_ids", self._shape(np.array(group, dtype=np.int32)))]
                else:
                    text = "".join(token_text(t) for t in group).encode()
                    out = [pb_utils.Tensor("text_output", self._shape(np.array([text], dtype=object)))]
                    if want_count:
                        count = np.array([len(group)], dtype=np.int32)
                        out.append(pb_utils.Tensor("num_output_tokens", self._shape(count)))
                last = self.final_with_last and i == len(groups) - 1
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=flags)
            if not (self.final_with_last and groups):
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"mock model failed: {exc}")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def mock_expected_text(prompt: str, output_len: int) -> str:
    """The text the mock model streams for ``prompt`` with ``max_tokens=output_len`` (mirrors its code)."""
    seed = hashlib.sha256(prompt.encode("utf-8")).digest()
    ids = [
        int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "little")).digest()[:2], "little") for i in range(output_len)
    ]
    return "".join(f" {t:04x}" for t in ids)


def _pbtxt_params(params: Mapping[str, Any]) -> str:
    return "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in params.items())


_MOCK_LLM_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 64
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}{count_in}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }}{count_out}
]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{params}"""

_MOCK_STEP_CONFIGS = {
    "pre": """name: "{name}"
backend: "python"
max_batch_size: 64
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [
  {{ name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] }},
  {{ name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] }}
]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{params}""",
    "generate": """name: "{name}"
backend: "python"
max_batch_size: 64
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] }},
  {{ name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "streaming" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [ {{ name: "output_ids" data_type: TYPE_INT32 dims: [ -1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{params}""",
    "post": """name: "{name}"
backend: "python"
max_batch_size: 64
input [ {{ name: "output_ids" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{params}""",
}

_MOCK_ENSEMBLE_CONFIG = """name: "{name}"
platform: "ensemble"
max_batch_size: 64
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
ensemble_scheduling {{
  step [
    {{ model_name: "{pre}" model_version: -1
      input_map {{ key: "text_input" value: "text_input" }}
      output_map {{ key: "input_ids" value: "_ids" }}
      output_map {{ key: "input_lengths" value: "_lengths" }} }},
    {{ model_name: "{generate}" model_version: -1
      input_map {{ key: "input_ids" value: "_ids" }}
      input_map {{ key: "input_lengths" value: "_lengths" }}
      input_map {{ key: "request_output_len" value: "max_tokens" }}
      input_map {{ key: "streaming" value: "stream" }}
      output_map {{ key: "output_ids" value: "_out_ids" }} }},
    {{ model_name: "{post}" model_version: -1
      input_map {{ key: "output_ids" value: "_out_ids" }}
      output_map {{ key: "text_output" value: "text_output" }} }}
  ]
}}
"""


def write_mock_repository(
    root: Path,
    *,
    name: str = "mock_llm",
    token_delay_ms: float = 0.0,
    compute_ms: float = 0.0,
    token_counts: bool = False,
    ensemble: bool = False,
    instances: int = 1,
    final_with_last: bool = False,
) -> Path:
    """Write (or add to) a Triton repository with kiln bench's deterministic mock LLM; returns ``root``.

    The mock streams ``max_tokens`` tokens, each ``f" {id:04x}"`` for an id hashed from the prompt (see
    :func:`mock_expected_text`), ends every request with a flags-only final response (as decoupled BLS
    models do), and sleeps ``token_delay_ms`` before each token (requests then run in their own threads).
    A prompt starting with ``kiln-mock-fail`` gets an error response instead (to exercise error counting).
    ``final_with_last`` marks the last token's response final instead (one message fewer per request, as the
    ``tensorrt_llm`` backend does). ``instances`` sets each Python model's instance count.

    ``ensemble=False``: one decoupled Python model ``name`` with the ensemble's contract (``text_input``,
    ``max_tokens``, ``stream`` → ``text_output``; with ``token_counts`` also ``return_num_output_tokens`` →
    ``num_output_tokens``). ``ensemble=True``: an ensemble ``name`` of three Python models,
    ``<name>_pre`` (text → byte ids), ``<name>_generate`` (takes exactly ``compute_ms`` per request, then
    streams ids) and ``<name>_post`` (ids → text), the same shape as upstream's pre → tensorrt_llm → post.
    """
    root = Path(root)

    def model(model_name: str, config: str) -> None:
        folder = root / model_name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(config, encoding="utf-8")
        if 'platform: "ensemble"' not in config:
            (folder / "1" / "model.py").write_text(_MOCK_MODEL, encoding="utf-8")

    if not ensemble:
        params = {
            "role": "llm",
            "token_delay_ms": token_delay_ms,
            "compute_ms": compute_ms,
            "final_with_last": str(final_with_last).lower(),
        }
        model(
            name,
            _MOCK_LLM_CONFIG.format(
                name=name,
                instances=instances,
                count_in=',\n  { name: "return_num_output_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true }'
                if token_counts
                else "",
                count_out=',\n  { name: "num_output_tokens" data_type: TYPE_INT32 dims: [ 1 ] }'
                if token_counts
                else "",
                params=_pbtxt_params(params),
            ),
        )
        return root
    names = {role: f"{name}_{role}" for role in ("pre", "generate", "post")}
    for role, step_name in names.items():
        params = {"role": role}
        if role == "generate":
            params.update(
                token_delay_ms=token_delay_ms, compute_ms=compute_ms, final_with_last=str(final_with_last).lower()
            )
        model(
            step_name,
            _MOCK_STEP_CONFIGS[role].format(name=step_name, instances=instances, params=_pbtxt_params(params)),
        )
    model(name, _MOCK_ENSEMBLE_CONFIG.format(name=name, **names))
    return root
