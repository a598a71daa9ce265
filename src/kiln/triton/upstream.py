"""The Triton model-repository contract of TensorRT-LLM's ``inflight_batcher_llm`` layout, as data.

Five models: ``preprocessing`` (Python, tokenizer) -> ``tensorrt_llm`` (C++ backend
``tensorrtllm``) -> ``postprocessing`` (Python, detokenizer), wired by the ``ensemble``;
``tensorrt_llm_bls`` is the Python alternative to the ensemble (and drives
draft/target speculative decoding).  kiln writes these configs itself; this module
says what upstream declares so that kiln's repositories keep the tensor names, types
and shapes that existing clients rely on.

Sources (read with the search tools; no upstream code is copied):

* ``NVIDIA/TensorRT-LLM`` ``triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt``
  at the newest versions the search index holds: tensorrt_llm and ensemble @ 2a9abd95,
  preprocessing @ 808059da, postprocessing @ 89fd9b74, tensorrt_llm_bls @ bff88ea8.
  They could not be pinned to the v1.2.1 tag (the repository is too large to fetch);
  they differ from the last tree in ``triton-inference-server/tensorrtllm_backend``
  (commit c2e65b8, 2025-05-13, ``all_models/inflight_batcher_llm``) only by the
  entries in :data:`ADDED_SINCE_BACKEND_REPO` and by templated prompt-table dtypes,
  which ``tensorrtllm_backend`` r26.x docs (docs/llama.md, docs/multimodal.md) fill.
* Parameter semantics and backend defaults: ``tensorrtllm_backend`` r26.04
  ``docs/model_config.md`` and the C++ backend ``inflight_batcher_llm/src/
  model_instance_state.cc`` / ``model_state.cc`` at c2e65b8; Python models'
  ``model.py`` at c2e65b8.
* Containers: ``triton-inference-server/server`` ``docs/introduction/compatibility.md``
  (trtllm-python-py3 table); ``tensorrtllm_backend`` branches r25.12-r26.07
  ``dockerfile/Dockerfile.triton.trt_llm_backend`` (TENSORRTLLM_VER) agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

UPSTREAM_SOURCE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "config_pbtxt": "NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm "
        "(tensorrt_llm+ensemble @ 2a9abd9536aa62ad3e4b9314be9286b1b1be523b, "
        "preprocessing @ 808059da341493bbf8deb9380aef745e4f546909, "
        "postprocessing @ 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0, "
        "tensorrt_llm_bls @ bff88ea886779f832686acb3f165e2b919c95b77)",
        "last_backend_repo_tree": "triton-inference-server/tensorrtllm_backend @ c2e65b8 all_models/inflight_batcher_llm",
        "parameter_docs": "triton-inference-server/tensorrtllm_backend r26.04 docs/model_config.md",
        "backend_defaults": "triton-inference-server/tensorrtllm_backend @ c2e65b8 inflight_batcher_llm/src/model_instance_state.cc",
        "containers": "triton-inference-server/server docs/introduction/compatibility.md @ 0f963c9a8c6913aa4cd9b57ee04f9c2b76ee8d2a",
    }
)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a model config.

    ``data_type`` is a Triton type name (``TYPE_INT32``, ``TYPE_STRING``, ...) or, where
    upstream leaves it to a template variable, that placeholder verbatim (for example
    ``"${logits_datatype}"``; see :data:`TEMPLATED_DATA_TYPES`).  ``dims`` exclude the
    batch dimension (every model has ``max_batch_size`` > 0).  ``reshape == ()`` is
    upstream's ``reshape: { shape: [ ] }`` (a ``[1]`` tensor seen as a scalar).
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    allow_ragged_batch: bool = False

    @property
    def template_var(self) -> str | None:
        """The template variable naming this tensor's type, if upstream templates it."""
        if self.data_type.startswith("${") and self.data_type.endswith("}"):
            return self.data_type[2:-1]
        return None


ParamKind = Literal["str", "path", "int", "float", "bool", "choice", "fixed"]


@dataclass(frozen=True)
class ParameterSpec:
    """One ``parameters { key: ... value: { string_value: ... } }`` entry.

    All values are strings on the wire.  ``template_var`` is the ``${...}`` upstream
    puts there (``None`` for fixed values); ``default`` is what the consumer uses when
    the key is absent or its value cannot be parsed (an unfilled ``${...}`` included),
    ``None`` when there is no default (absent means "unset" or the load fails, see
    ``required``).  ``allowed`` lists accepted spellings for ``choice``/``bool``.
    """

    key: str
    kind: ParamKind
    template_var: str | None = None
    default: str | None = None
    allowed: tuple[str, ...] | None = None
    required: bool = False
    fixed_value: str | None = None
    help: str = ""


@dataclass(frozen=True)
class EnsembleStep:
    """One ``ensemble_scheduling.step``: ``(model tensor, ensemble tensor)`` pairs, in file order."""

    model_name: str
    input_map: tuple[tuple[str, str], ...]
    output_map: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ModelContract:
    """What upstream's ``config.pbtxt`` for one model declares."""

    name: str
    backend: str | None
    platform: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: Mapping[str, ParameterSpec]
    template_vars: frozenset[str]
    decoupled: Literal["templated", "absent"] = "absent"
    dynamic_batching: bool = False
    steps: tuple[EnsembleStep, ...] = ()

    def input(self, name: str) -> TensorSpec:
        """The input tensor called ``name``; ``KeyError`` naming the model otherwise."""
        return _find(self.inputs, name, f"{self.name} input")

    def output(self, name: str) -> TensorSpec:
        """The output tensor called ``name``; ``KeyError`` naming the model otherwise."""
        return _find(self.outputs, name, f"{self.name} output")


def _find(specs: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise KeyError(f"{what} {name!r} is not in the upstream contract")


_T = TensorSpec
_P = ParameterSpec

_BOOL = ("true", "false", "True", "False", "TRUE", "FALSE", "1", "0")  # model_state.cc GetParameter<bool>
_PY_BOOL = ("true", "false", "1", "0", "t", "f", "y", "n", "yes", "no")  # pre/postprocessing model.py (lower-cased)

# Template variables whose value is a Triton data type, and the values upstream docs use.
TEMPLATED_DATA_TYPES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        # "The data type for context and generation logits" -- follows trtllm-build --logits_dtype.
        "logits_datatype": ("TYPE_FP32", "TYPE_FP16"),
        # docs: "float16 (model data type)"; docs/llama.md fills TYPE_FP16.
        "prompt_embedding_table_data_type": ("TYPE_FP16", "TYPE_BF16"),
        # docs: "For the mllama model, this must be TYPE_BF16. For other models like whisper, this is TYPE_FP16."
        "encoder_input_features_data_type": ("TYPE_FP16", "TYPE_BF16"),
    }
)

