"""Preflight: before any work, everything the run's steps need from this machine, all problems at once.

For the steps a run will execute, ``kiln build`` checks:

* a GPU and its architecture, where a step runs in the engine runtime (TensorRT-LLM's quantization, the engine
  build, the evaluation of what it quantized all run on this machine's GPU): none at all, an architecture the
  format does not run on, or another GPU than the recipe's ``hardware.gpu`` (an engine is built for one);
* the engine runtime itself: the container engine and its daemon, the image present locally (or the exact pull
  command), or the local interpreter;
* the host's NVIDIA driver (``nvidia-smi``) against the image's minimum (the container table's ``min_driver``): an
  older driver cannot run the image's CUDA, and fails only once the first job starts;
* free disk for every file the run writes (:func:`disk_budget`, from the planner's figures): the quantized
  checkpoint, the quantizer state (plus the weights SmoothQuant/AWQ calibration rewrote), the unquantized model
  where it cannot be hard-linked, the evaluation's base log-probabilities (the evaluate worker's scratch), the
  engine, and the repository when it lands on another disk;
* a Hugging Face token for gated models that are not already downloaded.

On a machine without a GPU a tensorrt recipe is refused here, and the message says how to calibrate and gate on
the CPU instead (``--set quantization.runtime=host --to evaluate``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Optional

from kiln.recipe.containers import row_for
from kiln.recipe.formats import format_refusal, kv_refusal
from kiln.recipe.gpus import detected_gpu_names, driver_older, host_driver_version, lookup_gpu
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import HF_PREFIX, Recipe
from kiln.runtime.engine_runtime import engine_runtime_for, runtime_image
from kiln.steps.runtime_jobs import uses_engine_runtime
from kiln.util.errors import KilnError

#: Hub organisations whose models ask every user to accept a licence before download (the model pages say so):
#: a download needs a token of an account that accepted it.
GATED_ORGS = ("meta-llama",)
#: Bytes written per byte of quantized weights for the quantized checkpoint and for the engine (scales, metadata,
#: the engine's own tables: about a tenth more than the weights).
_WEIGHTS_OVERHEAD = 1.1
#: The quantizers' own tensors (amax, scales, pre_quant_scale), per byte of the unquantized model: well under 1%.
_QUANTIZER_SHARE = 0.01
GIB = 1024**3


class PreflightError(KilnError):
    """This machine cannot run what the build asks; every problem found, each with its fix."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("this machine cannot run the build:\n  - " + "\n  - ".join(problems))


def runtime_steps(recipe: Recipe, steps: Iterable[str]) -> list[str]:
    """Which of ``steps`` run in the engine runtime."""
    return [s for s in steps if uses_engine_runtime(recipe, s)]


def check(loaded: LoadedRecipe, steps: list[str], build_root: Path) -> list[str]:
    """Every problem that would stop ``steps`` of this recipe on this machine (empty: go)."""
    recipe = loaded.recipe
    problems: list[str] = []
    in_runtime = runtime_steps(recipe, steps)
    if in_runtime:
        problems += _gpu_problems(recipe, in_runtime)
        problems += _driver_problems(recipe)
        problems += _worker_memory_problems(loaded, in_runtime)
        problems += engine_runtime_for(recipe, build_root).problems()
    problems += _disk_problems(loaded, steps, build_root)
    problems += _token_problems(recipe, steps)
    return problems


def _gpu_problems(recipe: Recipe, in_runtime: list[str]) -> list[str]:
    names = detected_gpu_names()
    what = ", ".join(in_runtime)
    if not names:
        return [f"no GPU on this machine: {what} run{'s' if len(in_runtime) == 1 else ''} in the engine runtime "
                "(TensorRT-LLM on a CUDA GPU). To calibrate and run the quality gate on the CPU with kiln's own "
                f"ModelOpt instead: kiln build {recipe.name} --set quantization.runtime=host --to evaluate; to "
                "build the engine, run on a machine with an NVIDIA GPU and the NVIDIA Container Toolkit"]
    problems = []
    here = lookup_gpu(names[0])
    if here is None:
        return [f"this machine's GPU {names[0]!r} is not in kiln's GPU table, so its architecture is unknown: set "
                "hardware.gpu to the closest known GPU, or add it to the table"]
    declared = lookup_gpu(recipe.hardware.gpu) if recipe.hardware.gpu else None
    if declared is not None and declared.name != here.name:
        problems.append(f"the recipe targets {declared.name} (hardware.gpu) but this machine has {here.name}: an "
                        f"engine is built for one GPU architecture. Build on a {declared.name}, or set "
                        f"hardware.gpu: {here.name}")
    target = "tensorrt" if recipe.target == "tensorrt" else recipe.target
    for key, refusal in (("quantization.format", format_refusal(recipe.quantization.format, target, here.sm, here.name)),
                         ("quantization.kv_cache", kv_refusal(recipe.quantization.kv_cache, target, here.sm,
                                                              here.name))):
        if refusal is not None:
            problems.append(f"{key}: {refusal.reason} on this machine's {here.name}" +
                            (f"; {refusal.hint}" if refusal.hint else ""))
    return problems


