"""Problems found in a recipe: each names the file, the line, the dotted key and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from kiln.util.errors import InputError


@dataclass(frozen=True)
class Origin:
    """Where a recipe value came from: a file and line, or a `--set` override."""

    file: str
    line: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass(frozen=True)
class Problem:
    """One finding: an error (the recipe cannot be used) or a warning (it can, but probably not as meant)."""

    severity: Literal["error", "warning"]
    key: str
    message: str
    origin: Optional[Origin] = None
    hint: str = ""

    def format(self) -> str:
        where = f"{self.origin}: " if self.origin else ""
        key = f"{self.key}: " if self.key else ""
        hint = f"\n    fix: {self.hint}" if self.hint else ""
        return f"{where}{self.severity}: {key}{self.message}{hint}"


class RecipeError(InputError):
    """Bad input: one or more problems that stop the recipe from being used (CLI exit code 2)."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(p.format() for p in problems))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]
