"""Property-based tests: malformed recipes thrown at the loader and at the CLI never produce a traceback.

Every input either loads or raises :class:`RecipeError` with at least one problem that has a message (the CLI:
exit 0 or 2, never an escaped exception). YAML tags must never run code. Example counts are modest for 2-core
CI: 60 per loader-level property, 15 per CLI-level one.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from conftest import CONFIGS
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kiln.recipe.errors import RecipeError
from kiln.recipe.loader import load_recipe, recipe_from_dict
from kiln.recipe.render import recipe_yaml
from kiln.recipe.schema import Recipe

LOADER = settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CLI = settings(max_examples=15, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

TINY = CONFIGS / "tiny-llama.yaml"
TINY_DATA: dict = yaml.safe_load(TINY.read_text())


def schema_leaves(model: type[BaseModel] = Recipe, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf key of the schema (dotted path → annotation), found from the models themselves."""
    out: dict[tuple[str, ...], Any] = {}
    for name, info in model.model_fields.items():
        if isinstance(info.default, BaseModel):
            out.update(schema_leaves(type(info.default), prefix + (name,)))
        else:
            out[prefix + (name,)] = info.annotation
    return out


LEAVES = schema_leaves()
SECTIONS = sorted({path[:i] for path in LEAVES for i in range(1, len(path))})

# ------------------------------------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63, max_value=10**40).map(lambda n: -n),
    st.integers(min_value=2**63, max_value=10**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["fp8", "none", "paged", "H100", "A100-80GB", "hf:org/name", "yes", "~"]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
key_paths = st.one_of(
    st.sampled_from(sorted(LEAVES)), st.sampled_from(SECTIONS),
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3).map(tuple),  # unknown / misspelled keys
)
mutation = st.tuples(st.sampled_from(["set", "delete"]), key_paths, values)

YAML_TOKENS = ["name:", " x", "\n", "  ", "- ", "[", "]", "{", "}", ": ", ",", "'", '"', "#", "? ", "---",
               "...", "%YAML 1.1\n", "\t", "&a ", "*a", "<<: ", "!!python/object/apply:os.system ['true']",
               "!!binary ", "!!set ", "!!timestamp ", "engine:", "quantization:", "format:", "max_batch_size:",
               "tokens_per_block:", "extends:", " ../x.yaml", "99999999999999999999999", "1e400", ".nan", "-.inf",
               "0x1F", "0o17", "2001-12-14", "null", "true", "\x00", "\ufeff", "\u2028", "é"]
yamlish = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)

DANGEROUS_TAGS = [
    "!!python/object/apply:os.system", "!!python/object/apply:subprocess.call", "!!python/object/new:os.system",
    "!!python/name:os.system", "!!python/module:os", "!!python/object:__main__.X",
    "tag:yaml.org,2002:python/object/apply:os.system", "!python/object/apply:os.system",
    "!<!python/object/apply:os.system>",
]


def apply_mutation(data: dict, op: str, path: tuple[str, ...], value: Any) -> None:
    node = data
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    if op == "delete":
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def assert_loads_or_reports(path: Path) -> None:
    """The property: a Recipe, or a RecipeError whose problems all carry a message and a severity."""
    try:
        loaded = load_recipe(path)
    except RecipeError as exc:
        assert exc.problems, "RecipeError without problems"
        assert exc.errors, "RecipeError without an error"
        for p in exc.problems:
            assert p.message.strip() and p.severity in ("error", "warning")
            assert p.format().strip()
        return
    assert isinstance(loaded.recipe, Recipe)


def assert_cli_ok_or_bad_input(result) -> None:
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert "error" in result.output


# ------------------------------------------------------------------------------------------- loader level


@LOADER
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_recipe_loads_or_reports(tmp_path, mutations):
    data = yaml.safe_load(TINY.read_text())
    for op, path, value in mutations:
        apply_mutation(data, op, path, value)
    file = tmp_path / "mutated.yaml"
    file.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    assert_loads_or_reports(file)


@LOADER
@given(text=st.one_of(yamlish, st.text(max_size=200)))
@example(text="!!timestamp ")  # found by this test: PyYAML raised AttributeError
@example(text="name: x\nengine: &a {x: *a}\n")  # recursive anchor
@example(text="name: x\nmodel: " + "[" * 700 + "]" * 700 + "\n")
@example(text="name: x\nengine:\n  max_batch_size: " + "9" * 5000 + "\n")
def test_arbitrary_text_loads_or_reports(tmp_path, text):
    file = tmp_path / "text.yaml"
    file.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert_loads_or_reports(file)


@LOADER
@given(blob=st.binary(max_size=300))
def test_binary_garbage_is_reported(tmp_path, blob):
    file = tmp_path / "blob.yaml"
    file.write_bytes(blob)
    assert_loads_or_reports(file)


@LOADER
@given(root=values.filter(lambda v: not isinstance(v, dict)))
def test_non_mapping_roots_are_errors(tmp_path, root):
    file = tmp_path / "root.yaml"
    file.write_text(yaml.safe_dump(root), encoding="utf-8")
    with pytest.raises(RecipeError, match="must be a mapping|recipe file is empty") as info:
        load_recipe(file)
    assert info.value.problems[0].origin.file == str(file)


