"""The runner's remote-cache hook: look a shared step's fingerprint up before it runs and pull a hit into place;
push what was built (or is up to date here and missing there) after.

The cache itself is :mod:`kiln.cache` (registry client, credentials, artifact format). This module decides what
to share (``cache.share``), checks that a pulled output is the one asked for (its recomputed fingerprint, the
step, its typed result, the files the step's contract requires), reports progress, and applies the failure
policy: an unreachable registry, refused credentials, a corrupt layer or a bad entry each print one clear
warning and the step is built here — unless ``--cache-required``, where the build fails instead.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

import kiln
from kiln.cache import artifact
from kiln.cache.errors import BadArtifact, CacheError, DigestMismatch
from kiln.cache.reference import CacheRef, parse_cache_url
from kiln.cache.registry import Registry
from kiln.pipeline.fingerprint import digest
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import CacheSection
from kiln.steps.base import StepResult
from kiln.util.artifacts import read_manifest
from kiln.util.errors import InputError, KilnError

if TYPE_CHECKING:
    from kiln.pipeline.runner import ScheduledStep

ENV_URL = "KILN_REMOTE_CACHE"


def tag_for(step: str, fingerprint: str) -> str:
    """The entry's tag: the step and its full fingerprint (a valid OCI tag: 72 characters)."""
    return f"{step}-{fingerprint}"


#: Steps whose entry files written beside the output name by manifest digest (the package step's deploy files):
#: their entry's creation annotation is the build's start time, so the digest is a function of the output alone.
PINNED_STEPS = ("package",)


@dataclass(frozen=True)
class EntrySource:
    """Where a step's output lives in the remote cache: the cache URL, the entry's tag and its manifest digest."""

    cache: str
    tag: str
    digest: str


@dataclass
class Pulled:
    result: StepResult
    info: dict[str, Any]
    """Recorded as the manifest's ``pulled`` field: where from, which manifest digest, who built it."""


class _Meter:
    """A rich progress bar in bytes for one transfer (nothing when progress is off)."""

    def __init__(self, progress: Optional[Progress], label: str):
        self._progress, self._label, self._task = progress, label, None

    def phase(self, name: str, total: int) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(f"{name} {self._label}", total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)


