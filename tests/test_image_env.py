"""kiln's engine-runtime workers in the NGC image's own Python environment (issue 20): ModelOpt 0.37, transformers
4.57.3, datasets 3.1.0 — the container table's row for TensorRT-LLM 1.2.1 — in a venv built by `make image-env`
(tests/image_env.py; torch is the CPU build, the only difference from the image). pytest runs in kiln's .venv; every
test here runs a worker with the image environment's python, directly or through the STAND-IN container runtime
(tests/standin_runtime: bubblewrap over a stand-in "image" whose tensorrt_llm.quantize_and_export follows 1.2.1's
source). Nothing here is a GPU run.

The default run keeps four representative cases (a hub-cache model through the stand-in container runtime, whose
build is also the INT8-KV weight-only and the evaluate case, and the AWQ unified export); the rest of the matrix is
marked image_env_matrix and runs with ``pytest -m image_env``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.recipe.formats import kv_cache_format_names, weight_format, weight_format_names
from kiln.recipe.loader import load_recipe
from kiln.runtime.engine_runtime import workers_dir
from kiln.steps.quantize import QUANT_RECORD
from kiln.util.errors import InputError
from tests import image_env
from tests.standins import hub_cache, serving_site, stub_repository

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "configs" / "tiny-llama.yaml"
STANDIN_SITE = REPO_ROOT / "tests" / "standin_runtime" / "image" / "site"
WORKER_JOBS = REPO_ROOT / "tests" / "standin_runtime" / "worker_jobs.py"
QUANTIZE_ONLY = REPO_ROOT / "tests" / "standin_runtime" / "quantize_only.py"
HUB_REPO = "kiln-test/tiny-llama"
SMALL = ["quantization.calibration.samples=4", "quantization.calibration.max_seq_len=32", "evaluation.samples=2",
         "evaluation.max_seq_len=32"]

pytestmark = [pytest.mark.image_env, pytest.mark.integration]
matrix = pytest.mark.image_env_matrix


def run_in_image(python: Path, args: list[str], site: Path | None = None, timeout: int = 600
                 ) -> subprocess.CompletedProcess:
    """``python ARGS`` with only the image's stand-in tensorrt_llm (and the given package metadata) added."""
    path = os.pathsep.join(str(p) for p in (STANDIN_SITE, site) if p)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": path,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, env=env)


def last_json(text: str) -> dict:
    return json.loads(next(line for line in reversed(text.strip().splitlines()) if line.startswith("{")))


def recipe_for(*overrides: str):
    return load_recipe(RECIPE, ["hardware.gpu=H100-SXM", *SMALL, *overrides]).recipe


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from kiln.models.tiny import ensure_tiny_llama

    return ensure_tiny_llama(progress=False)


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory) -> Path:
    """Calibration texts as the quantize step writes them (job/calib/train.jsonl, the `text` column)."""
    from kiln.models.data import load_texts

    root = tmp_path_factory.mktemp("calib")
    texts = load_texts(recipe_for().quantization.calibration, "quantization.calibration")[:4]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t[:400]}) + "\n" for t in texts))
    return root


def job_paths(out: Path, model: Path, calib: Path) -> dict[str, str]:
    return {"model": str(model), "calib": str(calib), "out": str(out), "job": str(out / "job")}


# ----------------------------------------------------------------------------------- the environment itself


@matrix
def test_the_probe_reads_the_images_packages(image_python: Path, tmp_path: Path) -> None:
    run = run_in_image(image_python, [str(workers_dir() / "probe.py")], site=serving_site(tmp_path))
    assert run.returncode == 0, run.stderr
    packages = last_json(run.stdout)["packages"]
    row = image_env.image_row()
    for name, version in row.python_packages.items():
        if name in packages and version[:1].isdigit():
            assert packages[name] == version, name
    assert packages["tensorrt_llm"] == row.tensorrt_llm and packages["torch"].endswith("+cpu")