@LOADER
@given(tag=st.sampled_from(DANGEROUS_TAGS), where=st.sampled_from(["root", "section", "value", "key", "set"]))
def test_python_tags_never_execute(tmp_path, tag, where):
    marker = tmp_path / "pwned"
    marker.unlink(missing_ok=True)
    payload = f"{tag} ['touch {marker}']" if "name:" not in tag and "module" not in tag else tag
    text = {"root": f"{payload}\n",
            "section": f"name: x\nmodel: {payload}\n",
            "value": f"name: x\nengine:\n  max_batch_size: {payload}\n",
            "key": f"name: x\n? {payload}\n: 1\n",
            "set": "name: x\n"}[where]
    file = tmp_path / "tagged.yaml"
    file.write_text(text, encoding="utf-8")
    overrides = [f"name={payload}"] if where == "set" else []
    with pytest.raises(RecipeError) as info:
        load_recipe(file, overrides)
    assert info.value.errors
    assert not marker.exists(), "a YAML tag ran code"


@settings(LOADER, max_examples=30)  # big inputs: PyYAML's pure-Python scanner is quadratic in nesting
@given(depth=st.one_of(st.integers(min_value=1, max_value=50), st.sampled_from([300, 520])),
       style=st.sampled_from(["flow_list", "flow_map", "block_map", "block_list"]),
       section=st.sampled_from(["model", "engine", "serving", "quantization"]))
