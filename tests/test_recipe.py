"""The recipe layer: loading, `extends`, `--set`, schema errors with file:line, and every cross-field rule.

Rule tests load a small, clean base recipe (no errors, no warnings) and change it with `--set`, so each
test shows exactly which key triggers a rule and that the same recipe without it is clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import CONFIGS, recipe_id, shipped_recipes

from kiln.recipe.catalog import list_recipes
from kiln.recipe.errors import Problem, RecipeError
from kiln.recipe.gpus import gpus_with_sm, lookup_gpu
from kiln.recipe.loader import deep_merge, load_recipe, parse_override, read_yaml, recipe_from_dict
from kiln.recipe.render import recipe_yaml
from kiln.recipe.rules import check_rules
from kiln.recipe.schema import Recipe

# A clean tensorrt recipe on one H100: no rule fires (asserted by test_rules_base_is_clean).
RULES_BASE = """\
name: rules-base
target: tensorrt
model:
  source: hf:meta-llama/Llama-3.1-8B-Instruct
quantization:
  format: none
hardware:
  gpu: H100-SXM
  count: 1
"""


def findings(path: Path, *sets: str, strict: bool = False) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of loading `path` with `--set` items."""
    try:
        loaded = load_recipe(path, sets, strict=strict)
    except RecipeError as exc:
        return exc.errors, [p for p in exc.problems if p.severity == "warning"]
    return [], list(loaded.warnings)


def keys(problems: list[Problem]) -> list[str]:
    return [p.key for p in problems]


def only(problems: list[Problem], key: str) -> Problem:
    hits = [p for p in problems if p.key == key]
    assert len(hits) == 1, f"expected one problem at {key}, got {[p.format() for p in problems]}"
    return hits[0]


@pytest.fixture
def base(write_recipe) -> Path:
    return write_recipe(RULES_BASE)


# --------------------------------------------------------------------------------------- shipped recipes


def test_shipped_recipes_are_found_recursively():
    found = shipped_recipes()
    # recipes live both at the top of configs/ and in sub-folders; the sub-folder ones must be found
    tops = {len(Path(recipe_id(p)).parts) for p in found}
    assert 1 in tops and max(tops) >= 2, tops
    assert not any("sweeps" in Path(recipe_id(p)).parts for p in found)
    assert [entry.path for entry in list_recipes(CONFIGS)] == found  # the catalog finds the same set


@pytest.mark.parametrize("path", shipped_recipes(), ids=recipe_id)
def test_shipped_recipe_loads_clean_and_renders_back_equal(path: Path):
    loaded = load_recipe(path)
    assert all(p.severity == "warning" for p in loaded.warnings)
    again = recipe_from_dict(yaml.safe_load(recipe_yaml(loaded.recipe)))
    assert again == loaded.recipe
    documented = recipe_yaml(loaded.recipe, docs=True)
    assert recipe_from_dict(yaml.safe_load(documented)) == loaded.recipe


# --------------------------------------------------------------------------------------- schema errors


THREE_MISTAKES = """\
name: three-mistakes
target: reference
quantization:
  formatt: int4_awq
engine:
  max_input_len: 512
  max_seq_len: 256
  kv_cache_type: pagd
"""


def test_three_mistakes_reported_together_with_line_and_key(write_recipe):
    path = write_recipe(THREE_MISTAKES)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    problems = info.value.problems
    assert len(problems) == 3, [p.format() for p in problems]
    by_key = {p.key: p for p in problems}
    assert set(by_key) == {"quantization.formatt", "engine.kv_cache_type", "engine.max_seq_len"}
    assert by_key["quantization.formatt"].origin.line == 4
    assert "unknown key" in by_key["quantization.formatt"].message
    assert "`format`" in by_key["quantization.formatt"].hint
    assert by_key["engine.kv_cache_type"].origin.line == 8
    assert "'pagd'" in by_key["engine.kv_cache_type"].message
    assert "`paged`" in by_key["engine.kv_cache_type"].hint
    assert by_key["engine.max_seq_len"].origin.line == 7
    assert "less than max_input_len" in by_key["engine.max_seq_len"].message
    assert all(p.origin.file == str(path) for p in problems)
    assert f"{path}:4: error: quantization.formatt" in str(info.value)


