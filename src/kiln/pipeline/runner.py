"""The runner: schedule which steps to run (and why), run them under a lock into atomic outputs, summarise.

`build/<recipe>/<step>/manifest.json` records each step's fingerprint components, the resolved recipe,
timings and the host; a step is skipped only when its fingerprint matches a complete output.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock, Timeout
from rich.console import Console
from rich.table import Table

from kiln.pipeline.fingerprint import diff, digest, flatten, select, tool_versions
from kiln.pipeline.registry import STEP_ORDER, load_steps
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.render import recipe_yaml
from kiln.steps.base import StepContext, StepSpec
from kiln.util.artifacts import atomic_dir, link_tree, read_manifest, sweep_leftovers, write_manifest
from kiln.util.errors import InputError, KilnError


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
    action: str  # run | skip | pending (module not built yet) | outside (outside --from/--to)
    reasons: list[str] = field(default_factory=list)
    manifest: Optional[dict] = None


@dataclass
class StepOutcome:
    name: str
    status: str  # ran | reused | skipped | failed | not built | not run
    seconds: float = 0.0
    out_dir: Optional[Path] = None
    result: dict = field(default_factory=dict)
    message: str = ""


@dataclass
class RunSummary:
    recipe: str
    outcomes: list[StepOutcome]
    failure: Optional[KilnError] = None
    seconds: float = 0.0


def _components(spec: StepSpec, loaded: LoadedRecipe, upstream: dict[str, str], gpu_arch: Optional[str]) -> dict:
    comps: dict[str, Any] = {
        "recipe": select(flatten(loaded.recipe), spec.keys, spec.ignore),
        "upstream": {name: upstream[name] for name in spec.after if name in upstream},
        "tools": tool_versions(spec.tools),
    }
    if spec.input_hashes is not None:
        comps["inputs"] = spec.input_hashes(loaded)
    if spec.gpu_arch:
        comps["gpu_arch"] = gpu_arch or "none"
    return comps


def _gpu_arch(loaded: LoadedRecipe) -> Optional[str]:
    from kiln.recipe.gpus import lookup_gpu

    gpu = lookup_gpu(loaded.recipe.hardware.gpu) if loaded.recipe.hardware.gpu else None
    return f"sm_{gpu.sm}" if gpu else None


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
    arch = _gpu_arch(loaded)
    scheduled: list[ScheduledStep] = []
    fingerprints: dict[str, str] = {}
    rerun: set[str] = set()
    for index, name in enumerate(STEP_ORDER):
        spec = specs.get(name)
        if spec is None:
            scheduled.append(ScheduledStep(StepSpec(name, lambda ctx: {}, ()), Path("-"), {}, "", "pending",
                                       ["not built yet"]))
            continue
        out_dir = layout.step_dir(spec, loaded)
        comps = _components(spec, loaded, fingerprints, arch)
        fp = digest(comps)
        fingerprints[name] = fp
        manifest = read_manifest(out_dir)
        reasons: list[str] = []
        if manifest is None:
            reasons.append("no complete output")
        elif manifest.get("fingerprint") != fp:
            reasons.extend(diff(manifest.get("components", {}), comps) or ["fingerprint changed"])
        if index < first or index > last:
            action = "outside"
        elif force or (from_step is not None and index >= first):
            action = "run"
            reasons.insert(0, "--force" if force else f"--from {from_step}")
        else:
            action = "run" if reasons else "skip"
        if action == "run":
            rerun.add(name)
        scheduled.append(ScheduledStep(spec, out_dir, comps, fp, action, reasons, manifest))
    # Steps before --from are used as they are: they must be complete and current.
    for p in scheduled[:first]:
        if p.action == "outside" and p.reasons and p.spec.name in {q for s in scheduled[first:last + 1]
                                                                    for q in s.spec.after}:
            raise InputError(f"--from {from_step}: upstream step {p.spec.name} is "
                             f"{'missing' if p.manifest is None else 'out of date'} ({'; '.join(p.reasons)}); "
                             f"run without --from, or --from {p.spec.name}")
    return scheduled


def describe_schedule(scheduled: list[ScheduledStep], loaded: LoadedRecipe, console: Console) -> None:
    """--dry-run: each step, run or skip and why, plus the step's own lines (e.g. the trtllm-build command)."""
    console.print(f"[bold]schedule for {loaded.recipe.name}[/] (target {loaded.recipe.target})")
    for p in scheduled:
        mark = {"run": "[yellow]run [/]", "skip": "[green]skip[/]", "pending": "[dim]n/a [/]",
                "outside": "[dim]--  [/]"}[p.action]
        why = "up to date" if p.action == "skip" else "; ".join(p.reasons) if p.reasons else "outside --from/--to"
        if p.action == "outside" and not p.reasons:
            why = "outside --from/--to (up to date)"
        console.print(f"  {mark} {p.spec.name:<9} {p.out_dir}  [dim]{why}[/]", highlight=False)
        if p.spec.describe is not None and p.action != "pending":
            for line in p.spec.describe(loaded):
                console.print(f"         {line}", markup=False, highlight=False)