@matrix
def test_the_engine_check_in_the_image_env(image_python: Path, tmp_path: Path) -> None:
    repo = stub_repository(tmp_path / "repo")
    same = run_in_image(image_python, [str(workers_dir() / "check_engine.py"), str(repo)], site=serving_site(tmp_path))
    assert same.returncode == 0, same.stderr
    other = run_in_image(image_python, [str(workers_dir() / "check_engine.py"), str(repo)],
                         site=serving_site(tmp_path, "1.1.0", "10.13.3.9"))
    assert other.returncode == 3 and "the engine was built with 1.2.1, this environment has 1.1.0" in other.stderr


# ----------------------------------------------------------------------------------- quantize: format × KV cache


def accepted_kv(fmt: str) -> dict[str, str]:
    """The KV-cache choices `kiln validate` accepts with ``fmt`` for target tensorrt (quantize in the engine
    runtime), each with the GPU it was validated for: H100-SXM where that runs the pair, else the first GPU of kiln's
    table that does (NVFP4 needs SM 100+: B200). Format none without a KV cache has nothing to calibrate and runs on
    the host."""
    from kiln.recipe.formats import gpus_that_run

    found = {}
    for kv in kv_cache_format_names():
        if fmt == "none" and kv == "none":
            continue
        gpus = gpus_that_run("tensorrt", fmt, kv)
        gpu = "H100-SXM" if "H100-SXM" in gpus else next(iter(gpus), "H100-SXM")
        try:
            recipe_for(f"hardware.gpu={gpu}", "target=tensorrt", f"quantization.format={fmt}",
                       f"quantization.kv_cache={kv}")
        except InputError:
            continue
        found[kv] = gpu
    return found


#: Formats whose fake-quant forward ModelOpt runs only on CUDA (the registry's ``fake_quant_needs_cuda``): on this
#: machine they run up to their CUDA-only lines (test_cuda_only_formats_quantize_up_to_their_cuda_lines_...).
CUDA_ONLY = [f for f in weight_format_names() if weight_format(f).fake_quant_needs_cuda is not None]


@matrix
@pytest.mark.parametrize("fmt", [f for f in weight_format_names() if f not in CUDA_ONLY])
def test_every_accepted_format_and_kv_cache_quantizes_in_the_image_env(fmt: str, image_python: Path, tmp_path: Path,
                                                                        tiny_dir: Path, calib_dir: Path) -> None:
    """One worker process per format, quantizing every KV-cache choice validate accepts for it, through the stand-in
    of 1.2.1's quantize_and_export (its flat KV_CACHE_CFG) with the image's ModelOpt; each checkpoint is checked as
    the quantize step checks it."""
    from kiln.steps.quantize import check_trtllm_checkpoint
    from kiln.steps.runtime_jobs import TRTLLM_DIR, quantize_job_file, write_job_file

    kvs = accepted_kv(fmt)
    assert kvs, f"validate accepts no KV cache with {fmt}"
    jobs = {}
    for kv in kvs:
        recipe = recipe_for(f"hardware.gpu={kvs[kv]}", "target=tensorrt", f"quantization.format={fmt}",
                            f"quantization.kv_cache={kv}")
        out = tmp_path / kv
        content = quantize_job_file(recipe, job_paths(out, tiny_dir, calib_dir), 4, "float32")
        jobs[kv] = write_job_file(out / "job", "quantize", content)
    run = run_in_image(image_python, [str(WORKER_JOBS), str(workers_dir() / "quantize.py"),
                                      *map(str, jobs.values())])
    outcome = last_json(run.stdout)
    assert {kv: outcome[str(path)] for kv, path in jobs.items()} == {kv: "ok" for kv in jobs}, run.stderr[-3000:]
    for kv in kvs:
        check_trtllm_checkpoint(tmp_path / kv / TRTLLM_DIR, fmt, kv, 1)
        assert (tmp_path / kv / "checkpoint" / "modelopt_state.pth").is_file()


