"""``python -m kiln.serve.openai``: kiln's OpenAI-compatible server alone, in front of a running Triton.

The same server as ``kiln openai`` (see there for the options), with an entry point that imports only what the
server needs: the deploy files' sidecar image installs kiln without its build dependencies (torch, ModelOpt).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.serve.openai import OpenAIConfig, OpenAIServer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kiln.serve.openai", description=__doc__.splitlines()[0])
    ap.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint, host:port")
    ap.add_argument("--repo", type=Path, help="the packaged repository (name, chat template, tokenizer)")
    ap.add_argument("--triton-model", default="ensemble", help="the Triton model called (ensemble contract)")
    ap.add_argument("--model-name", help="the id clients send as `model` (default: the recipe's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    args = ap.parse_args(argv)
    cfg = OpenAIConfig(triton_url=args.triton_url, triton_model=args.triton_model, repo=args.repo,
                       model_name=args.model_name, host=args.host, port=args.port)
    print(f"OpenAI-compatible API on {cfg.url}/v1 -> Triton {cfg.triton_model} at {cfg.triton_url}", flush=True)
    OpenAIServer(cfg).run()


if __name__ == "__main__":
    main()
