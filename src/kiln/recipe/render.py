"""Write a resolved recipe back as YAML, every default filled in, optionally each field's docstring above it."""

from __future__ import annotations

import textwrap

import yaml
from pydantic import BaseModel


def _scalar(value: object) -> str:
    if isinstance(value, tuple):
        value = [v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v for v in value]
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def _emit(model: BaseModel, indent: int, docs: bool, lines: list[str], skip: tuple[str, ...] = ()) -> None:
    pad = "  " * indent
    for name, info in type(model).model_fields.items():
        if name in skip:
            continue
        value = getattr(model, name)
        if docs and info.description:
            if lines and indent == 0:
                lines.append("")
            for doc_line in textwrap.wrap(" ".join(info.description.split()), 100 - len(pad)):
                lines.append(f"{pad}# {doc_line}")
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            _emit(value, indent + 1, docs, lines)
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")


def recipe_yaml(recipe: BaseModel, docs: bool = False, skip: tuple[str, ...] = ()) -> str:
    """The full resolved recipe as YAML (loads back to an equal recipe). `skip`: top-level keys to leave out."""
    lines: list[str] = []
    _emit(recipe, 0, docs, lines, skip)
    return "\n".join(lines) + "\n"
