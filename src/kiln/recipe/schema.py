"""The recipe schema: the one place where every recipe key, its type, its default and its meaning live.

A recipe is a YAML file validated into :class:`Recipe` — strict (unknown keys are errors, no type coercion
from strings to numbers) and frozen. Every field carries a docstring; ``kiln show --doc`` and the docs derive
from them. Cross-field rules (formats vs GPU, limits that must agree) live in :mod:`kiln.recipe.rules`.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.cache.reference import parse_cache_url
from kiln.recipe.formats import registry

BUILTIN_PREFIX = "builtin:"
HF_PREFIX = "hf:"
BUILTIN_MODELS = ("tiny-llama",)
BUILTIN_DATASETS = ("tiny-llama-calib", "tiny-llama-heldout")
#: The lm-eval tasks kiln ships for the built-in model (made from text that ships with Python: kiln.models.tasks).
BUILTIN_TASKS = ("tiny-python-nextword", "tiny-python-nextline")

# Format and target names come from the format registry (kiln/recipe/data/formats.yaml): a format added there
# is a valid recipe value without a change here.
_REGISTRY = registry()
WeightFormat = Literal[tuple(_REGISTRY.weight_formats)]  # type: ignore[valid-type]
KVCacheFormat = Literal[tuple(_REGISTRY.kv_cache_formats)]  # type: ignore[valid-type]
Target = Literal[tuple(_REGISTRY.targets)]  # type: ignore[valid-type]
_REGISTRY_DOC = "Which GPUs and targets run each: kiln/recipe/data/formats.yaml (`kiln validate` checks it)."


def _choices(table: dict, lead: str) -> str:
    return lead + ", ".join(f"`{name}` ({entry.label})" for name, entry in table.items()) + ". " + _REGISTRY_DOC


Dtype = Literal["auto", "float16", "bfloat16", "float32"]

INT64_MAX = 2**63 - 1  # Triton parses its integer parameters as int64

_HF_ID = re.compile(r"^hf:[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class Section(BaseModel):
    """Base for every recipe section: strict, frozen, unknown keys rejected, docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


def _check_source(value: str, what: str, builtins: tuple[str, ...]) -> str:
    if value.startswith(BUILTIN_PREFIX):
        name = value[len(BUILTIN_PREFIX):]
        if name not in builtins:
            raise ValueError(
                f"unknown built-in {what} {value!r}; known: "
                + ", ".join(BUILTIN_PREFIX + b for b in builtins)
            )
    elif value.startswith(HF_PREFIX):
        if not _HF_ID.match(value):
            raise ValueError(f"{value!r} is not a hub id; write hf:org/name or hf:org/name@revision")
    elif not value.strip():
        raise ValueError(f"empty {what}; give a local path, hf:org/name or " + BUILTIN_PREFIX + builtins[0])
    return value


