"""kiln's command line: thin click commands that parse, call the layer below, format errors and exit.

Exit codes: 0 ok, 1 the work failed, 2 bad input. User errors never show a traceback (``--debug`` does).
"""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Callable

import click
from rich.console import Console

from kiln.recipe.catalog import configs_dir, list_recipes, new_recipe, resolve_recipe_path
from kiln.recipe.errors import Problem, RecipeError
from kiln.recipe.loader import LoadedRecipe, load_recipe
from kiln.recipe.render import recipe_yaml
from kiln.util.errors import InputError, KilnError

# Wide enough for tables when output is not a terminal (CI logs, pipes); a terminal keeps its own width.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 140)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def print_problems(problems: list[Problem]) -> None:
    for p in problems:
        style = "red" if p.severity == "error" else "yellow"
        err.print(p.format(), style=style, markup=False)


def handle_errors(fn: Callable) -> Callable:
    """Map kiln's exceptions to messages and exit codes; tracebacks only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        try:
            return fn(*args, **kwargs)
        except RecipeError as exc:
            if debug:
                traceback.print_exc()
            print_problems(exc.problems)
            n = len(exc.errors)
            err.print(f"{n} problem{'s' if n != 1 else ''} found", style="red bold")
            sys.exit(EXIT_BAD_INPUT)
        except KilnError as exc:
            if debug:
                traceback.print_exc()
            err.print(f"error: {exc}", style="red", markup=False)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            err.print("interrupted", style="red")
            sys.exit(130)

    return wrapper


def set_option(fn: Callable) -> Callable:
    return click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                        help="Override a recipe key (repeatable). Beats the file, which beats the defaults.")(fn)


def strict_option(fn: Callable) -> Callable:
    return click.option("--strict", is_flag=True, help="Treat warnings as errors.")(fn)


def load(recipe: str, overrides: tuple[str, ...], strict: bool = False) -> LoadedRecipe:
    loaded = load_recipe(resolve_recipe_path(recipe), overrides, strict=strict)
    print_problems(list(loaded.warnings))
    return loaded


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--debug", is_flag=True, help="Show tracebacks for every error.")
@click.version_option(package_name="kiln")
def cli(debug: bool) -> None:
    """kiln: one YAML recipe → a quantized, compiled and served LLM (ModelOpt → TensorRT-LLM → Triton)."""


@cli.command()
@click.argument("recipe")
@set_option
@strict_option
@handle_errors
def validate(recipe: str, overrides: tuple[str, ...], strict: bool) -> None:
    """Check RECIPE (a path or a shipped recipe's name) without a GPU: schema, cross-field rules, and
    whether the model fits the named GPU."""
    from kiln.steps.resolve import fit_warnings

    if any(o.split("=", 1)[0].strip() == "target" for o in overrides):
        _show_move(recipe, overrides)
    loaded = load(recipe, overrides, strict)
    fit = fit_warnings(loaded)
    print_problems(fit)
    if strict and fit:
        raise RecipeError([Problem("error", p.key, p.message + " (--strict)", p.origin, p.hint) for p in fit])
    n = len(loaded.warnings) + len(fit)
    suffix = f" ({n} warning{'s' if n != 1 else ''})" if n else ""
    out.print(f"{loaded.path}: ok — {loaded.recipe.name}, target {loaded.recipe.target}, "
              f"format {loaded.recipe.quantization.format}{suffix}", markup=False)


def _show_move(recipe: str, overrides: tuple[str, ...]) -> None:
    """`--set target=pytorch`: what carries over, changes and is refused (before the usual validation, whose errors
    then give each refusal's reason and alternatives)."""
    try:
        moved = load_recipe(resolve_recipe_path(recipe), overrides, check_rules=False).recipe
    except (RecipeError, KilnError):
        return  # the usual validation below reports it
    if moved.target == "pytorch":
        from kiln.triton.llmapi_migrate import migration_view

        for line in migration_view(moved):
            out.print(line, markup=False)


@cli.command()
@click.argument("recipe")
@set_option
@click.option("--doc", is_flag=True, help="Write each field's description as a comment above it.")
@handle_errors
def show(recipe: str, overrides: tuple[str, ...], doc: bool) -> None:
    """Print the resolved RECIPE with every default filled in."""
    loaded = load(recipe, overrides)
    header = f"# {loaded.recipe.name}: resolved from {loaded.path}"
    if loaded.recipe.extends:
        header += f" (extends {loaded.recipe.extends})"
    if loaded.overrides:
        header += " with --set " + " ".join(loaded.overrides)
    click.echo(header)
    click.echo(recipe_yaml(loaded.recipe, docs=doc, skip=("extends",)), nl=False)


@cli.command(name="ls")
@handle_errors
def ls_() -> None:
    """List the shipped recipes, one line each."""
    root = configs_dir()
    entries = list_recipes(root)
    rows = [(str(e.path.relative_to(root) if e.path.is_relative_to(root) else e.path), e.name, e.target,
             e.format, e.error or e.description) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        click.echo("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])


@cli.command()
@click.argument("name")
@click.option("--from", "source", required=True, help="Recipe to copy (path or shipped recipe name).")
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=None,
              help="Where to write it (default: ./NAME.yaml).")
@handle_errors
def new(name: str, source: str, out_path: Path | None) -> None:
    """Start a new recipe NAME by copying a shipped one."""
    target = out_path or Path(f"{name}.yaml")
    written = new_recipe(name, resolve_recipe_path(source), target)
    out.print(f"wrote {written} — edit it, then: kiln validate {written}", markup=False)


def main() -> None:
    try:
        cli(prog_name="kiln")
    except InputError as exc:  # pragma: no cover - handled in commands; belt and braces
        err.print(f"error: {exc}", style="red", markup=False)
        sys.exit(EXIT_BAD_INPUT)


# The pipeline-facing commands register themselves on `cli` (imported last: they import from this module).
from kiln.cli import cache_cmds, commands, serve_cmds, sweep_cmds  # noqa: E402,F401
from kiln.cli import doctor_cmd  # noqa: E402,F401
