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


def cache_overrides(overrides: tuple[str, ...], cache: Optional[str]) -> tuple[str, ...]:
    """--cache URL (else $KILN_REMOTE_CACHE, unless --set cache.remote=… is given) as the override
    ``cache.remote=URL``, validated like the recipe's own value; ``--cache none`` turns the remote cache off."""
    from kiln.pipeline.remote import ENV_URL

    explicit = any(o.split("=", 1)[0].strip() == "cache.remote" for o in overrides)
    url = cache if cache is not None else None if explicit else os.environ.get(ENV_URL) or None
    if url is None:
        return overrides
    return (*overrides, "cache.remote=null" if url.strip().lower() in ("none", "off", "") else f"cache.remote={url}")


def cache_option(fn):
    return click.option("--cache", "cache", metavar="URL",
                        help="Remote cache of step outputs: oci://HOST/REPOSITORY (oci+http:// for plain HTTP), "
                             "or none. Beats $KILN_REMOTE_CACHE, which beats the recipe's cache.remote.")(fn)


def _run_build(recipe: str, overrides, strict, from_step, to_step, force, dry_run, build_dir, repo_dir,
               as_json: bool, quiet: bool, cache: Optional[str] = None, cache_required: bool = False,
               junit: Optional[Path] = None) -> None:
    from kiln.pipeline.remote import RemoteCache
    from kiln.pipeline.reports import schedule_dict, summary_json, write_junit
    from kiln.pipeline.runner import Layout, Status, describe_schedule, render_summary, run, schedule

    loaded = load(recipe, cache_overrides(overrides, cache), strict)
    layout = Layout(build_dir, repo_dir)
    if dry_run:
        scheduled = schedule(loaded, layout, force, from_step, to_step)
        if as_json:
            remote = RemoteCache.for_recipe(loaded, console=err, progress=False)
            click.echo(json.dumps(schedule_dict(scheduled, loaded, remote.lookup if remote else None), indent=2))
        else:
            describe_schedule(scheduled, loaded, out, layout.build_root)
            from kiln.pipeline.preflight import check

            for problem in check(loaded, [p.spec.name for p in scheduled if p.action == "run"], layout.build_root):
                out.print(f"  preflight: {problem}", markup=False, style="yellow")
        return
    remote = RemoteCache.for_recipe(loaded, cache_required, console=err, progress=not quiet)
    with stdout_to_stderr(as_json):  # libraries that print to stdout must not corrupt the JSON
        summary = run(loaded, layout, force, from_step, to_step, console=err, progress=not quiet, remote=remote)
    if junit is not None:
        write_junit(summary, junit)
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
@click.option("--dry-run", is_flag=True, help="Print the plan (run/skip and why, the exact engine build command); "
              "with --json, each step's fingerprint and whether the remote cache has it.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the run summary (or with --dry-run the schedule) as JSON on stdout (schema_version 1).")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False),
              help="Write a JUnit XML report: a test case per step and per quality-gate criterion.")
@cache_option
@click.option("--cache-required", is_flag=True,
              help="Fail (exit 1) on any remote-cache error instead of warning and building locally.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def build(recipe, overrides, strict, from_step, to_step, force, dry_run, as_json, junit, cache, cache_required, quiet,
          build_dir, repo_dir):
    """Build RECIPE: resolve → quantize → evaluate → build (engine) → package, skipping what is up to date."""
    _run_build(recipe, overrides, strict, from_step, to_step, force, dry_run, build_dir, repo_dir, as_json, quiet,
               cache, cache_required, junit)


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
@click.argument("recipes", nargs=-1, required=True, metavar="RECIPE...")
@set_option
@click.option("--gpu", help="GPU to plan for (default: the recipe's hardware.gpu); with --compare, a comma-separated "
              "list to compare.")
@click.option("--count", type=int, help="GPUs available (default: the recipe's hardware.count, else tp × pp).")
@click.option("--model-config", type=click.Path(path_type=Path, exists=True, dir_okay=True),
              help="A Hugging Face config.json (or model directory) for models kiln has no config for.")