#: ModelOpt 0.37.0's errors where an NVFP4 quantize needs CUDA on a CPU-only torch (exact text, as the worker
#: reports an exception: ``Type: message``):
#: * the fake-quant forward: modelopt/torch/quantization/tensor_quant.py:173 (_dynamic_block_quantize_impl);
#: * the TensorRT-LLM checkpoint export: modelopt/torch/quantization/backends/utils.py:28 (fp4_compatible calls
#:   torch.cuda.get_device_capability(0) unguarded; 0.47 checks torch.cuda.is_available() first), reached from
#:   export/quant_utils.py:774 to_quantized_weight -> qtensor/nvfp4_tensor.py:174 NVFP4QTensor.quantize.
FAKE_QUANT_NEEDS_CUDA = "AssertionError: amax must be a CUDA tensor for dynamic block quantization."
EXPORT_NEEDS_CUDA = "AssertionError: Torch not compiled with CUDA enabled"


@matrix
@pytest.mark.parametrize("fmt", CUDA_ONLY)
def test_cuda_only_formats_quantize_up_to_their_cuda_lines_in_the_image_env(fmt: str, image_python: Path,
                                                                            tmp_path: Path, tiny_dir: Path,
                                                                            calib_dir: Path) -> None:
    """NVFP4 (validate accepts it for target tensorrt on SM 100+, with KV cache none or fp8) in the image env, as far
    as a CPU goes — NOT a full quantize; the rest runs only on a GPU (`kiln doctor`).

    One process of kiln's quantize worker for every accepted KV cache: upstream's calibration (the stand-in
    quantize_and_export's ``mtq.quantize`` with NVFP4_DEFAULT_CFG, ModelOpt 0.37) completes and the worker saves the
    calibrated quantizer state; then the worker's own probe forward for the restore check
    (src/kiln/runtime/workers/quantize.py, ``save_state``: ``logits = model(input_ids=...)``) is the first
    fake-quant forward, and ModelOpt refuses it off CUDA (FAKE_QUANT_NEEDS_CUDA). A GPU runs the same line; nothing
    here runs a forward a GPU run would not. Upstream's quantize_and_export itself runs no forward after
    calibration: its path alone (tests/standin_runtime/quantize_only.py, a second process) calibrates and reaches
    ``export_tensorrt_llm_checkpoint``, where ModelOpt 0.37's NVFP4 weight packing asks torch for the CUDA device's
    capability (EXPORT_NEEDS_CUDA; see the constants for the lines). So on a CPU with ModelOpt 0.37 NVFP4 calibrates
    but neither fake-quantizes nor exports."""
    from kiln.steps.runtime_jobs import TRTLLM_DIR, quantize_job_file, write_job_file

    kvs = accepted_kv(fmt)
    assert kvs, f"validate accepts no KV cache with {fmt}"
    jobs = {}
    for kv, gpu in kvs.items():
        recipe = recipe_for(f"hardware.gpu={gpu}", "target=tensorrt", f"quantization.format={fmt}",
                            f"quantization.kv_cache={kv}")
        content = quantize_job_file(recipe, job_paths(tmp_path / kv, tiny_dir, calib_dir), 4, "float32")
        jobs[kv] = write_job_file(tmp_path / kv / "job", "quantize", content)
    worker = run_in_image(image_python, [str(WORKER_JOBS), str(workers_dir() / "quantize.py"),
                                         *map(str, jobs.values())])
    outcome = last_json(worker.stdout)
    assert {kv: outcome[str(path)] for kv, path in jobs.items()} == {kv: FAKE_QUANT_NEEDS_CUDA for kv in jobs}, \
        worker.stderr[-3000:]
    assert worker.stderr.count("in save_state\n") == len(jobs), worker.stderr[-3000:]  # the probe, not calibration
    for kv in kvs:
        assert (tmp_path / kv / "checkpoint" / "modelopt_state.pth").stat().st_size > 0  # calibrated, state saved
        assert not (tmp_path / kv / TRTLLM_DIR / "config.json").exists()

    upstream = run_in_image(image_python, [str(WORKER_JOBS), str(QUANTIZE_ONLY), *map(str, jobs.values())])
    outcome = last_json(upstream.stdout)
    assert {kv: outcome[str(path)] for kv, path in jobs.items()} == {kv: EXPORT_NEEDS_CUDA for kv in jobs}, \
        upstream.stderr[-3000:]
    for line in ("in quantize_and_export\n    export_tensorrt_llm_checkpoint(", "in quantize\n    fp4_compatible()",
                 "in fp4_compatible\n"):
        assert upstream.stderr.count(line) == len(jobs), (line, upstream.stderr[-3000:])


