"""The CPU reference runtime of the llmapi model (a test and development vehicle) against the ModelOpt-restored model:
it loads the unified checkpoint itself, dequantizing what it must and never reading the ModelOpt state, and its
logits match the restored model's within a stated tolerance.

The default recipe's format (INT4 AWQ) is compared on the checkpoint the pipeline built, in test_pytorch_target.py.

Tolerance, relative to the largest |logit|:
- weight formats (INT4 AWQ, unquantized): 1e-5 — the dequantized weights are the fake-quantized ones exactly, only
  the order of float sums differs (measured: about 4e-7);
- formats with an FP8 activation step or an FP8 KV cache (FP8, W4A8 AWQ, FP8 KV): 1.7e-2 worst, 1.4e-3 mean — a
  value on an FP8 rounding boundary may round the other way, and which values sit there depends on the last bit of a
  float32 matmul, i.e. on the CPU's kernels. Measured for FP8 + FP8-KV: about 1e-6 on the machine this was first
  written on; 8.6e-3 worst / 6.2e-4 mean on an AVX-512 machine (torch's default kernel set there: q/k/v projections
  differ by one float32 ulp from ModelOpt's fake-quant linear, position 4 of "The quick brown fox…" then flips one
  FP8 step in layer 1 and later layers carry it), 7e-5 worst on the same machine with ATEN_CPU_CAPABILITY=default.
  Without the FP8 KV cache's rounding of keys and values (the defect this test is for) the case measures 3.5e-2
  worst and 3.3e-3 mean on the AVX-512 machine: the bounds sit at the geometric middle of the two (√(8.6e-3·3.5e-2),
  √(6.2e-4·3.3e-3)), so both catch the defect with the same factor of ~2 either way;
- the mean difference of the exact formats: 1e-4.
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
EXACT, FP8_STEP, MEAN, FP8_MEAN = 1e-5, 1.7e-2, 1e-4, 1.4e-3


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
    mean_bound = MEAN if tolerance == EXACT else FP8_MEAN
    assert max(mean) <= mean_bound, f"{fmt}+{kv}: mean |Δlogit| / max|logit| = {max(mean):.3g} > {mean_bound}"


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
