"""`kiln sweep --executor slurm|kubernetes` without a cluster: the sbatch script's GPU request from tp × pp,
the settings and their errors, the Indexed Job (validated offline like the deploy manifests), the task's
supervisor, and collecting tasks that ended without a result (Slurm's commands replaced by stand-ins that
answer as squeue/sacct do, named as such). The real Slurm cluster and real points: test_sweep_cluster.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from kiln.experiments.tasks import TaskFile, TaskPoint, run_task
from kiln.recipe.catalog import configs_dir
from kiln.triton.deploy import container_security_context, pod_security_context, validate_manifests

BASE = configs_dir() / "tiny-llama.yaml"


def sweep_file(tmp_path: Path, **extra) -> Path:
    spec = {"name": "gpus", "base": str(BASE),
            "set": {"target": "tensorrt", "hardware.gpu": "H100-SXM", "quantization.format": "fp8"},
            "points": [{"parallelism.tp": 1}, {"parallelism.tp": 2}, {"parallelism.tp": 2, "parallelism.pp": 2},
                       {"parallelism.tp": 1, "quantization.format": "int8_sq"}]}
    spec.update(extra)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def scripts(output: str) -> dict[int, str]:
    """The sbatch scripts a dry run printed, by array number."""
    out, current = {}, None
    for line in output.splitlines():
        if line.startswith("# --- ") and "/job-" in line:
            current = int(line.split("/job-")[1].split(".sbatch")[0])
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_dry_run_prints_one_array_per_gpu_count_with_the_gpu_request_from_tp_times_pp(kiln, tmp_path):
    path = sweep_file(tmp_path)
    result = kiln("sweep", path, "--executor", "slurm", "--dry-run", "--build-dir", tmp_path / "build",
                  "--set", "slurm.partition=gpu", "--set", "slurm.time=2:00:00", "--set", "slurm.sbatch=[--exclusive]")
    assert result.exit_code == 0, result.output
    printed = scripts(result.output)
    assert len(printed) == 3  # 1, 2 and 4 GPUs: every task of an array gets the same resources
    by_gpus = {}
    for script in printed.values():
        gres = [o for o in sbatch_options(script) if o.startswith("--gres=")]
        assert len(gres) == 1
        by_gpus[int(gres[0].rsplit(":", 1)[1])] = script
    assert sorted(by_gpus) == [1, 2, 4]  # tp 1; tp 2; tp 2 × pp 2
    assert "point 0 (tp=1)" in by_gpus[1] and "point 3 (tp=1, format=int8_sq)" in by_gpus[1]
    assert "--array=0-1" in sbatch_options(by_gpus[1]) and "--array=0-0" in sbatch_options(by_gpus[4])
    for script in printed.values():
        options = sbatch_options(script)
        assert "--partition=gpu" in options and "--time=2:00:00" in options and "--exclusive" in options
        assert any(o.startswith("--output=") and o.endswith("/logs/%A_%a.log") for o in options)
        assert script.rstrip().endswith('--index "$SLURM_ARRAY_TASK_ID"')
    assert not (tmp_path / "build").exists()  # a dry run writes nothing

    gpus = kiln("sweep", path, "--executor", "slurm", "--dry-run", "--build-dir", tmp_path / "build",
                "--set", "slurm.gpu_request=gpus", "--set", "slurm.gpu_type=h100")
    requests = sorted(o for s in scripts(gpus.output).values() for o in sbatch_options(s) if o.startswith(("--gpus", "--gres")))
    assert requests == ["--gpus=h100:1", "--gpus=h100:2", "--gpus=h100:4"]


def test_the_cpu_reference_target_asks_for_no_gpu(kiln, tmp_path):
    path = sweep_file(tmp_path, set={"target": "reference", "quantization.format": "fp8"},
                      points=[{"parallelism.tp": 1}, {"quantization.format": "int8_sq"}])
    result = kiln("sweep", path, "--executor", "slurm", "--dry-run", "--build-dir", tmp_path / "build")
    assert result.exit_code == 0, result.output
    (script,) = scripts(result.output).values()
    assert not [o for o in sbatch_options(script) if o.startswith(("--gpus", "--gres"))]
    assert "CPU reference target" in script


def test_cluster_executors_need_each_points_gpu_and_valid_settings(kiln, tmp_path):
    path = sweep_file(tmp_path, set={"target": "tensorrt", "quantization.format": "fp8"})
    result = kiln("sweep", path, "--executor", "slurm", "--dry-run", "--build-dir", tmp_path / "build")
    assert result.exit_code == 2
    assert result.output.count("error: hardware.gpu: point") == 4  # all at once
    assert "submitting host is not the one that builds it" in result.output and "Traceback" not in result.output
    assert kiln("sweep", path, "--dry-run", "--build-dir", tmp_path / "build").exit_code == 0  # local: detected

    bad = sweep_file(tmp_path, slurm={"time": "two hours", "sbatch": ["exclusive"], "partion": "gpu"})
    result = kiln("sweep", bad, "--executor", "slurm", "--dry-run")
    assert result.exit_code == 2
    assert "slurm.time" in result.output and "not a Slurm time limit" in result.output
    assert "slurm.sbatch" in result.output and "is not an sbatch option" in result.output
    assert "slurm.partion" in result.output
    assert f"{bad}:" in result.output  # each problem names the sweep file's line
    unquoted = kiln("sweep", sweep_file(tmp_path, slurm={"time": 7200}), "--executor", "slurm", "--dry-run")
    assert unquoted.exit_code == 2 and "quoted text" in unquoted.output
    set_origin = kiln("sweep", sweep_file(tmp_path), "--set", "slurm.max_parallel=0", "--executor", "slurm", "--dry-run")
    assert set_origin.exit_code == 2 and "--set slurm.max_parallel" in set_origin.output

    no_image = kiln("sweep", sweep_file(tmp_path), "--executor", "kubernetes", "--dry-run")
    assert no_image.exit_code == 2 and "kubernetes.image" in no_image.output
    jobs = kiln("sweep", sweep_file(tmp_path), "--executor", "slurm", "--jobs", "2", "--dry-run")
    assert jobs.exit_code == 2 and "--jobs is for the local executor" in jobs.output


def test_indexed_job_validates_offline_with_gpu_limits_pvc_and_the_deploy_security_rules(kiln, tmp_path):
    path = sweep_file(tmp_path)
    build = tmp_path / "build"
    result = kiln("sweep", path, "--executor", "kubernetes", "--build-dir", build,
                  "--set", "kubernetes.image=registry.example/kiln:1", "--set", "kubernetes.pvc=shared-cache",
                  "--set", "kubernetes.parallelism=1")
    assert result.exit_code == 0, result.output
    manifest = build / "sweeps" / "gpus" / "submissions" / "0001" / "job.yaml"
    assert validate_manifests([manifest]) == []
    assert "kubectl apply -f" in result.output
    docs = list(yaml.safe_load_all(manifest.read_text()))
    configmap, jobs = docs[0], docs[1:]
    assert configmap["kind"] == "ConfigMap" and len(jobs) == 3
    limits = {}
    for job in jobs:
        spec = job["spec"]
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        task = TaskFile.model_validate_json(configmap["data"][container["command"][-1].rsplit("/", 1)[1]])
        assert spec["completionMode"] == "Indexed" and spec["completions"] == len(task.points)
        assert spec["parallelism"] == 1 and spec["backoffLimitPerIndex"] == 0 and pod["restartPolicy"] == "Never"
        limits[container["resources"]["limits"]["nvidia.com/gpu"]] = [tp.label for tp in task.points]
        assert pod["securityContext"] == pod_security_context()
        assert container["securityContext"] == container_security_context()
        assert {"name": "build-cache", "persistentVolumeClaim": {"claimName": "shared-cache"}} in pod["volumes"]
        assert container["workingDir"] == "/kiln" and task.build_root == "build"
    assert limits == {1: ["tp=1", "tp=1, format=int8_sq"], 2: ["tp=2"], 4: ["tp=2, pp=2"]}

    # The validation is real: the same Job with a root container or an unknown field fails it.
    for mutate, expected in ((lambda j: j["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
                              "runAsNonRoot"),
                             (lambda j: j["spec"].update(completionsMode="Indexed"), "completionsMode")):
        broken = json.loads(json.dumps(docs))
        mutate(broken[1])
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump_all(broken))
        problems = validate_manifests([bad])
        assert problems and expected in " ".join(problems)


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    """A stand-in for one of Slurm's commands: a shell script that answers as the real one does."""
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n# stand-in for Slurm's {name} (test only)\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _submitted(kiln, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A one-point Slurm sweep submitted through stand-in sbatch/squeue: (sweep file, build dir, bin dir)."""
    path = sweep_file(tmp_path, set={"target": "reference", "quantization.format": "fp8"}, points=[{}])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "sbatch", "echo 77")
    _stand_in(bin_dir, "squeue", "cat \"$(dirname \"$0\")/queue\" 2>/dev/null; exit 0")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    build = tmp_path / "build"
    result = kiln("sweep", path, "--executor", "slurm", "--no-wait", "--build-dir", build)
    assert result.exit_code == 0, result.output
    assert "submitted job array 77" in result.output and "kiln sweep collect" in result.output
    return path, build, bin_dir


