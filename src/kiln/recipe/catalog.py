"""Shipped recipes: where they are, what each is, and copying one to start a new recipe."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kiln.recipe.errors import Origin, Problem, RecipeError
from kiln.recipe.loader import load_recipe, read_yaml


def configs_dir() -> Path:
    """The shipped recipes: $KILN_CONFIGS, else the checkout's configs/, else ./configs."""
    env = os.environ.get("KILN_CONFIGS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[3] / "configs"
    return here if here.is_dir() else Path("configs")


@dataclass(frozen=True)
class Entry:
    path: Path
    name: str
    description: str
    target: str
    format: str
    error: Optional[str] = None


def list_recipes(root: Optional[Path] = None) -> list[Entry]:
    """Every recipe under `root`, found recursively (sweep files under sweeps/ are not recipes)."""
    root = root or configs_dir()
    out = []
    for path in sorted(root.rglob("*.yaml")):
        if "sweeps" in path.relative_to(root).parts:
            continue
        try:
            r = load_recipe(path).recipe
            out.append(Entry(path, r.name, r.description, r.target, r.quantization.format))
        except RecipeError as exc:
            out.append(Entry(path, "?", "", "?", "?", error=f"{len(exc.errors)} problem(s)"))
    return out


def resolve_recipe_path(ref: str) -> Path:
    """A recipe argument: a path, or the name/stem of a shipped recipe."""
    p = Path(ref)
    if p.exists() or p.suffix in (".yaml", ".yml"):
        return p
    for entry in list_recipes():
        if ref in (entry.name, entry.path.stem):
            return entry.path
    return p


def new_recipe(name: str, source: Path, out: Path) -> Path:
    """Copy `source` to `out` with `name:` replaced and `extends:` re-pointed; never overwrite."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise RecipeError([Problem("error", "name", f"{name!r} is not a valid recipe name", Origin("kiln new"),
                                   "use lower-case letters, digits, '.', '_' and '-'")])
    load_recipe(source)  # the source must be valid
    exists = RecipeError([Problem("error", "", f"{out} already exists; kiln never overwrites a recipe",
                                  Origin(str(out)), "choose another NAME or --out")])
    if out.exists():
        raise exists
    data, lines = read_yaml(source)
    text = source.read_text(encoding="utf-8")
    ext = lines.get(("extends",))
    if isinstance(data.get("extends"), str) and ext is not None and ext.line:
        # re-point the parsed value (quoted or with a trailing comment alike) on the line that holds it
        rows = text.splitlines(keepends=True)
        row = rows[ext.line - 1]
        if row.startswith("extends:"):
            rel = os.path.relpath((source.parent / data["extends"]).resolve(), out.resolve().parent)
            rows[ext.line - 1] = f"extends: {rel}" + ("\n" if row.endswith("\n") else "")
            text = "".join(rows)
    text, n = re.subn(r"(?m)^name:.*$", f"name: {name}", text, count=1)
    if n == 0:
        text = f"name: {name}\n" + text
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("x", encoding="utf-8") as fh:  # "x": never overwrite, even if created meanwhile
            fh.write(text)
    except FileExistsError:
        raise exists from None
    except OSError as exc:
        raise RecipeError([Problem("error", "", f"cannot write {out}: {exc.strerror or exc}", Origin(str(out)),
                                   "choose a writable --out")]) from None
    try:
        load_recipe(out)
    except RecipeError:
        out.unlink()  # leave no broken copy behind
        raise
    return out
