"""The quantize step in the engine runtime (``quantization.runtime: engine``, the default for target tensorrt).

kiln checks everything it can on the host first (the model directory, the calibration data, tp/pp against the
model) and chooses the calibration texts (the same seeded, hashed choice as the host path). Then the quantize
worker runs in the engine runtime: TensorRT-LLM's own ``quantize_and_export`` calibrates on the GPU with the
ModelOpt TensorRT-LLM was made with and exports the checkpoint ``trtllm-build`` reads; the worker also saves the
calibrated quantizers and a probe's logits, which the evaluate step restores and grades in the same runtime.

The output has the host path's shape: ``checkpoint/`` (the unquantized model, hard-linked from its source, its
tokenizer, ``modelopt_state.pth`` and kiln's record), ``restore_check.safetensors``, ``trtllm_checkpoint/``
(config.json, one rank*.safetensors per tp×pp rank, the tokenizer), plus ``job/`` (what the worker was told and
what it reported) and ``logs/``.

Target pytorch runs the unified-checkpoint worker instead (``export_hf.py``: the image's ModelOpt calibrates and
writes ``unified_checkpoint/``, ModelOpt's unified Hugging Face checkpoint), with the same calibration texts, the
same saved quantizers and the same evaluation in the runtime.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path

from kiln.models.data import content_hash, load_texts, select_texts
from kiln.models.loading import check_model_dir, load_tokenizer, resolve_dtype, resolve_model_dir
from kiln.recipe.formats import kv_cache_format, weight_format
from kiln.recipe.loader import LoadedRecipe
from kiln.runtime.engine_runtime import ContainerRuntime, engine_runtime_for
from kiln.steps.base import StepContext
from kiln.steps.quantize import (
    QUANT_RECORD,
    QuantizeResult,
    _check_excludes,
    _check_parallelism,
    calib_sample_count,
    check_trtllm_checkpoint,
    needs_calibration,
)
from kiln.steps.runtime_jobs import (
    CHECKPOINT_DIR,
    TRTLLM_DIR,
    UNIFIED_DIR,
    export_hf_job,
    export_hf_job_file,
    model_path,
    quantize_job,
    quantize_job_file,
    quantize_mounts,
    worker_placement,
    write_job_file,
)
from kiln.util.errors import InputError, KilnError

#: Files of a Hugging Face model directory kiln hard-links into ``checkpoint/`` (weights, config, tokenizer).
_MODEL_FILES = (".json", ".safetensors", ".model", ".txt", ".py", ".jinja", ".tiktoken")


def _link_model(src: Path, dst: Path) -> None:
    """The unquantized model beside the quantizers, by hard link (no extra disk; hub snapshots are symlinks,
    followed). Plain copies where links are impossible."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if not path.is_file() or not path.name.endswith(_MODEL_FILES):
            continue
        real = path.resolve()
        try:
            os.link(real, dst / path.name)
        except OSError:
            shutil.copy2(real, dst / path.name)


