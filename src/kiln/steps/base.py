"""What every pipeline step declares and receives: its contract.

A step is a plain function ``fn(ctx: StepContext) -> R`` where ``R`` is the step's own result type (a frozen
pydantic model, a :class:`StepResult`). It writes its outputs under ``ctx.out_dir`` (a temporary directory the
pipeline renames into place only when the step returns) and returns its result, which goes into the step's
manifest (and the end-of-run summary). It reads upstream artifacts from ``ctx.inputs[step_name]`` (their final,
complete directories) and upstream results with ``ctx.result(ResultType)``; it never writes upstream.

The :class:`StepSpec` declares the contract: the result type; the files a complete output must hold
(:meth:`StepSpec.required_files`, enforced by ``read_manifest``); and what the step's fingerprint covers —
the recipe keys that change its output (`keys`, dotted prefixes) minus those that do not (`ignore`), the
upstream steps it consumes (`after`), the packages whose versions matter (`tools`), the content hashes of
external input files (`input_hashes`) and, for steps whose output depends on it, the GPU it runs on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe

T = TypeVar("T")


class StepResult(BaseModel):
    """Base of every step's result: a frozen, strict record (unknown fields are errors), stored as JSON in the
    step's manifest and validated again when a later run reuses the stored output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    summary: str = ""
    """One line for the end-of-run summary."""

    def headline(self) -> str:
        return self.summary


R = TypeVar("R", bound=StepResult)


@dataclass
class StepContext:
    """Everything a step function may use."""

    loaded: LoadedRecipe
    out_dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)
    results: dict[str, StepResult] = field(default_factory=dict)
    console: Console = field(default_factory=lambda: Console(stderr=True))
    show_progress: bool = True
    final_dir: Optional[Path] = None
    """Where out_dir will be renamed to when the step completes."""
    fingerprint: str = ""
    """This run's fingerprint of the step (recorded in its manifest)."""
    build_root: Path = Path("build")
    """The build root (``build/``): the engine runtime keeps its scratch directory under it."""
    derived: dict[str, Path] = field(default_factory=dict)
    """The step's derived recipe's output (``{"baseline": <its package output>}``), built by the runner first."""

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

    def result(self, kind: type[R]) -> R:
        """The result of the upstream step whose result type is ``kind``; KeyError when that step is not an
        input of this one (a contract error: declare it in ``after``)."""
        for value in self.results.values():
            if isinstance(value, kind):
                return value
        raise KeyError(f"no upstream result of type {kind.__name__}: declare its step in StepSpec.after")

    def log(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False)

    def track(self, items: Iterable[T], description: str, total: Optional[int] = None) -> Iterator[T]:
        """Iterate with a progress bar (stderr)."""
        if not self.show_progress:
            yield from items
            return
        with Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            for item in items:
                yield item
                progress.advance(task)

    @contextlib.contextmanager
    def status(self, message: str) -> Iterator[Callable[[str], None]]:
        """A spinner for work without countable steps; yields a function that replaces its text (e.g. with the
        elapsed time and the last line a long job printed)."""
        if not self.show_progress:
            yield lambda text: None
            return
        with self.console.status(f"  {message}") as spinner:
            yield lambda text: spinner.update(f"  {message}: {text}")


Files = Union[tuple[str, ...], Callable[[Recipe], tuple[str, ...]]]


@dataclass(frozen=True)
class Gate:
    """One pass/fail criterion a step's stored result is held to (e.g. the perplexity increase against
    ``evaluation.max_ppl_increase_pct``): what CI reports show as a test case."""

    name: str
    key: str
    """The recipe key that sets the threshold."""
    passed: Optional[bool]
    """None when the gate is off (no threshold) or there is no figure to check."""
    message: str
    """The figures: measured value and threshold, and on failure what to do."""


@dataclass(frozen=True)
class StepSpec(Generic[R]):
    """A step's declaration: its function, its result type, the files it must produce, and everything its
    fingerprint covers."""

    name: str
    fn: Callable[[StepContext], R]
    result: type[R]
    """The step's result type: what ``fn`` returns and what its manifest's ``result`` must validate as."""
    keys: tuple[str, ...]
    files: Files = ()
    """Files (relative paths) a complete output must hold, besides the manifest; a function of the recipe where
    they depend on it (e.g. the engine only for target tensorrt). ``read_manifest`` refuses an output whose
    manifest does not list them all."""
    ignore: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    input_hashes: Optional[Callable[[LoadedRecipe], dict[str, str]]] = None
    runtime: Optional[Callable[[LoadedRecipe, Path], Optional[dict[str, str]]]] = None
    """When given and not None for the recipe (and build root): the engine runtime the step runs in (its image
    and digest, or interpreter), which the fingerprint covers. Cheap: starts nothing."""
    gpu_dependent: Optional[Callable[[Recipe], bool]] = None
    """When given and true for the recipe, the fingerprint covers the GPU the step runs on (``hardware.gpu``
    when declared, else the GPU detected here)."""
    describe: Optional[Callable[[LoadedRecipe, Path], list[str]]] = None
    """Extra lines for --dry-run, given the recipe and the build root (e.g. the exact engine-runtime command)."""
    output_dir: Optional[Callable[[LoadedRecipe, Path], Path]] = None
    """Where the final output lives, given the recipe and the repository root (default: build/<recipe>/<step>)."""
    check: Optional[Callable[[Recipe, R], Optional[str]]] = None
    """Re-checked on every run, also when the step is skipped (e.g. the quality gate on the stored result):
    returns a failure message or None. Fields it reads are left out of the fingerprint."""
    gates: Optional[Callable[[Recipe, R], list[Gate]]] = None
    """The criteria behind ``check``, one by one with their figures (for reports: JUnit test cases, --json)."""
    finish: Optional[Callable[[LoadedRecipe, Path, Any], None]] = None
    """Called once the output is complete and in place (built, reused, pulled, or up to date), with the recipe, the
    output directory and the remote-cache entry that holds it (``kiln.pipeline.remote.EntrySource``, or None):
    writes what lives beside the output (the package step's deploy files). Raises KilnError to fail the step."""
    derived: Optional[Callable[[LoadedRecipe], Optional[LoadedRecipe]]] = None
    """When given and not None for the recipe: another recipe (the task gate's unquantized baseline) that the runner
    builds up to ``package`` before this step, whose package fingerprint is part of this step's, and whose package
    output the step gets as ``ctx.derived["baseline"]``."""

    def required_files(self, recipe: Recipe) -> tuple[str, ...]:
        return self.files(recipe) if callable(self.files) else self.files

    def load_result(self, stored: Any) -> Optional[R]:
        """A stored result validated as this step's result type; None when it does not validate (an output
        written by another version of the step, which is then re-run rather than trusted)."""
        from pydantic import ValidationError

        try:
            return self.result.model_validate(stored)
        except ValidationError:
            return None