def _driver_problems(recipe: Recipe) -> list[str]:
    """The host driver against the container image's minimum (nothing to say without a driver: no GPU was already
    reported; nor for a local runtime or an image the table does not know, whose CUDA kiln cannot tell)."""
    if recipe.engine_runtime.kind != "container":
        return []
    image = runtime_image(recipe)
    row = row_for(image)
    have = host_driver_version()
    if row is None or row.min_driver is None or have is None or not driver_older(have, row.min_driver):
        return []
    return [f"this machine's NVIDIA driver is {have}, and {image} (CUDA {row.cuda or '?'}) needs driver "
            f"{row.min_driver} or later (kiln's container table, trtllm_containers.json): update the driver, or set "
            "engine_runtime.image / engine_runtime.trtllm_version to an image whose CUDA this driver runs"]


def _worker_memory_problems(loaded: LoadedRecipe, in_runtime: list[str]) -> list[str]:
    """The workers' memory on the recipe's GPUs (kiln.plan.workers): the unquantized model, one copy at a time,
    spread over hardware.count GPUs (tp × pp when unset). Nothing to say when kiln cannot plan the recipe."""
    if not {"quantize", "evaluate"} & set(in_runtime):
        return []
    from kiln.plan import PlanError, plan_for
    from kiln.plan.workers import recipe_worker_memory

    try:
        workers = recipe_worker_memory(loaded, plan_for(loaded))
    except PlanError:
        return []
    return [] if workers.fits else [f"the quantize/evaluate workers' model {workers.verdict()}"]


def _device(path: Path) -> tuple[Path, int]:
    """The nearest existing folder of ``path`` and its filesystem's device id."""
    where = path.resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, where.stat().st_dev


def _model_on_disk(loaded: LoadedRecipe) -> Optional[Path]:
    """Where the unquantized model's files are, if they are already on this machine (a local folder, or a
    downloaded hub snapshot); None when the run will download it."""
    source = loaded.recipe.model.source
    if not source.startswith(HF_PREFIX):
        path = Path(source).expanduser()
        return path if path.exists() else None
    repo, _, revision = source[len(HF_PREFIX):].partition("@")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except Exception:  # noqa: BLE001 - not downloaded
        return None


