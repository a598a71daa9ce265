"""Shared helpers for the benchmark scripts: build the default recipe into a scratch directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = ROOT / "configs" / "tiny-llama.yaml"


def kiln(*args: str, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Run the kiln CLI as a user would (a fresh process) and time it."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def build(cwd: Path, *sets: str) -> tuple[float, dict]:
    args = ["build", str(DEFAULT_RECIPE), "--json", "--quiet"]
    for s in sets:
        args += ["--set", s]
    seconds, proc = kiln(*args, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"kiln build failed:\n{proc.stderr[-3000:]}")
    return seconds, json.loads(proc.stdout)


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
