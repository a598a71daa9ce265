"""The quantize and evaluate steps.

Fast tests: the recipe → ModelOpt config mapping (both config shapes), model-directory checks, the quality
gate, the exported-checkpoint check, and every bad input failing with an InputError before any weights load
and with nothing written. Integration tests (``-m integration``): real ModelOpt calibration and export of
the built-in tiny Llama for the default recipe and each CPU format, a valid TensorRT-LLM checkpoint, the
restored fake-quant model equal to the calibrated one, and a quality report per format.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest

from kiln.recipe.loader import LoadedRecipe, load_recipe, recipe_from_dict
from kiln.recipe.schema import Recipe
from kiln.steps.base import StepContext
from kiln.util.errors import InputError, KilnError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / "configs" / "tiny-llama.yaml"


def make_recipe(**sections: Any) -> Recipe:
    return recipe_from_dict({"name": "t", **sections})


def ctx_for(recipe: Recipe, out: Path, **kw: Any) -> StepContext:
    out.mkdir(parents=True, exist_ok=True)
    return StepContext(LoadedRecipe(recipe, None), out, show_progress=False, **kw)


def entries_of(cfg: dict) -> list[dict]:
    return cfg["quant_cfg"]


def last_entry(cfg: dict, name: str) -> dict:
    """The entry that wins for a quantizer pattern (later entries override earlier ones)."""
    return [e for e in entries_of(cfg) if e.get("quantizer_name") == name][-1]


# --------------------------------------------------------------------------------------------- config mapping


def test_no_quantization_means_no_config() -> None:
    from kiln.steps.quantize import build_quant_config

    assert build_quant_config(make_recipe(quantization={"format": "none"})) is None


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "nvfp4"])
def test_presets_are_copied_not_edited(fmt: str) -> None:
    import modelopt.torch.quantization as mtq

    from kiln.recipe.formats import weight_format
    from kiln.steps.quantize import build_quant_config

    preset = getattr(mtq, weight_format(fmt).modelopt_config)
    before = copy.deepcopy(preset)
    cfg = build_quant_config(make_recipe(quantization={"format": fmt, "kv_cache": "fp8", "awq_block_size": 64,
                                                       "exclude_modules": ["lm_head", "*.mlp.down_proj"]}))
    assert preset == before
    assert cfg is not preset and cfg["quant_cfg"] is not preset["quant_cfg"]
    assert last_entry(cfg, "lm_head.*") == {"quantizer_name": "lm_head.*", "enable": False}
    assert last_entry(cfg, "*.mlp.down_proj.*")["enable"] is False
    assert entries_of(cfg)[-1]["quantizer_name"] == "*.mlp.down_proj.*"  # exclusions come last: they win


def test_smoothquant_alpha_and_awq_block_size() -> None:
    from kiln.steps.quantize import build_quant_config

    sq = build_quant_config(make_recipe(quantization={"format": "int8_sq", "smoothquant_alpha": 0.8}))
    assert sq["algorithm"] == {"method": "smoothquant", "alpha": 0.8}
    awq = build_quant_config(make_recipe(quantization={"format": "int4_awq", "awq_block_size": 64}))
    assert last_entry(awq, "*weight_quantizer")["cfg"]["block_sizes"][-1] == 64
    w4a8 = build_quant_config(make_recipe(quantization={"format": "w4a8_awq", "awq_block_size": 64}))
    first, second = last_entry(w4a8, "*weight_quantizer")["cfg"]
    assert first["block_sizes"][-1] == 64 and first["num_bits"] == 4 and second["num_bits"] == (4, 3)


def test_int4_weight_only_uses_per_channel_scales_like_trtllm_w4a16() -> None:
    from kiln.steps.quantize import build_quant_config

    cfg = build_quant_config(make_recipe(quantization={"format": "int4_wo"}))
    attrs = last_entry(cfg, "*weight_quantizer")["cfg"]
    assert attrs["num_bits"] == 4 and attrs["axis"] == 0 and "block_sizes" not in attrs
    assert last_entry(cfg, "*input_quantizer")["enable"] is False


def test_kv_cache_configs() -> None:
    from kiln.steps.quantize import build_quant_config

    fp8 = build_quant_config(make_recipe(quantization={"format": "int4_awq", "kv_cache": "fp8"}))
    assert last_entry(fp8, "*[kv]_bmm_quantizer")["cfg"]["num_bits"] == (4, 3)
    int8 = build_quant_config(make_recipe(quantization={"format": "fp8", "kv_cache": "int8"}))
    assert last_entry(int8, "*[kv]_bmm_quantizer")["cfg"]["num_bits"] == 8
    kv_only = build_quant_config(make_recipe(quantization={"format": "none", "kv_cache": "fp8",
                                                           "exclude_modules": []}))
    assert kv_only["algorithm"] == "max"
    assert entries_of(kv_only)[0] == {"quantizer_name": "*", "enable": False}
    assert [e["quantizer_name"] for e in entries_of(kv_only)] == ["*", "*[kv]_bmm_quantizer"]


def test_dict_style_configs_of_older_modelopt() -> None:
    """ModelOpt ~0.37 (the release TensorRT-LLM 1.2 pins) keeps quant_cfg as a dict: the editing helpers
    must work on that shape too."""
    from kiln.steps import quantize as qz

    old_awq = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"},
                                                   "enable": True},
                             "*input_quantizer": {"enable": False}, "default": {"enable": False}},
               "algorithm": {"method": "awq_lite", "alpha_step": 0.1}}
    qz._set_block_size(old_awq, 64)
    assert old_awq["quant_cfg"]["*weight_quantizer"]["block_sizes"][-1] == 64
    qz._disable_entries(old_awq, ["lm_head.*"])
    assert list(old_awq["quant_cfg"])[-1] == "lm_head.*"

    class OldMtq:
        FP8_KV_CFG = {"quant_cfg": {"*[kv]_bmm_quantizer": {"num_bits": (4, 3), "axis": None, "enable": True},
                                    "default": {"enable": False}}, "algorithm": "max"}

    int8 = qz.kv_cache_config("int8", OldMtq)
    assert int8 == {"*[kv]_bmm_quantizer": {"num_bits": 8, "axis": None, "enable": True}}
    assert OldMtq.FP8_KV_CFG["quant_cfg"]["*[kv]_bmm_quantizer"]["num_bits"] == (4, 3)


def test_awq_calibration_is_capped_at_32_samples() -> None:
    from kiln.steps.quantize import calib_sample_count

    for fmt, want in (("int4_awq", 32), ("w4a8_awq", 32), ("fp8", 100), ("int8_sq", 100)):
        r = make_recipe(quantization={"format": fmt, "calibration": {"samples": 100}})
        assert calib_sample_count(r) == want


# --------------------------------------------------------------------------------------------- rope, checkpoint check


def test_rope_settings_reach_the_trtllm_config() -> None:
    from kiln.steps.quantize import fix_rope

    llama31 = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}}
    trt: dict = {}
    fix_rope(trt, llama31)
    assert trt["rotary_base"] == 500000.0
    assert trt["rotary_scaling"]["factor"] == 8.0 and trt["rotary_scaling"]["type"] == "llama3"
    assert "rope_theta" not in trt["rotary_scaling"]
    plain = {"rotary_scaling": {"rope_theta": 10000.0, "rope_type": "default"}}
    fix_rope(plain, {"rope_theta": 10000.0})  # transformers 4 layout
    assert plain == {"rotary_base": 10000.0, "rotary_scaling": None}


def _fake_export(d: Path, quant: dict, world: int = 1, ranks: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"mapping": {"world_size": world}, "quantization": quant}))
    for r in range(ranks):
        (d / f"rank{r}.safetensors").write_bytes(b"")
    return d


def test_exported_checkpoint_check(tmp_path: Path) -> None:
    from kiln.steps.quantize import check_trtllm_checkpoint

    ok = _fake_export(tmp_path / "ok", {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8"})
    assert check_trtllm_checkpoint(ok, "int4_awq", "fp8", 1) == ("W4A16_AWQ", "FP8")
    bad = _fake_export(tmp_path / "bad", {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None})
    with pytest.raises(KilnError) as info:
        check_trtllm_checkpoint(bad, "int4_wo", "int8", 1)
    msg = str(info.value)
    assert "expects 'W4A16' for int4_wo" in msg and "expects 'INT8'" in msg
    short = _fake_export(tmp_path / "short", {"quant_algo": "FP8", "kv_cache_quant_algo": None}, world=2, ranks=1)
    with pytest.raises(KilnError, match="missing rank1.safetensors"):
        check_trtllm_checkpoint(short, "fp8", "none", 2)


# --------------------------------------------------------------------------------------------- quality gate


def test_gate_message_says_by_how_much() -> None:
    from kiln.steps.evaluate import EvaluateResult, check_gate

    result = EvaluateResult(format="int4_awq", base_perplexity=12.1, quant_perplexity=14.93, ppl_increase_pct=23.39,
                            mean_kl=0.05)
    r = make_recipe(evaluation={"max_ppl_increase_pct": 10.0})
    msg = check_gate(r, result)
    assert msg is not None
    assert "perplexity rose 23.4% (12.10 → 14.93), gate is 10%" in msg
    assert "evaluation.max_ppl_increase_pct" in msg and "gentler format" in msg
    assert check_gate(make_recipe(evaluation={"max_ppl_increase_pct": 30.0}), result) is None
    kl = check_gate(make_recipe(evaluation={"max_ppl_increase_pct": None, "max_kl": 0.01}), result)
    assert kl is not None and "0.05" in kl and "evaluation.max_kl" in kl
    assert check_gate(r, EvaluateResult(skipped=True)) is None


def test_gate_reports_small_changes_with_enough_digits() -> None:
    from kiln.steps.evaluate import EvaluateResult, check_gate

    result = EvaluateResult(format="fp8", base_perplexity=10.0, quant_perplexity=10.016, ppl_increase_pct=0.16,
                            mean_kl=0.001)
    msg = check_gate(make_recipe(evaluation={"max_ppl_increase_pct": 0.05}), result)
    assert msg is not None and "rose 0.16%" in msg


# --------------------------------------------------------------------------------------------- model directories


@pytest.fixture(scope="module")
def tiny_random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama + word-level tokenizer made here (no download), for input checks."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("model")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def no_heavy_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the step gets as far as loading weights."""
    import kiln.steps.quantize as qz

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(qz, "load_model", refuse)