# Tensors present in the TensorRT-LLM copy but not in tensorrtllm_backend@c2e65b8.
ADDED_SINCE_BACKEND_REPO: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "ensemble": frozenset(
            {"return_num_input_tokens", "return_num_output_tokens", "num_input_tokens", "num_output_tokens"}
        ),
        "tensorrt_llm": frozenset(
            {"return_num_input_tokens", "return_num_output_tokens", "num_input_tokens", "num_output_tokens"}
        ),
        "tensorrt_llm_bls": frozenset(
            {
                "image_sizes_input",
                "return_num_input_tokens",
                "return_num_output_tokens",
                "num_input_tokens",
                "num_output_tokens",
            }
        ),
        # IMAGE_SIZES as an input; also IMAGE_URL dims [1] -> [-1] and output IMAGE_SIZES dims [2] -> [-1, 2].
        "preprocessing": frozenset({"IMAGE_SIZES"}),
        "postprocessing": frozenset(),
    }
)

# upstream all_models/inflight_batcher_llm/ensemble/config.pbtxt
_ENSEMBLE: Final = ModelContract(
    name="ensemble",
    backend=None,
    platform="ensemble",
    inputs=(
        _T("text_input", "TYPE_STRING", (1,)),
        _T("decoder_text_input", "TYPE_STRING", (1,), optional=True),
        _T("max_tokens", "TYPE_INT32", (1,)),
        _T("num_return_sequences", "TYPE_INT32", (1,), optional=True),
        _T("bad_words", "TYPE_STRING", (-1,), optional=True),
        _T("stop_words", "TYPE_STRING", (-1,), optional=True),
        _T("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
        _T("end_id", "TYPE_INT32", (1,), optional=True),
        _T("pad_id", "TYPE_INT32", (1,), optional=True),
        _T("top_k", "TYPE_INT32", (1,), optional=True),
        _T("top_p", "TYPE_FP32", (1,), optional=True),
        _T("temperature", "TYPE_FP32", (1,), optional=True),
        _T("length_penalty", "TYPE_FP32", (1,), optional=True),
        _T("repetition_penalty", "TYPE_FP32", (1,), optional=True),
        _T("min_tokens", "TYPE_INT32", (1,), optional=True),
        _T("presence_penalty", "TYPE_FP32", (1,), optional=True),
        _T("frequency_penalty", "TYPE_FP32", (1,), optional=True),
        _T("seed", "TYPE_UINT64", (1,), optional=True),
        _T("return_log_probs", "TYPE_BOOL", (1,), optional=True),
        _T("return_context_logits", "TYPE_BOOL", (1,), optional=True),
        _T("return_generation_logits", "TYPE_BOOL", (1,), optional=True),
        _T("return_perf_metrics", "TYPE_BOOL", (1,), optional=True),
        _T("return_num_input_tokens", "TYPE_BOOL", (1,), optional=True),
        _T("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True),
        _T("beam_width", "TYPE_INT32", (1,), optional=True),
        _T("stream", "TYPE_BOOL", (1,), optional=True),
        _T("prompt_embedding_table", "TYPE_FP16", (-1, -1), optional=True),
        _T("prompt_table_extra_id", "TYPE_UINT64", (1,), optional=True),
        _T("prompt_vocab_size", "TYPE_INT32", (1,), optional=True),
        _T("embedding_bias_words", "TYPE_STRING", (-1,), optional=True),
        _T("embedding_bias_weights", "TYPE_FP32", (-1,), optional=True),
        _T("lora_task_id", "TYPE_UINT64", (1,), optional=True),
        _T("lora_weights", "TYPE_FP16", (-1, -1), optional=True, allow_ragged_batch=True),
        _T("lora_config", "TYPE_INT32", (-1, 3), optional=True, allow_ragged_batch=True),
        _T("guided_decoding_guide_type", "TYPE_STRING", (1,), optional=True, allow_ragged_batch=True),
        _T("guided_decoding_guide", "TYPE_STRING", (1,), optional=True, allow_ragged_batch=True),
    ),
    outputs=(
        _T("text_output", "TYPE_STRING", (-1,)),
        _T("cum_log_probs", "TYPE_FP32", (-1,)),
        _T("output_log_probs", "TYPE_FP32", (-1, -1)),
        _T("context_logits", "${logits_datatype}", (-1, -1)),
        _T("generation_logits", "${logits_datatype}", (-1, -1, -1)),
        _T("batch_index", "TYPE_INT32", (1,)),
        _T("sequence_index", "TYPE_INT32", (1,)),
        _T("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_reused_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,)),
        # upstream declares 'kv_cache_alloc_total_blocks' a second time here; listed once
        _T("arrival_time_ns", "TYPE_INT64", (1,)),
        _T("first_scheduled_time_ns", "TYPE_INT64", (1,)),
        _T("first_token_time_ns", "TYPE_INT64", (1,)),
        _T("last_token_time_ns", "TYPE_INT64", (1,)),
        _T("acceptance_rate", "TYPE_FP32", (1,)),
        _T("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
        _T("total_draft_tokens", "TYPE_INT32", (1,)),
        _T("num_input_tokens", "TYPE_INT32", (1,)),
        _T("num_output_tokens", "TYPE_INT32", (1,)),
    ),
    parameters=MappingProxyType({}),
    template_vars=frozenset({"logits_datatype", "triton_max_batch_size"}),
    decoupled="absent",
    dynamic_batching=False,
    steps=(
        EnsembleStep(
            "preprocessing",
            input_map=(
                ("QUERY", "text_input"),
                ("DECODER_QUERY", "decoder_text_input"),
                ("REQUEST_OUTPUT_LEN", "max_tokens"),
                ("BAD_WORDS_DICT", "bad_words"),
                ("STOP_WORDS_DICT", "stop_words"),
                ("EMBEDDING_BIAS_WORDS", "embedding_bias_words"),
                ("EMBEDDING_BIAS_WEIGHTS", "embedding_bias_weights"),
                ("END_ID", "end_id"),
                ("PAD_ID", "pad_id"),
                ("PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id"),
            ),
            output_map=(
                ("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
                ("INPUT_ID", "_INPUT_ID"),
                ("REQUEST_DECODER_INPUT_LEN", "_REQUEST_DECODER_INPUT_LEN"),
                ("DECODER_INPUT_ID", "_DECODER_INPUT_ID"),
                ("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
                ("STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
                ("BAD_WORDS_IDS", "_BAD_WORDS_IDS"),
                ("EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
                ("OUT_END_ID", "_PREPROCESSOR_END_ID"),
                ("OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
                ("OUT_PROMPT_TABLE_EXTRA_IDS", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
            ),
        ),
        EnsembleStep(
            "tensorrt_llm",
            input_map=(
                ("input_ids", "_INPUT_ID"),
                ("decoder_input_ids", "_DECODER_INPUT_ID"),
                ("input_lengths", "_REQUEST_INPUT_LEN"),
                ("decoder_input_lengths", "_REQUEST_DECODER_INPUT_LEN"),
                ("exclude_input_in_output", "exclude_input_in_output"),
                ("request_output_len", "_REQUEST_OUTPUT_LEN"),
                ("end_id", "_PREPROCESSOR_END_ID"),
                ("pad_id", "_PREPROCESSOR_PAD_ID"),
                ("embedding_bias", "_EMBEDDING_BIAS"),
                ("runtime_top_k", "top_k"),
                ("runtime_top_p", "top_p"),
                ("temperature", "temperature"),
                ("len_penalty", "length_penalty"),
                ("repetition_penalty", "repetition_penalty"),
                ("min_tokens", "min_tokens"),
                ("presence_penalty", "presence_penalty"),
                ("frequency_penalty", "frequency_penalty"),
                ("seed", "seed"),
                ("return_log_probs", "return_log_probs"),
                ("return_context_logits", "return_context_logits"),
                ("return_generation_logits", "return_generation_logits"),
                ("return_perf_metrics", "return_perf_metrics"),
                ("return_num_input_tokens", "return_num_input_tokens"),
                ("return_num_output_tokens", "return_num_output_tokens"),
                ("num_return_sequences", "num_return_sequences"),
                ("beam_width", "beam_width"),
                ("streaming", "stream"),
                ("prompt_embedding_table", "prompt_embedding_table"),
                ("prompt_vocab_size", "prompt_vocab_size"),
                ("stop_words_list", "_STOP_WORDS_IDS"),
                ("bad_words_list", "_BAD_WORDS_IDS"),
                ("prompt_table_extra_ids", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
                ("lora_task_id", "lora_task_id"),
                ("lora_weights", "lora_weights"),
                ("lora_config", "lora_config"),
                ("guided_decoding_guide_type", "guided_decoding_guide_type"),
                ("guided_decoding_guide", "guided_decoding_guide"),
            ),
            output_map=(
                ("output_ids", "_TOKENS_BATCH"),
                ("sequence_length", "_SEQUENCE_LENGTH"),
                ("cum_log_probs", "cum_log_probs"),
                ("output_log_probs", "output_log_probs"),
                ("context_logits", "context_logits"),
                ("generation_logits", "generation_logits"),
                ("batch_index", "batch_index"),
                ("sequence_index", "sequence_index"),
                ("kv_cache_alloc_new_blocks", "kv_cache_alloc_new_blocks"),
                ("kv_cache_reused_blocks", "kv_cache_reused_blocks"),
                ("kv_cache_alloc_total_blocks", "kv_cache_alloc_total_blocks"),
                ("arrival_time_ns", "arrival_time_ns"),
                ("first_scheduled_time_ns", "first_scheduled_time_ns"),
                ("first_token_time_ns", "first_token_time_ns"),
                ("last_token_time_ns", "last_token_time_ns"),
                ("acceptance_rate", "acceptance_rate"),
                ("total_accepted_draft_tokens", "total_accepted_draft_tokens"),
                ("total_draft_tokens", "total_draft_tokens"),
                ("num_input_tokens", "num_input_tokens"),
                ("num_output_tokens", "num_output_tokens"),
            ),
        ),
        EnsembleStep(
            "postprocessing",
            input_map=(
                ("TOKENS_BATCH", "_TOKENS_BATCH"),
                ("SEQUENCE_LENGTH", "_SEQUENCE_LENGTH"),
            ),
            output_map=(("OUTPUT", "text_output"),),
        ),
    ),
)

# upstream all_models/inflight_batcher_llm/preprocessing/config.pbtxt
_PREPROCESSING: Final = ModelContract(
    name="preprocessing",
    backend="python",
    platform=None,
    inputs=(
        _T("QUERY", "TYPE_STRING", (1,)),
        _T("DECODER_QUERY", "TYPE_STRING", (1,), optional=True),
        _T("IMAGE_BYTES", "TYPE_UINT8", (-1, -1, -1, -1), optional=True),
        _T("IMAGE_URL", "TYPE_STRING", (-1,), optional=True),
        _T("IMAGE_SIZES", "TYPE_INT64", (-1, 2), optional=True),
        _T("VIDEO_BYTES", "TYPE_UINT8", (-1, -1, -1, -1), optional=True),
        _T("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,)),
        _T("BAD_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
        _T("STOP_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
        _T("EMBEDDING_BIAS_WORDS", "TYPE_STRING", (-1,), optional=True),
        _T("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", (-1,), optional=True),
        _T("END_ID", "TYPE_INT32", (1,), optional=True),
        _T("PAD_ID", "TYPE_INT32", (1,), optional=True),
        _T("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", (1,), optional=True),
    ),
    outputs=(
        _T("INPUT_ID", "TYPE_INT32", (-1,)),
        _T("REQUEST_INPUT_LEN", "TYPE_INT32", (1,)),
        _T("DECODER_INPUT_ID", "TYPE_INT32", (-1,)),
        _T("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", (1,)),
        _T("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
        _T("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)),
        _T("EMBEDDING_BIAS", "TYPE_FP32", (-1,)),
        _T("REQUEST_OUTPUT_LEN", "TYPE_INT32", (-1,)),
        _T("OUT_END_ID", "TYPE_INT32", (1,)),
        _T("OUT_PAD_ID", "TYPE_INT32", (1,)),
        _T("OUT_PROMPT_TABLE_EXTRA_IDS", "TYPE_UINT64", (-1,)),
        _T("PIXEL_VALUES", "TYPE_FP16", (-1, -1, -1, -1)),
        _T("ASPECT_RATIO_IDS", "TYPE_INT64", (-1,)),
        _T("ASPECT_RATIO_MASK", "TYPE_INT64", (-1, -1)),
        _T("CROSS_ATTENTION_MASK", "TYPE_INT64", (-1, -1, -1)),
        _T("IMAGE_SIZES", "TYPE_INT64", (-1, 2)),
        _T("IS_VIDEO_INPUT", "TYPE_BOOL", (1,)),
        _T("ATTENTION_MASK", "TYPE_INT64", (-1,)),
        _T("IMAGE_GRID_THW", "TYPE_INT64", (3,)),
        _T("VISION_INPUT_ID", "TYPE_INT32", (-1,)),
    ),
    parameters=MappingProxyType(
        {
            "tokenizer_dir": _P(
                "tokenizer_dir",
                "path",
                template_var="tokenizer_dir",
                required=True,
                help="Tokenizer directory (model.py reads it unguarded).",
            ),
            "add_special_tokens": _P(
                "add_special_tokens",
                "bool",
                template_var="add_special_tokens",
                default="true",
                allowed=_PY_BOOL,
                help="Tokenizer add_special_tokens (lower-cased; anything else means true).",
            ),
            "multimodal_model_path": _P(
                "multimodal_model_path",
                "path",
                template_var="multimodal_model_path",
                required=True,
                help="Key must be present; empty or unfilled means text-only.",
            ),
            "gpt_model_path": _P(
                "gpt_model_path",
                "path",
                template_var="engine_dir",
                help="Engine directory; only read for multimodal models.",
            ),
            "max_num_images": _P(
                "max_num_images",
                "int",
                template_var="max_num_images",
                help="Multimodal: maximum images per request (non-digits mean None).",
            ),
        }
    ),
    template_vars=frozenset(
        {
            "add_special_tokens",
            "engine_dir",
            "max_num_images",
            "max_queue_delay_microseconds",
            "max_queue_size",
            "multimodal_model_path",
            "preprocessing_instance_count",
            "tokenizer_dir",
            "triton_max_batch_size",
        }
    ),
    decoupled="absent",
    dynamic_batching=True,
)

# upstream all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt
_TENSORRT_LLM: Final = ModelContract(
    name="tensorrt_llm",
    backend="${triton_backend}",
    platform=None,
    inputs=(
        _T("input_ids", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T(
            "encoder_input_features",
            "${encoder_input_features_data_type}",
            (-1, -1),
            optional=True,
            allow_ragged_batch=True,
        ),
        _T("encoder_output_lengths", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("input_lengths", "TYPE_INT32", (1,), reshape=()),
        _T("request_output_len", "TYPE_INT32", (1,), reshape=()),
        _T("num_return_sequences", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("draft_input_ids", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("decoder_input_ids", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("decoder_input_lengths", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("draft_logits", "${logits_datatype}", (-1, -1), optional=True, allow_ragged_batch=True),
        _T("draft_acceptance_threshold", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("end_id", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("pad_id", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("stop_words_list", "TYPE_INT32", (2, -1), optional=True, allow_ragged_batch=True),
        _T("bad_words_list", "TYPE_INT32", (2, -1), optional=True, allow_ragged_batch=True),
        _T("embedding_bias", "TYPE_FP32", (-1,), optional=True, allow_ragged_batch=True),
        _T("beam_width", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("temperature", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("runtime_top_k", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("runtime_top_p", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("runtime_top_p_min", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("runtime_top_p_decay", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("runtime_top_p_reset_ids", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("len_penalty", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("early_stopping", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("repetition_penalty", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("min_tokens", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("beam_search_diversity_rate", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("presence_penalty", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("frequency_penalty", "TYPE_FP32", (1,), optional=True, reshape=()),
        _T("seed", "TYPE_UINT64", (1,), optional=True, reshape=()),
        _T("return_log_probs", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_context_logits", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_generation_logits", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_perf_metrics", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_num_input_tokens", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("stop", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("streaming", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T(
            "prompt_embedding_table",
            "${prompt_embedding_table_data_type}",
            (-1, -1),
            optional=True,
            allow_ragged_batch=True,
        ),
        _T("prompt_table_extra_ids", "TYPE_UINT64", (-1,), optional=True, allow_ragged_batch=True),
        _T("prompt_vocab_size", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("cross_attention_mask", "TYPE_BOOL", (-1, -1), optional=True, allow_ragged_batch=True),
        _T("mrope_rotary_cos_sin", "TYPE_FP32", (-1,), optional=True),
        _T("mrope_position_deltas", "TYPE_INT64", (1,), optional=True),
        _T("lora_task_id", "TYPE_UINT64", (1,), optional=True, reshape=()),
        _T("lora_weights", "TYPE_FP16", (-1, -1), optional=True, allow_ragged_batch=True),
        _T("lora_config", "TYPE_INT32", (-1, 3), optional=True, allow_ragged_batch=True),
        _T("context_phase_params", "TYPE_UINT8", (-1,), optional=True, allow_ragged_batch=True),
        _T("skip_cross_attn_blocks", "TYPE_BOOL", (1,), optional=True, allow_ragged_batch=True),
        _T("retention_token_range_starts", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("retention_token_range_ends", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("retention_token_range_priorities", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("retention_token_range_durations_ms", "TYPE_INT32", (-1,), optional=True, allow_ragged_batch=True),
        _T("retention_decode_priority", "TYPE_INT32", (1,), optional=True, allow_ragged_batch=True),
        _T("retention_decode_duration_ms", "TYPE_INT32", (1,), optional=True, allow_ragged_batch=True),
        _T("guided_decoding_guide_type", "TYPE_STRING", (1,), optional=True, allow_ragged_batch=True),
        _T("guided_decoding_guide", "TYPE_STRING", (1,), optional=True, allow_ragged_batch=True),
        _T("lookahead_window_size", "TYPE_INT32", (1,), optional=True, allow_ragged_batch=True),
        _T("lookahead_ngram_size", "TYPE_INT32", (1,), optional=True, allow_ragged_batch=True),
        _T("lookahead_verification_set_size", "TYPE_INT32", (1,), optional=True, allow_ragged_batch=True),
    ),
    outputs=(
        _T("output_ids", "TYPE_INT32", (-1, -1)),
        _T("sequence_length", "TYPE_INT32", (-1,)),
        _T("cum_log_probs", "TYPE_FP32", (-1,)),
        _T("output_log_probs", "TYPE_FP32", (-1, -1)),
        _T("context_logits", "${logits_datatype}", (-1, -1)),
        _T("generation_logits", "${logits_datatype}", (-1, -1, -1)),
        _T("batch_index", "TYPE_INT32", (1,)),
        _T("sequence_index", "TYPE_INT32", (1,)),
        _T("context_phase_params", "TYPE_UINT8", (-1,)),
        _T("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_reused_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,)),
        _T("arrival_time_ns", "TYPE_INT64", (1,)),
        _T("first_scheduled_time_ns", "TYPE_INT64", (1,)),
        _T("first_token_time_ns", "TYPE_INT64", (1,)),
        _T("last_token_time_ns", "TYPE_INT64", (1,)),
        _T("acceptance_rate", "TYPE_FP32", (1,)),
        _T("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
        _T("total_draft_tokens", "TYPE_INT32", (1,)),
        _T("num_input_tokens", "TYPE_INT32", (1,)),
        _T("num_output_tokens", "TYPE_INT32", (1,)),
    ),
    parameters=MappingProxyType(
        {
            "max_beam_width": _P(
                "max_beam_width",
                "int",
                template_var="max_beam_width",
                default="1",
                help="Beam width of requests sent to the executor.",
            ),
            "FORCE_CPU_ONLY_INPUT_TENSORS": _P(
                "FORCE_CPU_ONLY_INPUT_TENSORS", "fixed", fixed_value="no", help="Upstream fixes it to no."
            ),
            "gpt_model_type": _P(
                "gpt_model_type",
                "choice",
                template_var="batching_strategy",
                allowed=("inflight_fused_batching", "inflight_batching", "V1", "v1"),
                required=True,
                help="Batching: inflight_* = in-flight batching, V1 = static. Missing or other values fail the load.",
            ),
            "gpt_model_path": _P(
                "gpt_model_path",
                "path",
                template_var="engine_dir",
                help="Engine directory (config.json + rank{N}.engine).",
            ),
            "encoder_model_path": _P(
                "encoder_model_path",
                "path",
                template_var="encoder_engine_dir",
                help="Encoder engine directory (encoder-decoder models only).",
            ),
            "max_tokens_in_paged_kv_cache": _P(
                "max_tokens_in_paged_kv_cache",
                "int",
                template_var="max_tokens_in_paged_kv_cache",
                help="KV cache size cap in tokens; unset = only kv_cache_free_gpu_mem_fraction limits it.",
            ),
            "max_attention_window_size": _P(
                "max_attention_window_size",
                "str",
                template_var="max_attention_window_size",
                help="Comma-separated per-layer attention window(s); unset = max_seq_len.",
            ),
            "sink_token_length": _P(
                "sink_token_length",
                "int",
                template_var="sink_token_length",
                help="Sink tokens always kept in the attention window.",
            ),
            "batch_scheduler_policy": _P(
                "batch_scheduler_policy",
                "choice",
                template_var="batch_scheduler_policy",
                default="guaranteed_no_evict",
                allowed=("max_utilization", "guaranteed_no_evict"),
                help="Capacity scheduler policy.",
            ),
            "kv_cache_free_gpu_mem_fraction": _P(
                "kv_cache_free_gpu_mem_fraction",
                "float",
                template_var="kv_cache_free_gpu_mem_fraction",
                default="0.9",
                help="Fraction of free GPU memory (after loading the engine) for the KV cache, in (0, 1].",
            ),
            "cross_kv_cache_fraction": _P(
                "cross_kv_cache_fraction",
                "float",
                template_var="cross_kv_cache_fraction",
                help="Cross-attention share of the KV cache (encoder-decoder only; docs default 0.5).",
            ),
            "kv_cache_host_memory_bytes": _P(
                "kv_cache_host_memory_bytes",
                "int",
                template_var="kv_cache_host_memory_bytes",
                default="0",
                help="Host memory for KV cache offloading, in bytes.",
            ),
            "kv_cache_onboard_blocks": _P(
                "kv_cache_onboard_blocks",
                "bool",
                template_var="kv_cache_onboard_blocks",
                default="true",
                allowed=_BOOL,
                help="Internal: onboard offloaded blocks.",
            ),
            "exclude_input_in_output": _P(
                "exclude_input_in_output",
                "bool",
                template_var="exclude_input_in_output",
                default="false",
                allowed=_BOOL,
                help="Return only completion tokens.",
            ),
            "cancellation_check_period_ms": _P(
                "cancellation_check_period_ms",
                "int",
                template_var="cancellation_check_period_ms",
                default="100",
                help="Cancellation poll period.",
            ),
            "stats_check_period_ms": _P(
                "stats_check_period_ms",
                "int",
                template_var="stats_check_period_ms",
                default="100",
                help="Statistics poll period.",
            ),
            "iter_stats_max_iterations": _P(
                "iter_stats_max_iterations",
                "int",
                template_var="iter_stats_max_iterations",
                help="Iterations of statistics kept (executor default when unset).",
            ),
            "request_stats_max_iterations": _P(
                "request_stats_max_iterations",
                "int",
                template_var="request_stats_max_iterations",
                help="Iterations of per-request statistics kept (executor default when unset).",
            ),
            "enable_kv_cache_reuse": _P(
                "enable_kv_cache_reuse",
                "bool",
                template_var="enable_kv_cache_reuse",
                default="true",
                allowed=_BOOL,
                help="Reuse KV blocks across requests (needs --use_paged_context_fmha). The backend turns it ON when unset.",
            ),
            "normalize_log_probs": _P(
                "normalize_log_probs",
                "bool",
                template_var="normalize_log_probs",
                default="true",
                allowed=_BOOL,
                help="Normalize output_log_probs.",
            ),
            "enable_chunked_context": _P(
                "enable_chunked_context",
                "bool",
                template_var="enable_chunked_context",
                default="false",
                allowed=_BOOL,
                help="Context chunking (needs --use_paged_context_fmha).",
            ),
            "gpu_device_ids": _P(
                "gpu_device_ids",
                "str",
                template_var="gpu_device_ids",
                help="Comma-separated GPU ids; semicolons separate model instances (escape commas for fill_template.py).",
            ),
            "participant_ids": _P(
                "participant_ids",
                "str",
                template_var="participant_ids",
                help="Comma-separated MPI ranks (orchestrator mode without process spawning).",
            ),
            "num_nodes": _P(
                "num_nodes", "int", template_var="num_nodes", default="1", help="MPI nodes used by this model."
            ),
            "lora_cache_optimal_adapter_size": _P(
                "lora_cache_optimal_adapter_size",
                "int",
                template_var="lora_cache_optimal_adapter_size",
                default="8",
                help="LoRA cache page sizing.",
            ),
            "lora_cache_max_adapter_size": _P(
                "lora_cache_max_adapter_size",
                "int",
                template_var="lora_cache_max_adapter_size",
                default="64",
                help="Minimum LoRA cache page size.",
            ),
            "lora_cache_gpu_memory_fraction": _P(
                "lora_cache_gpu_memory_fraction",
                "float",
                template_var="lora_cache_gpu_memory_fraction",
                default="0.05",
                help="GPU memory fraction for the LoRA cache.",
            ),
            "lora_cache_host_memory_bytes": _P(
                "lora_cache_host_memory_bytes",
                "int",
                template_var="lora_cache_host_memory_bytes",
                help="Host LoRA cache size in bytes (docs default 1G).",
            ),
            "lora_prefetch_dir": _P(
                "lora_prefetch_dir", "path", template_var="lora_prefetch_dir", help="LoRA weights loaded at start-up."
            ),
            "decoding_mode": _P(
                "decoding_mode",
                "choice",
                template_var="decoding_mode",
                allowed=("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle"),
                help="Unset/invalid: top_k_top_p when max_beam_width == 1, else beam_search.",
            ),
            "executor_worker_path": _P(
                "executor_worker_path",
                "fixed",
                fixed_value="/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
                help="Orchestrator worker binary inside the container.",
            ),
            "lookahead_window_size": _P(
                "lookahead_window_size",
                "int",
                template_var="lookahead_window_size",
                help="Lookahead decoding window (all three lookahead keys together).",
            ),
            "lookahead_ngram_size": _P(
                "lookahead_ngram_size",
                "int",
                template_var="lookahead_ngram_size",
                help="Lookahead decoding n-gram size.",
            ),
            "lookahead_verification_set_size": _P(
                "lookahead_verification_set_size",
                "int",
                template_var="lookahead_verification_set_size",
                help="Lookahead decoding verification set size.",
            ),
            "medusa_choices": _P(
                "medusa_choices",
                "str",
                template_var="medusa_choices",
                help="Medusa tree, e.g. {0, 0, 0}, {0, 1}; default mc_sim_7b_63.",
            ),
            "eagle_choices": _P(
                "eagle_choices", "str", template_var="eagle_choices", help="Default EAGLE tree, same format."
            ),
            "gpu_weights_percent": _P(
                "gpu_weights_percent",
                "float",
                template_var="gpu_weights_percent",
                default="1.0",
                help="Share of weights kept on GPU; < 1.0 needs an engine built with --weight_streaming.",
            ),
            "enable_context_fmha_fp32_acc": _P(
                "enable_context_fmha_fp32_acc",
                "bool",
                template_var="enable_context_fmha_fp32_acc",
                default="false",
                allowed=_BOOL,
                help="FP32 accumulation in context FMHA.",
            ),
            "multi_block_mode": _P(
                "multi_block_mode",
                "bool",
                template_var="multi_block_mode",
                default="true",
                allowed=_BOOL,
                help="Multi-block attention in generation.",
            ),
            "cuda_graph_mode": _P(
                "cuda_graph_mode",
                "bool",
                template_var="cuda_graph_mode",
                default="false",
                allowed=_BOOL,
                help="CUDA graphs.",
            ),
            "cuda_graph_cache_size": _P(
                "cuda_graph_cache_size",
                "int",
                template_var="cuda_graph_cache_size",
                default="0",
                help="Number of cached CUDA graphs.",
            ),
            "speculative_decoding_fast_logits": _P(
                "speculative_decoding_fast_logits",
                "bool",
                template_var="speculative_decoding_fast_logits",
                default="false",
                allowed=_BOOL,
                help="Fast logits transfer (orchestrator mode without spawning only).",
            ),
            "tokenizer_dir": _P(
                "tokenizer_dir",
                "path",
                template_var="tokenizer_dir",
                required=True,
                help="Key must be present (the C++ backend reads it unguarded); used by the Python backend for guided decoding.",
            ),
            "guided_decoding_backend": _P(
                "guided_decoding_backend",
                "choice",
                template_var="guided_decoding_backend",
                allowed=("xgrammar",),
                required=True,
                help="Key must be present; xgrammar enables guided decoding when xgrammar_tokenizer_info_path is set.",
            ),
            "xgrammar_tokenizer_info_path": _P(
                "xgrammar_tokenizer_info_path",
                "path",
                template_var="xgrammar_tokenizer_info_path",
                required=True,
                help="Key must be present; JSON tokenizer info for xgrammar.",
            ),
        }
    ),
    template_vars=frozenset(
        {
            "batch_scheduler_policy",
            "batching_strategy",
            "cancellation_check_period_ms",
            "cross_kv_cache_fraction",
            "cuda_graph_cache_size",
            "cuda_graph_mode",
            "decoding_mode",
            "decoupled_mode",
            "eagle_choices",
            "enable_chunked_context",
            "enable_context_fmha_fp32_acc",
            "enable_kv_cache_reuse",
            "enable_trt_overlap",
            "encoder_engine_dir",
            "encoder_input_features_data_type",
            "engine_dir",
            "exclude_input_in_output",
            "gpu_device_ids",
            "gpu_weights_percent",
            "guided_decoding_backend",
            "iter_stats_max_iterations",
            "kv_cache_free_gpu_mem_fraction",
            "kv_cache_host_memory_bytes",
            "kv_cache_onboard_blocks",
            "logits_datatype",
            "lookahead_ngram_size",
            "lookahead_verification_set_size",
            "lookahead_window_size",
            "lora_cache_gpu_memory_fraction",
            "lora_cache_host_memory_bytes",
            "lora_cache_max_adapter_size",
            "lora_cache_optimal_adapter_size",
            "lora_prefetch_dir",
            "max_attention_window_size",
            "max_beam_width",
            "max_queue_delay_microseconds",
            "max_queue_size",
            "max_tokens_in_paged_kv_cache",
            "medusa_choices",
            "multi_block_mode",
            "normalize_log_probs",
            "num_nodes",
            "participant_ids",
            "prompt_embedding_table_data_type",
            "request_stats_max_iterations",
            "sink_token_length",
            "speculative_decoding_fast_logits",
            "stats_check_period_ms",
            "tokenizer_dir",
            "triton_backend",
            "triton_max_batch_size",
            "xgrammar_tokenizer_info_path",
        }
    ),
    decoupled="templated",
    dynamic_batching=True,
)

# upstream all_models/inflight_batcher_llm/postprocessing/config.pbtxt
_POSTPROCESSING: Final = ModelContract(
    name="postprocessing",
    backend="python",
    platform=None,
    inputs=(
        _T("TOKENS_BATCH", "TYPE_INT32", (-1, -1)),
        _T("SEQUENCE_LENGTH", "TYPE_INT32", (-1,)),
    ),
    outputs=(_T("OUTPUT", "TYPE_STRING", (-1,)),),
    parameters=MappingProxyType(
        {
            "tokenizer_dir": _P(
                "tokenizer_dir",
                "path",
                template_var="tokenizer_dir",
                required=True,
                help="Tokenizer directory (model.py reads it unguarded).",
            ),
            "skip_special_tokens": _P(
                "skip_special_tokens",
                "bool",
                template_var="skip_special_tokens",
                default="true",
                allowed=_PY_BOOL,
                help="Detokenizer skip_special_tokens (lower-cased; anything else means true).",
            ),
        }
    ),
    template_vars=frozenset(
        {"postprocessing_instance_count", "skip_special_tokens", "tokenizer_dir", "triton_max_batch_size"}
    ),
    decoupled="absent",
    dynamic_batching=True,
)

# upstream all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt
_BLS: Final = ModelContract(
    name="tensorrt_llm_bls",
    backend="python",
    platform=None,
    inputs=(
        _T("text_input", "TYPE_STRING", (1,)),
        _T("decoder_text_input", "TYPE_STRING", (1,), optional=True),
        _T("image_input", "TYPE_FP16", (-1, 3, -1, -1), optional=True),
        _T("image_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), optional=True),
        _T("image_url_input", "TYPE_STRING", (1,), optional=True),
        _T("image_sizes_input", "TYPE_INT64", (-1, 2), optional=True),
        _T("video_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), optional=True),
        _T("max_tokens", "TYPE_INT32", (1,)),
        _T("bad_words", "TYPE_STRING", (-1,), optional=True),
        _T("stop_words", "TYPE_STRING", (-1,), optional=True),
        _T("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
        _T("end_id", "TYPE_INT32", (1,), optional=True),
        _T("pad_id", "TYPE_INT32", (1,), optional=True),
        _T("top_k", "TYPE_INT32", (1,), optional=True),
        _T("top_p", "TYPE_FP32", (1,), optional=True),
        _T("temperature", "TYPE_FP32", (1,), optional=True),
        _T("length_penalty", "TYPE_FP32", (1,), optional=True),
        _T("repetition_penalty", "TYPE_FP32", (1,), optional=True),
        _T("min_tokens", "TYPE_INT32", (1,), optional=True),
        _T("presence_penalty", "TYPE_FP32", (1,), optional=True),
        _T("frequency_penalty", "TYPE_FP32", (1,), optional=True),
        _T("seed", "TYPE_UINT64", (1,), optional=True),
        _T("return_log_probs", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_context_logits", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_generation_logits", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("num_return_sequences", "TYPE_INT32", (1,), optional=True, reshape=()),
        _T("beam_width", "TYPE_INT32", (1,), optional=True),
        _T("stream", "TYPE_BOOL", (1,), optional=True),
        _T("prompt_embedding_table", "${prompt_embedding_table_data_type}", (-1, -1), optional=True),
        _T("prompt_vocab_size", "TYPE_INT32", (1,), optional=True),
        _T("prompt_table_extra_id", "TYPE_UINT64", (1,), optional=True),
        _T("embedding_bias_words", "TYPE_STRING", (-1,), optional=True),
        _T("embedding_bias_weights", "TYPE_FP32", (-1,), optional=True),
        _T("num_draft_tokens", "TYPE_INT32", (1,), optional=True),
        _T("use_draft_logits", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("lora_task_id", "TYPE_UINT64", (1,), optional=True, reshape=()),
        _T("lora_weights", "TYPE_FP16", (-1, -1), optional=True, allow_ragged_batch=True),
        _T("lora_config", "TYPE_INT32", (-1, 3), optional=True, allow_ragged_batch=True),
        _T("return_perf_metrics", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_num_input_tokens", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True, reshape=()),
        _T("guided_decoding_guide_type", "TYPE_STRING", (1,), optional=True),
        _T("guided_decoding_guide", "TYPE_STRING", (1,), optional=True),
    ),
    outputs=(
        _T("text_output", "TYPE_STRING", (-1,)),
        _T("cum_log_probs", "TYPE_FP32", (-1,)),
        _T("output_log_probs", "TYPE_FP32", (-1, -1)),
        _T("context_logits", "${logits_datatype}", (-1, -1)),
        _T("generation_logits", "${logits_datatype}", (-1, -1, -1)),
        _T("batch_index", "TYPE_INT32", (1,)),
        _T("sequence_index", "TYPE_INT32", (1,)),
        _T("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_reused_blocks", "TYPE_INT32", (1,)),
        _T("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,)),
        _T("arrival_time_ns", "TYPE_INT64", (1,)),
        _T("first_scheduled_time_ns", "TYPE_INT64", (1,)),
        _T("first_token_time_ns", "TYPE_INT64", (1,)),
        _T("last_token_time_ns", "TYPE_INT64", (1,)),
        _T("acceptance_rate", "TYPE_FP32", (1,)),
        _T("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
        _T("total_draft_tokens", "TYPE_INT32", (1,)),
        _T("num_input_tokens", "TYPE_INT32", (1,)),
        _T("num_output_tokens", "TYPE_INT32", (1,)),
    ),
    parameters=MappingProxyType(
        {
            "accumulate_tokens": _P(
                "accumulate_tokens",
                "bool",
                template_var="accumulate_tokens",
                default="false",
                allowed=("true", "yes", "1", "t", "false", "no", "0", "f"),
                help="Streaming: detokenize all tokens so far instead of the newest one (lower-cased).",
            ),
            "tensorrt_llm_model_name": _P(
                "tensorrt_llm_model_name",
                "str",
                template_var="tensorrt_llm_model_name",
                default="tensorrt_llm",
                help="Target model; empty or unfilled means tensorrt_llm.",
            ),
            "tensorrt_llm_draft_model_name": _P(
                "tensorrt_llm_draft_model_name",
                "str",
                template_var="tensorrt_llm_draft_model_name",
                help="Draft model for speculative decoding; empty means none.",
            ),
            "multimodal_encoders_name": _P(
                "multimodal_encoders_name",
                "str",
                template_var="multimodal_encoders_name",
                help="Multimodal encoders model; empty means none.",
            ),
        }
    ),
    template_vars=frozenset(
        {
            "accumulate_tokens",
            "bls_instance_count",
            "decoupled_mode",
            "logits_datatype",
            "multimodal_encoders_name",
            "prompt_embedding_table_data_type",
            "tensorrt_llm_draft_model_name",
            "tensorrt_llm_model_name",
            "triton_max_batch_size",
        }
    ),
    decoupled="templated",
    dynamic_batching=False,
)

MODELS: Final[Mapping[str, ModelContract]] = MappingProxyType(
    {m.name: m for m in (_ENSEMBLE, _PREPROCESSING, _TENSORRT_LLM, _POSTPROCESSING, _BLS)}
)

# Template variables that are not parameters (model-level fields), with their meaning.
TEMPLATE_VARS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "triton_max_batch_size": "max_batch_size of every model (tensorrt_llm: the real limit is the engine's max_batch_size)",
        "triton_backend": "tensorrt_llm backend: 'tensorrtllm' (C++) or 'python'",
        "decoupled_mode": "model_transaction_policy.decoupled; must be true for streaming requests",
        "max_queue_delay_microseconds": "dynamic_batching.max_queue_delay_microseconds (fill_template.py default 0)",
        "max_queue_size": "dynamic_batching.default_queue_policy.max_queue_size (fill_template.py default 0)",
        "preprocessing_instance_count": "instance_group count of preprocessing (KIND_CPU)",
        "postprocessing_instance_count": "instance_group count of postprocessing (KIND_CPU)",
        "bls_instance_count": "instance_group count of tensorrt_llm_bls (KIND_CPU)",
        "logits_datatype": "data type of context/generation (and draft) logits tensors",
        "prompt_embedding_table_data_type": "data type of prompt_embedding_table",
        "encoder_input_features_data_type": "data type of encoder_input_features",
    }
)

# --- serving containers ---------------------------------------------------------------
# nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 -> the TensorRT-LLM (and TensorRT)
# it ships, from triton-inference-server/server docs/introduction/compatibility.md.
_CONTAINER_ROWS: Final = (
    ("24.04", "0.9.0", "9.3.0.post12.dev1"),
    ("24.05", "0.9.0", "10.0.1.6"),
    ("24.06", "0.10.0", "10.0.1"),
    ("24.07", "0.11.0", "10.1.0"),
    ("24.08", "0.12.0", "10.3.0"),
    ("24.09", "0.13.0", "10.4.0"),
    ("24.10", "0.14.0", "10.4.0"),
    ("24.11", "0.15.0", "10.6.0"),
    ("24.12", "0.16.0", "10.7.0"),
    ("25.01", "0.17.0", "10.8.0.43"),
    ("25.02", "0.17.0.post1", "10.8.0.43"),
    ("25.03", "0.18.0", "10.9.0.34"),
    ("25.04", "0.18.2", "10.9.0.34"),
    ("25.05", "0.19.0", "10.9.0.34"),
    ("25.06", "0.20.0", "10.10.0.31"),
    ("25.07", "0.20.0", "10.10.0.31"),
    ("25.08", "0.21.0", "10.11.0.33"),
    ("25.09", "1.0.0", "10.11.0.33"),
    ("25.10", "1.0.0", "10.11.0.33"),
    ("25.11", "1.0.3.2510", "10.13.3.9"),
    ("25.12", "1.1.0", "10.13.3.9"),
    ("26.01", "1.1.0", "10.13.3.9"),
    ("26.02", "1.1.0", "10.13.3.9"),
    ("26.03", "1.2.0", "10.14.1.48"),
    ("26.04", "1.2.1", "10.14.1.48"),
    ("26.05", "1.2.1", "10.14.1.48"),
    ("26.06", "1.2.1", "10.14.1.48"),
    ("26.07", "1.2.1", "10.14.1.48"),
)
CONTAINER_REPOSITORY: Final = "nvcr.io/nvidia/tritonserver"
CONTAINER_SUFFIX: Final = "-trtllm-python-py3"


def _tag(release: str) -> str:
    return f"{CONTAINER_REPOSITORY}:{release}{CONTAINER_SUFFIX}"


def _containers_by_version() -> Mapping[str, tuple[str, ...]]:
    table: dict[str, list[str]] = {}
    for release, trtllm, _tensorrt in _CONTAINER_ROWS:
        table.setdefault(trtllm, []).append(_tag(release))
    return MappingProxyType({version: tuple(tags) for version, tags in table.items()})


# TensorRT-LLM version -> container tags that ship it, oldest first.
NGC_CONTAINERS: Final[Mapping[str, tuple[str, ...]]] = _containers_by_version()
# Container tag -> TensorRT version inside it (an engine must be built with the same one).
CONTAINER_TENSORRT: Final[Mapping[str, str]] = MappingProxyType(
    {_tag(release): tensorrt for release, _trtllm, tensorrt in _CONTAINER_ROWS}
)


def container_for(trtllm_version: str) -> str:
    """Newest ``tritonserver:<yy.mm>-trtllm-python-py3`` tag shipping ``trtllm_version``.

    Raises ``LookupError`` listing the known versions when none ships it.
    """
    tags = NGC_CONTAINERS.get(trtllm_version.strip())
    if not tags:
        known = ", ".join(NGC_CONTAINERS)
        raise LookupError(
            f"no {CONTAINER_REPOSITORY}:*{CONTAINER_SUFFIX} container is known to ship "
            f"TensorRT-LLM {trtllm_version!r}; known versions: {known}"
        )
    return tags[-1]
