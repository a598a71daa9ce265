"""Running a sweep on a cluster: decide which points to submit, write and submit them, wait, collect.

``kiln sweep SWEEP.yaml --executor slurm|kubernetes`` (:func:`submit_sweep`) and ``kiln sweep collect``
(:func:`collect_sweep`). The files involved and why no cross-node lock is needed: :mod:`kiln.experiments.tasks`.
"""

from __future__ import annotations

import collections
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from rich.console import Console

from kiln.experiments import kubernetes, slurm
from kiln.experiments.executors import gpus_for
from kiln.experiments.sweep import Point, Sweep, point_fingerprint, point_key, write_results
from kiln.experiments.tasks import (
    NO_RESULT,
    PointId,
    Slot,
    TaskFile,
    TaskPoint,
    collect_records,
    done_records,
    is_done,
    latest_slots,
    next_submission_id,
    read_json,
    record_path,
    summarize,
    sweep_dir,
    write_json_atomic,
)
from kiln.pipeline.runner import Layout
from kiln.recipe.render import recipe_yaml
from kiln.util.errors import InputError, KilnError


def point_ids(sweep: Sweep, layout: Layout) -> dict[int, PointId]:
    """Every point's fingerprint and key (cheap: no model is loaded)."""
    out: dict[int, PointId] = {}
    problems = []
    for p in sweep.points:
        loaded = sweep.loaded[p.index]
        try:
            fp = point_fingerprint(loaded, layout, sweep.spec)
            out[p.index] = PointId(fp, point_key(loaded, fp))
        except KilnError as exc:
            problems.append(f"point {p.index} ({p.label}): {exc}")
    if problems:
        raise InputError("cannot fingerprint every point: " + "; ".join(problems))
    return out


def _bench(sweep: Sweep) -> Optional[dict]:
    return sweep.spec.bench.model_dump(mode="json") if "bench" in sweep.spec.measure else None


def _states(sweep: Sweep, slots: dict[str, Slot], wanted: set[str]) -> Callable[[Slot], Optional[str]]:
    """The scheduler's view of tasks (Slurm: squeue, asked only when a point has a task); Kubernetes: none."""
    if sweep.spec.executor != "slurm" or not any(slots.get(fp) for fp in wanted):
        return lambda slot: None
    states = slurm.queue_states()
    return lambda slot: slurm.slot_state(states, slot)


def _task_files(sweep: Sweep, todo: list[Point], ids: dict[int, PointId], submission: str, build_root: str,
                repo_root: str, write_log: bool) -> list[TaskFile]:
    """One task file per GPU count (a job array / Job gives every task the same resources), in point order."""
    groups: dict[int, list[Point]] = collections.defaultdict(list)
    for p in todo:
        groups[gpus_for(sweep.loaded[p.index])].append(p)
    spec = sweep.spec.model_dump(mode="json")
    tasks = []
    for g, gpus in enumerate(sorted(groups)):
        points = [TaskPoint(point=p.index, label=p.label, overrides=p.overrides,
                            recipe=sweep.loaded[p.index].recipe.name, fingerprint=ids[p.index].fingerprint,
                            key=ids[p.index].key, gpus=gpus,
                            recipe_yaml=recipe_yaml(sweep.loaded[p.index].recipe, skip=("extends",)))
                  for p in groups[gpus]]
        tasks.append(TaskFile(sweep=sweep.name, submission=submission, group=g, executor=sweep.spec.executor,
                              build_root=build_root, repo_root=repo_root, write_log=write_log, sweep_spec=spec,
                              points=points))
    return tasks


