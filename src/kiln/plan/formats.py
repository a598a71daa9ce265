"""The planner's view of the format registry: storage and GEMM facts, and which formats run where.

Every per-format fact (bytes per weight and the scales that grow with the element count, the tensor-core type
its GEMMs run in, the GPUs and targets that run it) lives in the format registry, ``kiln/recipe/data/
formats.yaml`` (:mod:`kiln.recipe.formats`); this module turns its lookups into :class:`PlanError` and adds
the base dtypes. Bytes per weight element count only what scales with the number of elements: per-tensor and
per-channel scales are named in each format's ``basis`` as not counted.
"""

from __future__ import annotations

from kiln.plan.errors import PlanError
from kiln.recipe import formats as registry
from kiln.recipe.formats import KVCacheFormat, WeightFormat

__all__ = [
    "WeightFormat",
    "KVCacheFormat",
    "BASE_DTYPES",
    "weight_format",
    "kv_cache_format",
    "base_dtype_bytes",
    "kv_dtype_bytes",
    "base_tensor_key",
    "unsupported_reason",
]

BASE_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def weight_format(name: str) -> WeightFormat:
    """The format called ``name``; PlanError listing the known ones otherwise."""
    try:
        return registry.weight_format(name)
    except registry.UnknownFormat as exc:
        raise PlanError(str(exc)) from None


def kv_cache_format(name: str) -> KVCacheFormat:
    """The KV-cache format called ``name``; PlanError listing the known ones otherwise."""
    try:
        return registry.kv_cache_format(name)
    except registry.UnknownFormat as exc:
        raise PlanError(str(exc)) from None


def base_dtype_bytes(dtype: str) -> int:
    """Bytes per element of the base (activation) dtype; PlanError listing the known ones otherwise."""
    try:
        return BASE_DTYPES[dtype]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(BASE_DTYPES)}") from None


def kv_dtype_bytes(kv_cache: str, dtype: str) -> int:
    """Bytes per KV-cache element: the registry's figure, or the base dtype's for an unquantized cache."""
    return kv_cache_format(kv_cache).bytes_per_element or base_dtype_bytes(dtype)


def base_tensor_key(dtype: str) -> str | None:
    """The GPU table's ``tflops`` key for GEMMs in the base dtype (None for float32: no figure)."""
    return {"float16": "fp16", "bfloat16": "bf16"}.get(dtype)


def unsupported_reason(weight: str, kv_cache: str, target: str, sm: int, gpu_name: str | None = None) -> str | None:
    """Why the weight format or the KV-cache format does not run on ``target`` at SM ``sm`` (the registry's
    reason, the same one `kiln validate` gives), or None when both run."""
    refusal = registry.format_refusal(weight, target, sm, gpu_name) or registry.kv_refusal(kv_cache, target, sm,
                                                                                           gpu_name)
    return None if refusal is None else refusal.reason
