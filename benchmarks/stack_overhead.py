"""What the serving stack adds to a request: ensemble latency minus the model's own compute time (target: p50 ≤ 2 ms).

A real ``tritonserver`` (nvidia-pytriton's) serves kiln bench's mock models, shaped like the real stack:

- ``ensemble``: ``pre → generate → post``, three Python models (text → ids, ids → streamed ids, ids → text),
  as upstream's ``preprocessing → tensorrt_llm → postprocessing``;
- ``single``: one Python model with the same text contract (the cost of one model behind gRPC).

The compute model (``generate``, or ``single``) takes exactly ``--compute-ms`` per request (it sleeps, then
spins to the exact end) and then sends its tokens at once. One client, one request at a time (no queueing);
overhead = kiln bench's end-to-end latency (send to final response, gRPC streaming) − that compute time. Each
path also runs with no compute at all, where the whole latency is overhead. As a check, Triton's own mean
``compute_infer`` for the compute model is printed next to it: when the machine is busy, sleeps overshoot and
the two differ (the script then says the figures are unreliable).

    python benchmarks/stack_overhead.py [--compute-ms 20] [--requests 300] [--output-len 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path


def compute_stats(http_url: str, model: str) -> tuple[int, float]:
    """(executions, total compute_infer ns) Triton has recorded for ``model``."""
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=10) as resp:
        stats = json.load(resp)["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(stats["count"]), float(stats["ns"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="the model's compute time per request")
    parser.add_argument("--requests", type=int, default=300, help="measured requests per row (default 300)")
    parser.add_argument("--output-len", type=int, default=1, help="tokens per request (default 1)")
    parser.add_argument("--target-ms", type=float, default=2.0, help="p50 overhead target for the ensemble")
    args = parser.parse_args()

    from kiln.serve.bench import BenchConfig, mock_expected_text, run_bench, synthetic_prompts, write_mock_repository
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    prompts = tuple(synthetic_prompts(32, 64, seed=0))
    expected = {p: mock_expected_text(p, args.output_len) for p in prompts}
    # (row label, compute ms, model to call, the model doing the compute)
    rows = []
    for compute in (0.0, args.compute_ms):
        rows.append((f"ensemble, compute {compute:g} ms", compute, f"ens_{compute:g}", f"ens_{compute:g}_generate"))
        rows.append((f"single, compute {compute:g} ms", compute, f"single_{compute:g}", f"single_{compute:g}"))
    print(f"{os.cpu_count()} cores; 1 client; {args.requests} requests per row; {args.output_len} token(s) each")
    print(
        f"{'path':<26} {'e2e p50':>8} {'overhead p50':>12} {'p90':>7} {'p99':>7} {'triton compute':>14} "
        f"{'p50 vs triton':>13} {'errors':>6}"
    )
    verdict = None
    busy = False
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
        repo = Path(tmp) / "repo"
        for compute in (0.0, args.compute_ms):
            write_mock_repository(repo, name=f"ens_{compute:g}", ensemble=True, compute_ms=compute)
            write_mock_repository(repo, name=f"single_{compute:g}", compute_ms=compute)
        server_cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        with TritonServer(server_cfg) as server:
            url, http = server.urls()["grpc"], server.urls()["http"]
            for label, compute, model, compute_model in rows:
                common = dict(url=url, model=model, concurrency=(1,), output_len=args.output_len, prompts=prompts)
                run_bench(BenchConfig(**common, max_requests=20, duration_s=60))  # warm-up
                n0, ns0 = compute_stats(http, compute_model)
                lv = run_bench(
                    BenchConfig(**common, expected=expected, max_requests=args.requests, duration_s=600)
                ).levels[0]
                n1, ns1 = compute_stats(http, compute_model)
                measured = (ns1 - ns0) / max(n1 - n0, 1) / 1e6
                busy = busy or (compute > 0 and measured > compute + 0.5)
                over = [(v or 0.0) - compute for v in (lv.e2e_p50_ms, lv.e2e_p90_ms, lv.e2e_p99_ms)]
                print(
                    f"{label:<26} {lv.e2e_p50_ms or 0:>8.2f} {over[0]:>12.2f} {over[1]:>7.2f} {over[2]:>7.2f} "
                    f"{measured:>14.2f} {(lv.e2e_p50_ms or 0.0) - measured:>13.2f} {lv.errors:>6}"
                )
                if model == f"ens_{args.compute_ms:g}":
                    verdict = (over[0], lv.errors, (lv.e2e_p50_ms or 0.0) - measured)
    assert verdict is not None
    overhead, errors, against_measured = verdict
    ok = overhead <= args.target_ms and errors == 0
    print(
        "(ms; overhead = e2e − the set compute time; triton compute = Triton's mean compute_infer of the compute "
        "model; p50 vs triton = e2e p50 − that mean)"
    )
    if busy:
        print(
            "WARNING: the model's measured compute exceeded its set time (the machine is busy): overhead against "
            f"the measured compute is {against_measured:.2f} ms; the figures are unreliable"
        )
    print(
        f"stack overhead p50 (ensemble, compute {args.compute_ms:g} ms): {overhead:.2f} ms; "
        f"target ≤ {args.target_ms:g} ms: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
