"""`kiln serve` to ready for the default repository, median of N, with its breakdown.

Breakdown per run, from the server log: the reference model's imports (torch, transformers, ModelOpt) and its
weights + ModelOpt state restore (logged by the model), and everything else — the stack's own share: server
start, backend stubs, tokenizer models, ensemble. Target: the stack's own share ≤ 3 s.

    .venv/bin/python benchmarks/serve_startup.py [--runs 5] [--repo triton_repo/tiny-llama]
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from _common import build, median

from kiln.serve.server import ServerConfig, TritonServer, free_port

LOAD = re.compile(r"loaded in ([\d.]+)s \(imports ([\d.]+)s, weights and ModelOpt state ([\d.]+)s\)")


def one(repo: Path) -> dict:
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(cfg)
    try:
        server.start(timeout_s=300)
        total = server.startup_s or 0.0
        log = server.log_tail(2000)
    finally:
        server.stop()
    m = LOAD.search(log)
    imports, weights = (float(m.group(2)), float(m.group(3))) if m else (0.0, 0.0)
    return {"total": total, "imports": imports, "weights": weights, "stack": total - imports - weights}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repo", type=Path, help="A packaged repository (default: build the default recipe).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-startup-") as d:
        repo = args.repo
        if repo is None:
            build(Path(d))
            repo = Path(d) / "triton_repo" / "tiny-llama"
        runs = [one(repo) for _ in range(args.runs)]
    for i, r in enumerate(runs):
        print(f"run {i}: ready in {r['total']:.2f} s = imports {r['imports']:.2f} + weights/state {r['weights']:.2f} "
              f"+ stack {r['stack']:.2f}")
    med = {k: median([r[k] for r in runs]) for k in runs[0]}
    print(f"median of {args.runs}: ready {med['total']:.2f} s; model imports {med['imports']:.2f} s, weights and "
          f"ModelOpt state {med['weights']:.2f} s; stack's own share {med['stack']:.2f} s "
          f"[target ≤ 3 s: {'PASS' if med['stack'] <= 3 else 'FAIL'}]")


if __name__ == "__main__":
    main()