def submit_sweep(sweep: Sweep, layout: Layout, *, dry_run: bool, wait: bool, console: Console,
                 out: Console) -> Optional[list[dict]]:
    """Submit the points without a result that are not already queued or running; with `wait` (Slurm), show
    progress until none is, then collect. Returns the collected records (None when it did not wait)."""
    spec = sweep.spec
    state = sweep_dir(layout.build_root, sweep.name)
    ids = point_ids(sweep, layout)
    done = done_records(state)
    bench = _bench(sweep)
    slots = latest_slots(state)
    keys = {i.key for i in ids.values()}
    unfinished = {k for k in keys if not is_done(done.get(k), bench)}
    task_state = _states(sweep, slots, unfinished)
    in_flight = {k for k in unfinished if k in slots and task_state(slots[k]) is not None}
    todo, seen = [], set()
    for p in sweep.points:
        key = ids[p.index].key
        if key in unfinished and key not in in_flight and key not in seen:
            seen.add(key)
            todo.append(p)
    n_done = len(keys - unfinished)
    console.print(f"sweep {sweep.name} ({spec.executor}): {len(sweep.points)} points — {n_done} done, "
                  f"{len(in_flight)} queued or running, {len(todo)} to submit")
    if todo:
        submission = next_submission_id(state)
        sub_dir = state / "submissions" / submission
        if spec.executor == "slurm":
            _submit_slurm(sweep, todo, ids, submission, sub_dir, layout, dry_run, console, out)
        else:
            _render_kubernetes(sweep, todo, ids, submission, sub_dir, dry_run, console, out)
    if dry_run or spec.executor == "kubernetes":
        return None
    if not wait:
        if todo:
            console.print(f"submitted; gather the results with: kiln sweep collect {sweep.file}"
                          + (f" --build-dir {layout.build_root}" if str(layout.build_root) != "build" else ""))
        return None
    try:
        wait_slurm(sweep, layout, ids, console)
    except KeyboardInterrupt:
        console.print(f"stopped waiting; the jobs keep running (scancel stops them). Gather the results with: "
                      f"kiln sweep collect {sweep.file}")
        raise
    return collect_sweep(sweep, layout, wait=False, console=console, ids=ids)


def _submit_slurm(sweep: Sweep, todo: list[Point], ids: dict[int, PointId], submission: str, sub_dir: Path,
                  layout: Layout, dry_run: bool, console: Console, out: Console) -> None:
    settings = sweep.spec.slurm
    tasks = _task_files(sweep, todo, ids, submission, str(layout.build_root.resolve()),
                        str(layout.repo_root.resolve()), write_log=False)
    abs_sub = sub_dir.resolve()
    scripts = []
    for task in tasks:
        loaded = [sweep.loaded[tp.point] for tp in task.points]
        task_path = abs_sub / f"task-{task.group}.json"
        scripts.append((task, task_path, slurm.render_sbatch(task, task_path, abs_sub, settings, Path.cwd(), loaded)))
    if dry_run:
        for task, _, script in scripts:
            out.print(f"# --- {abs_sub / f'job-{task.group}.sbatch'} (not written: --dry-run)", markup=False)
            out.print(script, markup=False, highlight=False, end="")
        return
    (sub_dir / "logs").mkdir(parents=True, exist_ok=True)
    info = {"id": submission, "executor": "slurm", "created": datetime.now(timezone.utc).isoformat(),
            "cwd": str(Path.cwd()), "jobs": {}}
    for task, task_path, script in scripts:
        write_json_atomic(task_path, task.model_dump(mode="json"))
        for tp in task.points:
            recipe = sub_dir / "recipes" / f"{tp.recipe}.yaml"
            recipe.parent.mkdir(parents=True, exist_ok=True)
            recipe.write_text(tp.recipe_yaml)
        script_path = sub_dir / f"job-{task.group}.sbatch"
        script_path.write_text(script)
    for task, _, _ in scripts:
        job_id = slurm.submit(sub_dir / f"job-{task.group}.sbatch")
        info["jobs"][str(task.group)] = job_id
        write_json_atomic(sub_dir / "submission.json", info)
        gpus = task.points[0].gpus
        console.print(f"submitted job array {job_id}: {len(task.points)} point(s)"
                      + (f", {gpus} GPU(s) each" if gpus else "") + f" — logs in {sub_dir / 'logs'}")