class ModelSection(Section):
    source: str = "builtin:tiny-llama"
    """Where the model comes from: `builtin:tiny-llama` (made locally, no download), a local Hugging Face
    directory (relative paths resolve against the working directory), or `hf:org/name[@revision]`."""

    dtype: Dtype = "auto"
    """Weights and activation dtype of the unquantized parts. `auto` uses the checkpoint's `torch_dtype`
    (float16 if it names none). The model is loaded directly in this dtype: never through float32."""

    tokenizer: Optional[str] = None
    """Tokenizer location (same forms as `source`); empty means the model's own tokenizer."""

    trust_remote_code: bool = False
    """Allow code shipped with a hub model to run when loading it. Off unless you trust the repository."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return _check_source(v, "model", BUILTIN_MODELS)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _check_source(v, "tokenizer", BUILTIN_MODELS)


class DataSource(Section):
    """Where text comes from (calibration or evaluation)."""

    dataset: str = "builtin:tiny-llama-calib"
    """Text source: a local `.txt` (one sample per blank-line-separated paragraph), `.jsonl` or `.parquet`
    file, `hf:org/name[@revision]` (a hub dataset), or `builtin:tiny-llama-calib` / `builtin:tiny-llama-heldout`
    (text shipped with Python)."""

    subset: Optional[str] = None
    """Dataset configuration name, for `hf:` datasets that have several (e.g. `3.0.0` for cnn_dailymail)."""

    split: str = "train"
    """Dataset split, for `hf:` datasets."""

    column: str = "text"
    """Column (or JSON key) holding the text, for `.jsonl`, `.parquet` and `hf:` datasets."""

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        return _check_source(v, "dataset", BUILTIN_DATASETS)


class CalibrationSection(DataSource):
    samples: Annotated[int, Field(ge=1, le=100_000)] = 512
    """Number of calibration samples. Upstream default 512; AWQ formats use at most 32 (as upstream does)."""

    max_seq_len: Annotated[int, Field(ge=8, le=131_072)] = 512
    """Tokens per calibration sample (longer samples are truncated)."""

    batch_size: Annotated[int, Field(ge=1, le=1024)] = 1
    """Samples per calibration forward pass."""

    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 1234
    """Seed for sample selection and anything random in calibration (0 to 2^32 − 1, what every RNG accepts)."""


class QuantizationSection(Section):
    format: WeightFormat = Field("none", description=_choices(_REGISTRY.weight_formats, "Weight/activation format: "))

    kv_cache: KVCacheFormat = Field("none", description=_choices(_REGISTRY.kv_cache_formats, "KV-cache quantization: "))

    smoothquant_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """SmoothQuant migration strength (int8_sq only): 0 keeps activations as they are, 1 moves all the
    outlier scale into the weights."""

    awq_block_size: Literal[64, 128] = 128
    """Group size of the AWQ formats' INT4 weight scales (int4_awq, w4a8_awq); other formats ignore it."""

    exclude_modules: tuple[str, ...] = ("lm_head",)
    """Module name patterns (fnmatch, e.g. `lm_head`, `*.mlp.down_proj`) kept at full precision."""

    calibration: CalibrationSection = CalibrationSection()
    """Calibration data used to compute scales."""

    runtime: Literal["auto", "engine", "host"] = "auto"
    """Where calibration and export run. `engine`: in the engine runtime (`engine_runtime`), through TensorRT-LLM's
    own ModelOpt integration, on the GPU — the checkpoint `trtllm-build` reads then comes from the ModelOpt that
    TensorRT-LLM was made with, and evaluation runs there too. `host`: in kiln's own environment (its ModelOpt,
    on this machine's CPU or GPU) — the reference target's path, and the way to calibrate and gate a tensorrt
    recipe on a machine without a GPU. `auto`: `engine` for target tensorrt, `host` for reference, and for
    pytorch `engine` on a machine with a GPU (the unified checkpoint comes from the image's ModelOpt) and `host`
    elsewhere (kiln's ModelOpt on the CPU; the manifest records which ModelOpt made it)."""


class TaskDefaults(Section):
    limit: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None
    """Documents evaluated per task (lm-eval's `--limit`: the first N of the test split). Empty: all of them."""

    num_fewshot: Annotated[int, Field(ge=0, le=64)] = 0
    """Few-shot examples put before each document (lm-eval's `--num_fewshot`)."""

    max_accuracy_drop_pct: Optional[Annotated[float, Field(ge=0.0, le=100.0)]] = 5.0
    """Task gate: fail the build if a task's accuracy (its first metric, 0–1) drops by more than this many
    percentage points from the unquantized baseline (0.62 → 0.58 is a 4-point drop). Empty disables."""

    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    """Requests lm-eval keeps in flight against each served model (its `num_concurrent`)."""


