"""The layer contract (import-linter, configured in pyproject.toml) holds, and can actually fail.

The second test copies the package to a temporary directory, adds an upward import to a low layer and runs
the same linter and contract on the copy: it must break and name the offending import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def run_lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    """lint-imports with the pyproject.toml in `cwd`, importing `kiln` from `pythonpath`. No cache is written."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", "pyproject.toml"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def linter() -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: install the dev extra (pip install -e '.[dev]')")
    return LINT_IMPORTS


def test_layer_contract_is_kept(linter):
    proc = run_lint_imports(REPO_ROOT, REPO_ROOT / "src")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def test_layer_contract_catches_an_upward_import(linter, tmp_path):
    shutil.copytree(REPO_ROOT / "src" / "kiln", tmp_path / "src" / "kiln",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    schema = tmp_path / "src" / "kiln" / "recipe" / "schema.py"
    lines = schema.read_text().splitlines()
    schema.write_text("\n".join(lines + ["import kiln.cli  # injected by test_layers"]) + "\n")

    proc = run_lint_imports(tmp_path, tmp_path / "src")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 kept, 1 broken" in out
    assert "kiln.recipe is not allowed to import kiln.cli" in out
    assert f"kiln.recipe.schema -> kiln.cli (l.{len(lines) + 1})" in out


def test_kiln_importing_tensorrt_llm_breaks_the_contract(linter, tmp_path):
    """kiln orchestrates; TensorRT-LLM runs in the engine runtime. An import of tensorrt_llm anywhere in kiln (but
    the standalone quantize worker) breaks a contract."""
    shutil.copytree(REPO_ROOT / "src" / "kiln", tmp_path / "src" / "kiln",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    engine = tmp_path / "src" / "kiln" / "steps" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _lazy():\n    import tensorrt_llm  # injected by test_layers\n")
    proc = run_lint_imports(tmp_path, tmp_path / "src")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "kiln.steps.engine -> tensorrt_llm" in out
