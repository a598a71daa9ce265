"""One point, one task: what a cluster executor hands to a node, what the node writes back, and collecting it.

Files under the sweep's directory, ``<build>/sweeps/<name>/``::

    records/<key>.json            one per point that ran on a cluster: its result record (status ok or failed,
                                  a failed one with its log's tail), written by the task that ran it
    submissions/<id>/             one per submission: task-<g>.json (the points of array/Job g, each with its
                                  fully resolved recipe, so a later edit of the sweep changes no queued task),
                                  the sbatch script or Kubernetes manifest, submission.json (job ids), logs/
    results.jsonl|csv|md, *.png   the collected table (as for a local sweep)

A point's *fingerprint* is one hash over the fingerprints of every step it runs
(:func:`kiln.experiments.sweep.point_fingerprint`): equal fingerprints, equal outputs. Its *key* adds its whole
resolved recipe (:func:`~kiln.experiments.sweep.point_key`: a quality gate changes no output but decides whether
the point passes). A point is *done* when a record with status ok exists for its key (or a local run left one
in results.jsonl); re-running a finished sweep submits nothing, and adding an axis value submits only the
points that have no result yet.

**The shared cache and locks.** The array tasks share one build directory on shared storage. The design does
not rely on file locks working across nodes (flock over NFS, Lustre or GPFS depends on the mount):

- each point has its own recipe name, so its own ``build/<recipe>/`` directory, and kiln submits a point only
  when no earlier task of it is still queued or running (``squeue``): exactly one task writes each point's
  directory. The runner's per-directory lock stays, and only ever guards against a person running
  ``kiln build`` on the same point by hand;
- points reuse each other's steps only by reading *complete* outputs: every step writes into a temporary
  directory renamed into place (an atomic rename within one directory, on NFS too) with its manifest written
  last, and the runner hard-links a complete output with the same fingerprint from another point's
  directory. A half-written output is never taken;
- two points running at the same time that need the same step (e.g. two points sharing a quantized
  checkpoint) may both compute it, each in its own directory: duplicated work, never a mixed output.

**A remote cache** (an OCI registry of step outputs keyed by fingerprint, if one is configured) sits behind
this: each task's runner consults it like any other build, so points on nodes without a common filesystem can
still share steps, and it keeps outputs beyond the life of a scratch filesystem. The sweep code does nothing
special for it; the shared build directory is the first place a task looks.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.util.errors import InputError, KilnError

LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 6000
#: Environment variables a task reads its index from when --index is not given (Kubernetes Indexed Jobs set
#: JOB_COMPLETION_INDEX; Slurm sets SLURM_ARRAY_TASK_ID).
INDEX_ENV = ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID")


class TaskPoint(BaseModel):
    """One point as its task runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    point: int
    label: str
    overrides: dict[str, Any]
    recipe: str
    fingerprint: str
    key: str
    gpus: int
    recipe_yaml: str
    """The point's fully resolved recipe (every default filled in, no `extends`)."""


