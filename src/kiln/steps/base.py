"""What every pipeline step declares and receives.

A step is a plain function ``fn(ctx: StepContext) -> dict``. It writes its outputs under ``ctx.out_dir`` (a
temporary directory the pipeline renames into place only when the step returns) and returns a small
JSON-able result that goes into the step's manifest (and the end-of-run summary). It reads upstream
artifacts from ``ctx.inputs[step_name]`` (their final, complete directories) and never writes there.

The :class:`StepSpec` declares what the step's fingerprint covers: the recipe keys that change its output
(`keys`, dotted prefixes) minus those that do not (`ignore`), the upstream steps it consumes (`after`), the
packages whose versions matter (`tools`), and the content hashes of external input files (`input_hashes`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe

T = TypeVar("T")


@dataclass
class StepContext:
    """Everything a step function may use."""

    loaded: LoadedRecipe
    out_dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)
    console: Console = field(default_factory=lambda: Console(stderr=True))
    show_progress: bool = True
    final_dir: Optional[Path] = None
    """Where out_dir will be renamed to when the step completes."""
    fingerprint: str = ""
    """This run's fingerprint of the step (recorded in its manifest)."""

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

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
    def status(self, message: str) -> Iterator[None]:
        """A spinner for work without countable steps."""
        if not self.show_progress:
            yield
            return
        with self.console.status(f"  {message}"):
            yield


@dataclass(frozen=True)
class StepSpec:
    """A step's declaration: its function and everything its fingerprint covers."""

    name: str
    fn: Callable[[StepContext], dict]
    keys: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    input_hashes: Optional[Callable[[LoadedRecipe], dict[str, str]]] = None
    gpu_arch: bool = False
    describe: Optional[Callable[[LoadedRecipe], list[str]]] = None
    """Extra lines for --dry-run (e.g. the exact trtllm-build invocation)."""
    output_dir: Optional[Callable[[LoadedRecipe, Path], Path]] = None
    """Where the final output lives, given the recipe and the build dir (default: build/<recipe>/<step>)."""
    files_checked: tuple[str, ...] = ()
    """Files (relative paths) a complete output must contain, besides the manifest."""
    check: Optional[Callable[[Recipe, dict], Optional[str]]] = None
    """Re-checked on every run, also when the step is skipped (e.g. the quality gate on the stored result):
    returns a failure message or None. Fields it reads are left out of the fingerprint."""


def step_result(**values: Any) -> dict:
    """A step's result, JSON-able (Paths become strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}
