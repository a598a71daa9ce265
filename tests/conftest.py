"""Shared test fixtures: where the repository and its shipped recipes are, and a CLI runner.

Keep this small: fixtures used by one test module belong in that module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner, Result

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def shipped_recipes() -> list[Path]:
    """Every shipped recipe, found recursively under configs/ (sweep files under configs/sweeps/ are not
    recipes). Never a hand-kept list: a recipe added anywhere under configs/ is picked up."""
    return sorted(p for p in CONFIGS.rglob("*.yaml") if "sweeps" not in p.relative_to(CONFIGS).parts)


def recipe_id(path: Path) -> str:
    """A readable pytest id for a shipped recipe: its path under configs/."""
    return str(path.relative_to(CONFIGS))


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Write recipe text to a file under tmp_path (default name recipe.yaml) and return its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def kiln() -> Callable[..., Result]:
    """Run the `kiln` CLI in-process: ``kiln("validate", path)`` returns click's Result (stdout and stderr
    both in ``.output``). Exceptions are caught by the runner, so a test sees them as ``.exception``."""
    from kiln.cli.main import cli

    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(cli, [str(a) for a in args], prog_name="kiln", catch_exceptions=True)

    return invoke
