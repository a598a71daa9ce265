"""Crash-safe step outputs: written to a temporary sibling, renamed into place only when complete.

A complete output is a directory with a `manifest.json` whose `complete` is true, written last, and whose
listed files exist with their recorded sizes. Anything else — a temp dir left by a crash, a directory
without a manifest — is never accepted, and temp leftovers are swept on the next run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

MANIFEST = "manifest.json"
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def read_manifest(out_dir: Path, required: Iterable[str] = ()) -> Optional[dict[str, Any]]:
    """The manifest of a complete output, or None.

    None when the manifest is missing, unreadable or not marked complete; when a file it lists is missing or
    has another size; or when a file in ``required`` (the files the step's contract says a complete output
    holds) is not among the files the manifest lists — a manifest written before the step's files is never
    taken for a complete output.
    """
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("complete") is not True:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None
    if any(rel not in files for rel in required):
        return None
    for rel, size in files.items():
        try:
            if (out_dir / rel).stat().st_size != size:
                return None
        except OSError:
            return None
    return manifest


def file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, durably (fsync), with the sizes of every file in the output."""
    manifest = {**manifest, "files": file_sizes(out_dir), "complete": True}
    tmp = out_dir / (MANIFEST + ".part")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out_dir / MANIFEST)


def leftovers(parent: Path, names: Iterable[str]) -> list[Path]:
    """Temp and old outputs (``.<name>.tmp-*``, ``.<name>.old-*``) of the outputs called ``names`` under
    ``parent``: what a killed writer left behind. Call while holding the build lock that every writer of those
    outputs holds, so none of them is still being written."""
    if not parent.is_dir():
        return []
    prefixes = tuple(f".{n}{mark}" for n in names for mark in (TMP_MARK, OLD_MARK))
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))


def sweep_leftovers(final: Path) -> list[Path]:
    """Remove temp/old siblings of `final` left by a crashed run (call while holding the build lock)."""
    found = leftovers(final.parent, [final.name])
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temp dir beside `final`; on normal exit it replaces `final` (old output removed).

    On an exception (or a kill) `final` is untouched and the temp dir is removed (or swept next run).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}{OLD_MARK}{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy a directory tree by hard links (no extra disk for large checkpoints and engines); plain copies
    where links are impossible (another filesystem). File names in `skip` are left out."""
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name not in skip:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
