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


# ------------------------------------------------------------------ the real thing: lm-eval against served models
# The session's default build and tritonserver (conftest) are the quantized side: kiln's OpenAI server is put in front
# of that server and announced like a running `kiln serve --openai` (its state file), so the gate reuses it; the gate
# builds the unquantized baseline (tiny-llama.baseline, up to package) and serves it with a tritonserver of its own.

PARTING_YAML = """\
task: kiln_parting_prompts
dataset_path: json
dataset_kwargs:
  data_files:
    test: items.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: %d
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def parting_task(tmp_path_factory, hf_greedy):
    """A generate_until task made of the served-greedy prompts (test_served_greedy: INT4 AWQ and the unquantized
    model part ways on some of them), each target the unquantized model's greedy continuation (Hugging Face
    generate): the baseline must score 1, the quantized model less. Returns (task YAML, documents, parting)."""
    from test_served_greedy import MAX_TOKENS, PROMPTS

    items = [{"prompt": p, "target": hf_greedy(p, MAX_TOKENS, quantized=False)} for p in PROMPTS]
    parting = sum(hf_greedy(p, MAX_TOKENS) != item["target"] for p, item in zip(PROMPTS, items))
    assert 0 < parting < len(PROMPTS), "precondition: some prompts must part the two models, some not"
    directory = tmp_path_factory.mktemp("parting-task")
    (directory / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (directory / "task.yaml").write_text(PARTING_YAML % MAX_TOKENS)
    return directory / "task.yaml", len(PROMPTS), parting


def _tasks(parting_yaml: Path, parting_drop: float) -> str:
    return ('evaluation.tasks=[{"task": "builtin:tiny-python-nextword", "limit": 10}, '
            '{"task": "builtin:tiny-python-nextline", "limit": 10}, '
            f'{{"task": "{parting_yaml}", "max_accuracy_drop_pct": {parting_drop}}}]')


def test_the_parting_prompts_part_the_served_models(parting_task, default_server):
    """The fixture's precondition, first, so that --durations shows the gate's own cost on the next test's setup."""
    _, documents, parts = parting_task
    assert 0 < parts < documents


# the shipped tiny-llama-tasks.yaml's gate, on the default recipe (so its package is the session's served one)
GATE = "evaluation.task_defaults.max_accuracy_drop_pct=10"


@pytest.fixture(scope="module")
def gate_run(default_build, default_server, parting_task):
    from kiln.serve.openai import OpenAIConfig, OpenAIServer
    from kiln.serve.server import free_port

    _, layout, repo = default_build
    front = OpenAIServer(OpenAIConfig(triton_url=default_server.urls()["grpc"], repo=repo, port=free_port()))
    front.start()
    state = layout.build_root / ".serve" / "tiny-llama.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"pid": os.getpid(), "repo": str(repo.resolve()),
                                 "urls": {"openai": f"{front.cfg.url}/v1"}}))
    try:
        loaded = load_recipe(RECIPE, (_tasks(parting_task[0], 100), GATE))
        yield loaded, layout, runner.run(loaded, layout, progress=False)
    finally:
        state.unlink()
        front.stop()


def test_the_default_recipe_with_a_builtin_task_passes_the_gate(gate_run, parting_task):
    loaded, layout, summary = gate_run
    assert summary.failure is None, summary.failure
    outcome = next(o for o in summary.outcomes if o.name == "tasks")
    assert outcome.status == runner.Status.RAN and [o.status for o in summary.outcomes[:-1]] == ["skipped"] * 5
    result = outcome.result
    assert "quantized: reused the running kiln serve" in result.served
    assert "baseline: tritonserver here" in result.served and result.baseline_repo.endswith("tiny-llama.baseline")
    nextword, nextline, parting = result.tasks
    assert (nextword.name, nextword.samples, nextword.output_type) == ("kiln_tiny_python_nextword", 10, "generate_until")
    assert (nextline.name, nextline.samples, nextline.output_type) == ("kiln_tiny_python_nextline", 10,
                                                                       "multiple_choice")
    assert [g.passed for g in outcome.gates] == [True, True, True]
    # the parting prompts: the baseline is the unquantized model, the quantized side really is INT4 AWQ
    _, documents, parts = parting_task
    assert (parting.samples, parting.baseline) == (documents, 1.0)
    assert parting.quantized == pytest.approx((documents - parts) / documents, abs=1e-6)
    stored = json.loads((layout.build_root / "tiny-llama" / "tasks" / "tasks.json").read_text())
    assert [t["quantized"] for t in stored["tasks"]] == [nextword.quantized, nextline.quantized, parting.quantized]


def test_loglikelihoods_are_each_served_models_own(gate_run, hf_greedy):
    """What lm-eval scored through echo + token-id prompts is the log-probability Hugging Face computes with the
    unquantized model (baseline) and the ModelOpt-restored one (quantized), continuation cut where lm-eval cuts it."""
    import torch
    from tokenizers import Tokenizer

    _, layout, _ = gate_run
    task_dir = layout.build_root / "tiny-llama" / "tasks" / "lm_eval" / "1-tiny-python-nextline"
    doc = json.loads((task_dir / "data.jsonl").read_text().splitlines()[0])
    tok = Tokenizer.from_file(str(hf_greedy.tokenizer_file))
    bos = tok.token_to_id("<s>")
    for which, quantized in (("baseline", False), ("quantized", True)):
        served = [ll for ll, _ in json.loads((task_dir / f"{which}.samples.jsonl").read_text().splitlines()[0])["response"]]
        expected = []
        for choice in doc["choices"]:
            context = tok.encode(doc["context"], add_special_tokens=False).ids
            whole = tok.encode(doc["context"] + "\n" + choice, add_special_tokens=False).ids
            ids = [bos] + whole
            with torch.no_grad():
                logp = torch.log_softmax(hf_greedy._model(quantized)(torch.tensor([ids])).logits[0].float(), -1)
            expected.append(sum(logp[i - 1, ids[i]].item() for i in range(1 + len(context), len(ids))))
        assert served == pytest.approx(expected, rel=1e-4, abs=1e-3), which


def test_a_zero_threshold_where_the_models_part_fails_the_build_with_both_accuracies(gate_run, parting_task, kiln,
                                                                                       tmp_path):
    _, layout, _ = gate_run
    _, documents, parts = parting_task
    result = kiln("build", RECIPE, "--set", _tasks(parting_task[0], 0), "--set", GATE, "--build-dir",
                  layout.build_root, "--repo-dir", layout.repo_root, "--junit", tmp_path / "junit.xml")
    assert result.exit_code == 1, result.output
    quantized = (documents - parts) / documents
    assert f"exact_match 1.0000 unquantized → {quantized:.4f} quantized" in result.output
    assert "gate is 0 points: raise evaluation.tasks[2].max_accuracy_drop_pct" in result.output
    assert "tasks     skipped" in result.output  # a threshold is re-checked on the stored figures, nothing re-runs
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["task accuracy kiln_parting_prompts (evaluation.tasks[2].max_accuracy_drop_pct)"]
