"""`kiln sweep`: the shipped example on the built-in model (real ModelOpt), resumability, and validation."""

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


@pytest.mark.integration
def test_example_sweep_runs_resumes_and_grows(tmp_path):
    layout = Layout(tmp_path / "build", tmp_path / "repo")
    sweep = load_sweep(EXAMPLE, layout)
    assert len(sweep.points) >= 6
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
    again = run_sweep(load_sweep(EXAMPLE, layout), layout, progress=False)
    assert _manifest_times(layout.build_root) == before  # re-running the finished sweep ran no step
    assert all(set(r["steps"].values()) <= {"skipped", "not run"} for r in again)

    grown = tmp_path / "grown.yaml"
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["base"] = str(EXAMPLE.parent / spec["base"])
    spec["axes"]["quantization.format"].append("int8_wo")
    grown.write_text(yaml.safe_dump(spec))
    bigger = load_sweep(grown, layout)
    records = run_sweep(bigger, layout, progress=False)
    ran = [r for r in records if any(s in ("ran", "reused") for s in r["steps"].values())]
    assert {r["overrides"]["quantization.format"] for r in ran} == {"int8_wo"}
    assert len(ran) == 2  # int8_wo × kv none/fp8: only the new points ran
    for key, started in before.items():
        assert json.loads((layout.build_root / key).read_text())["started"] == started
