"""The planner's inputs and its answer: plain dataclasses, each figure with the basis it was made on.

Split from :mod:`kiln.plan.planner` (which re-exports them) so that the arithmetic and the types it fills
stay readable on their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Basis strings (also written into the JSON).
WORKSPACE_BASIS = (
    "runtime: fixed 1 GiB (CUDA context ≈0.5 GiB + cuBLAS/TensorRT/NCCL workspaces ≈0.5 GiB); "
    "activations: TensorRT reuses buffers layer by layer, so one layer's live tensors for max_num_tokens "
    "tokens in the base dtype: per token 3×hidden (residual, norm output, projection output) + q/k/v "
    "outputs + attention output + MLP intermediates (gate, up, activated: 3×intermediate/tp; 2× for a "
    "plain MLP); logits: max_batch_size × vocab_size × 4 bytes (float32, last stage). TensorRT prints the "
    "real activation size at build time; expect it within about 2× of this estimate."
)
KV_BASIS = (
    "bytes per token = 2 (K and V) × layers × KV heads × head_dim × KV dtype bytes; per rank: the stage's "
    "layers and KV heads / tp (replicated when tp > KV heads). Budget = kv_cache_free_gpu_mem_fraction × "
    "(GPU memory − weights − workspace), capped by max_tokens_in_paged_kv_cache, rounded down to whole "
    "blocks of tokens_per_block; a sequence of max_seq_len takes ceil(max_seq_len / tokens_per_block) blocks."
)
DECODE_BASIS = (
    "one decode step per batch: time = max(bytes read ÷ HBM bandwidth, GEMM FLOPs ÷ dense tensor "
    "throughput), summed over pipeline stages (no overlap credited); bytes read = all weights except the "
    "embedding table (only looked up) + the KV cache of every sequence at max_seq_len tokens (worst case, "
    "end of generation); FLOPs = 2 × GEMM parameters × batch. Communication and kernel overheads ignored: "
    "an upper bound on speed."
)
PREFILL_BASIS = (
    "one sequence of max_input_len tokens: GEMM FLOPs = 2 × GEMM parameters × tokens (lm_head for the "
    "last token only) at the format's tensor throughput (excluded modules at the base dtype's), plus "
    "causal attention FLOPs = 2 × layers × heads × head_dim × tokens² at the base dtype's throughput; "
    "time = max(compute, weights ÷ bandwidth), per rank with tp, stages in sequence. Dense datasheet "
    "peaks: real kernels reach perhaps 60–80% of them."
)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner needs, as plain values (no recipe schema).

    ``model_config`` is the Hugging Face ``config.json`` content. ``weight_format`` and ``kv_cache`` are
    names in the format registry (kiln/recipe/data/formats.yaml) and ``target`` one of its targets, whose
    support for the formats the plan checks; ``dtype`` is the base/activation dtype (``float16``,
    ``bfloat16``, ``float32``).
    ``exclude_modules`` are module-name patterns kept at the base dtype (``"lm_head"`` matches a module
    named so at any depth; wildcards as in fnmatch). ``awq_block_size`` is the group size of the AWQ
    formats. The remaining fields are TensorRT-LLM build/runtime settings of the same names.
    """

    model_config: dict
    weight_format: str = "none"
    kv_cache: str = "none"
    dtype: str = "float16"
    exclude_modules: tuple[str, ...] = ("lm_head",)
    awq_block_size: int = 128
    tp: int = 1
    pp: int = 1
    max_batch_size: int = 2048
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    target: str = "tensorrt"
    enable_chunked_context: bool = False
    fp8_context_fmha: bool = False


@dataclass
class StagePlan:
    """One pipeline stage, as seen by each of its tp ranks (all bytes per GPU).

    ``gemm_params`` / ``gemm_bytes``: the decoder layers' matrices by the tensor-core type their GEMMs run in
    (``base`` is the activation dtype); ``lm_head_*``: the output head, which only the rows that need logits
    multiply (``lm_head_read_bytes`` is what a step streams: the embedding table when tied).
    """

    stage: int
    first_layer: int
    layers: int
    params: int
    weights_bytes: int
    embedding_bytes: int
    attention_bytes: int
    mlp_bytes: int
    norm_bytes: int
    lm_head_bytes: int
    excluded_bytes: int
    workspace_bytes: int
    free_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    kv_tokens: int
    gemm_params: dict[str, int] = field(default_factory=dict)
    gemm_bytes: dict[str, int] = field(default_factory=dict)
    lm_head_gemm: str = "base"
    lm_head_params: int = 0
    lm_head_read_bytes: int = 0


@dataclass
class WeightsPlan:
    """Weight storage: format, bytes per weight, whole-model and per-GPU totals."""

    format: str
    quant_algo: str | None
    base_dtype: str
    bytes_per_weight: float
    total_params: int
    quantized_params: int
    total_bytes: int
    per_gpu_bytes: int
    tie_word_embeddings: bool
    exclude_modules: list[str]
    excluded_matches: list[str]
    basis: list[str]


@dataclass
class WorkspacePlan:
    """The activation/workspace estimate for the stage that binds (see ``basis``)."""

    runtime_bytes: int
    activation_bytes: int
    activation_bytes_per_token: int
    logits_bytes: int
    total_bytes: int
    basis: str = WORKSPACE_BASIS


