"""Target pytorch: ModelOpt's unified Hugging Face checkpoint, what TensorRT-LLM's PyTorch backend loads.

``unified_checkpoint/`` holds the quantized safetensors (packed INT4, FP8, … with their ``weight_scale`` /
``input_scale`` / ``pre_quant_scale`` tensors and the KV cache's ``k_scale`` / ``v_scale``), ``config.json`` with its
``quantization_config`` and ``hf_quant_config.json`` (the file the PyTorch backend reads the quantization from), and
the tokenizer. It is written by ModelOpt's ``export_hf_checkpoint``: on the host by kiln's ModelOpt (this module),
in the engine runtime by the image's (``kiln/runtime/workers/export_hf.py``); the quantize manifest records which.

ModelOpt's export first "resmooths" layers that read the same input (q/k/v, gate/up): it gives them one shared AWQ
pre-quant scale and one input amax and requantizes their weights. kiln runs that same ModelOpt function right after
calibration, before it saves the quantizers, the restore probe and grades quality, so that the ModelOpt-restored
model, the quality gate and the exported checkpoint are the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kiln.recipe.formats import kv_cache_format, weight_format
from kiln.steps.runtime_jobs import UNIFIED_DIR
from kiln.util.errors import KilnError

HF_QUANT_CONFIG = "hf_quant_config.json"


def resmooth(model: Any) -> None:
    """ModelOpt's own first export step, applied to the calibrated model (see the module docstring)."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)


def export_unified(model: Any, dtype: str, tokenizer: Any, export_dir: Path, fmt: str,
                   kv: str) -> tuple[Optional[str], Optional[str]]:
    """Write the unified checkpoint with kiln's ModelOpt and check it; returns (quant_algo, kv_cache_quant_algo).
    The model is left in ModelOpt's export state (its weights packed): call this last."""
    from modelopt.torch.export import export_hf_checkpoint

    from kiln.models.loading import save_tokenizer, torch_dtype
    from kiln.steps.quantize import quiet_stdout

    try:
        with quiet_stdout():
            export_hf_checkpoint(model, dtype=torch_dtype(dtype), export_dir=str(export_dir))
    except (RuntimeError, ValueError, AssertionError, KeyError, NotImplementedError) as exc:
        raise KilnError(f"ModelOpt's unified Hugging Face export failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    save_tokenizer(tokenizer, export_dir)
    return check_unified_checkpoint(export_dir, fmt, kv)


def read_quantization(export_dir: Path) -> dict:
    """The checkpoint's ``hf_quant_config.json`` ``quantization`` section ({} when unquantized: ModelOpt 0.47 writes
    no file then; 0.37 writes one with null algorithms)."""
    path = export_dir / HF_QUANT_CONFIG
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data.get("quantization") or {}


def check_unified_checkpoint(export_dir: Path, fmt: str, kv: str) -> tuple[Optional[str], Optional[str]]:
    """The exported checkpoint's (quant_algo, kv_cache_quant_algo) after checking that they are the format's (the
    registry's quant_algo, which the PyTorch backend reads from hf_quant_config.json) and that the weights and the
    config are there."""
    quant = read_quantization(export_dir)
    got_algo, got_kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    want_algo, want_kv = weight_format(fmt).quant_algo, kv_cache_format(kv).kv_cache_quant_algo
    problems = []
    if got_algo != want_algo:
        problems.append(f"quant_algo is {got_algo!r}, the {fmt} format is {want_algo!r}")
    if got_kv != want_kv:
        problems.append(f"kv_cache_quant_algo is {got_kv!r}, KV cache {kv} is {want_kv!r}")
    if (want_algo or want_kv) and not (export_dir / HF_QUANT_CONFIG).is_file():
        problems.append(f"no {HF_QUANT_CONFIG} (the PyTorch backend reads the quantization from it)")
    if not (export_dir / "config.json").is_file():
        problems.append("no config.json")
    if not any(export_dir.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    if problems:
        raise KilnError(f"the unified checkpoint {export_dir} is not what the recipe asks for: " + "; ".join(problems)
                        + ". This is a ModelOpt/kiln mismatch: report it with `pip show nvidia-modelopt`")
    return got_algo, got_kv


def unified_files(recipe_format: str, kv: str) -> tuple[str, ...]:
    """Files a complete unified checkpoint must hold (the weights' names depend on the size: checked by
    :func:`check_unified_checkpoint`)."""
    files = (f"{UNIFIED_DIR}/config.json",)
    if weight_format(recipe_format).quant_algo or kv_cache_format(kv).kv_cache_quant_algo:
        files += (f"{UNIFIED_DIR}/{HF_QUANT_CONFIG}",)
    return files