class TaskEntry(Section):
    task: str
    """`builtin:tiny-python-nextword`, `builtin:tiny-python-nextline`, or the path of an lm-eval task YAML (one task;
    `dataset_path` a local loader — json, csv, parquet, text — over `dataset_kwargs.data_files`, paths relative to
    the YAML). The YAML and its data files are hashed into the `tasks` step's fingerprint."""

    limit: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None
    """Documents evaluated; empty: `evaluation.task_defaults.limit`."""

    num_fewshot: Optional[Annotated[int, Field(ge=0, le=64)]] = None
    """Few-shot examples; empty: `evaluation.task_defaults.num_fewshot`."""

    max_accuracy_drop_pct: Optional[Annotated[float, Field(ge=0.0, le=100.0)]] = None
    """Largest accepted accuracy drop in percentage points; empty: `evaluation.task_defaults.max_accuracy_drop_pct`."""

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        if v.startswith(BUILTIN_PREFIX):
            if v[len(BUILTIN_PREFIX):] not in BUILTIN_TASKS:
                raise ValueError(f"unknown built-in task {v!r}; known: "
                                 + ", ".join(BUILTIN_PREFIX + t for t in BUILTIN_TASKS))
        elif v.startswith(HF_PREFIX):
            raise ValueError(f"{v!r}: hub tasks are not fetched; give a local lm-eval task YAML over local data files "
                             "(pinned, hashed evaluation data) or a builtin: task")
        elif not v.endswith((".yaml", ".yml")):
            raise ValueError(f"{v!r} is not a task YAML; give the path of an lm-eval task .yaml or a builtin: task")
        return v


class EvaluationSection(DataSource):
    enabled: bool = True
    """Measure quality (perplexity and KL divergence against the unquantized model) after quantizing."""

    dataset: str = "builtin:tiny-llama-heldout"
    """Evaluation text, same forms as the calibration dataset."""

    split: str = "test"
    """Dataset split, for `hf:` datasets."""

    samples: Annotated[int, Field(ge=1, le=100_000)] = 64
    """Number of evaluation sequences."""

    max_seq_len: Annotated[int, Field(ge=8, le=131_072)] = 256
    """Tokens per evaluation sequence."""

    max_ppl_increase_pct: Optional[Annotated[float, Field(ge=0.0)]] = 10.0
    """Quality gate: fail the build if perplexity rises by more than this many percent. Empty disables."""

    max_kl: Optional[Annotated[float, Field(ge=0.0)]] = None
    """Quality gate: fail the build if the mean per-token KL divergence (nats) exceeds this. Empty disables."""

    tasks: tuple[TaskEntry, ...] = ()
    """Task-accuracy gate: lm-eval tasks run against the served quantized model and the served unquantized baseline
    (the `tasks` step, after `package`). Each is a built-in task (`builtin:tiny-python-nextword`, a generate_until
    task; `builtin:tiny-python-nextline`, a loglikelihood multiple-choice task) or an lm-eval task YAML over local
    data files. Empty: no task gate."""

    task_defaults: TaskDefaults = TaskDefaults()
    """`limit`, `num_fewshot` and `max_accuracy_drop_pct` for every task that does not set its own, and how many
    requests lm-eval keeps in flight."""


class ParallelismSection(Section):
    tp: Annotated[int, Field(ge=1, le=64)] = 1
    """Tensor-parallel size: each layer split across this many GPUs."""

    pp: Annotated[int, Field(ge=1, le=64)] = 1
    """Pipeline-parallel size: layers split into this many stages."""


SpeculativeMode = Literal[
    "none", "draft_tokens_external", "medusa", "eagle", "lookahead_decoding", "explicit_draft_tokens", "ngram", "mtp"
]


