"""The runner: schedule which steps to run (and why), run them under a lock into atomic outputs, summarise.

`build/<recipe>/<step>/manifest.json` records each step's fingerprint components, the resolved recipe, its
typed result, timings and the host; a step is skipped only when its fingerprint matches a complete output
(every file its contract requires listed and present, its stored result valid for the step's result type).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from filelock import FileLock, Timeout
from rich.console import Console
from rich.table import Table

from kiln.pipeline import preflight
from kiln.pipeline.fingerprint import diff, digest, flatten, select, tool_versions
from kiln.pipeline.registry import STEP_ORDER, load_steps
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.render import recipe_yaml
from kiln.steps.base import Gate, StepContext, StepResult, StepSpec
from kiln.util.artifacts import atomic_dir, leftovers, link_tree, read_manifest, write_manifest
from kiln.util.errors import InputError, KilnError

if TYPE_CHECKING:
    from kiln.pipeline.remote import RemoteCache


class _Word(str, Enum):
    """An enum whose members print and serialise as their plain value ("ran", not "Status.RAN")."""

    def __str__(self) -> str:
        return str(self.value)

    __format__ = str.__format__


class Action(_Word):
    """What the schedule decided for a step."""

    RUN = "run"
    SKIP = "skip"  # up to date: the stored output is used
    OUTSIDE = "outside"  # outside --from/--to: the stored output is used if there is one


class Status(_Word):
    """What happened to a step in a run."""

    RAN = "ran"
    REUSED = "reused"  # same fingerprint under another recipe: hard-linked instead of recomputed
    PULLED = "pulled"  # same fingerprint in the remote cache: pulled and verified instead of recomputed
    SKIPPED = "skipped"
    FAILED = "failed"
    NOT_RUN = "not run"


@dataclass
class Layout:
    """Where outputs go: build/<recipe>/<step>/ and (package) triton_repo/<recipe>/."""

    build_root: Path = Path("build")
    repo_root: Path = Path("triton_repo")

    def build_dir(self, name: str) -> Path:
        return self.build_root / name

    def step_dir(self, spec: StepSpec, loaded: LoadedRecipe) -> Path:
        if spec.output_dir is not None:
            return spec.output_dir(loaded, self.repo_root)
        return self.build_dir(loaded.recipe.name) / spec.name


@dataclass
class ScheduledStep:
    spec: StepSpec
    out_dir: Path
    components: dict[str, Any]
    fingerprint: str
    action: Action
    reasons: list[str] = field(default_factory=list)
    manifest: Optional[dict] = None
    stored: Optional[StepResult] = None
    """The stored output's result, validated as the step's result type (None when there is none)."""


@dataclass
class StepOutcome:
    name: str
    status: Status
    seconds: float = 0.0
    out_dir: Optional[Path] = None
    result: Optional[StepResult] = None
    message: str = ""
    reused_from: Optional[Path] = None
    fingerprint: str = ""
    pulled_from: Optional[str] = None
    """The remote-cache entry the output was pulled from (status pulled)."""
    pushed_to: Optional[str] = None
    """The remote-cache entry this run pushed the output to."""
    gates: list[Gate] = field(default_factory=list)
    """The step's pass/fail criteria checked on its result (the quality gate)."""


@dataclass
class RunSummary:
    recipe: str
    outcomes: list[StepOutcome]
    failure: Optional[KilnError] = None
    seconds: float = 0.0
    swept: list[Path] = field(default_factory=list)
    """Temporary outputs a killed build had left, removed at the start of this run."""
    cache: Optional[str] = None
    """The remote cache used (its address), if any."""
    cache_warnings: list[str] = field(default_factory=list)


def gpu_component(loaded: LoadedRecipe) -> str:
    """The GPU a GPU-dependent step's output is made for: the recipe's ``hardware.gpu`` when declared (required
    where the step runs on another machine), else the GPU detected here (its name as the driver reports it
    when the GPU table does not know it), else "none"."""
    from kiln.recipe.gpus import detected_gpu_names, lookup_gpu

    named = loaded.recipe.hardware.gpu
    if named:
        gpu = lookup_gpu(named)
        return f"{gpu.name} (sm_{gpu.sm})" if gpu else named
    detected = detected_gpu_names()
    if not detected:
        return "none"
    gpu = lookup_gpu(detected[0])
    return f"{gpu.name} (sm_{gpu.sm})" if gpu else detected[0]


