"""Hub-cache models in the engine runtime (issue 20, defect 1): a snapshot's files are relative links into the
repository folder's blobs/, so the job mounts the repository folder and reads the snapshot inside it — and
`kiln build --dry-run` shows that same mount. The run itself, through the stand-in container runtime with the image's
Python environment, is tests/test_image_env.py::test_a_hub_model_reaches_the_container_as_real_files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.steps.runtime_jobs import hub_snapshot, model_mount, model_path
from tests.standins import hub_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "configs" / "tiny-llama.yaml"


def test_a_snapshot_is_mounted_with_its_blobs(tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    snapshot = hub_cache(src, tmp_path / "hub", "org/name")
    repo = tmp_path / "hub" / "models--org--name"
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")
    assert hub_snapshot(snapshot) == (repo, f"snapshots/{snapshot.name}")
    assert hub_snapshot(repo) == (repo, f"snapshots/{snapshot.name}")  # the repo folder: refs/main names the snapshot
    assert model_mount(snapshot).host == repo and model_mount(src).host == src
    assert model_path({"model": "/kiln/in/model"}, snapshot) == f"/kiln/in/model/snapshots/{snapshot.name}"
    assert model_path({"model": "/kiln/in/model"}, src) == "/kiln/in/model"


def test_dry_run_shows_the_mount_the_run_uses(tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (src / name).write_text("{}")
    snapshot = hub_cache(src, tmp_path / "hf" / "hub", "org/name")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "kiln", "build", str(RECIPE), "--set", "target=tensorrt", "--set",
                          "model.source=hf:org/name", "--set", "hardware.gpu=H100-SXM", "--dry-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"--volume {snapshot.parent.parent}:/kiln/in/model:ro" in run.stdout, run.stdout