class SpeculativeSection(Section):
    mode: SpeculativeMode = "none"
    """Speculative decoding mode (trtllm-build `--speculative_decoding_mode`). `draft_tokens_external` is
    draft+target decoding driven by the BLS model with a separate draft recipe (target pytorch: the LLM argument
    speculative_config Draft_Target). Target pytorch also runs `eagle` (EAGLE3, with `draft_model`), `ngram` and
    `mtp` (models with multi-token-prediction layers), and not medusa, lookahead_decoding or explicit_draft_tokens;
    `ngram` and `mtp` are pytorch-only."""

    max_draft_len: Annotated[int, Field(ge=0, le=1024)] = 0
    """Most draft tokens verified per step (`--max_draft_len`); added to max_seq_len by upstream."""

    draft_recipe: Optional[str] = None
    """Recipe of the draft model (path), for `draft_tokens_external`."""

    draft_model: Optional[str] = None
    """Target pytorch, mode `eagle`: the EAGLE3 draft head, the LLM argument speculative_config.speculative_model_dir.
    A local Hugging Face directory, or `hf:org/name[@rev]` downloaded at package time, is linked into the repository
    (`tensorrt_llm/1/eagle_head`), so the servers find it with the hub offline."""

    max_matching_ngram_size: Annotated[int, Field(ge=1, le=64)] = 2
    """Mode `ngram` (target pytorch): the longest suffix of the sequence matched against earlier text to propose
    draft tokens (NGramDecodingConfig.max_matching_ngram_size)."""


class EngineSection(Section):
    max_batch_size: Annotated[int, Field(ge=1, le=65_536)] = 2048
    """Most sequences in flight at once (`--max_batch_size`)."""

    max_input_len: Annotated[int, Field(ge=1, le=1_048_576)] = 1024
    """Longest prompt in tokens (`--max_input_len`)."""

    max_seq_len: Optional[Annotated[int, Field(ge=2, le=1_048_576)]] = None
    """Longest prompt + output in tokens (`--max_seq_len`). Empty: the model's max_position_embeddings."""

    max_num_tokens: Annotated[int, Field(ge=1, le=1_048_576)] = 8192
    """Most tokens processed in one engine step across the batch (`--max_num_tokens`)."""

    max_beam_width: Annotated[int, Field(ge=1, le=64)] = 1
    """Beam search width (`--max_beam_width`); 1 is greedy/sampling."""

    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    """KV cache layout (`--kv_cache_type`). In-flight batching needs `paged`."""

    tokens_per_block: Annotated[int, Field(ge=1, le=1024)] = 32
    """Tokens per paged KV-cache block (`--tokens_per_block`); a power of two."""

    context_fmha: bool = True
    """Fused multi-head attention for the context phase (`--context_fmha`)."""

    use_paged_context_fmha: bool = True
    """Context FMHA over the paged KV cache (`--use_paged_context_fmha`); needed for KV reuse and chunked
    context."""

    use_fp8_context_fmha: bool = False
    """FP8 context FMHA (`--use_fp8_context_fmha`); only with fp8 formats and an fp8 KV cache, SM 89+."""

    gemm_plugin: Literal["auto", "float16", "bfloat16", "float32", "fp8", "nvfp4", "disable"] = "auto"
    """GEMM plugin (`--gemm_plugin`): `auto` picks the model dtype; `disable` uses TensorRT's own GEMMs."""

    multiple_profiles: bool = False
    """Build several TensorRT optimisation profiles (`--multiple_profiles`): faster, longer build."""

    remove_input_padding: bool = True
    """Packed (unpadded) inputs (`--remove_input_padding`); in-flight batching needs it."""

    workers: Optional[Annotated[int, Field(ge=1, le=64)]] = None
    """Ranks built in parallel (`--workers`). Empty: tp × pp."""

    gather_context_logits: bool = False
    """Keep the logits of every prompt position (`--gather_context_logits`). Enables prompt scoring on the
    `tensorrt` target: the OpenAI server's `echo`/`logprobs` requests (lm-eval's loglikelihood tasks: lambada,
    hellaswag, MMLU, …) get each prompt token's log-prob and the argmax alternative. Costs GPU memory for a
    prompt × vocabulary FP32 logits buffer per request in the context phase (a 2k-token prompt with a 128k
    vocabulary is 1 GiB) and a slower context phase; off, such requests are refused naming this key. The
    `reference` and `pytorch` targets score prompts without it."""

    speculative: SpeculativeSection = SpeculativeSection()
    """Speculative decoding."""


