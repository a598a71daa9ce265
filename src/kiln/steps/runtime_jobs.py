"""The jobs kiln's steps run in the engine runtime (see :mod:`kiln.runtime`), built in one place so that the
step and ``kiln build --dry-run`` show the same command line.

Mount points inside the runtime: ``/kiln/in/<name>`` read-only inputs, ``/kiln/job`` the job file (read-only),
``/kiln/out`` the step's temporary output (the only writable input besides ``/kiln/scratch``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from kiln.recipe.formats import kv_cache_format, weight_format
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe, quantization_runtime
from kiln.runtime.engine_runtime import ROOT, EngineRuntime, Job, Mount, engine_runtime_for

IN = f"{ROOT}/in"
OUT = f"{ROOT}/out"
JOB = f"{ROOT}/job"
ENGINE_SUBDIR = "trtllm_engine"
TRTLLM_DIR = "trtllm_checkpoint"
#: Target pytorch: ModelOpt's unified Hugging Face checkpoint (see kiln.steps.unified_export).
UNIFIED_DIR = "unified_checkpoint"
CHECKPOINT_DIR = "checkpoint"
MODELOPT_STATE = "modelopt_state.pth"
RESTORE_CHECK = "restore_check.safetensors"
#: The evaluate worker's scratch folder for the base model's log-probabilities (removed when it is done).
BASE_LOGPROBS_DIR = "base_logprobs"
PROBE_TEXT = "kiln probe: the quick brown fox jumps over the lazy dog."
#: A generous token limit for TensorRT-LLM's own tokenizer (upstream's default is 2048).
TOKENIZER_MAX_SEQ_LEN = 2048


def uses_engine_runtime(recipe: Recipe, step: str) -> bool:
    """Whether ``step`` runs in the engine runtime for this recipe."""
    if step == "engine":
        return recipe.target == "tensorrt"
    if step in ("quantize", "evaluate"):
        return quantization_runtime(recipe) == "engine"
    return False


def runtime_identity(step: str):
    """A StepSpec.runtime hook: the runtime's identity when ``step`` runs in it (for the fingerprint)."""

    def identity(loaded: LoadedRecipe, build_root: Path) -> Optional[dict[str, str]]:
        if not uses_engine_runtime(loaded.recipe, step):
            return None
        return engine_runtime_for(loaded.recipe, build_root).identity()

    return identity


def worker_placement(loaded: LoadedRecipe) -> Optional[dict[str, Any]]:
    """How the workers spread the model over the recipe's GPUs (``device_map="auto"`` with ``max_memory`` per GPU,
    from the planner: kiln.plan.workers); None when kiln cannot plan the recipe (unknown GPU or model config): the
    worker then lets accelerate spread the model over every GPU it sees."""
    from kiln.plan import PlanError, plan_for
    from kiln.plan.workers import recipe_worker_memory

    try:
        return recipe_worker_memory(loaded, plan_for(loaded)).placement()
    except PlanError:
        return None


def _job_mount(job_dir: Path) -> Mount:
    return Mount(job_dir, JOB, True)


def write_job_file(job_dir: Path, name: str, content: Mapping[str, Any]) -> Path:
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / f"{name}.json"
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ quantize


def hub_snapshot(model_dir: Path) -> Optional[tuple[Path, str]]:
    """For a Hugging Face hub cache snapshot (``…/models--org--name/snapshots/<rev>``) or its repository folder:
    (the repository folder, the snapshot's path in it). None for any other directory.

    A snapshot's files are relative symlinks ``../../blobs/<etag>``: mounting the snapshot alone leaves them
    dangling in a container, so jobs mount the repository folder and read the snapshot inside it."""
    if model_dir.parent.name == "snapshots" and model_dir.parent.parent.name.startswith("models--"):
        return model_dir.parent.parent, f"snapshots/{model_dir.name}"
    if model_dir.name.startswith("models--") and (model_dir / "refs" / "main").is_file():
        revision = (model_dir / "refs" / "main").read_text(encoding="utf-8").strip()
        return model_dir, f"snapshots/{revision}"
    if model_dir.name.startswith("models--"):  # not downloaded yet (--dry-run): the folder the run will mount
        return model_dir, "snapshots/<revision>"
    return None


def model_mount(model_dir: Path) -> Mount:
    """The read-only mount that makes the model's files real inside the runtime (see :func:`hub_snapshot`)."""
    hub = hub_snapshot(model_dir)
    return Mount(hub[0] if hub else model_dir, f"{IN}/model")


def model_path(paths: Mapping[str, str], model_dir: Path) -> str:
    """Where the job reads the model: the mount itself, or the snapshot inside a mounted hub repository folder."""
    hub = hub_snapshot(model_dir)
    return f"{paths['model']}/{hub[1]}" if hub else paths["model"]


def quantize_mounts(model_dir: Path, calib_dir: Path, out_dir: Path) -> dict[str, Mount]:
    return {"model": model_mount(model_dir), "calib": Mount(calib_dir, f"{IN}/calib"),
            "job": _job_mount(out_dir / "job"), "out": Mount(out_dir, OUT, False)}


