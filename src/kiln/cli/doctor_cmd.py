"""``kiln doctor``: the first run on a GPU host (kiln.pipeline.doctor)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kiln.cli.commands import layout_options
from kiln.cli.main import EXIT_FAILED, cli, err, handle_errors, out


@cli.command()
@click.option("--target", "targets", type=click.Choice(["tensorrt", "pytorch"]), multiple=True,
              help="Check only this target (repeatable; default: both).")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
@layout_options
@handle_errors
def doctor(targets: tuple[str, ...], as_json: bool, build_dir: Path, repo_dir: Path) -> None:
    """Check this GPU host end to end: the built-in tiny model through the real engine runtime for targets tensorrt
    and pytorch (quantize, evaluate, build or export, package, serve), each served greedy output compared with
    kiln's CPU reference runtime on the same checkpoint. One verdict per step, with the log of what failed. Without
    a GPU (or the container engine, the image, a new enough driver) it says what it would run and why it cannot,
    and exits 1."""
    from kiln.pipeline import doctor as doc

    report = doc.run(build_dir, repo_dir, progress=lambda s: err.print(s, markup=False),
                     targets=tuple(targets) or doc.TARGETS)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        if report.problems:
            out.print("kiln doctor would run, on this machine's GPU (the built-in tiny model):", markup=False)
        for v in report.verdicts:
            out.print("  " + v.line(), markup=False)
        if report.problems:
            out.print("and cannot run here:", markup=False)
            for p in report.problems:
                out.print(f"  - {p}", markup=False)
        else:
            out.print("kiln doctor: " + ("every step passed" if report.ok else "FAILED: send the lines above, the "
                      "logs they name and `kiln doctor --json`"), markup=False)
    if not report.ok:
        sys.exit(EXIT_FAILED)
