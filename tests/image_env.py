"""The NGC image's own Python environment, on this CPU machine: a test fixture (marker ``image_env``).

The GPU jobs run kiln's workers (src/kiln/runtime/workers/) inside the engine runtime image, with the Python packages
*that image* ships — ModelOpt 0.37, transformers 4.57.3, datasets 3.1.0 for TensorRT-LLM 1.2.1 — not kiln's own
(ModelOpt 0.47, transformers 5). This module builds a venv with exactly the packages the container table's row for
the pinned image lists (``python_packages`` in src/kiln/recipe/data/trtllm_containers.json, with their source), plus
CPU torch, so the image-environment tests run the workers under the image's libraries:

* torch is ``$KILN_IMAGE_ENV_TORCH`` (the Makefile passes its ``TORCH_SPEC``, ``torch==2.13.0``): the CPU build, the
  only one these machines have. The image carries NVIDIA's own CUDA build (2.10.0a0); this is the one difference in
  the venv, and it is said wherever the versions are printed.
* ``nvidia-modelopt`` is installed WITHOUT its ``[hf]`` extra (that extra caps transformers below 4.57 and pulls
  deepspeed): TensorRT-LLM 1.2.1 asks for ``nvidia-modelopt[torch]~=0.37.0``.

The venv is cached under kiln's cache (``$KILN_CACHE_DIR``, else ``~/.cache/kiln``) in
``image-env/<hash of the requirements and the Python version>``, so a change to the row's packages builds a new one.
It is built outside pytest's timed run::

    make image-env            # what `make test` runs first; a no-op when up to date
    .venv/bin/python -m tests.image_env [--print]

Tests that need it skip with that command as the reason when it is absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from kiln.models.tiny import cache_root
from kiln.recipe.containers import ContainerRow, container_for, row_for

#: The TensorRT-LLM release kiln pins for target tensorrt (its newest image is the engine runtime's default).
TRTLLM = "1.2.1"
#: The marker file a complete venv carries: the versions pip installed (written last).
DONE = "kiln-image-env.json"
BUILD_COMMAND = "make image-env"


def image_row() -> ContainerRow:
    row = row_for(container_for(TRTLLM))
    assert row is not None and row.python_packages, f"the container table lists no Python packages for {TRTLLM}"
    return row


def torch_spec() -> str:
    return os.environ.get("KILN_IMAGE_ENV_TORCH", "torch==2.13.0")


def requirement(name: str, spec: str) -> str:
    """``name==1.2.3`` for an exact version, ``name>=1.7`` where the source gives a range."""
    return f"{name}=={spec}" if spec[:1].isdigit() else f"{name}{spec}"


#: Constraints for the resolver that are not the image's facts but follow from them: pyarrow 26 (which datasets
#: 3.1.0 would pull) requires numpy 2, and TensorRT-LLM 1.2.1 pins numpy<2, so the image's pyarrow is an older one.
RESOLVER_CONSTRAINTS = ("pyarrow<26",)


def requirements(row: Optional[ContainerRow] = None) -> list[str]:
    row = row or image_row()
    return ([torch_spec()] + [requirement(n, v) for n, v in sorted(row.python_packages.items())]
            + list(RESOLVER_CONSTRAINTS))


def env_dir() -> Path:
    material = json.dumps({"requirements": requirements(), "python": list(sys.version_info[:2])})
    return cache_root() / "image-env" / hashlib.sha256(material.encode()).hexdigest()[:16]


def python() -> Optional[Path]:
    """The image environment's interpreter, or None when it is not built."""
    root = env_dir()
    return root / "bin" / "python" if (root / DONE).is_file() else None


def versions() -> dict[str, str]:
    """What the built venv holds (the packages the row names, and torch)."""
    root = env_dir()
    return json.loads((root / DONE).read_text())["versions"] if (root / DONE).is_file() else {}


def missing_reason() -> str:
    return (f"the image's Python environment (TensorRT-LLM {TRTLLM}'s packages: "
            f"{', '.join(requirements()[1:])}) is not built at {env_dir()}: run `{BUILD_COMMAND}`")


def header() -> str:
    """One line for pytest's header."""
    found = versions()
    if not found:
        return f"image env: not built ({BUILD_COMMAND}); image_env tests will skip"
    pkgs = ", ".join(f"{k} {v}" for k, v in found.items())
    return (f"image env ({image_row().image}, TensorRT-LLM {TRTLLM}): {pkgs} (torch is the CPU build; the image has "
            f"NVIDIA's CUDA build) at {env_dir()}")


def build(quiet: bool = False) -> Path:
    """Build the venv unless it is up to date; returns its directory."""
    root = env_dir()
    if (root / DONE).is_file():
        if not quiet:
            print(f"image env up to date: {root}")
        return root
    if root.exists():
        shutil.rmtree(root)  # an interrupted build
    started = time.monotonic()
    root.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the image's Python environment at {root}: {' '.join(requirements())}", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # torch first, alone, so nothing pulls another build of it; then the image's packages
        subprocess.run(pip + [torch_spec()], check=True)
        subprocess.run(pip + requirements()[1:], check=True)
    except (subprocess.CalledProcessError, OSError):
        shutil.rmtree(root, ignore_errors=True)
        raise
    names = ["torch"] + sorted(image_row().python_packages)
    script = ("import json, sys\nfrom importlib.metadata import version\n"
              "print(json.dumps({n: version(n) for n in sys.argv[1:]}))")
    found = json.loads(subprocess.run([str(root / "bin" / "python"), "-c", script, *names], check=True,
                                      capture_output=True, text=True).stdout)
    for name, spec in image_row().python_packages.items():
        if spec[:1].isdigit() and found[name] != spec:
            shutil.rmtree(root, ignore_errors=True)
            raise SystemExit(f"image env: {name} is {found[name]}, the container table says {spec}")
    (root / DONE).write_text(json.dumps({"requirements": requirements(), "versions": found,
                                         "seconds": round(time.monotonic() - started, 1)}, indent=2))
    print(f"image env built in {time.monotonic() - started:.0f} s: {found}")
    return root


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        print(python() or missing_reason())
    else:
        build()
