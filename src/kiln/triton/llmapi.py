"""Target pytorch: TensorRT-LLM 1.2.1's PyTorch backend behind Triton's ``llmapi`` model, and trtllm-serve.

Two upstream contracts, each kept as data with its source:

- ``data/llm_args/<version>.yaml``: the LLM arguments of one TensorRT-LLM release (``tensorrt_llm.LLM``'s TorchLlmArgs, its KV-cache, scheduler, CUDA-graph
  and speculative-decoding configs) with their types. :func:`check_llm_args` validates a model.yaml or trtllm-serve
  options mapping against them, strictly (unknown keys and wrong types are errors, as upstream's pydantic classes
  with ``extra="forbid"`` make them on the GPU, only later).
- ``data/llmapi_model.yaml``: the Triton llmapi model (its tensors, its ``triton_config`` keys and what its model.py
  does with them).

:func:`llm_args_for` maps a recipe to the LLM arguments, :func:`triton_config_for` to ``triton_config``, and
:func:`llmapi_config` writes the ``config.pbtxt`` with the values ``triton_config`` would set (kiln serves with
``--disable-auto-complete-config``, which skips upstream's auto_complete_config). :data:`RECIPE_MAPPING` says, for
every engine and serving key of a recipe, what it becomes on this target (``kiln validate --set target=pytorch``).
"""

from __future__ import annotations

import copy
import functools
import typing
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt,
                      ValidationError, create_model)
from tritonclient.grpc import model_config_pb2 as mc

from kiln.recipe.formats import kv_cache_format, registry
from kiln.recipe.schema import HF_PREFIX, Recipe, llmapi_runtime
from kiln.triton.repository import add_prompt_scoring, cpu_instances, render, set_parameters

MODEL_NAME = "tensorrt_llm"
MODEL_YAML = "model.yaml"
#: Beside the llmapi model.py: how the CPU reference runtime dequantizes each quant_algo (from the format registry).
DEQUANTIZE_FILE = "kiln_dequantize.json"
#: Where the unified checkpoint (and a draft model's) lives in the model's version directory; model.yaml names them
#: relative to it (kiln's model.py resolves them there).
CHECKPOINT_DIR = "checkpoint"
DRAFT_DIR = "draft_checkpoint"
#: The EAGLE3 head of a local ``engine.speculative.draft_model`` folder, linked into the version directory.
EAGLE_DIR = "eagle_head"
#: CudaGraphConfig's own default for max_batch_size (0 becomes 128): kiln captures up to the smaller of this and
#: engine.max_batch_size.
CUDA_GRAPH_DEFAULT_MAX_BATCH = 128
#: serving.scheduler_policy → SchedulerConfig.capacity_scheduler_policy.
SCHEDULER_POLICY = {"max_utilization": "MAX_UTILIZATION", "guaranteed_no_evict": "GUARANTEED_NO_EVICT"}
#: engine.speculative.mode → speculative_config.decoding_type (modes not listed do not run on this target).
DECODING_TYPE = {"draft_tokens_external": "DraftTarget", "eagle": "Eagle", "ngram": "NGram", "mtp": "MTP"}


def _load(name: str) -> dict:
    return yaml.safe_load(resources.files("kiln.triton").joinpath("data", name).read_text(encoding="utf-8"))


#: The TensorRT-LLM release whose LLM arguments kiln checks against when none is named.
DEFAULT_LLM_ARGS_VERSION = "1.2.1"


