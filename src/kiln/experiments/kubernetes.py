"""Kubernetes: one Indexed Job per submission (one per GPU count), one pod per point.

``kiln sweep SWEEP.yaml --executor kubernetes`` writes ``submissions/<id>/job.yaml``: a ConfigMap with the
task files (each point's fully resolved recipe) and, per GPU count, a ``batch/v1`` Job with
``completionMode: Indexed``; pod *i* runs point *i* of its task file. Kubernetes gives each pod its index in
``JOB_COMPLETION_INDEX`` (kubernetes.io/docs/tasks/job/indexed-parallel-processing-static), which
``kiln sweep task`` reads. Each pod:

- mounts the build cache, a ReadWriteMany PersistentVolumeClaim you create (``kubernetes.pvc``), at
  ``kubernetes.mount_path`` and works there, so the cache is ``<mount_path>/build`` and the tasks write their
  records and logs under ``build/sweeps/<name>/``; kiln's model cache and Hugging Face's live there too;
- asks for the point's tp × pp GPUs as a limit of ``kubernetes.gpu_resource`` (none for the CPU reference
  target), with a toleration for ``nvidia.com/gpu`` taints;
- follows the deploy files' security rules (:func:`kiln.triton.deploy.pod_security_context`,
  :func:`~kiln.triton.deploy.container_security_context`: non-root uid 1000, no privilege escalation, all
  capabilities dropped, RuntimeDefault seccomp, no service-account token);
- fails alone: ``backoffLimitPerIndex`` (beta and on by default from Kubernetes 1.29, per the bundled 1.30
  schema) keeps one failed point from failing the others.

kiln validates the file offline like the deploy manifests (kubernetes-validate, strict, against the oldest and
newest Kubernetes it supports, plus kiln's pod policy) and prints the ``kubectl apply`` command: there is no
cluster on the machine kiln is developed on, so this path has been validated and run locally (the pod's
command, once per index, in a directory shaped like the PVC), never on a cluster. ``kiln sweep collect
--build-dir <PVC>/build`` gathers the records from the PVC (mounted, or copied with ``kubectl cp``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.experiments.executors import KubernetesSettings
from kiln.experiments.tasks import TaskFile
from kiln.util.errors import KilnError

TASK_MOUNT = "/etc/kiln-sweep"
BUILD_DIR = "build"
REPO_DIR = "triton_repo"
CONFIGMAP_MAX_BYTES = 1024 * 1024  # Kubernetes' limit on a ConfigMap's data
SHM_SIZE = "8Gi"


def object_name(sweep: str, submission: str, group: int | None = None) -> str:
    from kiln.triton.deploy import k8s_name

    return k8s_name(f"kiln-sweep-{sweep}-{submission}" + (f"-{group}" if group is not None else ""))


def _labels(sweep: str, submission: str) -> dict[str, str]:
    from kiln.triton.deploy import k8s_name

    return {"app.kubernetes.io/name": k8s_name(f"kiln-sweep-{sweep}"), "app.kubernetes.io/component": "sweep",
            "app.kubernetes.io/managed-by": "kiln", "kiln.dev/submission": submission}


def pod_command(settings: KubernetesSettings, task: TaskFile) -> list[str]:
    return [*settings.kiln, "sweep", "task", f"{TASK_MOUNT}/task-{task.group}.json"]


def _job(task: TaskFile, settings: KubernetesSettings, configmap: str) -> dict[str, Any]:
    from kiln.triton.deploy import container_security_context, pod_security_context

    n = len(task.points)
    gpus = task.points[0].gpus
    mount = settings.mount_path
    resources: dict[str, Any] = {}
    if gpus:
        resources.setdefault("limits", {})[settings.gpu_resource] = gpus
    if settings.cpu:
        resources.setdefault("requests", {})["cpu"] = settings.cpu
    if settings.memory:
        resources.setdefault("requests", {})["memory"] = settings.memory
        resources.setdefault("limits", {})["memory"] = settings.memory
    container = {
        "name": "kiln",
        "image": settings.image,
        "command": pod_command(settings, task),
        "workingDir": mount,
        "env": [{"name": "HOME", "value": "/tmp"},  # uid 1000 has no home directory
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "KILN_CACHE_DIR", "value": f"{mount}/cache/kiln"},
                {"name": "HF_HOME", "value": f"{mount}/cache/huggingface"}],
        "resources": resources,
        "volumeMounts": [{"name": "build-cache", "mountPath": mount},
                         {"name": "tasks", "mountPath": TASK_MOUNT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": container_security_context(),
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [{"name": "build-cache", "persistentVolumeClaim": {"claimName": settings.pvc}},
                    {"name": "tasks", "configMap": {"name": configmap}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}],
    }
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    labels = _labels(task.sweep, task.submission)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": object_name(task.sweep, task.submission, task.group), "namespace": settings.namespace,
                     "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": n,
            "parallelism": min(settings.parallelism or n, n),
            "backoffLimitPerIndex": settings.retries,
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


def render_objects(tasks: list[TaskFile], settings: KubernetesSettings) -> list[dict[str, Any]]:
    """The ConfigMap with every task file, then one Indexed Job per task file."""
    first = tasks[0]
    configmap = object_name(first.sweep, first.submission)
    data = {f"task-{t.group}.json": t.model_dump_json(indent=1) for t in tasks}
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size > CONFIGMAP_MAX_BYTES:
        raise KilnError(f"the task files are {size / 2**20:.1f} MiB, more than a ConfigMap holds (1 MiB): "
                        "split the sweep (fewer points per submission)")
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": configmap, "namespace": settings.namespace, "labels": _labels(first.sweep, first.submission)},
        "data": data,
    }]
    objects += [_job(t, settings, configmap) for t in tasks]
    return objects


def write_manifest(path: Path, objects: list[dict[str, Any]], header: str) -> list[str]:
    """Write the objects as one YAML file and validate it offline; the problems found ([] when valid)."""
    import yaml

    from kiln.triton.deploy import validate_manifests

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def _text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:  # the task files as readable blocks
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    _Dumper.add_representer(str, _text)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120))
    return validate_manifests([path])
