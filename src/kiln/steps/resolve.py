"""Resolve: pin down everything the recipe leaves open, before any heavy work.

Finds the model (building the built-in one if absent), reads its config, fills limits the recipe leaves to
the model (max_seq_len), records the GPU (named or detected) and whether the plan fits it, and writes the
resolved recipe next to the outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kiln.models.loading import model_source_hash
from kiln.recipe.errors import Problem
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.render import recipe_yaml
from kiln.recipe.schema import BUILTIN_PREFIX, HF_PREFIX
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.util.errors import InputError


def fit_warnings(loaded: LoadedRecipe) -> list[Problem]:
    """A 'does not fit' plan verdict, as warnings, when the recipe names its GPU (tensorrt target)."""
    r = loaded.recipe
    if r.target != "tensorrt" or not r.hardware.gpu:
        return []
    from kiln.plan import PlanError, plan_for
    from kiln.recipe.gpus import lookup_gpu

    if lookup_gpu(r.hardware.gpu) is None:
        return []  # the recipe rules already report the unknown GPU
    try:
        result = plan_for(loaded)
    except PlanError as exc:
        if "no model config" in str(exc):
            return []
        return [Problem("warning", "model.source", f"cannot plan memory: {exc}", loaded.origin_of("model.source"))]
    if result.fits:
        return []
    return [Problem("warning", "hardware.gpu", f"does not fit: {result.verdict}", loaded.origin_of("hardware.gpu"),
                    "; ".join(result.advice))]


class ResolveResult(StepResult):
    """What resolve pinned down: the model directory (None for hub models, downloaded by quantize), the
    sequence limit, and the GPU (named by the recipe or detected here)."""

    model_dir: Optional[str]
    max_seq_len: Optional[int]
    gpu: Optional[str]
    gpu_count: Optional[int]
    gpu_detected: bool = False


def resolve(ctx: StepContext) -> ResolveResult:
    r = ctx.recipe
    source = r.model.source
    if source.startswith(BUILTIN_PREFIX):
        from kiln.models.tiny import ensure_tiny_llama

        with ctx.status("building the built-in tiny-llama (first run only)"):
            model_dir = ensure_tiny_llama(progress=ctx.show_progress)
    elif source.startswith(HF_PREFIX):
        model_dir = None  # downloaded by quantize (needs the weights); nothing to read here without network
    else:
        model_dir = Path(source)
        if not (model_dir / "config.json").is_file():
            raise InputError(f"model.source: {source} is not a Hugging Face model directory (no config.json); "
                             "give a directory made by save_pretrained, hf:org/name, or builtin:tiny-llama")
    from kiln.plan import recipe_model_config

    cfg = recipe_model_config(ctx.loaded)
    max_pos = (cfg or {}).get("max_position_embeddings")
    max_seq_len = r.engine.max_seq_len or max_pos
    if max_pos and r.engine.max_input_len > max_pos:
        raise InputError(f"engine.max_input_len ({r.engine.max_input_len}) exceeds the model's "
                         f"max_position_embeddings ({max_pos}); lower engine.max_input_len")
    if max_pos and max_seq_len and max_seq_len > max_pos:
        ctx.log(f"  warning: engine.max_seq_len {max_seq_len} exceeds max_position_embeddings {max_pos}")
    gpu, count, detected = r.hardware.gpu, r.hardware.count, False
    if gpu is None and r.target == "tensorrt":
        from kiln.recipe.gpus import detect_gpus

        found = detect_gpus()
        if found:
            gpu, count, detected = found[0], count or found[1], True
    fit = [p.format() for p in fit_warnings(ctx.loaded)]
    (ctx.out_dir / "recipe.yaml").write_text(recipe_yaml(r))
    info = {"model_dir": str(model_dir) if model_dir else None, "model_config": cfg, "max_seq_len": max_seq_len,
            "gpu": gpu, "gpu_count": count, "gpu_detected": detected, "fit_warnings": fit}
    (ctx.out_dir / "resolved.json").write_text(json.dumps(info, indent=2))
    return ResolveResult(summary=f"model {source}, max_seq_len {max_seq_len}, gpu {gpu or 'none'}"
                         + (" (detected)" if detected else ""), model_dir=str(model_dir) if model_dir else None,
                         max_seq_len=max_seq_len, gpu=gpu, gpu_count=count, gpu_detected=detected)


SPEC = StepSpec(
    name="resolve",
    fn=resolve,
    result=ResolveResult,
    keys=("model", "engine.max_seq_len", "engine.max_input_len", "hardware", "target"),
    input_hashes=lambda loaded: {"model": model_source_hash(loaded.recipe.model.source)},
    files=("recipe.yaml", "resolved.json"),
)