@click.option("--isl", type=click.IntRange(1), help="Prompt length in tokens: also predict serving speed for this "
              "workload (TTFT, TPOT, E2E, tokens/s, the batch reached and what limits it).")
@click.option("--osl", type=click.IntRange(1), help="Output length in tokens (with --isl).")
@click.option("--concurrency", type=click.IntRange(1), help="Requests in flight (default: the largest batch the "
              "KV cache, max_batch_size and max_num_tokens allow: maximum throughput).")
@click.option("--compare", is_flag=True, help="Plan each RECIPE (on each --gpu) for the same workload side by side; "
              "writes compare.json and compare.png (tokens/s per GPU against TTFT) to --out.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("build/plan-compare"),
              show_default=True, help="Where --compare writes its files.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (with --compare: the comparison) as JSON.")
@handle_errors
def plan_cmd(recipes, overrides, gpu: Optional[str], count: Optional[int], model_config: Optional[Path], isl, osl,
             concurrency, compare: bool, out_dir: Path, as_json: bool):
    """Memory, KV-cache capacity and speed of RECIPE on a GPU — no GPU needed.

    With --isl/--osl it predicts serving speed with in-flight batching; the speed model is calibrated on
    TensorRT-LLM's published trtllm-bench figures, measured with the PyTorch backend (a proxy for target:
    tensorrt). With --compare, several recipes and GPUs side by side for one workload.
    """
    from kiln.plan import PlanError, Workload, plan_for, render_plan

    problems = []
    if (isl is None) != (osl is None):
        problems.append("--isl and --osl go together")
    if concurrency is not None and isl is None:
        problems.append("--concurrency needs --isl and --osl")
    if compare and isl is None:
        problems.append("--compare needs a workload: --isl and --osl")
    gpus = [g.strip() for g in gpu.split(",") if g.strip()] if gpu else [None]
    if not compare and len(recipes) > 1:
        problems.append(f"{len(recipes)} recipes given: plan one, or add --compare")
    if not compare and len(gpus) > 1:
        problems.append("several --gpu values need --compare")
    if compare and len(recipes) * len(gpus) < 2:
        problems.append("--compare needs two or more recipes or GPUs (e.g. --gpu H100-SXM,H200)")
    if problems:
        raise InputError("; ".join(problems))
    workload = Workload(isl, osl, concurrency) if isl is not None else None
    if not compare:
        loaded = load(recipes[0], overrides)
        try:
            result = plan_for(loaded, gpus[0], count, model_config, workload)
        except PlanError as exc:
            raise InputError(str(exc)) from None
        from kiln.plan.workers import recipe_worker_memory

        workers = recipe_worker_memory(loaded, result)
        if as_json:
            click.echo(json.dumps({**result.to_dict(), "workers": workers.to_dict()}, indent=2))
        else:
            render_plan(result, out)
            out.print(f"\nEngine-runtime workers (quantize, export, evaluate): {workers.verdict()}; the evaluation "
                      f"keeps {workers.base_logprob_bytes / 2**30:,.1f} GiB of base log-probabilities on the scratch "
                      "disk", markup=False)
        return
    _plan_compare(recipes, overrides, gpus, count, model_config, workload, out_dir, as_json)


def _plan_compare(recipes, overrides, gpus, count, model_config, workload, out_dir: Path, as_json: bool) -> None:
    from kiln.plan import PlanError, plan_for
    from kiln.plan.compare import compare_entry, compare_json, render_compare, write_compare

    entries = []
    for recipe in recipes:
        loaded = load(recipe, overrides)
        for g in gpus:
            try:
                plan = plan_for(loaded, g, count, model_config)
            except PlanError as exc:
                raise InputError(f"{recipe}: {exc}") from None
            label = loaded.recipe.name + (f" on {plan.gpu['name']}" if len(gpus) > 1 or g else "")
            entries.append(compare_entry(label, loaded.recipe.name, plan, workload))
    paths = write_compare(entries, workload, out_dir)
    if as_json:
        click.echo(json.dumps(compare_json(entries, workload), indent=2))
    else:
        render_compare(entries, workload, out)
    err.print("wrote " + ", ".join(str(p) for p in paths.values()), markup=False)


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
