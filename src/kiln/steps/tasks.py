"""The tasks step: the task-accuracy gate — what quantization cost on lm-eval tasks, against the served models.

After ``package``, for the recipe's ``evaluation.tasks``:

1. every task is written into the step's output as an lm-eval task directory (``lm_eval/<n>-<name>/``: the task YAML
   with its data files beside it — a built-in task made from text that ships with Python, or a copy of the user's
   YAML and local data files, hashed into the fingerprint);
2. the packaged repository and the unquantized **baseline** (the same recipe with ``quantization.format: none``,
   ``kv_cache: none``, no quality gate and no tasks: the runner builds it up to ``package`` under the name
   ``<recipe>.baseline``, once, and reuses it by its fingerprint) are served — a running ``kiln serve --openai``
   of the same repository is reused; otherwise the CPU reference target's tritonserver here, or the engine in its
   NGC image on a GPU host — with kiln's OpenAI-compatible server in front (:mod:`kiln.serve.endpoint`);
3. lm-eval's ``local-completions`` model runs each task against both endpoints with the served repository's
   tokenizer (no hub access: ``HF_HUB_OFFLINE``), ``evaluation.task_defaults.concurrency`` requests in flight;
4. per task, the first metric of its ``metric_list`` (accuracy, 0–1) for both models and the drop in percentage
   points go to ``tasks.json``, a table, the build summary and one JUnit case per task.

The thresholds (``max_accuracy_drop_pct``) are outside the fingerprint: changing one re-checks the stored figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml
from pydantic import BaseModel, ConfigDict

from kiln.models.tasks import builtin_task_hash, write_builtin_task
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import BUILTIN_PREFIX, Recipe, TaskEntry
from kiln.steps.base import Gate, StepContext, StepResult, StepSpec
from kiln.util.errors import InputError, KilnError

TASKS_FILE = "tasks.json"
TASKS_DIR = "lm_eval"
BASELINE_SUFFIX = ".baseline"
#: lm-eval dataset loaders that read local files (anything else would reach for the hub).
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")
LM_EVAL = "lm-eval"
LM_EVAL_PIN = "0.4.13"


class TaskFigures(BaseModel):
    """One task's figures: its first metric for the unquantized baseline and the quantized model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    """The recipe's `evaluation.tasks[i].task`."""
    name: str
    """lm-eval's task name."""
    output_type: str
    metric: str
    samples: int
    baseline: float
    quantized: float
    drop_pts: float
    """baseline − quantized, in percentage points of accuracy (positive: quantization lost accuracy)."""


class TasksResult(StepResult):
    skipped: bool = False
    tasks: tuple[TaskFigures, ...] = ()
    served: Optional[str] = None
    """How the two models were served (for the record: reused server, tritonserver here, container)."""
    baseline_repo: Optional[str] = None
    lm_eval: Optional[str] = None
    seconds: Optional[float] = None

    def figures(self) -> dict:
        """Per task: baseline and quantized accuracy and the drop (sweep tables' task-accuracy columns)."""
        return {t.name: {"metric": t.metric, "baseline": t.baseline, "quantized": t.quantized, "drop_pts": t.drop_pts}
                for t in self.tasks}


# --------------------------------------------------------------------------------------------- tasks as inputs


class _Function(str):
    """A `!function module.name` value of an lm-eval task YAML, kept as written."""


class _TaskLoader(yaml.SafeLoader):
    pass


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
_TaskDumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


@dataclass(frozen=True)
class TaskFiles:
    """A user's task YAML read and checked: its parsed config and the local files it needs (data, helpers)."""

    yaml_path: Path
    config: dict
    data: dict[str, list[Path]]
    """data_files by split, resolved against the YAML's directory."""
    helpers: tuple[Path, ...]
    """Python files its `!function` values name."""


def _key(i: int) -> str:
    return f"evaluation.tasks[{i}].task"


