"""The runner's contract with fast stand-in steps: fingerprints, skip/re-run, --from/--to/--force, atomic outputs,
reuse across recipes, and the lock. The real step declarations are exercised in test_step_contracts.py (fast) and
test_pipeline_integration.py (real ModelOpt)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from kiln.pipeline import runner
from kiln.recipe.loader import load_recipe
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.util.artifacts import read_manifest
from kiln.util.errors import InputError, KilnError

CALLS: list[str] = []


class StandInResult(StepResult):
    """The stand-in steps' result."""

    step: str


def _writer(name: str):
    def fn(ctx: StepContext) -> StandInResult:
        CALLS.append(name)
        upstream = {k: (v / "out.txt").read_text() for k, v in ctx.inputs.items() if (v / "out.txt").exists()}
        (ctx.out_dir / "out.txt").write_text(json.dumps({"step": name, "upstream": upstream}))
        if name == "quantize" and ctx.recipe.quantization.calibration.samples == 13:
            raise KilnError("boom in quantize")
        return StandInResult(summary=f"{name} done", step=name)

    return fn


def _gate(recipe, result):
    return "gate failed" if recipe.evaluation.max_kl == 0.0 else None


def _spec(name: str, keys: tuple[str, ...], **kw) -> StepSpec:
    return StepSpec(name, kw.pop("fn", _writer(name)), StandInResult, keys, files=("out.txt",), **kw)


SPECS = {
    "resolve": _spec("resolve", ("model",)),
    "quantize": _spec("quantize", ("model", "quantization", "target"), after=("resolve",)),
    "evaluate": _spec("evaluate", ("evaluation",), ignore=("evaluation.max_ppl_increase_pct", "evaluation.max_kl"),
                      after=("quantize",), check=_gate),
    "engine": _spec("engine", ("engine",), after=("quantize",)),
    "package": _spec("package", ("serving", "engine"), after=("engine", "evaluate"),
                     output_dir=lambda loaded, root: root / loaded.recipe.name),
    "tasks": _spec("tasks", ("evaluation.task_defaults",)),  # after package for real; standalone here
}


@pytest.fixture(autouse=True)
def fake_steps(monkeypatch):
    monkeypatch.setattr(runner, "load_steps", lambda: dict(SPECS))
    CALLS.clear()


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text("name: pipe\ntarget: reference\nquantization:\n  format: int8_sq\n")
    return p


@pytest.fixture
def layout(tmp_path: Path) -> runner.Layout:
    return runner.Layout(tmp_path / "build", tmp_path / "repo")


def build(recipe_file, layout, *overrides, **kw):
    loaded = load_recipe(recipe_file, overrides)
    return runner.run(loaded, layout, progress=False, **kw)


def statuses(summary) -> dict[str, str]:
    return {o.name: o.status for o in summary.outcomes}


def test_first_build_runs_every_step_and_writes_manifests(recipe_file, layout):
    s = build(recipe_file, layout)
    assert s.failure is None
    assert statuses(s) == dict.fromkeys(runner.STEP_ORDER, "ran")
    m = read_manifest(layout.build_root / "pipe" / "quantize")
    assert m["fingerprint"] and m["components"]["recipe"]["quantization.format"] == "int8_sq"
    assert "name" not in m["components"]["recipe"]  # the name never affects an artifact
    assert "resolved_recipe" in m and m["host"]["name"]
    assert read_manifest(layout.repo_root / "pipe") is not None  # package lives in the repository root


def test_unchanged_rebuild_runs_no_step(recipe_file, layout):
    build(recipe_file, layout)
    CALLS.clear()
    s = build(recipe_file, layout)
    assert CALLS == []
    assert set(statuses(s).values()) == {"skipped"}


def test_calibration_change_reruns_quantize_and_everything_after(recipe_file, layout):
    build(recipe_file, layout)
    CALLS.clear()
    build(recipe_file, layout, "quantization.calibration.samples=64")
    assert CALLS == ["quantize", "evaluate", "engine", "package"]


def test_serving_change_reruns_only_package(recipe_file, layout):
    build(recipe_file, layout)
    CALLS.clear()
    build(recipe_file, layout, "serving.max_queue_delay_microseconds=500")
    assert CALLS == ["package"]


def test_gate_threshold_change_rechecks_without_recomputing(recipe_file, layout):
    build(recipe_file, layout)
    CALLS.clear()
    s = build(recipe_file, layout, "evaluation.max_kl=0.0")
    assert CALLS == [] and s.failure is not None and "gate failed" in str(s.failure)
    assert statuses(s)["engine"] == "not run"


def test_force_reruns_all(recipe_file, layout):
    build(recipe_file, layout)
    CALLS.clear()
    build(recipe_file, layout, force=True)
    assert CALLS == list(runner.STEP_ORDER)


def test_from_and_to(recipe_file, layout):
    s = build(recipe_file, layout, to_step="quantize")
    assert CALLS == ["resolve", "quantize"] and statuses(s)["evaluate"] == "not run"
    CALLS.clear()
    build(recipe_file, layout)
    CALLS.clear()
    build(recipe_file, layout, from_step="engine")
    assert CALLS == ["engine", "package", "tasks"]
    CALLS.clear()
    build(recipe_file, layout, from_step="evaluate", to_step="evaluate")
    assert CALLS == ["evaluate"]


def test_from_refuses_stale_upstream(recipe_file, layout):
    build(recipe_file, layout)
    loaded = load_recipe(recipe_file, ["quantization.format=fp8"])
    with pytest.raises(InputError, match="quantize is out of date"):
        runner.schedule(loaded, layout, from_step="evaluate")


