"""The planner's arithmetic: what one rank holds of each weight, how layers split into pipeline stages, the
activation bytes per token, and GEMM time at the GPU's datasheet tensor throughput.

Sharding follows what ModelOpt exports for TensorRT-LLM (see :mod:`kiln.plan.planner`). Pure functions of the
model shape, the weight format and the plan inputs; :mod:`kiln.plan.planner` assembles them into a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from kiln.plan.formats import WeightFormat, base_dtype_bytes, base_tensor_key
from kiln.plan.model import Linear, ModelShape
from kiln.recipe.gpus import GPUSpec

if TYPE_CHECKING:  # annotations only: the planner imports this module
    from kiln.plan.planner import PlanInputs


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module ``name`` matches an exclusion pattern (at any depth, or a parent module)."""
    return any(
        fnmatchcase(name, p) or fnmatchcase(name, "*." + p) or fnmatchcase(name, p + ".*")
        or fnmatchcase(name, "*." + p + ".*")
        for p in patterns
    )


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(1, shape.num_kv_heads // tp)


def _rank_shape(lin: Linear, shape: ModelShape, tp: int) -> tuple[int, int]:
    """(weight params, bias params) of ``lin`` held by one tp rank."""
    if lin.shard == "col":
        out = math.ceil(lin.out_features / tp)
        return lin.in_features * out, out if lin.bias else 0
    if lin.shard == "row":
        return math.ceil(lin.in_features / tp) * lin.out_features, lin.out_features if lin.bias else 0
    # kv: out_features = m × num_kv_heads × head_dim; each rank keeps its (possibly replicated) KV heads.
    out = lin.out_features // shape.num_kv_heads * kv_heads_per_rank(shape, tp)
    return lin.in_features * out, out if lin.bias else 0


@dataclass
class StageWeights:
    params: int = 0
    quantized_params: int = 0
    embedding: float = 0.0
    attention: float = 0.0
    mlp: float = 0.0
    norms: float = 0.0
    lm_head: float = 0.0
    lm_head_read: float = 0.0
    excluded: float = 0.0
    gemm_params: dict[str, int] = field(default_factory=dict)  # tensor type -> params, decoder layers
    lm_head_gemm: tuple[str, int] = ("base", 0)
    excluded_names: set[str] = field(default_factory=set)

    @property
    def total(self) -> float:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head


def stage_weights(
    shape: ModelShape,
    inputs: PlanInputs,
    fmt: WeightFormat,
    tp: int,
    first_layer: int,
    layers: int,
    first_stage: bool,
    last_stage: bool,
    single_stage: bool,
) -> StageWeights:
    base = base_dtype_bytes(inputs.dtype)
    bpw = fmt.bytes_per_weight(base, inputs.awq_block_size)
    quantize = fmt.name != "none"
    w = StageWeights()
    vocab_rows = math.ceil(shape.vocab_size / tp)
    table_params = vocab_rows * shape.hidden_size

    if first_stage:
        w.embedding = table_params * base
        w.params += table_params
    for layer in range(first_layer, first_layer + layers):
        for lin in shape.layer_linears(layer):
            weights, biases = _rank_shape(lin, shape, tp)
            excluded = quantize and _excluded(lin.name, inputs.exclude_modules)
            if excluded:
                w.excluded_names.add(_pattern_name(lin.name))
            if quantize and not excluded:
                nbytes = weights * bpw + biases * base
                gemm = fmt.gemm
                w.quantized_params += weights
            else:
                nbytes = (weights + biases) * base
                gemm = "base"
                if excluded:
                    w.excluded += nbytes
            w.gemm_params[gemm] = w.gemm_params.get(gemm, 0) + weights
            w.params += weights + biases
            if ".mlp." in lin.name:
                w.mlp += nbytes
            else:
                w.attention += nbytes
        w.norms += shape.norm_params_per_layer * base
        w.params += shape.norm_params_per_layer
    if last_stage:
        w.norms += shape.final_norm_params * base
        w.params += shape.final_norm_params
        if shape.tie_word_embeddings:
            # The head multiplies by the embedding table (base dtype): shared on a single stage, a copy on
            # the last stage otherwise.
            w.lm_head_read = table_params * base
            w.lm_head_gemm = ("base", table_params)
            if not single_stage:
                w.lm_head = table_params * base
                w.params += table_params
        else:
            excluded = quantize and _excluded("lm_head", inputs.exclude_modules)
            if quantize and not excluded:
                w.lm_head = table_params * bpw
                w.lm_head_gemm = (fmt.gemm, table_params)
                w.quantized_params += table_params
            else:
                w.lm_head = table_params * base
                w.lm_head_gemm = ("base", table_params)
                if excluded:
                    w.excluded += w.lm_head
                    w.excluded_names.add("lm_head")
            w.lm_head_read = w.lm_head
            w.params += table_params
    return w


def _pattern_name(name: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'model.layers.*.self_attn.q_proj' (for a short summary)."""
    parts = ["*" if part.isdigit() else part for part in name.split(".")]
    return ".".join(parts)


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(first layer, layer count) per stage: the first ``num_layers % pp`` stages get one extra layer."""
    base, extra = divmod(num_layers, pp)
    out, first = [], 0
    for stage in range(pp):
        count = base + (1 if stage < extra else 0)
        out.append((first, count))
        first += count
    return out


def activation_bytes_per_token(shape: ModelShape, inputs: PlanInputs) -> int:
    tp = inputs.tp
    base = base_dtype_bytes(inputs.dtype)
    q = shape.num_heads // tp * shape.head_dim
    kv = kv_heads_per_rank(shape, tp) * shape.head_dim
    inter = math.ceil(shape.intermediate_size / tp)
    mlp_factor = 3 if shape.mlp_gated else 2
    return base * (3 * shape.hidden_size + (q + 2 * kv) + q + mlp_factor * inter)


def tflops(gpu: GPUSpec, gemm: str, dtype: str) -> float | None:
    key = base_tensor_key(dtype) if gemm == "base" else gemm
    return gpu.tflops.get(key) if key else None


def gemm_seconds(params_by_type: dict[str, float], tokens: float, gpu: GPUSpec, dtype: str) -> float | None:
    total = 0.0
    for gemm, params in params_by_type.items():
        if params == 0:
            continue
        peak = tflops(gpu, gemm, dtype)
        if peak is None:
            return None
        total += 2 * params * tokens / (peak * 1e12)
    return total
