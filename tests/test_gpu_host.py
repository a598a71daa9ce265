"""What a GPU host must have before a GPU-hour is spent: the driver the image's CUDA needs, the disk every file of
the run takes. No GPU here: the host's driver comes from a STAND-IN nvidia-smi (tests/standins.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.pipeline import preflight
from kiln.recipe.containers import CONTAINER_ROWS, CONTAINER_SOURCES, row_for
from kiln.recipe.gpus import driver_older, host_driver_version
from kiln.recipe.loader import load_recipe
from tests.standins import nvidia_smi

REPO_ROOT = Path(__file__).resolve().parents[1]
IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"


def test_driver_versions_compare_as_numbers() -> None:
    assert driver_older("575.51.03", "580") and driver_older("535.230.02", "580.65")
    assert not driver_older("580.65.06", "580") and not driver_older("590.1", "580.65.06")
    assert driver_older("580.9", "580.65")  # 9 < 65, not "9" > "6"


def test_preflight_refuses_a_driver_older_than_the_images_minimum(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml").recipe
    monkeypatch.setenv("PATH", f"{tmp_path / 'old'}:/usr/bin:/bin")
    nvidia_smi(tmp_path / "old", ["NVIDIA H100 80GB HBM3"], driver="575.51.03")
    assert host_driver_version() == "575.51.03"
    (problem,) = preflight._driver_problems(recipe)
    assert f"driver is 575.51.03, and {IMAGE} (CUDA 13.3.1) needs driver 580 or later" in problem
    assert "update the driver" in problem
    monkeypatch.setenv("PATH", f"{tmp_path / 'new'}:/usr/bin:/bin")
    nvidia_smi(tmp_path / "new", ["NVIDIA H100 80GB HBM3"], driver="580.65.06")
    assert preflight._driver_problems(recipe) == []
    monkeypatch.setenv("PATH", f"{tmp_path / 'none'}:/usr/bin:/bin")  # nvidia-smi without a driver: "no GPU" is
    nvidia_smi(tmp_path / "none", [])                                   # preflight's other check
    assert host_driver_version() is None and preflight._driver_problems(recipe) == []


def test_the_default_images_minimum_driver_has_a_source() -> None:
    row = row_for(IMAGE)
    assert row is not None and row.cuda and row.min_driver == "580" and "cuda-compatibility" in row.note
    assert {"triton-release-notes", "cuda-compatibility"} <= set(CONTAINER_SOURCES)
    march = next(r for r in CONTAINER_ROWS if r.release == "26.03")
    assert march.verified is False and "1.2.0rc8" in march.note


def test_the_disk_budget_counts_every_file_the_run_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight used to budget 1.1 × the quantized weights per step (quantize, engine): an 8B FP8 run passed with
    25 GiB free and then wrote the evaluation's base log-probabilities and the hub download on top."""
    import shutil

    loaded = load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml")
    steps = ["resolve", "quantize", "evaluate", "engine", "package"]
    budget = {what: b for _, what, b in preflight.disk_budget(loaded, steps, tmp_path / "build")}
    gib = 1024**3
    assert 8 * gib < budget["the quantized checkpoint"] == budget["the engine"] < 10 * gib
    assert budget["the quantizer state"] < 0.2 * gib  # not mto.save's second copy of every weight
    assert budget["the base model's log-probabilities (evaluate's scratch, removed after)"] == 128 * 1024 * 128256 * 2
    sq = {what: b for _, what, b in preflight.disk_budget(
        load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "int8-sq.yaml"), steps, tmp_path / "build")}
    assert 12 * gib < sq["the quantizer state (with the linear weights the calibration rescaled)"] < 15 * gib
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100 * gib, 75 * gib,
                                                                                            25 * gib))
    (problem,) = preflight._disk_problems(loaded, steps, tmp_path / "build")
    assert "this run writes about" in problem and "has 25.0 GiB free" in problem
    assert "the base model's log-probabilities" in problem and "the engine 9.3 GiB" in problem


def test_preflight_refuses_a_model_the_workers_cannot_hold_on_the_recipes_gpus() -> None:
    fits = load_recipe(REPO_ROOT / "configs" / "llama-3.1-70b" / "fp8-tp4.yaml")
    assert preflight._worker_memory_problems(fits, ["quantize", "evaluate", "engine"]) == []
    one = load_recipe(REPO_ROOT / "configs" / "llama-3.1-70b" / "fp8-tp4.yaml", ["parallelism.tp=1", "hardware.count=1"])
    (problem,) = preflight._worker_memory_problems(one, ["quantize", "evaluate"])
    assert "does not fit: 131.4 GiB unquantized (bfloat16) over 1 GPU(s)" in problem and "hardware.count" in problem
