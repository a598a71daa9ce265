"""Write a complete Triton model repository (inflight_batcher_llm layout) for a recipe.

Every `config.pbtxt` is built as a real `ModelConfig` protobuf message and serialised with protobuf's own text
format, so it parses by construction and no `${placeholder}` can survive. Tensor names and types come from the
upstream contract (:mod:`kiln.triton.upstream`): every model declares upstream's whole tensor lists, and kiln's
Python models (pre/post-processing, BLS, the CPU reference runtime) accept every upstream input, refusing what
they cannot do with an error naming the feature.

Layout (`triton_repo/<recipe>/`):
    preprocessing/   python, kiln's tokenizer model, tokenizer copied into 1/tokenizer
    tensorrt_llm/    tensorrt: backend tensorrtllm, engine in 1/engine (gpt_model_path /models/tensorrt_llm/1/engine)
                     reference: python, kiln's CPU runtime, quantized checkpoint in 1/checkpoint, the limits it
                     runs with in 1/engine/config.json
    postprocessing/  python, kiln's detokenizer
    ensemble/        pre → tensorrt_llm → post
    tensorrt_llm_bls/ python, kiln's BLS (drives draft+target speculative decoding when there is a draft)
    tensorrt_llm_draft/ the draft model, when the recipe has one
    kiln.json        recipe, fingerprint, engine versions, serving container, server command
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from kiln.recipe.schema import Recipe
from kiln.triton.lint import CONTAINER_MODEL_ROOT
from kiln.recipe.containers import container_for, strip_digest
from kiln.triton.upstream import LOGITS_TRITON_TYPE, MODELS, TensorSpec
from kiln.util.artifacts import link_tree

# Every model declares upstream's whole tensor list (names, types, dims, optional flags): kiln's Python models
# (preprocessing, postprocessing, tensorrt_llm_bls and the reference tensorrt_llm runtime) accept every upstream
# input and answer what they cannot do with an error naming the feature (see each model.py).
FILLED_TYPES = {"${logits_datatype}": "TYPE_FP32", "${prompt_embedding_table_data_type}": "TYPE_FP16",
                "${encoder_input_features_data_type}": "TYPE_FP16"}
#: The engine's logits dtype kiln builds with (trtllm-build --logits_dtype), and the Triton type of the logits
#: tensors for each dtype an engine config can hold (pretrained_config.logits_dtype; upstream's templates leave
#: it to ${logits_datatype}, which every upstream example fills with TYPE_FP32).
LOGITS_DTYPE = "float32"
LOGITS_TENSORS = ("context_logits", "generation_logits")
PYTHON_MODEL_SOURCES = {"preprocessing": "preprocessing", "postprocessing": "postprocessing",
                        "tensorrt_llm": "reference", "tensorrt_llm_draft": "reference", "tensorrt_llm_bls": "bls"}


@dataclass(frozen=True)
class RepoInputs:
    """What the repository is made from."""

    recipe: Recipe
    tokenizer_dir: Path
    engine_dir: Path
    """tensorrt: the built engine directory; reference: a directory holding the stand-in engine config.json"""
    checkpoint_dir: Optional[Path] = None
    """reference: the quantized checkpoint (HF model + modelopt_state.pth)"""
    fingerprint: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    draft: Optional["RepoInputs"] = None
    quality: Optional[dict] = None
    image: Optional[str] = None
    """tensorrt: the serving image (the engine runtime's, pinned by digest when known); None: the table's."""
    image_digest: Optional[str] = None
    kv_tokens: Optional[int] = None
    """KV-cache token cap the planner gave this model (draft+target on shared GPUs)."""
    gpu_device_ids: Optional[str] = None
    """GPUs this model uses (draft+target placement); None: the recipe's serving.gpu_device_ids."""
    orchestrator: bool = False
    """Served in TensorRT-LLM's orchestrator mode (draft+target with tp × pp > 1)."""
    chat_template: Optional[str] = None
    """A chat template for a tokenizer that has none (kiln's for its built-in model); written as chat_template.jinja"""


def standin_engine_config(recipe: Recipe, max_seq_len: int, quantization: Optional[dict] = None,
                          version: str = "reference") -> dict[str, Any]:
    """An engine `config.json` with the build values the recipe asks for (the shape trtllm-build 1.2 writes).

    The reference runtime runs with exactly these limits; tests use it as a stand-in for GPU recipes' engines.
    """
    b = recipe.engine
    return {
        "version": version,
        "runtime": "reference" if version == "reference" else "tensorrt",
        "pretrained_config": {
            "mapping": {"world_size": recipe.parallelism.tp * recipe.parallelism.pp, "tp_size": recipe.parallelism.tp,
                        "pp_size": recipe.parallelism.pp},
            "quantization": quantization or {},
            "logits_dtype": LOGITS_DTYPE,
        },
        "build_config": {
            "max_batch_size": b.max_batch_size, "max_input_len": b.max_input_len,
            "max_seq_len": max_seq_len + b.speculative.max_draft_len, "max_num_tokens": b.max_num_tokens,
            "max_beam_width": b.max_beam_width, "kv_cache_type": b.kv_cache_type,
            "max_draft_len": b.speculative.max_draft_len,
            "speculative_decoding_mode": b.speculative.mode,
            "gather_context_logits": b.gather_context_logits,
            "plugin_config": {"tokens_per_block": b.tokens_per_block, "context_fmha": b.context_fmha,
                              "use_paged_context_fmha": b.use_paged_context_fmha,
                              "use_fp8_context_fmha": b.use_fp8_context_fmha,
                              "remove_input_padding": b.remove_input_padding,
                              "paged_kv_cache": b.kv_cache_type == "paged", "gemm_plugin": b.gemm_plugin,
                              "multiple_profiles": b.multiple_profiles},
        },
    }


# ------------------------------------------------------------------------------------------------ protobuf helpers


def _tensor(spec: TensorSpec, is_input: bool):
    t = mc.ModelInput() if is_input else mc.ModelOutput()
    t.name = spec.name
    t.data_type = mc.DataType.Value(FILLED_TYPES.get(spec.data_type, spec.data_type))
    t.dims.extend(spec.dims)
    if spec.reshape is not None:
        t.reshape.shape.extend(spec.reshape)
    if is_input:
        t.optional = spec.optional
        t.allow_ragged_batch = spec.allow_ragged_batch
    return t


def set_parameters(config, values: dict[str, Any]) -> None:
    """Set string parameters; None leaves a key out, booleans become "true"/"false"."""
    for key, value in values.items():
        if value is None:
            continue  # unset: the key is left out (never a placeholder, never an empty string that means 'default')
        if isinstance(value, bool):
            value = "true" if value else "false"
        config.parameters[key].string_value = str(value)


def base_config(name: str, max_batch_size: int, inputs: list[TensorSpec], outputs: list[TensorSpec], *,
                backend: Optional[str] = None, platform: Optional[str] = None):
    """A ModelConfig with its name, backend or platform, max_batch_size and tensors."""
    c = mc.ModelConfig()
    c.name = name
    if backend:
        c.backend = backend
    if platform:
        c.platform = platform
    c.max_batch_size = max_batch_size
    c.input.extend(_tensor(s, True) for s in inputs)
    c.output.extend(_tensor(s, False) for s in outputs)
    return c


def cpu_instances(c, count: int) -> None:
    """``instance_group [ { count: <count> kind: KIND_CPU } ]``."""
    g = c.instance_group.add()
    g.count = count
    g.kind = mc.ModelInstanceGroup.KIND_CPU


def render(config) -> str:
    """The config.pbtxt text (protobuf text format, parses back into ModelConfig)."""
    return text_format.MessageToString(config)


# ------------------------------------------------------------------------------------------------ model configs

#: Inputs upstream declares required that kiln declares optional, so that a request without them reaches kiln's
#: preprocessing model, which answers with an error naming the missing input. Triton core checks required inputs
#: by count only (a request with as many inputs as the model requires passes, whichever they are), and an ensemble
#: whose first step never gets its input ends with no response: HTTP generate answers 200 with "generate expects
#: model to produce exactly 1 response", a gRPC stream an empty final response (tritonserver 2.x, seen with the
#: session's real server; tests/test_openai_serving_errors.py). The ensemble's steps are unchanged.
CHECKED_BY_PREPROCESSING = {"ensemble": ("text_input", "max_tokens"), "preprocessing": ("QUERY", "REQUEST_OUTPUT_LEN")}


def _checked_by_preprocessing(c) -> None:
    for t in c.input:
        if t.name in CHECKED_BY_PREPROCESSING[c.name]:
            t.optional = True


def preprocessing_config(r: Recipe, max_seq_len: int):
    up = MODELS["preprocessing"]
    c = base_config("preprocessing", r.engine.max_batch_size, list(up.inputs), list(up.outputs), backend="python")
    cpu_instances(c, r.serving.preprocessing_instances)
    set_parameters(c, {"tokenizer_dir": "1/tokenizer", "add_special_tokens": r.serving.add_special_tokens,
                "max_input_len": r.engine.max_input_len, "max_seq_len": max_seq_len})
    _checked_by_preprocessing(c)
    return c


def postprocessing_config(r: Recipe):
    up = MODELS["postprocessing"]
    c = base_config("postprocessing", r.engine.max_batch_size, list(up.inputs), list(up.outputs), backend="python")
    cpu_instances(c, r.serving.postprocessing_instances)
    set_parameters(c, {"tokenizer_dir": "1/tokenizer", "skip_special_tokens": r.serving.skip_special_tokens})
    return c


def logits_type(engine_cfg: dict) -> str:
    """The Triton type of the logits tensors for an engine (its ``pretrained_config.logits_dtype``, float32 when
    the config names none, as TensorRT-LLM's runtime reads it)."""
    dtype = (engine_cfg.get("pretrained_config") or {}).get("logits_dtype") or "float32"
    if dtype not in LOGITS_TRITON_TYPE:
        raise ValueError(f"engine logits_dtype {dtype!r}: TensorRT-LLM allows {', '.join(LOGITS_TRITON_TYPE)}")
    return LOGITS_TRITON_TYPE[dtype]


def set_logits_type(config, triton_type: str) -> None:
    """Declare the logits outputs of a config with the engine's type (they must agree, or the backend returns
    garbage or asserts)."""
    for out in config.output:
        if out.name in LOGITS_TENSORS:
            out.data_type = mc.DataType.Value(triton_type)


def trtllm_config(r: Recipe, name: str, max_seq_len: int, engine_cfg: dict, kv_tokens: Optional[int] = None,
                  gpu_device_ids: Optional[str] = None):
    """The tensorrt_llm model: the C++ tensorrtllm backend (tensorrt) or kiln's CPU runtime (reference)."""
    up = MODELS["tensorrt_llm"]
    s = r.serving
    reference = r.target == "reference"
    c = base_config(name, r.engine.max_batch_size, list(up.inputs), list(up.outputs),
                    backend="python" if reference else "tensorrtllm")
    c.model_transaction_policy.decoupled = s.streaming
    c.dynamic_batching.max_queue_delay_microseconds = s.max_queue_delay_microseconds
    cpu_instances(c, 1)
    common = {
        "max_beam_width": r.engine.max_beam_width,
        "exclude_input_in_output": s.exclude_input_in_output,
        "enable_kv_cache_reuse": s.enable_kv_cache_reuse,
        "max_tokens_in_paged_kv_cache": min(c for c in (s.max_tokens_in_paged_kv_cache, kv_tokens) if c)
        if (s.max_tokens_in_paged_kv_cache or kv_tokens) else None,
        "cancellation_check_period_ms": 100,
    }
    if reference:
        add_prompt_scoring(c)
        b = engine_cfg["build_config"]
        ref_tokens = s.max_tokens_in_paged_kv_cache or b["max_batch_size"] * b["max_seq_len"]
        set_parameters(c, {**common,
                    "gpt_model_path": "1/engine",
                    "model_dir": "1/checkpoint", "modelopt_state": "modelopt_state.pth",
                    "tokenizer_dir": "1/checkpoint",
                    "dtype": r.model.dtype if r.model.dtype != "auto" else None,
                    "max_batch_size": b["max_batch_size"], "max_seq_len": b["max_seq_len"],
                    "max_num_tokens": b["max_num_tokens"], "tokens_per_block": b["plugin_config"]["tokens_per_block"],
                    "max_tokens_in_paged_kv_cache": ref_tokens,
                    "num_threads": s.cpu_threads})
    else:
        set_parameters(c, {**common,
                    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
                    "gpt_model_type": "inflight_fused_batching" if s.batching == "inflight_fused" else "V1",
                    "gpt_model_path": f"{CONTAINER_MODEL_ROOT}/{name}/1/engine",
                    "batch_scheduler_policy": s.scheduler_policy,
                    "kv_cache_free_gpu_mem_fraction": s.kv_cache_free_gpu_mem_fraction,
                    "kv_cache_host_memory_bytes": s.kv_cache_host_memory_bytes,
                    "enable_chunked_context": s.enable_chunked_context,
                    "gpu_device_ids": gpu_device_ids or (",".join(map(str, s.gpu_device_ids))
                                                         if s.gpu_device_ids else None),
                    "normalize_log_probs": True,
                    "stats_check_period_ms": 100,
                    "kv_cache_onboard_blocks": True,
                    "cuda_graph_mode": s.cuda_graphs,  # None (unset): the backend's default, off
                    "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
                    # read unguarded by the backend: they must exist; empty means guided decoding is off
                    "tokenizer_dir": "", "xgrammar_tokenizer_info_path": "", "guided_decoding_backend": ""})
        # upstream's parse leaves empty strings in place; _params skips None only
        for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
            c.parameters[key].string_value = ""
    set_logits_type(c, logits_type(engine_cfg))
    return c


#: kiln's prompt-scoring extension of the reference runtime's tensorrt_llm contract (the OpenAI server's echo /
#: loglikelihood requests; see the reference model's docstring): input -> outputs.
PROMPT_SCORING = ("return_prompt_log_probs", (("prompt_log_probs", "TYPE_FP32"), ("prompt_top_ids", "TYPE_INT32"),
                                              ("prompt_top_log_probs", "TYPE_FP32")))


def add_prompt_scoring(c) -> None:
    """Declare :data:`PROMPT_SCORING` on a reference or llmapi tensorrt_llm config (an optional input and three
    outputs)."""
    name, outputs = PROMPT_SCORING
    t = c.input.add(name=name, data_type=mc.TYPE_BOOL, dims=[1], optional=True)
    if c.max_batch_size > 0:  # Triton refuses an empty reshape on a non-batching model (the llmapi one)
        t.reshape.SetInParent()  # reshape: [ ] (a scalar per request), as upstream declares its flags
    for out, dtype in outputs:
        c.output.add(name=out, data_type=mc.DataType.Value(dtype), dims=[-1])


def ensemble_config(r: Recipe, trt_inputs: set[str], trt_outputs: set[str]):
    """pre → tensorrt_llm → post, keeping upstream's wiring for every tensor the models on each side have."""
    up = MODELS["ensemble"]
    have = {name: ({t.name for t in MODELS[name].inputs}, {t.name for t in MODELS[name].outputs})
            for name in ("preprocessing", "postprocessing")}
    have["tensorrt_llm"] = (trt_inputs, trt_outputs)
    ens_inputs = {t.name for t in up.inputs}
    available = set(ens_inputs)
    used_inputs: set[str] = set()
    steps = []
    for step in up.steps:
        m_in, m_out = have[step.model_name]
        imap = [(mt, et) for mt, et in step.input_map if mt in m_in and et in available]
        omap = [(mt, et) for mt, et in step.output_map if mt in m_out]
        used_inputs |= {et for _, et in imap if et in ens_inputs}
        available |= {et for _, et in omap}
        steps.append((step.model_name, imap, omap))
    produced = {et for _, _, omap in steps for _, et in omap}
    ins = [t for t in up.inputs if t.name in used_inputs]
    outs = [t for t in up.outputs if t.name in produced]
    c = base_config("ensemble", r.engine.max_batch_size, ins, outs, platform="ensemble")
    for model_name, imap, omap in steps:
        st = c.ensemble_scheduling.step.add()
        st.model_name = model_name
        st.model_version = -1
        for mt, et in imap:
            st.input_map[mt] = et
        for mt, et in omap:
            st.output_map[mt] = et
    _checked_by_preprocessing(c)
    return c


def bls_config(r: Recipe, draft_name: Optional[str]):
    up = MODELS["tensorrt_llm_bls"]
    c = base_config("tensorrt_llm_bls", r.engine.max_batch_size, list(up.inputs), list(up.outputs), backend="python")
    c.model_transaction_policy.decoupled = r.serving.streaming
    cpu_instances(c, r.serving.bls_instances)
    # accumulate_tokens false: streamed responses carry deltas (the model's default and upstream's; see its docstring)
    set_parameters(c, {"accumulate_tokens": False, "tensorrt_llm_model_name": "tensorrt_llm",
                "tensorrt_llm_draft_model_name": draft_name,
                "num_draft_tokens": r.engine.speculative.max_draft_len or None})
    return c


# ------------------------------------------------------------------------------------------------ writing


CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "config.json", CHAT_TEMPLATE_FILE)


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a tokenizer folder defines a chat template (chat_template.jinja, or tokenizer_config.json's key)."""
    if (tokenizer_dir / CHAT_TEMPLATE_FILE).is_file():
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))


