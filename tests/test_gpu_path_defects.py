"""The GPU-path defects found by reading kiln's output against upstream at the pinned version (issue 11), each with
a test that failed before its fix. (The launch-script, multi-node image and orchestrator defects are tested with
the deploy files in test_deploy.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.recipe.loader import load_recipe
from kiln.recipe.rules import check_rules
from kiln.steps.placement import place_draft_target
from kiln.steps.trtllm_args import expected_engine_config, trtllm_build_args
from kiln.triton.lint import lint_repository
from kiln.triton.repository import standin_engine_config, trtllm_config
from kiln.util.errors import InputError
from tests.test_repository import make_repo, tokenizer_dir  # noqa: F401 - shared fixture

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TARGET = CONFIGS / "speculative" / "target-llama-3.1-8b.yaml"
DRAFT = CONFIGS / "speculative" / "draft-llama-3.2-1b.yaml"


def params(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


# ------------------------------------------------------------------ 1. draft+target KV budget


def test_draft_and_target_on_one_gpu_split_the_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both models used to get kv_cache_free_gpu_mem_fraction 0.9 on one GPU: the first to load took the memory.
    Now both are capped so the two caches together fit what the planner leaves after both models."""
    from kiln.steps import placement

    monkeypatch.setattr(placement, "detect_gpus", lambda: None)
    target = load_recipe(TARGET, ["hardware.gpu=H100-SXM", "hardware.count=1"])
    draft = load_recipe(DRAFT, ["hardware.gpu=H100-SXM"])
    p = place_draft_target(target, draft)
    assert p.kv_tokens is not None and p.target_devices == p.draft_devices == "0" and not p.orchestrator
    from kiln.plan import plan_for

    pt, pd = plan_for(target), plan_for(draft)
    free = pt.kv_cache.gpu_memory_bytes - (pt.weights.per_gpu_bytes + pt.workspace.total_bytes
                                           + pd.weights.per_gpu_bytes + pd.workspace.total_bytes)
    both = p.kv_tokens * (pt.kv_cache.bytes_per_token_per_gpu + pd.kv_cache.bytes_per_token_per_gpu)
    assert both <= 0.9 * free < both + 32 * 2 * (pt.kv_cache.bytes_per_token_per_gpu
                                                 + pd.kv_cache.bytes_per_token_per_gpu)  # within one block
    for recipe in (target.recipe, draft.recipe):
        cfg = trtllm_config(recipe, "tensorrt_llm", 8192, standin_engine_config(recipe, 8192, version="1.2.1"),
                            p.kv_tokens, p.target_devices)
        assert params(cfg)["max_tokens_in_paged_kv_cache"] == str(p.kv_tokens)


def test_draft_gets_its_own_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.steps import placement

    monkeypatch.setattr(placement, "detect_gpus", lambda: None)
    p = place_draft_target(load_recipe(TARGET, ["hardware.gpu=H100-SXM", "hardware.count=2"]), load_recipe(DRAFT))
    assert (p.target_devices, p.draft_devices, p.kv_tokens) == ("0", "1", None)
    cfg = trtllm_config(load_recipe(DRAFT).recipe, "tensorrt_llm_draft", 8192,
                        standin_engine_config(load_recipe(DRAFT).recipe, 8192, version="1.2.1"), None, p.draft_devices)
    assert params(cfg)["gpu_device_ids"] == "1"
    with pytest.raises(InputError, match="set hardware.gpu"):
        place_draft_target(load_recipe(TARGET, ["hardware.count=1", "hardware.gpu=null"]), load_recipe(DRAFT))


def test_draft_and_target_with_tp_run_in_orchestrator_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.steps import placement

    monkeypatch.setattr(placement, "detect_gpus", lambda: None)
    p = place_draft_target(load_recipe(TARGET, ["hardware.gpu=H100-SXM", "parallelism.tp=2", "hardware.count=4"]),
                           load_recipe(DRAFT))
    assert p.orchestrator and (p.target_devices, p.draft_devices) == ("0,1", "2")
    refused = [e for e in check_rules(load_recipe(TARGET, ["parallelism.tp=16"], check_rules=False).recipe)
               if e.key == "engine.speculative.mode"]
    assert refused and "orchestrator mode" in refused[0].message


# ------------------------------------------------------------------ 5. logits dtype


