"""The one way from a recipe to a plan: :func:`plan_for`.

Every caller that plans a recipe (``kiln validate``'s fit warning, ``kiln plan``, ``kiln bench --recipe``, sweeps)
goes through here, so the recipe fields the planner reads are mapped in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from kiln.plan.errors import PlanError
from kiln.plan.model import load_model_config, shipped_model_config
from kiln.plan.planner import Plan, PlanInputs, make_plan
from kiln.plan.speed import Workload
from kiln.recipe.gpus import GPUSpec, known_gpu_names, lookup_gpu
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import BUILTIN_PREFIX, HF_PREFIX, Recipe


def recipe_model_config(loaded: LoadedRecipe) -> Optional[dict[str, Any]]:
    """The model's Hugging Face config without loading weights or downloading: a local or built-in
    config.json, or the config shipped with kiln for known hub models. None when unknown without a download."""
    source = loaded.recipe.model.source
    if source.startswith(HF_PREFIX):
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


def plan_inputs(recipe: Recipe, config: dict[str, Any], max_seq_len: Optional[int] = None) -> PlanInputs:
    """The planner's inputs for a recipe and its model config."""
    q, e, s = recipe.quantization, recipe.engine, recipe.serving
    dtype = recipe.model.dtype if recipe.model.dtype != "auto" else str(config.get("torch_dtype") or "float16")
    seq = max_seq_len or e.max_seq_len or int(config.get("max_position_embeddings") or e.max_input_len)
    return PlanInputs(model_config=config, weight_format=q.format, kv_cache=q.kv_cache, dtype=dtype,
                      exclude_modules=tuple(q.exclude_modules), awq_block_size=q.awq_block_size,
                      tp=recipe.parallelism.tp, pp=recipe.parallelism.pp, max_batch_size=e.max_batch_size,
                      max_input_len=e.max_input_len, max_seq_len=seq + e.speculative.max_draft_len,
                      max_num_tokens=e.max_num_tokens, tokens_per_block=e.tokens_per_block,
                      kv_cache_free_gpu_mem_fraction=s.kv_cache_free_gpu_mem_fraction,
                      max_tokens_in_paged_kv_cache=s.max_tokens_in_paged_kv_cache, target=recipe.target,
                      enable_chunked_context=s.enable_chunked_context, fp8_context_fmha=e.use_fp8_context_fmha)


def plan_gpu(loaded: LoadedRecipe, gpu: Union[str, GPUSpec, None] = None) -> GPUSpec:
    """The GPU to plan for: ``gpu`` when given, else the recipe's ``hardware.gpu``; PlanError naming the known
    GPUs when there is none or it is unknown."""
    if isinstance(gpu, GPUSpec):
        return gpu
    name = gpu or loaded.recipe.hardware.gpu
    if not name:
        raise PlanError("no GPU to plan for: pass --gpu or set hardware.gpu (known: "
                        + ", ".join(known_gpu_names()) + ")")
    spec = lookup_gpu(name)
    if spec is None:
        raise PlanError(f"unknown GPU {name!r}; known: " + ", ".join(known_gpu_names()))
    return spec


def plan_for(loaded: LoadedRecipe, gpu: Union[str, GPUSpec, None] = None, count: Optional[int] = None,
             model_config: Union[Path, dict, None] = None, workload: Optional[Workload] = None) -> Plan:
    """Plan the recipe on ``count`` GPUs of model ``gpu`` (defaults: the recipe's hardware section), and its
    serving speed for ``workload`` when given (see :func:`~kiln.plan.planner.make_plan`).

    ``model_config`` is a config.json path or dict for models kiln cannot read without a download. Raises
    PlanError for what cannot be planned (no or unknown GPU, no model config, bad planner input), saying what
    is known or how to proceed.
    """
    spec = plan_gpu(loaded, gpu)
    if isinstance(model_config, dict):
        cfg: Optional[dict] = model_config
    elif model_config is not None:
        cfg = load_model_config(model_config)
    else:
        cfg = recipe_model_config(loaded)
    if cfg is None:
        raise PlanError(f"no model config for {loaded.recipe.model.source} without downloading it: pass "
                        "--model-config FILE (the model's config.json)")
    return make_plan(plan_inputs(loaded.recipe, cfg), spec, count or loaded.recipe.hardware.count, workload)
