"""Memory, KV-cache and roofline arithmetic for one engine on one GPU model (no GPU, no torch).

Everything here is an estimate from published figures; each section of a :class:`Plan` carries a
``basis`` stating how its numbers were made. Figures are **per GPU** (per rank) unless named ``total``.

Sharding follows what ModelOpt exports for TensorRT-LLM: tensor parallelism (tp) splits q/o, the MLP and
lm_head across ranks; KV heads are split, or replicated when tp exceeds the number of KV heads; the
embedding is split along the vocabulary (``use_parallel_embedding``, ``embedding_sharding_dim: 0``);
norms are replicated. Pipeline parallelism (pp) gives each stage a contiguous run of layers (the first
``layers % pp`` stages one more); the embedding lives on the first stage, final norm and lm_head on the
last. A tied lm_head shares the embedding table on one stage; with pp > 1 the last stage holds a copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from fractions import Fraction
from typing import Any

from kiln.plan.errors import PlanError
from kiln.plan.formats import (
    WeightFormat,
    base_dtype_bytes,
    base_tensor_key,
    kv_dtype_bytes,
    unsupported_reason,
    weight_format,
)
from kiln.plan.model import Linear, ModelShape, parse_model_config
from kiln.plan.result import (
    DecodePoint,
    KVCachePlan,
    LimitsPlan,
    Plan,
    PlanInputs,
    PrefillPlan,
    StagePlan,
    WeightsPlan,
    WorkspacePlan,
)
from kiln.plan.speed import Workload
from kiln.plan.speed import predict as predict_speed
from kiln.recipe import formats as registry
from kiln.recipe.gpus import GPUSpec, known_gpu_names, lookup_gpu

__all__ = [
    "PlanInputs",
    "Plan",
    "StagePlan",
    "WeightsPlan",
    "WorkspacePlan",
    "KVCachePlan",
    "DecodePoint",
    "PrefillPlan",
    "LimitsPlan",
    "make_plan",
    "resolve_gpu",
    "valid_tp_sizes",
    "RUNTIME_OVERHEAD_BYTES",
    "GIB",
]

GIB = 1024**3
RUNTIME_OVERHEAD_BYTES = 1 * GIB
"""Fixed per-GPU overhead outside weights, activations and KV cache: the CUDA context (≈0.5 GiB on
recent GPUs) plus cuBLAS/TensorRT workspaces and NCCL buffers (≈0.5 GiB)."""

LOGITS_BYTES = 4
"""Logits are produced in float32, one row of vocab_size per sequence in the batch."""

MAX_TP_WITHOUT_COUNT = 8
"""Largest tp the advice suggests when no GPU count is given (one 8-GPU node)."""

# --------------------------------------------------------------------------------------------- inputs


def resolve_gpu(name: str) -> GPUSpec:
    """The GPU spec for ``name`` (canonical or alias); PlanError listing the known GPUs otherwise."""
    spec = lookup_gpu(name)
    if spec is None:
        raise PlanError(f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpu_names())}")
    return spec


def _tp_problem(shape: ModelShape, tp: int) -> str | None:
    if shape.num_heads % tp:
        return f"num_attention_heads {shape.num_heads} is not divisible by tp {tp}"
    kv = shape.num_kv_heads
    if tp <= kv and kv % tp:
        return f"num_key_value_heads {kv} is not divisible by tp {tp}"
    if tp > kv and tp % kv:
        return f"tp {tp} is not a multiple of num_key_value_heads {kv} (KV heads are replicated when tp > KV heads)"
    return None


def valid_tp_sizes(shape: ModelShape, limit: int = 64) -> list[int]:
    """tp sizes up to ``limit`` that split this model's query and KV heads evenly."""
    return [tp for tp in range(1, limit + 1) if _tp_problem(shape, tp) is None]


