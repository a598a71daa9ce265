"""Slurm: one job array per submission (one per GPU count, see :mod:`kiln.experiments.executors`); array task i
runs point i of its task file with ``kiln sweep task`` on the compute node, on the shared build cache.

The script is plain ``sbatch``: ``--array``, ``--output`` (one log per task, ``%A_%a``), ``--chdir`` (the
submitting directory, so relative paths in recipes mean what they meant there), the settings' partition,
account, QOS, time, CPUs and memory, and the GPU request from the points' tp × pp: ``--gres=gpu[:TYPE]:N`` or
``--gpus=[TYPE:]N`` (sbatch(1)); none for the CPU reference target. sbatch passes the submitting shell's
environment on (its default ``--export=ALL``).

Progress comes from ``squeue`` (queued and running tasks); a task that left the queue without writing its
result is looked up in ``sacct`` (accounting) or, where accounting is off, ``scontrol show job``.

**Container runtimes.** The sbatch script runs kiln on the node itself. Where a recipe's engine runtime says
that GPU work runs in a container (the ``engine_runtime`` section: docker, podman or apptainer, with its
image), kiln's runner starts that container for the steps that need it, on whichever host runs the step, so
the array task needs no wrapper of its own. :func:`runtime_lines` is the one place that adds lines to the
script for a runtime (e.g. a check that the container engine is on the node's PATH); it adds none today.
Loading an environment module is what `slurm.setup` is for (e.g. ``module load apptainer``).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kiln.experiments.executors import SlurmSettings
from kiln.experiments.tasks import Slot, TaskFile
from kiln.recipe.loader import LoadedRecipe
from kiln.util.errors import KilnError

COMMANDS = ("sbatch", "squeue")


def gpu_request(settings: SlurmSettings, gpus: int) -> Optional[str]:
    """The sbatch option that asks for `gpus` GPUs per task (None for none)."""
    if gpus <= 0:
        return None
    if settings.gpu_request == "gpus":
        return f"--gpus={settings.gpu_type + ':' if settings.gpu_type else ''}{gpus}"
    return f"--gres=gpu:{settings.gpu_type + ':' if settings.gpu_type else ''}{gpus}"


def runtime_lines(points: list[LoadedRecipe]) -> list[str]:
    """Shell lines a point's engine runtime needs in the script before kiln runs (none today: kiln's runner
    starts a container runtime itself where a recipe asks for one; see the module's docstring)."""
    return []


def kiln_command(settings: SlurmSettings) -> list[str]:
    return list(settings.kiln) if settings.kiln else [sys.executable, "-m", "kiln"]


def render_sbatch(task: TaskFile, task_path: Path, sub_dir: Path, settings: SlurmSettings, cwd: Path,
                  loaded: list[LoadedRecipe]) -> str:
    """The sbatch script for one job array of a submission."""
    n = len(task.points)
    gpus = task.points[0].gpus
    array = f"0-{n - 1}" + (f"%{settings.max_parallel}" if settings.max_parallel else "")
    options = [f"--job-name=kiln-sweep-{task.sweep}", f"--array={array}",
               f"--output={sub_dir / 'logs' / '%A_%a.log'}", f"--chdir={cwd}", "--ntasks=1"]
    for flag, value in (("partition", settings.partition), ("account", settings.account), ("qos", settings.qos),
                        ("time", settings.time), ("cpus-per-task", settings.cpus_per_task), ("mem", settings.mem)):
        if value is not None:
            options.append(f"--{flag}={value}")
    gpu = gpu_request(settings, gpus)
    if gpu:
        options.append(gpu)
    options += list(settings.sbatch)
    lines = ["#!/bin/bash",
             f"# kiln sweep {task.sweep}: submission {task.submission}, array {task.group} — {n} point(s), "
             f"{gpus} GPU(s) each (tp × pp{'' if gpus else '; CPU reference target'}).",
             "# Written by kiln (kiln sweep … --executor slurm); array task i runs point i of the task file:"]
    lines += [f"#   task {i}: point {tp.point} ({tp.label}) → {tp.recipe}" for i, tp in enumerate(task.points)]
    lines += [f"#SBATCH {shlex.quote(o) if ' ' in o else o}" for o in options]
    lines += ["set -eo pipefail",
              'echo "kiln sweep ' + task.sweep + ': array task ${SLURM_ARRAY_TASK_ID} (job ${SLURM_JOB_ID}) on $(hostname)"']
    lines += list(settings.setup)
    lines += runtime_lines(loaded)
    command = kiln_command(settings) + ["sweep", "task", str(task_path)]
    lines.append("exec " + " ".join(shlex.quote(w) for w in command) + ' --index "$SLURM_ARRAY_TASK_ID"')
    return "\n".join(lines) + "\n"


def _need(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise KilnError(f"{command} not found: executor slurm runs on a Slurm login node (Slurm's commands on "
                        "PATH, SLURM_CONF pointing at the cluster's slurm.conf if it is not in the default place)")
    return path


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT` → the array's job id."""
    proc = subprocess.run([_need("sbatch"), "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnError(f"sbatch refused {script}: {(proc.stderr or proc.stdout).strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise KilnError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id


def queue_states() -> dict[tuple[str, int], str]:
    """(array job id, task index) → state, for every array task of yours still in the queue (squeue); a pending
    task's state names why it waits, e.g. ``PENDING (Resources)``."""
    proc = subprocess.run([_need("squeue"), "--me", "-h", "-r", "-o", "%i|%T|%r"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnError(f"squeue failed: {(proc.stderr or proc.stdout).strip()}")
    states: dict[tuple[str, int], str] = {}
    for line in proc.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        array_id, sep, index = job.partition("_")
        if sep and index.isdigit():
            waiting = state == "PENDING" and reason not in ("", "None", "(null)")
            states[(array_id, int(index))] = f"{state} ({reason})" if waiting else state
    return states


def slot_state(states: dict[tuple[str, int], str], slot: Slot) -> Optional[str]:
    if slot.job_id is None:
        return None
    return states.get((slot.job_id, slot.index))


def _scontrol_state(job: str) -> Optional[str]:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    proc = subprocess.run([scontrol, "show", "job", job], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    fields = dict(w.split("=", 1) for w in proc.stdout.split() if "=" in w)
    if "JobState" not in fields:
        return None
    text = f"{fields['JobState']}, exit code {fields.get('ExitCode', '?')}"
    if fields.get("Reason") not in (None, "None"):
        text += f", reason {fields['Reason']}"
    return text


def final_state(slot: Slot) -> str:
    """What Slurm says about a task that left the queue without a result (sacct, else scontrol)."""
    if slot.job_id is None:
        return "the submission has no job id"
    job = f"{slot.job_id}_{slot.index}"
    sacct = shutil.which("sacct")
    if sacct is not None:
        proc = subprocess.run([sacct, "-n", "-P", "-X", "-j", job, "-o", "State,ExitCode"], capture_output=True,
                              text=True)
        line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
        if line:
            state, _, code = line.partition("|")
            return f"{state}, exit code {code}"
    return _scontrol_state(job) or "its final state is unknown (no Slurm accounting, and the job has left scontrol)"


def ended_without_result(slot: Slot) -> str:
    return (f"Slurm task {slot.job_id}_{slot.index} ended without writing its result ({final_state(slot)}); "
            f"its log: {slot.log}")
