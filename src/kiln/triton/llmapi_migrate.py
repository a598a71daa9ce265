"""Moving a recipe to target pytorch: what carries over, what changes and what is refused.

``kiln validate RECIPE --set target=pytorch`` prints this view (then validates as usual, so the refusals come with
their reasons and alternatives). Each engine and serving key is placed by :data:`kiln.triton.llmapi.RECIPE_MAPPING`
with the value the recipe gives it; the values the PyTorch backend needs come from the recipe rules'
:data:`~kiln.recipe.rules.PYTORCH_REQUIRES`, and the format verdict from the format registry.
"""

from __future__ import annotations

from typing import Any

from kiln.recipe.formats import format_refusal, kv_cache_format, kv_refusal, weight_format
from kiln.recipe.gpus import lookup_gpu
from kiln.recipe.rules import PYTORCH_REQUIRES, check_rules
from kiln.recipe.schema import Recipe, llmapi_runtime, quantization_runtime
from kiln.triton.llmapi import RECIPE_MAPPING, llm_args_for
from kiln.util.dotted import dotted_attr, dotted_get


_MISSING = object()


def _show(value: Any) -> str:
    if value is None:
        return "empty"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def migration_view(recipe: Recipe) -> list[str]:
    """The lines of the view for ``recipe`` (already moved: its target is pytorch)."""
    q = recipe.quantization
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    args = llm_args_for(recipe, "<unified checkpoint>", recipe.engine.max_seq_len,
                        "<draft's unified checkpoint>" if recipe.engine.speculative.draft_recipe else None,
                        strict=False)
    runtime = quantization_runtime(recipe)
    lines = [f"moving {recipe.name} to target pytorch: TensorRT-LLM {recipe.engine_runtime.trtllm_version}'s PyTorch "
             "backend, served by Triton's llmapi model (tensorrt_llm/1/model.yaml) or trtllm-serve",
             "  carries over unchanged:",
             f"    model ({recipe.model.source}, dtype {recipe.model.dtype} → LLM argument dtype), evaluation (the "
             "same quality gate on the same held-out text), hardware, engine_runtime (its image quantizes and serves)",
             f"    quantization: {fmt.label}" + (f" + {kv.label}" if q.kv_cache != "none" else "")
             + ", the same hashed calibration data → ModelOpt's unified Hugging Face checkpoint "
             f"(hf_quant_config.json quant_algo {fmt.quant_algo}, kv_cache_quant_algo {kv.kv_cache_quant_algo}) instead of a TensorRT-LLM "
             "checkpoint; exported " + ("in the engine runtime by the image's" if runtime == "engine" else
                                        "on this host by kiln's") + " ModelOpt",
             f"    parallelism: tp {recipe.parallelism.tp}, pp {recipe.parallelism.pp} → tensor_parallel_size, "
             "pipeline_parallel_size (one server process starts the ranks)",
             "  no engine step: nothing is compiled; the server loads the checkpoint when it starts",
             "  becomes an LLM argument or an llmapi setting:"]
    groups: dict[str, list[str]] = {"arg": [], "same": [], "dropped": [], "refused": []}
    for key, (kind, what) in RECIPE_MAPPING.items():
        if key.startswith("engine.speculative.") and key != "engine.speculative.mode" \
                and recipe.engine.speculative.mode == "none":
            continue  # no speculative decoding: its settings carry nothing
        value = _show(dotted_attr(recipe, key))
        if kind == "arg":
            emitted = dotted_get(args, what.split(" ")[0], _MISSING)
            suffix = "" if emitted is _MISSING or isinstance(emitted, dict) else f" = {_show(emitted)}"
            if emitted is _MISSING and value == "empty":
                suffix = " (not written: TensorRT-LLM's default)"
            groups["arg"].append(f"    {key}: {value} → {what}{suffix}")
        elif kind == "refused":
            need, why = PYTORCH_REQUIRES[key]
            ok = dotted_attr(recipe, key) == need
            line = f"    {key}: {value}" + ("" if ok else f" (needs {_show(need)})") + f": {why}"
            groups["same" if ok else "refused"].append(line)
        else:
            groups[kind].append(f"    {key}: {value}: {what}")
    lines += groups["arg"]
    lines += ["  carried as it is:"] + groups["same"]
    lines += ["  no equivalent on the PyTorch backend (dropped):"] + groups["dropped"]
    refused = groups["refused"]
    gpu = lookup_gpu(recipe.hardware.gpu) if recipe.hardware.gpu else None
    sm, name = (gpu.sm, gpu.name) if gpu else (None, None)
    for key, refusal in (("quantization.format", format_refusal(q.format, "pytorch", sm, name)),
                         ("quantization.kv_cache", kv_refusal(q.kv_cache, "pytorch", sm, name))):
        if refusal is not None:
            refused.append(f"    {key}: {refusal.reason}; {refusal.hint}")
    others = [p for p in check_rules(recipe) if p.severity == "error" and not any(p.key == r.split(":")[0].strip()
                                                                                 for r in refused)]
    refused += [f"    {p.key}: {p.message}" for p in others]
    lines += ["  refused (the errors below say how to fix each):"] + (refused or ["    nothing"])
    served = ("kiln's CPU reference runtime here (a test and development vehicle, not a fast path)"
              if llmapi_runtime(recipe) == "reference" else "TensorRT-LLM's LLM API on the GPU")
    lines.append(f"  served by: {served}; the deploy files and trtllm-serve options use the same LLM arguments")
    return lines
