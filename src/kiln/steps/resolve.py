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
from kiln.steps.base import StepContext, StepSpec, step_result
from kiln.util.errors import InputError


def model_config(loaded: LoadedRecipe) -> Optional[dict]:
    """The model's HF config without loading weights or downloading: a local/built-in config.json, or the
    config shipped with kiln for known hub models. None when unknown without a download."""
    source = loaded.recipe.model.source
    if source.startswith(HF_PREFIX):
        from kiln.plan import shipped_model_config

        return shipped_model_config(source)
    if source.startswith(BUILTIN_PREFIX):
        from kiln.models.tiny import ensure_tiny_llama

        path = ensure_tiny_llama(progress=False) / "config.json"
    else:
        path = Path(source) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def plan_inputs(recipe, config: dict, max_seq_len: Optional[int] = None):
    """The planner's inputs for a recipe and its model config."""
    from kiln.plan import PlanInputs

    q, b, s = recipe.quantization, recipe.engine, recipe.serving
    dtype = recipe.model.dtype if recipe.model.dtype != "auto" else str(config.get("torch_dtype") or "float16")
    seq = max_seq_len or b.max_seq_len or int(config.get("max_position_embeddings") or b.max_input_len)
    return PlanInputs(model_config=config, weight_format=q.format, kv_cache=q.kv_cache, dtype=dtype,
                      exclude_modules=tuple(q.exclude_modules), awq_block_size=q.awq_block_size,
                      tp=recipe.parallelism.tp, pp=recipe.parallelism.pp, max_batch_size=b.max_batch_size,
                      max_input_len=b.max_input_len, max_seq_len=seq + b.speculative.max_draft_len,
                      max_num_tokens=b.max_num_tokens, tokens_per_block=b.tokens_per_block,
                      kv_cache_free_gpu_mem_fraction=s.kv_cache_free_gpu_mem_fraction,
                      max_tokens_in_paged_kv_cache=s.max_tokens_in_paged_kv_cache, target=recipe.target)


def fit_warnings(loaded: LoadedRecipe) -> list[Problem]:
    """A 'does not fit' plan verdict, as warnings, when the recipe names its GPU (tensorrt target)."""
    r = loaded.recipe
    if r.target != "tensorrt" or not r.hardware.gpu:
        return []
    from kiln.plan import PlanError, make_plan
    from kiln.recipe.gpus import lookup_gpu

    gpu = lookup_gpu(r.hardware.gpu)
    cfg = model_config(loaded)
    if gpu is None or cfg is None:
        return []
    try:
        result = make_plan(plan_inputs(r, cfg), gpu, r.hardware.count)
    except PlanError as exc:
        return [Problem("warning", "model.source", f"cannot plan memory: {exc}", loaded.origin_of("model.source"))]
    if result.fits:
        return []
    return [Problem("warning", "hardware.gpu", f"does not fit: {result.verdict}", loaded.origin_of("hardware.gpu"),
                    "; ".join(result.advice))]


def resolve(ctx: StepContext) -> dict:
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
    cfg = model_config(ctx.loaded)
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
    return step_result(summary=f"model {source}, max_seq_len {max_seq_len}, gpu {gpu or 'none'}"
                       + (" (detected)" if detected else ""), model_dir=model_dir, max_seq_len=max_seq_len,
                       gpu=gpu, gpu_count=count)


SPEC = StepSpec(
    name="resolve",
    fn=resolve,
    keys=("model", "engine.max_seq_len", "engine.max_input_len", "hardware", "target"),
    input_hashes=lambda loaded: {"model": model_source_hash(loaded.recipe.model.source)},
    files_checked=("recipe.yaml", "resolved.json"),
)