class RemoteCache:
    """The remote cache for one build (``run(..., remote=...)``)."""

    def __init__(self, url: str, section: CacheSection, required: bool = False,
                 console: Optional[Console] = None, progress: bool = True, registry: Optional[Registry] = None):
        self.ref: CacheRef = parse_cache_url(url)
        self.section = section
        self.required = required
        self.console = console or Console(stderr=True)
        self.progress = progress
        self.registry = registry or Registry(self.ref)
        self.disabled: Optional[str] = None
        self.warnings: list[str] = []
        self._corrupt: dict[str, str] = {}
        """step → a blob of its entry whose bytes did not match its digest this run."""
        self._refused: set[str] = set()
        """Steps whose entry was refused this run as not a sound kiln entry (BadArtifact): pushed over."""

    @classmethod
    def for_recipe(cls, loaded: LoadedRecipe, required: bool = False, console: Optional[Console] = None,
                   progress: bool = True) -> Optional["RemoteCache"]:
        url = loaded.recipe.cache.remote
        if not url:
            if required:
                raise InputError("--cache-required, but no remote cache is configured: give --cache URL, set "
                                 f"{ENV_URL}, or cache.remote in the recipe")
            return None
        return cls(url, loaded.recipe.cache, required, console, progress)

    # ------------------------------------------------------------------ policy
    def shares(self, step: str) -> bool:
        return self.disabled is None and step in self.section.share

    def _fail(self, exc: CacheError, doing: str, fallback: str) -> None:
        message = f"remote cache {self.ref}: {doing}: {exc}"
        if self.required:
            raise KilnError(f"{message} (--cache-required)") from None
        if exc.disables:
            self.disabled = str(exc)
            fallback += "; the remote cache is off for the rest of this build"
        self.warn(f"{message} — {fallback}")

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    @contextmanager
    def _meter(self, label: str) -> Iterator[_Meter]:
        if not self.progress:
            yield _Meter(None, label)
            return
        with Progress(TextColumn("  {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=self.console, transient=True) as bar:
            yield _Meter(bar, label)

    # ------------------------------------------------------------------ lookup / pull / push
    def lookup(self, p: "ScheduledStep") -> Optional[str]:
        """For --dry-run: "hit", "miss", or "error: …" for a shared step (None when the step is not shared)."""
        if not (self.section.pull and self.shares(p.spec.name)):
            return None
        try:
            found = self.registry.get_manifest(tag_for(p.spec.name, p.fingerprint))
        except CacheError as exc:
            if exc.disables:
                self.disabled = str(exc)
            return f"error: {exc}"
        return "hit" if found is not None else "miss"

    def pull(self, p: "ScheduledStep", tmp: Path, loaded: LoadedRecipe) -> Optional[Pulled]:
        """Pull the step's output for this fingerprint into ``tmp`` (the empty temporary output directory);
        None on a miss or a failure that falls back to building (``tmp`` then emptied again)."""
        name = p.spec.name
        if not (self.section.pull and self.shares(name)):
            return None
        tag = tag_for(name, p.fingerprint)
        try:
            entry = artifact.read_entry(self.registry, tag)
            if entry is None:
                self.console.print(f"  [dim]remote cache: no {name} output for this fingerprint in {self.ref}[/]",
                                   highlight=False)
                return None
            result = self._check(p, entry, loaded)
            with self._meter(name) as meter:
                transfer = artifact.pull(self.registry, entry, tmp, meter)
        except OSError as exc:  # writing here failed (disk full, permissions): the step may still build
            _empty(tmp)
            self._fail(CacheError(f"writing {tmp}: {exc.strerror or exc}"), f"pulling {name}", "building it here")
            return None
        except CacheError as exc:
            _empty(tmp)
            if isinstance(exc, DigestMismatch):
                self._corrupt[name] = exc.digest
            elif isinstance(exc, BadArtifact):
                self._refused.add(name)
            self._fail(exc, f"pulling {name}", "building it here" + (
                " and pushing it over that entry" if name in self._refused and self.section.push else ""))
            return None
        self.console.print(f"  [cyan]↓[/] {name}: {transfer.describe('pulled')} from {self.ref}", highlight=False)
        built = entry.config
        info = {"from": self.ref.tag_ref(tag), "digest": entry.digest, "bytes": transfer.bytes_moved,
                "seconds": round(transfer.seconds, 3), "at": datetime.now(timezone.utc).isoformat(),
                "built": {"recipe": built.get("recipe"), "started": built.get("started"),
                          "seconds": built.get("seconds"), "host": (built.get("host") or {}).get("name")}}
        return Pulled(result, info)

    def _check(self, p: "ScheduledStep", entry: artifact.Entry, loaded: LoadedRecipe) -> StepResult:
        where = self.ref.tag_ref(entry.tag)
        config = entry.config
        if entry.annotations.get(artifact.A_FINGERPRINT) != p.fingerprint or config.get("fingerprint") != p.fingerprint:
            raise BadArtifact(f"{where} is labelled with another fingerprint")
        if not isinstance(config.get("components"), dict) or digest(config["components"]) != p.fingerprint:
            raise BadArtifact(f"{where}: its recorded components do not hash to its fingerprint")
        if config.get("step") != p.spec.name or config.get("complete") is not True:
            raise BadArtifact(f"{where} is not a complete {p.spec.name} output")
        result = p.spec.load_result(config.get("result"))
        if result is None:
            raise BadArtifact(f"{where}: its result does not validate as {p.spec.result.__name__} (written by "
                              "another kiln version)")
        missing = [f for f in p.spec.required_files(loaded.recipe) if f not in (config.get("files") or {})]
        if missing:
            raise BadArtifact(f"{where} lacks {', '.join(missing)}")
        return result

    def entry_source(self, p: "ScheduledStep", out_dir: Path) -> Optional[EntrySource]:
        """The entry that holds (or, once pushed, will hold) the complete output in ``out_dir``, by digest: the
        pulled entry's, else the digest the push gives it, computed here without the registry. None when the step
        is not shared or not pinned."""
        name = p.spec.name
        manifest = read_manifest(out_dir)
        if name not in PINNED_STEPS or name not in self.section.share or manifest is None:
            return None
        tag = tag_for(name, p.fingerprint)
        pulled = manifest.get("pulled") or {}
        if pulled.get("digest"):
            return EntrySource(str(self.ref), tag, str(pulled["digest"]))
        return EntrySource(str(self.ref), tag, self._predict(p, out_dir, manifest))

    def _predict(self, p: "ScheduledStep", out_dir: Path, manifest: dict[str, Any]) -> str:
        return artifact.predict_digest(out_dir, manifest, self.section.layer_mb << 20,
                                       self._annotations(p, manifest), str(manifest.get("started")),
                                       memo=artifact.PartMemo(out_dir))

    def push(self, p: "ScheduledStep", out_dir: Path, step_manifest: dict[str, Any], built_here: bool) -> Optional[str]:
        """Push a complete output unless the registry has it already; its reference, or None (not shared, already
        there, or a failure that was warned about)."""
        name = p.spec.name
        if not (self.section.push and self.shares(name)):
            return None
        if name in self._corrupt:
            # A registry keeps a blob's stored bytes when the same digest is uploaded again (distribution does,
            # even after a DELETE, until its offline garbage collection), so pushing would not repair it.
            self.warn(f"remote cache {self.ref}: {name} not pushed: the registry's copy of blob "
                      f"{self._corrupt[name]} is corrupt; its operator must delete entry "
                      f"{tag_for(name, p.fingerprint)} and run the registry's garbage collection")
            return None
        tag = tag_for(name, p.fingerprint)
        pinned = name in PINNED_STEPS
        try:
            # An entry refused this run is replaced by this sound output (same fingerprint, so the same tag).
            found = None if name in self._refused else self.registry.get_manifest(tag)
            reference = tag
            if found is not None:
                if not pinned:
                    return None
                # Another build of this fingerprint holds the tag; the deploy files written here name this build's
                # digest: add that manifest by digest (its layers are the same blobs), leaving the tag as it is.
                reference = self._predict(p, out_dir, step_manifest)
                if reference == found[1] or self.registry.get_manifest(reference) is not None:
                    return None
            with self._meter(name) as meter:
                transfer = artifact.push(self.registry, reference, out_dir, step_manifest,
                                         self.section.layer_mb << 20, self._annotations(p, step_manifest), meter,
                                         created=str(step_manifest.get("started")) if pinned else None,
                                         memo=artifact.PartMemo(out_dir))
        except OSError as exc:
            self._fail(CacheError(f"reading {out_dir}: {exc.strerror or exc}"), f"pushing {name}",
                       "the output here is kept")
            return None
        except CacheError as exc:
            self._fail(exc, f"pushing {name}",
                       "the output built here is kept" if built_here else "nothing changed here")
            return None
        self.console.print(f"  [cyan]↑[/] {name}: {transfer.describe('pushed')} to {self.ref}", highlight=False)
        return self.ref.tag_ref(tag) if reference == tag else f"{self.ref}@{transfer.digest}"

    @staticmethod
    def _annotations(p: "ScheduledStep", step_manifest: dict[str, Any]) -> dict[str, str]:
        return {artifact.A_STEP: p.spec.name, artifact.A_FINGERPRINT: p.fingerprint,
                artifact.A_RECIPE: str(step_manifest.get("recipe", "")), artifact.A_VERSION: kiln.__version__}


def _empty(directory: Path) -> None:
    """Remove what a failed pull wrote, keeping the (temporary) directory itself."""
    for child in list(directory.iterdir()) if directory.is_dir() else []:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
