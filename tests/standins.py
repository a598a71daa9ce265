"""Stand-ins for what these machines do not have (named as stand-ins wherever a test uses them; none of them is
ever presented as a GPU run):

* :func:`serving_site` — package metadata saying TensorRT-LLM and TensorRT are installed, at given versions, as the
  NGC serving image's Python reports them (``importlib.metadata``): what the engine check reads in a container.
* :func:`stub_repository` — a packaged repository's shape (kiln.json, a tensorrt_llm config naming its engine
  under /models, the engine check script) for the launch-script tests.
* :func:`nvidia_smi` — an ``nvidia-smi`` that lists the GPUs a test chooses.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

from kiln.triton.repository import CHECK_SCRIPT, check_engine_script

TRTLLM, TENSORRT = "1.2.1", "10.14.1.48"


def serving_site(root: Path, trtllm: str = TRTLLM, tensorrt: str = TENSORRT) -> Path:
    """A site directory (for PYTHONPATH) holding only the metadata of a TensorRT-LLM and a TensorRT install."""
    site = root / f"standin-site-{trtllm}-{tensorrt}"
    for name, version in (("tensorrt_llm", trtllm), ("tensorrt", tensorrt)):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def stub_repository(root: Path, models: tuple[str, ...] = ("tensorrt_llm",), trtllm: str = TRTLLM,
                    tensorrt: str = TENSORRT) -> Path:
    """A repository with kiln.json (engine built with ``trtllm``/``tensorrt``), the engine check script, and a
    config.pbtxt per model naming its engine where kiln names it (``/models/<model>/1/engine``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "kiln.json").write_text(json.dumps({"recipe": "stub", "target": "tensorrt",
                                                "engine": {"tensorrt_llm": trtllm, "tensorrt": tensorrt},
                                                "container": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"}))
    shutil.copy2(check_engine_script(), root / CHECK_SCRIPT)
    for model in models:
        (root / model / "1" / "engine").mkdir(parents=True, exist_ok=True)
        (root / model / "1" / "engine" / "rank0.engine").write_text("stand-in engine")
        (root / model / "config.pbtxt").write_text(
            f'name: "{model}"\nparameters {{\n  key: "gpt_model_path"\n  value {{\n'
            f'    string_value: "/models/{model}/1/engine"\n  }}\n}}\n')
    return root


#: The driver the stand-in nvidia-smi reports unless a test chooses one (CUDA 13.x's minimum is 580).
STANDIN_DRIVER = "580.65.06"


def nvidia_smi(bin_dir: Path, gpus: list[str], driver: str = STANDIN_DRIVER) -> Path:
    """A stand-in ``nvidia-smi`` in ``bin_dir`` printing ``gpus`` for ``--query-gpu=name`` and ``driver`` once per
    GPU for ``--query-gpu=driver_version`` (exit 9 when no GPU, as the real one does without a driver)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    if gpus:
        names = "\n".join(f"echo '{g}'" for g in gpus)
        drivers = "\n".join(f"echo '{driver}'" for _ in gpus)
        body = f'if [ "$1" = "--query-gpu=driver_version" ]; then\n{drivers}\nexit 0\nfi\n{names}'
    else:
        body = "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    exe.write_text(f"#!/usr/bin/env bash\n# stand-in nvidia-smi (tests): no GPU is here\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe
