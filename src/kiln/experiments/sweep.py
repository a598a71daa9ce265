"""`kiln sweep SWEEP.yaml`: run a matrix of recipe variants through the pipeline and compare them in one table.

A sweep names a base recipe and axes of `--set`-style overrides (or an explicit list of points). Every point is
validated before any runs; each runs through the normal pipeline, so cached steps are shared (points that differ
only in keys a step ignores reuse its output). Results: `build/sweeps/<name>/results.jsonl`, `results.csv`,
`results.md`, and PNG plots.

Where the points run is the sweep's `executor` (:mod:`kiln.experiments.executors`): here (`local`), as a Slurm
job array (:mod:`kiln.experiments.slurm`) or a Kubernetes Indexed Job (:mod:`kiln.experiments.kubernetes`); the
cluster executors share :mod:`kiln.experiments.tasks` (one task = one point, its result file, collecting).
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import itertools
import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.console import Console

from kiln.experiments.executors import Executor, KubernetesSettings, SlurmSettings, needs_gpu
from kiln.pipeline.fingerprint import digest
from kiln.pipeline.runner import Action, Layout, run, schedule
from kiln.steps.evaluate import EvaluateResult
from kiln.steps.tasks import TasksResult
from kiln.recipe.errors import Origin, Problem, RecipeError
from kiln.recipe.loader import LoadedRecipe, load_recipe, parse_override, read_yaml
from kiln.util.errors import KilnError

Measure = Literal["quality", "plan", "bench"]


class BenchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    concurrency: tuple[int, ...] = (1, 8)
    """Concurrency levels to measure per point."""
    duration_s: float = Field(20.0, gt=0)
    """Seconds per level."""
    input_len: int = Field(64, ge=1)
    """Synthetic prompt length (tokens, approximately)."""
    output_len: int = Field(32, ge=1)
    """Tokens generated per request."""


class SweepFile(BaseModel):
    """A sweep: a base recipe and the variants to run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: Optional[str] = None
    """Sweep name (default: the file's stem); results go to build/sweeps/<name>/."""
    base: str
    """Base recipe, relative to the sweep file."""
    set: dict[str, Any] = {}
    """Overrides applied to every point (dotted keys)."""
    axes: dict[str, list[Any]] = {}
    """Dotted recipe key → values; the matrix is their cartesian product."""
    points: list[dict[str, Any]] = []
    """An explicit list of points (dotted key → value), instead of or besides axes."""
    exclude: list[dict[str, Any]] = []
    """Points to leave out: each matches every point whose overrides include all its key/values."""
    measure: tuple[Measure, ...] = ("quality", "plan")
    """What to measure per point: quality (perplexity, KL), plan (memory, limits), bench (serve + benchmark)."""
    gpu: Optional[str] = None
    """GPU to plan for (default: each point's hardware.gpu; points without one get no plan)."""
    bench: BenchSettings = BenchSettings()
    """Benchmark settings, when measure includes bench."""
    executor: Executor = "local"
    """Where points run: `local` (here), `slurm` (a job array) or `kubernetes` (an Indexed Job)."""
    slurm: SlurmSettings = SlurmSettings()
    """Slurm settings, for `executor: slurm`."""
    kubernetes: KubernetesSettings = KubernetesSettings()
    """Kubernetes settings, for `executor: kubernetes`."""

    @model_validator(mode="after")
    def _something(self) -> "SweepFile":
        if not self.axes and not self.points:
            raise ValueError("a sweep needs `axes` or `points`")
        return self


@dataclass(frozen=True)
class Point:
    index: int
    overrides: dict[str, Any]

    @property
    def label(self) -> str:
        return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in self.overrides.items()) or "base"

    @property
    def slug(self) -> str:
        text = "-".join(str(v) for v in self.overrides.values()) or "base"
        short = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-")[:40]
        return f"{short}-{hashlib.sha256(json.dumps(self.overrides, sort_keys=True, default=str).encode()).hexdigest()[:6]}"


@dataclass
class Sweep:
    file: Path
    spec: SweepFile
    name: str
    base: Path
    points: list[Point]
    loaded: dict[int, LoadedRecipe] = field(default_factory=dict)


def _set_args(overrides: dict[str, Any]) -> list[str]:
    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in overrides.items()]


def expand(spec: SweepFile) -> list[Point]:
    """Cartesian product of the axes (in file order) plus explicit points, minus excludes, without duplicates."""
    raw: list[dict[str, Any]] = []
    if spec.axes:
        keys = list(spec.axes)
        for combo in itertools.product(*(spec.axes[k] for k in keys)):
            raw.append(dict(zip(keys, combo)))
    raw += [dict(p) for p in spec.points]
    out: list[Point] = []
    seen: set[str] = set()
    for overrides in raw:
        if any(all(overrides.get(k, object()) == v for k, v in ex.items()) for ex in spec.exclude):
            continue
        key = json.dumps(overrides, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(Point(len(out), overrides))
    return out


# Sweep keys whose own keys are dotted recipe keys: `--set set.evaluation.samples=4` sets the one key
# "evaluation.samples" under `set`, rather than a nested mapping.
_DOTTED_KEY_SECTIONS = ("set", "axes")


def apply_sweep_overrides(data: dict, origins: dict, overrides: tuple[str, ...]) -> dict:
    """`--set` on a sweep file: `slurm.partition=gpu`, `measure=[quality]`, `set.evaluation.samples=4`,
    `axes.quantization.format=[fp8, int8_sq]`. Values are YAML; each key's origin becomes its --set."""
    problems: list[Problem] = []
    data = copy.deepcopy(data) if data else {}
    for item in overrides:
        try:
            path, value = parse_override(item)
        except RecipeError as exc:
            problems.extend(exc.problems)
            continue
        raw = item.partition("=")[2].strip()
        if isinstance(value, int) and ":" in raw:
            value = raw  # YAML 1.1 reads 2:00:00 as the number 7200; a time limit means the text
        if path[0] in _DOTTED_KEY_SECTIONS and len(path) > 1:
            path = (path[0], ".".join(path[1:]))
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
        origins[path] = Origin(f"--set {'.'.join(path)}")
    if problems:
        raise RecipeError(problems)
    return data


def load_sweep(path: Path, layout: Layout, overrides: tuple[str, ...] = (), executor: Optional[str] = None) -> Sweep:
    """Read and validate a sweep and every one of its points, before any work. Raises RecipeError (all at once).

    `overrides` are `--set` items on the sweep file (they beat the file); `executor` (the `--executor` option)
    beats both."""
    data, origins = read_yaml(path)
    data = apply_sweep_overrides(data, origins, tuple(overrides))
    if executor is not None:
        data["executor"] = executor
        origins[("executor",)] = Origin("--executor")
    try:
        spec = SweepFile.model_validate(data)
    except ValidationError as exc:
        problems = []
        for e in exc.errors(include_url=False):
            loc = tuple(str(p) for p in e["loc"])
            origin = next((origins[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in origins), Origin(str(path)))
            problems.append(Problem("error", ".".join(loc), e["msg"].removeprefix("Value error, "), origin))
        raise RecipeError(problems) from None
    base = (path.parent / spec.base)
    if not base.is_file():
        raise RecipeError([Problem("error", "base", f"base recipe {spec.base} not found (looked for {base})",
                                   origins.get(("base",), Origin(str(path))), "base is relative to the sweep file")])
    name = spec.name or path.stem
    points = expand(spec)
    if not points:
        raise RecipeError([Problem("error", "exclude", "every point is excluded", Origin(str(path)))])
    sweep = Sweep(path, spec, name, base, points)
    problems: list[Problem] = []
    base_name = load_recipe(base, _set_args(spec.set), check_rules=False).recipe.name
    for point in points:
        args = _set_args({**spec.set, **point.overrides}) + [f"name={base_name}--{point.slug}"]
        try:
            sweep.loaded[point.index] = load_recipe(base, args)
        except RecipeError as exc:
            for p in exc.problems:
                key = p.key
                origin = origins.get(("axes", key)) or origins.get(("set", key)) or origins.get(("points",)) or p.origin
                problems.append(Problem(p.severity, key, f"point {point.index} ({point.label}): {p.message}",
                                        origin, p.hint))
    problems += _executor_problems(sweep, origins, Origin(str(path)))
    if problems:
        raise RecipeError(problems)
    return sweep


def _executor_problems(sweep: Sweep, origins: dict, file_origin: Origin) -> list[Problem]:
    """What a cluster executor needs that a local run does not."""
    spec = sweep.spec
    if spec.executor == "local":
        return []
    where = origins.get(("executor",), file_origin)
    problems = []
    for point in sweep.points:
        loaded = sweep.loaded.get(point.index)
        if loaded is not None and needs_gpu(loaded) and not loaded.recipe.hardware.gpu:
            problems.append(Problem(
                "error", "hardware.gpu",
                f"point {point.index} ({point.label}): executor {spec.executor} needs the GPU each point runs on: "
                "the submitting host is not the one that builds it, so kiln cannot detect it (and the engine's "
                "fingerprint covers it)", origins.get(("set", "hardware.gpu"), where),
                "declare it in the sweep's set: (e.g. hardware.gpu: H100-SXM), as an axis, or in the base recipe"))
    if spec.executor == "kubernetes" and not spec.kubernetes.image:
        problems.append(Problem("error", "kubernetes.image", "executor kubernetes needs the image the pods run",
                                origins.get(("kubernetes",), where),
                                "set kubernetes.image to an image holding kiln (e.g. --set kubernetes.image=…)"))
    return problems


def _plan_figures(loaded: LoadedRecipe, gpu_name: Optional[str]) -> Optional[dict]:
    from kiln.plan import PlanError, plan_for, plan_gpu, recipe_model_config

    try:
        gpu = plan_gpu(loaded, gpu_name)
    except PlanError:
        return None  # no GPU to plan for (the sweep validated the names it was given)
    if recipe_model_config(loaded) is None:
        return None
    try:
        p = plan_for(loaded, gpu)
    except PlanError as exc:
        return {"error": str(exc)}
    d = p.to_dict()
    weights = d.get("weights", {})
    kv = d.get("kv_cache", {})
    return {"gpu": gpu.name, "fits": p.fits, "verdict": p.verdict,
            "weight_bytes": weights.get("total_bytes", weights.get("bytes_per_gpu")),
            "weight_bytes_per_gpu": weights.get("bytes_per_gpu"),
            "kv_tokens": kv.get("tokens"), "max_sequences": kv.get("max_sequences"), "plan": d}


def _checkpoint_bytes(loaded: LoadedRecipe, layout: Layout) -> Optional[int]:
    """Bytes of the quantized weights: the TRT-LLM checkpoint if exported, else the reference checkpoint's
    real quantized footprint is not on disk (fake-quant), so None."""
    root = layout.build_dir(loaded.recipe.name) / "quantize" / "trtllm_checkpoint"
    files = list(root.glob("rank*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def last_step(spec: SweepFile, loaded: Optional[LoadedRecipe] = None) -> str:
    """The last pipeline step a point needs for the sweep's measures (the task gate's when the point has tasks)."""
    if loaded is not None and loaded.recipe.evaluation.tasks:
        return "tasks"
    return "package" if "bench" in spec.measure else "evaluate"


def point_fingerprint(loaded: LoadedRecipe, layout: Layout, spec: SweepFile) -> str:
    """One hash over the fingerprints of every step a point runs: equal fingerprints, equal results.
    Cheap (no model loading); raises KilnError where a step's inputs cannot be hashed."""
    steps = schedule(loaded, layout, to_step=last_step(spec, loaded))
    return digest({p.spec.name: p.fingerprint for p in steps if p.action != Action.OUTSIDE})


def point_key(loaded: LoadedRecipe, fingerprint: str) -> str:
    """A point's identity when resuming a sweep: its steps' fingerprint and its whole resolved recipe. Keys no step
    output depends on (a quality gate) still decide whether the point passes, so they are part of it."""
    from kiln.recipe.render import recipe_yaml

    return digest({"steps": fingerprint, "recipe": recipe_yaml(loaded.recipe)})


def run_point(point: Point, loaded: LoadedRecipe, layout: Layout, spec: SweepFile, progress: bool) -> dict:
    """Run one point's pipeline and measures; never raises (failures are recorded)."""
    to_step = last_step(spec, loaded)
    record: dict[str, Any] = {"point": point.index, "label": point.label, "overrides": point.overrides,
                              "recipe": loaded.recipe.name, "status": "ok"}
    try:
        record["fingerprint"] = point_fingerprint(loaded, layout, spec)
        record["key"] = point_key(loaded, record["fingerprint"])
        summary = run(loaded, layout, to_step=to_step, console=Console(stderr=True, quiet=not progress),
                      progress=progress)
        record["steps"] = {o.name: o.status.value for o in summary.outcomes}
        evaluate = next((o.result for o in summary.outcomes if isinstance(o.result, EvaluateResult)), None)
        if evaluate is not None and not evaluate.skipped:
            record["quality"] = {"base_perplexity": evaluate.base_perplexity,
                                 "quant_perplexity": evaluate.quant_perplexity,
                                 "ppl_increase_pct": evaluate.ppl_increase_pct, "mean_kl": evaluate.mean_kl}
        tasks = next((o.result for o in summary.outcomes if isinstance(o.result, TasksResult)), None)
        if tasks is not None and not tasks.skipped:
            record["tasks"] = tasks.figures()
        if summary.failure is not None:
            record.update(status="failed", error=str(summary.failure))
    except KilnError as exc:
        record.update(status="failed", error=str(exc))
    if "plan" in spec.measure:
        record["plan"] = _plan_figures(loaded, spec.gpu)
    record["checkpoint_bytes"] = _checkpoint_bytes(loaded, layout)
    return record


def bench_point(record: dict, loaded: LoadedRecipe, layout: Layout, spec: SweepFile) -> None:
    from kiln.serve.bench import BenchConfig, run_bench
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    repo = layout.repo_root / loaded.recipe.name
    ports = dict(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    try:
        with TritonServer(ServerConfig(repo=repo, **ports)) as server:
            server.start()
            report = run_bench(BenchConfig(url=f"127.0.0.1:{ports['grpc_port']}", concurrency=spec.bench.concurrency,
                                           duration_s=spec.bench.duration_s, input_len=spec.bench.input_len,
                                           output_len=spec.bench.output_len))
        record["bench"] = json.loads(report.to_json())
    except Exception as exc:  # noqa: BLE001 - a failed bench is recorded with the point, the sweep goes on
        record.update(status="failed", error=f"bench: {exc}")


def run_sweep(sweep: Sweep, layout: Layout, jobs: int = 1, console: Optional[Console] = None,
              progress: bool = True) -> list[dict]:
    """Run every point (reusing finished ones), write results, return the records."""
    console = console or Console(stderr=True)
    out_dir = layout.build_root / "sweeps" / sweep.name
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = _read_results(out_dir / "results.jsonl")
    records: dict[int, dict] = {}
    todo = list(sweep.points)
    console.print(f"sweep {sweep.name}: {len(sweep.points)} points, measures {', '.join(sweep.spec.measure)}")
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {p.index: pool.submit(run_point, p, sweep.loaded[p.index], layout, sweep.spec, False)
                       for p in todo}
            for index, fut in futures.items():
                records[index] = fut.result()
                console.print(f"  point {index}: {records[index]['status']}")
    else:
        for p in todo:
            console.print(f"[bold]point {p.index}/{len(sweep.points) - 1}[/]: {p.label}")
            records[p.index] = run_point(p, sweep.loaded[p.index], layout, sweep.spec, progress)
    if "bench" in sweep.spec.measure:
        for p in todo:
            rec = records[p.index]
            old = previous.get(rec.get("fingerprint"))
            if old and old.get("bench") and old.get("bench_settings") == sweep.spec.bench.model_dump(mode="json"):
                rec["bench"] = old["bench"]
            elif rec["status"] == "ok":
                bench_point(rec, sweep.loaded[p.index], layout, sweep.spec)
            rec["bench_settings"] = sweep.spec.bench.model_dump(mode="json")
    ordered = [records[p.index] for p in sweep.points]
    write_results(ordered, out_dir)
    return ordered


def _read_results(path: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("fingerprint"):
                out[rec["fingerprint"]] = rec
    return out


COLUMNS = ("point", "label", "status", "base_perplexity", "quant_perplexity", "ppl_increase_pct", "mean_kl", "weight_gib",
           "fits", "max_sequences", "steps_run", "task_accuracy", "max_task_drop_pts")


def table_rows(records: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        q = r.get("quality") or {}
        p = r.get("plan") or {}
        wb = p.get("weight_bytes") if isinstance(p, dict) else None
        steps = r.get("steps") or {}
        rows.append({"point": r["point"], "label": r["label"], "status": r["status"],
                     "base_perplexity": q.get("base_perplexity"), "quant_perplexity": q.get("quant_perplexity"),
                     "ppl_increase_pct": q.get("ppl_increase_pct"), "mean_kl": q.get("mean_kl"),
                     "weight_gib": None if wb is None else wb / 2**30,
                     "fits": p.get("fits") if isinstance(p, dict) else None,
                     "max_sequences": p.get("max_sequences") if isinstance(p, dict) else None,
                     "steps_run": sum(1 for s in steps.values() if s in ("ran", "reused")),
                     **_task_cells(r.get("tasks") or {})})
    return rows


def _task_cells(tasks: dict) -> dict[str, Any]:
    """The task gate's columns: each task's quantized accuracy (with the baseline's) and the largest drop."""
    if not tasks:
        return {"task_accuracy": None, "max_task_drop_pts": None}
    return {"task_accuracy": "; ".join(f"{name} {t['quantized']:.3f} (base {t['baseline']:.3f})"
                                       for name, t in tasks.items()),
            "max_task_drop_pts": max(t["drop_pts"] for t in tasks.values())}


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_results(records: list[dict], out_dir: Path) -> None:
    with open(out_dir / "results.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r, default=str) + "\n")
    rows = table_rows(records)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS))
    writer.writeheader()
    writer.writerows(rows)
    (out_dir / "results.csv").write_text(buf.getvalue())
    md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |" for row in rows]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    _plots(records, rows, out_dir)


def _plots(records: list[dict], rows: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["weight_gib"], r["ppl_increase_pct"], r["label"]) for r in rows
           if r["weight_gib"] is not None and r["ppl_increase_pct"] is not None]
    if pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for x, y, label in pts:
            ax.scatter(x * 1024, y)
            ax.annotate(label, (x * 1024, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("planned weight size (MiB)")
        ax.set_ylabel("perplexity increase (%)")
        ax.set_title("quality vs weight size")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "quality_vs_size.png", dpi=110)
        plt.close(fig)
    benched = [r for r in records if r.get("bench")]
    if benched:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in benched:
            # one point per level: the bench report's level fields (kiln.serve.bench.LevelResult)
            pts = [(lv["e2e_p50_ms"], lv["output_tokens_per_s"]) for lv in r["bench"].get("levels", [])
                   if lv.get("e2e_p50_ms") is not None and lv.get("output_tokens_per_s") is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=r["label"])
        ax.set_xlabel("end-to-end latency p50 (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("throughput vs latency")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_latency.png", dpi=110)
        plt.close(fig)


def render_table(records: list[dict], console: Console) -> None:
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for c in COLUMNS:
        table.add_column(c)
    for row in table_rows(records):
        table.add_row(*(_cell(row[c]) for c in COLUMNS))
    console.print(table)


def check_failures(records: list[dict]) -> Optional[KilnError]:
    failed = [r for r in records if r["status"] != "ok"]
    if not failed:
        return None
    return KilnError(f"{len(failed)} of {len(records)} points failed: "
                     + "; ".join(f"point {r['point']} ({r['label']}): {r.get('error', '')[:200]}" for r in failed))