def read_task_yaml(path: Path, key: str) -> TaskFiles:
    """Parse and check a user's lm-eval task YAML (every problem at once, naming the file and recipe key)."""
    if not path.is_file():
        raise InputError(f"{key}: task YAML {str(path)!r} not found (looked for {path.absolute()})")
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InputError(f"{key}: {path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise InputError(f"{key}: {path} is not an lm-eval task (a mapping with task, dataset_path, …)")
    problems: list[str] = []
    if not isinstance(config.get("task"), str):
        problems.append("`task` must be one task name (groups and task lists are not supported: one YAML per task)")
    for unsupported in ("include", "group", "task_list"):
        if unsupported in config:
            problems.append(f"`{unsupported}` is not supported: write the task in one YAML")
    loader = config.get("dataset_path")
    if loader not in LOCAL_LOADERS:
        problems.append(f"dataset_path {loader!r} would load from the hub; use a local loader ({', '.join(LOCAL_LOADERS)}) "
                        "with dataset_kwargs.data_files")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    data: dict[str, list[Path]] = {}
    if isinstance(files, (str, list)):
        files = {"train": files}
    if not isinstance(files, dict) or not files:
        problems.append("dataset_kwargs.data_files must name the local data files (a path, a list, or split: path)")
    else:
        for split, value in files.items():
            paths = [value] if isinstance(value, str) else value if isinstance(value, list) else None
            if not paths or not all(isinstance(p, str) for p in paths):
                problems.append(f"dataset_kwargs.data_files.{split} must be a path or a list of paths")
                continue
            resolved = [(path.parent / p) if not Path(p).is_absolute() else Path(p) for p in paths]
            for p in resolved:
                if not p.is_file():
                    problems.append(f"data file {str(p)!r} (dataset_kwargs.data_files.{split}) not found")
            data[str(split)] = resolved
    helpers = []
    for value in _functions(config):
        module = value.rsplit(".", 1)[0]
        helper = path.parent / (module.replace(".", "/") + ".py")
        if not helper.is_file():
            problems.append(f"!function {value}: {helper} not found (helpers must sit beside the YAML)")
        else:
            helpers.append(helper)
    if problems:
        raise InputError(f"{key}: {path}:\n  " + "\n  ".join(problems))
    return TaskFiles(path, config, data, tuple(sorted(set(helpers))))


def _functions(value: Any) -> Iterator[_Function]:
    if isinstance(value, _Function):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _functions(v)
    elif isinstance(value, list):
        for v in value:
            yield from _functions(v)


def _file_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def task_settings(recipe: Recipe, entry: TaskEntry) -> tuple[Optional[int], int, Optional[float]]:
    """(limit, num_fewshot, max_accuracy_drop_pct) of a task: its own, else evaluation.task_defaults'."""
    d = recipe.evaluation.task_defaults
    limit = entry.limit if entry.limit is not None else d.limit
    fewshot = entry.num_fewshot if entry.num_fewshot is not None else d.num_fewshot
    drop = entry.max_accuracy_drop_pct if entry.max_accuracy_drop_pct is not None else d.max_accuracy_drop_pct
    return limit, fewshot, drop


def tasks_input_hashes(loaded: LoadedRecipe) -> dict[str, str]:
    """Each task's content (YAML, data files, helpers; a built-in task's items) and its limit and few-shot count.
    The thresholds are not here: they are re-checked on the stored figures."""
    r = loaded.recipe
    out: dict[str, str] = {}
    problems: list[str] = []
    for i, entry in enumerate(r.evaluation.tasks):
        limit, fewshot, _ = task_settings(r, entry)
        try:
            if entry.task.startswith(BUILTIN_PREFIX):
                content = builtin_task_hash(entry.task[len(BUILTIN_PREFIX):])
            else:
                files = read_task_yaml(Path(entry.task).expanduser(), _key(i))
                content = _file_hash([files.yaml_path, *[p for ps in files.data.values() for p in ps], *files.helpers])
        except InputError as exc:
            problems.append(str(exc))
            continue
        out[f"task[{i}]"] = f"{entry.task} limit={limit} num_fewshot={fewshot} {content}"
    if problems:
        raise InputError("\n".join(problems))
    return out


@dataclass(frozen=True)
class Prepared:
    entry: TaskEntry
    directory: Path
    name: str
    output_type: str
    metric: str


def prepare_task(i: int, entry: TaskEntry, into: Path) -> Prepared:
    """The task as an lm-eval task directory under ``into`` (YAML + data files, paths rewritten to the copies)."""
    if entry.task.startswith(BUILTIN_PREFIX):
        builtin = entry.task[len(BUILTIN_PREFIX):]
        directory = into / f"{i}-{builtin}"
        yaml_path = write_builtin_task(builtin, directory)
        config = yaml.load(yaml_path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506
    else:
        files = read_task_yaml(Path(entry.task).expanduser(), _key(i))
        config = dict(files.config)
        directory = into / f"{i}-{config['task']}"
        (directory / "data").mkdir(parents=True)
        data_files: dict[str, list[str]] = {}
        for split, paths in files.data.items():
            for n, p in enumerate(paths):
                copy = directory / "data" / f"{split}-{n}-{p.name}"
                shutil.copyfile(p, copy)
                data_files.setdefault(split, []).append(str(copy.resolve()))
        for helper in files.helpers:
            shutil.copyfile(helper, directory / helper.name)
        config["dataset_kwargs"] = {**config.get("dataset_kwargs", {}), "data_files": data_files}
        (directory / "task.yaml").write_text(yaml.dump(config, Dumper=_TaskDumper, sort_keys=False), encoding="utf-8")
    metrics = config.get("metric_list") or []
    output_type = str(config.get("output_type") or "generate_until")
    metric = (metrics[0].get("metric") if metrics and isinstance(metrics[0], dict) else None) or (
        "exact_match" if output_type == "generate_until" else "acc")
    return Prepared(entry, directory, str(config["task"]), output_type, str(metric))


# --------------------------------------------------------------------------------------------- the baseline


def baseline_recipe(loaded: LoadedRecipe) -> Optional[LoadedRecipe]:
    """The unquantized baseline the task gate compares with (None when the recipe has no tasks): the same recipe
    with quantization.format none and kv_cache none, no quality gate and no tasks, named ``<recipe>.baseline``."""
    r = loaded.recipe
    if not r.evaluation.tasks:
        return None
    derived = r.model_copy(update={
        "name": r.name + BASELINE_SUFFIX,
        "quantization": r.quantization.model_copy(update={"format": "none", "kv_cache": "none"}),
        "evaluation": r.evaluation.model_copy(update={"enabled": False, "tasks": ()}),
    })
    return LoadedRecipe(derived, loaded.path, {}, (), loaded.overrides)


# --------------------------------------------------------------------------------------------- running lm-eval


def _lm_eval_version() -> str:
    """lm-eval's version, checked before anything is served: it and its API models' packages must be installed."""
    from importlib import metadata
    from importlib.util import find_spec

    fix = (f"install kiln's `eval` extra (lm-eval[api]=={LM_EVAL_PIN}: pip install -e '.[eval]'; `make` does), or "
           "leave evaluation.tasks empty")
    try:
        version = metadata.version(LM_EVAL)
    except metadata.PackageNotFoundError:
        raise KilnError(f"the task gate needs lm-eval {LM_EVAL_PIN} (evaluation.tasks is set): {fix}") from None
    missing = [m for m in ("tenacity", "aiohttp", "requests") if find_spec(m) is None]
    if missing:
        raise KilnError(f"lm-eval's local-completions model needs {', '.join(missing)}: {fix}")
    return version


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub: lm-eval and transformers read only local files while the tasks run."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "1" for n in names})
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def tokenizer_dir(repo: Path) -> Path:
    """The served repository's tokenizer (what lm-eval counts and cuts tokens with)."""
    for candidate in (repo / "preprocessing" / "1" / "tokenizer", repo / "tensorrt_llm" / "1" / "checkpoint"):
        if (candidate / "tokenizer.json").is_file() or (candidate / "tokenizer_config.json").is_file():
            return candidate
    raise KilnError(f"{repo} holds no tokenizer (preprocessing/1/tokenizer): package the recipe again")


def run_lm_eval(task: Prepared, url: str, model: str, tokenizer: Path, limit: Optional[int], fewshot: int,
                concurrency: int, max_length: int, add_bos: bool, samples_file: Path) -> tuple[float, int]:
    """lm-eval's ``local-completions`` on one task against one OpenAI endpoint: (the task's metric, documents)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    loglikelihood = task.output_type != "generate_until"
    model_args = {
        "model": model, "base_url": f"{url}/completions", "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface", "num_concurrent": concurrency, "max_retries": 1, "timeout": 600,
        "max_length": max_length, "max_gen_toks": 256,
        # loglikelihood: token ids, so the scored continuation is cut exactly where lm-eval cut it; generation: text,
        # tokenized by the server as every client's text is
        "tokenized_requests": loglikelihood, "add_bos_token": add_bos and loglikelihood,
    }
    with _offline():
        out = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=[task.name], num_fewshot=fewshot, limit=limit,
            task_manager=TaskManager(include_path=str(task.directory), include_defaults=False),
            log_samples=True, bootstrap_iters=0, random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234,
            fewshot_random_seed=1234)
    if not out or task.name not in out.get("results", {}):
        raise KilnError(f"lm-eval returned no result for {task.name}")
    figures = out["results"][task.name]
    value = next((v for k, v in figures.items() if k.split(",")[0] == task.metric and isinstance(v, (int, float))),
                 None)
    if value is None:
        raise KilnError(f"lm-eval's result for {task.name} has no {task.metric}: {sorted(figures)}")
    samples = out.get("samples", {}).get(task.name, [])
    samples_file.write_text("".join(json.dumps({"doc_id": s.get("doc_id"), "target": s.get("target"),
                                                "response": s.get("filtered_resps"), task.metric: s.get(task.metric)},
                                               default=str) + "\n" for s in samples), encoding="utf-8")
    return float(value), len(samples)


def _enter_together(cms: list, stack: contextlib.ExitStack) -> list:
    """Enter context managers in parallel threads (two servers start at once); all are exited by ``stack``."""
    with ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
    values, error = [], None
    for cm, fut in zip(cms, futures):
        try:
            values.append(fut.result())
            stack.push(cm.__exit__)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others are registered for exit
            error = error or exc
    if error is not None:
        raise error
    return values


def run_tasks(ctx: StepContext) -> TasksResult:
    started = time.perf_counter()
    r = ctx.recipe
    out = Path(ctx.out_dir)
    if not r.evaluation.tasks:
        (out / TASKS_FILE).write_text(json.dumps({"skipped": True, "reason": "evaluation.tasks is empty"}) + "\n")
        return TasksResult(summary="no tasks (evaluation.tasks empty): no task gate", skipped=True)
    version = _lm_eval_version()
    from kiln.recipe.schema import gpu_here
    from kiln.serve.endpoint import openai_endpoint

    prepared = [prepare_task(i, e, out / TASKS_DIR) for i, e in enumerate(r.evaluation.tasks)]
    repo, base_repo = Path(ctx.inputs["package"]), ctx.derived.get("baseline")
    if base_repo is None:
        raise KilnError("the tasks step needs the unquantized baseline's repository (the runner builds it)")
    tokenizer = tokenizer_dir(repo)
    max_length = int(r.engine.max_input_len)
    concurrency = r.evaluation.task_defaults.concurrency
    logs = out / "logs"
    model = r.serving.openai_model
    figures: list[TaskFigures] = []
    served: list[str] = []
    from kiln.runtime.engine_runtime import engine_runtime_for

    rt = engine_runtime_for(r, ctx.build_root)  # a GPU repository is served by the engine its jobs ran in
    engine = {"engine": getattr(rt, "engine", None), "exe": getattr(rt, "exe", None)}
    with contextlib.ExitStack() as stack:
        with ctx.status("serving the quantized model and the unquantized baseline"):
            quant_ep, base_ep = _enter_together(
                [openai_endpoint(repo, ctx.build_root / ".serve", logs, gpu_here(), model, note=ctx.log, **engine),
                 openai_endpoint(base_repo, ctx.build_root / ".serve", logs, gpu_here(), model, note=ctx.log,
                                 **engine)], stack)
        served = [f"quantized: {quant_ep.how}", f"baseline: {base_ep.how}"]
        runs = [(t, which, ep) for t in prepared for which, ep in (("baseline", base_ep), ("quantized", quant_ep))]
        scores: dict[tuple[str, str], tuple[float, int]] = {}
        for t, which, ep in runs:
            limit, fewshot, _ = task_settings(r, t.entry)
            t0 = time.perf_counter()
            with ctx.status(f"lm-eval {t.name} ({t.output_type}) on the {which} model"):
                try:
                    scores[(t.name, which)] = run_lm_eval(
                        t, ep.url, ep.model, tokenizer, limit, fewshot, concurrency, max_length,
                        r.serving.add_special_tokens, t.directory / f"{which}.samples.jsonl")
                except KilnError:
                    raise
                except Exception as exc:  # noqa: BLE001 - lm-eval's and the endpoint's failures, named, no traceback
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise KilnError(f"lm-eval failed on {t.name} ({t.output_type}) against the {which} model at "
                                    f"{ep.url}: {type(exc).__name__}: {first[:500]}; the servers' logs are in "
                                    f"{ctx.final_dir or out}/logs") from exc
            value, n = scores[(t.name, which)]
            ctx.log(f"  {t.name} on the {which} model: {t.metric} {value:.4f} over {n} documents "
                    f"({time.perf_counter() - t0:.1f} s)")
    for t in prepared:
        (b, n), (q, _) = scores[(t.name, "baseline")], scores[(t.name, "quantized")]
        figures.append(TaskFigures(task=t.entry.task, name=t.name, output_type=t.output_type, metric=t.metric,
                                   samples=n, baseline=round(b, 6), quantized=round(q, 6),
                                   drop_pts=round((b - q) * 100.0, 4)))
    seconds = round(time.perf_counter() - started, 3)
    result = TasksResult(
        summary="; ".join(f"{f.name} {f.metric} {f.baseline:.3f} → {f.quantized:.3f} ({-f.drop_pts:+.1f} pts)"
                          for f in figures),
        tasks=tuple(figures), served="; ".join(served), baseline_repo=str(base_repo), lm_eval=version, seconds=seconds)
    (out / TASKS_FILE).write_text(json.dumps({"skipped": False, **result.model_dump(exclude={"summary", "skipped"}),
                                              "gate": [g.message for g in task_gates(r, result)]}, indent=2) + "\n")
    _print_table(ctx, r, result)
    return result


# --------------------------------------------------------------------------------------------- the gate


def _threshold_key(recipe: Recipe, i: int) -> str:
    entry = recipe.evaluation.tasks[i]
    return (f"evaluation.tasks[{i}].max_accuracy_drop_pct" if entry.max_accuracy_drop_pct is not None
            else "evaluation.task_defaults.max_accuracy_drop_pct")


def task_gates(recipe: Recipe, result: TasksResult) -> list[Gate]:
    """One criterion per task: its accuracy drop from the baseline against its threshold, with both accuracies."""
    gates = []
    for i, entry in enumerate(recipe.evaluation.tasks):
        key = _threshold_key(recipe, i)
        _, _, limit_pts = task_settings(recipe, entry)
        fig = result.tasks[i] if i < len(result.tasks) and result.tasks[i].task == entry.task else None
        name = f"task accuracy {fig.name if fig else entry.task}"
        if fig is None:
            gates.append(Gate(name, key, None, "no figure (the task gate did not run)"))
            continue
        figures = (f"{fig.metric} {fig.baseline:.4f} unquantized → {fig.quantized:.4f} quantized "
                   f"(drop {fig.drop_pts:.2f} points, {fig.samples} documents)")
        if limit_pts is None:
            gates.append(Gate(name, key, None, f"{figures}; gate off ({key} empty)"))
        elif fig.drop_pts > limit_pts + 1e-9:
            gates.append(Gate(name, key, False, f"{fig.name}: {figures}, gate is {limit_pts:g} points: raise {key} "
                                                f"or pick a gentler format"))
        else:
            gates.append(Gate(name, key, True, f"{figures}, gate is {limit_pts:g} points"))
    return gates


def check_task_gate(recipe: Recipe, result: TasksResult) -> Optional[str]:
    return "; ".join(g.message for g in task_gates(recipe, result) if g.passed is False) or None


def _print_table(ctx: StepContext, recipe: Recipe, result: TasksResult) -> None:
    from rich.table import Table

    table = Table(title="task accuracy: unquantized baseline vs quantized (lm-eval local-completions)",
                  title_justify="left")
    for col, justify in (("task", "left"), ("metric", "left"), ("docs", "right"), ("unquantized", "right"),
                         ("quantized", "right"), ("drop (pts)", "right"), ("gate", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for fig, gate in zip(result.tasks, task_gates(recipe, result)):
        _, _, limit_pts = task_settings(recipe, recipe.evaluation.tasks[result.tasks.index(fig)])
        mark = "" if gate.passed is None else " ✓" if gate.passed else " ✗"
        table.add_row(fig.name, fig.metric, str(fig.samples), f"{fig.baseline:.4f}", f"{fig.quantized:.4f}",
                      f"{fig.drop_pts:+.2f}", (f"≤ {limit_pts:g}" if limit_pts is not None else "-") + mark)
    ctx.console.print(table)


def describe(loaded: LoadedRecipe, build_root: Path = Path("build")) -> list[str]:
    r = loaded.recipe
    if not r.evaluation.tasks:
        return ["no tasks (evaluation.tasks empty): no task gate"]
    names = ", ".join(e.task for e in r.evaluation.tasks)
    return [f"lm-eval {LM_EVAL_PIN} local-completions: {names}", f"against the served {r.name} and its unquantized "
            f"baseline {r.name}{BASELINE_SUFFIX} (built up to package under {build_root / '.baselines'})"]


SPEC = StepSpec(
    name="tasks",
    fn=run_tasks,
    result=TasksResult,
    keys=("evaluation.task_defaults", "engine.max_input_len", "serving.add_special_tokens", "serving.openai_model"),
    ignore=("evaluation.task_defaults.max_accuracy_drop_pct",),
    after=("package",),
    tools=(LM_EVAL,),
    input_hashes=tasks_input_hashes,
    derived=baseline_recipe,
    describe=describe,
    files=(TASKS_FILE,),
    check=check_task_gate,
    gates=task_gates,
)