def _manifest(p: ScheduledStep, loaded: LoadedRecipe, result: dict, started: float, seconds: float) -> dict:
    return {
        "step": p.spec.name,
        "recipe": loaded.recipe.name,
        "fingerprint": p.fingerprint,
        "components": p.components,
        "resolved_recipe": recipe_yaml(loaded.recipe),
        "recipe_file": str(loaded.path) if loaded.path else None,
        "overrides": list(loaded.overrides),
        "result": result,
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(),
        "seconds": round(seconds, 3),
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
                 "pid": os.getpid()},
    }


def find_reusable(p: ScheduledStep, layout: Layout) -> Optional[Path]:
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
        manifest = read_manifest(candidate)
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


def run(loaded: LoadedRecipe, layout: Layout, force: bool = False, from_step: Optional[str] = None,
        to_step: Optional[str] = None, console: Optional[Console] = None, progress: bool = True) -> RunSummary:
    """Run the pipeline. Never raises for a step failure: the summary carries it (CLI maps it to an exit code)."""
    console = console or Console(stderr=True)
    t_start = time.monotonic()
    schedule(loaded, layout, force, from_step, to_step)  # argument errors before waiting on a lock
    lock = _lock(layout.build_dir(loaded.recipe.name), console)
    outcomes: list[StepOutcome] = []
    failure: Optional[KilnError] = None
    try:
        scheduled = schedule(loaded, layout, force, from_step, to_step)  # again: another build may have finished
        inputs: dict[str, Path] = {}
        results: dict[str, dict] = {}
        for p in scheduled:
            name = p.spec.name
            if failure is not None:
                outcomes.append(StepOutcome(name, "not run", out_dir=p.out_dir))
                continue
            if p.action == "pending":
                outcomes.append(StepOutcome(name, "not built", message="this step is not built yet"))
                continue
            if p.action in ("skip", "outside"):
                if p.manifest is not None:
                    inputs[name], results[name] = p.out_dir, p.manifest.get("result", {})
                if p.action == "skip":
                    outcomes.append(StepOutcome(name, "skipped", 0.0, p.out_dir, results[name], "up to date"))
                    failure = _check(p, loaded, results[name])
                else:
                    outcomes.append(StepOutcome(name, "not run", out_dir=p.out_dir, message="outside --from/--to"))
                continue
            sweep_leftovers(p.out_dir)
            reuse = None if force else find_reusable(p, layout)
            console.print(f"[bold]▶ {name}[/] [dim]({'; '.join(p.reasons)})"
                          + (f" — reusing {reuse}" if reuse else "") + "[/]", highlight=False)
            started, t0 = time.time(), time.monotonic()
            try:
                with atomic_dir(p.out_dir) as tmp:
                    if reuse is not None:
                        link_tree(reuse, tmp, skip=("manifest.json",))
                        result = {**(read_manifest(reuse) or {}).get("result", {}), "reused_from": str(reuse)}
                    else:
                        ctx = StepContext(loaded, tmp, dict(inputs), dict(results), console, progress, p.out_dir,
                                          p.fingerprint)
                        result = p.spec.fn(ctx) or {}
                    write_manifest(tmp, _manifest(p, loaded, result, started, time.monotonic() - t0))
            except KilnError as exc:
                outcomes.append(StepOutcome(name, "failed", time.monotonic() - t0, None, {}, str(exc)))
                failure = exc
                continue
            seconds = time.monotonic() - t0
            inputs[name], results[name] = p.out_dir, result
            outcomes.append(StepOutcome(name, "reused" if reuse else "ran", seconds, p.out_dir, result))
            failure = _check(p, loaded, result)
            if failure is not None:
                outcomes[-1].message = str(failure)
    finally:
        lock.release()
    return RunSummary(loaded.recipe.name, outcomes, failure, time.monotonic() - t_start)


def _check(p: ScheduledStep, loaded: LoadedRecipe, result: dict) -> Optional[KilnError]:
    if p.spec.check is None:
        return None
    message = p.spec.check(loaded.recipe, result)
    return KilnError(message) if message else None


def render_summary(summary: RunSummary, console: Console) -> None:
    """The one-screen summary: steps run/skipped, times, artifacts, and each step's headline figures."""
    table = Table(title=f"kiln build {summary.recipe}", title_justify="left", box=None, pad_edge=False)
    for col in ("step", "status", "time", "output", "notes"):
        table.add_column(col, overflow="fold")
    colours = {"ran": "green", "reused": "cyan", "skipped": "cyan", "failed": "red", "not built": "yellow", "not run": "dim"}
    for o in summary.outcomes:
        notes = o.message or _headline(o.result)
        table.add_row(o.name, f"[{colours.get(o.status, 'white')}]{o.status}[/]",
                      f"{o.seconds:.1f}s" if o.status in ("ran", "reused") else "", str(o.out_dir or ""), notes)
    console.print(table)
    console.print(f"total {summary.seconds:.1f}s", style="dim")


def _headline(result: dict) -> str:
    headline = result.get("summary")
    if isinstance(headline, str):
        return headline
    keys = [k for k, v in result.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)][:4]
    return ", ".join(f"{k}={_fmt(result[k])}" for k in keys)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_json(summary: RunSummary) -> str:
    return json.dumps({"recipe": summary.recipe, "seconds": summary.seconds,
                       "failure": str(summary.failure) if summary.failure else None,
                       "steps": [{"name": o.name, "status": o.status, "seconds": o.seconds,
                                  "output": str(o.out_dir) if o.out_dir else None, "result": o.result,
                                  "message": o.message} for o in summary.outcomes]}, indent=2, default=str)
