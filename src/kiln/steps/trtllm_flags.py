"""The ``trtllm-build`` command line of TensorRT-LLM 1.2.x, as data.

Pure data plus one small checker, :func:`check_flags`, so that kiln can refuse a
build command that upstream would reject (unknown flag, bad choice, missing
value) before it reaches a GPU machine.

Sources (read with the search tools; nothing here is copied code):

* ``NVIDIA/TensorRT-LLM`` GitHub Pages, path ``1.2.1/commands/trtllm-build.html``
  (commit 58fb435e of the docs branch): the argparse output that Sphinx renders
  from ``tensorrt_llm/commands/build.py`` of release 1.2.1, with every flag,
  alias, choice list and default.  This is the authoritative list below.
* Same branch, ``1.2.1/_modules/tensorrt_llm/builder.html`` (``BuildConfig``
  field defaults, ``_init_max_seq_len``, ``build()``) and
  ``1.2.1/_modules/tensorrt_llm/quantization/mode.html`` (``QuantAlgo``,
  ``QUANT_ALGO_LIST``, ``KV_CACHE_QUANT_ALGO_LIST``, ``QuantMode.from_quant_algo``).
* ``NVIDIA/TensorRT-LLM`` ``tensorrt_llm/plugin/plugin.py`` at commit c20322ff
  (``PluginConfig`` pydantic fields, ``cli_plugin_args``, ``add_plugin_argument``,
  ``validate``); its flag list, choices and defaults match the 1.2.1 page above.
* ``NVIDIA/Model-Optimizer`` docs, ``guides/0_support_matrix`` (GPU generation per
  quantization format).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

TRTLLM_VERSION_SOURCE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "version": "1.2.1",
        "flags": (
            "NVIDIA/TensorRT-LLM gh-pages 1.2.1/commands/trtllm-build.html "
            "(docs commit 58fb435eacc402f3bd177e60f592c955d2b0719d), generated from "
            "tensorrt_llm/commands/build.py + tensorrt_llm/plugin/plugin.py of v1.2.1"
        ),
        "build_config": (
            "NVIDIA/TensorRT-LLM gh-pages 1.2.1/_modules/tensorrt_llm/builder.html "
            "(BuildConfig, _init_max_seq_len, build)"
        ),
        "quant_algo": (
            "NVIDIA/TensorRT-LLM gh-pages 1.2.1/_modules/tensorrt_llm/quantization/mode.html "
            "(QuantAlgo, QUANT_ALGO_LIST, KV_CACHE_QUANT_ALGO_LIST)"
        ),
        "plugin_config": (
            "NVIDIA/TensorRT-LLM tensorrt_llm/plugin/plugin.py @ c20322ffd3dc0740ca530c9fad989b22e64f6e06"
        ),
        "gpu_matrix": "NVIDIA/Model-Optimizer docs guides/0_support_matrix",
    }
)

FlagKind = Literal["int", "str", "path", "choice", "bool_enable_disable", "store_true"]

# argparse's own sentinel (``argparse.SUPPRESS == "==SUPPRESS=="``): upstream gives
# ``--kv_cache_type`` and ``--paged_kv_cache`` no default at all, so that the build
# can tell "not given" from any value.
SUPPRESSED: Final = "==SUPPRESS=="

ENABLE_DISABLE: Final = ("enable", "disable")
# Plugin dtype choices.  Upstream renders "disable" twice (None appears in both the
# Literal and the Optional); the duplicate is dropped here.
_PLUGIN_DTYPES: Final = ("auto", "float16", "float32", "bfloat16", "int32", "disable")


@dataclass(frozen=True)
class FlagSpec:
    """One ``trtllm-build`` flag as upstream's argparse declares it.

    ``default`` is the argparse default verbatim: ``None`` where upstream has none,
    :data:`SUPPRESSED` where upstream uses ``argparse.SUPPRESS``, and the strings
    ``"enable"``/``"disable"`` for plugin switches (they are strings on the command
    line, turned into booleans later by ``PluginConfig``).
    """

    name: str
    kind: FlagKind
    default: object = None
    choices: tuple[str, ...] | None = None
    help: str = ""
    aliases: tuple[str, ...] = ()
    nargs: Literal["+"] | None = None
    group: str = "general"
    deprecated: str | None = None

    @property
    def takes_value(self) -> bool:
        """Whether the flag consumes the next command-line token(s)."""
        return self.kind != "store_true"


def _flag(name: str, kind: FlagKind, default: object = None, **kw: object) -> tuple[str, FlagSpec]:
    return name, FlagSpec(name=name, kind=kind, default=default, **kw)  # type: ignore[arg-type]


def _plugin(name: str, default: str | None, choices: tuple[str, ...], help: str) -> tuple[str, FlagSpec]:
    return _flag(name, "choice", default, choices=choices, help=help, group="plugin")


def _switch(name: str, default: str, help: str) -> tuple[str, FlagSpec]:
    return _flag(name, "bool_enable_disable", default, choices=ENABLE_DISABLE, help=help, group="plugin")


# fmt: off
BUILD_FLAGS: Final[Mapping[str, FlagSpec]] = MappingProxyType(dict([
    # -- inputs / outputs ------------------------------------------------------------
    _flag("--checkpoint_dir", "path", None, help="TensorRT-LLM checkpoint directory (config.json + rank*.safetensors)."),
    _flag("--model_config", "path", None, help="Checkpoint config.json used instead of --checkpoint_dir (no weights)."),
    _flag("--build_config", "path", None, help="JSON BuildConfig file; replaces the build-shape flags below."),
    _flag("--model_cls_file", "path", None, help="Python file defining a custom model class."),
    _flag("--model_cls_name", "str", None, help="Custom model class name (with --model_cls_file)."),
    _flag("--output_dir", "path", "engine_outputs", help="Where config.json and rank{N}.engine are written."),
    # -- build shape (BuildConfig) ---------------------------------------------------
    _flag("--max_batch_size", "int", 2048, help="Maximum number of requests the engine can schedule."),
    _flag("--max_input_len", "int", 1024, help="Maximum input length of one request."),
    _flag("--max_seq_len", "int", None, aliases=("--max_decoder_seq_len",),
          help="Maximum prompt+output length; deduced from max_position_embeddings when unset."),
    _flag("--max_beam_width", "int", 1, help="Maximum beam width for beam search."),
    _flag("--max_num_tokens", "int", 8192, help="Maximum batched input tokens per iteration (padding removed)."),
    _flag("--opt_num_tokens", "int", None, help="Optimal batched input tokens (defaults to max_batch_size*max_beam_width)."),
    _flag("--max_encoder_input_len", "int", 1024, help="Maximum encoder input length (encoder-decoder models)."),
    _flag("--max_prompt_embedding_table_size", "int", 0, aliases=("--max_multimodal_len",),
          help="Prompt-tuning / multimodal table size; > 0 enables it."),
    _flag("--kv_cache_type", "choice", SUPPRESSED, choices=("continuous", "paged", "disabled"),
          help="KV cache type; when neither this nor --paged_kv_cache is given the build uses paged."),
    _flag("--paged_kv_cache", "bool_enable_disable", SUPPRESSED, choices=ENABLE_DISABLE,
          deprecated="use --kv_cache_type paged|continuous instead",
          help="Deprecated; 'enable' equals --kv_cache_type paged for transformer models."),
    _flag("--input_timing_cache", "path", None, help="Timing cache to read (ignored when the file is missing)."),
    _flag("--output_timing_cache", "path", "model.cache", help="Timing cache to write."),
    _flag("--profiling_verbosity", "choice", "layer_names_only", choices=("layer_names_only", "detailed", "none"),
          help="TensorRT engine profiling verbosity."),
    _flag("--strip_plan", "store_true", False, help="Strip weights from the engine (refit later with the same weights)."),
    _flag("--weight_sparsity", "store_true", False, help="Enable weight sparsity."),
    _flag("--weight_streaming", "store_true", False, help="Allow offloading weights to CPU and streaming them at run time."),
    _flag("--fast_build", "store_true", False, help="Faster build, possibly slower engine."),
    _flag("--workers", "int", 1, help="Parallel build workers (capped at the visible GPU count)."),
    _flag("--log_level", "choice", "info",
          choices=("internal_error", "error", "warning", "info", "verbose", "debug", "trace"), help="Logging level."),
    _flag("--enable_debug_output", "store_true", False, help="Enable debug output tensors."),
    _flag("--visualize_network", "path", None, help="Directory to export the network as ONNX before building."),
    _flag("--dry_run", "store_true", False, help="Run everything except the actual engine build."),
    _flag("--monitor_memory", "store_true", False, help="Monitor memory during the build."),
    # -- logits ---------------------------------------------------------------------
    _flag("--logits_dtype", "choice", None, choices=("float16", "float32"), group="logits",
          help="Data type of the logits output."),
    _flag("--gather_context_logits", "store_true", False, group="logits", help="Enable gathering context logits."),
    _flag("--gather_generation_logits", "store_true", False, group="logits", help="Enable gathering generation logits."),
    _flag("--gather_all_token_logits", "store_true", False, group="logits", help="Both of the two above."),
    # -- LoRA -----------------------------------------------------------------------
    _flag("--lora_dir", "path", None, nargs="+", group="lora", help="LoRA weight directories (first one configures)."),
    _flag("--lora_ckpt_source", "choice", "hf", choices=("hf", "nemo"), group="lora", help="LoRA checkpoint format."),
    _flag("--lora_target_modules", "choice", None, nargs="+", group="lora",
          choices=("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h",
                   "mlp_gate", "cross_attn_qkv", "cross_attn_q", "cross_attn_k", "cross_attn_v",
                   "cross_attn_dense", "moe_h_to_4h", "moe_4h_to_h", "moe_gate", "moe_router", "mlp_router",
                   "mlp_gate_up"),
          help="Modules LoRA applies to (needs --lora_plugin)."),
    _flag("--max_lora_rank", "int", 64, group="lora", help="Maximum LoRA rank (sizes the LoRA plugin workspace)."),
    # -- speculative decoding -------------------------------------------------------
    _flag("--speculative_decoding_mode", "choice", None, group="speculative",
          choices=("draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"),
          help="Speculative decoding mode; the build then adds max_draft_len to max_seq_len."),
    _flag("--max_draft_len", "int", 0, group="speculative", help="Maximum draft tokens for the target model."),
    # -- plugins (PluginConfig fields listed in plugin.py cli_plugin_args) ----------
    _plugin("--bert_attention_plugin", "auto", _PLUGIN_DTYPES, "Attention plugin for BERT-like encoders."),
    _plugin("--gpt_attention_plugin", "auto", _PLUGIN_DTYPES, "Attention plugin for GPT-like decoders (in-place KV cache)."),
    _plugin("--gemm_plugin", None, ("auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"),
            "cuBLASLt GEMM plugin for non-quantized GEMMs (and FP8); off when not given."),
    _plugin("--gemm_swiglu_plugin", "disable", ("fp8", "disable"), "GEMM + SwiGLU fusion (FP8 on Hopper only)."),
    _plugin("--fp8_rowwise_gemm_plugin", "disable", _PLUGIN_DTYPES, "FP8 per-token/per-channel GEMM plugin."),
    _plugin("--nccl_plugin", "auto", _PLUGIN_DTYPES, "NCCL plugin for multi-GPU/multi-node."),
    _plugin("--lora_plugin", "disable", _PLUGIN_DTYPES, "Enable LoRA."),
    _switch("--dora_plugin", "disable", "Enable DoRA."),
    _plugin("--moe_plugin", "auto", _PLUGIN_DTYPES, "MoE kernels."),
    _plugin("--mamba_conv1d_plugin", "auto", _PLUGIN_DTYPES, "Mamba conv1d kernels."),
    _plugin("--low_latency_gemm_plugin", "disable", ("fp8", "disable"), "Low-latency GEMM plugin."),
    _plugin("--low_latency_gemm_swiglu_plugin", "disable", ("fp8", "disable"), "Low-latency GEMM + SwiGLU plugin."),
    _plugin("--gemm_allreduce_plugin", "disable", ("float16", "bfloat16", "disable"), "GEMM + AllReduce fusion."),
    _switch("--context_fmha", "enable", "Fused multi-head attention in the context phase."),
    _switch("--bert_context_fmha_fp32_acc", "disable", "FP32 accumulation for BERT context FMHA."),
    _switch("--remove_input_padding", "enable", "Pack tokens of different requests together."),
    _switch("--norm_quant_fusion", "disable", "Fuse LayerNorm and quantization."),
    _switch("--reduce_fusion", "disable", "Fuse ResidualAdd+LayerNorm after AllReduce (TP>1, some models)."),
    _switch("--user_buffer", "disable", "Zero-copy communication buffers; needs --reduce_fusion enable."),
    _flag("--tokens_per_block", "int", 32, group="plugin", help="Tokens per paged KV cache block."),
    _switch("--use_paged_context_fmha", "enable", "Paged context FMHA; needed for KV cache reuse and chunked context."),
    _switch("--use_fp8_context_fmha", "enable", "FP8 context FMHA when the FP8 workflow is used."),
    _switch("--fuse_fp4_quant", "disable", "Fuse FP4 quantization into the attention kernel."),
    _switch("--multiple_profiles", "disable", "Several TensorRT optimization profiles (longer build)."),
    _switch("--paged_state", "enable", "Paged RNN state (Mamba/RecurrentGemma)."),
    _switch("--streamingllm", "disable", "StreamingLLM; the 1.2 build asserts it is off."),
    _switch("--use_fused_mlp", "enable", "Horizontal fusion of the gated-MLP GEMMs."),
    _switch("--pp_reduce_scatter", "disable", "ReduceScatter+AllGather PP optimization (Mixtral only)."),
]))
# fmt: on

_HELP_FLAGS: Final = frozenset({"-h", "--help"})

ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {alias: spec.name for spec in BUILD_FLAGS.values() for alias in spec.aliases}
)

# Flags people still copy from older guides.  None is accepted by trtllm-build 1.2.1.
REMOVED_FLAGS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "--tp_size": "parallelism is not a build flag: tp_size comes from the checkpoint's mapping "
        "(set when converting/exporting the checkpoint); trtllm-build builds one engine per rank",
        "--pp_size": "parallelism is not a build flag: pp_size comes from the checkpoint's mapping",
        "--world_size": "world size comes from the checkpoint's mapping (tp_size * pp_size)",
        "--strongly_typed": "removed: trtllm-build always builds strongly typed networks "
        "(build.py passes strongly_typed=True; BuildConfig.strongly_typed defaults to True)",
        "--max_output_len": "removed: use --max_seq_len (prompt + output tokens)",
        "--auto_parallel": "removed in 1.x together with --gpus_per_node and --cluster_key",
        "--gpus_per_node": "removed with auto parallel",
        "--cluster_key": "removed with auto parallel",
        "--use_inflight_batching": "not a trtllm-build flag: in-flight batching needs the defaults "
        "(gpt_attention_plugin, paged KV cache, remove_input_padding)",
        "--enable_context_fmha": "use --context_fmha enable",
        "--multi_block_mode": "a runtime option now (Triton tensorrt_llm parameter multi_block_mode)",
        "--use_custom_all_reduce": "not a trtllm-build 1.2 flag",
        "--use_weight_only": "quantization is read from the checkpoint (quant_algo), not from build flags",
        "--weight_only_precision": "quantization is read from the checkpoint (quant_algo), not from build flags",
        "--int8_kv_cache": "KV cache quantization is read from the checkpoint (kv_cache_quant_algo)",
        "--use_smooth_quant": "quantization is read from the checkpoint (quant_algo), not from build flags",
    }
)

# --- quantization values a 1.2 checkpoint may carry ----------------------------------
# QuantAlgo members of tensorrt_llm/quantization/mode.py (1.2.1).
QUANT_ALGO_MEMBERS: Final = frozenset(
    {
        "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ",
        "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
        "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8", "FP8_PER_CHANNEL_PER_TOKEN",
        "FP8_BLOCK_SCALES", "INT8", "MIXED_PRECISION", "NVFP4", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8",
        "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "NVFP4_AWQ", "NO_QUANT",
    }
)  # fmt: skip
# QUANT_ALGO_LIST = set(QuantAlgo) - {INT8}: what QuantMode.from_quant_algo accepts as quant_algo
# (INT8 is only a KV-cache algorithm).  A checkpoint may also have quant_algo null (no quantization).
QUANT_ALGOS: Final = QUANT_ALGO_MEMBERS - {"INT8"}
# KV_CACHE_QUANT_ALGO_LIST = [FP8, INT8, NVFP4]; kv_cache_quant_algo may also be null.
KV_CACHE_QUANT_ALGOS: Final = frozenset({"FP8", "INT8", "NVFP4"})

# --- GPU requirements ------------------------------------------------------------------
# Minimum compute capability (SM, e.g. 89 = 8.9) per quant_algo, from ModelOpt's support
# matrix: FP8 and W4A8 AWQ "Ada and later", INT8 SmoothQuant and W4A16 AWQ "Ampere and
# later", FP4 "Blackwell and later".  Formats the matrix does not list are absent.
QUANT_ALGO_MIN_SM: Final[Mapping[str, int]] = MappingProxyType(
    {"FP8": 89, "W4A8_AWQ": 89, "W8A8_SQ_PER_CHANNEL": 80, "W4A16_AWQ": 80, "NVFP4": 100}
)
# trtllm-build 1.2.1 raises on SM 100-119 (``builder.build``): INT8/INT4 weight-only modes
# (which by QuantMode.from_quant_algo include the AWQ/GPTQ ones and W4A8_AWQ), INT8 KV cache,
# SmoothQuant (INT8 weights + activations), and per-channel/per-token scaling (FP8 rowwise).
SM_100_TO_119_REFUSED_QUANT_ALGOS: Final = frozenset(
    {
        "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ",
        "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
        "FP8_PER_CHANNEL_PER_TOKEN",
    }
)  # fmt: skip
SM_100_TO_119_REFUSED_KV_CACHE_QUANT_ALGOS: Final = frozenset({"INT8"})
# PluginConfig.validate(): plugins refused on exactly SM 100.
SM_100_UNSUPPORTED_PLUGIN_FLAGS: Final = frozenset(
    {
        "--gemm_swiglu_plugin", "--fp8_rowwise_gemm_plugin", "--low_latency_gemm_plugin",
        "--low_latency_gemm_swiglu_plugin", "--bert_context_fmha_fp32_acc",
    }
)  # fmt: skip
# builder.build(): FP8 context FMHA is switched off (with a warning, not an error) below SM 89.
FP8_CONTEXT_FMHA_MIN_SM: Final = 89


def canonical_flag(name: str) -> str | None:
    """Return the primary spelling of ``name`` (resolving aliases), or ``None`` if unknown."""
    if name in BUILD_FLAGS:
        return name
    return ALIASES.get(name)


def _unknown_flag_problem(name: str) -> str:
    if name in REMOVED_FLAGS:
        return f"{name}: not accepted by trtllm-build 1.2 ({REMOVED_FLAGS[name]})"
    known = [*BUILD_FLAGS, *ALIASES]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{name}: unknown trtllm-build 1.2 flag{hint}"


def _value_problem(spec: FlagSpec, given: str, value: str) -> str | None:
    if spec.kind == "int":
        try:
            int(value)
        except ValueError:
            return f"{given}: expected an integer, got {value!r}"
        return None
    if spec.choices is not None:
        # --kv_cache_type is matched case-insensitively upstream (KVCacheType._missing_).
        candidate = value.lower() if spec.name == "--kv_cache_type" else value
        if candidate not in spec.choices:
            return f"{given}: {value!r} is not one of {', '.join(spec.choices)}"
    return None


def check_flags(argv: list[str]) -> list[str]:
    """Check a ``trtllm-build`` argument list against the 1.2.1 command line.

    ``argv`` is what follows ``trtllm-build`` (no program name).  Returns a list of
    human-readable problems; an empty list means upstream's parser would accept it.
    Stricter than argparse on purpose: abbreviated flags (argparse's prefix matching)
    and repeated flags are reported, so that generated commands stay explicit.
    """
    problems: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token == "-":
            problems.append(f"{token!r}: unexpected positional argument (trtllm-build takes only flags)")
            continue
        given, has_inline, inline = token.partition("=")
        if given in _HELP_FLAGS:
            continue
        name = canonical_flag(given)
        if name is None:
            problems.append(_unknown_flag_problem(given))
            continue
        spec = BUILD_FLAGS[name]
        if name in seen:
            problems.append(f"{given}: given more than once")
        seen.add(name)
        if not spec.takes_value:
            if has_inline:
                problems.append(f"{given}: takes no value, got {inline!r}")
            continue
        values: list[str] = []
        if has_inline:
            values.append(inline)
        else:
            while i < len(argv) and not (argv[i].startswith("--") or argv[i] in _HELP_FLAGS):
                values.append(argv[i])
                i += 1
                if spec.nargs is None:
                    break
        if not values:
            problems.append(f"{given}: needs a value")
            continue
        for value in values:
            problem = _value_problem(spec, given, value)
            if problem:
                problems.append(problem)
    return problems
