"""The CPU reference runtime of the llmapi model (a test and development vehicle) against the ModelOpt-restored model:
it loads the unified checkpoint itself, dequantizing what it must and never reading the ModelOpt state, and its
logits match the restored model's within a stated tolerance.

The default recipe's format (INT4 AWQ) is compared on the checkpoint the pipeline built, in test_pytorch_target.py.

Tolerance, relative to the largest |logit|:
- weight formats (INT4 AWQ, unquantized): 1e-5 — the dequantized weights are the fake-quantized ones exactly, only
  the order of float sums differs (measured: about 4e-7);
- formats with an FP8 activation step or an FP8 KV cache (FP8, W4A8 AWQ, FP8 KV): 5e-3 — a value on an FP8 rounding
  boundary may round the other way (measured: about 1e-6, once 1.7e-3 with other calibration data);
- the mean difference, every format: 1e-4. Without the FP8 KV cache's rounding of keys and values the FP8 + FP8-KV
  case measures 2.6e-2 worst and 3e-3 mean: both bounds catch it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from kiln.recipe.loader import load_recipe
from kiln.triton.llmapi import dequantize_table
from kiln.triton.repository import models_source

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox jumps over the lazy dog", "# Copyright"]
TEXTS = ["The quick brown fox jumps over the lazy dog. def fibonacci(n): import os", "Beautiful is better than ugly."]
EXACT, FP8_STEP, MEAN = 1e-5, 5e-3, 1e-4


def reference_module():
    sys.path.insert(0, str(models_source() / "llmapi"))
    try:
        import kiln_llmapi_reference
    finally:
        sys.path.pop(0)
    return kiln_llmapi_reference


def quantize_both(tmp: Path, fmt: str, kv: str):
    """(the ModelOpt-restored model, the unified checkpoint's directory) for the tiny model in ``fmt`` + ``kv``,
    made as kiln's host quantize step makes them (its config, ModelOpt's resmoothing, mto.save, the export)."""
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    import torch

    from kiln.models.loading import load_model, load_tokenizer
    from kiln.models.tiny import ensure_tiny_llama
    from kiln.steps.quantize import build_quant_config
    from kiln.steps.unified_export import export_unified, resmooth

    src = ensure_tiny_llama(progress=False)
    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml",
                         ["target=pytorch", f"quantization.format={fmt}", f"quantization.kv_cache={kv}"]).recipe
    tokenizer = load_tokenizer(src, False)
    model = load_model(src, "float32", False)

    def loop(m):
        with torch.no_grad():
            for text in TEXTS:
                m(**tokenizer(text, return_tensors="pt"))

    config = build_quant_config(recipe)
    with contextlib.redirect_stdout(io.StringIO()):
        if config is not None:
            model = mtq.quantize(model, config, forward_loop=loop)
            resmooth(model)
        mto.save(model, str(tmp / "state.pth"))
        export_unified(model, "float32", tokenizer, tmp / "unified", fmt, kv)
        restored = load_model(src, "float32", False)
        mto.restore(restored, str(tmp / "state.pth"))
    return restored.eval(), tmp / "unified", tokenizer


@pytest.mark.parametrize("fmt, kv, tolerance", [
    ("none", "none", EXACT),
    ("fp8", "fp8", FP8_STEP),
    ("w4a8_awq", "none", FP8_STEP),
])
def test_reference_logits_match_the_modelopt_restored_model(tmp_path, fmt, kv, tolerance) -> None:
    import torch

    restored, unified, tokenizer = quantize_both(tmp_path, fmt, kv)
    ref = reference_module()
    model, quant = ref.load_unified_checkpoint(str(unified), "float32", dequantize_table())
    assert not (unified / "modelopt_state.pth").exists()  # it never sees the ModelOpt state
    assert quant.get("quant_algo") == {"int4_awq": "W4A16_AWQ", "none": None, "fp8": "FP8", "w4a8_awq": "W4A8_AWQ"}[fmt]
    worst, mean = 0.0, []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            want, got = restored(input_ids=ids).logits, model(input_ids=ids).logits
            scale = float(want.abs().max())
            worst = max(worst, float((want - got).abs().max()) / scale)
            mean.append(float((want - got).abs().mean()) / scale)
    assert worst <= tolerance, f"{fmt}+{kv}: max |Δlogit| / max|logit| = {worst:.3g} > {tolerance}"
    assert max(mean) <= MEAN, f"{fmt}+{kv}: mean |Δlogit| / max|logit| = {max(mean):.3g}"


def test_the_reference_refuses_what_it_cannot_dequantize(tmp_path) -> None:
    import json

    ref = reference_module()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(ref.ReferenceError, match="quant_algo NVFP4 is not one the CPU reference runtime runs"):
        ref.load_unified_checkpoint(str(tmp_path), layouts=dequantize_table())
    with pytest.raises(ref.ReferenceError, match="best_of=2"):
        ref.SamplingParams(best_of=2)
    assert ref.SamplingParams().greedy and not ref.SamplingParams(top_k=5).greedy