def disk_budget(loaded: LoadedRecipe, steps: list[str], build_root: Path,
                repo_root: Optional[Path] = None) -> Optional[list[tuple[Path, str, int]]]:
    """Every file the run's ``steps`` write, as (the disk's folder, what, bytes); None when kiln cannot plan the
    model. Figures from the planner; see the module docstring for what each step writes."""
    from kiln.plan import PlanError, plan_for, recipe_model_config
    from kiln.plan.formats import base_dtype_bytes
    from kiln.recipe.formats import weight_format
    from kiln.recipe.gpus import GPUS
    from kiln.recipe.schema import quantization_runtime

    recipe = loaded.recipe
    if recipe_model_config(loaded) is None:
        return None
    try:  # bytes do not depend on the GPU; any GPU of the table plans them
        plan = plan_for(loaded, recipe.hardware.gpu or next(iter(GPUS.values())))
    except PlanError:
        return None
    quantized = plan.weights.total_bytes
    unquantized = plan.weights.total_params * base_dtype_bytes(str(plan.weights.base_dtype))
    linear = plan.weights.quantized_params * base_dtype_bytes(str(plan.weights.base_dtype))
    build = build_root
    items: list[tuple[Path, str, int]] = []
    if "quantize" in steps:
        fmt = weight_format(recipe.quantization.format)
        items.append((build, "the quantized checkpoint", int(quantized * _WEIGHTS_OVERHEAD)))
        if quantization_runtime(recipe) == "host":  # kiln's own ModelOpt: mto.save and a re-saved checkpoint
            items.append((build, "the quantizer state (mto.save: every weight)", unquantized))
            items.append((build, "the unquantized checkpoint, saved in the model dtype", unquantized))
            return items + _later_steps(loaded, steps, build, repo_root, plan, quantized)
        folds = fmt.calibration.algorithm == "smoothquant" or "AWQ" in (fmt.modelopt_config or "")
        items.append((build, "the quantizer state" + (" (with the linear weights the calibration rescaled)"
                                                      if folds else ""),
                      int(unquantized * _QUANTIZER_SHARE) + (linear if folds else 0)))
        model = _model_on_disk(loaded)
        if model is None or _device(model)[1] != _device(build)[1]:
            why = "downloaded" if model is None else f"copied from {model} (another disk: no hard links)"
            if model is None and recipe.model.source.startswith(HF_PREFIX):
                from huggingface_hub.constants import HF_HUB_CACHE

                items.append((Path(HF_HUB_CACHE), "the unquantized model, downloaded to the hub cache", unquantized))
                if _device(Path(HF_HUB_CACHE))[1] != _device(build)[1]:
                    items.append((build, "the unquantized model, copied beside the quantizers", unquantized))
            else:
                items.append((build, f"the unquantized model, {why}", unquantized))
    return items + _later_steps(loaded, steps, build, repo_root, plan, quantized)


def _later_steps(loaded: LoadedRecipe, steps: list[str], build: Path, repo_root: Optional[Path], plan,
                 quantized: int) -> list[tuple[Path, str, int]]:
    from kiln.plan.workers import recipe_worker_memory
    from kiln.recipe.schema import quantization_runtime

    recipe = loaded.recipe
    items = []
    if "evaluate" in steps and recipe.evaluation.enabled and quantization_runtime(recipe) == "engine":
        items.append((build, "the base model's log-probabilities (evaluate's scratch, removed after)",
                      recipe_worker_memory(loaded, plan).base_logprob_bytes))
    if "engine" in steps and recipe.target == "tensorrt":
        items.append((build, "the engine", int(quantized * _WEIGHTS_OVERHEAD)))
    if "package" in steps and repo_root is not None and _device(repo_root)[1] != _device(build)[1]:
        items.append((repo_root, "the repository's engine or checkpoint (another disk: copied, not linked)",
                      int(quantized * _WEIGHTS_OVERHEAD)))
    return items


def _disk_problems(loaded: LoadedRecipe, steps: list[str], build_root: Path,
                   repo_root: Optional[Path] = None) -> list[str]:
    items = disk_budget(loaded, steps, build_root, repo_root)
    if not items:
        return []
    problems = []
    by_disk: dict[int, list[tuple[Path, str, int]]] = {}
    for item in items:
        by_disk.setdefault(_device(item[0])[1], []).append(item)
    for entries in by_disk.values():
        where = _device(entries[0][0])[0]
        need = sum(b for _, _, b in entries)
        free = shutil.disk_usage(where).free
        if free >= need:
            continue
        parts = ", ".join(f"{what} {b / GIB:.1f} GiB" for _, what, b in entries)
        problems.append(f"not enough disk under {entries[0][0]}: this run writes about {need / GIB:.1f} GiB there "
                        f"({parts}) and {where} has {free / GIB:.1f} GiB free: free space, or point --build-dir "
                        "at a larger disk")
    return problems


def _token_problems(recipe: Recipe, steps: list[str]) -> list[str]:
    source = recipe.model.source
    if "quantize" not in steps or not source.startswith(HF_PREFIX):
        return []
    repo, _, revision = source[len(HF_PREFIX):].partition("@")
    if repo.split("/", 1)[0].lower() not in GATED_ORGS:
        return []
    from huggingface_hub import get_token, snapshot_download

    try:
        snapshot_download(repo, revision=revision or None, local_files_only=True)
        return []  # already downloaded: no token needed
    except Exception:  # noqa: BLE001 - not in the local cache
        pass
    if get_token():
        return []
    return [f"model.source: {repo} is a gated model (accept its licence on huggingface.co) and is not downloaded "
            "yet, and no Hugging Face token is set: export HF_TOKEN=… or run `hf auth login`"]
