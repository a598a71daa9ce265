"""The real steps' contracts, fast: their fingerprints decide what re-runs, the files they must produce are
enforced, and the manifest is the last thing written.

These tests use the real step declarations (kiln.pipeline.registry.STEPS), not stand-ins: complete outputs are
laid down with the fingerprints the real schedule computes, so a key dropped from a step's fingerprint, or a
required file that stops being checked, fails here in the unit tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.pipeline import runner
from kiln.pipeline.registry import STEPS
from kiln.recipe.loader import load_recipe
from kiln.steps.engine import EngineResult
from kiln.steps.evaluate import EvaluateResult
from kiln.steps.package import PackageResult
from kiln.steps.quantize import QuantizeResult
from kiln.steps.resolve import ResolveResult
from kiln.steps.tasks import TasksResult
from kiln.util.artifacts import read_manifest, write_manifest

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.yaml"

# One valid result per real step (what a complete output's manifest holds).
RESULTS = {
    "resolve": ResolveResult(summary="s", model_dir="/m", max_seq_len=512, gpu=None, gpu_count=None),
    "quantize": QuantizeResult(summary="s", format="int4_awq", kv_cache="none", quant_algo=None,
                               kv_cache_quant_algo=None, dtype="float32", calib_samples=32, calib_data=None,
                               params=1, checkpoint="checkpoint", trtllm_checkpoint=None, load_seconds=0.0,
                               calib_seconds=0.0, export_seconds=0.0, seconds=0.0),
    "evaluate": EvaluateResult(summary="s", format="int4_awq", ppl_increase_pct=0.1, mean_kl=0.001,
                               base_perplexity=1.0, quant_perplexity=1.001),
    "engine": EngineResult(summary="s", runtime="reference"),
    "package": PackageResult(summary="s", models=5, container="", deploy=""),
    "tasks": TasksResult(summary="s", skipped=True),
}


def lay_down_complete_outputs(loaded, layout) -> None:
    """A complete output for every step, as a finished build leaves it: the required files, then the manifest
    carrying the fingerprint the real schedule computes."""
    for p in runner.schedule(loaded, layout):
        out = p.out_dir
        out.mkdir(parents=True, exist_ok=True)
        for rel in p.spec.required_files(loaded.recipe):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(f"{p.spec.name}:{rel}")
        write_manifest(out, {"step": p.spec.name, "fingerprint": p.fingerprint, "components": p.components,
                             "result": RESULTS[p.spec.name].model_dump(mode="json")})


@pytest.fixture
def layout(tmp_path: Path) -> runner.Layout:
    return runner.Layout(tmp_path / "build", tmp_path / "triton_repo")


@pytest.fixture
def built(layout):
    lay_down_complete_outputs(load_recipe(RECIPE), layout)
    return layout


def rerun(layout, *overrides: str) -> list[str]:
    return [p.spec.name for p in runner.schedule(load_recipe(RECIPE, overrides), layout)
            if p.action == runner.Action.RUN]


def test_every_step_has_a_typed_result_and_required_files():
    assert [s.name for s in STEPS] == ["resolve", "quantize", "evaluate", "engine", "package", "tasks"]
    recipe = load_recipe(RECIPE).recipe
    for spec in STEPS:
        assert spec.result is type(RESULTS[spec.name]), spec.name
        assert spec.required_files(recipe), f"{spec.name} declares no file a complete output must hold"


def test_an_unchanged_recipe_reruns_nothing(built):
    assert rerun(built) == []


@pytest.mark.parametrize(("override", "expected"), [
    ("serving.max_queue_delay_microseconds=100", ["package", "tasks"]),
    ("serving.streaming=false", ["package", "tasks"]),
    ("quantization.calibration.samples=16", ["quantize", "evaluate", "engine", "package", "tasks"]),
    ("quantization.format=int8_sq", ["quantize", "evaluate", "engine", "package", "tasks"]),
    ("evaluation.samples=8", ["evaluate", "package", "tasks"]),
    ("evaluation.max_kl=0.5", []),  # a gate threshold is re-checked on the stored figures, never recomputed
    ("engine.max_batch_size=8", ["engine", "package", "tasks"]),
    ("description=another description", []),
])
def test_real_fingerprints_rerun_exactly_what_a_change_affects(built, override, expected):
    assert rerun(built, override) == expected


def test_the_fingerprint_names_the_field_that_changed(built):
    steps = runner.schedule(load_recipe(RECIPE, ["serving.max_queue_delay_microseconds=100"]), built)
    package = next(p for p in steps if p.spec.name == "package")
    assert any("serving.max_queue_delay_microseconds: 0 → 100" in r for r in package.reasons), package.reasons


@pytest.mark.parametrize("step", [s.name for s in STEPS])
def test_a_complete_output_missing_a_required_file_is_rejected(built, step):
    loaded = load_recipe(RECIPE)
    spec = next(s for s in STEPS if s.name == step)
    out = runner.Layout.step_dir(built, spec, loaded)
    for rel in spec.required_files(loaded.recipe):
        path = out / rel
        saved = path.read_bytes()
        path.unlink()
        assert read_manifest(out, spec.required_files(loaded.recipe)) is None, rel
        assert step in rerun(built), f"{step} not re-run with {rel} deleted"
        path.write_bytes(saved)
    assert rerun(built) == []


def test_a_manifest_that_does_not_list_a_required_file_is_rejected(built):
    """A manifest written before the step's files lists none of them: never a complete output."""
    loaded = load_recipe(RECIPE)
    spec = next(s for s in STEPS if s.name == "quantize")
    out = runner.Layout.step_dir(built, spec, loaded)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] = {}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(out, spec.required_files(loaded.recipe)) is None
    assert rerun(built)[0] == "quantize"