def llm_args_versions() -> tuple[str, ...]:
    """The TensorRT-LLM releases with an LLM-argument table (``data/llm_args/<version>.yaml``; a new release adds a
    file)."""
    folder = resources.files("kiln.triton").joinpath("data", "llm_args")
    return tuple(sorted(p.name[:-len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")))


@functools.cache
def llm_args_data(version: str = DEFAULT_LLM_ARGS_VERSION) -> dict:
    """``data/llm_args/<version>.yaml``, parsed. Raises ``LookupError`` naming the versions kiln has tables for."""
    if version not in llm_args_versions():
        raise LookupError(f"no LLM-argument table for TensorRT-LLM {version!r} (kiln/triton/data/llm_args/); known: "
                          f"{', '.join(llm_args_versions())}")
    data = _load(f"llm_args/{version}.yaml")
    base = data.pop("extends", None)
    if base is None:
        return data
    # a release whose arguments are another's plus `changes` (its own `pinned`, `sources` and caveat)
    merged = copy.deepcopy(llm_args_data(str(base)))
    # the base's sources stay (fields inherited unchanged still cite them); the release's own are added
    merged["sources"] = {**(merged.get("sources") or {}), **(data.pop("sources", None) or {})}
    changes = data.pop("changes", None) or {}
    for name, spec in (changes.get("classes") or {}).items():
        fields = merged["classes"].setdefault(name, {"fields": {}})["fields"]
        for field, value in (spec.get("fields") or {}).items():
            if value is None:
                fields.pop(field, None)  # removed in this release
            else:
                fields[field] = value
    merged.update(data)
    return merged


def llm_args_version(recipe: Recipe) -> str:
    """The TensorRT-LLM release whose LLM arguments a recipe's files are checked against: its
    ``engine_runtime.trtllm_version`` (``LookupError`` when kiln has no table for it)."""
    from kiln.util.errors import InputError

    version = recipe.engine_runtime.trtllm_version.strip()
    try:
        llm_args_data(version)
    except LookupError as exc:
        raise InputError(f"engine_runtime.trtllm_version: {exc}") from None
    return version


@functools.cache
def llmapi_model_data() -> dict:
    """``data/llmapi_model.yaml``, parsed."""
    return _load("llmapi_model.yaml")


# ------------------------------------------------------------------------------------------ typed LLM arguments

_STRICT = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)


def _type(text: str, namespace: dict[str, Any]) -> Any:
    """A field type written in the data file's typing notation (no builtins reachable but the type names)."""
    names = {"Optional": Optional, "List": list, "Dict": dict, "Literal": Literal, "Union": Union, "Any": Any, "bool": bool,
             "int": int, "float": float, "str": str, "dict": dict, "NonNegativeInt": NonNegativeInt,
             "PositiveInt": PositiveInt, "NonNegativeFloat": NonNegativeFloat, **namespace}
    return eval(text, {"__builtins__": {}}, names)  # noqa: S307 - kiln's own data file, no builtins


#: Bounds a field of the data file may carry, as upstream's pydantic Field(ge=…, le=…, min_length=…) has them.
_BOUNDS = ("ge", "le", "gt", "lt", "min_length")


def _fields(spec: dict, namespace: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, field in (spec or {}).items():
        kind = _type(str(field["type"]), namespace)
        extra: dict[str, Any] = {k: field[k] for k in _BOUNDS if k in field}
        if field.get("aliases"):
            extra["validation_alias"] = AliasChoices(name, *field["aliases"])
        if field.get("required"):
            out[name] = (kind, Field(..., **extra))
        else:
            out[name] = (kind, Field(default=field.get("default"), **extra))
    return out


@functools.cache
def llm_args_model(version: str = DEFAULT_LLM_ARGS_VERSION) -> type[BaseModel]:
    """A strict pydantic model of TorchLlmArgs built from the version's data file (nested configs and the
    speculative-decoding variants included; the variant is picked by ``decoding_type`` as
    DecodingBaseConfig.from_dict picks it)."""
    data = llm_args_data(version)
    classes = data["classes"]
    namespace: dict[str, Any] = {}
    for name in ("DynamicBatchConfig", "KvCacheConfig", "SchedulerConfig", "CudaGraphConfig"):
        namespace[name] = create_model(name, __config__=_STRICT, **_fields(classes[name]["fields"], namespace))
    spec = data["speculative"]
    variants = []
    for key, variant in spec["variants"].items():
        fields = {**_fields(spec["base_fields"], namespace), **_fields(variant["fields"], namespace)}
        fields[spec["dispatch_key"]] = (Literal[key], ...)  # type: ignore[valid-type]
        variants.append(create_model(variant["class"], __config__=_STRICT, **fields))
    namespace["SpeculativeConfig"] = typing.Annotated[Union[tuple(variants)],  # type: ignore[valid-type]
                                                      Field(discriminator=spec["dispatch_key"])]
    return create_model("TorchLlmArgs", __config__=_STRICT, **_fields(classes["TorchLlmArgs"]["fields"], namespace))


def check_llm_args(args: dict, version: str = DEFAULT_LLM_ARGS_VERSION) -> list[str]:
    """Every problem of ``args`` (a model.yaml without ``triton_config``, or trtllm-serve options with ``model``)
    against TensorRT-LLM ``version``'s LLM arguments: unknown keys, wrong types, a speculative-decoding type the
    PyTorch backend refuses or a variant missing what it needs. Each names the dotted key."""
    problems: list[str] = []
    data = llm_args_data(version)
    try:
        llm_args_model(version).model_validate(args)
    except ValidationError as exc:
        for e in exc.errors():
            loc = [str(p) for p in e["loc"]]
            if len(loc) > 1 and loc[0] == "speculative_config" and loc[1] in data["speculative"]["variants"]:
                loc.pop(1)  # the discriminator's branch name, not a key the user wrote
            where = ".".join(loc) or "(top)"
            msg = f"unknown key (not an LLM argument of TensorRT-LLM {version})" if e["type"] == "extra_forbidden" \
                else e["msg"]
            problems.append(f"{where}: {msg}")
    cg = args.get("cuda_graph_config")
    if isinstance(cg, dict) and isinstance(cg.get("batch_sizes"), list) and cg["batch_sizes"] \
            and all(isinstance(b, int) for b in cg["batch_sizes"]) and cg.get("max_batch_size") not in (None, 0) \
            and cg["max_batch_size"] != max(cg["batch_sizes"]):
        # CudaGraphConfig.validate_cuda_graph_config (the 1.2-line llm_args.py): both given, they must agree
        problems.append(f"cuda_graph_config.max_batch_size: {cg['max_batch_size']!r}, but max(batch_sizes) is "
                        f"{max(cg['batch_sizes'])}: when both are given they must be equal (or leave max_batch_size out)")
    spec = data["speculative"]
    sc = args.get("speculative_config")
    if isinstance(sc, dict) and sc.get(spec["dispatch_key"]) in spec["variants"]:
        variant = spec["variants"][sc[spec["dispatch_key"]]]
        if not variant["pytorch"]:
            problems.append(f"speculative_config.decoding_type: {sc[spec['dispatch_key']]} does not run on the "
                            "PyTorch backend")
        fields = {**spec["base_fields"], **(variant.get("fields") or {})}

        def given(key: str) -> bool:  # the field under its name or any alias upstream accepts
            names = (key, *((fields.get(key) or {}).get("aliases") or ()))
            return any(sc.get(n) not in (None, 0) for n in names)

        problems += [f"speculative_config.{k}: needed by {sc[spec['dispatch_key']]}" for k in variant.get("needs", ())
                     if not given(k)]
    return problems


# ------------------------------------------------------------------------------------------ recipe → arguments


def _table_version(recipe: Recipe) -> str:
    """The release whose argument table names what kiln writes: the recipe's ``engine_runtime.trtllm_version`` when
    kiln has a table for it (else the default; :func:`llm_args_version` is what refuses an unknown one)."""
    version = recipe.engine_runtime.trtllm_version.strip()
    return version if version in llm_args_versions() else DEFAULT_LLM_ARGS_VERSION


def _speculative(recipe: Recipe, draft_path: Optional[str], strict: bool) -> Optional[dict]:
    sp = recipe.engine.speculative
    if sp.mode == "none":
        return None
    kind = DECODING_TYPE.get(sp.mode)
    if kind is None:
        if not strict:
            return None
        raise ValueError(f"engine.speculative.mode {sp.mode} does not run on the pytorch target")
    # the release's spelling of kiln's decoding types (the table's `kiln_names`: Draft_Target and Eagle3, the tags
    # of its discriminated SpeculativeConfig union)
    names = llm_args_data(_table_version(recipe))["speculative"].get("kiln_names") or {}
    out: dict[str, Any] = {"decoding_type": names.get(kind, kind)}
    if kind == "MTP":
        out["num_nextn_predict_layers"] = sp.max_draft_len
        return out
    out["max_draft_len"] = sp.max_draft_len
    if kind == "NGram":
        out["max_matching_ngram_size"] = sp.max_matching_ngram_size
    elif kind == "DraftTarget":
        out["speculative_model_dir"] = draft_path
    elif kind == "Eagle":
        out["speculative_model_dir"] = draft_path or eagle_head_reference(sp.draft_model)
    return out


def eagle_head_reference(draft_model: Optional[str]) -> Optional[str]:
    """What ``speculative_model`` takes for an EAGLE3 head kiln did not package (the CPU reference runtime, which does
    not speculate): upstream accepts a Hugging Face Hub id (``org/name``; no revision field) or a local directory, so
    ``hf:org/name[@rev]`` is written as ``org/name``. For TensorRT-LLM the package step links the head into the
    repository instead (:data:`EAGLE_DIR`), a hub head downloaded at its revision."""
    if draft_model and draft_model.startswith(HF_PREFIX):
        return draft_model[len(HF_PREFIX):].partition("@")[0]
    return draft_model


def llm_args_for(recipe: Recipe, model_path: str, max_seq_len: Optional[int],
                 draft_path: Optional[str] = None, strict: bool = True) -> dict[str, Any]:
    """The LLM arguments the recipe means (see :data:`RECIPE_MAPPING`), for a checkpoint at ``model_path``.
    ``strict=False`` leaves out what the target refuses (a speculative mode it does not run) instead of raising."""
    e, s = recipe.engine, recipe.serving
    kv: dict[str, Any] = {
        "free_gpu_memory_fraction": s.kv_cache_free_gpu_mem_fraction,
        "enable_block_reuse": s.enable_kv_cache_reuse,
        "tokens_per_block": e.tokens_per_block,
        "dtype": kv_cache_format(recipe.quantization.kv_cache).trtllm_kv_cache_dtype or "auto",
    }
    if s.max_tokens_in_paged_kv_cache is not None:
        kv["max_tokens"] = s.max_tokens_in_paged_kv_cache
    if s.kv_cache_host_memory_bytes:
        kv["host_cache_size"] = s.kv_cache_host_memory_bytes
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": recipe.model.dtype,
        "trust_remote_code": recipe.model.trust_remote_code,
        "tensor_parallel_size": recipe.parallelism.tp,
        "pipeline_parallel_size": recipe.parallelism.pp,
        "max_batch_size": e.max_batch_size,
        "max_input_len": e.max_input_len,
        "max_num_tokens": e.max_num_tokens,
        "max_beam_width": e.max_beam_width,
        "enable_chunked_prefill": s.enable_chunked_context,
        "kv_cache_config": kv,
        "scheduler_config": {"capacity_scheduler_policy": SCHEDULER_POLICY[s.scheduler_policy]},
    }
    if max_seq_len is not None:
        args["max_seq_len"] = int(max_seq_len)
    if s.cuda_graphs is True:
        args["cuda_graph_config"] = {"max_batch_size": min(e.max_batch_size, CUDA_GRAPH_DEFAULT_MAX_BATCH),
                                     "enable_padding": True}
    elif s.cuda_graphs is False:
        args["cuda_graph_config"] = None  # TorchLlmArgs: null turns CUDA graphs off
    spec = _speculative(recipe, draft_path, strict)
    if spec is not None:
        args["speculative_config"] = spec
    return args


def triton_config_for(recipe: Recipe) -> dict[str, Any]:
    """model.yaml's ``triton_config``: one prompt per request (upstream's model does not batch: the LLM does), and
    decoupled when the recipe streams."""
    return {"max_batch_size": 0, "decoupled": recipe.serving.streaming, "cancellation_check_period_ms": 100}


def check_triton_config(triton_config: Any) -> list[str]:
    """Problems of a model.yaml's ``triton_config`` against the pinned llmapi model's handling of it."""
    spec = llmapi_model_data()["triton_config"]
    if not isinstance(triton_config, dict):
        return ["triton_config: missing or not a mapping (the llmapi model reads triton_config.decoupled and "
                "triton_config.max_batch_size unguarded)"]
    problems = [f"triton_config.{k}: not a key the llmapi model reads (it reads {', '.join(spec)})"
                for k in triton_config if k not in spec]
    kinds = {"bool": bool, "int": int}
    for key, field in spec.items():
        if key not in triton_config:
            if field.get("required"):
                problems.append(f"triton_config.{key}: required (the llmapi model reads it unguarded)")
            continue
        value = triton_config[key]
        want = kinds[field["type"]]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            problems.append(f"triton_config.{key}: {value!r} is not a {field['type']}")
        elif "must_be" in field and value != field["must_be"]:
            problems.append(f"triton_config.{key}: {value!r}, but the llmapi model only runs with {field['must_be']} "
                            f"({' '.join(field['note'].split())})")
    return problems


def model_yaml(recipe: Recipe, max_seq_len: Optional[int], draft: bool = False,
               eagle_head: bool = False) -> dict[str, Any]:
    """The whole model.yaml: the LLM arguments (the checkpoint, and a packaged draft checkpoint or EAGLE3 head, named
    relative to the version directory) and ``triton_config``."""
    args = llm_args_for(recipe, CHECKPOINT_DIR, max_seq_len,
                        DRAFT_DIR if draft else EAGLE_DIR if eagle_head else None)
    return {**args, "triton_config": triton_config_for(recipe)}


def dequantize_table() -> dict[str, Any]:
    """The format registry's unified-checkpoint layouts by the quant_algo / kv_cache_quant_algo the checkpoint's
    hf_quant_config.json names: what kiln's CPU reference runtime dequantizes (it cannot import kiln)."""
    reg = registry()
    return {
        "source": "kiln/recipe/data/formats.yaml (unified)",
        "weights": {f.quant_algo: f.unified.model_dump(exclude={"source"}) for f in reg.weight_formats.values()
                    if f.unified is not None and f.quant_algo},
        "kv_cache": {f.kv_cache_quant_algo: f.unified.rounding for f in reg.kv_cache_formats.values()
                     if f.unified is not None and f.kv_cache_quant_algo},
    }


def dump_yaml(data: dict, header: str = "") -> str:
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    return (header + "\n" if header else "") + body


# ------------------------------------------------------------------------------------------ config.pbtxt


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


def contract_tensors(kind: Literal["inputs", "outputs"]) -> list[Tensor]:
    return [Tensor(t["name"], t["data_type"], tuple(t["dims"]), bool(t.get("optional", False)))
            for t in llmapi_model_data()[kind]]


def llmapi_config(recipe: Recipe, runtime: Optional[str] = None) -> Any:
    """The tensorrt_llm ``ModelConfig``: upstream's tensors, and ``max_batch_size`` / ``decoupled`` written from
    ``triton_config`` (what upstream's auto_complete_config would set). Parameters are kiln's model's: which runtime
    serves it and the defaults it applies to requests."""
    runtime = runtime or llmapi_runtime(recipe)
    tc = triton_config_for(recipe)
    c = mc.ModelConfig()
    c.name = MODEL_NAME
    c.backend = llmapi_model_data()["backend"]
    c.max_batch_size = tc["max_batch_size"]
    c.model_transaction_policy.decoupled = tc["decoupled"]
    for t in contract_tensors("inputs"):
        i = c.input.add()
        i.name, i.data_type, i.optional = t.name, mc.DataType.Value(t.data_type), t.optional
        i.dims.extend(t.dims)
    for t in contract_tensors("outputs"):
        o = c.output.add()
        o.name, o.data_type = t.name, mc.DataType.Value(t.data_type)
        o.dims.extend(t.dims)
    add_prompt_scoring(c)  # kiln's extension after upstream's tensors (the llmapi model.py's docstring)
    cpu_instances(c, 1)
    set_parameters(c, {"runtime": runtime,
                       "exclude_input_from_output": recipe.serving.exclude_input_in_output,
                       "num_threads": recipe.serving.cpu_threads if runtime == "reference" else None})
    return c


def render_config(recipe: Recipe, runtime: Optional[str] = None) -> str:
    return render(llmapi_config(recipe, runtime))


# ------------------------------------------------------------------------------------------ trtllm-serve


def container_llm_args(args: dict[str, Any], repo_root: str) -> dict[str, Any]:
    """The LLM arguments for a server started outside Triton (trtllm-serve, Dynamo's trtllm worker) with the packaged
    repository mounted at ``repo_root``: the draft checkpoint, which model.yaml names relative to the version
    directory (kiln's llmapi model.py resolves it there), named by its absolute path in the container. Left relative,
    upstream's DecodingBaseConfig.speculative_model (a Hub id or a local directory) would resolve it against the
    worker's working directory, or try it as a Hugging Face Hub id."""
    spec = args.get("speculative_config")
    if isinstance(spec, dict) and spec.get("speculative_model_dir") in (DRAFT_DIR, EAGLE_DIR):
        args = {**args, "speculative_config": {**spec, "speculative_model_dir":
                                               f"{repo_root}/{MODEL_NAME}/1/{spec['speculative_model_dir']}"}}
    return args


def trtllm_serve_options(args: dict[str, Any]) -> dict[str, Any]:
    """The ``--extra_llm_api_options`` file: every LLM argument but the positional model."""
    positional = llm_args_data()["trtllm_serve"]["positional"]
    return {k: v for k, v in args.items() if k != positional}


def trtllm_serve_command(recipe: Recipe, checkpoint: str, options_file: str, host: str = "0.0.0.0") -> list[str]:
    """``trtllm-serve serve <checkpoint> --backend pytorch --host … --port … --tp_size … --pp_size …
    --extra_llm_api_options <file>`` (the file's values win over the flags, so they agree by construction)."""
    ts = llm_args_data()["trtllm_serve"]
    return [*ts["command"], checkpoint, "--backend", "pytorch", "--host", host, "--port", str(recipe.serving.http_port),
            "--tp_size", str(recipe.parallelism.tp), "--pp_size", str(recipe.parallelism.pp),
            ts["options_flag"], options_file]


# ------------------------------------------------------------------------------------------ moving a recipe

#: What each engine/serving key of a recipe becomes on target pytorch: ("arg", LLM argument or llmapi setting),
#: ("same", how it carries over unchanged), ("dropped", why it has no equivalent) or ("refused", the value the
#: PyTorch backend needs). A test keeps it complete: a new recipe key must say what it becomes here.
RECIPE_MAPPING: dict[str, tuple[str, str]] = {
    "engine.max_batch_size": ("arg", "max_batch_size"),
    "engine.max_input_len": ("arg", "max_input_len (the PyTorch backend refuses prompts by max_num_tokens and "
                             "max_seq_len instead)"),
    "engine.max_seq_len": ("arg", "max_seq_len (the model's max_position_embeddings when empty)"),
    "engine.max_num_tokens": ("arg", "max_num_tokens"),
    "engine.max_beam_width": ("arg", "max_beam_width"),
    "engine.kv_cache_type": ("refused", "paged (the PyTorch backend's KV cache is always paged)"),
    "engine.tokens_per_block": ("arg", "kv_cache_config.tokens_per_block"),
    "engine.context_fmha": ("dropped", "a trtllm-build plugin flag; the PyTorch backend compiles nothing"),
    "engine.use_paged_context_fmha": ("dropped", "a trtllm-build plugin flag; KV reuse and chunked prefill need no "
                                      "build-time switch on the PyTorch backend"),
    "engine.use_fp8_context_fmha": ("dropped", "a trtllm-build plugin flag; the PyTorch attention backend picks "
                                    "its FP8 kernels from the checkpoint and KV dtype"),
    "engine.gemm_plugin": ("dropped", "a trtllm-build plugin flag; the PyTorch backend picks its GEMMs from the "
                           "checkpoint's quant_algo"),
    "engine.multiple_profiles": ("dropped", "TensorRT optimisation profiles; nothing is compiled"),
    "engine.remove_input_padding": ("dropped", "the PyTorch backend always packs inputs"),
    "engine.workers": ("dropped", "parallel engine builds; nothing is built"),
    "engine.gather_context_logits": ("dropped", "a trtllm-build switch; the llmapi model asks the LLM for prompt "
                                     "log-probs per request (SamplingParams(prompt_logprobs=1)) instead"),
    "engine.speculative.mode": ("arg", "speculative_config.decoding_type (draft_tokens_external → Draft_Target, "
                                "eagle → Eagle3, ngram → NGram, mtp → MTP: the release table's `kiln_names`, the "
                                "tags of its SpeculativeConfig union; medusa, lookahead_decoding and "
                                "explicit_draft_tokens are refused)"),
    "engine.speculative.max_draft_len": ("arg", "speculative_config.max_draft_len (mtp: num_nextn_predict_layers)"),
    "engine.speculative.draft_recipe": ("arg", "speculative_config.speculative_model_dir (the draft recipe's unified "
                                        "checkpoint, in the same model: no BLS model, no second tensorrt_llm)"),
    "engine.speculative.draft_model": ("arg", "speculative_config.speculative_model_dir (eagle: the EAGLE3 head)"),
    "engine.speculative.max_matching_ngram_size": ("arg", "speculative_config.max_matching_ngram_size (ngram)"),
    "serving.batching": ("refused", "inflight_fused (the PyTorch backend only batches in flight)"),
    "serving.scheduler_policy": ("arg", "scheduler_config.capacity_scheduler_policy"),
    "serving.kv_cache_free_gpu_mem_fraction": ("arg", "kv_cache_config.free_gpu_memory_fraction"),
    "serving.max_tokens_in_paged_kv_cache": ("arg", "kv_cache_config.max_tokens"),
    "serving.enable_kv_cache_reuse": ("arg", "kv_cache_config.enable_block_reuse"),
    "serving.enable_chunked_context": ("arg", "enable_chunked_prefill"),
    "serving.kv_cache_host_memory_bytes": ("arg", "kv_cache_config.host_cache_size"),
    "serving.streaming": ("arg", "triton_config.decoupled (and model_transaction_policy in config.pbtxt)"),
    "serving.exclude_input_in_output": ("arg", "the llmapi model's default for "
                                        "sampling_param_exclude_input_from_output (upstream's model defaults it to "
                                        "false: the prompt is echoed)"),
    "serving.max_queue_delay_microseconds": ("dropped", "the llmapi model takes one prompt per request "
                                             "(max_batch_size 0); the LLM batches in flight itself"),
    "serving.gpu_device_ids": ("refused", "empty: the LLM API uses the GPUs the process sees (CUDA_VISIBLE_DEVICES)"),
    "serving.preprocessing_instances": ("dropped", "no preprocessing model: the LLM API tokenizes"),
    "serving.postprocessing_instances": ("dropped", "no postprocessing model: the LLM API detokenizes"),
    "serving.bls_instances": ("dropped", "no BLS model: speculative decoding runs inside the LLM"),
    "serving.add_special_tokens": ("refused", "true (the LLM API's tokenizer adds them)"),
    "serving.skip_special_tokens": ("refused", "true (the LLM API's detokenizer skips them)"),
    "serving.cuda_graphs": ("arg", "cuda_graph_config (true: padded graphs up to min(max_batch_size, 128); "
                            "false: null)"),
    "serving.llmapi_runtime": ("same", "which runtime serves the llmapi model (the GPU LLM API or kiln's CPU "
                               "reference)"),
    "serving.cpu_threads": ("same", "torch threads of the CPU reference runtime"),
    "serving.host": ("same", "the address kiln serve binds"),
    "serving.http_port": ("same", "tritonserver --http-port (trtllm-serve --port)"),
    "serving.grpc_port": ("same", "tritonserver --grpc-port"),
    "serving.metrics_port": ("same", "tritonserver --metrics-port"),
    "serving.multinode_image": ("dropped", "kiln serves the llmapi model on one node"),
    "serving.openai_port": ("dropped", "no OpenAI sidecar: trtllm-serve (whose files package writes) is "
                            "OpenAI-compatible itself"),
    "serving.openai_model": ("dropped", "the OpenAI sidecar calls the ensemble or the BLS, which an llmapi "
                             "repository does not have"),
    "serving.openai_sidecar": ("dropped", "no sidecar: trtllm-serve is OpenAI-compatible itself"),
    "serving.openai_image": ("dropped", "no sidecar image on this target"),
    "serving.dynamo_workers": ("same", "the aggregated DynamoGraphDeployment's worker replicas (deploy/<recipe>/dynamo)"),
    "serving.dynamo_prefill_workers": ("same", "the disaggregated DynamoGraphDeployment's prefill replicas"),
    "serving.dynamo_decode_workers": ("same", "the disaggregated DynamoGraphDeployment's decode replicas"),
    "serving.init_image": ("same", "the deploy files' init step that pulls the packaged repository (cache.remote)"),
    "serving.registry_secret": ("same", "the Secret the init step reads the remote cache's credentials from"),
    "serving.repo_cache_pvc": ("same", "the volume the init step pulls the repository into (reused across pods)"),
}

