"""Values addressed by dotted key paths (``engine.speculative.mode``), in nested dicts or attribute trees."""

from __future__ import annotations

from typing import Any


def dotted_get(data: Any, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` in nested dicts, or ``default`` where a part is missing or not inside a dict."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return default
        data = data[part]
    return data


def dotted_attr(obj: Any, dotted: str) -> Any:
    """The attribute at ``dotted`` (``recipe.engine.max_batch_size``); AttributeError where a part is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