def run_bad(recipe: Recipe, tmp_path: Path) -> str:
    from kiln.steps.quantize import quantize

    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        quantize(ctx_for(recipe, out))
    assert not (out / "checkpoint").exists() and not (out / "trtllm_checkpoint").exists()
    assert list(out.iterdir()) == []
    return str(info.value)


def model_recipe(source: Path | str, **quant: Any) -> Recipe:
    return make_recipe(target="tensorrt", model={"source": str(source)},
                       quantization={"format": "int8_wo", "runtime": "host", **quant})


@pytest.mark.usefixtures("no_heavy_work")
def test_missing_model_dir(tmp_path: Path) -> None:
    msg = run_bad(model_recipe(tmp_path / "nope"), tmp_path)
    assert "model.source" in msg and "not found" in msg


@pytest.mark.usefixtures("no_heavy_work")
def test_model_source_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    assert "is a file, not a model directory" in run_bad(model_recipe(f), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_unreadable_config(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    (d / "config.json").write_text("{not json", encoding="utf-8")
    msg = run_bad(model_recipe(d), tmp_path)
    assert "config.json is not valid JSON" in msg


@pytest.mark.usefixtures("no_heavy_work")
def test_no_config(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    (d / "config.json").unlink()
    assert "has no config.json" in run_bad(model_recipe(d), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_corrupt_safetensors(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    msg = run_bad(model_recipe(d), tmp_path)
    assert "model.safetensors is corrupt or unreadable" in msg
    weights.write_bytes(b"\x07" * 64)  # garbage header
    assert "corrupt or unreadable" in run_bad(model_recipe(d), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_pickle_weights_only(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert "no *.safetensors" in run_bad(model_recipe(d), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_unsupported_architecture(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = run_bad(model_recipe(d), tmp_path)
    assert "GPT2LMHeadModel is not supported" in msg and "LlamaForCausalLM" in msg and "MistralForCausalLM" in msg


@pytest.mark.usefixtures("no_heavy_work")
def test_missing_tokenizer(tmp_path: Path, tiny_random_model: Path) -> None:
    d = copy_model(tiny_random_model, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    assert "no tokenizer" in run_bad(model_recipe(d), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_hub_model_without_network_is_an_input_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = {}

    def offline(**kw: Any) -> None:
        calls.update(kw)
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic "
                                      "has been disabled.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    msg = run_bad(model_recipe("hf:kiln-test/not-a-model@v2"), tmp_path)
    assert "cannot download kiln-test/not-a-model at revision v2" in msg and "LocalEntryNotFoundError" in msg
    assert calls["repo_id"] == "kiln-test/not-a-model" and calls["revision"] == "v2"
    assert "*.safetensors" in calls["allow_patterns"] and "*.py" not in calls["allow_patterns"]
    assert "*.bin" not in calls["allow_patterns"]


@pytest.mark.usefixtures("no_heavy_work")
def test_calibration_file_with_too_few_samples(tmp_path: Path, tiny_random_model: Path) -> None:
    data = tmp_path / "calib.txt"
    data.write_text("w1 w2 w3\n\nw4 w5\n\nw6", encoding="utf-8")
    msg = run_bad(model_recipe(tiny_random_model, calibration={"dataset": str(data), "samples": 5}), tmp_path)
    assert "asked for 5 samples but the data has only 3 usable" in msg
    assert "lower quantization.calibration.samples to 3" in msg


@pytest.mark.usefixtures("no_heavy_work")
@pytest.mark.parametrize("rows, column, expect", [
    ([{"text": ""}, {"text": " "}], "text", "holds no text"),
    ([{"text": 1}, {"text": 2}], "text", "holds int values, not text"),
    ([{"body": "w1"}], "text", "has no key 'text'"),
])
def test_bad_calibration_column(tmp_path: Path, tiny_random_model: Path, rows: list, column: str,
                                expect: str) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    calib = {"dataset": str(data), "column": column, "samples": 1}
    assert expect in run_bad(model_recipe(tiny_random_model, calibration=calib), tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_nvfp4_without_cuda(tmp_path: Path, tiny_random_model: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nvfp4 calibrates here")
    msg = run_bad(model_recipe(tiny_random_model, format="nvfp4"), tmp_path)
    assert "needs a CUDA GPU" in msg and "quantization.format" in msg


@pytest.mark.usefixtures("no_heavy_work")
def test_tp_must_divide_heads(tmp_path: Path, tiny_random_model: Path) -> None:
    r = make_recipe(target="tensorrt", model={"source": str(tiny_random_model)},
                    quantization={"format": "fp8", "runtime": "host"}, parallelism={"tp": 3})
    assert "parallelism.tp: 3 does not divide the model's 2 attention heads" in run_bad(r, tmp_path)


@pytest.mark.usefixtures("no_heavy_work")
def test_weight_only_exclusions_trtllm_cannot_honour(tmp_path: Path, tiny_random_model: Path) -> None:
    r = model_recipe(tiny_random_model, exclude_modules=["lm_head", "*.mlp.down_proj"])
    assert "'*.mlp.down_proj' cannot be honoured with int8_wo" in run_bad(r, tmp_path)


def test_model_hash_changes_with_the_weights(tmp_path: Path, tiny_random_model: Path) -> None:
    import os

    from kiln.models.loading import model_source_hash

    d = copy_model(tiny_random_model, tmp_path / "m")
    h = model_source_hash(str(d))
    assert h == model_source_hash(str(d))
    st = d / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 1_000_000))
    assert model_source_hash(str(d)) != h
    h2 = model_source_hash(str(d))
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg))
    assert model_source_hash(str(d)) != h2


def test_load_model_uses_the_recipe_dtype(tiny_random_model: Path) -> None:
    import torch

    from kiln.models.loading import load_model, read_config, resolve_dtype

    assert resolve_dtype("auto", read_config(tiny_random_model)) == "float32"
    assert resolve_dtype("auto", {}) == "float16"
    model = load_model(tiny_random_model, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training


# --------------------------------------------------------------------------------------------- integration

FORMATS = [
    # (id, --set overrides, quant_algo, kv_cache_quant_algo)
    ("default", [], "W4A16_AWQ", None),
    ("fp8", ["quantization.format=fp8"], "FP8", None),
    ("fp8-kv-fp8", ["quantization.format=fp8", "quantization.kv_cache=fp8"], "FP8", "FP8"),
    ("int8_sq", ["quantization.format=int8_sq"], "W8A8_SQ_PER_CHANNEL", None),
    ("int4_awq", ["quantization.format=int4_awq", "quantization.awq_block_size=64"], "W4A16_AWQ", None),
    ("w4a8_awq", ["quantization.format=w4a8_awq"], "W4A8_AWQ", None),
    ("int8_wo", ["quantization.format=int8_wo"], "W8A16", None),
    ("int4_wo", ["quantization.format=int4_wo", "quantization.kv_cache=int8"], "W4A16", "INT8"),
]
FAST = ["target=tensorrt", "quantization.runtime=host", "quantization.calibration.samples=8", "quantization.calibration.max_seq_len=64",
        "evaluation.samples=8", "evaluation.max_seq_len=128"]


@pytest.fixture(scope="module")
def tiny_llama() -> Path:
    from kiln.models.tiny import ensure_tiny_llama

    return ensure_tiny_llama(progress=False)


@pytest.fixture(scope="module")
def built(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Quantize + evaluate one configuration (memoised, so later tests reuse the outputs)."""
    from kiln.steps.evaluate import evaluate
    from kiln.steps.quantize import quantize

    cache: dict[str, tuple] = {}

    def build(fid: str, extra: tuple[str, ...] = ()) -> tuple:
        key = fid + "|" + ",".join(extra)
        if key not in cache:
            overrides = dict((f[0], f[1]) for f in FORMATS)[fid]
            loaded = load_recipe(DEFAULT_RECIPE, FAST + overrides + list(extra))
            root = tmp_path_factory.mktemp(fid)
            q_ctx = StepContext(loaded, root / "quantize", show_progress=False)
            q_ctx.out_dir.mkdir()
            q_res = quantize(q_ctx)
            e_ctx = StepContext(loaded, root / "evaluate", inputs={"quantize": q_ctx.out_dir}, show_progress=False)
            e_ctx.out_dir.mkdir()
            e_res = evaluate(e_ctx)
            cache[key] = (loaded.recipe, q_ctx.out_dir, q_res, e_ctx.out_dir, e_res)
        return cache[key]

    return build


@pytest.mark.integration
@pytest.mark.parametrize("fid, overrides, quant_algo, kv_algo", FORMATS, ids=[f[0] for f in FORMATS])
def test_format_produces_trtllm_checkpoint_and_quality_report(built: Callable, fid: str, overrides: list,
                                                              quant_algo: str, kv_algo: Any) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from kiln.steps.evaluate import EvaluateResult, check_gate

    recipe, qdir, q_res, edir, e_res = built(fid)
    assert (q_res.quant_algo, q_res.kv_cache_quant_algo) == (quant_algo, kv_algo)

    trt = qdir / "trtllm_checkpoint"
    config = json.loads((trt / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM"
    assert config["quantization"]["quant_algo"] == quant_algo
    assert config["quantization"]["kv_cache_quant_algo"] == kv_algo
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert config["num_hidden_layers"] == 4 and config["num_key_value_heads"] == 2
    assert config["rotary_base"] == 10000.0
    with safe_open(str(trt / "rank0.safetensors"), framework="pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("transformer.layers.0.attention.qkv.weight")
        lm_head = f.get_tensor("lm_head.weight")
    assert lm_head.is_floating_point() and lm_head.element_size() >= 2  # excluded by default: not quantized
    assert {"transformer.vocab_embedding.weight", "lm_head.weight", "transformer.ln_f.weight"} <= names
    if quant_algo in ("W8A16", "W4A16"):  # TensorRT-LLM quantizes these itself at build time
        assert qkv.is_floating_point()
    else:  # ModelOpt wrote quantized weights and their scales
        assert not qkv.is_floating_point() or qkv.element_size() == 1
        assert "transformer.layers.0.attention.qkv.weights_scaling_factor" in names
    if kv_algo:
        assert "transformer.layers.0.attention.kv_cache_scaling_factor" in names
    assert AutoTokenizer.from_pretrained(str(trt / "tokenizer"))("hello")["input_ids"]

    quality = json.loads((edir / "quality.json").read_text())
    assert quality["skipped"] is False and quality["format"] == recipe.quantization.format
    for k in ("base_perplexity", "quant_perplexity", "mean_kl"):
        assert math.isfinite(quality[k]) and quality[k] >= 0
    assert quality["mean_kl"] > 0  # quantization changes something
    assert quality["base_perplexity"] < 1000  # the tiny model learned something
    assert e_res.ppl_increase_pct == quality["ppl_increase_pct"]
    if fid == "default":  # the shipped recipe passes its own gate
        assert check_gate(recipe, e_res) is None, check_gate(recipe, e_res)


@pytest.mark.integration
@pytest.mark.parametrize("fid", ["default", "int8_sq", "int4_wo"])
def test_restored_model_equals_the_calibrated_one(built: Callable, fid: str) -> None:
    """The reference runtime's load path, mto.restore(from_pretrained(checkpoint)), reproduces the
    calibrated model's logits exactly; and the checkpoint itself is the unquantized model."""
    import modelopt.torch.opt as mto
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, qdir, *_ = built(fid)
    ckpt = qdir / "checkpoint"
    probe = load_file(str(qdir / "restore_check.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(ckpt))
    with torch.no_grad():
        base_logits = base(input_ids=probe["input_ids"]).logits
    model = mto.restore(base, str(ckpt / "modelopt_state.pth"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert torch.equal(logits, probe["logits"])
    assert not torch.equal(base_logits, logits)
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"  # the recipe dtype


@pytest.mark.integration
def test_tighter_gate_than_achieved_fails_with_the_figures(built: Callable) -> None:
    from kiln.steps.evaluate import EvaluateResult, check_gate

    recipe, _, _, _, e_res = built("int4_wo")
    tight = recipe.model_copy(update={"evaluation": recipe.evaluation.model_copy(
        update={"max_ppl_increase_pct": e_res.ppl_increase_pct / 2 if e_res.ppl_increase_pct > 0 else None,
                "max_kl": e_res.mean_kl / 2})})
    msg = check_gate(tight, e_res)
    assert msg is not None and "evaluation.max_kl" in msg and f"{e_res.mean_kl:.4g}" in msg
    loose = recipe.model_copy(update={"evaluation": recipe.evaluation.model_copy(
        update={"max_ppl_increase_pct": None, "max_kl": e_res.mean_kl * 2})})
    assert check_gate(loose, e_res) is None


@pytest.mark.integration
def test_tensor_parallel_export_writes_a_file_per_rank(built: Callable) -> None:
    _, qdir, q_res, _, _ = built("fp8", ("parallelism.tp=2", "evaluation.enabled=false"))
    trt = qdir / "trtllm_checkpoint"
    config = json.loads((trt / "config.json").read_text())
    assert config["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert (trt / "rank0.safetensors").is_file() and (trt / "rank1.safetensors").is_file()


@pytest.mark.integration
def test_reference_target_writes_no_trtllm_checkpoint_and_skipped_evaluation(built: Callable) -> None:
    recipe, qdir, q_res, edir, e_res = built("fp8", ("target=reference", "evaluation.enabled=false"))
    assert recipe.target == "reference" and not (qdir / "trtllm_checkpoint").exists()
    assert (qdir / "checkpoint" / "modelopt_state.pth").is_file()
    assert q_res.quant_algo == "FP8"  # what the format maps to, recorded for the manifest
    assert json.loads((edir / "quality.json").read_text()) == {"skipped": True,
                                                               "reason": "evaluation.enabled is false"}
    assert e_res.skipped and e_res.base_perplexity is None