def test_a_stored_result_of_another_shape_is_not_trusted(built):
    loaded = load_recipe(RECIPE)
    spec = next(s for s in STEPS if s.name == "evaluate")
    out = runner.Layout.step_dir(built, spec, loaded)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["result"]["ppl_increase_pct"] = "a lot"  # what an older kiln might have written
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert rerun(built) == ["evaluate"]  # re-measured; same fingerprint, so nothing downstream changes


def test_the_engine_fingerprint_covers_the_gpu(built, monkeypatch):
    from kiln.recipe import gpus

    trt = ["target=tensorrt", "quantization.format=fp8"]
    monkeypatch.setattr(gpus, "detected_gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    h100 = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(RECIPE, trt), built)}
    monkeypatch.setattr(gpus, "detected_gpu_names", lambda: ["NVIDIA H200"])
    h200 = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(RECIPE, trt), built)}
    assert h100["engine"] != h200["engine"]  # a detected GPU of another architecture rebuilds the engine
    assert h100["quantize"] == h200["quantize"]  # the checkpoint does not depend on it
    declared = {p.spec.name: p for p in runner.schedule(load_recipe(RECIPE, [*trt, "hardware.gpu=H200"]), built)}
    assert declared["engine"].components["gpu"] == "H200 (sm_90)"  # declared beats detected
    monkeypatch.setattr(gpus, "detected_gpu_names", lambda: [])
    none = {p.spec.name: p.components for p in runner.schedule(load_recipe(RECIPE, trt), built)}
    assert none["engine"]["gpu"] == "none"
    reference = {p.spec.name: p.components for p in runner.schedule(load_recipe(RECIPE), built)}
    assert "gpu" not in reference["engine"]  # the CPU reference target has no engine to rebuild


def test_the_manifest_is_the_last_thing_a_step_writes(layout, monkeypatch):
    """Every file of a finished output exists, with its final size, when the runner writes the manifest."""
    from tests.test_pipeline import SPECS  # fast stand-in steps: this is the runner's ordering, not a step's

    monkeypatch.setattr(runner, "load_steps", lambda: dict(SPECS))
    seen: dict[str, dict[str, int]] = {}
    real_write = runner.write_manifest

    def spy(out_dir: Path, manifest: dict) -> None:
        seen[manifest["step"]] = {str(p.relative_to(out_dir)): p.stat().st_size
                                  for p in out_dir.rglob("*") if p.is_file()}
        real_write(out_dir, manifest)

    monkeypatch.setattr(runner, "write_manifest", spy)
    recipe = layout.build_root.parent / "r.yaml"
    recipe.write_text("name: pipe\ntarget: reference\n")
    summary = runner.run(load_recipe(recipe), layout, progress=False)
    assert summary.failure is None and set(seen) == set(SPECS)
    for p in runner.schedule(load_recipe(recipe), layout):
        final = {str(f.relative_to(p.out_dir)): f.stat().st_size for f in p.out_dir.rglob("*")
                 if f.is_file() and f.name != "manifest.json"}
        assert final and seen[p.spec.name] == final, p.spec.name


# ------------------------------------------------------------------ fingerprints: exact, per input, by whole segments


def test_recipe_keys_match_by_whole_dotted_segments():
    """`engine` covers `engine.max_batch_size`, never `engine_runtime.shm_size` or a key merely starting with it."""
    from kiln.pipeline.fingerprint import select

    flat = {"engine": 1, "engine.max_batch_size": 8, "engine_runtime.shm_size": "2g", "engines.x": 0,
            "model.dtype": "float32", "model_extra": 1}
    assert select(flat, ["engine", "model.dtype"]) == {"engine": 1, "engine.max_batch_size": 8,
                                                       "model.dtype": "float32"}
    assert select(flat, ["engine", "model"], ignore=["engine.max"]) == {
        "engine": 1, "engine.max_batch_size": 8, "model.dtype": "float32"}  # `engine.max` ignores no key either
    assert select(flat, ["engine"], ignore=["engine"]) == {}


