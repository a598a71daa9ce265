"""Storage and compute facts for each weight format and KV-cache dtype.

Bytes per weight element count only what scales with the number of elements:

- ``none``: the base dtype (2 bytes for float16/bfloat16, 4 for float32).
- ``fp8`` (FP8): 1 byte; one per-tensor scale per matrix (a few bytes, not counted).
- ``int8_sq`` (W8A8_SQ_PER_CHANNEL), ``int8_wo`` (W8A16): 1 byte; one scale per output channel (a vector,
  under 0.1% for hidden sizes ≥ 1024, not counted).
- ``int4_wo`` (W4A16): 0.5 byte, per-channel scales (not counted).
- ``int4_awq`` (W4A16_AWQ), ``w4a8_awq`` (W4A8_AWQ): 0.5 byte + one float16 scale per ``awq_block_size``
  elements = 0.5 + 2 / block (0.515625 for block 128, 0.53125 for block 64); the per-input-channel
  ``pre_quant_scale`` vector is not counted.
- ``nvfp4`` (NVFP4): 0.5 byte + one FP8 (E4M3) scale per 16 elements = 0.5625; the per-tensor FP32
  global scale is not counted.

Which GPUs run a format (GUIDE §2, from TensorRT-LLM's checks): FP8 and W4A8 AWQ need SM 89+, NVFP4
SM 100+, INT8 SmoothQuant and INT4 AWQ SM 80+; INT8/INT4 weight-only and SmoothQuant are refused on
SM 100–119. An FP8 KV cache needs SM 89+.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.plan.errors import PlanError

__all__ = [
    "WeightFormat",
    "WEIGHT_FORMATS",
    "KV_CACHE_DTYPES",
    "BASE_DTYPES",
    "weight_format",
    "base_dtype_bytes",
    "kv_dtype_bytes",
    "base_tensor_key",
    "format_unsupported_reason",
    "kv_unsupported_reason",
]

BASE_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
KV_CACHE_DTYPES: tuple[str, ...] = ("none", "fp8", "int8")


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: its storage cost, the tensor-core type its GEMMs run in, and its GPU range."""

    name: str
    quant_algo: str | None
    weight_bytes: float | None  # None: the base dtype's size
    group_scale: str | None  # "awq": fp16 scale per awq_block_size elements; "nvfp4": fp8 scale per 16
    gemm: str  # tensor-core type of the GEMM: "base" (the activation dtype), "fp8", "int8", "fp4"
    min_sm: int
    refused_sm: tuple[int, int] | None
    description: str

    def bytes_per_weight(self, base_bytes: int, awq_block_size: int) -> float:
        """Bytes stored per weight element, scales included (see the module docstring)."""
        if self.weight_bytes is None:
            return float(base_bytes)
        if self.group_scale == "awq":
            return self.weight_bytes + 2.0 / awq_block_size
        if self.group_scale == "nvfp4":
            return self.weight_bytes + 1.0 / 16
        return self.weight_bytes

    def basis(self, base_dtype: str, awq_block_size: int) -> str:
        """How :meth:`bytes_per_weight` is made up, in words."""
        base = BASE_DTYPES[base_dtype]
        value = self.bytes_per_weight(base, awq_block_size)
        if self.weight_bytes is None:
            return f"{base_dtype}: {base} bytes per weight"
        if self.group_scale == "awq":
            return (
                f"{self.name}: 0.5 byte (int4) + one fp16 scale per {awq_block_size} weights "
                f"(2/{awq_block_size}) = {value:g} bytes per weight"
            )
        if self.group_scale == "nvfp4":
            return f"{self.name}: 0.5 byte (fp4) + one fp8 scale per 16 weights (1/16) = {value:g} bytes per weight"
        return f"{self.name}: {value:g} byte(s) per weight; per-tensor/per-channel scales not counted"


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("none", None, None, None, "base", 0, None, "unquantized (base dtype)"),
        WeightFormat("fp8", "FP8", 1.0, None, "fp8", 89, None, "FP8 weights and activations"),
        WeightFormat("int8_sq", "W8A8_SQ_PER_CHANNEL", 1.0, None, "int8", 80, (100, 119), "INT8 SmoothQuant"),
        WeightFormat("int8_wo", "W8A16", 1.0, None, "base", 80, (100, 119), "INT8 weight-only"),
        WeightFormat("int4_wo", "W4A16", 0.5, None, "base", 80, (100, 119), "INT4 weight-only (per channel)"),
        WeightFormat("int4_awq", "W4A16_AWQ", 0.5, "awq", "base", 80, None, "INT4 AWQ, group scales"),
        WeightFormat("w4a8_awq", "W4A8_AWQ", 0.5, "awq", "fp8", 89, None, "INT4 AWQ weights, FP8 activations"),
        WeightFormat("nvfp4", "NVFP4", 0.5, "nvfp4", "fp4", 100, None, "NVFP4, fp8 block scales per 16"),
    )
}


def weight_format(name: str) -> WeightFormat:
    """The format called ``name``; PlanError listing the known ones otherwise."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise PlanError(
            f"unknown weight format {name!r}; known formats: {', '.join(WEIGHT_FORMATS)}"
        ) from None


def base_dtype_bytes(dtype: str) -> int:
    """Bytes per element of the base (activation) dtype; PlanError listing the known ones otherwise."""
    try:
        return BASE_DTYPES[dtype]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(BASE_DTYPES)}") from None


def kv_dtype_bytes(kv_cache: str, dtype: str) -> int:
    """Bytes per KV-cache element: the base dtype for ``none``, 1 for ``fp8`` and ``int8``."""
    if kv_cache == "none":
        return base_dtype_bytes(dtype)
    if kv_cache in ("fp8", "int8"):
        return 1
    raise PlanError(f"unknown kv_cache {kv_cache!r}; known values: {', '.join(KV_CACHE_DTYPES)}")


def base_tensor_key(dtype: str) -> str | None:
    """The GPU table's ``tflops`` key for GEMMs in the base dtype (None for float32: no figure)."""
    return {"float16": "fp16", "bfloat16": "bf16"}.get(dtype)


def format_unsupported_reason(fmt: WeightFormat, sm: int) -> str | None:
    """Why ``fmt`` cannot run on a GPU of compute capability ``sm``, or None when it can."""
    if sm < fmt.min_sm:
        return f"{fmt.name} needs SM {fmt.min_sm}+ (this GPU is SM {sm})"
    if fmt.refused_sm and fmt.refused_sm[0] <= sm <= fmt.refused_sm[1]:
        lo, hi = fmt.refused_sm
        return f"{fmt.name} is not supported on SM {lo}-{hi} (this GPU is SM {sm})"
    return None


def kv_unsupported_reason(kv_cache: str, sm: int) -> str | None:
    """Why a KV-cache dtype cannot run on SM ``sm``, or None when it can."""
    if kv_cache == "fp8" and sm < 89:
        return f"an fp8 KV cache needs SM 89+ (this GPU is SM {sm})"
    return None
