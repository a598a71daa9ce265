"""How many requests/s `kiln bench`'s client sustains against a trivial model (target: ≥ 1,000 on 2 cores).

The server is a real ``tritonserver`` (nvidia-pytriton's) serving kiln bench's mock LLM: a decoupled Python
model with the ensemble's tensor contract that answers instantly, one token per request, and ends each
request with a flags-only final response as a BLS model does (so the client reads two messages per request,
its harder case). Client and server share this machine's cores, so the measured rate is what the whole
stack does; the client's own CPU time per request (``time.process_time`` of this process, gRPC's threads
included) shows how far the client alone would go, so that a benchmark never measures the client.

    python benchmarks/client_capacity.py [--concurrency 16,64] [--duration 10] [--target 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def _process_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children, now."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="16,64", help="comma-separated client counts (default 16,64)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level (default 10)")
    parser.add_argument("--output-len", type=int, default=1, help="tokens per request (default 1)")
    parser.add_argument("--target", type=float, default=1000.0, help="requests/s the best level must reach")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.concurrency.split(","))

    from kiln.serve.bench import BenchConfig, run_bench, write_mock_repository
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    print(f"cores: {os.cpu_count()} (client and server share them)")
    with tempfile.TemporaryDirectory(prefix="kiln-capacity-") as tmp:
        repo = write_mock_repository(Path(tmp) / "repo", name="trivial")
        server_cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        with TritonServer(server_cfg) as server:
            url = server.urls()["grpc"]
            # Warm-up: first requests pay stream set-up and the stub's first calls.
            run_bench(BenchConfig(url=url, model="trivial", concurrency=(4,), duration_s=1.0, output_len=1))
            head = (
                f"{'clients':>7} {'req/s':>8} {'errors':>6} {'e2e p50':>8} {'client cores':>12} "
                f"{'client µs/req':>13} {'server cores':>12} {'client-only req/s/core':>22}"
            )
            print(head)
            best = 0.0
            errors = 0
            for c in levels:
                cfg = BenchConfig(
                    url=url, model="trivial", concurrency=(c,), duration_s=args.duration, output_len=args.output_len
                )
                assert server.proc is not None
                s0, c0, t0 = _process_cpu([server.proc.pid]), time.process_time(), time.perf_counter()
                level = run_bench(cfg).levels[0]
                wall = time.perf_counter() - t0
                client_cpu = time.process_time() - c0
                server_cpu = _process_cpu([server.proc.pid]) - s0
                per_req = client_cpu / max(level.completed, 1)
                print(
                    f"{c:>7} {level.requests_per_s:>8.0f} {level.errors:>6} {level.e2e_p50_ms or 0:>8.2f} "
                    f"{client_cpu / wall:>12.2f} {per_req * 1e6:>13.0f} {server_cpu / wall:>12.2f} "
                    f"{1 / per_req if per_req else float('inf'):>22.0f}"
                )
                best = max(best, level.requests_per_s)
                errors += level.errors
    ok = best >= args.target and errors == 0
    print(f"best: {best:.0f} requests/s with {errors} errors; target ≥ {args.target:.0f}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