def test_collect_reports_queued_points_and_tasks_that_ended_without_a_result(kiln, tmp_path, monkeypatch):
    path, build, bin_dir = _submitted(kiln, tmp_path, monkeypatch)
    (bin_dir / "queue").write_text("77_0|PENDING\n")
    again = kiln("sweep", path, "--executor", "slurm", "--no-wait", "--build-dir", build)
    assert "1 queued or running, 0 to submit" in again.output  # not submitted twice
    pending = kiln("sweep", "collect", path, "--executor", "slurm", "--build-dir", build)
    assert pending.exit_code == 1 and "still queued or running" in pending.output

    (bin_dir / "queue").write_text("")
    _stand_in(bin_dir, "sacct", "echo 'OUT_OF_MEMORY|0:125'")
    log = build / "sweeps" / "gpus" / "submissions" / "0001" / "logs" / "77_0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "slurmstepd: error: Detected 1 oom_kill event\n")
    collected = kiln("sweep", "collect", path, "--executor", "slurm", "--build-dir", build)
    assert collected.exit_code == 1
    (record,) = [json.loads(line) for line in (build / "sweeps" / "gpus" / "results.jsonl").read_text().splitlines()]
    assert record["status"] == "failed"
    assert "ended without writing its result (OUT_OF_MEMORY, exit code 0:125)" in record["error"]
    assert record["log_tail"].endswith("oom_kill event") and "line 99" in record["log_tail"]
    assert "line 10\n" not in record["log_tail"]  # the tail, not the whole log
    assert "oom_kill event" in collected.output
    # A point that failed is submitted again on the next run (a retry), as a local sweep runs it again.
    retry = kiln("sweep", path, "--executor", "slurm", "--no-wait", "--build-dir", build)
    assert "0 done, 0 queued or running, 1 to submit" in retry.output