def _validate(inputs: PlanInputs, shape: ModelShape) -> list[str]:
    problems: list[str] = []
    weight_format(inputs.weight_format)
    base_dtype_bytes(inputs.dtype)
    if inputs.kv_cache not in registry.kv_cache_format_names():
        problems.append(f"kv_cache {inputs.kv_cache!r} unknown; known values: "
                        f"{', '.join(registry.kv_cache_format_names())}")
    if inputs.target not in registry.target_names():
        problems.append(f"target {inputs.target!r} unknown; known targets: {', '.join(registry.target_names())}")
    for key in ("tp", "pp", "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                "tokens_per_block", "awq_block_size"):
        value = getattr(inputs, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key} must be a positive integer, got {value!r}")
    if problems:
        return problems
    if weight_format(inputs.weight_format).uses_awq_block_size and inputs.awq_block_size not in (64, 128):
        problems.append(f"awq_block_size must be 64 or 128, got {inputs.awq_block_size}")
    fraction = inputs.kv_cache_free_gpu_mem_fraction
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        problems.append(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction!r}")
    cap = inputs.max_tokens_in_paged_kv_cache
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        problems.append(f"max_tokens_in_paged_kv_cache must be a positive integer or unset, got {cap!r}")
    tp_problem = _tp_problem(shape, inputs.tp)
    if tp_problem:
        problems.append(f"{tp_problem}; valid tp sizes for this model: {valid_tp_sizes(shape)}")
    if inputs.pp > shape.num_layers:
        problems.append(f"pp {inputs.pp} exceeds the model's {shape.num_layers} layers")
    return problems


# ------------------------------------------------------------------------------------------ arithmetic


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module ``name`` matches an exclusion pattern (at any depth, or a parent module)."""
    return any(
        fnmatchcase(name, p) or fnmatchcase(name, "*." + p) or fnmatchcase(name, p + ".*")
        or fnmatchcase(name, "*." + p + ".*")
        for p in patterns
    )


def _kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(1, shape.num_kv_heads // tp)


def _rank_shape(lin: Linear, shape: ModelShape, tp: int) -> tuple[int, int]:
    """(weight params, bias params) of ``lin`` held by one tp rank."""
    if lin.shard == "col":
        out = math.ceil(lin.out_features / tp)
        return lin.in_features * out, out if lin.bias else 0
    if lin.shard == "row":
        return math.ceil(lin.in_features / tp) * lin.out_features, lin.out_features if lin.bias else 0
    # kv: out_features = m × num_kv_heads × head_dim; each rank keeps its (possibly replicated) KV heads.
    out = lin.out_features // shape.num_kv_heads * _kv_heads_per_rank(shape, tp)
    return lin.in_features * out, out if lin.bias else 0


@dataclass
class _StageWeights:
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
    gemm_bytes: dict[str, float] = field(default_factory=dict)  # tensor type -> bytes, decoder layers
    lm_head_gemm: tuple[str, int] = ("base", 0)
    excluded_names: set[str] = field(default_factory=set)

    @property
    def total(self) -> float:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head


def _stage_weights(
    shape: ModelShape,
    inputs: PlanInputs,
    fmt: WeightFormat,
    tp: int,
    first_layer: int,
    layers: int,
    first_stage: bool,
    last_stage: bool,
    single_stage: bool,
) -> _StageWeights:
    base = base_dtype_bytes(inputs.dtype)
    bpw = fmt.bytes_per_weight(base, inputs.awq_block_size)
    quantize = fmt.name != "none"
    w = _StageWeights()
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
                gemm = fmt.storage.gemm
                w.quantized_params += weights
            else:
                nbytes = (weights + biases) * base
                gemm = "base"
                if excluded:
                    w.excluded += nbytes
            w.gemm_params[gemm] = w.gemm_params.get(gemm, 0) + weights
            w.gemm_bytes[gemm] = w.gemm_bytes.get(gemm, 0.0) + nbytes
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
                w.lm_head_gemm = (fmt.storage.gemm, table_params)
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


def _stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(first layer, layer count) per stage: the first ``num_layers % pp`` stages get one extra layer."""
    base, extra = divmod(num_layers, pp)
    out, first = [], 0
    for stage in range(pp):
        count = base + (1 if stage < extra else 0)
        out.append((first, count))
        first += count
    return out


def _activation_bytes_per_token(shape: ModelShape, inputs: PlanInputs) -> int:
    tp = inputs.tp
    base = base_dtype_bytes(inputs.dtype)
    q = shape.num_heads // tp * shape.head_dim
    kv = _kv_heads_per_rank(shape, tp) * shape.head_dim
    inter = math.ceil(shape.intermediate_size / tp)
    mlp_factor = 3 if shape.mlp_gated else 2
    return base * (3 * shape.hidden_size + (q + 2 * kv) + q + mlp_factor * inter)


def _tflops(gpu: GPUSpec, gemm: str, dtype: str) -> float | None:
    key = base_tensor_key(dtype) if gemm == "base" else gemm
    return gpu.tflops.get(key) if key else None


def _gemm_seconds(params_by_type: dict[str, float], tokens: float, gpu: GPUSpec, dtype: str) -> float | None:
    total = 0.0
    for gemm, params in params_by_type.items():
        if params == 0:
            continue
        tflops = _tflops(gpu, gemm, dtype)
        if tflops is None:
            return None
        total += 2 * params * tokens / (tflops * 1e12)
    return total


# ------------------------------------------------------------------------------------------ the plan


def _evaluate(inputs: PlanInputs, gpu: GPUSpec, gpu_count: int | None) -> Plan:
    """The plan without advice (advice re-plans variations of the inputs with this)."""
    shape = parse_model_config(inputs.model_config)
    problems = _validate(inputs, shape)
    if problems:
        raise PlanError("invalid plan inputs: " + "; ".join(problems))
    fmt = weight_format(inputs.weight_format)
    base = base_dtype_bytes(inputs.dtype)
    kv_bytes = kv_dtype_bytes(inputs.kv_cache, inputs.dtype)
    tp, pp = inputs.tp, inputs.pp
    memory = round(gpu.memory_gib * GIB)
    # The fraction as written (0.9 is 9/10), so budgets are exact integers, not float-rounded.
    fraction = Fraction(repr(float(inputs.kv_cache_free_gpu_mem_fraction)))
    bandwidth = gpu.bandwidth_gbs * 1e9
    kv_heads_rank = _kv_heads_per_rank(shape, tp)
    tpb = inputs.tokens_per_block

    act_per_token = _activation_bytes_per_token(shape, inputs)
    activation = inputs.max_num_tokens * act_per_token
    logits = inputs.max_batch_size * shape.vocab_size * LOGITS_BYTES

    stage_weights: list[_StageWeights] = []
    stages: list[StagePlan] = []
    layout = _stage_layers(shape.num_layers, pp)
    for index, (first, count) in enumerate(layout):
        last = index == pp - 1
        sw = _stage_weights(shape, inputs, fmt, tp, first, count, index == 0, last, pp == 1)
        stage_weights.append(sw)
        weights_bytes = math.ceil(sw.total)
        workspace = RUNTIME_OVERHEAD_BYTES + activation + (logits if last else 0)
        free = memory - weights_bytes - workspace
        kv_per_token = 2 * count * kv_heads_rank * shape.head_dim * kv_bytes
        budget = int(fraction * free) if free > 0 else 0
        stages.append(
            StagePlan(
                stage=index,
                first_layer=first,
                layers=count,
                params=sw.params,
                weights_bytes=weights_bytes,
                embedding_bytes=math.ceil(sw.embedding),
                attention_bytes=math.ceil(sw.attention),
                mlp_bytes=math.ceil(sw.mlp),
                norm_bytes=math.ceil(sw.norms),
                lm_head_bytes=math.ceil(sw.lm_head),
                excluded_bytes=math.ceil(sw.excluded),
                workspace_bytes=workspace,
                free_bytes=free,
                kv_bytes_per_token=kv_per_token,
                kv_budget_bytes=budget,
                kv_tokens=budget // kv_per_token,
                gemm_params=dict(sw.gemm_params),
                gemm_bytes={k: math.ceil(v) for k, v in sw.gemm_bytes.items()},
                lm_head_gemm=sw.lm_head_gemm[0],
                lm_head_params=sw.lm_head_gemm[1],
                lm_head_read_bytes=math.ceil(sw.lm_head_read),
            )
        )

    # Whole-model figures (tp = pp = 1).
    whole = _stage_weights(shape, inputs, fmt, 1, 0, shape.num_layers, True, True, True)
    bind = min(stages, key=lambda s: (s.kv_tokens // tpb, s.stage))
    heaviest = max(stages, key=lambda s: (s.weights_bytes, -s.stage))

    # KV cache: the binding stage decides how many blocks every stage can use.
    blocks = bind.kv_tokens // tpb
    limited_by = "kv_cache_free_gpu_mem_fraction"
    cap = inputs.max_tokens_in_paged_kv_cache
    if cap is not None and math.ceil(cap / tpb) < blocks:
        blocks = math.ceil(cap / tpb)
        limited_by = "max_tokens_in_paged_kv_cache"
    if bind.free_bytes <= 0:
        limited_by = "no memory left after weights and workspace"
    blocks_per_seq = math.ceil(inputs.max_seq_len / tpb)
    max_sequences = blocks // blocks_per_seq
    kv = KVCachePlan(
        dtype=inputs.kv_cache if inputs.kv_cache != "none" else inputs.dtype,
        bytes_per_element=kv_bytes,
        bytes_per_token=2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_bytes,
        bytes_per_token_per_gpu=bind.kv_bytes_per_token,
        kv_heads_per_gpu=kv_heads_rank,
        bytes_per_sequence_per_gpu=blocks_per_seq * tpb * bind.kv_bytes_per_token,
        gpu_memory_bytes=memory,
        free_bytes_per_gpu=bind.free_bytes,
        budget_bytes_per_gpu=bind.kv_budget_bytes,
        kv_cache_free_gpu_mem_fraction=inputs.kv_cache_free_gpu_mem_fraction,
        max_tokens_in_paged_kv_cache=cap,
        tokens_per_block=tpb,
        blocks=blocks,
        tokens=blocks * tpb,
        blocks_per_sequence=blocks_per_seq,
        max_sequences=max_sequences,
        limited_by=limited_by,
    )

    weights = WeightsPlan(
        format=fmt.name,
        quant_algo=fmt.quant_algo,
        base_dtype=inputs.dtype,
        bytes_per_weight=fmt.bytes_per_weight(base, inputs.awq_block_size),
        total_params=shape.total_params(),
        quantized_params=whole.quantized_params,
        total_bytes=math.ceil(whole.total),
        per_gpu_bytes=heaviest.weights_bytes,
        tie_word_embeddings=shape.tie_word_embeddings,
        exclude_modules=list(inputs.exclude_modules),
        excluded_matches=sorted(whole.excluded_names),
        basis=[
            fmt.basis(inputs.dtype, base, inputs.awq_block_size),
            f"embedding ({shape.vocab_size} × {shape.hidden_size}), norms, biases and excluded modules "
            f"at {inputs.dtype} ({base} bytes)",
            "lm_head tied to the embedding (one table, base dtype)" if shape.tie_word_embeddings
            else "lm_head separate from the embedding (quantized unless excluded)",
            f"tp {tp}: q/o, MLP, embedding and lm_head split {tp} ways; KV projections keep "
            f"{kv_heads_rank} KV head(s) per GPU; norms replicated",
            f"pp {pp}: layers per stage {[count for _, count in layout]}; embedding on stage 0, "
            "final norm and lm_head on the last stage",
        ],
    )
    workspace = WorkspacePlan(
        runtime_bytes=RUNTIME_OVERHEAD_BYTES,
        activation_bytes=activation,
        activation_bytes_per_token=act_per_token,
        logits_bytes=logits if bind.stage == pp - 1 else 0,
        total_bytes=bind.workspace_bytes,
    )

    limits = _limits(inputs, gpu, stages, stage_weights, shape, max_sequences, bandwidth)
    world = tp * pp
    replicas = (gpu_count // world) if gpu_count else 1
    plan = Plan(
        model=shape.summary(),
        gpu={
            "name": gpu.name,
            "sm": gpu.sm,
            "memory_gib": gpu.memory_gib,
            "bandwidth_gbs": gpu.bandwidth_gbs,
            "tflops": dict(gpu.tflops),
            "source": gpu.source,
            "interconnect": dataclasses.asdict(gpu.interconnect) if gpu.interconnect else None,
        },
        gpu_count=gpu_count,
        tp=tp,
        pp=pp,
        world_size=world,
        replicas=replicas,
        settings={
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(inputs).items()
            if k != "model_config"
        },
        weights=weights,
        workspace=workspace,
        kv_cache=kv,
        limits=limits,
        stages=stages,
        fits=False,
        first_limit=None,
        verdict="",
        warnings=_warnings(inputs, shape),
    )
    plan.fits, plan.first_limit, plan.verdict = _assess(plan, inputs, gpu, fmt)
    return plan


def _limits(
    inputs: PlanInputs,
    gpu: GPUSpec,
    stages: list[StagePlan],
    stage_weights: list[_StageWeights],
    shape: ModelShape,
    max_sequences: int,
    bandwidth: float,
) -> LimitsPlan:
    ctx = inputs.max_seq_len
    cap = min(inputs.max_batch_size, max_sequences)
    batches = sorted({b for b in (2**i for i in range(0, 31)) if b <= cap} | ({cap} if cap >= 1 else set()))
    decode: list[DecodePoint] = []
    for batch in batches:
        memory_s, compute_s, step_s = 0.0, 0.0, 0.0
        compute_known = True
        for stage, sw in zip(stages, stage_weights):
            read = sw.attention + sw.mlp + sw.norms + sw.lm_head_read
            mem = (read + batch * ctx * stage.kv_bytes_per_token) / bandwidth
            params = dict(sw.gemm_params)
            lm_type, lm_params = sw.lm_head_gemm
            params[lm_type] = params.get(lm_type, 0) + lm_params
            comp = _gemm_seconds(params, batch, gpu, inputs.dtype)
            memory_s += mem
            if comp is None:
                compute_known = False
                step_s += mem
            else:
                compute_s += comp
                step_s += max(mem, comp)
        decode.append(
            DecodePoint(
                batch=batch,
                memory_ms=memory_s * 1e3,
                compute_ms=compute_s * 1e3 if compute_known else None,
                step_ms=step_s * 1e3,
                bound="compute" if compute_known and compute_s > memory_s else "memory",
                tokens_per_s_per_sequence=1 / step_s,
                tokens_per_s=batch / step_s,
            )
        )

    tokens = inputs.max_input_len
    gemm_flops = 0.0
    attn_flops = 0.0
    compute: float | None = 0.0
    memory_s = 0.0
    base_tflops = _tflops(gpu, "base", inputs.dtype)
    heads_rank = shape.num_heads // inputs.tp
    used: dict[str, float] = {}
    for stage, sw in zip(stages, stage_weights):
        lm_type, lm_params = sw.lm_head_gemm
        stage_gemm = sum(2 * p * tokens for p in sw.gemm_params.values()) + 2 * lm_params
        stage_attn = 2 * stage.layers * heads_rank * shape.head_dim * tokens**2
        gemm_flops += stage_gemm
        attn_flops += stage_attn
        memory_s += (sw.attention + sw.mlp + sw.norms + sw.lm_head_read) / bandwidth
        for gemm in [*sw.gemm_params, lm_type]:
            tf = _tflops(gpu, gemm, inputs.dtype)
            if tf is not None:
                used[gemm if gemm != "base" else str(base_tensor_key(inputs.dtype))] = tf
        layer_s = _gemm_seconds(dict(sw.gemm_params), tokens, gpu, inputs.dtype)
        head_s = _gemm_seconds({lm_type: lm_params}, 1, gpu, inputs.dtype)
        if compute is None or layer_s is None or head_s is None or base_tflops is None:
            compute = None
        else:
            compute += layer_s + head_s + stage_attn / (base_tflops * 1e12)
    seconds = max(compute, memory_s) if compute is not None else None
    prefill = PrefillPlan(
        tokens=tokens,
        gemm_flops=gemm_flops,
        attention_flops=attn_flops,
        compute_s=compute,
        memory_s=memory_s,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else None,
        tensor_tflops=used,
    )
    return LimitsPlan(
        max_batch_size=inputs.max_batch_size,
        max_concurrent_sequences=max_sequences,
        batch_reachable=max_sequences >= inputs.max_batch_size,
        decode_context_len=ctx,
        decode=decode,
        prefill=prefill,
    )


def _warnings(inputs: PlanInputs, shape: ModelShape) -> list[str]:
    out: list[str] = []
    if shape.max_position_embeddings and inputs.max_seq_len > shape.max_position_embeddings:
        out.append(
            f"max_seq_len {inputs.max_seq_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}"
        )
    if inputs.max_input_len > inputs.max_seq_len:
        out.append(f"max_input_len {inputs.max_input_len} exceeds max_seq_len {inputs.max_seq_len}")
    if inputs.max_num_tokens < inputs.max_input_len:
        out.append(
            f"max_num_tokens {inputs.max_num_tokens} < max_input_len {inputs.max_input_len}: a full prompt "
            "needs chunked context"
        )
    if inputs.dtype == "float32":
        out.append("float32 has no tensor-core figure in the GPU table: compute times are not estimated")
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _assess(plan: Plan, inputs: PlanInputs, gpu: GPUSpec, fmt: WeightFormat) -> tuple[bool, str | None, str]:
    """(fits, first limit hit, verdict sentence), checking limits in the order they bite."""
    if plan.gpu_count is not None and plan.world_size > plan.gpu_count:
        return False, "gpu_count", (
            f"does not fit: tp {plan.tp} × pp {plan.pp} needs {plan.world_size} GPUs, {plan.gpu_count} given"
        )
    reason = unsupported_reason(fmt.name, inputs.kv_cache, inputs.target, gpu.sm, gpu.name)
    if reason:
        return False, "format", f"does not run on {gpu.name}: {reason}"
    heaviest = max(plan.stages, key=lambda s: s.weights_bytes)
    memory = plan.kv_cache.gpu_memory_bytes
    if heaviest.weights_bytes > memory:
        return False, "weights", (
            f"does not fit: weights need {_gib(heaviest.weights_bytes)} per GPU, {gpu.name} has {_gib(memory)}"
        )
    short = min(plan.stages, key=lambda s: s.free_bytes)
    if short.free_bytes <= 0:
        return False, "workspace", (
            f"does not fit: weights {_gib(short.weights_bytes)} + workspace {_gib(short.workspace_bytes)} "
            f"exceed {_gib(memory)} per GPU"
        )
    kv = plan.kv_cache
    if kv.max_sequences < 1:
        return False, "kv_cache", (
            f"does not fit: the KV cache holds {kv.tokens} tokens per GPU, one max_seq_len "
            f"{inputs.max_seq_len} sequence needs {kv.blocks_per_sequence * kv.tokens_per_block}"
        )
    if not plan.limits.batch_reachable:
        return True, "max_batch_size", (
            f"fits, but only {kv.max_sequences} sequences of max_seq_len {inputs.max_seq_len} fit in the KV "
            f"cache at once (max_batch_size {inputs.max_batch_size} is not reachable at full length)"
        )
    return True, None, (
        f"fits: {_gib(heaviest.weights_bytes)} weights + {_gib(kv.budget_bytes_per_gpu)} KV cache per GPU; "
        f"{kv.max_sequences} full-length sequences fit, max_batch_size {inputs.max_batch_size} reachable"
    )


# ------------------------------------------------------------------------------------------- advice


def _solves(plan: Plan, limit: str) -> bool:
    if limit == "max_batch_size":
        return plan.fits and plan.limits.batch_reachable
    return plan.fits


def _try(inputs: PlanInputs, gpu: GPUSpec, gpu_count: int | None, **changes: Any) -> Plan | None:
    try:
        return _evaluate(dataclasses.replace(inputs, **changes), gpu, gpu_count)
    except PlanError:
        return None


def _advise(plan: Plan, inputs: PlanInputs, gpu: GPUSpec, gpu_count: int | None) -> list[str]:
    limit = plan.first_limit
    if limit is None:
        return []
    shape = parse_model_config(inputs.model_config)
    fmt = weight_format(inputs.weight_format)
    advice: list[str] = []
    if limit == "gpu_count":
        return [f"lower tp × pp to at most {gpu_count}, or plan with at least {plan.world_size} GPUs"]
    target = inputs.target
    if limit == "format":
        runs_fmt = registry.gpus_that_run(target, fmt.name, inputs.kv_cache)
        advice.append(f"formats {gpu.name} runs: {', '.join(registry.formats_that_run(target, gpu.sm))}")
        kv_here = registry.kv_formats_that_run(target, gpu.sm)
        if inputs.kv_cache not in kv_here:
            advice.append(f"use kv_cache {' or '.join(kv_here)} on this GPU")
        advice.append(f"GPUs that run {fmt.name} with kv_cache {inputs.kv_cache}: {', '.join(runs_fmt) or 'none'}")
        return advice

    base = base_dtype_bytes(inputs.dtype)
    current_bpw = fmt.bytes_per_weight(base, inputs.awq_block_size)
    # Smaller weight formats this GPU runs.
    if limit in ("weights", "workspace", "kv_cache", "max_batch_size"):
        candidates = sorted(
            (weight_format(name) for name in registry.formats_that_run(target, gpu.sm)
             if weight_format(name).bytes_per_weight(base, inputs.awq_block_size) < current_bpw),
            key=lambda f: -f.bytes_per_weight(base, inputs.awq_block_size),
        )
        for f in candidates:
            alt = _try(inputs, gpu, gpu_count, weight_format=f.name)
            if alt and _solves(alt, limit):
                advice.append(
                    f"weight format {f.name}: {_gib(alt.weights.per_gpu_bytes)} weights per GPU, "
                    f"{alt.kv_cache.max_sequences} full-length sequences"
                )
                break
    # More tensor parallelism.
    tp_limit = (gpu_count // inputs.pp) if gpu_count else MAX_TP_WITHOUT_COUNT
    for tp in valid_tp_sizes(shape, limit=max(tp_limit, 1)):
        if tp <= inputs.tp:
            continue
        alt = _try(inputs, gpu, gpu_count, tp=tp)
        if alt and _solves(alt, limit):
            advice.append(
                f"tp {tp}: {_gib(alt.weights.per_gpu_bytes)} weights per GPU, "
                f"{alt.kv_cache.max_sequences} full-length sequences"
            )
            break
    else:
        if limit in ("weights", "workspace"):
            advice.append(f"no tp up to {tp_limit} is enough alone: add pipeline stages (pp) or GPUs with more memory")
    # Workspace side: fewer tokens per forward pass means smaller activation buffers.
    if limit in ("workspace", "kv_cache"):
        for tokens in (16384, 8192, 4096, 2048, 1024):
            if tokens >= inputs.max_num_tokens:
                continue
            alt = _try(inputs, gpu, gpu_count, max_num_tokens=tokens)
            if alt and _solves(alt, limit):
                advice.append(
                    f"max_num_tokens {tokens}: activations {_gib(alt.workspace.activation_bytes)} per GPU, "
                    f"{alt.kv_cache.max_sequences} full-length sequences"
                )
                break
    # KV-cache side: a smaller KV dtype, a shorter max_seq_len, a smaller batch.
    if limit in ("kv_cache", "max_batch_size"):
        smaller = sorted((k for k in registry.kv_formats_that_run(target, gpu.sm)
                          if kv_dtype_bytes(k, inputs.dtype) < kv_dtype_bytes(inputs.kv_cache, inputs.dtype)),
                         key=lambda k: kv_dtype_bytes(k, inputs.dtype))
        if smaller:
            kv_alt = smaller[0]
            alt = _try(inputs, gpu, gpu_count, kv_cache=kv_alt)
            if alt and _solves(alt, limit):
                advice.append(f"kv_cache {kv_alt}: {alt.kv_cache.max_sequences} full-length sequences")
        wanted = 1 if limit == "kv_cache" else inputs.max_batch_size
        tpb = inputs.tokens_per_block
        seq_len = plan.kv_cache.blocks // wanted * tpb
        if seq_len >= tpb:
            advice.append(
                f"max_seq_len ≤ {seq_len}: {wanted} sequence(s) of that length fit"
            )
        if limit == "max_batch_size" and plan.kv_cache.max_sequences >= 1:
            advice.append(
                f"max_batch_size {plan.kv_cache.max_sequences}: the most full-length sequences that fit "
                "(shorter sequences share the cache, so more may run in practice)"
            )
    return advice


def make_plan(inputs: PlanInputs, gpu: GPUSpec, gpu_count: int | None = None,
              workload: Workload | None = None) -> Plan:
    """Plan ``inputs`` on ``gpu_count`` GPUs of model ``gpu`` (None: as many as tp × pp needs).

    With a ``workload`` (prompt/output lengths, optionally a concurrency) a plan that fits also predicts its
    serving speed (``Plan.workload``, how in ``Plan.speed``; see :mod:`kiln.plan.speed`); one that does not fit
    says so in its warnings instead.

    Raises PlanError for bad input (unknown format or dtype, model config missing fields, tp that does
    not split the heads, …), naming what is allowed. A plan that does not fit is not an error: see
    ``Plan.fits``, ``Plan.verdict``, ``Plan.first_limit`` and ``Plan.advice``.
    """
    if gpu_count is not None and (isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 1):
        raise PlanError(f"gpu_count must be a positive integer, got {gpu_count!r}")
    plan = _evaluate(inputs, gpu, gpu_count)
    plan.advice = _advise(plan, inputs, gpu, gpu_count)
    if workload is not None:
        if plan.fits:
            plan.workload, plan.speed = predict_speed(plan, workload)
        else:
            plan.warnings.append("no speed prediction: the plan does not fit")
    return plan


def weight_bytes(inputs: PlanInputs) -> tuple[int, int]:
    """The weights without a GPU: ``(whole model bytes, heaviest rank's bytes)`` with the same sharding and
    formats as :func:`make_plan` (a weight's size does not depend on the GPU). PlanError for bad input."""
    shape = parse_model_config(inputs.model_config)
    problems = _validate(inputs, shape)
    if problems:
        raise PlanError("invalid plan inputs: " + "; ".join(problems))
    fmt = weight_format(inputs.weight_format)
    whole = _stage_weights(shape, inputs, fmt, 1, 0, shape.num_layers, True, True, True)
    layout = _stage_layers(shape.num_layers, inputs.pp)
    heaviest = max(_stage_weights(shape, inputs, fmt, inputs.tp, first, count, i == 0, i == inputs.pp - 1,
                                  inputs.pp == 1).total for i, (first, count) in enumerate(layout))
    return math.ceil(whole.total), math.ceil(heaviest)