# ----------------------------------------------------------------------------------- unified export (target pytorch)


def export_hf(fmt: str, image_python: Path, out: Path, tiny_dir: Path, calib_dir: Path) -> subprocess.CompletedProcess:
    from kiln.steps.runtime_jobs import export_hf_job_file, write_job_file

    recipe = recipe_for("target=pytorch", f"quantization.format={fmt}")
    job = write_job_file(out / "job", "export_hf",
                         export_hf_job_file(recipe, job_paths(out, tiny_dir, calib_dir), 4, "float32"))
    return run_in_image(image_python, [str(workers_dir() / "export_hf.py"), "--job", str(job)])


def check_export(fmt: str, run: subprocess.CompletedProcess, out: Path) -> None:
    from kiln.steps.runtime_jobs import UNIFIED_DIR
    from kiln.steps.unified_export import check_unified_checkpoint

    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert check_unified_checkpoint(out / UNIFIED_DIR, fmt, "none")[0] is not None
    report = json.loads((out / "job" / "export_hf.result.json").read_text())
    assert report["packages"]["nvidia-modelopt"] == image_env.image_row().python_packages["nvidia-modelopt"]


def test_awq_unified_export_in_the_image_env(image_python: Path, tmp_path: Path, tiny_dir: Path,
                                             calib_dir: Path) -> None:
    """Issue 20 defect 3: under ModelOpt 0.37, export_hf_checkpoint resmooths the fused layers itself; the worker
    resmoothed them first, and the second pass crashed (no ``_pre_quant_scale``)."""
    check_export("int4_awq", export_hf("int4_awq", image_python, tmp_path, tiny_dir, calib_dir), tmp_path)


@matrix
@pytest.mark.parametrize("fmt", ["w4a8_awq", "fp8"])
def test_unified_export_in_the_image_env(fmt: str, image_python: Path, tmp_path: Path, tiny_dir: Path,
                                         calib_dir: Path) -> None:
    check_export(fmt, export_hf(fmt, image_python, tmp_path, tiny_dir, calib_dir), tmp_path)


# ----------------------------------------------------------------------------------- a hub model, through the container