def _render_kubernetes(sweep: Sweep, todo: list[Point], ids: dict[int, PointId], submission: str, sub_dir: Path,
                       dry_run: bool, console: Console, out: Console) -> None:
    settings = sweep.spec.kubernetes
    tasks = _task_files(sweep, todo, ids, submission, kubernetes.BUILD_DIR, kubernetes.REPO_DIR, write_log=True)
    objects = kubernetes.render_objects(tasks, settings)
    header = (f"# kiln sweep {sweep.name}, submission {submission}: {len(todo)} point(s) as Kubernetes Indexed "
              "Job(s).\n# Written by kiln; apply with kubectl apply -f this file. Pod i runs point i of its task "
              f"file;\n# results land on the PVC {settings.pvc} under build/sweeps/{sweep.name}/.\n")
    path = sub_dir / "job.yaml"
    if dry_run:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            problems = kubernetes.write_manifest(Path(tmp) / "job.yaml", objects, header)
            out.print((Path(tmp) / "job.yaml").read_text(), markup=False, highlight=False, end="")
    else:
        problems = kubernetes.write_manifest(path, objects, header)
        for task in tasks:
            write_json_atomic(sub_dir / f"task-{task.group}.json", task.model_dump(mode="json"))
        write_json_atomic(sub_dir / "submission.json", {
            "id": submission, "executor": "kubernetes", "created": datetime.now(timezone.utc).isoformat(),
            "jobs": {str(t.group): kubernetes.object_name(t.sweep, t.submission, t.group) for t in tasks}})
    if problems:
        raise KilnError("the generated Kubernetes manifest does not validate (a kiln bug): " + "; ".join(problems))
    if not dry_run:
        console.print(f"wrote {path} ({len(tasks)} Indexed Job(s), validated offline). kiln does not talk to the "
                      f"cluster; apply it with:\n  kubectl apply -f {path}\nthen, with the PVC "
                      f"{settings.pvc} mounted or copied here: kiln sweep collect {sweep.file} --executor "
                      "kubernetes --build-dir <PVC>/build")


def wait_slurm(sweep: Sweep, layout: Layout, ids: dict[int, PointId], console: Console) -> None:
    """Show progress (squeue, and the records the tasks write) until no point of the sweep is queued or running."""
    state = sweep_dir(layout.build_root, sweep.name)
    wanted = {i.key for i in ids.values()}
    last = ""
    while True:
        slots = latest_slots(state)
        states = slurm.queue_states()
        counts: collections.Counter[str] = collections.Counter()
        in_flight = 0
        for key in wanted:
            slot = slots.get(key)
            now = slurm.slot_state(states, slot) if slot is not None else None
            if now is not None:
                counts[now.lower()] += 1
                in_flight += 1
                continue
            record = read_json(record_path(state, key))
            counts[record.get("status", "?") if record else "ended" if slot else "not submitted"] += 1
        line = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        if line != last:
            console.print(f"  slurm: {line}")
            last = line
        if not in_flight:
            return
        time.sleep(sweep.spec.slurm.poll_s)


def collect_sweep(sweep: Sweep, layout: Layout, *, wait: bool, console: Console,
                  ids: Optional[dict[int, PointId]] = None) -> list[dict]:
    """Gather every point's result into results.jsonl/csv/md and the plots; with `wait` (Slurm), wait first."""
    ids = ids or point_ids(sweep, layout)
    state = sweep_dir(layout.build_root, sweep.name)
    if wait and sweep.spec.executor == "slurm":
        wait_slurm(sweep, layout, ids, console)
    if sweep.spec.executor == "slurm":
        slots = latest_slots(state)
        task_state = _states(sweep, slots, {i.key for i in ids.values()})
        ended = slurm.ended_without_result
    elif sweep.spec.executor == "kubernetes":
        def task_state(slot: Slot) -> Optional[str]:
            return None

        def ended(slot: Slot) -> str:
            return (f"no result on the PVC for pod {slot.index} of Job "
                    f"{kubernetes.object_name(sweep.name, slot.submission, slot.group)} yet: it is queued or "
                    f"running, or it ended without one (kubectl logs, or its log {slot.log})")
    else:
        raise InputError("kiln sweep collect gathers what a cluster ran: give --executor slurm or kubernetes "
                         "(a local sweep writes its results as it runs)")
    records = collect_records(sweep.points, ids, state, task_state, ended)
    state.mkdir(parents=True, exist_ok=True)
    write_results(records, state)
    console.print(f"collected {sweep.name}: {summarize(records)}")
    if any(r["status"] == NO_RESULT for r in records):
        console.print("(kiln cannot see the Kubernetes cluster: 'no result' means the PVC holds none yet)")
    return records
