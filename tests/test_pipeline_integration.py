"""The real pipeline on the built-in model: no-op rebuilds, crash safety under SIGKILL, concurrent builds, and the
tensorrt target stopping at the engine step on a machine without a GPU."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.recipe.catalog import configs_dir

pytestmark = pytest.mark.integration

RECIPE = str(configs_dir() / "tiny-llama.yaml")
# int8_sq calibrates in seconds (AWQ's search is the slow part); the pipeline's behaviour does not depend on it
FAST = ["--set", "quantization.format=int8_sq", "--set", "quantization.calibration.samples=8", "--set", "quantization.calibration.max_seq_len=64",
        "--set", "evaluation.samples=4", "--set", "evaluation.max_seq_len=64"]


def kiln(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def digests(root: Path) -> dict[str, object]:
    """Content of every artifact file (manifests left out): a hash, or for pickled ModelOpt state (whose bytes
    vary with pickling order) the tensors and values it holds."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == "manifest.json":
            continue
        key = str(p.relative_to(root))
        out[key] = _state(p) if p.suffix == ".pth" else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _state(path: Path) -> object:
    import torch

    def norm(x):
        if isinstance(x, dict):
            return {str(k): norm(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [norm(v) for v in x]
        if torch.is_tensor(x):
            return hashlib.sha256(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        return repr(x)

    return norm(torch.load(path, map_location="cpu", weights_only=False))


def started(build: Path) -> dict[str, str]:
    return {str(p.relative_to(build)): json.loads(p.read_text())["started"] for p in sorted(build.glob("*/*/manifest.json"))}


@pytest.fixture(scope="module")
def fast_build(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    """One complete build with FAST settings, and the digests of its quantize output (an uninterrupted run's, to
    compare resumed builds against). Tests that change it only change later steps than quantize."""
    work = tmp_path_factory.mktemp("fast-build")
    first = kiln("build", RECIPE, *FAST, "--quiet", cwd=work)
    assert first.returncode == 0, first.stderr
    return work, digests(work / "build" / "tiny-llama" / "quantize")


def test_unchanged_rebuild_runs_nothing_and_serving_change_only_packages(fast_build):
    work, _ = fast_build
    before = started(work / "build")
    again = kiln("build", RECIPE, *FAST, "--json", "--quiet", cwd=work)
    assert again.returncode == 0
    assert {s["status"] for s in json.loads(again.stdout)["steps"]} == {"skipped"}
    assert started(work / "build") == before
    serving = kiln("build", RECIPE, *FAST, "--set", "serving.max_queue_delay_microseconds=100", "--json", "--quiet",
                   cwd=work)
    statuses = {s["name"]: s["status"] for s in json.loads(serving.stdout)["steps"]}
    assert statuses == {"resolve": "skipped", "quantize": "skipped", "evaluate": "skipped", "engine": "skipped",
                        "package": "ran", "tasks": "ran"}  # the task gate follows its package (no tasks: a no-op)
    dry = kiln("build", RECIPE, *FAST, "--set", "quantization.calibration.seed=7", "--dry-run", cwd=work)
    assert "quantization.calibration.seed: 1234 → 7" in dry.stdout and "skip resolve" in dry.stdout.replace("  ", " ")


def _kill_when(proc: subprocess.Popen, predicate, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        assert proc.poll() is None, "the build finished before it could be killed"
        time.sleep(0.05)
    raise AssertionError("the build never reached the point to kill it at")


def test_sigkill_leaves_nothing_a_later_run_accepts(tmp_path, fast_build):
    """A build killed during calibration, then one killed while exporting the checkpoint: neither half-written
    output is accepted, and the run after them makes exactly what an uninterrupted build makes."""
    build = tmp_path / "build" / "tiny-llama"
    cmd = [sys.executable, "-m", "kiln", "build", RECIPE, *FAST, "--quiet", "--to", "quantize"]

    def tmp_dirs():
        return list(build.glob(".quantize.tmp-*")) if build.is_dir() else []

    calibrating = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(calibrating, lambda: bool(tmp_dirs()))
    assert not (build / "quantize" / "manifest.json").exists()
    stale = set(tmp_dirs())
    exporting = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # once the exported checkpoint starts appearing in the (new) temp dir
    _kill_when(exporting, lambda: any((d / "checkpoint").exists() for d in set(tmp_dirs()) - stale))
    assert not (build / "quantize" / "manifest.json").exists()
    resumed = kiln("build", RECIPE, *FAST, "--json", "--quiet", "--to", "quantize", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    statuses = {s["name"]: s["status"] for s in json.loads(resumed.stdout)["steps"]}
    assert statuses["quantize"] == "ran"  # the half-written outputs were not accepted
    assert not list(build.glob(".quantize.tmp-*"))
    assert digests(build / "quantize") == fast_build[1]


def test_two_simultaneous_builds_make_one_set_of_artifacts(tmp_path):
    cmd = [sys.executable, "-m", "kiln", "build", RECIPE, *FAST, "--json", "--quiet"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    quantize = sorted({s["name"]: s["status"] for s in json.loads(out)["steps"]}["quantize"] for out, _ in results)
    assert quantize == ["ran", "skipped"]
    assert any("another kiln build of tiny-llama is running" in err for _, err in results)
    assert len(list((tmp_path / "build" / "tiny-llama").glob("quantize*"))) == 1


def test_tensorrt_recipe_is_refused_without_a_gpu_and_calibrates_on_the_host_when_asked(tmp_path):
    """No GPU here: a tensorrt recipe is refused before any work, and the message says how to calibrate and gate on
    the CPU; doing so exports the TensorRT-LLM checkpoint with kiln's ModelOpt, and the manifest says so."""
    args = ["build", RECIPE, *FAST, "--set", "target=tensorrt", "--set", "name=tiny-trt"]
    dry = kiln(*args, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0
    assert "trtllm-build --checkpoint_dir /kiln/in/checkpoint --output_dir /kiln/out/trtllm_engine" in dry.stdout
    assert "--kv_cache_type paged" in dry.stdout and "--tokens_per_block 32" in dry.stdout
    refused = kiln(*args, "--quiet", cwd=tmp_path)
    assert refused.returncode == 2 and "no GPU on this machine" in refused.stderr
    assert "--set quantization.runtime=host --to evaluate" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "build" / "tiny-trt" / "quantize").exists()
    run = kiln(*args, "--set", "quantization.runtime=host", "--to", "evaluate", "--quiet", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    steps = {s["name"]: s for s in json.loads(run.stdout)["steps"]}
    assert steps["quantize"]["status"] == "ran" and steps["evaluate"]["status"] == "ran"
    assert steps["quantize"]["result"]["produced_by"]["environment"].startswith("host")
    ckpt = json.loads((tmp_path / "build" / "tiny-trt" / "quantize" / "trtllm_checkpoint" / "config.json").read_text())
    assert ckpt["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"


def _gpu_ready() -> str | None:
    import shutil

    if shutil.which("nvidia-smi") is None:
        return "no CUDA device (nvidia-smi not found)"
    if not any(shutil.which(e) for e in ("docker", "podman", "apptainer")):
        return "no container engine for the engine runtime (docker, podman or apptainer)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_ready() is not None, reason=f"needs a CUDA GPU and the NGC TensorRT-LLM image: {_gpu_ready()}")
def test_gpu_builds_a_real_engine(tmp_path):
    """On a GPU host with docker and the NGC image: the built-in model's tensorrt recipe quantizes, compiles and
    packages for real, in the engine runtime."""
    result = kiln("build", RECIPE, "--set", "target=tensorrt", "--set", "name=tiny-gpu", "--set",
                  "quantization.format=int8_sq", "--quiet", cwd=tmp_path, timeout=3600)
    assert result.returncode == 0, result.stderr
    engine = tmp_path / "build" / "tiny-gpu" / "engine" / "trtllm_engine"
    assert (engine / "rank0.engine").stat().st_size > 0
    assert kiln("lint", str(tmp_path / "triton_repo" / "tiny-gpu"), cwd=tmp_path).returncode == 0
