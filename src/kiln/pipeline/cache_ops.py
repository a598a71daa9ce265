"""What ``kiln cache ls|pull|push|gc`` do, on the same hook the runner uses (:mod:`kiln.pipeline.remote`)."""

from __future__ import annotations

import json
import time
import typing
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Optional

from kiln.cache import artifact
from kiln.cache.errors import BadArtifact
from kiln.pipeline.remote import RemoteCache, tag_for
from kiln.pipeline.runner import Action, Layout, _lock, _manifest, read_manifest, schedule, sweep_recipe_leftovers
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import ShareableStep
from kiln.util.artifacts import atomic_dir, write_manifest
from kiln.util.errors import InputError, KilnError


@dataclass
class EntryRow:
    tag: str
    step: str
    fingerprint: str
    recipe: str
    created: str
    bytes: int
    digest: str
    current: bool = False
    """The recipe given to ``kiln cache ls`` would use this entry now."""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def list_entries(remote: RemoteCache, loaded: Optional[LoadedRecipe] = None,
                 layout: Optional[Layout] = None) -> list[EntryRow]:
    """Every kiln entry in the repository (from manifest annotations; configs are not fetched)."""
    wanted: set[str] = set()
    if loaded is not None:
        wanted = {tag_for(p.spec.name, p.fingerprint) for p in schedule(loaded, layout or Layout())}
    rows = []
    for tag in sorted(remote.registry.tags()):
        found = remote.registry.get_manifest(tag)
        if found is None:
            continue
        try:
            manifest = json.loads(found[0])
        except ValueError:
            continue
        if manifest.get("artifactType") != artifact.ARTIFACT_TYPE:
            continue
        ann = manifest.get("annotations") or {}
        rows.append(EntryRow(tag, ann.get(artifact.A_STEP, "?"), ann.get(artifact.A_FINGERPRINT, "?"),
                             ann.get(artifact.A_RECIPE, "?"), ann.get(artifact.CREATED, "?"),
                             int(ann.get(artifact.A_BYTES, 0) or 0), found[1], tag in wanted))
    return rows


def _steps(loaded: LoadedRecipe, steps: tuple[str, ...]) -> tuple[str, ...]:
    shareable = typing.get_args(ShareableStep)
    chosen = steps or loaded.recipe.cache.share
    bad = [s for s in chosen if s not in shareable]
    if bad:
        raise InputError(f"--step {bad[0]}: not a step the cache can share ({', '.join(shareable)})")
    return tuple(chosen)


def pull_outputs(loaded: LoadedRecipe, layout: Layout, remote: RemoteCache, steps: tuple[str, ...] = ()) -> list[str]:
    """Pull the recipe's current outputs of ``steps`` (default: ``cache.share``) into the build directory, each
    verified and renamed into place like a build's; lines saying what happened. KilnError when a step is
    neither up to date here nor in the cache."""
    chosen = _steps(loaded, steps)
    remote.section = remote.section.model_copy(update={"share": chosen, "pull": True})
    lines, missing = [], []
    lock = _lock(layout.build_dir(loaded.recipe.name), remote.console)
    try:
        sweep_recipe_leftovers(loaded, layout)  # what an interrupted pull or build left
        for p in schedule(loaded, layout):
            if p.spec.name not in chosen:
                continue
            if p.action == Action.SKIP:
                lines.append(f"{p.spec.name}: up to date here ({p.out_dir})")
                continue
            started, t0 = time.time(), time.monotonic()
            try:
                with atomic_dir(p.out_dir) as tmp:
                    pulled = remote.pull(p, tmp, loaded)
                    if pulled is None:
                        raise _Miss()
                    manifest = _manifest(p, loaded, pulled.result, started, time.monotonic() - t0, None)
                    manifest["pulled"] = pulled.info
                    write_manifest(tmp, manifest)
            except _Miss:
                missing.append(p.spec.name)
                lines.append(f"{p.spec.name}: not in {remote.ref} (fingerprint {p.fingerprint[:12]}…)")
                continue
            if p.spec.finish is not None:  # what lives beside the output (the package step's deploy files)
                p.spec.finish(loaded, p.out_dir, remote.entry_source(p, p.out_dir))
            lines.append(f"{p.spec.name}: pulled into {p.out_dir}")
    finally:
        lock.release()
    if missing:
        raise KilnError("\n".join(lines) + f"\nnot in the remote cache: {', '.join(missing)} — build them "
                        "(kiln build pushes them)")
    return lines


class _Miss(Exception):
    pass


def push_outputs(loaded: LoadedRecipe, layout: Layout, remote: RemoteCache, steps: tuple[str, ...] = ()) -> list[str]:
    """Push the recipe's complete, current local outputs of ``steps`` (default: ``cache.share``)."""
    chosen = _steps(loaded, steps)
    remote.section = remote.section.model_copy(update={"share": chosen, "push": True})
    lines, stale = [], []
    for p in schedule(loaded, layout):
        if p.spec.name not in chosen:
            continue
        manifest = read_manifest(p.out_dir)
        if p.action != Action.SKIP or manifest is None:
            stale.append(p.spec.name)
            lines.append(f"{p.spec.name}: no complete, current output here ({'; '.join(p.reasons)})")
            continue
        ref = remote.push(p, p.out_dir, manifest, built_here=False)
        lines.append(f"{p.spec.name}: pushed to {ref}" if ref else f"{p.spec.name}: already in {remote.ref}")
    if stale:
        raise KilnError("\n".join(lines) + f"\nnothing to push for {', '.join(stale)}: run kiln build first")
    return lines


def gc_entries(remote: RemoteCache, older_than_days: float, dry_run: bool = False) -> tuple[list[EntryRow], str]:
    """Delete (untag) entries created more than ``older_than_days`` ago; the rows deleted (or that would be)
    and a note on freeing their storage."""
    cutoff = datetime.now(timezone.utc) - timedelta(days=older_than_days)
    doomed = []
    for row in list_entries(remote):
        try:
            created = datetime.fromisoformat(row.created)
        except ValueError:
            raise BadArtifact(f"{remote.ref.tag_ref(row.tag)} has no creation time; delete it by hand") from None
        if created < cutoff:
            doomed.append(row)
    if not dry_run:
        for row in doomed:
            remote.registry.delete_manifest(row.digest)
    note = ("the registry frees the blobs no manifest references in its own garbage collection "
            "(distribution: `registry garbage-collect CONFIG`; hosted registries run it on their schedule)")
    return doomed, note
