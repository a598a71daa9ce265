"""The format registry (kiln/recipe/data/formats.yaml via kiln.recipe.formats): one home per format fact, the
same verdict from `kiln validate` and `kiln plan`, the upstream source behind each refusal, and a new format as
one data entry.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, recipe_id, shipped_recipes

from kiln.plan import make_plan
from kiln.recipe import formats
from kiln.recipe.gpus import GPUS
from kiln.recipe.loader import load_recipe
from kiln.recipe.rules import check_rules
from kiln.recipe.schema import QuantizationSection, Recipe
from kiln.plan import plan_inputs
from kiln.plan import recipe_model_config as model_config

SRC = REPO_ROOT / "src"
REGISTRY_FILE = SRC / "kiln" / "recipe" / "data" / "formats.yaml"
DATA_SUFFIXES = (".yaml", ".yml", ".json")
TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".pbtxt", ".md", ".cfg", ".toml", *DATA_SUFFIXES)

# ------------------------------------------------------------------------------------ one home per fact

# Written out here on purpose (not read from the registry): every quant_algo string kiln uses and every
# ModelOpt config name. Each must occur in exactly one file under src/: the registry.
DISTINCTIVE = (
    "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "W4A8_AWQ", "W8A16", "W4A16",
    "FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG", "INT8_WEIGHT_ONLY_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "NVFP4_DEFAULT_CFG", "FP8_KV_CFG",
)  # fmt: skip
# Words that also occur in prose ("an FP8 KV cache"): they count only as a whole string literal in Python and
# as a whole value in a data file. FP8 and INT8 are also the KV-cache algorithms.
PROSE_LIKE = ("FP8", "NVFP4", "INT8")


def _identifier(word: str) -> re.Pattern[str]:
    """``word`` as a whole identifier: W4A16 does not match inside W4A16_AWQ or xW4A16."""
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])")


def _python_strings(text: str) -> list[str]:
    """Every plain string literal of a Python source, evaluated (f-strings and byte strings skipped)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue  # an f-string with placeholders
            if isinstance(value, str):
                found.append(value)
    return found


def _data_values(node: object) -> list[str]:
    """Every string value (not key) of parsed YAML/JSON."""
    if isinstance(node, dict):
        return [v for value in node.values() for v in _data_values(value)]
    if isinstance(node, list):
        return [v for value in node for v in _data_values(value)]
    return [node] if isinstance(node, str) else []


def files_holding(root: Path, words: tuple[str, ...] = DISTINCTIVE + PROSE_LIKE) -> dict[str, list[Path]]:
    """For each word, the files under ``root`` that spell it (the matching rules above)."""
    hits: dict[str, list[Path]] = {w: [] for w in words}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                       and "__pycache__" not in p.parts):
        text = path.read_text(encoding="utf-8")
        strings: list[str] = []
        if path.suffix in (".py", ".pyi"):
            strings = _python_strings(text)
        elif path.suffix in DATA_SUFFIXES:
            strings = _data_values(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text))
        for word in words:
            if word in PROSE_LIKE:
                found = word in strings
            else:
                found = _identifier(word).search(text) is not None
            if found:
                hits[word].append(path)
    return hits


def test_each_format_fact_has_one_home() -> None:
    hits = files_holding(SRC)
    misplaced = {w: [str(p.relative_to(REPO_ROOT)) for p in paths] for w, paths in hits.items()
                 if paths != [REGISTRY_FILE]}
    assert misplaced == {}, "each literal must live only in src/kiln/recipe/data/formats.yaml"


def test_the_literal_matcher_can_fail(tmp_path: Path) -> None:
    """The matcher above finds a duplicate wherever code could hide one, and ignores prose and longer names."""
    (tmp_path / "home.yaml").write_text("quant_algo: FP8\nalgos: [W4A16_AWQ, INT8]\n")
    (tmp_path / "code.py").write_text('ALGO = "FP8"\nCFG = mtq.FP8_KV_CFG\n# W4A16 in a comment counts\n')
    (tmp_path / "prose.py").write_text('"""An FP8 KV cache; INT8 weights."""\nx = f"{y} NVFP4"\nname = "W4A16_AWQ_X"\n')
    (tmp_path / "other.json").write_text('{"FP8": "fp8", "kind": "INT8"}')
    hits = files_holding(tmp_path)
    names = {w: sorted(p.name for p in paths) for w, paths in hits.items() if paths}
    assert names == {
        "FP8": ["code.py", "home.yaml"],  # the literal in code.py duplicates the registry's value; prose does not
        "INT8": ["home.yaml", "other.json"],  # a JSON value counts, a JSON key does not
        "W4A16_AWQ": ["home.yaml"],  # "W4A16_AWQ_X" is another identifier
        "W4A16": ["code.py"],  # a comment counts; not inside W4A16_AWQ
        "FP8_KV_CFG": ["code.py"],
    }


