"""The Triton repository writer and `kiln lint`: every shipped recipe packages into a repository that parses into
Triton's real schema and lints clean; deliberately broken repositories produce the right finding."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kiln.cli.main import cli
from kiln.recipe.catalog import configs_dir, list_recipes
from kiln.recipe.loader import load_recipe, recipe_from_dict
from kiln.triton.lint import lint_repository
from kiln.triton.repository import (
    SHARED_MODEL_MODULES,
    RepoInputs,
    install_python_model,
    models_source,
    standin_engine_config,
    write_repository,
)
from kiln.triton.upstream import MODELS

SHIPPED = [e.path for e in list_recipes(configs_dir())]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "pad_token": "<pad>", "unk_token": "<unk>"}))
    return d


def make_inputs(recipe, tmp: Path, tokenizer_dir: Path, version: str, recipe_path: Path | None = None) -> RepoInputs:
    """Stand-ins for what the pipeline hands the writer: an engine config made from the recipe, a checkpoint dir."""
    seq = recipe.engine.max_seq_len or 4096
    tmp.mkdir(parents=True, exist_ok=True)
    engine = tmp / "engine"
    engine.mkdir(parents=True, exist_ok=True)
    if recipe.target == "tensorrt":
        cfg = standin_engine_config(recipe, seq, version=version)
        for rank in range(recipe.parallelism.tp * recipe.parallelism.pp):
            (engine / f"rank{rank}.engine").write_bytes(b"stand-in")
    else:
        cfg = standin_engine_config(recipe, seq)
    (engine / "config.json").write_text(json.dumps(cfg))
    ckpt = tmp / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "config.json").write_text("{}")
    versions = {"tensorrt_llm": version, "tensorrt": "10.14.1.48"} if recipe.target == "tensorrt" else {}
    draft = None
    if recipe.engine.speculative.draft_recipe and recipe_path is not None:
        draft_recipe = load_recipe(recipe_path.parent / recipe.engine.speculative.draft_recipe).recipe
        draft = make_inputs(draft_recipe, tmp / "draft", tokenizer_dir, version)
    return RepoInputs(recipe, tokenizer_dir, engine, ckpt, "fp", versions, draft)


def make_repo(recipe, tmp: Path, tokenizer_dir: Path, *, version: str = "1.2.1", recipe_path: Path | None = None) -> Path:
    """Package `recipe` with a stand-in engine config (for GPU recipes) and a stand-in checkpoint dir."""
    inputs = make_inputs(recipe, tmp, tokenizer_dir, version, recipe_path)
    out = tmp / "repo" / recipe.name
    out.mkdir(parents=True)
    write_repository(inputs, out, recipe.engine.max_seq_len or 4096)
    return out


def parse(path: Path):
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), cfg)
    return cfg


@pytest.mark.parametrize("recipe_path", SHIPPED, ids=[str(p.relative_to(configs_dir())) for p in SHIPPED])
def test_every_shipped_recipe_packages_into_a_clean_repository(recipe_path, tmp_path, tokenizer_dir):
    recipe = load_recipe(recipe_path).recipe
    repo = make_repo(recipe, tmp_path, tokenizer_dir, recipe_path=recipe_path)
    configs = sorted(repo.glob("*/config.pbtxt"))
    assert {p.parent.name for p in configs} >= {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble",
                                                "tensorrt_llm_bls"}
    for p in configs:
        cfg = parse(p)  # Triton's real schema; raises on unknown fields, bad enums, wrong types
        assert cfg.name == p.parent.name and cfg.max_batch_size == recipe.engine.max_batch_size
        assert "${" not in p.read_text()
    findings = lint_repository(repo)
    assert [f.format() for f in findings if f.severity == "error"] == []
    assert_python_models_shipped_whole(repo)
    info = json.loads((repo / "kiln.json").read_text())
    assert info["recipe"] == recipe.name and info["target"] == recipe.target
    trt = parse(repo / "tensorrt_llm" / "config.pbtxt")
    assert trt.model_transaction_policy.decoupled == recipe.serving.streaming
    if recipe.target == "tensorrt":
        assert trt.backend == "tensorrtllm"
        assert info["container"].startswith("nvcr.io/nvidia/tritonserver:") and "trtllm-python-py3" in info["container"]
        params = {k: v.string_value for k, v in trt.parameters.items()}
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["batch_scheduler_policy"] == recipe.serving.scheduler_policy
        assert params["enable_chunked_context"] == str(recipe.serving.enable_chunked_context).lower()
        assert float(params["kv_cache_free_gpu_mem_fraction"]) == recipe.serving.kv_cache_free_gpu_mem_fraction
        for required in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
            assert required in params  # the backend reads these unguarded
        # the full upstream tensorrt_llm contract on the real backend
        assert {t.name for t in trt.input} == {t.name for t in MODELS["tensorrt_llm"].inputs}
    else:
        assert trt.backend == "python"
    if recipe.engine.speculative.mode == "draft_tokens_external":
        assert (repo / "tensorrt_llm_draft" / "config.pbtxt").is_file()
        bls = parse(repo / "tensorrt_llm_bls" / "config.pbtxt")
        assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == "tensorrt_llm_draft"


def test_ensemble_keeps_the_client_contract(tmp_path, tokenizer_dir):
    recipe = load_recipe(configs_dir() / "tiny-llama.yaml").recipe
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    ens = parse(repo / "ensemble" / "config.pbtxt")
    inputs = {t.name: model_config_pb2.DataType.Name(t.data_type) for t in ens.input}
    for name, dtype in {"text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "bad_words": "TYPE_STRING",
                        "stop_words": "TYPE_STRING", "stream": "TYPE_BOOL", "temperature": "TYPE_FP32",
                        "top_k": "TYPE_INT32", "top_p": "TYPE_FP32", "seed": "TYPE_UINT64",
                        "end_id": "TYPE_INT32", "pad_id": "TYPE_INT32"}.items():
        assert inputs[name] == dtype
    assert "text_output" in {t.name for t in ens.output}
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["preprocessing", "tensorrt_llm", "postprocessing"]


def _tensors(config, kind: str) -> list[tuple]:
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), tuple(t.dims), getattr(t, "optional", False),
             tuple(t.reshape.shape) if t.HasField("reshape") else None) for t in getattr(config, kind)]


@pytest.mark.parametrize("recipe_name", ["tiny-llama.yaml", "llama-3.1-8b/fp8.yaml"])  # reference, tensorrt
def test_every_model_declares_upstreams_whole_tensor_lists(tmp_path, tokenizer_dir, recipe_name):
    """Names, types, dims, optional flags and reshapes exactly as upstream's configs, for every target: existing
    clients send any of them (issue 12: kiln once declared 14 of preprocessing's 34 tensors). The reference
    target's tensorrt_llm adds kiln's prompt-scoring tensors after upstream's (PROMPT_SCORING, and nothing else);
    the inputs preprocessing checks itself are optional (CHECKED_BY_PREPROCESSING, and nothing else)."""
    from kiln.triton.repository import CHECKED_BY_PREPROCESSING, FILLED_TYPES, PROMPT_SCORING

    recipe = load_recipe(configs_dir() / recipe_name).recipe
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    scoring_in, scoring_out = PROMPT_SCORING
    extension = {"input": [(scoring_in, "TYPE_BOOL", (1,), True, ())],
                 "output": [(name, dtype, (-1,), False, None) for name, dtype in scoring_out]}
    for name in ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"):
        config = parse(repo / name / "config.pbtxt")
        up = MODELS[name]
        for kind, specs in (("input", up.inputs), ("output", up.outputs)):
            expected = [(t.name, FILLED_TYPES.get(t.data_type, t.data_type), t.dims,
                         (t.optional or t.name in CHECKED_BY_PREPROCESSING.get(name, ())) if kind == "input"
                         else False, t.reshape) for t in specs]
            if name == "tensorrt_llm" and recipe.target == "reference":
                expected += extension[kind]
            assert _tensors(config, kind) == expected, f"{name} {kind}s differ from upstream's"


def assert_python_models_shipped_whole(repo: Path) -> list[str]:
    """Every Python model's version directory holds the shared helper and every module its model.py imports
    from kiln's model sources, each byte-identical to the source; no model imports kiln. Returns the models."""
    src = models_source()
    shipped = {p.name for p in src.rglob("*.py") if p.name != "__init__.py" and p.name != "model.py"}
    python_models = [p.parent for p in repo.glob("*/config.pbtxt") if parse(p).backend == "python"]
    for model in python_models:
        version = model / "1"
        for name in SHARED_MODEL_MODULES:
            assert (version / name).read_bytes() == (src / name).read_bytes(), f"{model.name}: {name} differs"
        tree = ast.parse((version / "model.py").read_text(encoding="utf-8"))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "kiln" not in imported, f"{model.name}/1/model.py imports kiln"
        for module in sorted(imported & {Path(n).stem for n in shipped}):
            copy = version / f"{module}.py"
            assert copy.is_file(), f"{model.name}/1/model.py imports {module}, which is not shipped beside it"
            source = next(p for p in src.rglob(f"{module}.py"))
            assert copy.read_bytes() == source.read_bytes(), f"{model.name}: {module}.py differs from {source}"
        model_py = next(p for p in src.glob("*/model.py") if p.read_bytes() == (version / "model.py").read_bytes())
        assert model_py.parent.name in {"preprocessing", "postprocessing", "reference", "bls"}
    return sorted(m.name for m in python_models)


def test_every_python_model_ships_with_its_helper_byte_identical(tmp_path, tokenizer_dir):
    recipe = load_recipe(configs_dir() / "tiny-llama.yaml").recipe  # reference target: four Python models
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    models = assert_python_models_shipped_whole(repo)
    assert models == ["postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    helper = repo / "preprocessing" / "1" / "kiln_triton_utils.py"
    helper.write_bytes(helper.read_bytes() + b"# drifted\n")
    with pytest.raises(AssertionError, match="preprocessing: kiln_triton_utils.py differs"):
        assert_python_models_shipped_whole(repo)


def test_install_python_model_writes_what_the_model_imports(tmp_path):
    written = install_python_model("postprocessing", tmp_path / "post")
    assert sorted(p.name for p in written) == ["kiln_triton_utils.py", "model.py"]
    assert all(p.parent == tmp_path / "post" / "1" for p in written)
    # the copy imports as the stub imports it: from its version directory, without kiln
    code = ("import sys, types; sys.modules['triton_python_backend_utils'] = types.ModuleType('stub'); "
            f"sys.path.insert(0, {str(tmp_path / 'post' / '1')!r}); import kiln_triton_utils; "
            "assert kiln_triton_utils.__file__.startswith(sys.path[0]); "
            "assert not any(m == 'kiln' or m.startswith('kiln.') for m in sys.modules)")
    import subprocess

    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------- broken repositories


@pytest.fixture
def gpu_repo(tmp_path, tokenizer_dir) -> Path:
    recipe = load_recipe(configs_dir() / "llama-3.1-8b" / "fp8.yaml").recipe
    return make_repo(recipe, tmp_path, tokenizer_dir)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert re.search(old, text), f"{old!r} not in {path}"
    path.write_text(re.sub(old, new, text, count=1))


def errors(repo: Path) -> list[str]:
    return [f.format() for f in lint_repository(repo) if f.severity == "error"]


def test_placeholder_left(gpu_repo):
    """An unfilled parameter the backend reads with no fallback is an error; one with a fallback is a warning that
    names the default (graded by triton/data/upstream_parameters.yaml)."""
    edit(gpu_repo / "tensorrt_llm" / "config.pbtxt", r'string_value: "guaranteed_no_evict"',
         'string_value: "${batch_scheduler_policy}"')
    edit(gpu_repo / "tensorrt_llm" / "config.pbtxt", r'string_value: "/models/tensorrt_llm/1/engine"',
         'string_value: "${engine_dir}"')
    found = lint_repository(gpu_repo)
    errs = [f.format() for f in found if f.severity == "error"]
    assert len(errs) == 1 and "unfilled parameter gpt_model_path (${engine_dir})" in errs[0], errs
    assert "tensorrt_llm/config.pbtxt:" in errs[0] and "model_instance_state.cc:746" in errs[0]
    warns = [f.format() for f in found if f.severity == "warning" and "${batch_scheduler_policy}" in f.message]
    assert len(warns) == 1 and "default: guaranteed_no_evict" in warns[0], warns


def test_batch_size_above_engine(gpu_repo):
    edit(gpu_repo / "tensorrt_llm" / "config.pbtxt", r"max_batch_size: 256", "max_batch_size: 512")
    assert any("max_batch_size 512 exceeds the engine's 256" in f for f in errors(gpu_repo))


def test_ensemble_maps_missing_tensor(gpu_repo):
    edit(gpu_repo / "ensemble" / "config.pbtxt", r'key: "runtime_top_k"', 'key: "runtime_top_kk"')
    assert any("'runtime_top_kk', which tensorrt_llm does not declare as an input" in f for f in errors(gpu_repo))


def test_ensemble_maps_to_missing_model(gpu_repo):
    shutil.rmtree(gpu_repo / "postprocessing")
    assert any("model 'postprocessing', which is not in the repository" in f for f in errors(gpu_repo))


def test_streaming_without_decoupled(gpu_repo):
    edit(gpu_repo / "tensorrt_llm" / "config.pbtxt", r"decoupled: true", "decoupled: false")
    found = errors(gpu_repo)
    assert any("streams tokens (serving.streaming) but tensorrt_llm is not decoupled" in f for f in found)
    assert any("tensorrt_llm_bls is decoupled but tensorrt_llm is not" in f for f in found)


def test_kv_reuse_without_paged_context_fmha(gpu_repo):
    cfg_path = gpu_repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["build_config"]["plugin_config"]["use_paged_context_fmha"] = False
    cfg_path.write_text(json.dumps(cfg))
    found = errors(gpu_repo)
    assert any("enable_kv_cache_reuse is on but the engine was built without paged context FMHA" in f for f in found)
    assert any("enable_chunked_context is on" in f for f in found)


def test_kv_reuse_with_an_int8_kv_cache_engine(gpu_repo):
    """TensorRT-LLM turns paged context FMHA off with an INT8 KV cache (the format registry's
    disables_paged_context_fmha): KV reuse on such an engine is an error."""
    cfg_path = gpu_repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pretrained_config"].setdefault("quantization", {})["kv_cache_quant_algo"] = "int8"
    cfg_path.write_text(json.dumps(cfg))
    assert any("enable_kv_cache_reuse is on but the engine's INT8 KV cache disables paged context FMHA" in f
               for f in errors(gpu_repo))


def test_tokenizer_missing(gpu_repo):
    shutil.rmtree(gpu_repo / "preprocessing" / "1" / "tokenizer")
    assert any("[preprocessing] tokenizer directory" in f and "does not exist" in f for f in errors(gpu_repo))


def test_tokenizer_unloadable(gpu_repo):
    (gpu_repo / "postprocessing" / "1" / "tokenizer" / "tokenizer.json").write_text("{not json")
    assert any("[postprocessing] tokenizer in" in f and "does not load" in f for f in errors(gpu_repo))


def test_unknown_field_and_bad_enum_are_reported_with_line(gpu_repo):
    edit(gpu_repo / "postprocessing" / "config.pbtxt", r'backend: "python"', 'backend: "python"\nmax_batch_sise: 4')
    found = errors(gpu_repo)
    assert any("postprocessing/config.pbtxt:" in f and "does not parse" in f and "max_batch_sise" in f for f in found)


def test_engine_version_vs_container(gpu_repo):
    cfg_path = gpu_repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["version"] = "1.1.0"
    cfg_path.write_text(json.dumps(cfg))
    assert any("built with TensorRT-LLM 1.1.0" in f and "kSERIALIZATION_VERSION" in f for f in errors(gpu_repo))


def test_lint_cli_exit_codes(gpu_repo):
    runner = CliRunner()
    ok = runner.invoke(cli, ["lint", str(gpu_repo)])
    assert ok.exit_code == 0, ok.output
    edit(gpu_repo / "tensorrt_llm" / "config.pbtxt", r"max_batch_size: 256", "max_batch_size: 512")
    bad = runner.invoke(cli, ["lint", str(gpu_repo)])
    assert bad.exit_code == 1 and "exceeds the engine's 256" in bad.output


def test_hand_made_upstream_style_repository_is_linted(tmp_path, tokenizer_dir):
    """A repository filled from upstream templates by hand, with absolute paths and one placeholder left."""
    recipe = recipe_from_dict({"name": "hand", "target": "tensorrt"})
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    (repo / "kiln.json").unlink()
    engine = repo / "tensorrt_llm" / "1" / "engine"
    edit(repo / "tensorrt_llm" / "config.pbtxt", r'string_value: "/models/tensorrt_llm/1/engine"',
         f'string_value: "{engine}"')
    edit(repo / "preprocessing" / "config.pbtxt", r'string_value: "1/tokenizer"', f'string_value: "{tokenizer_dir}"')
    edit(repo / "postprocessing" / "config.pbtxt", r'string_value: "true"', 'string_value: "${skip_special_tokens}"')
    assert errors(repo) == []
    warns = [f.format() for f in lint_repository(repo) if f.severity == "warning" and "${skip_special_tokens}" in f.message]
    assert len(warns) == 1 and "default: True" in warns[0] and "postprocessing/1/model.py:59" in warns[0]


def test_lint_reads_boolean_parameters_as_the_models_do(gpu_repo):
    """kiln lint and the Python models share kiln_triton_utils.parse_bool: 'on' is on, 'off' is off."""
    cfg_path = gpu_repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["build_config"]["plugin_config"]["use_paged_context_fmha"] = False
    cfg_path.write_text(json.dumps(cfg))
    pbtxt = gpu_repo / "tensorrt_llm" / "config.pbtxt"
    edit(pbtxt, r'(key: "enable_kv_cache_reuse"\s*value \{\s*string_value: )"true"', r'\1"on"')
    edit(pbtxt, r'(key: "enable_chunked_context"\s*value \{\s*string_value: )"true"', r'\1"off"')
    found = errors(gpu_repo)
    assert any("enable_kv_cache_reuse is on but the engine was built without paged context FMHA" in f for f in found)
    assert not any("enable_chunked_context is on" in f for f in found), found


def test_package_fingerprint_covers_the_shared_helper(tmp_path, monkeypatch):
    """The package step re-runs when a shipped Python model or the helper shipped beside them changes."""
    import kiln.triton.repository as repository
    from kiln.steps import package

    copy = tmp_path / "models"
    shutil.copytree(models_source(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(repository, "models_source", lambda: copy)
    loaded = load_recipe(configs_dir() / "tiny-llama.yaml")
    before = package._sources_hash(loaded)
    helper = copy / "kiln_triton_utils.py"
    helper.write_text(helper.read_text(encoding="utf-8") + "\n# changed\n", encoding="utf-8")
    assert package._sources_hash(loaded) != before


def test_a_chat_template_is_written_for_a_tokenizer_without_one(tmp_path, tokenizer_dir):
    """kiln's template for builtin:tiny-llama arrives at package time (RepoInputs.chat_template); a tokenizer that
    has its own keeps it."""
    import dataclasses

    recipe = load_recipe(configs_dir() / "tiny-llama.yaml").recipe
    inputs = dataclasses.replace(make_inputs(recipe, tmp_path / "a", tokenizer_dir, "1.2.1"), chat_template="T")
    out = tmp_path / "a" / "repo"
    out.mkdir()
    write_repository(inputs, out, 512)
    for model in ("preprocessing", "postprocessing"):
        assert (out / model / "1" / "tokenizer" / "chat_template.jinja").read_text() == "T"
    own = tmp_path / "own-tok"
    shutil.copytree(tokenizer_dir, own)
    (own / "chat_template.jinja").write_text("OWN")
    inputs = dataclasses.replace(inputs, tokenizer_dir=own)
    out = tmp_path / "b"
    out.mkdir()
    write_repository(inputs, out, 512)
    assert (out / "preprocessing" / "1" / "tokenizer" / "chat_template.jinja").read_text() == "OWN"


def test_package_writes_tiny_llamas_chat_template_and_fingerprints_it(monkeypatch):
    from kiln.steps import package

    loaded = load_recipe(configs_dir() / "tiny-llama.yaml")
    before = package._sources_hash(loaded)["chat_template"]
    monkeypatch.setattr(package, "builtin_chat_template", lambda source: "changed")
    assert package._sources_hash(loaded)["chat_template"] != before, "a template change re-runs the package step"