def _copy_tokenizer(src: Path, dst: Path, chat_template: Optional[str] = None) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if chat_template is not None and not has_chat_template(dst):
        (dst / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")


#: Shipped beside every Python model's model.py (the backend puts the version directory on sys.path).
SHARED_MODEL_MODULES = ("kiln_triton_utils.py",)


def install_python_model(kind: str, dst: Path) -> list[Path]:
    """Copy kiln's Python model ``kind`` (a directory of :func:`models_source`) into model directory ``dst``.

    Writes ``dst/1/model.py``, every other ``.py`` file of the kind's directory (modules the model imports),
    and :data:`SHARED_MODEL_MODULES`, byte for byte. Returns the files written.
    """
    src = models_source()
    version = dst / "1"
    version.mkdir(parents=True, exist_ok=True)
    sources = sorted(p for p in (src / kind).glob("*.py") if p.name != "__init__.py")
    sources += [src / name for name in SHARED_MODEL_MODULES]
    written = []
    for path in sources:
        shutil.copy2(path, version / path.name)
        written.append(version / path.name)
    return written


def _write_config(dst: Path, config) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.pbtxt").write_text(render(config))


CHECK_SCRIPT = "kiln_check_engine.py"


def check_engine_script() -> Path:
    """The standalone script that compares the engine's versions with the serving environment's (kiln's runtime
    worker; shipped into every repository so launch.sh runs it in the container, where kiln is not installed)."""
    return Path(str(resources.files("kiln.runtime") / "workers" / "check_engine.py"))


def models_source() -> Path:
    """The directory holding kiln's Python models (``<kind>/model.py``) and the modules shipped beside them."""
    return Path(str(resources.files("kiln.triton") / "models"))


#: The recipe's serving.* keys kiln.json records under ``serving``: where `kiln serve REPO` serves the repository
#: (kiln.serve.session.serving_record reads them back; the schema holds their defaults).
SERVING_RECORD_KEYS = ("host", "http_port", "grpc_port", "metrics_port", "openai_port", "openai_model")


def serving_record(recipe: Recipe) -> dict[str, Any]:
    """kiln.json's ``serving``: the host and ports the recipe serves on (HTTP, gRPC, metrics, OpenAI) and the Triton
    model its OpenAI-compatible server calls; the one record of where this repository is served."""
    return {key: getattr(recipe.serving, key) for key in SERVING_RECORD_KEYS}


def write_repository(inp: RepoInputs, out: Path, max_seq_len: int, final: Optional[Path] = None) -> dict[str, Any]:
    """Write the whole repository into `out` (an empty directory, renamed to `final` when complete: kiln.json's
    server command names `final`, never the temporary directory). Returns the kiln.json content."""
    r = inp.recipe
    engine_cfg = json.loads((inp.engine_dir / "config.json").read_text())
    logits = logits_type(engine_cfg)

    pre = out / "preprocessing"
    _write_config(pre, preprocessing_config(r, max_seq_len))
    install_python_model("preprocessing", pre)
    _copy_tokenizer(inp.tokenizer_dir, pre / "1" / "tokenizer", inp.chat_template)

    post = out / "postprocessing"
    _write_config(post, postprocessing_config(r))
    install_python_model("postprocessing", post)
    _copy_tokenizer(inp.tokenizer_dir, post / "1" / "tokenizer", inp.chat_template)

    def write_llm(name: str, source: RepoInputs) -> Any:
        cfg = json.loads((source.engine_dir / "config.json").read_text())
        config = trtllm_config(source.recipe, name, max_seq_len, cfg, source.kv_tokens, source.gpu_device_ids)
        d = out / name
        _write_config(d, config)
        link_tree(source.engine_dir, d / "1" / "engine")
        if source.recipe.target == "reference":
            install_python_model("reference", d)
            assert source.checkpoint_dir is not None, "the reference target needs the quantized checkpoint"
            link_tree(source.checkpoint_dir, d / "1" / "checkpoint")
        return config

    trt = write_llm("tensorrt_llm", inp)
    draft_name = None
    if inp.draft is not None:
        draft_name = "tensorrt_llm_draft"
        write_llm(draft_name, inp.draft)

    ens = ensemble_config(r, {t.name for t in trt.input}, {t.name for t in trt.output})
    set_logits_type(ens, logits)
    _write_config(out / "ensemble", ens)
    (out / "ensemble" / "1").mkdir(exist_ok=True)

    bls = out / "tensorrt_llm_bls"
    bls_cfg = bls_config(r, draft_name)
    set_logits_type(bls_cfg, logits)
    _write_config(bls, bls_cfg)
    install_python_model("bls", bls)

    trtllm_version = inp.versions.get("tensorrt_llm")
    container = None
    if r.target == "tensorrt" and trtllm_version:
        container = inp.image or container_for(trtllm_version)
        if inp.image_digest and "@" not in container:
            container = f"{strip_digest(container)}@{inp.image_digest}"  # pinned: the image that built the engine
    shutil.copy2(check_engine_script(), out / CHECK_SCRIPT)
    from kiln.triton.deploy import DeployInfo, server_command

    world = r.parallelism.tp * r.parallelism.pp
    names = ("tensorrt_llm",) + ((draft_name,) if draft_name else ())
    root = CONTAINER_MODEL_ROOT if container else str(final or out)
    command = server_command(DeployInfo.from_recipe(r, container or "kiln-reference", draft_model_name=draft_name,
                                                    orchestrator=inp.orchestrator), root)
    info = {
        "kiln_repository_version": 2,
        "recipe": r.name,
        "fingerprint": inp.fingerprint,
        "target": r.target,
        "runtime": ("reference: PyTorch on CPU in a Triton Python model (a test and development vehicle, "
                    "not the fast path)") if r.target == "reference" else "tensorrt: TensorRT-LLM engine",
        "engine": {"tensorrt_llm": trtllm_version, "tensorrt": inp.versions.get("tensorrt"),
                   "image": inp.image, "image_digest": inp.image_digest,
                   "logits_dtype": (engine_cfg.get("pretrained_config") or {}).get("logits_dtype"),
                   "max_batch_size": engine_cfg["build_config"].get("max_batch_size"),
                   "max_input_len": engine_cfg["build_config"].get("max_input_len"),
                   "max_seq_len": engine_cfg["build_config"].get("max_seq_len"),
                   # whether the engine keeps prompt logits: the OpenAI server scores prompts (echo) only then
                   "gather_context_logits": bool(engine_cfg["build_config"].get("gather_context_logits", False))},
        "container": container,
        "streaming": r.serving.streaming,
        "world_size": world,
        "tensorrt_llm_models": list(names),
        "orchestrator": inp.orchestrator,
        "models": sorted(p.name for p in out.iterdir() if p.is_dir()),
        "server_command": command,
        "check_command": ["python3", f"{root}/{CHECK_SCRIPT}", root],
        "quality": inp.quality,
        "serving": serving_record(r),
    }
    (out / "kiln.json").write_text(json.dumps(info, indent=2))
    return info