# ------------------------------------------------------------------------- validate and plan agree


def _validate_refusals(recipe: Recipe) -> list[str]:
    return [p.message for p in check_rules(recipe)
            if p.severity == "error" and p.key in ("quantization.format", "quantization.kv_cache")]


def test_b200_refuses_w4a8_awq_in_validate_and_plan_as_upstream_does(kiln) -> None:
    recipe = REPO_ROOT / "configs" / "llama-3.1-8b" / "w4a8-awq.yaml"
    validated = kiln("validate", recipe, "--set", "hardware.gpu=B200")
    assert validated.exit_code == 2
    assert "quantization.format: trtllm-build 1.2.1 refuses W4A8 AWQ on SM 100-119" in validated.output
    assert "use quantization.format: fp8 instead" in validated.output
    planned = kiln("plan", recipe, "--gpu", "B200", "--json")
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output)
    assert (plan["fits"], plan["first_limit"]) == (False, "format")
    assert "trtllm-build 1.2.1 refuses W4A8 AWQ on SM 100-119" in plan["verdict"]
    # ... and the verdict is the cited upstream source's: builder.build() of TensorRT-LLM 1.2.1, whose
    # `100 <= SM < 120` block refuses INT4 weight-only modes, W4A8_AWQ's mode in QuantMode.from_quant_algo.
    reg = formats.registry()
    (refused,) = reg.weight_formats["w4a8_awq"].support["tensorrt"].refused
    assert refused.sm == (100, 120)
    source = reg.sources[refused.source]
    assert source.repo == "NVIDIA/TensorRT-LLM" and source.path.startswith("1.2.1/_modules/tensorrt_llm/builder.html")
    assert source.commit == "58fb435eacc402f3bd177e60f592c955d2b0719d"
    assert "builder.build()" in source.title and "1.2.1" in source.title
    assert "get_sm_version() >= 100 and get_sm_version() < 120" in source.what
    # SM 120+ (RTX Blackwell) is outside that block: not refused there.
    assert formats.format_refusal("w4a8_awq", "tensorrt", 120) is None


# Every shipped recipe fits wherever its format runs, so one case beyond them makes validate's "does not fit"
# warning and the plan's no-fit verdict meet too: 70B FP8 squeezed onto one GPU.
VERDICT_CASES = [(path, ()) for path in shipped_recipes()] + [
    (REPO_ROOT / "configs" / "llama-3.1-70b" / "fp8-tp4.yaml", ("parallelism.tp=1", "hardware.count=1")),
]


@pytest.mark.parametrize(("path", "sets"), VERDICT_CASES,
                         ids=[recipe_id(p) + ("+" + ",".join(s) if s else "") for p, s in VERDICT_CASES])
def test_validate_and_plan_give_the_same_verdict_on_every_gpu(kiln, path: Path, sets: tuple[str, ...]) -> None:
    """The whole verdict on every GPU in the table: `kiln validate` (hardware.gpu set to it) refuses the recipe
    (exit 2) exactly when `kiln plan --gpu` says it does not run there, with the same reason; it warns "does not
    fit" exactly when the plan does not fit, with the plan's verdict; it is clean exactly when the plan fits."""
    overrides = [arg for s in sets for arg in ("--set", s)]
    seen = set()
    for gpu in GPUS.values():
        validated = kiln("validate", path, *overrides, "--set", f"hardware.gpu={gpu.name}")
        planned = kiln("plan", path, *overrides, "--gpu", gpu.name, "--json")
        assert planned.exit_code == 0, planned.output
        plan = json.loads(planned.output[planned.output.index("{\n"):])  # in-process, warnings precede the JSON
        said = " ".join(validated.output.split())  # rich wraps long lines
        if plan["first_limit"] == "format":
            seen.add("refused")
            assert validated.exit_code == 2, (gpu.name, validated.output)
            assert plan["verdict"].startswith(f"does not run on {gpu.name}: ")
            assert plan["verdict"].removeprefix(f"does not run on {gpu.name}: ") in said, (gpu.name, said)
        elif not plan["fits"]:
            seen.add("does not fit")
            assert validated.exit_code == 0, (gpu.name, validated.output)
            assert f"does not fit: {plan['verdict']}" in said, (gpu.name, said)
        else:
            seen.add("fits")
            assert validated.exit_code == 0 and "does not fit" not in said, (gpu.name, said)
    if sets:
        assert "does not fit" in seen  # the extra case does reach that branch


