"""Step fingerprints: a hash over exactly what changes a step's output, kept as readable components.

Components are stored in each manifest, so a re-run can say *which* field changed, not just that one did.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from typing import Any, Iterable

from pydantic import BaseModel

import kiln

# Recipe keys that never change any artifact (documentation, provenance).
NEVER_AFFECTS = ("name", "description", "extends")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A recipe (or any nested mapping) as {dotted.key: scalar-or-list}."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _covered(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def select(flat: dict[str, Any], keys: Iterable[str], ignore: Iterable[str] = ()) -> dict[str, Any]:
    """The recipe fields a step depends on: under `keys`, minus `ignore` and NEVER_AFFECTS."""
    keys, ignore = tuple(keys), tuple(ignore) + NEVER_AFFECTS
    return {k: v for k, v in flat.items() if _covered(k, keys) and not _covered(k, ignore)}


def digest(components: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the components."""
    blob = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def tool_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of packages (no import): 'absent' when not installed."""
    out = {"kiln": kiln.__version__}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two component sets, e.g. 'recipe quantization.format: fp8 → int4_awq'."""
    changes: list[str] = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key, "<unset>") != b.get(key, "<unset>"):
                    changes.append(f"{section} {key}: {_short(a.get(key, '<unset>'))} → {_short(b.get(key, '<unset>'))}")
        else:
            changes.append(f"{section}: {_short(a)} → {_short(b)}")
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:18] + "…" + text[-18:]