def quantize_job_file(recipe: Recipe, paths: Mapping[str, str], samples: int, dtype: str,
                      placement: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What the quantize worker is told (paths as the runtime sees them)."""
    q = recipe.quantization
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    fake = fmt.engine_fake_quant
    out = paths["out"]
    return {
        "model_dir": paths["model"], "calib_dir": paths["calib"], "output_dir": f"{out}/{TRTLLM_DIR}",
        "modelopt_state": f"{out}/{CHECKPOINT_DIR}/{MODELOPT_STATE}", "restore_check": f"{out}/{RESTORE_CHECK}",
        "result": f"{out}/job/quantize.result.json",
        "qformat": fmt.trtllm_qformat, "kv_cache_dtype": kv.trtllm_kv_cache_dtype, "kv_preset": kv.modelopt_config,
        "kv_num_bits": kv.modelopt_num_bits,
        "calib_size": samples, "batch_size": q.calibration.batch_size,
        "calib_max_seq_length": q.calibration.max_seq_len, "awq_block_size": q.awq_block_size,
        "tp_size": recipe.parallelism.tp, "pp_size": recipe.parallelism.pp, "seed": q.calibration.seed,
        "dtype": dtype, "tokenizer_max_seq_length": TOKENIZER_MAX_SEQ_LEN,
        "exclude_patterns": [p if p.endswith("*") else f"{p}.*" for p in q.exclude_modules if p != "lm_head"],
        "smoothquant_alpha": q.smoothquant_alpha if fmt.calibration.algorithm == "smoothquant" else None,
        "fake_quant": ({"preset": fake.preset, "disable": list(fake.disable), "per_channel": fake.per_channel}
                       if fake else None),
        "probe_text": PROBE_TEXT, "placement": dict(placement) if placement else None,
    }


def quantize_job(rt: EngineRuntime, mounts: dict[str, Mount]) -> Job:
    return Job("quantize", mounts, lambda p: [rt.python(), f"{p['workers']}/quantize.py", "--job",
                                              f"{p['job']}/quantize.json"], workdir="out")


def export_hf_job_file(recipe: Recipe, paths: Mapping[str, str], samples: int, dtype: str,
                       placement: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What the unified-checkpoint worker (target pytorch) is told: the registry's ModelOpt presets by name (the
    image's ModelOpt builds them), the recipe's choices and the paths as the runtime sees them."""
    q = recipe.quantization
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    out = paths["out"]
    return {
        "model_dir": paths["model"], "calib_dir": paths["calib"], "output_dir": f"{out}/{UNIFIED_DIR}",
        "modelopt_state": f"{out}/{CHECKPOINT_DIR}/{MODELOPT_STATE}", "restore_check": f"{out}/{RESTORE_CHECK}",
        "result": f"{out}/job/export_hf.result.json",
        "preset": fmt.modelopt_config, "uses_block_size": fmt.uses_awq_block_size, "awq_block_size": q.awq_block_size,
        "smoothquant_alpha": q.smoothquant_alpha if fmt.calibration.algorithm == "smoothquant" else None,
        "kv_preset": kv.modelopt_config, "kv_num_bits": kv.modelopt_num_bits,
        "calib_size": samples, "calib_max_seq_length": q.calibration.max_seq_len, "seed": q.calibration.seed,
        "dtype": dtype, "exclude_patterns": [p if p.endswith("*") else f"{p}.*" for p in q.exclude_modules],
        "probe_text": PROBE_TEXT, "placement": dict(placement) if placement else None,
    }


def export_hf_job(rt: EngineRuntime, mounts: dict[str, Mount]) -> Job:
    return Job("export-hf", mounts, lambda p: [rt.python(), f"{p['workers']}/export_hf.py", "--job",
                                               f"{p['job']}/export_hf.json"], workdir="out")


# ------------------------------------------------------------------------------------------------ evaluate


def evaluate_mounts(quantize_dir: Path, out_dir: Path) -> dict[str, Mount]:
    return {"quantize": Mount(quantize_dir, f"{IN}/quantize"), "job": _job_mount(out_dir / "job"),
            "out": Mount(out_dir, OUT, False)}


def evaluate_job_file(paths: Mapping[str, str], dtype: str, batch_size: int, pad_id: int,
                      placement: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What the evaluate worker is told. ``scratch_dir``: where it keeps the base model's log-probabilities (fp16)
    between its two passes; it removes them when done."""
    q = paths["quantize"]
    return {"model_dir": f"{q}/{CHECKPOINT_DIR}", "modelopt_state": f"{q}/{CHECKPOINT_DIR}/{MODELOPT_STATE}",
            "restore_check": f"{q}/{RESTORE_CHECK}", "sequences": f"{paths['job']}/sequences.json",
            "result": f"{paths['out']}/job/evaluate.result.json", "dtype": dtype, "batch_size": batch_size,
            "pad_id": pad_id, "scratch_dir": f"{paths['out']}/{BASE_LOGPROBS_DIR}",
            "placement": dict(placement) if placement else None}


def evaluate_job(rt: EngineRuntime, mounts: dict[str, Mount]) -> Job:
    return Job("evaluate", mounts, lambda p: [rt.python(), f"{p['workers']}/evaluate.py", "--job",
                                              f"{p['job']}/evaluate.json"], workdir="out")


# ------------------------------------------------------------------------------------------------ engine


def engine_mounts(checkpoint: Path, out_dir: Path) -> dict[str, Mount]:
    return {"checkpoint": Mount(checkpoint, f"{IN}/checkpoint"), "out": Mount(out_dir, OUT, False)}


def engine_job(recipe: Recipe, mounts: dict[str, Mount]) -> Job:
    from kiln.steps.trtllm_args import trtllm_build_args

    return Job("trtllm-build", mounts,
               lambda p: ["trtllm-build", *trtllm_build_args(recipe, p["checkpoint"], f"{p['out']}/{ENGINE_SUBDIR}")],
               workdir="out")
