"""The quantize step: ModelOpt calibration of the recipe's model, then export.

Upstream's path (TensorRT-LLM ``examples/quantization/quantize.py``), with kiln's checks around it:

1. resolve and check the model directory and the calibration data (InputError before anything heavy);
2. load the model directly in the recipe dtype and save it, unquantized, as ``checkpoint/`` (a Hugging
   Face directory with the tokenizer): the baseline for the evaluate step and the base that the reference
   runtime restores the quantizers onto;
3. map the recipe to a ModelOpt config (:func:`build_quant_config`) and calibrate with
   ``mtq.quantize(model, cfg, forward_loop)``;
4. ``checkpoint/modelopt_state.pth`` via ``mto.save``; ``mto.restore(from_pretrained(checkpoint), path)``
   gives the calibrated fake-quant model back (``restore_check.safetensors`` holds a probe's logits so
   that consumers can verify this);
5. ``target: tensorrt``: ``trtllm_checkpoint/`` via ``export_tensorrt_llm_checkpoint`` (config.json +
   ``rank{N}.safetensors`` per tp×pp rank + ``tokenizer/``), and its ``quant_algo`` /
   ``kv_cache_quant_algo`` checked against what TensorRT-LLM 1.2 expects for the format;
   ``target: pytorch``: ``unified_checkpoint/`` via ``export_hf_checkpoint`` (ModelOpt's unified Hugging Face
   checkpoint, :mod:`kiln.steps.unified_export`), whose layer resmoothing runs right after calibration so that
   steps 4-5 and the quality gate see the exported numbers.

Every per-format fact (ModelOpt preset, expected ``quant_algo``, scale layout, calibration cap) comes from the
format registry (:mod:`kiln.recipe.formats`). Formats marked ``trtllm_quantizes_weights`` (the weight-only ones)
follow upstream's TensorRT-LLM path: the TensorRT-LLM checkpoint holds the unquantized weights with the
format's ``quant_algo`` and ``trtllm-build`` quantizes them per output channel; the fake-quant model kiln
evaluates and serves on the reference target uses the same per-channel symmetric scheme (the registry's
preset, with per-channel scales where it says ``modelopt_weight_scales: per_channel``), so the quality gate
measures what the engine runs.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import io
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from kiln.models.data import batches, content_hash, load_texts, tokenize_samples
from kiln.models.loading import (
    ModelInfo,
    check_model_dir,
    hf_progress_off,
    load_model,
    load_tokenizer,
    model_source_hash,
    resolve_dtype,
    resolve_model_dir,
    save_tokenizer,
)
from kiln.recipe.formats import kv_cache_format, registry, weight_format
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe, quantization_runtime
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.steps.runtime_jobs import (
    CHECKPOINT_DIR,
    MODELOPT_STATE,
    PROBE_TEXT,
    RESTORE_CHECK,
    TRTLLM_DIR,
    UNIFIED_DIR,
    runtime_identity,
)
from kiln.util.errors import InputError, KilnError

if TYPE_CHECKING:
    import torch

QUANT_RECORD = "kiln_quantization.json"

#: Tokens of the probe whose logits ``restore_check.safetensors`` records.
PROBE_TOKENS = 32


# --------------------------------------------------------------------------------------------- config


def _weight_quantizer_cfgs(cfg: dict) -> list[dict]:
    """The attribute dicts of the ``*weight_quantizer`` entry, in either config shape (dict-style
    ``quant_cfg`` in ModelOpt ~0.37, list of entries in 0.47); a sequential quantizer gives several."""
    entries = cfg["quant_cfg"]
    if isinstance(entries, dict):
        found = entries.get("*weight_quantizer")
    else:
        found = next((e.get("cfg") for e in entries
                      if e.get("quantizer_name") == "*weight_quantizer" and e.get("cfg") is not None), None)
    if found is None:
        raise KilnError("the installed ModelOpt's config has no '*weight_quantizer' entry; kiln supports "
                        "nvidia-modelopt 0.37 to 0.47")
    return list(found) if isinstance(found, (list, tuple)) else [found]


def _set_weight_quantizer(cfg: dict, attrs: dict) -> None:
    entries = cfg["quant_cfg"]
    if isinstance(entries, dict):
        entries["*weight_quantizer"] = attrs
        return
    for entry in entries:
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            entry["cfg"] = attrs


def _set_block_size(cfg: dict, block: int) -> None:
    attrs = _weight_quantizer_cfgs(cfg)[0]
    sizes = attrs.get("block_sizes")
    if not isinstance(sizes, dict):
        raise KilnError("the installed ModelOpt's INT4 config has no block_sizes to set")
    key = -1 if -1 in sizes or "-1" not in sizes else "-1"
    sizes[key] = block


def _disable_entries(cfg: dict, patterns: list[str]) -> None:
    """Append "disable these quantizers" entries (last entries win in both config shapes)."""
    entries = cfg.get("quant_cfg")
    if isinstance(entries, dict):
        for pattern in patterns:
            entries[pattern] = {"enable": False}
    else:
        entries.extend({"quantizer_name": p, "enable": False} for p in patterns)


def _modelopt_preset(mtq: Any, name: str, key: str, value: str) -> dict:
    preset = getattr(mtq, name, None)
    if preset is None:
        raise KilnError(f"the installed nvidia-modelopt has no {name} (needed for {key}: {value}); install "
                        "nvidia-modelopt 0.37 to 0.47")
    return preset


def kv_cache_config(kv: str, mtq: Any) -> Any:
    """The KV-cache quantizer entries of the registry's ModelOpt preset for KV-cache format ``kv``, in the
    installed ModelOpt's shape; with the registry's ``modelopt_num_bits`` (an INT8 KV cache: the FP8 preset's
    quantizers with 8-bit integers, as upstream's own INT8 KV config)."""
    fmt = kv_cache_format(kv)
    entries = copy.deepcopy(_modelopt_preset(mtq, str(fmt.modelopt_config), "quantization.kv_cache", kv)["quant_cfg"])
    bits = fmt.modelopt_num_bits
    if bits is None:
        return entries

    def with_bits(attrs: Any) -> Any:
        if isinstance(attrs, dict) and "num_bits" in attrs:
            return {**attrs, "num_bits": bits}
        return attrs

    if isinstance(entries, dict):
        return {k: with_bits(v) for k, v in entries.items() if k != "default"}
    return [{**e, "cfg": with_bits(e["cfg"])} if "cfg" in e else e for e in entries]


def _merge_kv(cfg: dict, kv_entries: Any) -> dict:
    """ModelOpt's own helper when present; otherwise the same merge by hand."""
    try:
        from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant
    except ImportError:  # pragma: no cover - older ModelOpt
        update_quant_cfg_with_kv_cache_quant = None
    if update_quant_cfg_with_kv_cache_quant is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the whole config
            return update_quant_cfg_with_kv_cache_quant(cfg, kv_entries)
    merged = copy.deepcopy(cfg)  # pragma: no cover
    if isinstance(kv_entries, dict):  # pragma: no cover
        merged["quant_cfg"] = merged.get("quant_cfg") or {"default": {"enable": False}}
        merged["quant_cfg"].update(kv_entries)
    else:  # pragma: no cover
        merged["quant_cfg"] = (merged.get("quant_cfg") or [{"quantizer_name": "*", "enable": False}]) + kv_entries
    merged["algorithm"] = merged.get("algorithm") or "max"  # pragma: no cover
    return merged  # pragma: no cover


def exclude_patterns(modules: tuple[str, ...]) -> list[str]:
    """Recipe module patterns (fnmatch on module names) → quantizer-name patterns."""
    return [p if p.endswith("*") else f"{p}.*" for p in modules]


def build_quant_config(recipe: Recipe) -> Optional[dict]:
    """The ModelOpt quantization config for a recipe, or None when nothing is quantized.

    ModelOpt's presets are deep-copied before any edit. Handles both config shapes (dict-style
    ``quant_cfg`` in ModelOpt ~0.37, a list of entries in 0.47).
    """
    import modelopt.torch.quantization as mtq

    q = recipe.quantization
    if not needs_calibration(recipe):
        return None
    fmt = weight_format(q.format)
    if fmt.modelopt_config is None:
        cfg: dict = {"quant_cfg": None, "algorithm": None}
    else:
        cfg = copy.deepcopy(_modelopt_preset(mtq, fmt.modelopt_config, "quantization.format", q.format))
        if fmt.calibration.algorithm == "smoothquant":
            cfg["algorithm"] = {"method": "smoothquant", "alpha": q.smoothquant_alpha}
        if fmt.uses_awq_block_size:
            _set_block_size(cfg, q.awq_block_size)
        if fmt.modelopt_weight_scales == "per_channel":
            # TensorRT-LLM quantizes these weights per output channel: use the same scales in the fake-quant
            # model (the preset's bit width, block scales replaced by per-channel ones).
            attrs = {k: v for k, v in _weight_quantizer_cfgs(cfg)[0].items() if k != "block_sizes"}
            _set_weight_quantizer(cfg, {**attrs, "axis": 0})
    if kv_cache_format(q.kv_cache).modelopt_config is not None:
        cfg = _merge_kv(cfg, kv_cache_config(q.kv_cache, mtq))
    if q.exclude_modules:
        _disable_entries(cfg, exclude_patterns(q.exclude_modules))
    return cfg


# --------------------------------------------------------------------------------------------- checks


def calib_sample_count(recipe: Recipe) -> int:
    """Calibration samples used: the recipe's, capped where the registry says (AWQ: as upstream)."""
    samples = recipe.quantization.calibration.samples
    cap = weight_format(recipe.quantization.format).calibration.max_samples
    return samples if cap is None else min(samples, cap)


def needs_calibration(recipe: Recipe) -> bool:
    q = recipe.quantization
    return (weight_format(q.format).modelopt_config is not None
            or kv_cache_format(q.kv_cache).modelopt_config is not None)


def _check_device(recipe: Recipe) -> None:
    import torch

    fmt = weight_format(recipe.quantization.format)
    if fmt.fake_quant_needs_cuda is not None and not torch.cuda.is_available():
        on_cpu = [f.name for f in registry().weight_formats.values()
                  if f.modelopt_config is not None and f.fake_quant_needs_cuda is None]
        raise InputError(f"quantization.format: {fmt.name} calibration needs a CUDA GPU "
                         f"({fmt.fake_quant_needs_cuda.why}) and this machine has none; quantize on a GPU "
                         f"machine, or pick a format that calibrates on the CPU ({', '.join(on_cpu)})")


def _module_names(info: ModelInfo) -> list[str]:
    """Module names of the model's weights, from the safetensors headers (no weights read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in info.weight_files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(k.rsplit(".", 1)[0] for k in handle.keys())
    return sorted(names)


def _check_excludes(recipe: Recipe, info: ModelInfo, ctx: StepContext) -> None:
    """Warn about exclude patterns that match nothing; refuse ones TensorRT-LLM cannot honour."""
    q = recipe.quantization
    modules = _module_names(info)
    for pattern in q.exclude_modules:
        matched = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
        if not matched and pattern != "lm_head":
            ctx.log(f"  warning: quantization.exclude_modules: {pattern!r} matches no module of the model "
                    f"(e.g. {modules[len(modules) // 2] if modules else '-'}); it has no effect")
        fmt = weight_format(q.format)
        if recipe.target == "tensorrt" and fmt.trtllm_quantizes_weights and any(m != "lm_head" for m in matched):
            exported = [f.name for f in registry().weight_formats.values()
                        if f.modelopt_config is not None and not f.trtllm_quantizes_weights]
            raise InputError(f"quantization.exclude_modules: {pattern!r} cannot be honoured with {q.format} on "
                             f"target tensorrt: TensorRT-LLM quantizes {fmt.label} itself at build time, every "
                             f"attention and MLP layer; remove the pattern, or use {' / '.join(exported)}, which "
                             "ModelOpt exports with per-layer exclusions")


def _check_parallelism(recipe: Recipe, info: ModelInfo) -> None:
    if recipe.target not in ("tensorrt", "pytorch"):
        return
    tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
    heads, layers = info.num_attention_heads, info.num_hidden_layers
    if heads and heads % tp:
        raise InputError(f"parallelism.tp: {tp} does not divide the model's {heads} attention heads; "
                         f"use a divisor of {heads}")
    if layers and pp > layers:
        raise InputError(f"parallelism.pp: {pp} pipeline stages for a model of {layers} layers; use at most {layers}")


# --------------------------------------------------------------------------------------------- hashes


def quantize_input_hashes(loaded: LoadedRecipe) -> dict[str, str]:
    """Content hashes of the step's external inputs: the model (and tokenizer) and the calibration data."""
    recipe = loaded.recipe
    hashes = {"model": model_source_hash(recipe.model.source)}
    if recipe.model.tokenizer:
        hashes["tokenizer"] = model_source_hash(recipe.model.tokenizer, key="model.tokenizer")
    if needs_calibration(recipe):
        hashes["calibration"] = content_hash(recipe.quantization.calibration)
    return hashes


# --------------------------------------------------------------------------------------------- step


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """ModelOpt prints configs and per-rank chatter to stdout; keep kiln's output readable."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _forward_loop(batch_list: list[dict], ctx: StepContext) -> Callable[[Any], None]:
    import torch

    def loop(model: Any) -> None:
        device = next(model.parameters()).device
        with torch.no_grad():
            for batch in ctx.track(batch_list, "calibrating", total=len(batch_list)):
                model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)

    return loop


def _probe_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    import torch

    with torch.no_grad():
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()


class QuantizeResult(StepResult):
    """What was quantized and how: the format, the checkpoint formats written, and the time each phase took."""

    format: str
    kv_cache: str
    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    dtype: str
    calib_samples: int
    calib_data: Optional[str]
    params: int
    checkpoint: str
    trtllm_checkpoint: Optional[str]
    unified_checkpoint: Optional[str] = None
    """Target pytorch: ModelOpt's unified Hugging Face checkpoint (what TensorRT-LLM's PyTorch backend loads)."""
    load_seconds: float
    calib_seconds: float
    export_seconds: float
    seconds: float
    produced_by: dict[str, Optional[str]] = {}
    """Which ModelOpt, in which environment, produced the checkpoint: `environment` (`host`, or the engine
    runtime's image/interpreter), `modelopt`, `tensorrt_llm` (engine runtime only), `device`."""


def host_environment() -> dict[str, Optional[str]]:
    """kiln's own environment, for ``produced_by``."""
    from importlib import metadata

    import torch

    return {"environment": "host (kiln's environment)", "modelopt": metadata.version("nvidia-modelopt"),
            "tensorrt_llm": None,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def quantize(ctx: StepContext) -> QuantizeResult:
    """Calibrate and export the recipe's model into ``ctx.out_dir`` (see the module docstring)."""
    if quantization_runtime(ctx.recipe) == "engine":
        from kiln.steps.quantize_runtime import quantize_in_runtime

        return quantize_in_runtime(ctx)
    started = time.perf_counter()
    recipe = ctx.recipe
    q = recipe.quantization
    calib = q.calibration

    # ---- cheap checks first: everything the user can get wrong fails here, before any weights load
    _check_device(recipe)
    model_dir = resolve_model_dir(recipe.model.source, recipe.model.trust_remote_code,
                                  progress=ctx.show_progress)
    tok_dir = (resolve_model_dir(recipe.model.tokenizer, recipe.model.trust_remote_code, key="model.tokenizer")
               if recipe.model.tokenizer else None)
    info = check_model_dir(model_dir, tokenizer_dir=tok_dir)
    _check_parallelism(recipe, info)
    _check_excludes(recipe, info, ctx)
    dtype = resolve_dtype(recipe.model.dtype, info.config)
    tokenizer = load_tokenizer(tok_dir or model_dir, recipe.model.trust_remote_code)
    samples: list = []
    data_hash = None
    if needs_calibration(recipe):
        texts = load_texts(calib, "quantization.calibration")
        samples = tokenize_samples(texts, tokenizer, calib_sample_count(recipe), calib.max_seq_len, calib.seed,
                                   key="quantization.calibration", min_tokens=1)
        data_hash = content_hash(calib)
    quant_cfg = build_quant_config(recipe)

    # ---- heavy work
    import torch

    torch.manual_seed(calib.seed)
    out = Path(ctx.out_dir)
    ckpt = out / CHECKPOINT_DIR
    ctx.log(f"  model {info.architecture} ({info.parameters / 1e6:.1f}M parameters) from {model_dir}, {dtype}")
    t0 = time.perf_counter()
    with ctx.status(f"loading the model ({dtype})"):
        model = load_model(model_dir, dtype, recipe.model.trust_remote_code)
        with hf_progress_off():
            model.save_pretrained(str(ckpt))
        save_tokenizer(tokenizer, ckpt)
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    if quant_cfg is not None:
        import modelopt.torch.quantization as mtq

        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        loop = _forward_loop(batches(samples, calib.batch_size, pad_id), ctx)
        ctx.log(f"  calibrating {q.format}" + (f" + {q.kv_cache} KV cache" if q.kv_cache != "none" else "")
                + f" on {len(samples)} samples × ≤{calib.max_seq_len} tokens")
        try:
            with quiet_stdout():
                model = mtq.quantize(model, quant_cfg, forward_loop=loop)
        except (RuntimeError, ValueError, AssertionError) as exc:
            raise KilnError(f"ModelOpt calibration failed for {q.format}: {str(exc).splitlines()[0]}") from exc
        if recipe.target == "pytorch":
            from kiln.steps.unified_export import resmooth

            with quiet_stdout():
                resmooth(model)
    calib_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    import modelopt.torch.opt as mto
    from safetensors.torch import save_file

    probe = (samples[0] if samples else torch.tensor(
        tokenizer(PROBE_TEXT)["input_ids"]))[:PROBE_TOKENS][None, :]
    save_file({"input_ids": probe.contiguous(), "logits": _probe_logits(model, probe).contiguous()},
              str(out / RESTORE_CHECK))
    mto.save(model, str(ckpt / MODELOPT_STATE))

    quant_algo = weight_format(q.format).quant_algo
    kv_algo = kv_cache_format(q.kv_cache).kv_cache_quant_algo
    if recipe.target == "tensorrt":
        quant_algo, kv_algo = export_trtllm(model, recipe, info, dtype, tokenizer, out / TRTLLM_DIR)
    elif recipe.target == "pytorch":
        from kiln.steps.unified_export import export_unified

        quant_algo, kv_algo = export_unified(model, dtype, tokenizer, out / UNIFIED_DIR, q.format, q.kv_cache)
    export_s = time.perf_counter() - t0

    record = {
        "format": q.format, "kv_cache": q.kv_cache, "quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo,
        "dtype": dtype, "architecture": info.architecture, "exclude_modules": list(q.exclude_modules),
        "smoothquant_alpha": q.smoothquant_alpha if weight_format(q.format).calibration.algorithm == "smoothquant"
        else None,
        "block_size": q.awq_block_size if weight_format(q.format).uses_awq_block_size else None,
        "calib_samples": len(samples), "calib_data": data_hash, "modelopt_state": MODELOPT_STATE,
        "produced_by": host_environment(),
        "export": ("modelopt.torch.export.export_hf_checkpoint (unified Hugging Face checkpoint)"
                   if recipe.target == "pytorch" else "modelopt.torch.export.export_tensorrt_llm_checkpoint"
                   if recipe.target == "tensorrt" else None),
    }
    (ckpt / QUANT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    del model  # refcounting frees it; a full gc.collect() here costs more than a small model's calibration
    label = q.format + (f" + {q.kv_cache} KV" if q.kv_cache != "none" else "")
    return QuantizeResult(
        summary=f"{label} (quant_algo {quant_algo}), {len(samples)} calibration samples, {info.parameters:,} params",
        format=q.format, kv_cache=q.kv_cache, quant_algo=quant_algo, kv_cache_quant_algo=kv_algo, dtype=dtype,
        calib_samples=len(samples), calib_data=data_hash, params=info.parameters, checkpoint=CHECKPOINT_DIR,
        trtllm_checkpoint=TRTLLM_DIR if recipe.target == "tensorrt" else None,
        unified_checkpoint=UNIFIED_DIR if recipe.target == "pytorch" else None,
        load_seconds=round(load_s, 3), calib_seconds=round(calib_s, 3), export_seconds=round(export_s, 3),
        seconds=round(time.perf_counter() - started, 3), produced_by=record["produced_by"],
    )


# --------------------------------------------------------------------------------------------- export


def export_trtllm(model: Any, recipe: Recipe, info: ModelInfo, dtype: str, tokenizer: Any,
                  export_dir: Path) -> tuple[Optional[str], Optional[str]]:
    """Write the TensorRT-LLM checkpoint and check it; returns (quant_algo, kv_cache_quant_algo)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from kiln.models.loading import torch_dtype

    q = recipe.quantization
    fmt = weight_format(q.format)
    tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
    if fmt.trtllm_quantizes_weights:
        # Upstream's weight-only path: unquantized weights, TensorRT-LLM quantizes them at build time.
        mtq.disable_quantizer(model, "*weight_quantizer")
        mtq.disable_quantizer(model, "*input_quantizer")
    try:
        with quiet_stdout():
            export_tensorrt_llm_checkpoint(model, decoder_type=info.decoder_type, dtype=torch_dtype(dtype),
                                           export_dir=str(export_dir), inference_tensor_parallel=tp,
                                           inference_pipeline_parallel=pp)
    except (RuntimeError, ValueError, AssertionError, KeyError, NotImplementedError) as exc:
        raise KilnError(f"ModelOpt's TensorRT-LLM export failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    config_path = export_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    quant = config.setdefault("quantization", {})
    if fmt.trtllm_quantizes_weights:
        quant["quant_algo"] = fmt.quant_algo
    fix_rope(config, info.config)
    config_path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    save_tokenizer(tokenizer, export_dir / "tokenizer")
    return check_trtllm_checkpoint(export_dir, q.format, q.kv_cache, tp * pp)


def hf_rope(hf_config: dict) -> tuple[Optional[float], Optional[dict]]:
    """(rope theta, rope scaling without theta or None for plain RoPE) from a config.json written by
    transformers 4 (``rope_theta`` + ``rope_scaling``) or 5 (``rope_parameters``)."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    params = params if isinstance(params, dict) else {}
    theta = hf_config.get("rope_theta", params.get("rope_theta"))
    rope_type = params.get("rope_type") or params.get("type")
    scaling = None
    if rope_type and rope_type != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling.setdefault("type", rope_type)
    return (float(theta) if theta is not None else None), scaling


def fix_rope(trt_config: dict, hf_config: dict) -> None:
    """Carry RoPE settings into the TensorRT-LLM config. ModelOpt 0.47 reads ``rope_theta`` /
    ``rope_scaling`` attributes that transformers 5 moved into ``rope_parameters``: without this the
    checkpoint silently falls back to base 10000 and no scaling (wrong for Llama 3.x)."""
    theta, scaling = hf_rope(hf_config)
    if theta is not None:
        trt_config["rotary_base"] = theta
    current = trt_config.get("rotary_scaling")
    if scaling is not None:
        trt_config["rotary_scaling"] = scaling
    elif isinstance(current, dict) and (current.get("rope_type") or current.get("type")) in (None, "default"):
        trt_config["rotary_scaling"] = None


def check_trtllm_checkpoint(export_dir: Path, fmt: str, kv: str,
                            world_size: int) -> tuple[Optional[str], Optional[str]]:
    """The exported checkpoint's (quant_algo, kv_cache_quant_algo), after checking that they are what
    TensorRT-LLM 1.2 expects for the recipe's format and that every rank's weights are there."""
    config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization") or {}
    got_algo, got_kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    want_algo, want_kv = weight_format(fmt).quant_algo, kv_cache_format(kv).kv_cache_quant_algo
    valid = registry().trtllm_quant_algos
    problems = []
    if got_algo != want_algo:
        problems.append(f"quant_algo is {got_algo!r}, TensorRT-LLM 1.2 expects {want_algo!r} for {fmt}")
    elif got_algo is not None and got_algo not in valid.quant_algos:
        problems.append(f"quant_algo {got_algo!r} is not one TensorRT-LLM 1.2 accepts")
    if got_kv != want_kv:
        problems.append(f"kv_cache_quant_algo is {got_kv!r}, TensorRT-LLM 1.2 expects {want_kv!r} for KV cache {kv}")
    elif got_kv is not None and got_kv not in valid.kv_cache_quant_algos:
        problems.append(f"kv_cache_quant_algo {got_kv!r} is not one TensorRT-LLM 1.2 accepts")
    mapping = config.get("mapping") or {}
    if mapping.get("world_size") != world_size:
        problems.append(f"mapping.world_size is {mapping.get('world_size')}, expected {world_size} (tp × pp)")
    missing = [f"rank{r}.safetensors" for r in range(world_size) if not (export_dir / f"rank{r}.safetensors").is_file()]
    if missing:
        problems.append("missing " + ", ".join(missing))
    if problems:
        raise KilnError(f"the exported TensorRT-LLM checkpoint {export_dir} is not what TensorRT-LLM 1.2 expects: "
                        + "; ".join(problems) + ". This is a ModelOpt/kiln mismatch: report it with "
                        "`pip show nvidia-modelopt`")
    return got_algo, got_kv


def required_files(recipe: Recipe) -> tuple[str, ...]:
    """Files a complete quantize output holds: the checkpoint with its ModelOpt state and record, the restore
    probe, and for target tensorrt the TensorRT-LLM checkpoint's config and every rank's weights."""
    files = (f"{CHECKPOINT_DIR}/config.json", f"{CHECKPOINT_DIR}/{MODELOPT_STATE}", f"{CHECKPOINT_DIR}/{QUANT_RECORD}",
             RESTORE_CHECK)
    if recipe.target == "tensorrt":
        ranks = recipe.parallelism.tp * recipe.parallelism.pp
        files += (f"{TRTLLM_DIR}/config.json",) + tuple(f"{TRTLLM_DIR}/rank{r}.safetensors" for r in range(ranks))
    elif recipe.target == "pytorch":
        from kiln.steps.unified_export import unified_files

        files += unified_files(recipe.quantization.format, recipe.quantization.kv_cache)
    return files


def describe(loaded: LoadedRecipe, build_root: Path = Path("build")) -> list[str]:
    """Lines for --dry-run (in the engine runtime: the exact command line)."""
    r = loaded.recipe
    q = r.quantization
    if quantization_runtime(r) == "engine":
        from kiln.steps.quantize_runtime import describe_in_runtime

        return describe_in_runtime(loaded, build_root)
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    name = fmt.modelopt_config or "no weight quantization"
    if fmt.modelopt_weight_scales == "per_channel":
        name += f" with per-channel scales (TensorRT-LLM {fmt.quant_algo})"
    elif fmt.uses_awq_block_size:
        name += f", block {q.awq_block_size}"
    lines = [f"ModelOpt {name}"
             + (f" + {kv.label}" if kv.modelopt_config is not None else "")
             + (f", {calib_sample_count(r)} calibration samples from {q.calibration.dataset}"
                if needs_calibration(r) else "")]
    if r.target == "tensorrt":
        lines.append(f"export_tensorrt_llm_checkpoint(tp={r.parallelism.tp}, pp={r.parallelism.pp}) → "
                     f"quant_algo {fmt.quant_algo}, kv_cache_quant_algo {kv.kv_cache_quant_algo}")
    elif r.target == "pytorch":
        lines.append(f"export_hf_checkpoint (kiln's ModelOpt) → {UNIFIED_DIR}/ with hf_quant_config.json: quant_algo "
                     f"{fmt.quant_algo}, kv_cache_quant_algo {kv.kv_cache_quant_algo}")
    return lines


SPEC = StepSpec(
    name="quantize",
    fn=quantize,
    result=QuantizeResult,
    keys=("model", "quantization", "parallelism", "target"),
    tools=("nvidia-modelopt", "torch", "transformers"),
    input_hashes=quantize_input_hashes,
    runtime=runtime_identity("quantize"),
    describe=describe,
    files=required_files,
)