def _components(spec: StepSpec, loaded: LoadedRecipe, upstream: dict[str, str], gpu: Optional[str],
                build_root: Path) -> dict:
    comps: dict[str, Any] = {
        "recipe": select(flatten(loaded.recipe), spec.keys, spec.ignore),
        "upstream": {name: upstream[name] for name in spec.after if name in upstream},
        "tools": tool_versions(spec.tools),
    }
    if spec.input_hashes is not None:
        comps["inputs"] = spec.input_hashes(loaded)
    if gpu is not None:
        comps["gpu"] = gpu
    runtime = spec.runtime(loaded, build_root) if spec.runtime is not None else None
    if runtime is not None:
        comps["runtime"] = runtime
    return comps


def _stored(spec: StepSpec, out_dir: Path, loaded: LoadedRecipe) -> tuple[Optional[dict], Optional[StepResult]]:
    """The complete output's manifest and its result (both None when there is no complete, valid output)."""
    manifest = read_manifest(out_dir, spec.required_files(loaded.recipe))
    if manifest is None:
        return None, None
    result = spec.load_result(manifest.get("result"))
    return (manifest, result) if result is not None else (None, None)


def schedule(loaded: LoadedRecipe, layout: Layout, force: bool = False, from_step: Optional[str] = None,
             to_step: Optional[str] = None) -> list[ScheduledStep]:
    """Decide, for every step, whether it runs and why. Cheap: no heavy imports, no model loading."""
    for label, value in (("--from", from_step), ("--to", to_step)):
        if value is not None and value not in STEP_ORDER:
            raise InputError(f"{label} {value!r} is not a step; steps: {', '.join(STEP_ORDER)}")
    first = STEP_ORDER.index(from_step) if from_step else 0
    last = STEP_ORDER.index(to_step) if to_step else len(STEP_ORDER) - 1
    if first > last:
        raise InputError(f"--from {from_step} comes after --to {to_step}")
    specs = load_steps()
    gpu: Optional[str] = None
    scheduled: list[ScheduledStep] = []
    fingerprints: dict[str, str] = {}
    for index, name in enumerate(STEP_ORDER):
        if name not in specs:  # a registry given in its place (tests' stand-in steps) may hold fewer steps
            continue
        spec = specs[name]
        out_dir = layout.step_dir(spec, loaded)
        step_gpu = None
        if spec.gpu_dependent is not None and spec.gpu_dependent(loaded.recipe):
            gpu = gpu if gpu is not None else gpu_component(loaded)
            step_gpu = gpu
        comps = _components(spec, loaded, fingerprints, step_gpu, layout.build_root)
        derived = spec.derived(loaded) if spec.derived is not None else None
        if derived is not None:
            comps["baseline"] = _derived_fingerprint(derived, layout)
        fp = digest(comps)
        fingerprints[name] = fp
        manifest, stored = _stored(spec, out_dir, loaded)
        reasons: list[str] = []
        if manifest is None:
            reasons.append("no complete output")
        elif manifest.get("fingerprint") != fp:
            reasons.extend(diff(manifest.get("components", {}), comps) or ["fingerprint changed"])
        if index < first or index > last:
            action = Action.OUTSIDE
        elif force or (from_step is not None and index >= first):
            action = Action.RUN
            reasons.insert(0, "--force" if force else f"--from {from_step}")
        else:
            action = Action.RUN if reasons else Action.SKIP
        scheduled.append(ScheduledStep(spec, out_dir, comps, fp, action, reasons, manifest, stored))
    # Steps before --from are used as they are: they must be complete and current.
    needed = {q for s in scheduled[first:last + 1] for q in s.spec.after}
    for p in scheduled[:first]:
        if p.action == Action.OUTSIDE and p.reasons and p.spec.name in needed:
            raise InputError(f"--from {from_step}: upstream step {p.spec.name} is "
                             f"{'missing' if p.manifest is None else 'out of date'} ({'; '.join(p.reasons)}); "
                             f"run without --from, or --from {p.spec.name}")
    return scheduled


#: A step's derived recipe (the task gate's unquantized baseline) is built up to this step.
DERIVED_TO = "package"


def derived_layout(layout: Layout) -> Layout:
    """Where derived recipes go: their steps in build/<name>/ like any recipe (so they share outputs by fingerprint),
    their repositories under build/.baselines/ rather than beside the user's in triton_repo/."""
    return Layout(layout.build_root, layout.build_root / ".baselines")