class TaskFile(BaseModel):
    """The points of one job array (one Indexed Job): task i runs points[i]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep: str
    submission: str
    group: int
    executor: str
    build_root: str
    """Build directory as the task sees it (absolute for Slurm; relative to the pod's working dir on Kubernetes)."""
    repo_root: str
    write_log: bool
    """Whether the task writes its own log under the submission's logs/ (Kubernetes; Slurm writes Slurm's)."""
    sweep_spec: dict[str, Any]
    """The sweep's settings (measures, plan GPU, bench settings) as the submitter validated them."""
    points: list[TaskPoint]

    @property
    def state_dir(self) -> Path:
        return sweep_dir(Path(self.build_root), self.sweep)

    @classmethod
    def read(cls, path: Path) -> "TaskFile":
        try:
            return cls.model_validate_json(Path(path).read_text())
        except OSError as exc:
            raise InputError(f"cannot read the task file {path}: {exc}") from None
        except ValidationError as exc:
            raise InputError(f"{path} is not a kiln sweep task file: {exc.errors()[0]['msg']}") from None


def sweep_dir(build_root: Path, name: str) -> Path:
    return build_root / "sweeps" / name


def record_path(state: Path, key: str) -> Path:
    return state / "records" / f"{key}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader sees the old file or the whole new one (rename within the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def log_tail(path: Optional[Path]) -> Optional[str]:
    """The last lines of a log (None when there is no log)."""
    if path is None or not path.is_file():
        return None
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", "replace")
    lines = text.splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(lines)[-LOG_TAIL_CHARS:]


# --------------------------------------------------------------------------------------------- submissions


@dataclass(frozen=True)
class PointId:
    fingerprint: str
    """Its steps' fingerprints in one hash: equal fingerprints, equal outputs."""
    key: str
    """The fingerprint and the whole resolved recipe: what a finished result is found by."""


@dataclass(frozen=True)
class Slot:
    """Where a point was last submitted: submission id, array/Job group, task index (and the job's id)."""

    submission: str
    group: int
    index: int
    executor: str
    job_id: Optional[str]
    log: Optional[Path]


def next_submission_id(state: Path) -> str:
    root = state / "submissions"
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return f"{max(taken, default=0) + 1:04d}"


def submission_info(sub_dir: Path) -> dict:
    """submission.json (written by the submitter; absent on a Kubernetes PVC, where only task files are)."""
    return read_json(sub_dir / "submission.json") or {}


def latest_slots(state: Path) -> dict[str, Slot]:
    """point key → the slot of its latest submission, from the task files under submissions/."""
    slots: dict[str, Slot] = {}
    root = state / "submissions"
    if not root.is_dir():
        return slots
    for sub_dir in sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        jobs = {int(k): v for k, v in (submission_info(sub_dir).get("jobs") or {}).items()}
        for task_path in sorted(sub_dir.glob("task-*.json")):
            try:
                task = TaskFile.read(task_path)
            except InputError:
                continue
            job_id = jobs.get(task.group)
            for index, tp in enumerate(task.points):
                slots[tp.key] = Slot(sub_dir.name, task.group, index, task.executor, job_id,
                                             task_log_path(sub_dir, task, index, job_id))
    return slots


def task_log_path(sub_dir: Path, task: TaskFile, index: int, job_id: Optional[str]) -> Optional[Path]:
    """Where a task's output goes: Slurm's `--output` file (``%A_%a``), or the task's own log on Kubernetes."""
    if task.executor == "slurm":
        return sub_dir / "logs" / f"{job_id}_{index}.log" if job_id else None
    return sub_dir / "logs" / f"{task.group}_{index}.log"


# --------------------------------------------------------------------------------------------- running a task


def task_index(index: Optional[int]) -> int:
    if index is not None:
        return index
    for name in INDEX_ENV:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    raise InputError("which point? give --index N, or run inside a Slurm array task or a Kubernetes Indexed "
                     f"Job pod (they set {' or '.join(reversed(INDEX_ENV))})")


def _task_identity(task: TaskFile, index: int) -> dict[str, Any]:
    ident: dict[str, Any] = {"executor": task.executor, "submission": task.submission, "group": task.group,
                             "index": index, "host": socket.gethostname()}
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        if os.environ.get(name):
            ident[name.lower()] = os.environ[name]
    return ident


def run_task(task_path: Path, index: Optional[int], out: Callable[[bytes], None]) -> int:
    """Run one task: the point runs in a child process (``kiln sweep task … --inline``) whose output this one
    passes on (to ``out``, and to the task's log where it keeps one) and keeps the tail of; then the point's
    record is written, with the log's tail when it failed — also when the child died without a result (a
    crash, the kernel's OOM killer). Returns the exit code: 0 when the point is ok, else 1."""
    task = TaskFile.read(task_path)
    index = task_index(index)
    if not 0 <= index < len(task.points):
        raise InputError(f"--index {index}: {task_path} has points 0–{len(task.points) - 1}")
    tp = task.points[index]
    state = task.state_dir
    sub_dir = state / "submissions" / task.submission
    own_copy = sub_dir / f"task-{task.group}.json"
    if not own_copy.exists():  # Kubernetes: the task file comes from a ConfigMap; keep it beside the results
        write_json_atomic(own_copy, task.model_dump(mode="json"))
    log = task_log_path(sub_dir, task, index, None) if task.write_log else None
    attempt = uuid.uuid4().hex[:12]
    result = state / "records" / f".{tp.key}.{attempt}.result.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[bytes] = collections.deque(maxlen=LOG_TAIL_LINES)
    log_fh = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log_fh = open(log, "ab")
    try:
        child = subprocess.Popen([sys.executable, "-m", "kiln", "sweep", "task", str(task_path), "--index",
                                  str(index), "--inline", str(result)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert child.stdout is not None
        for line in child.stdout:
            out(line)
            tail.append(line)
            if log_fh is not None:
                log_fh.write(line)
                log_fh.flush()
        code = child.wait()
    finally:
        if log_fh is not None:
            log_fh.close()
    record = read_json(result)
    if record is None:
        record = {"point": tp.point, "label": tp.label, "overrides": tp.overrides, "recipe": tp.recipe,
                  "fingerprint": tp.fingerprint, "key": tp.key, "status": "failed",
                  "error": f"the point's process ended with exit code {code} before writing its result"}
    record["task"] = _task_identity(task, index)
    if log is not None:
        record["task"]["log"] = str(log)
    if record.get("status") != "ok":
        record["log_tail"] = b"".join(tail).decode("utf-8", "replace")[-LOG_TAIL_CHARS:]
    write_json_atomic(record_path(state, tp.key), record)
    result.unlink(missing_ok=True)
    return 0 if record.get("status") == "ok" else 1


def run_task_inline(task_path: Path, index: int, result: Path) -> None:
    """The point itself (the child of :func:`run_task`): its recipe, the pipeline, its measures."""
    from kiln.experiments.sweep import Point, SweepFile, bench_point, run_point
    from kiln.pipeline.runner import Layout
    from kiln.recipe.loader import load_recipe

    task = TaskFile.read(task_path)
    tp = task.points[index]
    spec = SweepFile.model_validate(task.sweep_spec)
    recipe_file = task.state_dir / "submissions" / task.submission / "recipes" / f"{tp.recipe}.yaml"
    if not recipe_file.is_file() or recipe_file.read_text() != tp.recipe_yaml:
        recipe_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = recipe_file.with_name(f".{recipe_file.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(tp.recipe_yaml)
        os.replace(tmp, recipe_file)
    layout = Layout(Path(task.build_root), Path(task.repo_root))
    print(f"kiln sweep {task.sweep}: point {tp.point} ({tp.label}) as task {index} of submission "
          f"{task.submission} on {socket.gethostname()}", file=sys.stderr, flush=True)
    loaded = load_recipe(recipe_file)
    record = run_point(Point(tp.point, tp.overrides), loaded, layout, spec, progress=False)
    if "bench" in spec.measure:
        if record["status"] == "ok":
            bench_point(record, loaded, layout, spec)
        record["bench_settings"] = spec.bench.model_dump(mode="json")
    if record.get("fingerprint") and record["fingerprint"] != tp.fingerprint:
        record["submitted_fingerprint"] = tp.fingerprint
        record["warning"] = ("this node computed another fingerprint than the submitting host (different tool "
                             "versions or inputs here?): the outputs are not the ones the sweep asked for")
    record["finished"] = datetime.now(timezone.utc).isoformat()
    write_json_atomic(result, record)
    print(f"point {tp.point}: {record['status']}" + (f" — {record.get('error')}" if record.get("error") else ""),
          file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- collecting


#: Statuses a point can have in a collected table besides ok and failed.
PENDING, RUNNING, NO_RESULT, NOT_SUBMITTED = "pending", "running", "no result", "not submitted"


def done_records(state: Path) -> dict[str, dict]:
    """point key → a finished (ok) record: the records/ a cluster's tasks wrote, and a local run's results."""
    done: dict[str, dict] = {}
    results = state / "results.jsonl"
    if results.is_file():
        for line in results.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("status") == "ok" and rec.get("key"):
                done[rec["key"]] = rec
    records = state / "records"
    if records.is_dir():
        for path in records.glob("*.json"):
            if path.name.startswith("."):
                continue
            rec = read_json(path)
            if rec is not None and rec.get("status") == "ok":
                done[path.stem] = rec
    return done


def is_done(record: Optional[dict], bench: Optional[dict]) -> bool:
    """A finished record that also has the benchmark the sweep asks for (same settings), if it asks for one."""
    if record is None or record.get("status") != "ok":
        return False
    return bench is None or (bool(record.get("bench")) and record.get("bench_settings") == bench)


def collect_records(points: list, ids: dict[int, "PointId"], state: Path,
                    task_state: Callable[[Slot], Optional[str]], ended_without_result: Callable[[Slot], str]) -> list[dict]:
    """The sweep's table: one record per point — what its latest task is doing if it is queued or running,
    else the record its task wrote (or a local run's), else what is known of a task that ended without one.

    ``task_state(slot)`` is the scheduler's word for a task still queued or running (None when it is not);
    ``ended_without_result(slot)`` says what is known of a task that left the queue without a record."""
    slots = latest_slots(state)
    done = done_records(state)
    out = []
    for p in points:
        key = ids[p.index].key
        base = {"point": p.index, "label": p.label, "overrides": p.overrides,
                "fingerprint": ids[p.index].fingerprint, "key": key}
        slot = slots.get(key)
        where = None if slot is None else {"submission": slot.submission, "group": slot.group, "index": slot.index,
                                           "job_id": slot.job_id, "log": str(slot.log) if slot.log else None}
        now = task_state(slot) if slot is not None else None
        if now is not None:
            out.append({**base, "status": RUNNING if now.upper().startswith(("RUNNING", "COMPLETING")) else PENDING,
                        "scheduler_state": now, "task": where})
            continue
        record = read_json(record_path(state, key)) or done.get(key)
        if record is not None and (slot is None or record.get("status") == "ok"
                                   or (record.get("task") or {}).get("submission") == slot.submission):
            merged = {**record, **base}
            if merged.get("status") != "ok" and not merged.get("log_tail") and slot is not None:
                merged["log_tail"] = log_tail(slot.log)
            out.append(merged)
        elif slot is not None:
            status = "failed" if slot.executor == "slurm" else NO_RESULT
            out.append({**base, "status": status, "error": ended_without_result(slot), "task": where,
                        "log_tail": log_tail(slot.log)})
        else:
            out.append({**base, "status": NOT_SUBMITTED})
    return out


def summarize(records: list[dict]) -> str:
    counts = collections.Counter(r["status"] for r in records)
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def failures(records: list[dict]) -> Optional[KilnError]:
    """A KilnError naming every point that is not ok (failed, or without a result yet), else None."""
    bad = [r for r in records if r["status"] != "ok"]
    if not bad:
        return None
    unfinished = [r for r in bad if r["status"] in (PENDING, RUNNING)]
    parts = []
    for r in bad:
        text = f"point {r['point']} ({r['label']}): {r['status']}"
        if r.get("error"):
            text += f" — {str(r['error'])[:300]}"
        parts.append(text)
    head = f"{len(bad)} of {len(records)} points are not ok"
    if unfinished:
        head += f" ({len(unfinished)} still queued or running: kiln sweep collect --wait gathers them)"
    return KilnError(head + ": " + "; ".join(parts))
