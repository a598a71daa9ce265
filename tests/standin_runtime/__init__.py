"""A STAND-IN engine runtime for tests: a `docker` / `podman` / `apptainer` on PATH (container_runtime.py) that
records its argv and runs the command in a bubblewrap sandbox over a stand-in "image" (image/: a stand-in
tensorrt_llm package whose quantize_and_export follows TensorRT-LLM 1.2.1's on the CPU with the ModelOpt of the
image's python — kiln's own by default, the image environment's with ``install(python=…)`` — a stand-in trtllm-build,
and the package metadata of the TensorRT-LLM/TensorRT versions a test chooses), plus a stand-in nvidia-smi.

Nothing it produces is a GPU run or a TensorRT engine; tests that use it say so.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional

from tests.standins import nvidia_smi, serving_site

HERE = Path(__file__).resolve().parent
IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
DIGEST = "sha256:" + "ab" * 32
H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class Standin:
    bin: Path
    log: Path
    image_root: Path
    env: dict[str, str] = field(default_factory=dict)

    def calls(self, prog: Optional[str] = None) -> list[dict]:
        if not self.log.exists():
            return []
        rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [r for r in rows if prog is None or r["prog"] == prog]

    def runs(self) -> list[list[str]]:
        """The argv of every `run` / `exec` (the jobs, in order)."""
        return [r["argv"] for r in self.calls() if r["argv"][:1] in (["run"], ["exec"])]


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def install(root: Path, *, engines: tuple[str, ...] = ("docker",), images: Optional[dict[str, str]] = None,
            trtllm: str = "1.2.1", tensorrt: str = "10.14.1.48", gpus: tuple[str, ...] = (H100,),
            daemon_up: bool = True, engine_override: Optional[dict] = None,
            python: Optional[Path] = None) -> Standin:
    """Lay the stand-in out under ``root`` and return it with the environment a test sets (PATH first).

    ``python``: the "image"'s interpreter. By default it is kiln's own (this machine's ModelOpt and transformers,
    not the image's); the image-environment tests pass the venv with the image's packages (tests/image_env.py)."""
    bin_dir, image_root = root / "bin", root / "image"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for engine in engines:
        _script(bin_dir / engine, f'exec "{sys.executable}" "{HERE / "container_runtime.py"}" "$0" "$@"')
    nvidia_smi(bin_dir, list(gpus))
    site = serving_site(root, trtllm, tensorrt)
    shutil.copytree(HERE / "image" / "site", image_root / "site", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for info in site.iterdir():
        shutil.copytree(info, image_root / "site" / info.name, dirs_exist_ok=True)
    (image_root / "bin").mkdir(parents=True, exist_ok=True)
    _script(image_root / "bin" / "python3", f'exec "{python or sys.executable}" "$@"')
    flags = resources.files("kiln.steps") / "data" / "trtllm_build_flags.yaml"
    override = json.dumps(engine_override or {}).replace("'", "'\\''")
    # the container's environment is only what its command line sets: the stand-in's settings are baked in
    _script(image_root / "bin" / "trtllm-build",
            f"KILN_STANDIN_FLAGS_FILE='{flags}' KILN_STANDIN_ENGINE_OVERRIDE='{override}' "
            f'exec "{sys.executable}" "{HERE / "image" / "trtllm_build.py"}" "$@"')
    log = root / "runtime-calls.jsonl"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "KILN_STANDIN_LOG": str(log),
        "KILN_STANDIN_IMAGES": json.dumps({IMAGE: DIGEST} if images is None else images),
        "KILN_STANDIN_IMAGE_ROOT": str(image_root),
        "KILN_STANDIN_DAEMON": "up" if daemon_up else "down",
    }
    return Standin(bin_dir, log, image_root, env)
