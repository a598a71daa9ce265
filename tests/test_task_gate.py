"""The task-accuracy gate (the `tasks` step): recipe keys, task files as hashed inputs, what re-runs, the gate's
figures in every report, and — in the integration part — lm-eval 0.4.13's real `local-completions` against the
served quantized model and the served unquantized baseline (real tritonserver, CPU reference runtime).
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from kiln.pipeline import reports, runner
from kiln.recipe.loader import load_recipe
from kiln.steps.tasks import (TaskFigures, TasksResult, baseline_recipe, check_task_gate, read_task_yaml,
                              task_gates, tasks_input_hashes)
from kiln.util.errors import InputError
from test_step_contracts import lay_down_complete_outputs  # complete outputs with the real schedule's fingerprints

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPE = CONFIGS / "tiny-llama.yaml"

TASK_YAML = """\
task: my_lines
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/items.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
process_docs: !function helpers.keep
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


@pytest.fixture
def user_task(tmp_path: Path) -> Path:
    """A user's lm-eval task: YAML, a JSONL data file beside it (relative path) and a `!function` helper."""
    (tmp_path / "task" / "data").mkdir(parents=True)
    (tmp_path / "task" / "data" / "items.jsonl").write_text('{"prompt": "a", "target": "b"}\n')
    (tmp_path / "task" / "helpers.py").write_text("def keep(docs):\n    return docs\n")
    path = tmp_path / "task" / "task.yaml"
    path.write_text(TASK_YAML)
    return path


def _with_task(path: Path, *more: str):
    return load_recipe(RECIPE, (f'evaluation.tasks=[{{"task": "{path}"}}]', *more))


def test_thresholds_come_from_the_task_or_the_defaults(tmp_path):
    loaded = load_recipe(RECIPE, ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword"}, '
                                  '{"task": "builtin:tiny-python-nextline", "max_accuracy_drop_pct": 0}]',
                                  "evaluation.task_defaults.max_accuracy_drop_pct=3"))
    result = TasksResult(summary="s", tasks=(
        TaskFigures(task="builtin:tiny-python-nextword", name="a", output_type="generate_until", metric="exact_match",
                    samples=10, baseline=0.5, quantized=0.48, drop_pts=2.0),
        TaskFigures(task="builtin:tiny-python-nextline", name="b", output_type="multiple_choice", metric="acc",
                    samples=10, baseline=0.5, quantized=0.4, drop_pts=10.0)))
    gates = task_gates(loaded.recipe, result)
    assert [g.passed for g in gates] == [True, False]
    assert gates[0].key == "evaluation.task_defaults.max_accuracy_drop_pct"
    assert gates[1].key == "evaluation.tasks[1].max_accuracy_drop_pct"
    message = check_task_gate(loaded.recipe, result)
    assert "0.5000 unquantized → 0.4000 quantized" in message and "gate is 0 points" in message
    off = load_recipe(RECIPE, ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword"}]',
                               "evaluation.task_defaults.max_accuracy_drop_pct=null"))
    assert task_gates(off.recipe, result)[0].passed is None and check_task_gate(off.recipe, result) is None


def test_a_task_yaml_is_checked_all_problems_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: x\ndataset_path: cais/mmlu\ninclude: base.yaml\ndoc_to_text: !function nowhere.f\n")
    with pytest.raises(InputError) as err:
        read_task_yaml(bad, "evaluation.tasks[0].task")
    text = str(err.value)
    assert text.startswith(f"evaluation.tasks[0].task: {bad}")
    for expected in ("would load from the hub", "`include` is not supported", "data_files must name",
                     "nowhere.py not found"):
        assert expected in text, text


def test_the_baseline_is_the_recipe_unquantized_without_tasks():
    loaded = load_recipe(RECIPE, ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword"}]',))
    base = baseline_recipe(loaded).recipe
    assert (base.name, base.quantization.format, base.quantization.kv_cache) == ("tiny-llama.baseline", "none", "none")
    assert base.evaluation.tasks == () and base.evaluation.enabled is False
    assert base.engine == loaded.recipe.engine and base.serving == loaded.recipe.serving
    assert baseline_recipe(load_recipe(RECIPE)) is None  # no tasks: no baseline


def _rerun(layout, loaded) -> list[str]:
    return [p.spec.name for p in runner.schedule(loaded, layout) if p.action == runner.Action.RUN]


def test_a_task_data_change_reruns_only_the_tasks_step(tmp_path, user_task):
    layout = runner.Layout(tmp_path / "build", tmp_path / "repo")
    loaded = _with_task(user_task)
    lay_down_complete_outputs(loaded, layout)
    tasks = next(p for p in runner.schedule(loaded, layout) if p.spec.name == "tasks")
    assert tasks.action == runner.Action.SKIP and "baseline" in tasks.components
    data = user_task.parent / "data" / "items.jsonl"
    data.write_text(data.read_text() + '{"prompt": "c", "target": "d"}\n')
    assert _rerun(layout, loaded) == ["tasks"]
    lay_down_complete_outputs(loaded, layout)
    (user_task.parent / "helpers.py").write_text("def keep(docs):\n    return docs[:1]\n")
    assert _rerun(layout, loaded) == ["tasks"]
    lay_down_complete_outputs(loaded, layout)
    assert _rerun(layout, _with_task(user_task, "evaluation.task_defaults.max_accuracy_drop_pct=0")) == []
    assert _rerun(layout, _with_task(user_task, "evaluation.task_defaults.limit=3")) == ["tasks"]
    # the baseline's package is part of the gate's fingerprint: a serving change reaches it twice, same answer
    assert _rerun(layout, _with_task(user_task, "serving.streaming=false")) == ["package", "tasks"]


def test_the_fingerprint_holds_each_tasks_content(tmp_path, user_task):
    before = tasks_input_hashes(_with_task(user_task))
    (user_task.parent / "data" / "items.jsonl").write_text('{"prompt": "a", "target": "B"}\n')
    after = tasks_input_hashes(_with_task(user_task))
    assert before.keys() == after.keys() == {"task[0]"} and before != after
    builtin = tasks_input_hashes(load_recipe(RECIPE, ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword"}]',)))
    assert builtin["task[0]"].startswith("builtin:tiny-python-nextword limit=None num_fewshot=0 sha256:")


def test_the_gate_in_the_json_summary_and_one_junit_case_per_task():
    loaded = load_recipe(RECIPE, ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword"}, '
                                  '{"task": "builtin:tiny-python-nextline"}]',
                                  "evaluation.task_defaults.max_accuracy_drop_pct=0"))
    result = TasksResult(summary="s", tasks=(
        TaskFigures(task="builtin:tiny-python-nextword", name="kiln_tiny_python_nextword", output_type="generate_until",
                    metric="exact_match", samples=8, baseline=0.375, quantized=0.25, drop_pts=12.5),
        TaskFigures(task="builtin:tiny-python-nextline", name="kiln_tiny_python_nextline",
                    output_type="multiple_choice", metric="acc", samples=8, baseline=0.5, quantized=0.5, drop_pts=0.0)),
        served="x", baseline_repo="y", lm_eval="0.4.13", seconds=1.0)
    failure = runner.KilnError(check_task_gate(loaded.recipe, result))
    outcome = runner.StepOutcome("tasks", runner.Status.RAN, 1.0, Path("build/x/tasks"), result, fingerprint="a" * 64,
                                 gates=task_gates(loaded.recipe, result))
    summary = runner.RunSummary("x", [outcome], failure, 1.0)
    data = json.loads(reports.summary_json(summary))
    jsonschema.validate(data, reports.json_schema(reports.SUMMARY_SCHEMA))
    assert [g["status"] for g in data["steps"][0]["gates"]] == ["failed", "passed"]
    data["steps"][0]["result"]["tasks"][0]["baseline"] = "high"  # the schema holds the gate's figures' types
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, reports.json_schema(reports.SUMMARY_SCHEMA))
    suite = ET.fromstring(reports.junit_xml(summary)).find("testsuite")
    cases = {c.get("name"): c for c in suite.iter("testcase") if c.get("classname").endswith("quality_gate")}
    assert list(cases) == ["task accuracy kiln_tiny_python_nextword (evaluation.task_defaults.max_accuracy_drop_pct)",
                           "task accuracy kiln_tiny_python_nextline (evaluation.task_defaults.max_accuracy_drop_pct)"]
    failed = cases["task accuracy kiln_tiny_python_nextword (evaluation.task_defaults.max_accuracy_drop_pct)"]
    assert "0.3750 unquantized → 0.2500 quantized" in failed.find("failure").get("message")


def test_sweep_tables_show_task_accuracy():
    from kiln.experiments.sweep import table_rows

    rows = table_rows([{"point": 0, "label": "int4_awq", "status": "ok",
                        "tasks": {"kiln_tiny_python_nextword": {"metric": "exact_match", "baseline": 0.5,
                                                             "quantized": 0.25, "drop_pts": 25.0}}},
                       {"point": 1, "label": "fp8", "status": "ok"}])
    assert rows[0]["task_accuracy"] == "kiln_tiny_python_nextword 0.250 (base 0.500)"
    assert rows[0]["max_task_drop_pts"] == 25.0 and rows[1]["task_accuracy"] is None