def test_the_engine_is_built_with_the_logits_dtype_the_configs_declare(tmp_path, tokenizer_dir) -> None:  # noqa: F811
    """The configs declared the logits tensors FP32 while the ModelOpt checkpoint says logits_dtype float16: kiln
    now builds with --logits_dtype float32, checks it in the engine's config, and declares what the engine has."""
    recipe = load_recipe(CONFIGS / "llama-3.1-8b" / "fp8.yaml").recipe
    args = trtllm_build_args(recipe, "ckpt", "out")
    assert args[args.index("--logits_dtype") + 1] == "float32"
    assert expected_engine_config(recipe, 8192)["pretrained_config.logits_dtype"] == "float32"
    cfg16 = standin_engine_config(recipe, 8192, version="1.2.1")
    cfg16["pretrained_config"]["logits_dtype"] = "float16"
    outs = {o.name: o.data_type for o in trtllm_config(recipe, "tensorrt_llm", 8192, cfg16).output}
    from tritonclient.grpc import model_config_pb2 as mc

    assert outs["generation_logits"] == outs["context_logits"] == mc.DataType.Value("TYPE_FP16")
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    engine = repo / "tensorrt_llm" / "1" / "engine" / "config.json"
    engine_cfg = json.loads(engine.read_text())
    assert engine_cfg["pretrained_config"]["logits_dtype"] == "float32" and not [
        f for f in lint_repository(repo) if f.severity == "error"]
    engine_cfg["pretrained_config"]["logits_dtype"] = "float16"  # an engine built without kiln's flag
    engine.unlink()
    engine.write_text(json.dumps(engine_cfg))
    found = [f.message for f in lint_repository(repo) if f.severity == "error"]
    assert any("generation_logits is declared TYPE_FP32 but the engine's logits are float16" in m for m in found)


# ------------------------------------------------------------------ 6. kiln.json server_command


def test_server_command_is_the_leader_form_for_several_ranks(tmp_path, tokenizer_dir) -> None:  # noqa: F811
    recipe = load_recipe(CONFIGS / "llama-3.1-70b" / "fp8-tp4.yaml").recipe
    info = json.loads((make_repo(recipe, tmp_path, tokenizer_dir) / "kiln.json").read_text())
    cmd = info["server_command"]
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"] and cmd.count("tritonserver") == 4
    assert "--model-control-mode=explicit" in cmd and "--backend-config=python,shm-region-prefix-name=prefix3_" in cmd
    assert info["check_command"] == ["python3", "/models/kiln_check_engine.py", "/models"]


def test_server_command_names_the_final_repository_not_a_temporary_one(default_build) -> None:
    """It named `.tiny-llama.tmp-2811-f17134d0` (the package step's temporary output) in a fresh build. The
    session's default build is such a fresh build by the real pipeline (its package step wrote kiln.json into
    the temporary directory and renamed it), so it is checked rather than building the recipe again."""
    _, layout, repo = default_build
    assert repo == layout.repo_root / "tiny-llama"
    cmd = json.loads((repo / "kiln.json").read_text())["server_command"]
    repo_arg = next(a for a in cmd if a.startswith("--model-repository="))
    assert repo_arg == f"--model-repository={repo}"
    assert ".tmp-" not in " ".join(cmd)


# ------------------------------------------------------------------ the engine check at start


def test_kiln_serve_refuses_an_engine_built_by_other_versions(tmp_path, kiln, monkeypatch) -> None:
    """`kiln serve REPO` on a host whose TensorRT-LLM/TensorRT did not build the engine refuses before starting
    tritonserver, with the rebuild command (launch.sh runs the same check in the container: test_deploy.py)."""
    import sys

    from tests.standins import serving_site, stub_repository

    repo = stub_repository(tmp_path / "repo", trtllm="1.2.1", tensorrt="10.14.1.48")
    monkeypatch.syspath_prepend(str(serving_site(tmp_path, "1.1.0", "10.13.3.9")))  # this host's stand-in install
    import importlib

    importlib.invalidate_caches()
    result = kiln("serve", repo)
    assert result.exit_code == 2, result.output
    assert "tensorrt_llm: the engine was built with 1.2.1, this environment has 1.1.0" in result.output
    assert "kiln build stub --from engine --set engine_runtime.trtllm_version=1.1.0" in result.output
    assert "Traceback" not in result.output and sys.modules.get("tensorrt_llm") is None


@pytest.mark.parametrize(("host_trtllm", "host_tensorrt", "differs", "same"), [
    ("1.2.1", "10.13.3.9", "tensorrt: the engine was built with 10.14.1.48, this environment has 10.13.3.9",
     "tensorrt_llm:"),
    ("1.1.0", "10.14.1.48", "tensorrt_llm: the engine was built with 1.2.1, this environment has 1.1.0",
     "tensorrt:"),
])
def test_the_shipped_engine_check_refuses_a_mismatch_of_either_version_alone(tmp_path, host_trtllm, host_tensorrt,
                                                                            differs, same) -> None:
    """The script launch.sh and `kiln serve` run in the serving container, run as they run it: one version of the
    two differing is enough to refuse (an engine serialized by TensorRT 10.14 does not load in 10.13 even under
    the same TensorRT-LLM), and the message names only the one that differs."""
    import os
    import subprocess
    import sys

    from tests.standins import serving_site, stub_repository

    repo = stub_repository(tmp_path / "repo", trtllm="1.2.1", tensorrt="10.14.1.48")

    def check(trtllm: str, tensorrt: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(serving_site(tmp_path, trtllm, tensorrt))}
        return subprocess.run([sys.executable, "-S", str(repo / "kiln_check_engine.py"), str(repo)], env=env,
                              capture_output=True, text=True, timeout=60)

    refused = check(host_trtllm, host_tensorrt)
    assert refused.returncode == 3, refused.stderr
    assert differs in refused.stderr and same not in refused.stderr.replace(differs, "")
    assert check("1.2.1", "10.14.1.48").returncode == 0  # the same stand-in site with both versions agreeing
