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

Modules: :mod:`~kiln.serve.bench.config` (settings), :mod:`~kiln.serve.bench.prompts`,
:mod:`~kiln.serve.bench.loadgen` (clients, levels, wire protocol), :mod:`~kiln.serve.bench.stats` (per-level
figures), :mod:`~kiln.serve.bench.report` (files, tables, planner comparison) and :mod:`~kiln.serve.bench.mock`
(the deterministic mock LLM's repository writer). The names below are importable from here.

Example::

    cfg = BenchConfig(url="127.0.0.1:8001", concurrency=(1, 4, 16), duration_s=20)
    report = run_bench(cfg)
    report.write(Path("bench-out"))       # bench.json, bench.csv, bench.png
    print(format_report(report))
"""

from kiln.serve.bench.config import BenchConfig, BenchError, Level
from kiln.serve.bench.loadgen import run_bench, run_bench_async, run_level
from kiln.serve.bench.mock import mock_expected_text, write_mock_repository
from kiln.serve.bench.prompts import PromptSet, load_prompts, synthetic_prompts
from kiln.serve.bench.report import (
    BenchReport,
    PlanComparison,
    compare_with_plan,
    format_comparison,
    format_report,
    plot_report,
)
from kiln.serve.bench.stats import LevelResult

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchReport",
    "PlanComparison",
    "Level",
    "LevelResult",
    "PromptSet",
    "compare_with_plan",
    "format_comparison",
    "format_report",
    "load_prompts",
    "mock_expected_text",
    "plot_report",
    "run_bench",
    "run_bench_async",
    "run_level",
    "synthetic_prompts",
    "write_mock_repository",
]