def test_bad_step_names(recipe_file, layout):
    with pytest.raises(InputError, match="not a step"):
        build(recipe_file, layout, to_step="link")
    with pytest.raises(InputError, match="comes after"):
        build(recipe_file, layout, from_step="package", to_step="resolve")


def test_dry_run_explains_which_field_changed(recipe_file, layout, capsys):
    from rich.console import Console

    build(recipe_file, layout)
    loaded = load_recipe(recipe_file, ["quantization.format=fp8"])
    planned = runner.schedule(loaded, layout)
    assert [p.action for p in planned] == ["skip", "run", "run", "run", "run", "skip"]
    assert any("quantization.format: int8_sq → fp8" in r for r in planned[1].reasons)
    assert any("upstream quantize" in r for r in planned[2].reasons)
    runner.describe_schedule(planned, loaded, Console(width=200))
    out = capsys.readouterr().out
    assert "skip" in out and "quantization.format: int8_sq → fp8" in out
    assert CALLS == ["resolve", "quantize", "evaluate", "engine", "package", "tasks"]  # only the first build ran anything


def test_failed_step_leaves_previous_complete_output(recipe_file, layout):
    build(recipe_file, layout)
    before = (layout.build_root / "pipe" / "quantize" / "out.txt").read_text()
    s = build(recipe_file, layout, "quantization.calibration.samples=13")  # the stand-in raises after writing
    assert statuses(s)["quantize"] == "failed" and "boom" in str(s.failure)
    assert statuses(s)["package"] == "not run"
    qdir = layout.build_root / "pipe" / "quantize"
    assert (qdir / "out.txt").read_text() == before  # the old complete artifact, untouched
    assert [p.name for p in qdir.parent.iterdir() if ".tmp-" in p.name] == []


def test_incomplete_output_is_never_accepted(recipe_file, layout):
    build(recipe_file, layout)
    qdir = layout.build_root / "pipe" / "quantize"
    (qdir / "out.txt").write_text("truncated")  # size no longer matches the manifest
    CALLS.clear()
    build(recipe_file, layout)
    assert CALLS[0] == "quantize"
    manifest = json.loads((qdir / "manifest.json").read_text())
    manifest["complete"] = False
    (qdir / "manifest.json").write_text(json.dumps(manifest))
    CALLS.clear()
    build(recipe_file, layout)
    assert CALLS[0] == "quantize"


def test_leftovers_are_swept_at_the_start_even_when_no_step_reruns(recipe_file, layout):
    build(recipe_file, layout)
    junk = [layout.build_root / "pipe" / ".quantize.tmp-999-deadbeef", layout.build_root / "pipe" / ".engine.old-1a2b",
            layout.repo_root / ".pipe.tmp-999-cafe", layout.repo_root.parent / "deploy" / ".pipe.tmp-999-f00d"]
    other = layout.build_root / "other" / ".quantize.tmp-999-deadbeef"  # another recipe's: not ours to sweep
    for d in [*junk, other]:
        d.mkdir(parents=True)
        (d / "half.bin").write_text("x")
    CALLS.clear()
    s = build(recipe_file, layout)
    assert CALLS == []  # nothing re-ran, and still:
    assert not any(d.exists() for d in junk) and sorted(s.swept) == sorted(junk)
    assert other.exists()


def test_points_that_share_a_step_fingerprint_reuse_its_output(tmp_path, layout):
    a = tmp_path / "a.yaml"
    a.write_text("name: alpha\ntarget: reference\n")
    b = tmp_path / "b.yaml"
    b.write_text("name: beta\ntarget: reference\nserving:\n  streaming: false\n")
    runner.run(load_recipe(a), layout, progress=False)
    CALLS.clear()
    s = runner.run(load_recipe(b), layout, progress=False)
    assert CALLS == ["package"]  # resolve..build reused from alpha (name and serving do not affect them)
    assert statuses(s)["quantize"] == "reused"
    qa, qb = layout.build_root / "alpha" / "quantize" / "out.txt", layout.build_root / "beta" / "quantize" / "out.txt"
    assert qa.read_text() == qb.read_text() and qa.stat().st_ino == qb.stat().st_ino  # hard link, no copy
    assert read_manifest(qb.parent)["recipe"] == "beta"


def _slow_build(recipe_file: str, build_root: str, repo_root: str, q) -> None:
    slow = dict(SPECS)

    def slow_quantize(ctx):
        time.sleep(1.5)
        return _writer("quantize")(ctx)

    slow["quantize"] = _spec("quantize", ("model", "quantization", "target"), fn=slow_quantize, after=("resolve",))
    runner.load_steps = lambda: slow
    s = runner.run(load_recipe(recipe_file), runner.Layout(Path(build_root), Path(repo_root)), progress=False)
    q.put((s.failure is None, {o.name: o.status for o in s.outcomes}))


def test_concurrent_builds_wait_and_share_one_set_of_artifacts(recipe_file, layout):
    ctx = multiprocessing.get_context("spawn")  # fork() in a pytest process with gRPC/torch threads can hang the child
    q = ctx.Queue()
    procs = [ctx.Process(target=_slow_build, args=(str(recipe_file), str(layout.build_root), str(layout.repo_root), q))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = [q.get(timeout=5) for _ in procs]
    assert all(ok for ok, _ in results)
    ran = sorted(st["quantize"] for _, st in results)
    assert ran == ["ran", "skipped"]  # the second waited on the lock, then reused the first one's output
