"""Where kiln keeps what it caches on this machine."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """kiln's cache directory: ``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``."""
    explicit = os.environ.get("KILN_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "kiln"
