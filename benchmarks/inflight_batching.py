"""In-flight batching on the CPU reference runtime: 16 concurrent streams against the same runtime limited to
one request at a time (engine.max_batch_size 1). Target: ≥ 4× requests/s.

    .venv/bin/python benchmarks/inflight_batching.py [--duration 20] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import build

from kiln.serve.bench import BenchConfig, run_bench
from kiln.serve.server import ServerConfig, TritonServer, free_port


def measure(repo: Path, concurrency: int, duration: float, output_len: int):
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(cfg) as server:
        report = run_bench(BenchConfig(url=server.urls()["grpc"], concurrency=(concurrency,), duration_s=duration,
                                       input_len=16, output_len=output_len, request_timeout_s=300))
    level = report.levels[0]
    if report.total_errors:
        raise SystemExit(f"errors during the run: {level.error_samples}")
    return level


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ifb-") as d:
        cwd = Path(d)
        build(cwd)
        build(cwd, "name=tiny-llama-one-at-a-time", "engine.max_batch_size=1")  # quantize reused
        batched = measure(cwd / "triton_repo" / "tiny-llama", args.concurrency, args.duration, args.output_len)
        single = measure(cwd / "triton_repo" / "tiny-llama-one-at-a-time", args.concurrency, args.duration,
                         args.output_len)
    print(f"{args.concurrency} concurrent streams, {args.output_len} output tokens, {args.duration:.0f} s each")
    print(f"{'runtime':<28} {'req/s':>7} {'tok/s':>8} {'ttft p50 ms':>12} {'e2e p50 ms':>11}")
    for label, lv in (("in-flight batching", batched), ("one request at a time", single)):
        print(f"{label:<28} {lv.requests_per_s:>7.2f} {lv.output_tokens_per_s:>8.1f} {lv.ttft_p50_ms:>12.1f} "
              f"{lv.e2e_p50_ms:>11.1f}")
    ratio = batched.requests_per_s / single.requests_per_s
    print(f"speed-up {ratio:.1f}× requests/s, TTFT p50 {single.ttft_p50_ms / batched.ttft_p50_ms:.1f}× lower "
          f"[target ≥ 4×: {'PASS' if ratio >= 4 else 'FAIL'}]")


if __name__ == "__main__":
    main()