def _derived_fingerprint(derived: LoadedRecipe, layout: Layout) -> str:
    sub = schedule(derived, derived_layout(layout), to_step=DERIVED_TO)
    return next(p.fingerprint for p in sub if p.spec.name == DERIVED_TO)


def _build_derived(p: ScheduledStep, loaded: LoadedRecipe, layout: Layout, console: Console, progress: bool,
                   remote: Optional["RemoteCache"]) -> dict[str, Path]:
    """Build the step's derived recipe up to DERIVED_TO (a no-op when it is up to date); its output directory."""
    derived = p.spec.derived(loaded) if p.spec.derived is not None else None
    if derived is None:
        return {}
    console.print(f"[dim]  the baseline {derived.recipe.name}, up to {DERIVED_TO}:[/]", highlight=False)
    sub = run(derived, derived_layout(layout), to_step=DERIVED_TO, console=console, progress=progress, remote=remote)
    if sub.failure is not None:
        raise KilnError(f"the baseline {derived.recipe.name} did not build: {sub.failure}")
    return {"baseline": derived_layout(layout).step_dir(load_steps()[DERIVED_TO], derived)}


def describe_schedule(scheduled: list[ScheduledStep], loaded: LoadedRecipe, console: Console,
                      build_root: Path = Path("build")) -> None:
    """--dry-run: each step, run or skip and why, plus the step's own lines (e.g. the trtllm-build command)."""
    console.print(f"[bold]schedule for {loaded.recipe.name}[/] (target {loaded.recipe.target})")
    for p in scheduled:
        mark = {Action.RUN: "[yellow]run [/]", Action.SKIP: "[green]skip[/]", Action.OUTSIDE: "[dim]--  [/]"}[p.action]
        why = "up to date" if p.action == Action.SKIP else "; ".join(p.reasons) if p.reasons else "outside --from/--to"
        if p.action == Action.OUTSIDE and not p.reasons:
            why = "outside --from/--to (up to date)"
        console.print(f"  {mark} {p.spec.name:<9} {p.out_dir}  [dim]{why}[/]", highlight=False)
        if p.spec.describe is not None:
            for line in p.spec.describe(loaded, build_root):
                console.print(f"         {line}", markup=False, highlight=False)


def _manifest(p: ScheduledStep, loaded: LoadedRecipe, result: StepResult, started: float, seconds: float,
              reused_from: Optional[Path]) -> dict:
    return {
        "step": p.spec.name,
        "recipe": loaded.recipe.name,
        "fingerprint": p.fingerprint,
        "components": p.components,
        "resolved_recipe": recipe_yaml(loaded.recipe),
        "recipe_file": str(loaded.path) if loaded.path else None,
        "overrides": list(loaded.overrides),
        "result": result.model_dump(mode="json"),
        "reused_from": str(reused_from) if reused_from else None,
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(),
        "seconds": round(seconds, 3),
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
                 "pid": os.getpid()},
    }


def find_reusable(p: ScheduledStep, layout: Layout, loaded: LoadedRecipe) -> Optional[Path]:
    """A complete output of the same step with the same fingerprint under another recipe's build dir.

    Fingerprints leave out the recipe name, so recipes (or sweep points) that differ only in keys a step does
    not depend on share its output — e.g. points differing only in serving keys share the quantized checkpoint.
    """
    if p.spec.output_dir is not None or not layout.build_root.is_dir():
        return None
    for other in sorted(layout.build_root.iterdir()):
        candidate = other / p.spec.name
        if candidate == p.out_dir or not candidate.is_dir():
            continue
        manifest, stored = _stored(p.spec, candidate, loaded)
        if manifest is not None and manifest.get("fingerprint") == p.fingerprint:
            return candidate
    return None


