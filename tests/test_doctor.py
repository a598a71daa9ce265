"""``kiln doctor``, the first run on a GPU host. No GPU here: the no-GPU path runs for real; the GPU path runs up to
the boundary through STAND-INS (tests/standins.py's nvidia-smi, tests/standin_runtime's docker and image), whose
python refuses the calibration jobs the way a broken GPU host would, so the doctor's verdicts and log paths are the
real ones for a failing first run. Nothing here is a GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.standin_runtime import install

needs_bwrap = pytest.mark.skipif(not Path("/usr/bin/bwrap").exists() and not any(
    (Path(p) / "bwrap").exists() for p in os.environ.get("PATH", "").split(os.pathsep)),
    reason="the stand-in container runtime needs bubblewrap (apt-get install bubblewrap)")


def doctor(cwd: Path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "kiln", "doctor", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env})
    return run, time.monotonic() - started


def test_without_a_gpu_it_says_what_it_would_run_and_why_not(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    run, seconds = doctor(tmp_path, {"PATH": f"{empty}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    print(f"kiln doctor without a GPU: exit {run.returncode} in {seconds:.1f} s")
    assert run.returncode == 1, run.stdout + run.stderr
    for target in ("tensorrt", "pytorch"):
        for step in ("probe", "quantize", "evaluate", "package", "serve", "compare"):
            assert f"WOULD RUN {target:9} {step:9}" in run.stdout, (target, step, run.stdout)
    assert "WOULD RUN tensorrt  engine    trtllm-build in" in run.stdout
    assert "and cannot run here:" in run.stdout and "no GPU: nvidia-smi is absent" in run.stdout
    assert not (tmp_path / "build").exists()  # nothing was started or written


@needs_bwrap
def test_on_a_gpu_host_every_step_gets_a_verdict_and_failures_their_log(tmp_path: Path) -> None:
    s = install(tmp_path / "rt")
    python = s.image_root / "bin" / "python3"  # STAND-IN image python: the calibration jobs fail like a bad GPU
    python.write_text('#!/bin/sh\ncase "$*" in *quantize.py*|*export_hf.py*) echo "STAND-IN: CUDA error: out of '
                      f'memory" >&2; exit 1;; esac\nexec "{sys.executable}" "$@"\n')
    run, _ = doctor(tmp_path, s.env, "--target", "tensorrt")  # pytorch's export_hf job fails the same way
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "cannot run here" not in out
    assert "PASS      tensorrt  probe     TensorRT-LLM 1.2.1, TensorRT 10.14.1.48" in out
    line = next(ln for ln in out.splitlines() if "FAIL      tensorrt  quantize" in ln)
    log = Path(line.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "STAND-IN: CUDA error: out of memory" in log.read_text(), line
    for step in ("evaluate", "engine", "package", "serve", "compare"):
        assert f"SKIP      tensorrt  {step:9}" in out, step
    assert "pytorch" not in out
    assert "FAILED: send the lines above" in out