def test_a_task_whose_point_process_dies_still_records_a_failure_with_its_log_tail(tmp_path):
    task = TaskFile(sweep="s", submission="0001", group=0, executor="kubernetes", build_root=str(tmp_path / "build"),
                    repo_root=str(tmp_path / "repo"), write_log=True,
                    sweep_spec={"base": "x.yaml", "points": [{}]},
                    points=[TaskPoint(point=0, label="base", overrides={}, recipe="broken", fingerprint="f" * 64, key="k" * 64,
                                      gpus=0, recipe_yaml="name: broken\nquantization: {format: fp9}\n")])
    path = tmp_path / "task-0.json"
    path.write_text(task.model_dump_json())
    seen: list[bytes] = []
    code = run_task(path, 0, seen.append)
    assert code == 1
    record = json.loads((tmp_path / "build" / "sweeps" / "s" / "records" / ("k" * 64 + ".json")).read_text())
    assert record["status"] == "failed" and "before writing its result" in record["error"]
    assert "fp9" in record["log_tail"] and b"fp9" in b"".join(seen)  # passed on, and kept
    log = Path(record["task"]["log"])
    assert log.read_text() == b"".join(seen).decode() and log.name == "0_0.log"
    assert (tmp_path / "build" / "sweeps" / "s" / "submissions" / "0001" / "task-0.json").is_file()


def test_a_task_takes_its_index_from_the_option_or_the_schedulers_variable(kiln, tmp_path, monkeypatch):
    for name in ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = kiln("sweep", "task", bad, "--index", "0")
    assert result.exit_code == 2 and "not a kiln sweep task file" in result.output
    task = TaskFile(sweep="s", submission="0001", group=0, executor="slurm", build_root=str(tmp_path / "b"),
                    repo_root=str(tmp_path / "r"), write_log=False, sweep_spec={"base": "x.yaml", "points": [{}]},
                    points=[])
    path = tmp_path / "task-0.json"
    path.write_text(task.model_dump_json())
    result = kiln("sweep", "task", path)
    assert result.exit_code == 2 and "which point?" in result.output and "JOB_COMPLETION_INDEX" in result.output
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    result = kiln("sweep", "task", path)
    assert result.exit_code == 2 and "--index 3" in result.output


def test_a_point_is_found_by_its_steps_fingerprint_and_its_whole_recipe(tmp_path):
    """Two points whose outputs are the same (only a quality gate differs) share a fingerprint (so the runner
    hard-links one's steps for the other) but not a key: one may pass where the other fails."""
    from kiln.experiments.cluster import point_ids
    from kiln.experiments.sweep import load_sweep
    from kiln.pipeline.runner import Layout

    path = sweep_file(tmp_path, set={"target": "reference", "quantization.format": "fp8"},
                      points=[{}, {"evaluation.max_kl": 1e-12}, {"quantization.format": "int8_sq"}])
    layout = Layout(tmp_path / "build", tmp_path / "repo")
    ids = point_ids(load_sweep(path, layout), layout)
    assert ids[0].fingerprint == ids[1].fingerprint != ids[2].fingerprint
    assert len({i.key for i in ids.values()}) == 3
