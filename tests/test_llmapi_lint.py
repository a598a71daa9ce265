"""`kiln lint` on Triton llmapi repositories (target pytorch): a repository kiln writes is clean, and each way a
hand-edited one goes wrong is an error naming the file, the line and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.recipe.loader import load_recipe
from kiln.triton.lint import lint_repository
from kiln.util.errors import InputError
from kiln.triton.llmapi_repository import write_llmapi_repository
from tests.standins import llmapi_repository
from triton_harness import load_model_module, pb_utils  # noqa: F401 - pb_utils is a fixture

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """An llmapi repository as kiln packages it, over a stand-in checkpoint (config.json and hf_quant_config.json
    only: lint reads no weights)."""
    return llmapi_repository(tmp_path, "W4A16_AWQ", ["target=pytorch"])


def _errors(repo: Path) -> list[str]:
    return [f.format() for f in lint_repository(repo) if f.severity == "error"]


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_a_packaged_llmapi_repository_lints_clean(repo: Path) -> None:
    assert [f.format() for f in lint_repository(repo)] == []


@pytest.mark.parametrize("file, old, new, needle", [
    ("config.pbtxt", "decoupled: true", "decoupled: false", "decoupled is False but model.yaml triton_config"),
    ("config.pbtxt", 'name: "tensorrt_llm"\n', 'name: "tensorrt_llm"\nmax_batch_size: 8\n',
     "max_batch_size is 8 but model.yaml triton_config says 0"),
    ("1/model.yaml", "max_batch_size: 0", "max_batch_size: 8", "triton_config.max_batch_size: 8, but the llmapi"),
    ("1/model.yaml", "enable_chunked_prefill: false", "enable_chunked_context: false",
     "enable_chunked_context: unknown key (not an LLM argument of TensorRT-LLM 1.2.1)"),
    ("1/model.yaml", "  tokens_per_block: 32", "  tokens_per_block: '32'", "kv_cache_config.tokens_per_block"),
    ("1/model.yaml", "decoupled: true", "decoupled: [true", "not valid YAML"),
    ("1/model.yaml", "model: checkpoint", "model: missing_dir", "has no config.json"),
    ("1/checkpoint/hf_quant_config.json", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL",
     "the checkpoint is int8_sq: the pytorch target does not run INT8 SmoothQuant"),
    ("config.pbtxt", 'name: "sampling_param_max_tokens"\n  data_type: TYPE_INT32',
     'name: "sampling_param_max_tokens"\n  data_type: TYPE_INT64',
     "input sampling_param_max_tokens is TYPE_INT64 [1], the llmapi contract says TYPE_INT32 [1]"),
])
def test_each_mistake_is_an_error_with_its_place_and_fix(repo: Path, file: str, old: str, new: str,
                                                         needle: str) -> None:
    _edit(repo / "tensorrt_llm" / file, old, new)
    errors = _errors(repo)
    assert any(needle in e for e in errors), errors
    assert all("fix:" in e for e in errors if needle in e)


def test_findings_name_the_line(repo: Path) -> None:
    _edit(repo / "tensorrt_llm" / "1" / "model.yaml", "enable_chunked_prefill: false", "enable_chunked_context: false")
    line = next(i for i, text in enumerate((repo / "tensorrt_llm" / "1" / "model.yaml").read_text().splitlines(), 1)
                if text.startswith("enable_chunked_context"))
    assert any(f"model.yaml:{line}:" in e for e in _errors(repo))


def test_an_upstream_style_hub_model_is_a_warning_not_an_error(repo: Path) -> None:
    _edit(repo / "tensorrt_llm" / "1" / "model.yaml", "model: checkpoint", "model: TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    findings = lint_repository(repo)
    assert not [f for f in findings if f.severity == "error"]
    assert any("is a hub id" in f.message for f in findings)


def test_draft_target_decoding_ships_the_draft_checkpoint_and_names_it_in_both_configs(tmp_path: Path) -> None:
    """Draft-target speculative decoding on target pytorch: the draft's unified checkpoint beside the target's, named
    by speculative_config in model.yaml (relative) and in the trtllm-serve options (the container path)."""
    import yaml

    from kiln.triton.llmapi import check_llm_args
    from kiln.triton.llmapi_repository import write_trtllm_serve_files

    ckpts = {}
    for name in ("unified", "draft"):
        ckpts[name] = tmp_path / name
        ckpts[name].mkdir()
        (ckpts[name] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    recipe = load_recipe(REPO_ROOT / "configs" / "speculative" / "target-llama-3.1-8b.yaml",
                         ["target=pytorch", "serving.llmapi_runtime=tensorrt_llm"]).recipe
    out = tmp_path / "repo"
    out.mkdir()
    info = write_llmapi_repository(recipe, ckpts["unified"], out, 8192, draft_checkpoint=ckpts["draft"])
    version = out / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    assert data["speculative_config"] == {"decoding_type": "Draft_Target", "max_draft_len": 4,
                                          "speculative_model_dir": "draft_checkpoint"}
    assert (version / "draft_checkpoint" / "config.json").is_file()
    assert not [f for f in lint_repository(out) if f.severity == "error"]
    deploy = tmp_path / "deploy"
    write_trtllm_serve_files(recipe, info, deploy)
    options = yaml.safe_load((deploy / "trtllm-serve" / "llm_options.yaml").read_text())
    assert options["speculative_config"]["speculative_model_dir"] == "/models/tensorrt_llm/1/draft_checkpoint"
    assert check_llm_args({**options, "model": "x"}) == []
    assert info["container"] and info["server_command"][0] == "tritonserver"


def test_an_eagle3_head_reaches_the_server_as_a_packaged_folder(tmp_path: Path, pb_utils, monkeypatch) -> None:
    """mode eagle on target pytorch: the head is linked into the repository (`eagle_head`, named relative in
    model.yaml, by its container path for trtllm-serve/Dynamo, which run with the hub offline): a local folder as it
    is, a hub head downloaded at its revision by the package step. Unpackaged (the CPU reference runtime) a hub head
    is written as TensorRT-LLM's Hub id (`org/name`, never kiln's `hf:` form), and the shipped model.py resolves
    only paths that exist in its version directory."""
    import yaml

    from kiln.triton.llmapi import container_llm_args, model_yaml

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ckpt = tmp_path / "unified"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    sets = ["target=pytorch", "serving.llmapi_runtime=tensorrt_llm", "engine.speculative.mode=eagle",
            "engine.speculative.max_draft_len=3"]
    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml", [*sets, f"engine.speculative.draft_model={head}"])
    out = tmp_path / "repo"
    out.mkdir()
    info = write_llmapi_repository(recipe.recipe, ckpt, out, 512, eagle_head=head)
    version = out / "tensorrt_llm" / "1"
    spec = yaml.safe_load((version / "model.yaml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "eagle_head"}
    assert (version / "eagle_head" / "config.json").is_file()
    assert container_llm_args(info["llm_args"], "/models")["speculative_config"]["speculative_model_dir"] == \
        "/models/tensorrt_llm/1/eagle_head"

    hub_id = "hf:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@abc123"
    hub = load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml", [*sets, f"engine.speculative.draft_model={hub_id}"])
    reference = load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml",
                            [*sets[:1], "serving.llmapi_runtime=reference", *sets[2:],
                             f"engine.speculative.draft_model={hub_id}"]).recipe
    assert model_yaml(reference, 512)["speculative_config"]["speculative_model_dir"] == \
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"

    # the shipped model.py: a relative path that exists is joined onto the version directory, a Hub id is left alone
    model = load_model_module("llmapi")
    data, _ = model.read_model_yaml(str(version))
    assert data["speculative_config"]["speculative_model_dir"] == str(version / "eagle_head")
    (version / "model.yaml").write_text((version / "model.yaml").read_text().replace(
        "speculative_model_dir: eagle_head", "speculative_model_dir: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"))
    data, _ = model.read_model_yaml(str(version))
    assert data["speculative_config"]["speculative_model_dir"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"

    # the package step links the local head (its content is a package input) and downloads a hub head at its
    # revision (STAND-IN for the download: resolve_model_dir answers with the local folder and records the ask)
    from kiln.models import loading
    from kiln.steps import package

    assert package._eagle_head(recipe.recipe) == head and package._eagle_head(reference) is None
    asked = []
    real = loading.resolve_model_dir
    monkeypatch.setattr(loading, "resolve_model_dir",
                        lambda source, **kw: asked.append((source, kw["key"])) or head if source == hub_id
                        else real(source, **kw))
    (head / "pytorch_model.bin").write_bytes(b"\x80")  # a hub head with pickled weights only is refused
    with pytest.raises(InputError, match="engine.speculative.draft_model: .* no safetensors weights"):
        package._eagle_head(hub.recipe)
    (head / "model.safetensors").write_bytes(b"")
    asked.clear()
    assert package._eagle_head(hub.recipe) == head and asked == [(hub_id, "engine.speculative.draft_model")]
    hashes = package._sources_hash(recipe)
    (head / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert package._sources_hash(recipe)["eagle_head"] != hashes["eagle_head"]
    hashes = package._sources_hash(recipe)
    (head / "pytorch_model.bin").write_bytes(b"\x80\x81")  # a local head's pickled weights rewritten
    assert package._sources_hash(recipe)["eagle_head"] != hashes["eagle_head"]
    assert package._sources_hash(hub)["eagle_head"] != package._sources_hash(
        load_recipe(REPO_ROOT / "configs" / "tiny-llama.yaml",
                    [*sets, "engine.speculative.draft_model=hf:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]))["eagle_head"]
