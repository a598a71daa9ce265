"""The chosen TensorRT-LLM release, beyond its container row: `kiln lint` checks an llmapi repository's LLM arguments
against the release kiln.json records (``llm_args_version``), and the format registry says which formats each
release's PyTorch backend runs (``pytorch_releases``: 1.3/1.4 unverified, same as 1.2.1), which `kiln validate`
enforces naming the release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.recipe import formats
from kiln.triton.lint import lint_repository
from tests.standins import llmapi_repository

from tests.conftest import CONFIGS

RECIPE = CONFIGS / "tiny-llama.yaml"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """An llmapi repository as kiln packages it for TensorRT-LLM 1.3.0rc29, over a stand-in checkpoint (config.json
    and hf_quant_config.json only: lint reads no weights)."""
    return llmapi_repository(tmp_path, "FP8", ["target=pytorch", "engine_runtime.trtllm_version=1.3.0rc29"])


def _errors(repo: Path) -> list[str]:
    return [f.format() for f in lint_repository(repo) if f.severity == "error"]


def _set_version(repo: Path, version: str) -> None:
    info = json.loads((repo / "kiln.json").read_text())
    info["llm_args_version"] = version
    (repo / "kiln.json").write_text(json.dumps(info))


def test_lint_checks_the_llm_arguments_against_the_recorded_release(repo: Path) -> None:
    assert json.loads((repo / "kiln.json").read_text())["llm_args_version"] == "1.3.0rc29"
    assert _errors(repo) == []
    model_yaml = repo / "tensorrt_llm" / "1" / "model.yaml"
    model_yaml.write_text(model_yaml.read_text().replace("enable_chunked_prefill:", "enable_chunked_context:", 1))
    errors = _errors(repo)
    assert len(errors) == 1 and "enable_chunked_context: unknown key (not an LLM argument of TensorRT-LLM " \
                                   "1.3.0rc29)" in errors[0] and "llm_args/1.3.0rc29.yaml" in errors[0], errors
    _set_version(repo, "1.2.1")
    assert "(not an LLM argument of TensorRT-LLM 1.2.1)" in _errors(repo)[0]


def test_lint_says_when_kiln_has_no_table_for_the_recorded_release(repo: Path) -> None:
    _set_version(repo, "1.9.0")
    errors = _errors(repo)
    assert len(errors) == 1 and "kiln.json" in errors[0] and "llm_args_version '1.9.0'" in errors[0], errors
    assert "1.2.1, 1.3.0rc29, 1.4.0rc2" in errors[0]


def test_each_release_names_the_formats_its_pytorch_backend_runs_with_a_source() -> None:
    reg = formats.registry()
    runs_121 = formats.pytorch_release_formats("1.2.1")
    assert runs_121 == (("none", "fp8", "int4_awq", "w4a8_awq", "nvfp4"), ("none", "fp8"))
    for version in ("1.3.0rc29", "1.4.0rc2"):
        rel = reg.pytorch_releases[version]
        assert formats.pytorch_release_formats(version) == runs_121
        assert rel.verified is False and rel.note.startswith("unverified, same as 1.2.1")
        assert reg.sources[rel.source].repo == "NVIDIA/TensorRT-LLM"
    assert formats.pytorch_release_formats("1.5.0") is None


def _registry_where_1_4_drops_nvfp4() -> formats.Registry:
    import yaml

    from kiln.recipe.formats import DATA_FILE, load_registry

    data = yaml.safe_load(Path(formats.__file__).with_name("data").joinpath(DATA_FILE).read_text())
    data["pytorch_releases"]["1.4.0rc2"]["drops"] = [{"format": "nvfp4", "why": "a test's hypothetical removal"}]
    return load_registry(yaml.safe_dump(data, sort_keys=False), DATA_FILE)


def test_validate_refuses_a_format_the_chosen_release_does_not_run(kiln, monkeypatch) -> None:
    result = kiln("validate", RECIPE, "--set", "target=pytorch", "--set", "engine_runtime.trtllm_version=1.5.0")
    assert result.exit_code == 2, result.output
    assert "kiln does not know which formats TensorRT-LLM 1.5.0's PyTorch backend runs" in result.output
    reg = _registry_where_1_4_drops_nvfp4()
    monkeypatch.setattr(formats, "registry", lambda: reg)
    sets = ("--set", "target=pytorch", "--set", "quantization.format=nvfp4")
    result = kiln("validate", RECIPE, *sets, "--set", "engine_runtime.trtllm_version=1.4.0rc2")
    assert result.exit_code == 2, result.output
    assert "TensorRT-LLM 1.4.0rc2's PyTorch backend does not run NVFP4 (a test's hypothetical removal" in \
        result.output
    assert "use quantization.format: one of none, fp8, int4_awq, w4a8_awq" in result.output
    result = kiln("validate", RECIPE, *sets, "--set", "engine_runtime.trtllm_version=1.3.0rc29")
    assert "PyTorch backend does not run" not in result.output, result.output


def test_lint_refuses_a_checkpoint_format_the_recorded_release_does_not_run(repo: Path, monkeypatch) -> None:
    reg = _registry_where_1_4_drops_nvfp4()
    monkeypatch.setattr(formats, "registry", lambda: reg)
    (repo / "tensorrt_llm" / "1" / "checkpoint" / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert _errors(repo) == []  # recorded 1.3.0rc29 runs NVFP4
    _set_version(repo, "1.4.0rc2")
    errors = _errors(repo)
    assert len(errors) == 1 and "the checkpoint is nvfp4: TensorRT-LLM 1.4.0rc2's PyTorch backend does not run " \
                                   "NVFP4" in errors[0], errors


def test_a_release_without_a_triton_image_records_no_tritonserver_and_serve_docker_refuses_it(
        tmp_path: Path, kiln) -> None:
    """The release image of TensorRT-LLM 1.3.0rc29 carries trtllm-serve only (the container table): kiln.json records
    its stacks and no tritonserver command, and `kiln serve --docker` refuses before running anything, naming the
    deploy scripts that do serve it (a tritonserver command in that image would die with "command not found")."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "triton").mkdir()
    gpu = llmapi_repository(tmp_path / "gpu", "FP8", ["target=pytorch", "serving.llmapi_runtime=tensorrt_llm",
                                                      "engine_runtime.trtllm_version=1.3.0rc29"])
    info = json.loads((gpu / "kiln.json").read_text())
    assert info["container"] == "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc29"
    assert info["stacks"] == ["trtllm-serve"] and info["server_command"] == []
    result = kiln("serve", str(gpu), "--docker")
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "tensorrt-llm/release:1.3.0rc29 carries no Triton server (TensorRT-LLM 1.3.0rc29: trtllm-serve only" in out
    assert "deploy/tiny-llama/trtllm-serve/serve.sh or deploy/tiny-llama/dynamo/launch.sh" in out
    triton = llmapi_repository(tmp_path / "triton", "FP8", ["target=pytorch", "serving.llmapi_runtime=tensorrt_llm"])
    info = json.loads((triton / "kiln.json").read_text())
    assert "triton-llmapi" in info["stacks"] and info["server_command"][0] == "tritonserver"


def test_kilns_openai_front_refuses_a_pytorch_target_repository_naming_its_openai_endpoints(tmp_path: Path,
                                                                                            kiln) -> None:
    """kiln's OpenAI front speaks the ensemble's contract; a target-pytorch repository (Triton's llmapi model) has
    none, and every request would answer 503 'model ensemble not found'. `kiln serve --openai` and `kiln openai
    --repo` refuse it before starting anything, naming trtllm-serve and Dynamo."""
    repo = llmapi_repository(tmp_path, "FP8", ["target=pytorch"])
    for args in (("serve", str(repo), "--openai", "--background"), ("openai", "--repo", str(repo))):
        result = kiln(*args)
        out = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert "target-pytorch repository (Triton's llmapi model)" in out and "--stack dynamo" in out
        assert "trtllm-serve/serve.sh" in out