@pytest.fixture(scope="module")
def hub_build(tmp_path_factory, image_python: Path, tiny_dir: Path):
    """configs/tiny-llama.yaml with the built-in model put into a Hugging Face hub cache (HF_HOME) and named
    ``hf:kiln-test/tiny-llama``, int4_wo weights with an INT8 KV cache, target tensorrt, built to the evaluate step
    with every job in the stand-in container runtime running the image environment's python."""
    if shutil.which("bwrap") is None:
        pytest.skip("the stand-in container runtime needs bubblewrap (apt-get install bubblewrap)")
    from tests.standin_runtime import install

    root = tmp_path_factory.mktemp("hub-build")
    snapshot = hub_cache(tiny_dir, root / "hf" / "hub", HUB_REPO)
    s = install(root / "rt", python=image_python)
    env = {**os.environ, **s.env, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    sets = [w for o in ["target=tensorrt", "hardware.gpu=H100-SXM", f"model.source=hf:{HUB_REPO}",
                        "quantization.format=int4_wo", "quantization.kv_cache=int8", *SMALL] for w in ("--set", o)]
    run = subprocess.run([sys.executable, "-m", "kiln", "build", str(RECIPE), *sets, "--to", "evaluate", "--quiet"],
                         cwd=root, capture_output=True, text=True, timeout=900, env=env)
    return root, s, snapshot, run


def _mounts(argv: list[str]) -> dict[str, tuple[str, str]]:
    return {argv[i + 1].rsplit(":", 2)[1]: (argv[i + 1].rsplit(":", 2)[0], argv[i + 1].rsplit(":", 2)[2])
            for i, w in enumerate(argv) if w == "--volume"}


def test_a_hub_model_reaches_the_container_as_real_files(hub_build) -> None:
    """Issue 20 defect 1: the snapshot's files are relative links into ../../blobs; mounting only the snapshot left
    them dangling in the container. The repository folder is mounted and the worker reads the snapshot in it."""
    root, s, snapshot, run = hub_build
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    quantize = next(a for a in s.runs() if "/kiln/workers/quantize.py" in a)
    host, mode = _mounts(quantize)["/kiln/in/model"]
    assert (Path(host), mode) == (snapshot.parent.parent, "ro")  # models--kiln-test--tiny-llama
    job = json.loads((root / "build" / "tiny-llama" / "quantize" / "job" / "quantize.json").read_text())
    assert job["model_dir"] == f"/kiln/in/model/snapshots/{snapshot.name}"
    report = json.loads((root / "build" / "tiny-llama" / "quantize" / "job" / "quantize.result.json").read_text())
    assert report["packages"]["nvidia-modelopt"] == image_env.image_row().python_packages["nvidia-modelopt"]
    assert report["packages"]["transformers"] == image_env.image_row().python_packages["transformers"]


def test_int8_kv_cache_with_weight_only_weights_in_the_image_env(hub_build) -> None:
    """Issue 20 defect 6: the worker read ``KV_CACHE_CFG["quant_cfg"]``; 1.2.1's KV_CACHE_CFG is a flat dict of
    quantizer patterns (KeyError: 'quant_cfg' after a full quantize_and_export)."""
    root, _, _, run = hub_build
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((root / "build" / "tiny-llama" / "quantize" / "checkpoint" / QUANT_RECORD).read_text())
    ckpt = json.loads((root / "build" / "tiny-llama" / "quantize" / "trtllm_checkpoint" / "config.json").read_text())
    assert (ckpt["quantization"]["quant_algo"], ckpt["quantization"]["kv_cache_quant_algo"]) == ("W4A16", "INT8")
    assert (record["format"], record["kv_cache"], record["graded"]) == ("int4_wo", "int8", "weights")


def test_evaluate_in_the_image_env(hub_build) -> None:
    root, s, _, run = hub_build
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert any("/kiln/workers/evaluate.py" in a for a in s.runs())
    result = json.loads((root / "build" / "tiny-llama" / "evaluate" / "job" / "evaluate.result.json").read_text())
    assert result["tokens"] > 0 and result["kl"] >= 0 and result["restore_error"] <= 1e-3


def test_the_workers_hold_one_model_and_save_no_weight_copy_in_the_image_env(hub_build) -> None:
    """Issue 20 defects 4 and 5 under ModelOpt 0.37 (no extra build: the hub build's own jobs). Evaluate scored the
    base model, kept its log-probabilities on the scratch disk (removed after), then the quantized one: one model at a
    time. The weight-only fake-quant state holds ModelOpt's state and the quantizers' tensors, not mto.save's copy of
    every weight."""
    root, _, _, run = hub_build
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    build = root / "build" / "tiny-llama"
    result = json.loads((build / "evaluate" / "job" / "evaluate.result.json").read_text())
    assert result["models_at_once"] == 1 and result["base_logprob_bytes"] > 0
    assert not (build / "evaluate" / "base_logprobs").exists()
    ckpt = build / "quantize" / "checkpoint"
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert weights > 0 and (ckpt / "modelopt_state.pth").stat().st_size < 0.1 * weights
    report = json.loads((build / "quantize" / "job" / "quantize.result.json").read_text())
    assert report["state"]["unchanged_weights"] > 0 and report["state"]["bytes"] < 0.1 * weights