def quantize_in_runtime(ctx: StepContext) -> QuantizeResult:
    started = time.perf_counter()
    recipe = ctx.recipe
    q = recipe.quantization
    if not needs_calibration(recipe):
        raise InputError("quantization.runtime: engine with quantization.format: none and kv_cache: none has "
                         "nothing to calibrate; set quantization.runtime: host (kiln writes the unquantized "
                         "checkpoint itself)")
    # ---- cheap checks on the host first
    model_dir = resolve_model_dir(recipe.model.source, recipe.model.trust_remote_code, progress=ctx.show_progress)
    if recipe.model.tokenizer:
        raise InputError("model.tokenizer: TensorRT-LLM's quantizer reads the tokenizer from the model directory; "
                         "put the tokenizer there, or use quantization.runtime: host")
    info = check_model_dir(model_dir)
    _check_parallelism(recipe, info)
    _check_excludes(recipe, info, ctx)
    dtype = resolve_dtype(recipe.model.dtype, info.config)
    tokenizer = load_tokenizer(model_dir, recipe.model.trust_remote_code)
    samples = calib_sample_count(recipe)
    texts = select_texts(load_texts(q.calibration, "quantization.calibration"), tokenizer, samples,
                         q.calibration.max_seq_len, q.calibration.seed, key="quantization.calibration", min_tokens=1)
    out = Path(ctx.out_dir)
    calib_dir = out / "job" / "calib"
    calib_dir.mkdir(parents=True)
    with open(calib_dir / "train.jsonl", "w", encoding="utf-8") as fh:  # `datasets` reads it as split train
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")

    # ---- the worker, in the engine runtime
    rt = engine_runtime_for(recipe, ctx.build_root)
    mounts = quantize_mounts(model_dir, calib_dir, out)
    unified = recipe.target == "pytorch"
    name = "export_hf" if unified else "quantize"
    job = export_hf_job(rt, mounts) if unified else quantize_job(rt, mounts)
    paths = {**rt.paths(job), "model": model_path(rt.paths(job), model_dir)}  # a hub snapshot: inside its repo
    content = (export_hf_job_file if unified else quantize_job_file)(recipe, paths, len(texts), dtype,
                                                                      worker_placement(ctx.loaded))
    write_job_file(out / "job", name, content)
    ctx.log("  " + shlex.join(rt.command(job)))
    with ctx.status(f"calibrating {q.format} with " + ("the image's ModelOpt" if unified
                                                       else "TensorRT-LLM's quantizer")) as update:
        rt.run(job, out / "logs" / f"{name}.log", update)
    try:
        report = json.loads((out / "job" / f"{name}.result.json").read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(f"the {name} worker wrote no report ({exc}); see {out / 'logs' / f'{name}.log'}") from None

    # ---- the output's host side: the unquantized model beside the quantizers, checks, kiln's record
    _link_model(model_dir, out / CHECKPOINT_DIR)
    world = recipe.parallelism.tp * recipe.parallelism.pp
    if unified:
        from kiln.steps.unified_export import check_unified_checkpoint

        quant_algo, kv_algo = check_unified_checkpoint(out / UNIFIED_DIR, q.format, q.kv_cache)
    else:
        quant_algo, kv_algo = check_trtllm_checkpoint(out / TRTLLM_DIR, q.format, q.kv_cache, world)
    packages = report.get("packages", {})
    produced_by = {
        "environment": (f"engine runtime: {rt.image}" if isinstance(rt, ContainerRuntime) else rt.describe()),
        "image_digest": rt.digest() if isinstance(rt, ContainerRuntime) else None,
        "modelopt": packages.get("nvidia-modelopt"), "tensorrt_llm": packages.get("tensorrt_llm"),
        "device": report.get("device"),
    }
    fmt = weight_format(q.format)
    record = {
        "format": q.format, "kv_cache": q.kv_cache, "quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo,
        "dtype": dtype, "architecture": info.architecture, "exclude_modules": list(q.exclude_modules),
        "smoothquant_alpha": q.smoothquant_alpha if fmt.calibration.algorithm == "smoothquant" else None,
        "block_size": q.awq_block_size if fmt.uses_awq_block_size else None,
        "calib_samples": len(texts), "calib_data": content_hash(q.calibration),
        "modelopt_state": "modelopt_state.pth", "graded": report.get("state_from"), "produced_by": produced_by,
        "trtllm_qformat": fmt.trtllm_qformat, "trtllm_kv_cache_dtype": kv_cache_format(q.kv_cache).trtllm_kv_cache_dtype,
        "export": report.get("export", "tensorrt_llm.quantization.quantize_and_export"),
    }
    (out / CHECKPOINT_DIR / QUANT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    label = q.format + (f" + {q.kv_cache} KV" if q.kv_cache != "none" else "")
    seconds = round(time.perf_counter() - started, 3)
    return QuantizeResult(
        summary=f"{label} (quant_algo {quant_algo}) " + (
            f"unified checkpoint by the image's ModelOpt {produced_by['modelopt']} (TensorRT-LLM "
            f"{produced_by['tensorrt_llm']})" if unified else
            f"by TensorRT-LLM {produced_by['tensorrt_llm']} / ModelOpt {produced_by['modelopt']}")
        + f" in the engine runtime, {len(texts)} calibration samples",
        format=q.format, kv_cache=q.kv_cache, quant_algo=quant_algo, kv_cache_quant_algo=kv_algo, dtype=dtype,
        calib_samples=len(texts), calib_data=record["calib_data"], params=info.parameters, checkpoint=CHECKPOINT_DIR,
        trtllm_checkpoint=None if unified else TRTLLM_DIR, unified_checkpoint=UNIFIED_DIR if unified else None,
        load_seconds=0.0, calib_seconds=float(report.get("seconds") or 0.0),
        export_seconds=0.0, seconds=seconds, produced_by=produced_by)


def describe_in_runtime(loaded: LoadedRecipe, build_root: Path) -> list[str]:
    """--dry-run: the worker's command line and the TensorRT-LLM call it makes."""
    r = loaded.recipe
    q = r.quantization
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    rt = engine_runtime_for(r, build_root)
    out = build_root / r.name / "quantize"
    mounts = quantize_mounts(_model_dir_for_display(r), out / "job" / "calib", out)
    if r.target == "pytorch":
        return [f"the image's ModelOpt: {fmt.modelopt_config or 'no weight quantization'}"
                + (f" + {kv.label}" if kv.modelopt_config else "") + f", {calib_sample_count(r)} calibration samples, "
                f"export_hf_checkpoint → {UNIFIED_DIR}/ (quant_algo {fmt.quant_algo}, kv_cache_quant_algo "
                f"{kv.kv_cache_quant_algo})", "$ " + shlex.join(rt.command(export_hf_job(rt, mounts)))]
    job = quantize_job(rt, mounts)
    return [f"TensorRT-LLM quantize_and_export(qformat={fmt.trtllm_qformat}, kv_cache_dtype="
            f"{kv.trtllm_kv_cache_dtype}, calib_size={calib_sample_count(r)}, tp_size={r.parallelism.tp}, "
            f"pp_size={r.parallelism.pp}) → quant_algo {fmt.quant_algo}, kv_cache_quant_algo {kv.kv_cache_quant_algo}",
            "$ " + shlex.join(rt.command(job))]


def _model_dir_for_display(recipe) -> Path:
    """The model directory the worker will read, without building or downloading anything."""
    from kiln.models.tiny import tiny_llama_dir
    from kiln.recipe.schema import BUILTIN_PREFIX, HF_PREFIX

    source = recipe.model.source
    if source.startswith(BUILTIN_PREFIX):
        return tiny_llama_dir()
    if source.startswith(HF_PREFIX):
        repo, _, revision = source[len(HF_PREFIX):].partition("@")
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
        except Exception:  # noqa: BLE001 - not downloaded yet: name where it will be
            from huggingface_hub.constants import HF_HUB_CACHE

            return Path(HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))
    return Path(source)