def test_preflight_refuses_on_this_gpu_what_validate_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine runtime runs on this machine's GPU: preflight gives the registry's verdict for it, word for word
    what `kiln validate` says. Stand-in (not a GPU run): nvidia-smi reporting one B200."""
    from kiln.pipeline import preflight

    monkeypatch.setattr(preflight, "detected_gpu_names", lambda: ["NVIDIA B200"])
    for sets, key in ((["quantization.format=w4a8_awq"], "quantization.format"),
                      (["quantization.kv_cache=int8"], "quantization.kv_cache")):
        loaded = load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml",
                             [*sets, "hardware.gpu=B200", "quantization.calibration.samples=32"], check_rules=False)
        (refusal,) = [p for p in check_rules(loaded.recipe) if p.key == key and p.severity == "error"]
        problems = preflight._gpu_problems(loaded.recipe, ["engine"])
        assert problems == [f"{key}: {refusal.message} on this machine's B200; {refusal.hint}"]
    ok = load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml", ["hardware.gpu=B200"]).recipe
    assert preflight._gpu_problems(ok, ["engine"]) == []


# ------------------------------------------------------------------------------ facts from upstream


def test_blackwell_refusals_follow_builder_build_of_1_2_1() -> None:
    """On SM 100-119 trtllm-build 1.2.1 refuses SmoothQuant, INT8/INT4 weight-only modes (AWQ included) and
    an INT8 KV cache, and nothing else kiln offers; minimum SMs come from the support matrices."""
    refused = {f for f in formats.weight_format_names() if formats.format_refusal(f, "tensorrt", 100)}
    assert refused == {"int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo"}
    assert {k for k in formats.kv_cache_format_names() if formats.kv_refusal(k, "tensorrt", 100)} == {"int8"}
    reg = formats.registry()
    for fmt in [*reg.weight_formats.values(), *reg.kv_cache_formats.values()]:
        for rule in fmt.support["tensorrt"].refused:
            assert rule.source == "trtllm-builder" and rule.sm == (100, 120), fmt.name
    assert formats.formats_that_run("tensorrt", 80) == ["none", "int8_sq", "int4_awq", "int8_wo", "int4_wo"]
    assert formats.formats_that_run("tensorrt", 89) == [n for n in formats.weight_format_names() if n != "nvfp4"]
    assert formats.formats_that_run("tensorrt", 100) == ["none", "fp8", "nvfp4"]
    assert formats.formats_that_run("tensorrt", 120) == list(formats.weight_format_names())
    assert formats.kv_formats_that_run("tensorrt", 80) == ["none", "int8"]


def test_reference_target_runs_on_cpu_and_only_nvfp4_needs_cuda() -> None:
    for sm in (None, 80, 100):
        assert formats.formats_that_run("reference", sm) == [n for n in formats.weight_format_names()
                                                             if n != "nvfp4"]
    reason = formats.why_unsupported("nvfp4", "reference")
    assert reason is not None and "needs a CUDA GPU" in reason and "target: tensorrt" in reason


def test_gentler_advice_runs_where_the_recipe_runs() -> None:
    from kiln.steps.evaluate import EvaluateResult, check_gate

    def advice(fmt: str, gpu: str | None) -> str:
        r = Recipe.model_validate({"name": "g", "hardware": {"gpu": gpu}, "evaluation": {"max_kl": 0.01}})
        return str(check_gate(r, EvaluateResult(format=fmt, mean_kl=1.0)))

    assert "(e.g. int8_sq or fp8)" in advice("int4_awq", "H100-SXM")
    assert "(e.g. fp8)" in advice("int4_awq", "B200")  # int8_sq is refused on SM 100-119
    assert "(e.g. int4_awq or fp8)" in advice("w4a8_awq", None)


def test_storage_facts_for_the_planner() -> None:
    wf = formats.weight_format
    assert wf("int4_awq").bytes_per_weight(2, 128) == 0.5 + 2 / 128
    assert wf("w4a8_awq").bytes_per_weight(2, 64) == 0.5 + 2 / 64
    assert wf("nvfp4").bytes_per_weight(2, 128) == 0.5 + 1 / 16
    assert wf("none").bytes_per_weight(4, 128) == 4.0
    assert {n: wf(n).storage.gemm for n in formats.weight_format_names()} == {
        "none": "base", "fp8": "fp8", "int8_sq": "int8", "int4_awq": "base", "w4a8_awq": "fp8",
        "int8_wo": "base", "int4_wo": "base", "nvfp4": "fp4",
    }  # fmt: skip
    assert [n for n in formats.weight_format_names() if wf(n).uses_awq_block_size] == ["int4_awq", "w4a8_awq"]


def test_trtllm_qformat_names_are_upstream_choices() -> None:
    """Each format names the `--qformat` TensorRT-LLM's own quantizer takes (examples/quantization/quantize.py)."""
    upstream = {"nvfp4", "fp8", "fp8_pc_pt", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "full_prec"}
    reg = formats.registry()
    assert {f.trtllm_qformat for f in reg.weight_formats.values()} <= upstream
    assert {k.trtllm_kv_cache_dtype for k in reg.kv_cache_formats.values()} == {None, "fp8", "int8"}