def test_deeply_nested_structures_are_errors(tmp_path, depth, style, section):
    # past ~500 levels PyYAML's composer hits Python's recursion limit: that must be a RecipeError too
    if style == "flow_list":
        body = " " + "[" * depth + "]" * depth + "\n"
    elif style == "flow_map":
        body = " " + "{a: " * depth + "1" + "}" * depth + "\n"
    elif style == "block_map":
        body = "\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(depth)) + "  " * (depth + 1) + "v\n"
    else:
        body = "\n" + "".join("  " * (i + 1) + "-\n" for i in range(depth)) + "  " * (depth + 1) + "v\n"
    file = tmp_path / "deep.yaml"
    file.write_text(f"name: x\n{section}:{body}", encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert info.value.errors and all(p.message for p in info.value.problems)


def flow(value: Any) -> str:
    """A scalar as one line of YAML."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


one_line_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                             st.sampled_from(["fp8", "a b", "'q'", "x: y", "# not a comment", ""]))


@LOADER
@given(section=st.sampled_from([None, "engine", "serving", "quantization.calibration"]),
       key=st.sampled_from(["max_batch_size", "streaming", "samples", "description", "zzz"]),
       first=one_line_scalars, second=one_line_scalars, gap=st.integers(min_value=0, max_value=3))
def test_duplicate_keys_are_reported_with_the_second_line(tmp_path, section, key, first, second, gap):
    indent = "" if section is None else "  " * len(section.split("."))
    head = "" if section is None else "".join("  " * i + f"{part}:\n" for i, part in enumerate(section.split(".")))
    lines = ["name: dup"] + head.splitlines() + [f"{indent}{key}: {flow(first)}"] + \
            [f"{indent}other{i}: 1" for i in range(gap)] + [f"{indent}{key}: {flow(second)}"]
    file = tmp_path / "dup.yaml"
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    dotted = key if section is None else f"{section}.{key}"
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert [(p.key, p.message, p.origin.line) for p in info.value.problems] == [
        (dotted, "duplicate key", len(lines))]


def _unwrap(ann: Any) -> Any:
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    return ann


def _is_int_field(ann: Any) -> bool:
    ann = _unwrap(ann)
    if typing.get_origin(ann) is typing.Union:
        return any(_unwrap(a) is int for a in typing.get_args(ann))
    return ann is int


INT_LEAVES = sorted(path for path, ann in LEAVES.items() if _is_int_field(ann))


@LOADER
@given(path=st.sampled_from(INT_LEAVES),
       number=st.one_of(st.integers(min_value=2**63, max_value=10**30), st.integers(min_value=-(10**30), max_value=-1)),
       digits=st.integers(min_value=0, max_value=6000))
def test_huge_numbers_are_errors(tmp_path, path, number, digits):
    text = "9" * digits if digits > 4300 else str(number)  # > 4300 digits: past Python's int-parsing limit
    lines = ["name: huge"] + ["  " * i + f"{part}:" for i, part in enumerate(path[:-1])]
    lines.append("  " * (len(path) - 1) + f"{path[-1]}: {text}")
    file = tmp_path / "huge.yaml"
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        load_recipe(file)
    assert info.value.errors


@LOADER
@given(item=st.one_of(st.text(max_size=40),
                      st.tuples(st.sampled_from([".".join(p) for p in sorted(LEAVES)]), yamlish | st.text(max_size=30))
                      .map(lambda kv: f"{kv[0]}={kv[1]}")))
@example(item="name=!!timestamp")  # found by this test: PyYAML raised AttributeError
@example(item="name=" + "[" * 700)
@example(item="engine.max_batch_size=" + "9" * 5000)
@example(item="name.x=3")
def test_arbitrary_set_items_load_or_report(item):
    try:
        load_recipe(TINY, [item])
    except RecipeError as exc:
        assert exc.errors and all(p.message for p in exc.problems)


# ----------------------------------------------------------------------- valid recipes render back equal


SOURCES = {"source": ["builtin:tiny-llama", "hf:meta-llama/Llama-3.1-8B-Instruct", "./models/local dir", "/abs/m"],
           "tokenizer": ["builtin:tiny-llama", "hf:org/tok@v1.0", "tok/dir"],
           "dataset": ["builtin:tiny-llama-calib", "builtin:tiny-llama-heldout", "hf:abisee/cnn_dailymail",
                       "data/calib.jsonl"]}
texts = st.text(st.characters(blacklist_categories=["Cs"]), max_size=30)


def value_strategy(name: str, ann: Any) -> st.SearchStrategy:
    ann = _unwrap(ann)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is typing.Union:
        return st.one_of(*(st.none() if a is type(None) else value_strategy(name, a) for a in args))
    if origin is tuple:
        return st.lists(value_strategy(name, args[0]), max_size=3)
    if ann is bool:
        return st.booleans()
    if ann is int:
        return st.integers(min_value=8, max_value=64)
    if ann is float:
        return st.floats(min_value=0.01, max_value=1.0)
    if name == "name":
        return st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)
    if name in SOURCES:
        return st.sampled_from(SOURCES[name])
    if name == "extends":
        return st.none()
    return texts


@st.composite
def valid_recipe_dicts(draw) -> dict:
    data: dict = {"name": draw(value_strategy("name", str))}
    chosen = draw(st.lists(st.sampled_from(sorted(LEAVES)), max_size=12, unique=True))
    for path in chosen:
        apply_mutation(data, "set", path, draw(value_strategy(path[-1], LEAVES[path])))
    return data


@LOADER
@given(data=valid_recipe_dicts())
def test_valid_recipes_render_back_equal(data):
    try:
        recipe = recipe_from_dict(data)
    except RecipeError as exc:  # the schema may still refuse a combination: then it must say why
        assert exc.errors
        return
    assert recipe_from_dict(yaml.safe_load(recipe_yaml(recipe))) == recipe
    assert recipe_from_dict(yaml.safe_load(recipe_yaml(recipe, docs=True))) == recipe


# ------------------------------------------------------------------------------------------- CLI level

HF_BASE = """\
name: fuzz-base
target: tensorrt
model:
  source: hf:meta-llama/Llama-3.1-8B-Instruct
hardware:
  gpu: H100-SXM
"""


@CLI
@given(text=st.one_of(yamlish, st.text(max_size=120)), command=st.sampled_from(["validate", "show"]))
def test_cli_arbitrary_file_exits_0_or_2(kiln, tmp_path, text, command):
    file = tmp_path / "cli.yaml"
    file.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert_cli_ok_or_bad_input(kiln(command, file))


@CLI
@given(mutations=st.lists(mutation.filter(lambda m: m[1][:1] != ("hardware",) and m[1] != ("model", "source")),
                          min_size=1, max_size=3))
def test_cli_mutated_recipe_exits_0_or_2(kiln, tmp_path, mutations):
    data = yaml.safe_load(TINY.read_text())  # reference target: validate never builds a model
    for op, path, value in mutations:
        apply_mutation(data, op, path, value)
    file = tmp_path / "cli-mutated.yaml"
    file.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    assert_cli_ok_or_bad_input(kiln("validate", file))


@CLI
@given(items=st.lists(
    st.one_of(st.text(max_size=30),
              st.tuples(st.sampled_from([".".join(p) for p in sorted(LEAVES) if p != ("model", "source")]),
                        yamlish | st.text(max_size=20)).map(lambda kv: f"{kv[0]}={kv[1]}")),
    min_size=1, max_size=3), strict=st.booleans())
@example(items=["name=!!timestamp"], strict=False)
def test_cli_arbitrary_set_exits_0_or_2(kiln, tmp_path, items, strict):
    base = tmp_path / "hf-base.yaml"
    base.write_text(HF_BASE, encoding="utf-8")  # an hf: model: validate plans with the shipped config, no build
    args = ["validate", str(base)] + [a for item in items for a in ("--set", item)] + (["--strict"] if strict else [])
    assert_cli_ok_or_bad_input(kiln(*args))


@CLI
@given(blob=st.binary(max_size=200), tag=st.sampled_from(DANGEROUS_TAGS))
def test_cli_binary_and_tags_exit_2(kiln, tmp_path, blob, tag):
    marker = tmp_path / "cli-pwned"
    file = tmp_path / "cli-bad.yaml"
    file.write_bytes(blob + f"\nname: x\nmodel: {tag} ['touch {marker}']\n".encode())
    result = kiln("validate", file)
    assert_cli_ok_or_bad_input(result)
    assert result.exit_code == 2
    assert not marker.exists()
