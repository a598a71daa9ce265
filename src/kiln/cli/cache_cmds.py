"""``kiln cache``: the remote cache of step outputs for people (CI uses ``kiln build --cache``)."""

from __future__ import annotations

import json
import typing
from typing import Optional

import click

from kiln.cli.commands import cache_option, cache_overrides, layout_options
from kiln.cli.main import cli, err, handle_errors, load, out, set_option
from kiln.recipe.schema import ShareableStep
from kiln.util.errors import InputError

SHAREABLE = click.Choice(list(typing.get_args(ShareableStep)))


def _remote(recipe: Optional[str], overrides, cache: Optional[str], quiet: bool = False):
    from kiln.pipeline.remote import ENV_URL, RemoteCache
    from kiln.recipe.schema import CacheSection

    loaded = load(recipe, cache_overrides(overrides, cache)) if recipe else None
    if loaded is not None:
        remote = RemoteCache.for_recipe(loaded, required=True, console=err, progress=not quiet)
        if remote is None:
            raise InputError(f"no remote cache: give --cache URL, set {ENV_URL}, or cache.remote in {recipe}")
        return loaded, remote
    import os

    url = cache or os.environ.get(ENV_URL)
    if not url:
        raise InputError(f"no remote cache: give --cache URL or set {ENV_URL} (or name a RECIPE with cache.remote)")
    try:
        return None, RemoteCache(url, CacheSection(), required=True, console=err, progress=not quiet)
    except ValueError as exc:
        raise InputError(f"--cache: {exc}") from None


@cli.group()
def cache() -> None:
    """The remote cache of step outputs in an OCI registry: list, pull, push, garbage-collect."""


@cache.command(name="ls")
@click.argument("recipe", required=False)
@set_option
@cache_option
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
@layout_options
@handle_errors
def ls_cmd(recipe, overrides, cache, as_json, build_dir, repo_dir):
    """List the entries (with RECIPE: mark the ones its build would use now)."""
    from kiln.pipeline.cache_ops import list_entries
    from kiln.pipeline.runner import Layout

    loaded, remote = _remote(recipe, overrides, cache)
    rows = list_entries(remote, loaded, Layout(build_dir, repo_dir))
    if as_json:
        click.echo(json.dumps({"cache": str(remote.ref), "entries": [r.as_dict() for r in rows]}, indent=2))
        return
    for r in rows:
        mark = "*" if r.current else " "
        out.print(f"{mark} {r.step:<9} {r.fingerprint[:16]}  {r.bytes / 1e6:>10.1f} MB  {r.created}  {r.recipe}",
                  markup=False)
    out.print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {remote.ref}"
              + (" (* = what this recipe's build would pull now)" if loaded is not None else ""), markup=False)


@cache.command(name="pull")
@click.argument("recipe")
@set_option
@cache_option
@click.option("--step", "steps", type=SHAREABLE, multiple=True, help="Only this step (repeatable; default: "
              "the recipe's cache.share).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def pull_cmd(recipe, overrides, cache, steps, quiet, build_dir, repo_dir):
    """Pull RECIPE's current outputs from the remote cache into the build directory (verified, atomic)."""
    from kiln.pipeline.cache_ops import pull_outputs
    from kiln.pipeline.runner import Layout

    loaded, remote = _remote(recipe, overrides, cache, quiet)
    for line in pull_outputs(loaded, Layout(build_dir, repo_dir), remote, tuple(steps)):
        out.print(line, markup=False)


@cache.command(name="push")
@click.argument("recipe")
@set_option
@cache_option
@click.option("--step", "steps", type=SHAREABLE, multiple=True, help="Only this step (repeatable; default: "
              "the recipe's cache.share).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@layout_options
@handle_errors
def push_cmd(recipe, overrides, cache, steps, quiet, build_dir, repo_dir):
    """Push RECIPE's complete, up-to-date local outputs to the remote cache (layers it has are skipped)."""
    from kiln.pipeline.cache_ops import push_outputs
    from kiln.pipeline.runner import Layout

    loaded, remote = _remote(recipe, overrides, cache, quiet)
    for line in push_outputs(loaded, Layout(build_dir, repo_dir), remote, tuple(steps)):
        out.print(line, markup=False)


@cache.command(name="gc")
@cache_option
@click.option("--older-than", "days", type=click.FloatRange(min=0), required=True, metavar="DAYS",
              help="Delete entries created more than DAYS days ago.")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@handle_errors
def gc_cmd(cache, days, dry_run):
    """Delete old entries from the remote cache (the registry must allow deletes)."""
    from kiln.pipeline.cache_ops import gc_entries

    _, remote = _remote(None, (), cache)
    rows, note = gc_entries(remote, days, dry_run)
    for r in rows:
        out.print(f"{'would delete' if dry_run else 'deleted'} {r.step} {r.fingerprint[:16]} ({r.created}, "
                  f"{r.bytes / 1e6:.1f} MB)", markup=False)
    out.print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} {'to delete' if dry_run else 'deleted'}; {note}",
              markup=False)
