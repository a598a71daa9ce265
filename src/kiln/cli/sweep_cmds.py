"""`kiln sweep`: run a recipe matrix here, as a Slurm job array or as a Kubernetes Indexed Job, and collect it.

    kiln sweep SWEEP.yaml [--executor local|slurm|kubernetes] [--set slurm.partition=gpu] [--no-wait] [--dry-run]
    kiln sweep collect SWEEP.yaml [--wait]
    kiln sweep task TASK.json [--index N]        (what each cluster task runs; not for people)

`kiln sweep SWEEP.yaml` is short for `kiln sweep run SWEEP.yaml`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from kiln.cli.commands import layout_options
from kiln.cli.main import cli, err, handle_errors, out

EXECUTOR = click.Choice(["local", "slurm", "kubernetes"])


class _RunByDefault(click.Group):
    """A group whose first argument, when it is not a sub-command, is the sweep file of `run`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def sweep_options(fn):
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                      help="Override a sweep-file key (repeatable), e.g. slurm.partition=gpu, measure=[quality], "
                           "set.evaluation.samples=16.")(fn)
    fn = click.option("--executor", type=EXECUTOR, default=None,
                      help="Where the points run (default: the sweep file's executor, else local).")(fn)
    return fn


@cli.group(cls=_RunByDefault)
def sweep() -> None:
    """Run a recipe matrix (SWEEP_FILE: base recipe + axes) here, on Slurm or on Kubernetes, and compare the
    points in one table (build/sweeps/<name>/results.{jsonl,csv,md} and plots).

    `kiln sweep SWEEP_FILE …` is short for `kiln sweep run SWEEP_FILE …`."""


@sweep.command(name="run")
@click.argument("sweep_file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@sweep_options
@click.option("--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Local executor: points whose CPU steps run in parallel processes.")
@click.option("--dry-run", is_flag=True, help="Validate every point and list them (Slurm: print the sbatch "
              "script; Kubernetes: the manifest); run and write nothing.")
@click.option("--no-wait", is_flag=True, help="Slurm: submit and return; `kiln sweep collect` gathers later.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def run_cmd(sweep_file: Path, overrides: tuple[str, ...], executor: Optional[str], jobs: int, dry_run: bool,
            no_wait: bool, quiet: bool, build_dir: Path, repo_dir: Path) -> None:
    """Run SWEEP_FILE's points: here (local; cached steps are skipped), as a Slurm job array, or as a
    Kubernetes Indexed Job (points that already have a result are not submitted again)."""
    from kiln.experiments.sweep import check_failures, load_sweep, render_table, run_sweep
    from kiln.pipeline.runner import Layout
    from kiln.util.errors import InputError

    layout = Layout(build_dir, repo_dir)
    s = load_sweep(sweep_file, layout, overrides, executor)
    if s.spec.executor != "local":
        if jobs != 1:
            raise InputError(f"--jobs is for the local executor; {s.spec.executor} runs each point as its own task")
        _cluster(s, layout, dry_run, not no_wait)
        return
    if no_wait:
        raise InputError("--no-wait is for the cluster executors (slurm); a local sweep runs here")
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


def _cluster(s, layout, dry_run: bool, wait: bool) -> None:
    from kiln.experiments.cluster import submit_sweep

    records = submit_sweep(s, layout, dry_run=dry_run, wait=wait, console=err, out=out)
    if records is not None:
        _report(records, layout, s.name)


def _report(records: list[dict], layout, name: str) -> None:
    from kiln.experiments.sweep import render_table
    from kiln.experiments.tasks import failures

    render_table(records, out)
    out.print(f"results: {layout.build_root / 'sweeps' / name}/results.{{jsonl,csv,md}}", markup=False)
    for r in records:
        if r["status"] == "failed" and r.get("log_tail"):
            err.print(f"--- point {r['point']} ({r['label']}): last lines of its log "
                      f"{(r.get('task') or {}).get('log') or ''}", style="red", markup=False)
            err.print(r["log_tail"], markup=False, highlight=False)
    failure = failures(records)
    if failure is not None:
        err.print(f"error: {failure}", style="red", markup=False)
        sys.exit(1)


@sweep.command(name="collect")
@click.argument("sweep_file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@sweep_options
@click.option("--wait", is_flag=True, help="Slurm: wait until no point is queued or running, showing progress.")
@layout_options
@handle_errors
def collect_cmd(sweep_file: Path, overrides: tuple[str, ...], executor: Optional[str], wait: bool, build_dir: Path,
                repo_dir: Path) -> None:
    """Gather what a cluster ran for SWEEP_FILE into results.{jsonl,csv,md} and plots (Kubernetes: with the
    PVC mounted or copied here, --build-dir <PVC>/build). Exit 0 only when every point is ok."""
    from kiln.experiments.cluster import collect_sweep
    from kiln.experiments.sweep import load_sweep
    from kiln.pipeline.runner import Layout

    layout = Layout(build_dir, repo_dir)
    s = load_sweep(sweep_file, layout, overrides, executor)
    records = collect_sweep(s, layout, wait=wait, console=err)
    _report(records, layout, s.name)


@sweep.command(name="task", hidden=True)
@click.argument("task_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--index", type=click.IntRange(0), default=None,
              help="Which point of the task file (default: $JOB_COMPLETION_INDEX, else $SLURM_ARRAY_TASK_ID).")
@click.option("--inline", "result", type=click.Path(path_type=Path), default=None, hidden=True,
              help="Run the point in this process and write its record to this file (the task's child).")
@handle_errors
def task_cmd(task_file: Path, index: Optional[int], result: Optional[Path]) -> None:
    """Run one point of a cluster sweep (what each Slurm array task and Kubernetes pod runs)."""
    from kiln.experiments.tasks import run_task, run_task_inline, task_index

    if result is not None:
        run_task_inline(task_file, task_index(index), result)
        return

    def passthrough(line: bytes) -> None:
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()

    sys.exit(run_task(task_file, index, passthrough))