class ServingSection(Section):
    batching: Literal["inflight_fused", "v1"] = "inflight_fused"
    """Batching strategy (`gpt_model_type`): in-flight fused batching, or static `v1`."""

    scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = "guaranteed_no_evict"
    """Batch scheduler (`batch_scheduler_policy`): `max_utilization` packs more requests and may pause some."""

    kv_cache_free_gpu_mem_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """Fraction of GPU memory left after weights that the KV cache takes."""

    max_tokens_in_paged_kv_cache: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = None
    """Hard cap on KV-cache tokens; the smaller of this and the fraction wins. Empty: no cap. On the
    reference target this sizes the CPU paged cache (default there: max_batch_size × max_seq_len)."""

    enable_kv_cache_reuse: bool = True
    """Reuse KV blocks across requests that share a prefix (needs paged context FMHA)."""

    enable_chunked_context: bool = False
    """Split long prompts over several steps (needs paged context FMHA)."""

    kv_cache_host_memory_bytes: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    """Host memory for offloaded KV blocks, bytes (0: none)."""

    streaming: bool = True
    """Stream tokens as they are generated (the model is `decoupled`)."""

    exclude_input_in_output: bool = True
    """Return only generated text, not the prompt."""

    max_queue_delay_microseconds: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    """How long a request may wait to join a batch."""

    gpu_device_ids: Optional[tuple[int, ...]] = None
    """GPUs the model uses (`gpu_device_ids`). Empty: all visible."""

    preprocessing_instances: Annotated[int, Field(ge=1, le=64)] = 1
    """Tokenizer model instances."""

    postprocessing_instances: Annotated[int, Field(ge=1, le=64)] = 1
    """Detokenizer model instances."""

    bls_instances: Annotated[int, Field(ge=1, le=64)] = 1
    """BLS model instances."""

    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (e.g. BOS) to prompts."""

    skip_special_tokens: bool = True
    """Drop special tokens from returned text."""

    cuda_graphs: Optional[bool] = None
    """CUDA graphs for the generation step. Target pytorch: the LLM argument cuda_graph_config (TensorRT-LLM's
    default: on, padded batch sizes up to min(engine.max_batch_size, 128)); false turns them off. Target tensorrt:
    the tensorrtllm backend's cuda_graph_mode (its default: off). Empty: each backend's default. The reference
    runtimes run on the CPU: there it has no effect (`kiln validate` warns)."""

    llmapi_runtime: Literal["auto", "tensorrt_llm", "reference"] = "auto"
    """Target pytorch: what runs the Triton `tensorrt_llm` (llmapi) model. `tensorrt_llm`: TensorRT-LLM's LLM API
    (PyTorch backend) on the GPU, in the NGC image. `reference`: kiln's CPU runtime for the same tensor contract and
    the same unified checkpoint, a test and development vehicle, not a fast path. `auto`: tensorrt_llm when this
    machine has an NVIDIA GPU (or tp × pp > 1), else reference."""

    cpu_threads: Optional[Annotated[int, Field(ge=1, le=1024)]] = None
    """Reference target only: torch threads for the CPU runtime. Empty: the machine's cores."""

    host: str = "127.0.0.1"
    """Address `kiln serve` binds (deploy files bind 0.0.0.0 inside the container)."""

    http_port: Annotated[int, Field(ge=1, le=65_535)] = 8000
    """HTTP/REST port."""

    grpc_port: Annotated[int, Field(ge=1, le=65_535)] = 8001
    """gRPC port."""

    metrics_port: Annotated[int, Field(ge=1, le=65_535)] = 8002
    """Prometheus metrics port."""

    multinode_image: Optional[str] = None
    """Multi-node deployments (tp × pp above hardware.gpus_per_node): the image of the LeaderWorkerSet pods, built
    from the Dockerfile.multinode kiln writes beside the deploy files (the serving image plus sshd, which the
    stock NGC image lacks) and pushed to your registry. Empty: `kiln-trtllm-multinode:<serving tag>`, the name the
    Dockerfile's build command gives."""

    openai_port: Annotated[int, Field(ge=1, le=65_535)] = 9000
    """Port of kiln's OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`): `kiln serve --openai`
    and the deploy files' sidecar."""

    openai_model: Literal["ensemble", "tensorrt_llm_bls"] = "ensemble"
    """The Triton model the OpenAI-compatible server calls. `tensorrt_llm_bls` decodes streamed text from all
    tokens so far, so a multi-byte character is never split on the tensorrt target (the ensemble decodes each
    token on its own there, as upstream); the ensemble is the faster path."""

    openai_sidecar: bool = True
    """Deploy files (tensorrt target) run kiln's OpenAI-compatible server beside Triton (a Compose service, a
    second container in the Kubernetes pod)."""

    openai_image: Optional[str] = None
    """Image of the OpenAI sidecar: one with kiln installed. Empty: `kiln-openai:<kiln version>`, built from the
    serving image with the `Dockerfile.openai` kiln writes beside the deploy files."""

    init_image: Optional[str] = None
    """Image of the deploy files' init step that pulls the packaged repository from the remote cache (cache.remote)
    into the pod's volume: one with kiln installed. Pin it by digest (`repo/name:tag@sha256:…`): the step verifies
    what it pulls, so its own image must be the one you checked. Empty: `kiln-init:<kiln version>`, built with the
    `Dockerfile.init` kiln writes beside the deploy files (a warning says it is not pinned)."""

    registry_secret: str = "kiln-registry"
    """Kubernetes Secret of type kubernetes.io/dockerconfigjson (`kubectl create secret docker-registry …`) holding
    the remote cache's credentials for the init step; mounted as its Docker config, never inlined. Optional in the
    pod: a registry that allows anonymous pulls needs none."""

    repo_cache_pvc: Optional[str] = None
    """A PersistentVolumeClaim (ReadWriteMany) the init step pulls the repository into, one folder per manifest
    digest, so pods on nodes that pulled it before start without pulling again. Empty: an emptyDir per pod."""

    @field_validator("init_image")
    @classmethod
    def _init_image_pinned(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.fullmatch(r"[^\s@]+@sha256:[0-9a-f]{64}", v):
            raise ValueError(f"{v!r} is not pinned by digest: give `repo/name:tag@sha256:<64 hex digits>` (the init step "
                             "pulls and verifies the repository, so its own image must be exactly the one you checked), "
                             "or leave it empty for kiln's Dockerfile.init")
        return v

    @field_validator("registry_secret", "repo_cache_pvc")
    @classmethod
    def _k8s_object_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", v):
            raise ValueError(f"{v!r} is not a Kubernetes object name (lower-case letters, digits, '-' and '.')")
        return v

    dynamo_workers: Annotated[int, Field(ge=1, le=256)] = 1
    """Dynamo (target pytorch): TensorRT-LLM workers of the aggregated DynamoGraphDeployment, each tp × pp GPUs; the
    frontend's router spreads requests over them."""

    dynamo_prefill_workers: Annotated[int, Field(ge=1, le=256)] = 1
    """Dynamo, disaggregated serving: prefill workers (each tp × pp GPUs). Default 1 prefill : 1 decode, the split
    of Dynamo 1.6.1's planner profile for one model on one GPU each (dynamo/planner/tests/data/profiling_results/
    H200_TP1P_TP1D); size it from your own profile (prefill-heavy traffic: more prefill workers)."""

    dynamo_decode_workers: Annotated[int, Field(ge=1, le=256)] = 1
    """Dynamo, disaggregated serving: decode workers (each tp × pp GPUs)."""


class EngineRuntimeSection(Section):
    kind: Literal["container", "local"] = "container"
    """Where TensorRT-LLM work runs (its quantization, the engine build and the evaluation of what it quantized).
    `container`: in the NGC image that will serve the engine (docker or podman with GPUs, or Apptainer on Slurm
    clusters without docker), as the caller's uid:gid, inputs mounted read-only. `local`: on this machine, with the
    interpreter named by `python` (a venv that has tensorrt_llm) and `trtllm-build` beside it or on PATH."""

    trtllm_version: str = "1.2.1"
    """TensorRT-LLM version: picks the image from kiln's container table (the same table that picks the serving
    container), and the versions the runtime must report."""

    image: Optional[str] = None
    """Container image, overriding the one `trtllm_version` picks (e.g. a mirror, or `repo:tag@sha256:…` to pin a
    digest; a `.sif` path for Apptainer). Empty: the table's newest `tritonserver:<yy.mm>-trtllm-python-py3`."""

    container_engine: Literal["auto", "docker", "podman", "apptainer"] = "auto"
    """Container engine for `kind: container`. `auto`: the first of docker, podman, apptainer (or singularity) found
    on PATH."""

    gpus: str = "all"
    """GPUs the container sees: `all`, or device indices such as `0,1`."""

    shm_size: str = "2g"
    """Shared memory for the container (`--shm-size`), as NVIDIA's TensorRT-LLM container docs give it (docker only:
    podman refuses `--shm-size` with `--ipc=host`, under which the host's /dev/shm is shared)."""

    python: Optional[str] = None
    """`kind: local`: the Python interpreter (or venv directory) that has tensorrt_llm. Empty: `python3` on PATH."""


class HardwareSection(Section):
    gpu: Optional[str] = None
    """GPU model the engine is built for, e.g. `H100-SXM`, `A100-80GB`, `L40S`, `H200`, `B200`. Empty: detected
    from this machine when it has a GPU. Used for validation and planning."""

    count: Optional[Annotated[int, Field(ge=1, le=1024)]] = None
    """GPUs available (empty: detected, else tp × pp)."""

    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 8
    """GPUs per node where it is deployed: tp × pp above this spans several nodes (Kubernetes manifests then
    use a LeaderWorkerSet instead of a Deployment)."""


#: Steps whose outputs the remote cache can share: every step. The package step's entry is its Triton repository
#: (with the engine or checkpoint it holds); its deploy files stay out and are rendered after a build or pull,
#: naming that entry by fingerprint and manifest digest. A test keeps this equal to the pipeline's steps.
ShareableStep = Literal["resolve", "quantize", "evaluate", "engine", "package", "tasks"]


class CacheSection(Section):
    remote: Optional[str] = None
    """Remote cache of step outputs, keyed by fingerprint: an OCI registry repository,
    `oci://HOST[:PORT]/REPOSITORY` (HTTPS) or `oci+http://HOST[:PORT]/REPOSITORY` (plain HTTP). `kiln build --cache
    URL` and the KILN_REMOTE_CACHE environment variable beat this. Empty: no remote cache. Credentials never go
    here: `docker login` / `oras login` / `podman login`, or KILN_REGISTRY_USERNAME and KILN_REGISTRY_PASSWORD."""

    share: tuple[ShareableStep, ...] = ("quantize", "evaluate", "engine", "package")
    """Steps whose outputs are looked up before they run and pushed after: by default the expensive ones —
    calibration, the quality measurement (both models over the evaluation set; the gate is still checked on the
    pulled figures) and the engine build — and the packaged Triton repository, which the deploy files' init
    containers pull by digest (so a cluster needs nothing copied by hand)."""

    pull: bool = True
    """Look shared steps up in the remote cache and pull a hit instead of running the step."""

    push: bool = True
    """Push shared steps' outputs that the registry lacks (built here, or up to date here). Off for a read-only
    token."""

    layer_mb: Annotated[int, Field(ge=1, le=4096)] = 256
    """Largest layer, MiB: files are cut into uncompressed layers of at most this size, so a multi-GB engine
    pushes, resumes and verifies layer by layer."""

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_cache_url(v)
        return v


class Recipe(Section):
    """A kiln recipe: one model, how to quantize, compile and serve it."""

    name: str
    """Recipe name: lower-case letters, digits, `.`, `_`, `-`. Names the build and repository directories."""

    description: str = ""
    """One line saying what the recipe is for (shown by `kiln ls`)."""

    extends: Optional[str] = None
    """Base recipe (path, relative to this file) whose keys this recipe overrides key by key."""

    target: Target = Field("tensorrt", description="What runs the model: " + "; ".join(
        f"`{name}`: {t.label}" for name, t in _REGISTRY.targets.items()) + ".")

    model: ModelSection = ModelSection()
    """The model."""

    quantization: QuantizationSection = QuantizationSection()
    """How to quantize."""

    evaluation: EvaluationSection = EvaluationSection()
    """Quality measurement and gate."""

    parallelism: ParallelismSection = ParallelismSection()
    """Multi-GPU split."""

    engine: EngineSection = EngineSection()
    """Engine limits and features: what `trtllm-build` compiles in (target tensorrt), the LLM arguments of the
    PyTorch backend (target pytorch: the limits, tokens_per_block and speculative decoding carry over; the
    build-time plugin flags have no equivalent there), and what the reference runtimes run with."""

    serving: ServingSection = ServingSection()
    """Triton serving settings."""

    hardware: HardwareSection = HardwareSection()
    """Target hardware."""

    engine_runtime: EngineRuntimeSection = EngineRuntimeSection()
    """Where TensorRT-LLM's own work (quantization, engine build, evaluation) runs: kiln itself never imports
    tensorrt_llm."""

    cache: CacheSection = CacheSection()
    """Remote cache of step outputs (CI engine builds): never part of any fingerprint."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r} is not a valid name; use lower-case letters, digits, '.', '_' and '-'")
        return v


SECTIONS: tuple[str, ...] = tuple(Recipe.model_fields)

#: Keys that were renamed, old dotted path → new one: recipes written for an older kiln get the new name as the fix.
RENAMED_KEYS: dict[str, str] = {"build": "engine"}


@functools.cache
def gpu_here() -> bool:
    """Whether this machine has an NVIDIA GPU (``nvidia-smi`` lists one); asked once per process."""
    from kiln.recipe.gpus import detected_gpu_names

    return bool(detected_gpu_names())


def quantization_runtime(recipe: Recipe) -> Literal["engine", "host"]:
    """Where the recipe's calibration and export run (``quantization.runtime`` with `auto` resolved): the engine
    runtime for target tensorrt, the host for reference, and for pytorch the engine runtime on a machine with a GPU
    (the image's ModelOpt, which matches its TensorRT-LLM) and the host elsewhere (kiln's ModelOpt, the CPU path)."""
    q = recipe.quantization.runtime
    if q != "auto":
        return q
    if recipe.target == "pytorch":
        nothing = (_REGISTRY.weight_formats[recipe.quantization.format].modelopt_config is None
                   and _REGISTRY.kv_cache_formats[recipe.quantization.kv_cache].modelopt_config is None)
        return "engine" if gpu_here() and not nothing else "host"  # nothing to calibrate: a plain export
    return "engine" if recipe.target == "tensorrt" else "host"


def llmapi_runtime(recipe: Recipe) -> Literal["tensorrt_llm", "reference"]:
    """Target pytorch: what runs the llmapi model (``serving.llmapi_runtime`` with `auto` resolved on this machine)."""
    value = recipe.serving.llmapi_runtime
    if value != "auto":
        return value
    if recipe.parallelism.tp * recipe.parallelism.pp > 1:
        return "tensorrt_llm"  # the reference runs one process: a multi-GPU recipe is packaged for its GPUs
    return "tensorrt_llm" if gpu_here() else "reference"
