"""`kiln sweep`: the shipped example validated; a fast variant of it run on the built-in model (real ModelOpt) with
resumability; a bench sweep (real tritonserver per point) and the data its plot draws; validation errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli.main import cli
from kiln.experiments.sweep import SweepFile, expand, load_sweep, run_sweep
from kiln.pipeline.runner import Layout
from kiln.recipe.catalog import configs_dir
from kiln.recipe.errors import RecipeError

EXAMPLE = configs_dir() / "sweeps" / "tiny-llama-formats.yaml"


def test_expand_is_the_product_minus_excludes_in_file_order():
    spec = SweepFile.model_validate({"base": "x.yaml", "axes": {"a.b": [1, 2], "c.d": ["x", "y"]},
                                     "exclude": [{"a.b": 2, "c.d": "x"}], "points": [{"a.b": 9}, {"a.b": 1, "c.d": "x"}]})
    assert [p.overrides for p in expand(spec)] == [{"a.b": 1, "c.d": "x"}, {"a.b": 1, "c.d": "y"},
                                                   {"a.b": 2, "c.d": "y"}, {"a.b": 9}]


def test_invalid_axis_key_or_value_fails_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {configs_dir() / 'tiny-llama.yaml'}\n"
                   "axes:\n"
                   "  quantization.formt: [int8_sq]\n"
                   "  quantization.kv_cache: [none, fp9]\n")
    layout = Layout(tmp_path / "build", tmp_path / "repo")
    with pytest.raises(RecipeError) as info:
        load_sweep(bad, layout)
    text = str(info.value)
    assert "quantization.formt" in text and "did you mean `format`" in text and "point 0" in text
    assert "'fp9' is not allowed" in text and "point 1" in text
    assert f"{bad}:3: error: quantization.formt" in text  # each problem points at its axis line in the sweep file
    assert f"{bad}:4: error: quantization.kv_cache" in text
    assert not (tmp_path / "build").exists()  # nothing ran
    result = CliRunner().invoke(cli, ["sweep", str(bad), "--build-dir", str(tmp_path / "b2")])
    assert result.exit_code == 2 and "Traceback" not in result.output


def _manifest_times(build: Path) -> dict[str, str]:
    return {str(p.relative_to(build)): json.loads(p.read_text())["started"]
            for p in sorted(build.glob("*/*/manifest.json"))}


def test_example_sweep_is_valid_and_compares_every_format(tmp_path):
    """The shipped example expands to its points and each one validates (running it is the next test's job, with
    the fast formats only: the pipeline's sweep behaviour does not depend on the format)."""
    sweep = load_sweep(EXAMPLE, Layout(tmp_path / "build", tmp_path / "repo"))
    pairs = [(p.overrides["quantization.format"], p.overrides["quantization.kv_cache"]) for p in sweep.points]
    assert pairs == [("int8_sq", "none"), ("int4_awq", "none"), ("int4_awq", "fp8"), ("w4a8_awq", "none"),
                     ("fp8", "none"), ("fp8", "fp8")]
    assert sorted(sweep.loaded) == [p.index for p in sweep.points]
    assert {sweep.loaded[p.index].recipe.quantization.format for p in sweep.points} == {f for f, _ in pairs}
    assert sweep.spec.measure == ("quality", "plan") and sweep.spec.gpu == "H100-SXM"
    assert not (tmp_path / "build").exists()  # validating runs nothing


# Fast settings for sweeps that run: int8_sq / fp8 / int8_wo calibrate in about a second on a few short samples.
FAST_SET = {"quantization.calibration.samples": 4, "quantization.calibration.max_seq_len": 64,
            "evaluation.samples": 4, "evaluation.max_seq_len": 64}


def _example_with(tmp_path: Path, name: str, formats: list[str]) -> Path:
    """The shipped example (same set, exclusions, measures, GPU) over other formats, with FAST_SET."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["base"] = str(EXAMPLE.parent / spec["base"])
    spec["set"].update(FAST_SET)
    spec["axes"]["quantization.format"] = formats
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.integration
def test_sweep_runs_resumes_and_grows(tmp_path):
    layout = Layout(tmp_path / "build", tmp_path / "repo")
    sweep = load_sweep(_example_with(tmp_path, "fast.yaml", ["int8_sq", "fp8"]), layout)
    assert [p.label for p in sweep.points] == ["format=int8_sq, kv_cache=none", "format=fp8, kv_cache=none",
                                               "format=fp8, kv_cache=fp8"]  # int8_sq × fp8 KV is excluded
    records = run_sweep(sweep, layout, progress=False)
    assert [r["status"] for r in records] == ["ok"] * len(records), [r.get("error") for r in records]

    out = layout.build_root / "sweeps" / sweep.name
    rows = list(csv.DictReader((out / "results.csv").open()))
    md = (out / "results.md").read_text()
    assert (out / "quality_vs_size.png").stat().st_size > 1000
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) == len(sweep.points)
    for row, point in zip(rows, sweep.points):
        name = sweep.loaded[point.index].recipe.name
        quality = json.loads((layout.build_root / name / "evaluate" / "quality.json").read_text())
        assert float(row["ppl_increase_pct"]) == pytest.approx(quality["ppl_increase_pct"])
        assert float(row["mean_kl"]) == pytest.approx(quality["mean_kl"])
        assert quality["format"] == point.overrides["quantization.format"]
        assert row["fits"] == "True"
        assert f"| {point.index} | {point.label} | ok |" in md

    # points that differ only in the KV cache share nothing upstream of quantize; every point resolved once
    before = _manifest_times(layout.build_root)
    again = run_sweep(load_sweep(sweep.file, layout), layout, progress=False)
    assert _manifest_times(layout.build_root) == before  # re-running the finished sweep ran no step
    assert all(set(r["steps"].values()) <= {"skipped", "not run"} for r in again)

    grown = _example_with(tmp_path, "grown.yaml", ["int8_sq", "fp8", "int8_wo"])  # same sweep, one more format
    records = run_sweep(load_sweep(grown, layout), layout, progress=False)
    ran = [r for r in records if any(s in ("ran", "reused") for s in r["steps"].values())]
    assert {r["overrides"]["quantization.format"] for r in ran} == {"int8_wo"}
    assert len(ran) == 2  # int8_wo × kv none/fp8: only the new points ran
    for key, started in before.items():
        assert json.loads((layout.build_root / key).read_text())["started"] == started


@pytest.mark.integration
def test_bench_sweep_plots_each_points_throughput_against_latency(tmp_path, monkeypatch):
    """measure: bench serves each point with a real tritonserver and benchmarks it; the throughput-vs-latency plot
    draws one line per point through its levels' (E2E p50, output tokens/s); a re-run reuses the figures."""
    from matplotlib.figure import Figure

    sweep_file = tmp_path / "bench.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "bench-sweep", "base": str(configs_dir() / "tiny-llama.yaml"),
        "set": {"quantization.format": "int8_sq", **FAST_SET},
        "axes": {"serving.cpu_threads": [1, 2]},
        "measure": ["bench"],
        "bench": {"concurrency": [1, 2], "duration_s": 0.5, "input_len": 8, "output_len": 8},
    }))
    drawn: dict[str, list[tuple[str, list[float], list[float]]]] = {}
    savefig = Figure.savefig

    def record_lines(fig, path, *args, **kwargs):  # what each plot draws, captured as it is saved
        drawn[Path(path).name] = [(line.get_label(), [float(x) for x in line.get_xdata()],
                                   [float(y) for y in line.get_ydata()]) for ax in fig.axes for line in ax.get_lines()]
        return savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record_lines)
    layout = Layout(tmp_path / "build", tmp_path / "repo")
    records = run_sweep(load_sweep(sweep_file, layout), layout, progress=False)
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("error") for r in records]
    expected = []
    for r in records:
        levels = r["bench"]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert all(lv["completed"] >= 1 and lv["errors"] == 0 for lv in levels)
        expected.append((r["label"], [lv["e2e_p50_ms"] for lv in levels], [lv["output_tokens_per_s"] for lv in levels]))
    lines = drawn["throughput_vs_latency.png"]
    assert lines == expected
    assert all(x > 0 for _, xs, ys in lines for x in xs + ys)
    out = layout.build_root / "sweeps" / "bench-sweep"
    assert (out / "throughput_vs_latency.png").stat().st_size > 1000

    def no_server(*_args, **_kwargs):
        raise AssertionError("a finished point was benchmarked again")

    monkeypatch.setattr("kiln.serve.server.TritonServer.start", no_server)
    again = run_sweep(load_sweep(sweep_file, layout), layout, progress=False)
    assert [r["status"] for r in again] == ["ok", "ok"], [r.get("error") for r in again]
    assert [r["bench"] for r in again] == [r["bench"] for r in records]
