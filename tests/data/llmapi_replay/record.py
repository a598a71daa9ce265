"""Record the requests tensorrtllm_backend's own client sends to Triton's llmapi model: run the real
``tools/inflight_batcher_llm/end_to_end_test.py --test-llmapi`` against a recording endpoint (a real tritonserver
serving kiln's llmapi config.pbtxt with a recording stand-in model, recorder_model.py) and write what it sent as
the fixtures tests/test_llmapi_replay.py replays against kiln's llmapi repository.

    git -C <tensorrtllm_backend clone> archive <COMMIT> tools ci/L0_backend_trtllm | tar -x -C /tmp/upstream
    pip install --target /tmp/e2e-deps tabulate        # utils.py imports it; kiln's environment has the rest
    PYTHONPATH=src python tests/data/llmapi_replay/record.py --upstream /tmp/upstream --commit <COMMIT> \\
        --deps /tmp/e2e-deps

No upstream code is copied into kiln: the fixtures hold the requests (inputs, request ids, requested outputs) and the
script's own output. The script's exit status is recorded; a mode whose run fails is reported and not written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import text_format

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
SCRIPT = "tools/inflight_batcher_llm/end_to_end_test.py"
DATASET = "ci/L0_backend_trtllm/simple_data.json"
BASE_ARGS = ["--dataset", "{dataset}", "--max-input-len", "500", "--test-llmapi", "--model-name", "tensorrt_llm"]
#: mode → (decoupled, extra script arguments, transport of every request).
MODES = {
    "http": (False, [], "http"),
    "grpc_stream": (True, ["--protocol", "grpc", "--streaming", "--output-config",
                           "{'return_finish_reason': True, 'return_stop_reason': True}"], "grpc-stream"),
}


def recorder_repository(root: Path, decoupled: bool, record_to: Path) -> Path:
    from kiln.recipe.loader import load_recipe
    from kiln.triton.llmapi import llmapi_config

    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml",
                         ["target=pytorch", f"serving.streaming={str(decoupled).lower()}"]).recipe
    config = llmapi_config(recipe, runtime="reference")
    config.parameters.clear()
    config.parameters["record_to"].string_value = str(record_to)
    model = root / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    shutil.copy2(HERE / "recorder_model.py", model / "1" / "model.py")
    return root


def record(mode: str, upstream: Path, commit: str, deps: str) -> dict:
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    decoupled, extra, transport = MODES[mode]
    with tempfile.TemporaryDirectory(prefix="kiln-record-") as tmp:
        tmp_path = Path(tmp)
        log = tmp_path / "requests.jsonl"
        repo = recorder_repository(tmp_path / "repo", decoupled, log)
        cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        args = [a.format(dataset=upstream / DATASET) for a in BASE_ARGS] + extra
        port = cfg.grpc_port if transport.startswith("grpc") else cfg.http_port
        argv = [sys.executable, str(upstream / SCRIPT), *args, "-u", f"127.0.0.1:{port}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (deps, os.environ.get("PYTHONPATH")) if p)}
        with TritonServer(cfg):
            run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        requests = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "source": {"repo": "triton-inference-server/tensorrtllm_backend", "commit": commit, "script": SCRIPT,
                   "dataset": DATASET, "argv": [SCRIPT, *[a.replace(str(upstream) + "/", "") for a in args],
                                                "-u", "<endpoint>"]},
        "recorded_with": {"endpoint": "tritonserver (nvidia-pytriton 0.7.0) serving kiln's llmapi config.pbtxt with "
                                      "the recording stand-in tests/data/llmapi_replay/recorder_model.py",
                          "decoupled": decoupled},
        "transport": transport,
        "script_exit_status": run.returncode,
        "script_output": (run.stdout + run.stderr).strip().splitlines()[-12:],
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="an export of tensorrtllm_backend at --commit")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--deps", default="", help="a directory with the script's extra packages (tabulate)")
    parser.add_argument("--out", type=Path, default=HERE)
    ns = parser.parse_args()
    failed = []
    for mode in MODES:
        fixture = record(mode, ns.upstream.resolve(), ns.commit, ns.deps)
        print(f"{mode}: exit {fixture['script_exit_status']}, {len(fixture['requests'])} requests; "
              + " | ".join(fixture["script_output"][-3:]))
        if fixture["script_exit_status"] != 0:
            failed.append(mode)
            continue
        (ns.out / f"{mode}.json").write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
