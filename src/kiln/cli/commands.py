"""The pipeline-facing commands: build, quantize, plan (registered on the main group)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import click

from kiln.cli.main import cli, err, handle_errors, load, out, set_option, strict_option
from kiln.pipeline.registry import STEP_ORDER
from kiln.util.errors import InputError

STEPS = click.Choice(list(STEP_ORDER))


@contextlib.contextmanager
def stdout_to_stderr(active: bool = True):
    """Send everything written to file descriptor 1 (Python or C) to stderr while active."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def layout_options(fn):
    fn = click.option("--build-dir", type=click.Path(path_type=Path), default=Path("build"), show_default=True,
                      help="Where step outputs go (build/<recipe>/<step>/).")(fn)
    fn = click.option("--repo-dir", type=click.Path(path_type=Path), default=Path("triton_repo"),
                      show_default=True, help="Where packaged Triton repositories go.")(fn)
    return fn


def _run_build(recipe: str, overrides, strict, from_step, to_step, force, dry_run, build_dir, repo_dir,
               as_json: bool, quiet: bool) -> None:
    from kiln.pipeline.runner import Layout, Status, describe_schedule, render_summary, run, schedule, summary_json

    loaded = load(recipe, overrides, strict)
    layout = Layout(build_dir, repo_dir)
    if dry_run:
        scheduled = schedule(loaded, layout, force, from_step, to_step)
        describe_schedule(scheduled, loaded, out, layout.build_root)
        from kiln.pipeline.preflight import check

        for problem in check(loaded, [p.spec.name for p in scheduled if p.action == "run"], layout.build_root):
            out.print(f"  preflight: {problem}", markup=False, style="yellow")
        return
    with stdout_to_stderr(as_json):  # libraries that print to stdout must not corrupt the JSON
        summary = run(loaded, layout, force, from_step, to_step, console=err, progress=not quiet)
    if as_json:
        click.echo(summary_json(summary))
    else:
        render_summary(summary, err)
    if summary.failure is not None:
        err.print(f"error: {summary.failure}", style="red", markup=False)
        sys.exit(summary.failure.exit_code)
    if loaded.recipe.target == "reference" and any(o.name == "package" and o.status in (Status.RAN, Status.REUSED, Status.SKIPPED)
                                                   for o in summary.outcomes):
        err.print("note: target 'reference' serves the quantized model with PyTorch on CPU — a test and "
                  "development vehicle with the tensorrt_llm tensor contract, not the fast path.", style="dim")
    packaged = any(o.name == "package" and o.status == Status.RAN for o in summary.outcomes)
    if loaded.recipe.target == "pytorch" and packaged:
        from kiln.recipe.schema import llmapi_runtime

        if llmapi_runtime(loaded.recipe) == "reference":
            err.print("note: target 'pytorch' on a machine without a GPU: the llmapi model is served by kiln's CPU "
                      "reference runtime (a test and development vehicle); package with serving.llmapi_runtime: "
                      "tensorrt_llm (or on a GPU host) for TensorRT-LLM's LLM API.", style="dim")


@cli.command()
@click.argument("recipe")
@set_option
@strict_option
@click.option("--from", "from_step", type=STEPS, help="Re-run from this step (earlier steps must be current).")
@click.option("--to", "to_step", type=STEPS, help="Stop after this step.")
@click.option("--force", is_flag=True, help="Re-run every step, even if up to date.")
@click.option("--dry-run", is_flag=True, help="Print the plan (run/skip and why, the exact engine build command).")
@click.option("--json", "as_json", is_flag=True, help="Print the run summary as JSON on stdout.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def build(recipe, overrides, strict, from_step, to_step, force, dry_run, as_json, quiet, build_dir, repo_dir):
    """Build RECIPE: resolve → quantize → evaluate → build (engine) → package, skipping what is up to date."""
    _run_build(recipe, overrides, strict, from_step, to_step, force, dry_run, build_dir, repo_dir, as_json, quiet)


@cli.command()
@click.argument("recipe")
@set_option
@strict_option
@click.option("--force", is_flag=True, help="Re-run even if up to date.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def quantize(recipe, overrides, strict, force, quiet, build_dir, repo_dir):
    """Quantize RECIPE and measure its quality (kiln build --to evaluate)."""
    _run_build(recipe, overrides, strict, None, "evaluate", force, False, build_dir, repo_dir, False, quiet)


@cli.command(name="plan")
@click.argument("recipe")
@set_option
@click.option("--gpu", help="GPU to plan for (default: the recipe's hardware.gpu).")
@click.option("--count", type=int, help="GPUs available (default: the recipe's hardware.count, else tp × pp).")
@click.option("--model-config", type=click.Path(path_type=Path, exists=True, dir_okay=True),
              help="A Hugging Face config.json (or model directory) for models kiln has no config for.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@handle_errors
def plan_cmd(recipe, overrides, gpu: Optional[str], count: Optional[int], model_config: Optional[Path], as_json):
    """Memory, KV-cache capacity and speed limits of RECIPE on a GPU — no GPU needed."""
    from kiln.plan import PlanError, plan_for, render_plan

    loaded = load(recipe, overrides)
    try:
        result = plan_for(loaded, gpu, count, model_config)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render_plan(result, out)


@cli.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print findings as JSON.")
@handle_errors
def lint(repo: Path, as_json: bool) -> None:
    """Check a Triton TensorRT-LLM model repository (kiln's or hand-made) without a GPU."""
    from kiln.triton.lint import lint_repository

    findings = lint_repository(repo)
    errors = [f for f in findings if f.severity == "error"]
    if as_json:
        click.echo(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for f in findings:
            err.print(f.format(), style="red" if f.severity == "error" else "yellow", markup=False)
        out.print(f"{repo}: {len(errors)} error(s), {len(findings) - len(errors)} warning(s)", markup=False)
    if errors:
        sys.exit(1)


@cli.command()
@click.argument("sweep_file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Points whose CPU steps run in parallel processes.")
@click.option("--dry-run", is_flag=True, help="Validate every point and list them; run nothing.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def sweep(sweep_file: Path, jobs: int, dry_run: bool, quiet: bool, build_dir: Path, repo_dir: Path) -> None:
    """Run a recipe matrix (SWEEP_FILE: base recipe + axes) and print one comparison table."""
    from kiln.experiments.sweep import check_failures, load_sweep, render_table, run_sweep
    from kiln.pipeline.runner import Layout

    layout = Layout(build_dir, repo_dir)
    s = load_sweep(sweep_file, layout)
    if dry_run:
        for p in s.points:
            out.print(f"point {p.index}: {p.label}  → {s.loaded[p.index].recipe.name}", markup=False)
        return
    records = run_sweep(s, layout, jobs=jobs, console=err, progress=not quiet)
    render_table(records, out)
    out.print(f"results: {build_dir / 'sweeps' / s.name}/results.{{jsonl,csv,md}}", markup=False)
    failure = check_failures(records)
    if failure is not None:
        err.print(f"error: {failure}", style="red", markup=False)
        sys.exit(1)