def test_missing_name_and_wrong_types_are_errors(write_recipe):
    path = write_recipe("target: reference\nengine:\n  max_batch_size: '64'\n  context_fmha: 1\n")
    errors, _ = findings(path)
    assert sorted(keys(errors)) == ["engine.context_fmha", "engine.max_batch_size", "name"]
    assert only(errors, "engine.max_batch_size").origin.line == 3  # no coercion of '64' to 64
    assert only(errors, "engine.context_fmha").origin.line == 4  # nor of 1 to true
    assert "required key is missing" in only(errors, "name").message


def test_bad_name_and_sources_are_errors(write_recipe):
    path = write_recipe("name: Bad Name\nmodel:\n  source: builtin:nope\nquantization:\n  calibration:\n"
                        "    dataset: 'hf:not a hub id'\n")
    errors, _ = findings(path)
    assert set(keys(errors)) == {"name", "model.source", "quantization.calibration.dataset"}
    assert only(errors, "model.source").origin.line == 3
    assert "builtin:tiny-llama" in only(errors, "model.source").message
    assert only(errors, "quantization.calibration.dataset").origin.line == 6


def test_yaml_syntax_error_names_the_line(write_recipe):
    path = write_recipe("name: x\nengine:\n  max_batch_size: [1, 2\n  max_input_len: 3\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    (problem,) = info.value.problems
    assert "invalid YAML" in problem.message
    assert problem.origin.file == str(path) and problem.origin.line is not None and problem.origin.line >= 3


def test_duplicate_keys_are_errors_with_the_second_line(write_recipe):
    path = write_recipe("name: dup\nengine:\n  max_batch_size: 4\n  max_batch_size: 8\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    (problem,) = info.value.problems
    assert (problem.key, problem.message, problem.origin.line) == ("engine.max_batch_size", "duplicate key", 4)


def test_python_tags_are_refused_not_run(write_recipe, tmp_path):
    marker = tmp_path / "marker"
    path = write_recipe(f"name: x\nmodel: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert not marker.exists()
    assert "tag" in info.value.problems[0].hint and info.value.problems[0].origin.line == 2


@pytest.mark.parametrize("text, what", [("- a\n- b\n", "list"), ("42\n", "int"), ("~\n", "empty"),
                                        ("# nothing\n", "empty")])
def test_non_mapping_root_is_an_error(write_recipe, text, what):
    with pytest.raises(RecipeError, match=f"must be a mapping of keys to values, not {what}"):
        load_recipe(write_recipe(text))


def test_empty_and_missing_files(write_recipe, tmp_path):
    with pytest.raises(RecipeError, match="recipe file is empty"):
        load_recipe(write_recipe(""))
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "absent.yaml")


def test_alias_bombs_and_recursive_anchors_are_refused_quickly(write_recipe):
    lines = ["a0: &a0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1, k9: 1}"]
    lines += [f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(10)) + "}" for i in range(1, 9)]
    with pytest.raises(RecipeError, match="recipe too large"):
        load_recipe(write_recipe("\n".join(lines) + "\nname: x\n"))  # 10^9 values once expanded
    with pytest.raises(RecipeError, match="recipe too large"):
        load_recipe(write_recipe("name: x\nengine: &a {x: *a}\n", "recursive.yaml"))


def test_strings_are_not_coerced_and_lists_become_tuples(write_recipe):
    path = write_recipe("name: t\nquantization:\n  exclude_modules: [lm_head, '*.down_proj']\n"
                        "serving:\n  gpu_device_ids: [0, 1]\n")
    r = load_recipe(path).recipe
    assert r.quantization.exclude_modules == ("lm_head", "*.down_proj")
    assert r.serving.gpu_device_ids == (0, 1)
    with pytest.raises(Exception):
        r.engine.max_batch_size = 3  # frozen


# --------------------------------------------------------------------------------------- extends and --set


def test_precedence_cli_beats_file_beats_base_beats_defaults(write_recipe, tmp_path):
    write_recipe("name: base\ndescription: the base\nengine:\n  max_batch_size: 11\n  max_input_len: 22\n"
                 "  max_num_tokens: 33\n", "bases/base.yaml")
    child = write_recipe("extends: bases/base.yaml\nname: child\nengine:\n  max_input_len: 44\n"
                         "  max_num_tokens: 55\n", "child.yaml")
    loaded = load_recipe(child, ["engine.max_num_tokens=66"])
    b = loaded.recipe.engine
    assert b.max_batch_size == 11  # base beats default (2048)
    assert b.max_input_len == 44  # file beats base
    assert b.max_num_tokens == 66  # --set beats file
    assert b.max_beam_width == Recipe.model_fields["engine"].default.max_beam_width == 1  # default
    assert loaded.recipe.name == "child" and loaded.recipe.description == ""  # name/description not inherited
    assert str(loaded.origin_of("engine.max_batch_size")) == f"{tmp_path / 'bases/base.yaml'}:4"
    assert str(loaded.origin_of("engine.max_input_len")) == f"{child}:4"
    assert str(loaded.origin_of("engine.max_num_tokens")) == "--set engine.max_num_tokens"
    assert loaded.user_set("engine.max_batch_size") and not loaded.user_set("engine.max_beam_width")
    # without --set the file's value holds
    assert load_recipe(child).recipe.engine.max_num_tokens == 55


def test_later_set_beats_earlier_set(base):
    assert load_recipe(base, ["engine.max_batch_size=4", "engine.max_batch_size=8"]).recipe.engine.max_batch_size == 8


def test_set_values_are_yaml_scalars(base):
    r = load_recipe(base, ["serving.streaming=false", "quantization.exclude_modules=[lm_head, x]",
                           "evaluation.max_kl=0.25", "evaluation.max_ppl_increase_pct=", "engine.speculative.mode=none"
                           ]).recipe
    assert r.serving.streaming is False
    assert r.quantization.exclude_modules == ("lm_head", "x")
    assert r.evaluation.max_kl == 0.25
    assert r.evaluation.max_ppl_increase_pct is None


def test_set_values_are_validated_like_the_file(base):
    errors, _ = findings(base, "engine.max_batch_size=abc", "quantization.formt=fp8", "serving.batching=v2")
    assert str(only(errors, "engine.max_batch_size").origin) == "--set engine.max_batch_size"
    assert "valid integer" in only(errors, "engine.max_batch_size").message
    assert str(only(errors, "quantization.formt").origin) == "--set quantization.formt"
    assert "`format`" in only(errors, "quantization.formt").hint
    assert str(only(errors, "serving.batching").origin) == "--set serving.batching"


def test_set_through_a_scalar_is_blamed_on_the_set(base):
    errors, _ = findings(base, "name.x=3")
    assert str(only(errors, "name").origin) == "--set name.x"


@pytest.mark.parametrize("item", ["engine.max_batch_size", "=3", "build..max_batch_size=3", ".x=1", "x.=1", " =1"])
def test_bad_set_syntax_is_an_error(base, item):
    with pytest.raises(RecipeError, match="bad --set"):
        load_recipe(base, [item])
    with pytest.raises(RecipeError):
        parse_override(item)


@pytest.mark.parametrize("value", ["[" * 700, "9" * 5000])
def test_unreadable_set_values_are_errors(base, value):
    with pytest.raises(RecipeError, match="cannot read the value of --set name"):
        load_recipe(base, [f"name={value}"])


def test_extends_problems(write_recipe):
    loop_a = write_recipe("extends: b.yaml\nname: a\n", "a.yaml")
    write_recipe("extends: a.yaml\nname: b\n", "b.yaml")
    with pytest.raises(RecipeError, match="circular extends"):
        load_recipe(loop_a)
    with pytest.raises(RecipeError, match="circular extends"):
        load_recipe(write_recipe("extends: self.yaml\nname: s\n", "self.yaml"))
    missing = write_recipe("name: m\n\nextends: nowhere.yaml\n", "m.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(missing)
    assert info.value.problems[0].origin.line == 3 and "not found" in info.value.problems[0].message
    with pytest.raises(RecipeError, match="must be the path of a base recipe"):
        load_recipe(write_recipe("name: n\nextends: 3\n", "n.yaml"))
    with pytest.raises(RecipeError, match="cannot use base recipe"):
        load_recipe(write_recipe('name: z\nextends: "a\\0b.yaml"\n', "z.yaml"))


def test_deep_merge_merges_mappings_and_replaces_the_rest():
    assert deep_merge({"a": {"x": 1, "y": [1]}, "b": 1}, {"a": {"y": [2]}, "c": 3}) == {
        "a": {"x": 1, "y": [2]}, "b": 1, "c": 3}


def test_read_yaml_records_the_line_of_every_key(write_recipe):
    _, lines = read_yaml(write_recipe("name: x\n\nengine:\n  # comment\n  max_batch_size: 4\n"))
    assert lines[("name",)].line == 1 and lines[("engine",)].line == 3 and lines[("engine", "max_batch_size")].line == 5


def test_recipe_from_dict_raises_recipe_error():
    assert recipe_from_dict({"name": "ok"}).name == "ok"
    with pytest.raises(RecipeError, match="unknown key"):
        recipe_from_dict({"name": "ok", "bild": {}})


# --------------------------------------------------------------------------------------- cross-field rules


def test_rules_base_is_clean(base):
    assert findings(base) == ([], [])


def test_rule_unknown_gpu(base):
    errors, _ = findings(base, "hardware.gpu=Z9000")
    assert "unknown GPU 'Z9000'" in only(errors, "hardware.gpu").message
    assert "H100-SXM" in only(errors, "hardware.gpu").hint
    for name in ("H100", "NVIDIA H100 80GB HBM3", "a100-80gb", "L40S"):
        assert findings(base, f"hardware.gpu={name}")[0] == [], name


@pytest.mark.parametrize("fmt, bad_gpu, good_gpu, need", [
    ("fp8", "A100-80GB", "L40S", 89),
    ("w4a8_awq", "A100-40GB", "H100-SXM", 89),
    ("nvfp4", "H100-SXM", "B200", 100),
])
def test_rule_format_needs_sm(base, fmt, bad_gpu, good_gpu, need):
    errors, _ = findings(base, f"quantization.format={fmt}", f"hardware.gpu={bad_gpu}")
    problem = only(errors, "quantization.format")
    assert f"needs SM {need}+" in problem.message and bad_gpu in problem.message
    # the hint names every GPU of the table that runs the format: SM high enough and not refused there
    runs = [g for g in gpus_with_sm(need) if not (fmt == "w4a8_awq" and 100 <= lookup_gpu(g).sm < 120)]
    assert runs and all(name in problem.hint for name in runs)
    assert findings(base, f"quantization.format={fmt}", f"hardware.gpu={good_gpu}")[0] == []


@pytest.mark.parametrize("fmt", ["int8_sq", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq"])
def test_rule_formats_refused_on_blackwell(base, fmt):
    """trtllm-build 1.2.1 builder.build() refuses INT8/INT4 weight-only modes (W4A16_AWQ and W4A8_AWQ among
    them) and SmoothQuant on SM 100-119; the hint offers a format B200 runs, never another refused one."""
    errors, _ = findings(base, f"quantization.format={fmt}", "hardware.gpu=B200",
                         "quantization.calibration.samples=32")
    problem = only(errors, "quantization.format")
    assert "trtllm-build 1.2.1 refuses" in problem.message and "SM 100-119" in problem.message
    assert lookup_gpu("B200").sm == 100
    suggested = problem.hint.split("quantization.format: ")[1].split()[0]
    assert suggested == "fp8", problem.hint
    for gpu in ("H100-SXM", "L40S"):
        assert findings(base, f"quantization.format={fmt}", f"hardware.gpu={gpu}",
                        "quantization.calibration.samples=32")[0] == [], gpu


@pytest.mark.parametrize("fmt", ["int8_sq", "int8_wo", "int4_wo", "int4_awq"])
def test_rule_ampere_formats_run_on_a100(base, fmt):
    assert findings(base, f"quantization.format={fmt}", "hardware.gpu=A100-80GB",
                    "quantization.calibration.samples=32")[0] == []


def test_rule_kv_cache_vs_gpu(base):
    errors, _ = findings(base, "quantization.kv_cache=fp8", "hardware.gpu=A100-80GB")
    problem = only(errors, "quantization.kv_cache")
    assert "FP8 KV cache needs SM 89+" in problem.message
    assert "use quantization.kv_cache: int8 instead" in problem.hint
    assert findings(base, "quantization.kv_cache=fp8", "hardware.gpu=H100-SXM")[0] == []
    # builder.build() of 1.2.1 refuses an INT8 KV cache on SM 100-119 ("INT8/INT4 quantization ...")
    errors, _ = findings(base, "quantization.kv_cache=int8", "hardware.gpu=B200")
    problem = only(errors, "quantization.kv_cache")
    assert "refuses INT8 KV cache on SM 100-119" in problem.message
    assert "use quantization.kv_cache: fp8 instead" in problem.hint


def test_rule_format_rules_skip_reference_target_and_unnamed_gpu(base):
    assert findings(base, "quantization.format=fp8", "hardware.gpu=")[0] == []
    # the reference target runs on CPU: the named GPU's SM does not matter
    assert findings(base, "target=reference", "quantization.format=fp8", "hardware.gpu=A100-80GB")[0] == []


def test_rule_ranks_exceed_gpu_count(base):
    errors, _ = findings(base, "parallelism.tp=2", "parallelism.pp=2", "hardware.count=2")
    assert "tp × pp = 4 ranks but hardware.count is 2" in only(errors, "parallelism").message
    assert findings(base, "parallelism.tp=2", "parallelism.pp=2", "hardware.count=4")[0] == []
    assert findings(base, "parallelism.tp=8", "hardware.count=")[0] == []  # count unknown: not checked


def test_rule_gpu_device_ids_cover_the_ranks(base):
    errors, _ = findings(base, "parallelism.tp=2", "hardware.count=2", "serving.gpu_device_ids=[0]")
    assert "1 device ids for 2 ranks" in only(errors, "serving.gpu_device_ids").message
    assert findings(base, "parallelism.tp=2", "hardware.count=2", "serving.gpu_device_ids=[0, 1]")[0] == []


def test_rule_max_seq_len_below_max_input_len(base):
    errors, _ = findings(base, "engine.max_input_len=2048", "engine.max_seq_len=1024")
    assert "max_seq_len (1024) is less than max_input_len (2048)" in only(errors, "engine.max_seq_len").message
    assert findings(base, "engine.max_input_len=2048", "engine.max_seq_len=4096") == ([], [])
    errors, warnings = findings(base, "engine.max_input_len=2048", "engine.max_seq_len=2048")
    assert errors == [] and keys(warnings) == ["engine.max_seq_len"]  # equal: allowed, but no room for output


def test_rule_max_num_tokens_below_max_input_len_needs_chunked_context(base):
    errors, _ = findings(base, "engine.max_input_len=4096", "engine.max_num_tokens=2048")
    problem = only(errors, "engine.max_num_tokens")
    assert "without chunked context" in problem.message and "enable_chunked_context" in problem.hint
    assert findings(base, "engine.max_input_len=4096", "engine.max_num_tokens=2048",
                    "serving.enable_chunked_context=true") == ([], [])
    assert findings(base, "engine.max_input_len=2048", "engine.max_num_tokens=2048") == ([], [])


def test_rule_tokens_per_block_power_of_two(base):
    errors, _ = findings(base, "engine.tokens_per_block=48")
    assert "48 is not a power of two" in only(errors, "engine.tokens_per_block").message
    for n in (1, 16, 64, 128):
        assert findings(base, f"engine.tokens_per_block={n}") == ([], []), n


@pytest.mark.parametrize("feature", ["serving.enable_kv_cache_reuse", "serving.enable_chunked_context"])
def test_rule_kv_reuse_and_chunked_context_need_paged_context_fmha(base, feature):
    off = ("serving.enable_kv_cache_reuse=false", "serving.enable_chunked_context=false")
    errors, _ = findings(base, *off, f"{feature}=true", "engine.use_paged_context_fmha=false")
    assert "needs paged context FMHA" in only(errors, feature).message
    errors, _ = findings(base, *off, f"{feature}=true", "engine.context_fmha=false")
    assert only(errors, feature)
    assert findings(base, *off, f"{feature}=true") == ([], [])
    assert findings(base, *off, "engine.use_paged_context_fmha=false") == ([], [])


def test_rule_inflight_batching_needs_paged_cache_and_packed_inputs(base):
    errors, _ = findings(base, "engine.kv_cache_type=continuous", "serving.enable_kv_cache_reuse=false")
    assert "needs a paged KV cache" in only(errors, "engine.kv_cache_type").message
    errors, _ = findings(base, "engine.remove_input_padding=false")
    assert only(errors, "engine.remove_input_padding")
    assert findings(base, "engine.kv_cache_type=continuous", "serving.enable_kv_cache_reuse=false",
                    "serving.batching=v1") == ([], [])


def test_rule_int8_kv_cache_gives_warnings_not_errors(base):
    errors, warnings = findings(base, "quantization.kv_cache=int8", "serving.enable_chunked_context=true")
    assert errors == []
    assert set(keys(warnings)) == {"serving.enable_kv_cache_reuse", "serving.enable_chunked_context",
                                   "engine.use_paged_context_fmha"}
    assert all(p.severity == "warning" for p in warnings)
    assert "turns paged context FMHA off" in only(warnings, "serving.enable_kv_cache_reuse").message
    assert findings(base, "quantization.kv_cache=none", "serving.enable_chunked_context=true") == ([], [])
    assert findings(base, "quantization.kv_cache=fp8", "serving.enable_chunked_context=true") == ([], [])


def test_rule_fp8_context_fmha_without_fp8_format_warns(base):
    _, warnings = findings(base, "engine.use_fp8_context_fmha=true")
    assert keys(warnings) == ["engine.use_fp8_context_fmha"]
    assert findings(base, "engine.use_fp8_context_fmha=true", "quantization.format=fp8",
                    "quantization.kv_cache=fp8") == ([], [])


SPEC = ("engine.speculative.mode=draft_tokens_external", "engine.speculative.max_draft_len=4",
        "engine.speculative.draft_recipe=draft.yaml")


def test_rule_speculative_valid_draft_target(base):
    assert findings(base, *SPEC) == ([], [])
    errors, warnings = findings(base, *SPEC, "engine.max_seq_len=2048")
    assert errors == []
    assert "engine max_seq_len will be 2052" in only(warnings, "engine.max_seq_len").message


@pytest.mark.parametrize("sets, key, fragment", [
    (("engine.speculative.max_draft_len=4",), "engine.speculative.max_draft_len", "speculative decoding is off"),
    (("engine.speculative.draft_recipe=d.yaml",), "engine.speculative.draft_recipe", "speculative decoding is off"),
    (SPEC[:1] + SPEC[2:], "engine.speculative.max_draft_len", "needs max_draft_len ≥ 1"),
    (SPEC[:2], "engine.speculative.draft_recipe", "needs a draft model recipe"),
    (("engine.speculative.mode=medusa", "engine.speculative.max_draft_len=63", "engine.speculative.draft_recipe=d.yaml"),
     "engine.speculative.draft_recipe", "does not use a separate draft recipe"),
    (SPEC + ("engine.max_beam_width=2",), "engine.max_beam_width", "max_beam_width: 1"),
    (SPEC + ("engine.use_paged_context_fmha=false", "serving.enable_kv_cache_reuse=false"),
     "engine.use_paged_context_fmha", "needs paged context FMHA"),
    (("target=reference", "hardware.gpu=", "engine.speculative.mode=eagle", "engine.speculative.max_draft_len=63"),
     "engine.speculative.mode", "reference target supports only draft_tokens_external"),
])
def test_rule_speculative_limits(base, sets, key, fragment):
    errors, _ = findings(base, *sets)
    assert fragment in only(errors, key).message


def test_rule_speculative_heads_on_tensorrt_and_beam_without_speculation(base):
    assert findings(base, "engine.speculative.mode=eagle", "engine.speculative.max_draft_len=63")[0] == []
    assert findings(base, "engine.max_beam_width=4")[0] == []


def test_rule_nvfp4_on_reference_target(base):
    errors, _ = findings(base, "target=reference", "quantization.format=nvfp4")
    problem = only(errors, "quantization.format")
    assert "needs a CUDA GPU" in problem.message and "the reference target runs on CPU" in problem.message
    assert "target: tensorrt" in problem.hint
    assert findings(base, "target=reference", "quantization.format=int4_awq",
                    "quantization.calibration.samples=32")[0] == []


def test_rule_tensor_parallel_on_reference_target(base):
    errors, _ = findings(base, "target=reference", "parallelism.tp=2", "hardware.count=2")
    assert "one CPU process" in only(errors, "parallelism").message
    errors, _ = findings(base, "target=reference", "parallelism.pp=2", "hardware.count=2")
    assert only(errors, "parallelism")
    assert findings(base, "target=reference", "parallelism.tp=1") == ([], [])
    assert findings(base, "parallelism.tp=2", "hardware.count=2") == ([], [])  # fine on tensorrt


def test_rule_reference_kv_cache_quantization_warns(base):
    _, warnings = findings(base, "target=reference", "quantization.kv_cache=fp8")
    assert keys(warnings) == ["quantization.kv_cache"]


def test_rule_calibration_limits(base):
    _, warnings = findings(base, "quantization.format=int4_awq", "quantization.calibration.samples=64")
    assert keys(warnings) == ["quantization.calibration.samples"]
    errors, _ = findings(base, "quantization.format=fp8", "quantization.calibration.samples=4",
                         "quantization.calibration.batch_size=8")
    assert "exceeds samples" in only(errors, "quantization.calibration.batch_size").message
    # no quantization, no calibration: nothing to check
    assert findings(base, "quantization.calibration.samples=4", "quantization.calibration.batch_size=8") == ([], [])


def test_rule_errors_name_the_line_of_the_key(write_recipe):
    path = write_recipe(RULES_BASE.replace("format: none", "format: fp8").replace("gpu: H100-SXM", "gpu: A100-80GB"))
    errors, _ = findings(path)
    problem = only(errors, "quantization.format")
    assert problem.origin.file == str(path) and problem.origin.line == 6


def test_schema_error_suppresses_misleading_rule_on_same_key(write_recipe):
    # a bad value is reported once (by the schema), not again by a rule reading the salvaged default
    # (the salvaged default max_num_tokens 8192 < max_input_len 10000 would otherwise fire the rule there)
    errors, _ = findings(write_recipe(RULES_BASE), "engine.max_input_len=10000", "engine.max_num_tokens=lots")
    assert keys(errors) == ["engine.max_num_tokens"] and "valid integer" in errors[0].message
    errors, _ = findings(write_recipe(RULES_BASE), "engine.max_input_len=10000", "engine.max_num_tokens=8192")
    assert keys(errors) == ["engine.max_num_tokens"] and "without chunked context" in errors[0].message


def test_warnings_and_errors_are_distinct_and_strict_promotes_warnings(base):
    errors, warnings = findings(base, "engine.use_fp8_context_fmha=true")
    assert errors == [] and [p.severity for p in warnings] == ["warning"]
    with pytest.raises(RecipeError) as info:
        load_recipe(base, ["engine.use_fp8_context_fmha=true"], strict=True)
    (problem,) = info.value.problems
    assert problem.severity == "error" and problem.message.endswith("(--strict)")
    assert problem.key == "engine.use_fp8_context_fmha"
    load_recipe(base, strict=True)  # no warnings: strict changes nothing


def test_check_rules_orders_errors_first():
    r = recipe_from_dict({"name": "x", "engine": {"use_fp8_context_fmha": True, "tokens_per_block": 48}})
    assert [(p.severity, p.key) for p in check_rules(r)] == [
        ("error", "engine.tokens_per_block"), ("warning", "engine.use_fp8_context_fmha")]
