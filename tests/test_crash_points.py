"""A crash after any file write of any real step leaves an output that is never taken for complete.

The real pipeline runs once on the built-in model (int8_sq, seconds) for the tensorrt target up to evaluate and
the reference target to the end, while an audit hook records, in order, every file each step writes into its
temporary output (Python-level opens for writing, copies, hard links and renames). Then, for every prefix of
that sequence — the state a kill right after that write leaves on disk — the output is rebuilt with exactly
the files written so far, and `read_manifest`, with the step's required files, must refuse it. Only the finished
output (manifest renamed into place last) is accepted. Files written outside Python's view (native writers) are
put in every prefix: the worst case for this check.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from kiln.pipeline import runner
from kiln.recipe.loader import load_recipe
from kiln.util.artifacts import MANIFEST, TMP_MARK, read_manifest

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.yaml"
FAST = ["quantization.format=int8_sq", "quantization.calibration.samples=8",
        "quantization.calibration.max_seq_len=64", "evaluation.samples=4", "evaluation.max_seq_len=64"]

_recording: list[tuple[str, str]] | None = None  # (temporary output dir name, path written inside it)


def _hook(event: str, args: tuple) -> None:
    if _recording is None:
        return
    path = None
    if event == "open":
        target, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        path = target if writes else None
    elif event in ("os.rename", "os.link", "shutil.copyfile"):
        path = args[1]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    parts = Path(os.fsdecode(path)).parts
    for i, part in enumerate(parts):
        if TMP_MARK in part:
            if len(parts) > i + 1:
                _recording.append((part, str(Path(*parts[i + 1:]))))
            return


sys.addaudithook(_hook)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each step's final output directory, its required files and its write sequence."""
    global _recording
    root = tmp_path_factory.mktemp("crash")
    layout = runner.Layout(root / "build", root / "triton_repo")
    out = {}
    for overrides, to_step in ((["name=crash-trt", "target=tensorrt", "quantization.runtime=host", *FAST], "evaluate"),
                               (["name=crash-ref", *FAST], None)):
        loaded = load_recipe(RECIPE, overrides)
        _recording = []
        try:
            summary = runner.run(loaded, layout, to_step=to_step, progress=False)
        finally:
            writes, _recording = _recording, None
        assert summary.failure is None, summary.failure
        for p in runner.schedule(loaded, layout, to_step=to_step):
            if p.action == runner.Action.OUTSIDE:
                continue
            prefix = f".{p.out_dir.name}{TMP_MARK}"
            sequence = [rel for tmp, rel in writes if tmp.startswith(prefix)]
            out[f"{loaded.recipe.name}/{p.spec.name}"] = (p.out_dir, p.spec.required_files(loaded.recipe), sequence)
    return out


def _state_after(final: Path, sequence: list[str], count: int, into: Path) -> Path:
    """The temporary output as a kill after the first ``count`` writes of ``sequence`` leaves it."""
    written = set(sequence[:count])
    seen = set(sequence)
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for f in sorted(final.rglob("*")):
        rel = str(f.relative_to(final))
        if f.is_file() and (rel in written or (rel not in seen and f.name != MANIFEST)):
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, into / rel)
    return into


STEPS = [f"crash-trt/{s}" for s in ("resolve", "quantize", "evaluate")] + \
        [f"crash-ref/{s}" for s in ("resolve", "quantize", "evaluate", "engine", "package")]


@pytest.mark.parametrize("key", STEPS)
def test_no_crash_point_leaves_an_output_taken_for_complete(recorded, key, tmp_path):
    final, required, sequence = recorded[key]
    assert read_manifest(final, required) is not None  # the finished output is accepted
    assert sequence and sequence[-1] == MANIFEST, f"the manifest must be the last write: {sequence[-3:]}"
    for count in range(len(sequence)):  # every state before the manifest's rename into place
        state = _state_after(final, sequence, count, tmp_path / "state")
        assert read_manifest(state, required) is None, f"accepted after {count} writes: {sequence[:count][-3:]}"
