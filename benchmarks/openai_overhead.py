"""What kiln's OpenAI-compatible server costs in front of Triton (targets: ≤ 2 ms added per request, median; ≤ 5%
throughput lost at 32 streams).

The model is kiln bench's mock LLM (a real ``tritonserver`` from nvidia-pytriton serving the deterministic mock:
``kiln.serve.bench.write_mock_repository``), so model time does not drown the signal; it streams ``--tokens``
tokens per request, ``--token-ms`` apart: a decode step, 20 ms by default (an 8B model's step at batch 32 on one
GPU is of that order); 5 ms is a fast small-batch step, 0 as fast as Python can send them. On a machine whose
cores the client, Triton and the mock already saturate, a short step measures that contention, not the proxy. The OpenAI server
runs as the deploy files' sidecar does, in its own process (``python -m kiln.serve.openai``). The clients are
kiln bench's own: gRPC streaming to Triton, ``POST /v1/completions`` with ``stream: true`` to the proxy.

1. Added latency, paired: each pair sends the same new prompt once straight to Triton and once through the proxy
   (in random order, one request at a time) and takes the difference of the two end-to-end times (send to last
   token). Reported: median of the differences with a 95% bootstrap confidence interval, and the same for the
   time to first token.
2. Throughput at 32 concurrent streams: tokens/s straight to Triton and through the proxy, runs interleaved
   (``--rounds`` of each), and the loss.

    python benchmarks/openai_overhead.py [--pairs 300] [--tokens 16] [--token-ms 20] [--duration 15] [--rounds 2]

Client, proxy and server share this machine's cores (2 on the development box, shared with other work): the
latency and throughput figures include that contention. The proxy's own CPU time per request and per token
(``psutil``, its process only) is printed too: it is what the proxy costs wherever it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _bootstrap_median(diffs: list[float], rng: random.Random, n: int = 4000) -> tuple[float, float, float]:
    import numpy as np

    arr = np.asarray(diffs)
    gen = np.random.default_rng(rng.randrange(2**32))
    medians = np.median(arr[gen.integers(0, len(arr), size=(n, len(arr)))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(np.median(arr)), float(lo), float(hi)


async def _paired(triton_url: str, openai_url: str, pairs: int, tokens: int, seed: int) -> tuple[list, list]:
    from kiln.serve.bench import BenchConfig
    from kiln.serve.bench.loadgen import make_session

    direct = make_session(BenchConfig(url=triton_url, model="mock_llm", output_len=tokens))
    proxied = make_session(BenchConfig(url=openai_url, api="openai", output_len=tokens))
    await direct.open()
    await proxied.open()
    rng = random.Random(seed)
    e2e, ttft = [], []
    try:
        a, b = direct.client("direct"), proxied.client("proxied")
        for i in range(pairs + 20):  # the first 20 pairs warm both paths up and are not counted
            prompt = f"pair {i} {rng.random()}"
            order = [(a, "d"), (b, "p")] if rng.random() < 0.5 else [(b, "p"), (a, "d")]
            out = {}
            for client, tag in order:
                o = await client.request(prompt)
                if o.error:
                    raise SystemExit(f"request failed ({tag}): {o.error}")
                out[tag] = o
            if i >= 20:
                e2e.append((out["p"].t_end - out["p"].t_send) * 1e3 - (out["d"].t_end - out["d"].t_send) * 1e3)
                ttft.append((out["p"].t_first - out["p"].t_send) * 1e3 - (out["d"].t_first - out["d"].t_send) * 1e3)
        await a.close()
    finally:
        await direct.close()
        await proxied.close()
    return e2e, ttft


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _throughput(url: str, api: str, tokens: int, duration: float) -> tuple[float, int, int, int]:
    from kiln.serve.bench import BenchConfig, run_bench

    cfg = BenchConfig(url=url, api=api, model="mock_llm", concurrency=(32,), duration_s=duration, output_len=tokens,
                      request_timeout_s=120)
    level = run_bench(cfg).levels[0]
    return level.output_tokens_per_s or 0.0, level.completed, level.errors, level.output_tokens or 0


def _wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300, help="paired requests for the latency figure (default 300)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument("--token-ms", type=float, default=20.0, help="mock decode step in ms (default 20)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per throughput run (default 15)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved throughput runs per path (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from kiln.serve.bench import write_mock_repository
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    print(f"cores: {os.cpu_count()} (client, proxy and Triton share them; load average {os.getloadavg()[0]:.1f} "
          f"at start); mock: {args.tokens} tokens/request, {args.token_ms:g} ms apart")
    with tempfile.TemporaryDirectory(prefix="kiln-openai-bench-") as tmp:
        repo = write_mock_repository(Path(tmp) / "repo", token_counts=True, token_delay_ms=args.token_ms)
        cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        with TritonServer(cfg) as triton:
            port = free_port()
            proxy = subprocess.Popen(
                [sys.executable, "-m", "kiln.serve.openai", "--triton-url", triton.urls()["grpc"],
                 "--triton-model", "mock_llm", "--port", str(port)], stdout=subprocess.DEVNULL)
            try:
                openai_url = f"http://127.0.0.1:{port}/v1"
                _wait_http(f"http://127.0.0.1:{port}/health")
                cpu0 = _cpu(proxy.pid)
                e2e, ttft = asyncio.run(_paired(triton.urls()["grpc"], openai_url, args.pairs, args.tokens, args.seed))
                cpu_per_request = (_cpu(proxy.pid) - cpu0) / (args.pairs + 20) * 1e3
                rng = random.Random(args.seed)
                med, lo, hi = _bootstrap_median(e2e, rng)
                tmed, tlo, thi = _bootstrap_median(ttft, rng)
                print(f"\nadded latency per request ({len(e2e)} pairs, proxied minus direct):")
                print(f"  end to end: median {med:.2f} ms, 95% CI [{lo:.2f}, {hi:.2f}]   (target <= 2 ms: "
                      f"{'met' if hi <= 2.0 else 'NOT met' if lo > 2.0 else 'CI straddles it'})")
                print(f"  first token: median {tmed:.2f} ms, 95% CI [{tlo:.2f}, {thi:.2f}]")
                print(f"  the proxy's CPU time: {cpu_per_request:.2f} ms per request of {args.tokens} tokens (one request "
                      "at a time, so every token wakes it)")
                direct, proxied = [], []
                proxy_cpu = 0.0
                for _ in range(args.rounds):
                    direct.append(_throughput(triton.urls()["grpc"], "triton", args.tokens, args.duration))
                    cpu0 = _cpu(proxy.pid)
                    proxied.append(_throughput(openai_url, "openai", args.tokens, args.duration))
                    proxy_cpu += _cpu(proxy.pid) - cpu0
                d = sum(r[0] for r in direct) / len(direct)
                p = sum(r[0] for r in proxied) / len(proxied)
                errors = sum(r[2] for r in direct + proxied)
                per_token = proxy_cpu / max(sum(r[3] for r in proxied), 1) * 1e6
                loss = 100.0 * (1.0 - p / d) if d else float("nan")
                print(f"\nthroughput at 32 streams ({args.rounds} x {args.duration:g} s each, interleaved):")
                print(f"  direct {d:,.0f} tok/s, through the proxy {p:,.0f} tok/s: loss {loss:.1f}%   "
                      f"(target <= 5%: {'met' if loss <= 5.0 else 'NOT met'}); errors {errors}")
                print("  runs: direct " + ", ".join(f"{r[0]:,.0f}" for r in direct)
                      + "; proxied " + ", ".join(f"{r[0]:,.0f}" for r in proxied))
                print(f"  the proxy's CPU time: {per_token:.0f} us per streamed token, "
                      f"{proxy_cpu / (args.rounds * args.duration):.2f} cores at this rate")
            finally:
                proxy.terminate()
                proxy.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
