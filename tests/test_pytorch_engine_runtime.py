"""Target pytorch on a GPU host, through a STAND-IN engine runtime (tests/standin_runtime: a `docker` that records its
argv and runs the command in a bubblewrap sandbox over a stand-in image whose Python is this machine's, ModelOpt 0.47
on the CPU, plus a stand-in nvidia-smi reporting an H100). kiln's real unified-checkpoint worker (export_hf.py)
calibrates and exports in it, the evaluate worker grades there, and package writes the GPU llmapi repository with its
deploy and trtllm-serve files. Nothing here is a GPU run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.standin_runtime import DIGEST, IMAGE, install

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "configs" / "tiny-llama.yaml"
# Evaluation is off here to keep the test short: the evaluate worker grades a pytorch checkpoint exactly as it grades
# a tensorrt one (the same checkpoint/ + modelopt_state.pth), which test_engine_runtime.py runs in the stand-in.
# Serving values off their defaults, so the files are seen to carry the recipe's values, not constants.
SETS = ["target=pytorch", "quantization.calibration.samples=4", "quantization.calibration.max_seq_len=64",
        "evaluation.enabled=false", "hardware.gpu=H100-SXM", "engine.max_batch_size=24",
        "serving.kv_cache_free_gpu_mem_fraction=0.77", "serving.max_tokens_in_paged_kv_cache=12288"]


def kiln(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("bwrap") is None:
        pytest.skip("the stand-in container runtime needs bubblewrap (apt-get install bubblewrap)")
    root = tmp_path_factory.mktemp("pytorch-engine-runtime")
    s = install(root / "rt")
    sets = [w for o in SETS for w in ("--set", o)]
    dry = kiln("build", str(RECIPE), *sets, "--dry-run", cwd=root, env=s.env)
    run = kiln("build", str(RECIPE), *sets, "--quiet", cwd=root, env=s.env)
    assert run.returncode == 0, run.stdout + run.stderr
    return root, s, dry


def test_the_unified_checkpoint_is_exported_in_the_image_by_its_modelopt(built) -> None:
    root, s, dry = built
    jobs = {Path(argv[argv.index(IMAGE) + 2]).stem: argv for argv in s.runs()}
    assert set(jobs) == {"export_hf"}  # no TensorRT-LLM quantizer, no trtllm-build, no engine probe
    assert jobs["export_hf"][-4:] == ["python3", "/kiln/workers/export_hf.py", "--job", "/kiln/job/export_hf.json"]
    assert "/kiln/workers/export_hf.py" in dry.stdout and "export_hf_checkpoint" in dry.stdout
    build = root / "build" / "tiny-llama"
    job = json.loads((build / "quantize" / "job" / "export_hf.json").read_text())
    assert {k: job[k] for k in ("preset", "awq_block_size", "calib_size", "output_dir")} == {
        "preset": "INT4_AWQ_CFG", "awq_block_size": 128, "calib_size": 4, "output_dir": "/kiln/out/unified_checkpoint"}
    result = json.loads((build / "quantize" / "manifest.json").read_text())["result"]
    assert result["produced_by"]["environment"] == f"engine runtime: {IMAGE}"
    assert result["produced_by"]["tensorrt_llm"] == "1.2.1" and result["produced_by"]["modelopt"]
    assert result["unified_checkpoint"] == "unified_checkpoint" and result["quant_algo"] == "W4A16_AWQ"
    record = json.loads((build / "quantize" / "checkpoint" / "kiln_quantization.json").read_text())
    assert record["export"] == "modelopt.torch.export.export_hf_checkpoint"
    assert (build / "quantize" / "restore_check.safetensors").is_file()  # what the evaluate worker would check


def test_the_gpu_repository_deploy_and_trtllm_serve_files(built) -> None:
    from kiln.triton.llmapi import check_llm_args

    root, _, _ = built
    repo, deploy = root / "triton_repo" / "tiny-llama", root / "deploy" / "tiny-llama"
    info = json.loads((repo / "kiln.json").read_text())
    assert info["llmapi_runtime"] == "tensorrt_llm" and info["container"] == f"{IMAGE}@{DIGEST}"
    assert info["server_command"][0] == "tritonserver" and "--disable-auto-complete-config" in info["server_command"]
    assert '"tensorrt_llm"' in (repo / "tensorrt_llm" / "config.pbtxt").read_text().split('key: "runtime"')[1][:60]
    launch = (deploy / "launch.sh").read_text()
    assert "kiln_check_engine" not in launch and "mpirun" not in launch and "exec tritonserver" in launch
    assert f"image: {IMAGE}@{DIGEST}" in (deploy / "docker-compose.yml").read_text()
    options = yaml.safe_load((deploy / "trtllm-serve" / "llm_options.yaml").read_text())
    assert "model" not in options and check_llm_args({**options, "model": "x"}) == []
    model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    # Both files carry the recipe's values (written out here from the recipe and SETS, not from kiln's output).
    recipe_args = {"dtype": "float32", "trust_remote_code": False, "tensor_parallel_size": 1,
                   "pipeline_parallel_size": 1, "max_batch_size": 24, "max_input_len": 256, "max_num_tokens": 2048,
                   "max_seq_len": 512, "max_beam_width": 1, "enable_chunked_prefill": False,
                   "kv_cache_config": {"free_gpu_memory_fraction": 0.77, "enable_block_reuse": True,
                                       "tokens_per_block": 32, "dtype": "auto", "max_tokens": 12288},
                   "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}}
    assert options == recipe_args
    assert model_yaml == {**recipe_args, "model": "checkpoint",
                          "triton_config": {"max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 100}}
    serve = (deploy / "trtllm-serve" / "serve.sh").read_text()
    assert 'trtllm-serve serve "${MODEL_REPO}/tensorrt_llm/1/checkpoint"' in serve
    assert '--extra_llm_api_options "$(dirname "$0")/llm_options.yaml"' in serve
    lint = subprocess.run([sys.executable, "-m", "kiln", "lint", str(repo)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # Dynamo: launch script and DynamoGraphDeployments (aggregated, disaggregated) that validate
    from kiln.triton.deploy.dynamo import validate_dynamo_manifests

    dynamo = deploy / "dynamo"
    graphs = [dynamo / "k8s" / "graph-aggregated.yaml", dynamo / "k8s" / "graph-disaggregated.yaml"]
    assert (dynamo / "launch.sh").is_file() and all(g.is_file() for g in graphs)
    assert validate_dynamo_manifests(graphs) == []
    assert yaml.safe_load((dynamo / "llm_options.yaml").read_text()) == options
