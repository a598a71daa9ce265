"""Engine: compile the TensorRT-LLM 1.2.x engine from the quantize step's checkpoint (`target: tensorrt`).

The build runs in the recipe's engine runtime (``engine_runtime``: the NGC container that will serve the engine,
or a named local TensorRT-LLM): kiln never imports ``tensorrt_llm``. The step first reads the TensorRT-LLM and
TensorRT versions inside the runtime and refuses to build when they are not the ones the container table gives
for the recipe — an engine only loads where the same versions serve it. Then ``trtllm-build`` runs with every
``engine`` field mapped to its 1.2 flag (:mod:`kiln.steps.trtllm_args`), and the engine's ``config.json`` is read
back against the recipe. The versions, the image and its digest go into the manifest and ``kiln.json``.

Whether this machine can run the build at all (a GPU, its architecture, the container engine and image, disk)
is checked for every step of a run before any work (:mod:`kiln.pipeline.preflight`).

For `target: reference` and `target: pytorch` there is no engine: the step records that the CPU reference runtime,
or TensorRT-LLM's PyTorch backend loading the unified checkpoint, will serve the quantized model.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal, Optional

from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe
from kiln.runtime.engine_runtime import ContainerRuntime, check_versions, engine_runtime_for, read_versions
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.steps.resolve import ResolveResult
from kiln.steps.runtime_jobs import ENGINE_SUBDIR, TRTLLM_DIR, engine_job, engine_mounts, runtime_identity
from kiln.steps.trtllm_args import verify_engine_config
from kiln.util.errors import KilnError

__all__ = ["ENGINE_SUBDIR", "EngineResult", "SPEC", "build_engine", "describe", "required_files"]

REFERENCE_NOTE = ("target 'reference': no engine is compiled; the CPU reference runtime (PyTorch in a Triton "
                  "Python model, tensorrt_llm tensor contract) serves the quantized checkpoint — a test and "
                  "development vehicle, not the fast path")
PYTORCH_NOTE = ("target 'pytorch': no engine is compiled; TensorRT-LLM's PyTorch backend loads the unified Hugging "
                "Face checkpoint (quantize's unified_checkpoint/) when the server starts")


class EngineResult(StepResult):
    """Which runtime serves the model and, for a TensorRT-LLM engine, what built it: the versions read inside the
    engine runtime (an engine only loads in a container with the same TensorRT-LLM and TensorRT), the image and
    its digest (when the container engine can tell), and the exact build command."""

    runtime: Literal["reference", "tensorrt", "pytorch"]
    tensorrt_llm: Optional[str] = None
    tensorrt: Optional[str] = None
    built_in: Optional[str] = None
    """`container` or `local`."""
    image: Optional[str] = None
    image_digest: Optional[str] = None
    command: tuple[str, ...] = ()


def build_engine(ctx: StepContext) -> EngineResult:
    r = ctx.recipe
    if r.target == "reference":
        (ctx.out_dir / "engine.json").write_text(json.dumps({"runtime": "reference", "note": REFERENCE_NOTE}, indent=2))
        return EngineResult(summary="no engine (reference target: the CPU reference runtime serves the checkpoint)",
                            runtime="reference")
    if r.target == "pytorch":
        (ctx.out_dir / "engine.json").write_text(json.dumps({"runtime": "pytorch", "note": PYTORCH_NOTE}, indent=2))
        return EngineResult(summary="no engine (pytorch target: the PyTorch backend loads the unified checkpoint)",
                            runtime="pytorch")
    rt = engine_runtime_for(r, ctx.build_root)
    logs = ctx.out_dir / "logs"
    with ctx.status(f"reading the versions in {rt.describe()}"):
        versions = read_versions(rt, logs / "probe.log")
    mismatch = check_versions(r, versions)
    if mismatch:
        raise KilnError("the engine runtime is not what the recipe asks for: " + "; ".join(mismatch) + ". An engine "
                        "only loads in a container with the TensorRT-LLM and TensorRT that built it: set "
                        "engine_runtime.image to an image of the table's, or engine_runtime.trtllm_version to what "
                        "this image ships")
    job = engine_job(r, engine_mounts(ctx.inputs["quantize"] / TRTLLM_DIR, ctx.out_dir))
    cmd = rt.command(job)
    ctx.log("  " + shlex.join(cmd))
    with ctx.status("trtllm-build (minutes)") as update:
        rt.run(job, logs / "trtllm-build.log", update)
    engine_dir = ctx.out_dir / ENGINE_SUBDIR
    try:
        engine_cfg = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(f"trtllm-build wrote no readable {engine_dir / 'config.json'} ({exc}); see "
                        f"{logs / 'trtllm-build.log'}") from None
    mismatches = verify_engine_config(r, engine_cfg, ctx.result(ResolveResult).max_seq_len)
    if mismatches:
        raise KilnError("the engine does not match the recipe:\n  " + "\n  ".join(mismatches))
    ranks = r.parallelism.tp * r.parallelism.pp
    missing = [f"rank{i}.engine" for i in range(ranks) if not (engine_dir / f"rank{i}.engine").is_file()]
    if missing:
        raise KilnError(f"trtllm-build did not write {', '.join(missing)}")
    image = rt.image if isinstance(rt, ContainerRuntime) else None
    digest = rt.digest() if isinstance(rt, ContainerRuntime) else None
    record = {"runtime": "tensorrt", "tensorrt_llm": versions.tensorrt_llm, "tensorrt": versions.tensorrt,
              "built_in": rt.kind, "image": image, "image_digest": digest, "runtime_report": versions.as_dict(),
              "command": cmd}
    (ctx.out_dir / "engine.json").write_text(json.dumps(record, indent=2))
    where = f"{image}" + (f"@{digest}" if digest and "@" not in (image or "") else "") if image else rt.describe()
    return EngineResult(summary=f"engine built with TensorRT-LLM {versions.tensorrt_llm} / TensorRT "
                        f"{versions.tensorrt} in {where}", runtime="tensorrt", tensorrt_llm=versions.tensorrt_llm,
                        tensorrt=versions.tensorrt, built_in=rt.kind, image=image, image_digest=digest,
                        command=tuple(cmd))


def describe(loaded: LoadedRecipe, build_root: Path = Path("build")) -> list[str]:
    """--dry-run: the exact command the engine runtime will run."""
    r = loaded.recipe
    if r.target == "reference":
        return [REFERENCE_NOTE]
    if r.target == "pytorch":
        return [PYTORCH_NOTE]
    rt = engine_runtime_for(r, build_root)
    base = build_root / r.name
    job = engine_job(r, engine_mounts(base / "quantize" / TRTLLM_DIR, base / "engine"))
    return ["$ " + shlex.join(rt.command(job))]


def required_files(recipe: Recipe) -> tuple[str, ...]:
    """engine.json always; for target tensorrt also the engine's config.json and one engine file per rank."""
    if recipe.target != "tensorrt":
        return ("engine.json",)
    ranks = recipe.parallelism.tp * recipe.parallelism.pp
    return ("engine.json", f"{ENGINE_SUBDIR}/config.json") + tuple(f"{ENGINE_SUBDIR}/rank{r}.engine"
                                                                    for r in range(ranks))


SPEC = StepSpec(
    name="engine",
    fn=build_engine,
    result=EngineResult,
    # engine_runtime.* is not a key: where the engine is built (kind, python, image, version) enters through
    # `runtime` when the target builds one there; the reference and pytorch targets build nothing there.
    keys=("engine", "parallelism", "target", "hardware.gpu"),
    files=required_files,
    after=("resolve", "quantize"),
    runtime=runtime_identity("engine"),
    gpu_dependent=lambda recipe: recipe.target == "tensorrt",
    describe=describe,
)