def _lock(build_dir: Path, console: Console) -> FileLock:
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(build_dir / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        console.print(f"another kiln build of {build_dir.name} is running; waiting for it to finish…")
        lock.acquire()
        console.print("it finished; reusing what it built where it is up to date")
    return lock


def sweep_recipe_leftovers(loaded: LoadedRecipe, layout: Layout) -> list[Path]:
    """Remove every temporary output a killed build of this recipe left, whether or not its step runs again
    (a 70B checkpoint's leftovers can be a hundred GB). Call while holding the recipe's build lock: every
    writer of these outputs holds it, so none is being written."""
    name = loaded.recipe.name
    found = leftovers(layout.build_dir(name), [spec.name for spec in load_steps().values()])
    for spec in load_steps().values():
        if spec.output_dir is not None:
            final = layout.step_dir(spec, loaded)
            found += leftovers(final.parent, [final.name])
            found += leftovers(final.parent.parent / "deploy", [final.name])  # the package step's deploy files
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def run(loaded: LoadedRecipe, layout: Layout, force: bool = False, from_step: Optional[str] = None,
        to_step: Optional[str] = None, console: Optional[Console] = None, progress: bool = True,
        remote: Optional["RemoteCache"] = None) -> RunSummary:
    """Run the pipeline. Never raises for a step failure: the summary carries it (CLI maps it to an exit code).

    With ``remote``, a shared step that would run is first looked up there by fingerprint and pulled on a hit;
    a shared step's complete output the registry lacks is pushed (see :mod:`kiln.pipeline.remote`)."""
    console = console or Console(stderr=True)
    t_start = time.monotonic()
    first = schedule(loaded, layout, force, from_step, to_step)  # argument errors before waiting on a lock
    problems = preflight.check(loaded, [p.spec.name for p in first if p.action == Action.RUN], layout.build_root)
    if problems:  # before any work, and before waiting on another build: all at once
        return RunSummary(loaded.recipe.name, [StepOutcome(p.spec.name, Status.NOT_RUN, out_dir=p.out_dir)
                                               for p in first], preflight.PreflightError(problems),
                          time.monotonic() - t_start)
    lock = _lock(layout.build_dir(loaded.recipe.name), console)
    outcomes: list[StepOutcome] = []
    failure: Optional[KilnError] = None
    try:
        swept = sweep_recipe_leftovers(loaded, layout)
        if swept:
            console.print(f"[dim]removed {len(swept)} temporary output(s) left by an interrupted build: "
                          + ", ".join(p.name for p in swept) + "[/]", highlight=False)
        scheduled = schedule(loaded, layout, force, from_step, to_step)  # again: another build may have finished
        inputs: dict[str, Path] = {}
        results: dict[str, StepResult] = {}
        for p in scheduled:
            name = p.spec.name
            if failure is not None:
                outcomes.append(StepOutcome(name, Status.NOT_RUN, out_dir=p.out_dir))
                continue
            if p.action in (Action.SKIP, Action.OUTSIDE):
                if p.stored is not None:
                    inputs[name], results[name] = p.out_dir, p.stored
                if p.action == Action.SKIP:
                    outcomes.append(StepOutcome(name, Status.SKIPPED, 0.0, p.out_dir, p.stored, "up to date",
                                                fingerprint=p.fingerprint, gates=_gates(p, loaded, p.stored)))
                    finished = _finish(p, loaded, remote, outcomes[-1])
                    pushed = None
                    if remote is not None and p.manifest is not None and not p.manifest.get("pulled"):
                        pushed = _push(remote, p, outcomes[-1], built_here=False)
                    failure = finished or _check(p, loaded, p.stored) or pushed
                else:
                    outcomes.append(StepOutcome(name, Status.NOT_RUN, out_dir=p.out_dir, message="outside --from/--to"))
                continue
            reuse = None if force else find_reusable(p, layout, loaded)
            console.print(f"[bold]▶ {name}[/] [dim]({'; '.join(p.reasons)})"
                          + (f" — reusing {reuse}" if reuse else "") + "[/]", highlight=False)
            started, t0 = time.time(), time.monotonic()
            pulled = None
            try:
                with atomic_dir(p.out_dir) as tmp:
                    if reuse is not None:
                        link_tree(reuse, tmp, skip=("manifest.json",))
                        result = _stored(p.spec, reuse, loaded)[1]
                    elif remote is not None and (pulled := remote.pull(p, tmp, loaded)) is not None:
                        result = pulled.result
                    else:
                        ctx = StepContext(loaded, tmp, dict(inputs), dict(results), console, progress, p.out_dir,
                                          p.fingerprint, layout.build_root,
                                          _build_derived(p, loaded, layout, console, progress, remote))
                        result = p.spec.fn(ctx)
                    if not isinstance(result, p.spec.result):
                        raise TypeError(f"step {name} returned {type(result).__name__}, "
                                        f"its contract says {p.spec.result.__name__}")
                    missing = [f for f in p.spec.required_files(loaded.recipe) if not (tmp / f).is_file()]
                    if missing:
                        raise KilnError(f"step {name} did not write {', '.join(missing)}: its output is incomplete "
                                        "and was not kept")
                    manifest = _manifest(p, loaded, result, started, time.monotonic() - t0, reuse)
                    if pulled is not None:
                        manifest["pulled"] = pulled.info
                    write_manifest(tmp, manifest)
            except KilnError as exc:
                outcomes.append(StepOutcome(name, Status.FAILED, time.monotonic() - t0, None, None, str(exc),
                                            fingerprint=p.fingerprint))
                failure = exc
                continue
            seconds = time.monotonic() - t0
            inputs[name], results[name] = p.out_dir, result
            status = Status.PULLED if pulled else Status.REUSED if reuse else Status.RAN
            outcomes.append(StepOutcome(name, status, seconds, p.out_dir, result, reused_from=reuse,
                                        fingerprint=p.fingerprint, pulled_from=pulled.info["from"] if pulled else None,
                                        gates=_gates(p, loaded, result)))
            finished = _finish(p, loaded, remote, outcomes[-1])
            pushed = _push(remote, p, outcomes[-1], built_here=reuse is None) if remote and not pulled else None
            failure = finished or _check(p, loaded, result)
            if failure is not None:
                outcomes[-1].message = str(failure)
            failure = failure or pushed
    finally:
        lock.release()
    return RunSummary(loaded.recipe.name, outcomes, failure, time.monotonic() - t_start, swept,
                      cache=str(remote.ref) if remote is not None else None,
                      cache_warnings=list(remote.warnings) if remote is not None else [])


def _push(remote: "RemoteCache", p: ScheduledStep, outcome: StepOutcome, built_here: bool) -> Optional[KilnError]:
    """The remote-cache hook after a step's output is complete: push it if it is shared and the registry lacks
    it. A KilnError only under --cache-required (otherwise a failure is a warning)."""
    manifest = read_manifest(p.out_dir)
    if manifest is None:
        return None
    try:
        outcome.pushed_to = remote.push(p, p.out_dir, manifest, built_here)
    except KilnError as exc:
        outcome.message = str(exc)
        return exc
    return None


def _finish(p: ScheduledStep, loaded: LoadedRecipe, remote: Optional["RemoteCache"],
            outcome: StepOutcome) -> Optional[KilnError]:
    """The step's ``finish`` hook on its complete output, given the remote-cache entry that holds it."""
    if p.spec.finish is None:
        return None
    try:
        p.spec.finish(loaded, p.out_dir, remote.entry_source(p, p.out_dir) if remote is not None else None)
    except KilnError as exc:
        outcome.status, outcome.message = Status.FAILED, str(exc)
        return exc
    return None


def _gates(p: ScheduledStep, loaded: LoadedRecipe, result: Optional[StepResult]) -> list[Gate]:
    return p.spec.gates(loaded.recipe, result) if p.spec.gates is not None and result is not None else []


def _check(p: ScheduledStep, loaded: LoadedRecipe, result: Optional[StepResult]) -> Optional[KilnError]:
    if p.spec.check is None or result is None:
        return None
    message = p.spec.check(loaded.recipe, result)
    return KilnError(message) if message else None


def render_summary(summary: RunSummary, console: Console) -> None:
    """The one-screen summary: steps run/skipped, times, artifacts, and each step's headline figures."""
    table = Table(title=f"kiln build {summary.recipe}", title_justify="left", box=None, pad_edge=False)
    for col in ("step", "status", "time", "output", "notes"):
        table.add_column(col, overflow="fold")
    colours = {Status.RAN: "green", Status.REUSED: "cyan", Status.PULLED: "cyan", Status.SKIPPED: "cyan",
               Status.FAILED: "red", Status.NOT_RUN: "dim"}
    for o in summary.outcomes:
        notes = o.message or (o.result.headline() if o.result is not None else "")
        table.add_row(o.name, f"[{colours.get(o.status, 'white')}]{o.status}[/]",
                      f"{o.seconds:.1f}s" if o.status in (Status.RAN, Status.REUSED, Status.PULLED) else "",
                      str(o.out_dir or ""),
                      notes)
    console.print(table)
    console.print(f"total {summary.seconds:.1f}s", style="dim")