def test_schema_names_and_docs_come_from_the_registry() -> None:
    field = QuantizationSection.model_fields["format"]
    assert field.annotation.__args__ == formats.weight_format_names()
    assert "`w4a8_awq` (W4A8 AWQ)" in (field.description or "")
    assert Recipe.model_fields["target"].annotation.__args__ == formats.target_names()


# ------------------------------------------------------------------------------ the data is checked


def _registry_text(edit: str = "") -> str:
    return REGISTRY_FILE.read_text(encoding="utf-8") + edit


@pytest.mark.parametrize("edit, message", [
    ("  extra:\n    label: x\n    modelopt_config: null\n    kv_cache_quant_algo: FP16\n"
     "    trtllm_kv_cache_dtype: null\n    bytes_per_element: 1\n    support: {tensorrt: {}}\n",
     "kv_cache_formats.extra.support: no entry for target 'reference'"),
    ("  extra:\n    label: x\n    modelopt_config: null\n    kv_cache_quant_algo: FP16\n"
     "    trtllm_kv_cache_dtype: null\n    bytes_per_element: 1\n"
     "    support: {tensorrt: {}, pytorch: {}, reference: {}}\n",
     "kv_cache_formats.extra.kv_cache_quant_algo: 'FP16' is not one TensorRT-LLM 1.2.1 accepts"),
    ("  extra:\n    label: x\n    modelopt_config: null\n    kv_cache_quant_algo: null\n    gentler: [fp16]\n"
     "    trtllm_kv_cache_dtype: null\n    bytes_per_element: 1\n    support:\n      tensorrt:\n"
     "        min_sm: {sm: 90, source: my-blog, note: x}\n      pytorch: {}\n      reference: {}\n",
     "kv_cache_formats.extra.gentler: unknown format 'fp16'; kv_cache_formats.extra.support.tensorrt: unknown source"),
])
def test_bad_registry_entries_are_refused_with_their_key(edit: str, message: str) -> None:
    # the KV-cache table is the registry's last mapping but one: insert the entry before the quant-algo table
    text = _registry_text().replace("\n# What a TensorRT-LLM 1.2.1 checkpoint may say", edit + "\n# What a", 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        formats.load_registry(text, "test.yaml")


# ------------------------------------------------------------------------ a new format is one entry

NEW_FORMAT = """
  fp8_pc_pt:
    label: FP8 per-channel per-token
    description: FP8 weights with per-channel scales, FP8 activations with per-token scales
    modelopt_config: FP8_PER_CHANNEL_PER_TOKEN_CFG
    trtllm_qformat: fp8_pc_pt
    quant_algo: FP8_PER_CHANNEL_PER_TOKEN
    storage: {weight_bytes: 1, weight_dtype: fp8, scales_not_counted: one scale per output channel, gemm: fp8}
    gentler: [fp8]
    support:
      tensorrt:
        min_sm: {sm: 89, source: modelopt-support-matrix, note: FP8 on Ada and later}
        refused:
          - sm: [100, 120]
            by: trtllm-build 1.2.1
            why: "builder.build() raises 'Per-channel or per-token scaling is not supported on SM>=100.'"
            source: trtllm-builder
      pytorch: {}
      reference: {}
"""


@pytest.fixture(scope="module")
def kiln_with_new_format(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of kiln's source whose only change is one more entry in formats.yaml."""
    root = tmp_path_factory.mktemp("kiln-copy")
    shutil.copytree(SRC / "kiln", root / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    registry = root / "kiln" / "recipe" / "data" / "formats.yaml"
    text = registry.read_text(encoding="utf-8")
    registry.write_text(text.replace("\nkv_cache_formats:\n", NEW_FORMAT + "\nkv_cache_formats:\n", 1),
                        encoding="utf-8")
    return root


def _run_kiln(src: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                          timeout=120)


def test_a_new_format_is_one_registry_entry(kiln_with_new_format: Path, tmp_path: Path) -> None:
    """The schema accepts it, the rules judge it by its support entry, the planner sizes it by its storage entry,
    the quantize step maps it to its ModelOpt preset and quant_algo, and `kiln show --doc` documents it: no code
    changed."""
    recipe = str(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml")
    on_b200 = _run_kiln(kiln_with_new_format, "validate", recipe, "--set", "quantization.format=fp8_pc_pt",
                        "--set", "hardware.gpu=B200")
    assert on_b200.returncode == 2, on_b200.stderr
    assert "trtllm-build 1.2.1 refuses FP8 per-channel per-token on SM 100-119" in on_b200.stderr
    assert "use quantization.format: fp8 instead" in on_b200.stderr
    on_h100 = _run_kiln(kiln_with_new_format, "validate", recipe, "--set", "quantization.format=fp8_pc_pt",
                        "--set", "hardware.gpu=H100-SXM")
    assert on_h100.returncode == 0, on_h100.stderr
    planned = _run_kiln(kiln_with_new_format, "plan", recipe, "--set", "quantization.format=fp8_pc_pt",
                        "--gpu", "H100-SXM", "--json")
    assert planned.returncode == 0, planned.stderr
    weights = json.loads(planned.stdout)["weights"]
    assert (weights["format"], weights["quant_algo"], weights["bytes_per_weight"]) == (
        "fp8_pc_pt", "FP8_PER_CHANNEL_PER_TOKEN", 1.0)
    dry = _run_kiln(kiln_with_new_format, "build", recipe, "--set", "quantization.format=fp8_pc_pt", "--set",
                    "hardware.gpu=H100-SXM", "--dry-run", "--build-dir", str(tmp_path / "b"), "--repo-dir",
                    str(tmp_path / "r"))
    assert dry.returncode == 0, dry.stderr
    assert "quantize_and_export(qformat=fp8_pc_pt" in dry.stdout  # what the engine runtime's quantizer is told
    host = _run_kiln(kiln_with_new_format, "build", recipe, "--set", "quantization.format=fp8_pc_pt", "--set",
                     "hardware.gpu=H100-SXM", "--set", "quantization.runtime=host", "--dry-run", "--build-dir",
                     str(tmp_path / "b"), "--repo-dir", str(tmp_path / "r"))
    assert "ModelOpt FP8_PER_CHANNEL_PER_TOKEN_CFG" in host.stdout  # the host path's preset
    assert "quant_algo FP8_PER_CHANNEL_PER_TOKEN" in dry.stdout  # what its checkpoint must say
    shown = _run_kiln(kiln_with_new_format, "show", recipe, "--doc")
    assert "`fp8_pc_pt` (FP8 per-channel per-token)" in " ".join(shown.stdout.replace("#", " ").split())
    # the unchanged kiln refuses the name
    assert "fp8_pc_pt" not in formats.weight_format_names()
