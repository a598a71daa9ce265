"""Sweeps on a cluster, for real: a single-node Slurm cluster (munge, slurmctld, slurmd; tests/slurm_cluster.py)
runs the points of a fast sweep (int8_sq, fp8 on the built-in model, small sample counts) as array tasks, and
a Kubernetes Indexed Job's pod command runs locally once per JOB_COMPLETION_INDEX in a directory shaped like
its PVC (there is no Kubernetes cluster here). Both are compared with a local run in another build directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.experiments.sweep import load_sweep, run_sweep
from kiln.pipeline.runner import Layout
from kiln.recipe.catalog import configs_dir
from slurm_cluster import SlurmCluster, unavailable

pytestmark = pytest.mark.integration

FAST_SET = {"quantization.calibration.samples": 8, "quantization.calibration.max_seq_len": 64,
            "evaluation.samples": 4, "evaluation.max_seq_len": 64, "hardware.gpu": "H100-SXM"}
FORMATS = ["int8_sq", "fp8"]


def write_sweep(path: Path, formats: list[str], points: list[dict] | None = None, **extra) -> Path:
    spec = {"name": "fast", "base": str(configs_dir() / "tiny-llama.yaml"), "set": dict(FAST_SET),
            "axes": {"quantization.format": formats}, "measure": ["quality", "plan"], **extra}
    if points:
        spec["points"] = points
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def kiln(*args, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def results(build: Path) -> dict[str, dict]:
    """results.jsonl by point label."""
    lines = (build / "sweeps" / "fast" / "results.jsonl").read_text().splitlines()
    return {r["label"]: r for r in map(json.loads, lines)}


def started(build: Path) -> dict[str, str]:
    return {str(p.relative_to(build)): json.loads(p.read_text())["started"] for p in build.glob("*/*/manifest.json")}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """The sweep run here, in its own build directory: what every cluster run must reproduce."""
    root = tmp_path_factory.mktemp("local")
    layout = Layout(root / "build", root / "repo")
    records = run_sweep(load_sweep(write_sweep(root / "sweep.yaml", FORMATS), layout), layout, progress=False)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    return root / "build"


def test_slurm_job_array_runs_each_point_as_a_task_resumes_grows_and_reports_failures(local_run, tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    work = tmp_path / "work"
    work.mkdir()
    build = work / "build"
    settings = ["--set", "slurm.poll_s=0.5"]
    with SlurmCluster(tmp_path / "slurm", cpus=2) as cluster:
        sweep = write_sweep(work / "sweep.yaml", FORMATS, executor="slurm")
        first = kiln("sweep", sweep, *settings, env=cluster.env, cwd=work)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "2 to submit" in first.stderr and "submitted job array" in first.stderr

        # Every point ran as an array task, by Slurm's own records (jobcomp/filetxt).
        sub = build / "sweeps" / "fast" / "submissions" / "0001"
        job = json.loads((sub / "submission.json").read_text())["jobs"]["0"]
        task = json.loads((sub / "task-0.json").read_text())
        done = {int(c["ArrayTaskId"]): c for c in cluster.completions(job, 2)}
        assert sorted(done) == [0, 1] and {c["JobState"] for c in done.values()} == {"COMPLETED"}
        slurm_runs = results(build)
        for index, tp in enumerate(task["points"]):
            record = slurm_runs[tp["label"]]
            assert record["task"]["slurm_array_job_id"] == job and record["task"]["slurm_array_task_id"] == str(index)
            assert done[index]["JobId"] == record["task"]["slurm_job_id"]

        # The results equal the local run's: same fingerprints, same quality figures.
        local = results(local_run)
        assert set(slurm_runs) == set(local) == {"format=int8_sq", "format=fp8"}
        for label, record in slurm_runs.items():
            assert record["status"] == "ok"
            assert record["fingerprint"] == local[label]["fingerprint"]
            assert record["quality"] == local[label]["quality"]
            # resolve is shared: the second task to reach it may hard-link the first one's (same fingerprint)
            assert record["steps"]["resolve"] in ("ran", "reused")
            assert {k: v for k, v in record["steps"].items() if k != "resolve"} == {
                "quantize": "ran", "evaluate": "ran", "engine": "not run", "package": "not run", "tasks": "not run"}
        assert (build / "sweeps" / "fast" / "results.csv").is_file()
        assert (build / "sweeps" / "fast" / "quality_vs_size.png").stat().st_size > 1000

        # A rerun of the finished sweep submits nothing.
        before, n_completions = started(build), len(cluster.completions())
        again = kiln("sweep", sweep, *settings, env=cluster.env, cwd=work)
        assert again.returncode == 0, again.stderr
        assert "2 done, 0 queued or running, 0 to submit" in again.stderr and "submitted" not in again.stderr
        assert not (sub.parent / "0002").exists() and len(cluster.completions()) == n_completions
        assert started(build) == before

        # One more axis value: only its point is submitted and run; it reuses what it shares (resolve).
        grown = write_sweep(work / "sweep.yaml", FORMATS + ["int8_wo"], executor="slurm")
        more = kiln("sweep", grown, *settings, env=cluster.env, cwd=work)
        assert more.returncode == 0, more.stderr
        assert "2 done, 0 queued or running, 1 to submit" in more.stderr
        task2 = json.loads((sub.parent / "0002" / "task-0.json").read_text())
        assert [tp["label"] for tp in task2["points"]] == ["format=int8_wo"]
        assert len(cluster.completions(json.loads((sub.parent / "0002" / "submission.json").read_text())["jobs"]["0"], 1)) == 1
        assert len(cluster.completions()) == n_completions + 1
        for key, when in before.items():
            assert json.loads((build / key).read_text())["started"] == when  # nothing else ran again
        new = results(build)["format=int8_wo"]
        assert new["status"] == "ok" and new["steps"]["resolve"] == "reused" and new["steps"]["quantize"] == "ran"

        # A point made to fail (a quality gate nothing can pass) is reported with its log's tail; the rest complete.
        failing = write_sweep(work / "sweep.yaml", FORMATS + ["int8_wo"], executor="slurm",
                              points=[{"quantization.format": "int8_wo", "evaluation.max_kl": 1e-12}])
        bad = kiln("sweep", failing, *settings, env=cluster.env, cwd=work)
        assert bad.returncode == 1
        table = results(build)
        assert [r["status"] for r in table.values()] == ["ok", "ok", "ok", "failed"]
        failed = table["format=int8_wo, max_kl=1e-12"]
        assert "mean KL divergence" in failed["error"] and "gate is 1e-12" in failed["error"]
        assert "mean KL divergence" in failed["log_tail"]  # the tail of the task's own log
        assert failed["steps"]["quantize"] == "reused"  # the int8_wo point's checkpoint, hard-linked
        job3 = json.loads((sub.parent / "0003" / "submission.json").read_text())["jobs"]["0"]
        (last,) = cluster.completions(job3, 1)
        assert last["JobState"] == "FAILED" and last["ExitCode"] == "1:0"
        assert "1 of 4 points are not ok" in bad.stderr and "point 3 (format=int8_wo, max_kl=1e-12): failed" in bad.stderr

        # kiln sweep collect gathers the same table again, later, from the files the tasks wrote.
        collected = kiln("sweep", "collect", failing, "--executor", "slurm", env=cluster.env, cwd=work)
        assert collected.returncode == 1 and "1 failed, 3 ok" in collected.stderr
        assert results(build) == table


def test_kubernetes_pods_command_run_per_completion_index_into_a_pvc_shaped_directory(local_run, tmp_path):
    """kiln renders the Indexed Job; each pod's command runs here with JOB_COMPLETION_INDEX set, its volumes
    mapped onto local directories (the PVC: a copy of the local run's build cache, so the pods find every
    step done and what is tested is the pod's command, its index and collecting; the ConfigMap: its files).
    No Kubernetes cluster ran anything."""
    work = tmp_path / "work"
    work.mkdir()
    sweep = write_sweep(work / "sweep.yaml", FORMATS, executor="kubernetes",
                        kubernetes={"image": "registry.example/kiln:test", "mount_path": "/kiln"})
    rendered = kiln("sweep", sweep, "--build-dir", work / "build", env=dict(os.environ), cwd=work)
    assert rendered.returncode == 0, rendered.stderr
    docs = list(yaml.safe_load_all((work / "build" / "sweeps" / "fast" / "submissions" / "0001" / "job.yaml").read_text()))
    configmap, job = docs
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]

    pvc = tmp_path / "pvc"
    shutil.copytree(local_run, pvc / "build", copy_function=os.link,
                    ignore=lambda d, names: ["sweeps"] if Path(d) == local_run else [])
    from kiln.models.tiny import cache_root, ensure_tiny_llama

    ensure_tiny_llama(progress=False)
    shutil.copytree(cache_root() / "models", pvc / "cache" / "kiln" / "models",  # the PVC's kiln cache
                    ignore=shutil.ignore_patterns("*.lock"))
    tasks_dir = tmp_path / "configmap"
    tasks_dir.mkdir()
    for name, text in configmap["data"].items():
        (tasks_dir / name).write_text(text)
    mounts = {m["mountPath"]: {"build-cache": pvc, "tasks": tasks_dir, "dshm": tmp_path / "shm"}[m["name"]]
              for m in container["volumeMounts"]}

    def local(value: str) -> str:
        for mount, where in mounts.items():
            if value == mount or value.startswith(mount + "/"):
                return str(where) + value[len(mount):]
        return value

    env = {**os.environ, **{e["name"]: local(e["value"]) for e in container["env"]},
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for index in range(job["spec"]["completions"]):
        proc = subprocess.run([local(w) for w in container["command"]], cwd=local(container["workingDir"]),
                              env={**env, "JOB_COMPLETION_INDEX": str(index)}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    collected = kiln("sweep", "collect", sweep, "--build-dir", pvc / "build", env=dict(os.environ), cwd=work)
    assert collected.returncode == 0, collected.stderr
    pods, local_records = results(pvc / "build"), results(local_run)
    assert set(pods) == set(local_records)
    for label, record in pods.items():
        assert record["status"] == "ok" and record["fingerprint"] == local_records[label]["fingerprint"]
        assert record["quality"] == local_records[label]["quality"]
        assert set(record["steps"].values()) <= {"skipped", "not run"}  # the PVC's cache had every step
        assert record["task"]["executor"] == "kubernetes"
        assert (pvc / record["task"]["log"]).is_file()  # the pod's own log, on the PVC