TRT = ["target=tensorrt", "quantization.format=fp8", "hardware.gpu=H100"]


@pytest.fixture(scope="module")
def trt_fingerprints(tmp_path_factory) -> dict[str, str]:
    """The tensorrt target's fingerprints per step (they do not depend on what is stored)."""
    layout = runner.Layout(tmp_path_factory.mktemp("trt") / "build")
    return {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(RECIPE, TRT), layout)}


@pytest.mark.parametrize("override", ["engine_runtime.shm_size=8g", "engine_runtime.container_engine=podman",
                                      "engine_runtime.gpus=0,1"])
def test_engine_runtime_keys_that_cannot_change_an_output_rerun_nothing(built, trt_fingerprints, override):
    """Shared memory, the container engine and the GPUs the container sees change how a job runs, not what it
    makes: nothing reruns (with the reference target, whose steps do not run in the engine runtime at all, and
    with the tensorrt target, whose quantize, evaluate and engine do)."""
    assert rerun(built, override) == []
    after = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(RECIPE, [*TRT, override]), built)}
    assert after == trt_fingerprints


@pytest.mark.parametrize("override", ["engine_runtime.trtllm_version=1.1.0", "engine_runtime.kind=local",
                                      "engine_runtime.image=nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"])
def test_engine_runtime_keys_that_pick_the_tensorrt_llm_rerun_what_runs_in_it(built, trt_fingerprints, override):
    """Another TensorRT-LLM (a version, an image, a local interpreter) re-quantizes, re-evaluates and rebuilds the
    engine of the tensorrt target (all three run in it), then repackages; the reference target runs none of them
    there, so nothing reruns."""
    before = trt_fingerprints
    after = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(RECIPE, [*TRT, override]), built)}
    assert [s for s in before if before[s] != after[s]] == ["quantize", "evaluate", "engine", "package", "tasks"]
    assert rerun(built, override) == []


def test_a_changed_shipped_triton_model_reruns_only_package(built, tmp_path, monkeypatch):
    """The Python models and the engine-check script kiln ships into repositories are the package step's inputs:
    after a kiln upgrade changes one, the repository is rewritten (and nothing else is rebuilt)."""
    from kiln.triton import repository

    models = shutil.copytree(repository.models_source(), tmp_path / "models")
    monkeypatch.setattr(repository, "models_source", lambda: models)
    assert rerun(built) == []
    shipped = sorted(models.rglob("*.py"))[0]
    shipped.write_text(shipped.read_text() + "\n# a later kiln\n")
    assert rerun(built) == ["package", "tasks"]  # the task gate follows its package
    shipped.write_text(shipped.read_text().replace("\n# a later kiln\n", ""))
    check = tmp_path / "check_engine.py"
    check.write_text(repository.check_engine_script().read_text() + "\n# a later kiln\n")
    monkeypatch.setattr(repository, "check_engine_script", lambda: check)
    assert rerun(built) == ["package", "tasks"]


def test_a_changed_chat_template_reruns_only_package(built, monkeypatch):
    from kiln.steps import package

    shipped = package.builtin_chat_template("builtin:tiny-llama")
    assert shipped  # the tiny model ships one
    monkeypatch.setattr(package, "builtin_chat_template", lambda source: shipped + "{# a later kiln #}")
    assert rerun(built) == ["package", "tasks"]


def test_a_changed_external_draft_recipe_reruns_only_package(tmp_path):
    """Draft+target decoding: the draft's engine is built by the package step from the draft recipe (a file beside
    the target's); editing that file repackages, and leaves the target's own steps alone."""
    recipe = tmp_path / "target.yaml"
    recipe.write_text(RECIPE.read_text())
    draft = tmp_path / "draft.yaml"
    draft.write_text(RECIPE.read_text().replace("name: tiny-llama", "name: tiny-draft"))
    spec = [*TRT, "engine.speculative.mode=draft_tokens_external", "engine.speculative.draft_recipe=draft.yaml",
            "engine.speculative.max_draft_len=4"]
    layout = runner.Layout(tmp_path / "build", tmp_path / "triton_repo")
    before = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(recipe, spec), layout)}
    draft.write_text(draft.read_text().replace("samples: 32", "samples: 16", 1))
    after = {p.spec.name: p.fingerprint for p in runner.schedule(load_recipe(recipe, spec), layout)}
    assert [s for s in before if before[s] != after[s]] == ["package", "tasks"]