@dataclass
class KVCachePlan:
    """KV-cache size per token and sequence, and how many fit (figures for the binding stage's ranks)."""

    dtype: str
    bytes_per_element: int
    bytes_per_token: int
    bytes_per_token_per_gpu: int
    kv_heads_per_gpu: int
    bytes_per_sequence_per_gpu: int
    gpu_memory_bytes: int
    free_bytes_per_gpu: int
    budget_bytes_per_gpu: int
    kv_cache_free_gpu_mem_fraction: float
    max_tokens_in_paged_kv_cache: int | None
    tokens_per_block: int
    blocks: int
    tokens: int
    blocks_per_sequence: int
    max_sequences: int
    limited_by: str
    basis: str = KV_BASIS


@dataclass
class DecodePoint:
    """Roofline decode speed at one batch size."""

    batch: int
    memory_ms: float
    compute_ms: float | None
    step_ms: float
    bound: str
    tokens_per_s_per_sequence: float
    tokens_per_s: float


@dataclass
class PrefillPlan:
    """Roofline prefill time for one max_input_len prompt."""

    tokens: int
    gemm_flops: float
    attention_flops: float
    compute_s: float | None
    memory_s: float
    seconds: float | None
    tokens_per_s: float | None
    tensor_tflops: dict[str, float]
    basis: str = PREFILL_BASIS


@dataclass
class LimitsPlan:
    """Concurrency and roofline limits."""

    max_batch_size: int
    max_concurrent_sequences: int
    batch_reachable: bool
    decode_context_len: int
    decode: list[DecodePoint]
    prefill: PrefillPlan
    decode_basis: str = DECODE_BASIS


@dataclass
class Plan:
    """The planner's answer. ``fits``/``verdict``/``first_limit``/``advice`` summarise it; ``to_dict()``
    gives JSON-ready content with every figure and its basis."""

    model: dict[str, Any]
    gpu: dict[str, Any]
    gpu_count: int | None
    tp: int
    pp: int
    world_size: int
    replicas: int
    settings: dict[str, Any]
    weights: WeightsPlan
    workspace: WorkspacePlan
    kv_cache: KVCachePlan
    limits: LimitsPlan
    stages: list[StagePlan]
    fits: bool
    first_limit: str | None
    verdict: str
    advice: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    workload: WorkloadPlan | None = None
    speed: SpeedPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        """All figures as plain JSON-ready values (bytes as ints, times in ms/s as floats)."""
        return dataclasses.asdict(self)


SPEED_BASIS = (
    "in-flight batching in steady state, closed loop: `batch` requests in flight, each finished one replaced at "
    "once. Each step decodes one token for every generating sequence and, in some steps, carries prompt tokens "
    "(a whole prompt, several, or a chunk of one when chunked context is on) up to max_num_tokens. A step's time "
    "per GPU: every GEMM as max(weight streaming, math) + overlap × the shorter of the two (weights at the "
    "measured streaming fraction of HBM bandwidth, math at the measured compute fraction of the dense tensor "
    "peak × a fitted scale); decode attention reads each sequence's KV cache (prompt + half the output) at the "
    "measured attention fraction of bandwidth; prompt attention = 2 × layers × heads × head_dim × chunk × isl "
    "FLOPs at the measured fraction × a fitted scale; tensor parallelism adds 2 all-reduces per layer of tokens "
    "× hidden × activation bytes (latency + 2(tp−1)/tp × bytes ÷ link bandwidth, from the GPU table); pipeline "
    "stages pass their activations over the same link, the batch running as pp micro-batches; a fitted "
    "overhead per step and per sequence. TPOT = the mean step; TTFT = the prompt's steps (+ waiting for a slot "
    "when concurrency exceeds the batch); E2E = TTFT + (osl − 1) × TPOT; tokens/s = requests finished per "
    "second × osl (Little's law ties them to the batch). Measured fractions: plan/data/kernel_efficiency.json; "
    "fitted scalars: plan/data/speed_fit.json."
)
ANCHOR_NOTE = (
    "calibrated on TensorRT-LLM 1.0's published trtllm-bench max-throughput rows (Llama 3.1 8B FP8; 70B rows "
    "held out), measured with the PyTorch backend (trtllm-bench's default since 0.19): for `target: tensorrt` "
    "they are a proxy"
)


@dataclass
class WorkloadPlan:
    """Predicted serving speed for ``isl``/``osl`` at ``concurrency`` (None: the largest batch the limits
    allow). ``limited_by`` names what stopped the batch: ``kv_cache``, ``max_batch_size``, ``max_num_tokens``
    or ``concurrency`` (the workload itself). Figures are for one engine (tp × pp GPUs; replicas multiply the
    total); token rates count output tokens only."""

    isl: int
    osl: int
    concurrency: int | None
    batch: int
    limited_by: str
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    output_tokens_per_s: float
    output_tokens_per_s_per_gpu: float


@dataclass
class StepTime:
    """One engine step's time per GPU (ms), by component, for ``decode`` sequences and ``prefill`` prompt
    tokens (per step, whole engine; with pp > 1 the slowest stage's micro-batch times pp)."""

    decode: float
    prefill: float
    gemm_ms: float
    decode_attention_ms: float
    prefill_attention_ms: float
    communication_ms: float
    overhead_ms: float
    total_ms: float


@dataclass
class SpeedPlan:
    """How :class:`WorkloadPlan` was reached: each limit's batch, the steady state, the two kinds of step,
    the kernel fractions and fitted scalars used, and the basis."""

    limits: dict[str, int]
    requests_per_s: float
    prefill_tokens_per_step: float
    steps_with_prefill: float
    prompt_steps: int
    queue_wait_ms: float
    decode_step: StepTime
    prefill_step: StepTime
    fractions: dict[str, Any]
    fitted: dict[str, Any]
    anchors: str = ANCHOR_NOTE
    basis: str = SPEED_BASIS
