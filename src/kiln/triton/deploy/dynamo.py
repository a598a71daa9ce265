"""Dynamo deployment files for a target-pytorch recipe (``deploy/<recipe>/dynamo/``).

:func:`write_dynamo_files` writes, from the packaged llmapi repository's facts (the unified checkpoint, kiln's LLM
arguments) and the recipe:

``launch.sh``
    One host: the recipe's Dynamo image (``tensorrtllm-runtime:<dynamo version>``, the container table's ``dynamo``
    role for the recipe's TensorRT-LLM) running the Dynamo frontend and ``serving.dynamo_workers``
    ``python3 -m dynamo.trtllm`` workers with kiln's LLM options (``--extra-engine-args``), file discovery and the
    TCP request plane (no etcd, no NATS).
``llm_options.yaml``
    The LLM arguments (model.yaml's, without the model), checked against the version's table by package.
``k8s/graph-aggregated.yaml`` / ``k8s/graph-disaggregated.yaml``
    ``DynamoGraphDeployment`` objects (``nvidia.com/v1beta1``): a frontend plus aggregated workers, or a frontend
    plus prefill and decode workers (``serving.dynamo_prefill_workers`` / ``dynamo_decode_workers``), each worker
    tp × pp GPUs; with a ConfigMap holding the LLM options. Every pod is hardened as kiln's other manifests
    (non-root uid 1000, no privilege escalation, no capabilities, RuntimeDefault seccomp, no service-account token)
    and every container requests CPU and memory.
``README.md``
    How to run them.

The object builders are one function per object (:func:`frontend_component`, :func:`worker_component`,
:func:`options_configmap`, :func:`graph_deployment`) so later steps (init containers, plan-based sizing) can extend
them. :func:`validate_graph_deployment` checks an object offline against an outline of the chosen Dynamo release's
v1beta1 structure (``kiln/triton/data/dynamo/dynamo-<version>.yaml``, with its sources; not the CRD itself: the only
stored CRDs are v1alpha1-only, see the data file), written in the CRD's own dialect and validated as the API server
does (:mod:`kiln.triton.deploy.crd`), and each pod template against Kubernetes' own PodTemplateSpec schema (strict).
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from kiln.recipe.containers import row_for
from kiln.recipe.schema import Recipe
from kiln.plan.host import PodSizing
from kiln.triton.deploy.info import CONTAINER_REPO, SHM_SIZE_GIB, RepoPull, k8s_name
from kiln.triton.deploy.k8s import (
    container_security_context,
    init_container,
    pod_security_context,
    repo_mount,
    repo_volumes,
)
from kiln.triton.deploy.render import _dump_yaml

DYNAMO_DIR = "dynamo"
#: The Dynamo release whose interfaces kiln writes against (the tests' PyPI release).
DYNAMO_RELEASE = "1.6.1"
OPTIONS_FILE = "llm_options.yaml"
OPTIONS_MOUNT = "/kiln/dynamo"
GRAPH_FILES = ("graph-aggregated.yaml", "graph-disaggregated.yaml")
#: CPU / memory requests per container. Placeholders until the plan sizes pods (issue 23): the frontend tokenizes
#: and routes; a TensorRT-LLM worker's host side loads the checkpoint and drives tp × pp GPUs.
FRONTEND_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
WORKER_CPU_PER_GPU, WORKER_MEMORY_GIB_PER_GPU = 4, 32


@functools.cache
def dynamo_data(release: str = DYNAMO_RELEASE) -> dict:
    """``data/dynamo/dynamo-<release>.yaml``: the release's flags, environment and DynamoGraphDeployment structure."""
    path = resources.files("kiln.triton").joinpath("data", "dynamo", f"dynamo-{release}.yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class DynamoDeploy:
    """What the Dynamo files need to know about a packaged recipe."""

    recipe_name: str
    image: str
    served_model_name: str
    tp: int
    pp: int
    http_port: int
    workers: int
    prefill_workers: int
    decode_workers: int
    checkpoint: str = f"{CONTAINER_REPO}/tensorrt_llm/1/checkpoint"
    hub_token_secret: Optional[str] = None
    repo_pull: Optional[RepoPull] = None
    """The repository comes from the remote cache: every pod's init step pulls it by digest (None: the user's PVC)."""
    sizing: Optional[PodSizing] = None
    """A worker pod's host memory, /dev/shm and CPU from the plan (kiln.plan.host); None: the fixed figures."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @classmethod
    def from_recipe(cls, recipe: Recipe, image: str, hub_token_secret: Optional[str] = None,
                    repo_pull: Optional[RepoPull] = None, sizing: Optional[PodSizing] = None) -> "DynamoDeploy":
        s = recipe.serving
        return cls(recipe_name=recipe.name, image=image, served_model_name=recipe.name, tp=recipe.parallelism.tp,
                   pp=recipe.parallelism.pp, http_port=s.http_port, workers=s.dynamo_workers,
                   prefill_workers=s.dynamo_prefill_workers, decode_workers=s.dynamo_decode_workers,
                   hub_token_secret=hub_token_secret, repo_pull=repo_pull, sizing=sizing)


# ------------------------------------------------------------------------------------------------ commands
def frontend_args(d: DynamoDeploy, host: str = "0.0.0.0") -> list[str]:
    return ["python3", "-m", "dynamo.frontend", "--http-host", host, "--http-port", str(d.http_port)]


def worker_args(d: DynamoDeploy, options: str, mode: str = "agg") -> list[str]:
    """``python3 -m dynamo.trtllm`` with the checkpoint, kiln's LLM options and the parallelism (``mode``: agg,
    prefill or decode)."""
    if mode not in dynamo_data()["trtllm_worker"]["disaggregation_modes"]:
        raise ValueError(f"disaggregation mode {mode!r} is not one of Dynamo {DYNAMO_RELEASE}'s")
    args = ["python3", "-m", "dynamo.trtllm", "--model-path", d.checkpoint, "--served-model-name",
            d.served_model_name, "--tensor-parallel-size", str(d.tp), "--pipeline-parallel-size", str(d.pp),
            "--extra-engine-args", options]
    return args + (["--disaggregation-mode", mode] if mode != "agg" else [])


# ------------------------------------------------------------------------------------------------ Kubernetes
def _labels(d: DynamoDeploy, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": k8s_name(d.recipe_name), "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "kiln"}


def _pod_spec(d: DynamoDeploy, container: dict[str, Any], gpu: bool) -> dict[str, Any]:
    repo = repo_volumes(d.repo_pull, _pvc(d), d.sizing.repo_bytes if d.sizing else 0)
    volumes: list[dict[str, Any]] = [
        repo[0],
        {"name": "llm-options", "configMap": {"name": options_configmap_name(d)}},
    ] + repo[1:]
    if gpu:
        shm = d.sizing.shm_gib if d.sizing else SHM_SIZE_GIB
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}})
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if d.repo_pull is not None:
        spec["initContainers"] = [init_container(d.repo_pull)]
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _pvc(d: DynamoDeploy) -> str:
    return f"{k8s_name(d.recipe_name)}-model-repo"


def _env(d: DynamoDeploy) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    if d.hub_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": d.hub_token_secret,
                                                                          "key": "HF_TOKEN"}}})
    return env


def _mounts(d: DynamoDeploy, gpu: bool) -> list[dict[str, Any]]:
    mounts = [repo_mount(d.repo_pull),
              {"name": "llm-options", "mountPath": OPTIONS_MOUNT, "readOnly": True}]
    return mounts + ([{"name": "dshm", "mountPath": "/dev/shm"}] if gpu else [])


def frontend_component(d: DynamoDeploy) -> dict[str, Any]:
    """The Dynamo frontend: the OpenAI API on ``serving.http_port``, probed on its health endpoint."""
    health = dynamo_data()["frontend"]["health_path"]
    probe = {"httpGet": {"path": health, "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "main",
        "image": d.image,
        "command": frontend_args(d),
        "ports": [{"name": "http", "containerPort": d.http_port, "protocol": "TCP"}],
        "env": _env(d),
        "resources": FRONTEND_RESOURCES,
        "startupProbe": {**probe, "failureThreshold": 60},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "volumeMounts": _mounts(d, False),
        "securityContext": container_security_context(),
    }
    return {"name": "Frontend", "type": "frontend", "replicas": 1,
            "podTemplate": {"metadata": {"labels": _labels(d, "frontend")},
                            "spec": _pod_spec(d, container, gpu=False)}}


def worker_component(d: DynamoDeploy, name: str, mode: str, replicas: int) -> dict[str, Any]:
    """TensorRT-LLM workers (``mode`` agg → type worker; prefill; decode), each tp × pp GPUs."""
    kind = {"agg": "worker", "prefill": "prefill", "decode": "decode"}[mode]
    container = {
        "name": "main",
        "image": d.image,
        "command": worker_args(d, f"{OPTIONS_MOUNT}/{OPTIONS_FILE}", mode),
        "env": _env(d),
        "resources": _worker_resources(d),
        "volumeMounts": _mounts(d, True),
        "securityContext": container_security_context(),
    }
    return {"name": name, "type": kind, "replicas": replicas,
            "podTemplate": {"metadata": {"labels": _labels(d, name.lower())},
                            "spec": _pod_spec(d, container, gpu=True)}}


def _worker_resources(d: DynamoDeploy) -> dict[str, Any]:
    """A worker's: from the plan when given (memory request = limit, CPU limit twice the request), else the fixed
    figures per GPU."""
    gpus = d.gpus
    if d.sizing is None:
        cpu, memory = WORKER_CPU_PER_GPU * gpus, f"{WORKER_MEMORY_GIB_PER_GPU * gpus}Gi"
    else:
        cpu, memory = d.sizing.cpu, f"{d.sizing.memory_mib}Mi"
    return {"requests": {"cpu": str(cpu), "memory": memory, "nvidia.com/gpu": gpus},
            "limits": {"cpu": str(2 * cpu), "memory": memory, "nvidia.com/gpu": gpus}}


def options_configmap_name(d: DynamoDeploy) -> str:
    return f"{k8s_name(d.recipe_name)}-dynamo-llm-options"


def options_configmap(d: DynamoDeploy, options_text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": options_configmap_name(d), "labels": _labels(d, "llm-options")},
            "data": {OPTIONS_FILE: options_text}}


def graph_deployment(d: DynamoDeploy, disaggregated: bool) -> dict[str, Any]:
    g = dynamo_data()["graph_deployment"]
    if disaggregated:
        workers = [worker_component(d, "prefill", "prefill", d.prefill_workers),
                   worker_component(d, "decode", "decode", d.decode_workers)]
    else:
        workers = [worker_component(d, "TRTLLMWorker", "agg", d.workers)]
    name = k8s_name(d.recipe_name) + ("-disagg" if disaggregated else "-agg")
    return {"apiVersion": g["apiVersion"], "kind": g["kind"],
            "metadata": {"name": name, "labels": _labels(d, "graph")},
            "spec": {"components": [frontend_component(d), *workers]}}


# ------------------------------------------------------------------------------------------------ validation
def validate_graph_deployment(doc: Any, where: str = "DynamoGraphDeployment",
                              kubernetes_versions: Optional[Sequence[str]] = None) -> list[str]:
    """Every problem of one DynamoGraphDeployment: its structure against Dynamo's (the pinned release's data), each
    component's podTemplate as a strict Kubernetes PodTemplateSpec, and kiln's policy (CPU and memory requested by
    every container, non-root pods, no privilege escalation)."""
    from kiln.triton.deploy.crd import crd_validator
    from kiln.triton.deploy.validate import _validate_core, default_kubernetes_versions

    problems: list[str] = []
    g = dynamo_data()["graph_deployment"]
    for e in sorted(crd_validator(g["schema"]).iter_errors(doc), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in e.absolute_path) or "(top)"
        problems.append(f"{where}: {path}: {e.message} (Dynamo {DYNAMO_RELEASE} DynamoGraphDeployment)")
    if problems or not isinstance(doc, dict):
        return problems
    # what the API server routes on: a kind and a version the CRD serves
    group = g["apiVersion"].split("/", 1)[0]
    served = [f"{group}/{v}" for v in g["served_versions"]]
    if doc["apiVersion"] not in served:
        problems.append(f"{where}: apiVersion: {' or '.join(repr(v) for v in served)} was expected, not "
                        f"{doc['apiVersion']!r} (the versions Dynamo {DYNAMO_RELEASE}'s CRD serves, as kiln has it)")
    if doc["kind"] != g["kind"]:
        problems.append(f"{where}: kind: {g['kind']!r} was expected, not {doc['kind']!r}")
    # the CRD's CEL rules (x-kubernetes-validations: not run offline) that kiln checks itself
    versions = tuple(kubernetes_versions or default_kubernetes_versions())
    names = [c["name"].lower() for c in doc["spec"]["components"]]  # v1beta1: unique case-insensitively
    problems += [f"{where}: spec.components: name {n!r} appears twice (names must be unique case-insensitively)"
                 for n in sorted(set(names)) if names.count(n) > 1]
    if sum(c["type"] == "epp" for c in doc["spec"]["components"]) > 1:
        problems.append(f"{where}: spec.components: at most one component may have type epp")
    for i, comp in enumerate(doc["spec"]["components"]):
        at = f"{where}: spec.components.{i} ({comp['name']})"
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": k8s_name(comp["name"])},
                    "template": comp["podTemplate"]}
        problems += _validate_core(template, f"{at}.podTemplate", versions)
        spec = comp["podTemplate"].get("spec") or {}
        sc = spec.get("securityContext") or {}
        if sc.get("runAsNonRoot") is not True:
            problems.append(f"{at}: the pod does not set securityContext.runAsNonRoot: true")
        for c in spec.get("containers") or []:
            req = (c.get("resources") or {}).get("requests") or {}
            for res in ("cpu", "memory"):
                if res not in req:
                    problems.append(f"{at}: container {c.get('name')!r} requests no {res} (resources.requests.{res})")
            csc = c.get("securityContext") or {}
            if csc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{at}: container {c.get('name')!r} allows privilege escalation")
    return problems


def validate_dynamo_manifests(paths: Sequence[Path]) -> list[str]:
    """Every problem of kiln's Dynamo manifest files (DynamoGraphDeployments and the core objects beside them)."""
    from kiln.triton.deploy.validate import _validate_core, default_kubernetes_versions

    problems: list[str] = []
    versions = default_kubernetes_versions()
    for path in paths:
        for i, doc in enumerate(yaml.safe_load_all(Path(path).read_text(encoding="utf-8"))):
            where = f"{Path(path).name}[{i}]"
            if isinstance(doc, dict) and doc.get("kind") == "DynamoGraphDeployment":
                problems += validate_graph_deployment(doc, where, versions)
            elif doc is not None:
                problems += _validate_core(doc, where, versions)
    return problems


# ------------------------------------------------------------------------------------------------ files
def render_launch_script(d: DynamoDeploy) -> str:
    """One host: the Dynamo image running the frontend and ``workers`` TensorRT-LLM workers (one per tp × pp GPUs)."""
    env = ("-e DYN_FILE_KV=/tmp/dynamo-kv -e DYN_DISCOVERY_BACKEND=file -e DYN_REQUEST_PLANE=tcp "
           "-e HF_HUB_OFFLINE=1")
    inner = [" ".join(shlex.quote(w) for w in frontend_args(d)) + " &"]
    for i in range(d.workers):
        first = i * d.gpus
        devices = ",".join(str(g) for g in range(first, first + d.gpus))
        inner.append(f"CUDA_VISIBLE_DEVICES={devices} "
                     + " ".join(shlex.quote(w) for w in worker_args(d, f"{OPTIONS_MOUNT}/{OPTIONS_FILE}")) + " &")
    body = " ".join(inner) + " wait -n"
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Dynamo for kiln recipe {d.recipe_name!r} (target pytorch) on one host: the Dynamo frontend (OpenAI API on",
        f"# port {d.http_port}) and {d.workers} TensorRT-LLM worker(s) (python3 -m dynamo.trtllm, {d.gpus} GPU(s) each)",
        f"# in {d.image}, file discovery and the TCP request plane (no etcd, no NATS). Written by kiln: change the",
        "# recipe and package again. MODEL_REPO: the packaged repository (default: ../../../triton_repo/<recipe>).",
        "set -euo pipefail",
        'here="$(cd "$(dirname "$0")" && pwd)"',
        f'MODEL_REPO="${{MODEL_REPO:-$here/../../../triton_repo/{d.recipe_name}}}"',
        f"exec docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
        f"--user 1000:1000 -p {d.http_port}:{d.http_port} {env} "
        f'-v "$MODEL_REPO:{CONTAINER_REPO}:ro" -v "$here:{OPTIONS_MOUNT}:ro" '
        f"{shlex.quote(d.image)} bash -c {shlex.quote(body)}",
        "",
    ])


def render_readme(d: DynamoDeploy) -> str:
    return "\n".join([
        f"# Dynamo deployment of {d.recipe_name}",
        "",
        f"TensorRT-LLM on the PyTorch backend behind NVIDIA Dynamo (image `{d.image}`, Dynamo {DYNAMO_RELEASE}'s",
        "interfaces), loading the unified checkpoint of the packaged repository with kiln's LLM options",
        f"(`{OPTIONS_FILE}`).",
        "",
        "- `./launch.sh`: one host, Docker with the NVIDIA Container Toolkit; the OpenAI API on port "
        f"{d.http_port} (`/v1/models`, `/v1/completions`, `/v1/chat/completions`).",
        "- `k8s/graph-aggregated.yaml`: a DynamoGraphDeployment (needs Dynamo's operator and CRDs) with the frontend "
        f"and {d.workers} aggregated worker(s) of {d.gpus} GPU(s); `k8s/graph-disaggregated.yaml`: the frontend, "
        f"{d.prefill_workers} prefill and {d.decode_workers} decode worker(s) (serving.dynamo_prefill_workers / "
        "dynamo_decode_workers). "
        + (f"In every pod an init container pulls the packaged repository `{d.repo_pull.tag}` by digest "
           f"`{d.repo_pull.digest}` from `{d.repo_pull.cache}` and verifies it (the registry Secret "
           f"`{d.repo_pull.registry_secret}` is the only object made by hand: see ../README.md); the pods mount it "
           "and the LLM options from the ConfigMap in the same file." if d.repo_pull is not None else
           f"Both mount the model repository from the PersistentVolumeClaim `{_pvc(d)}` (without a remote cache, "
           "e.g. air-gapped: fill it with the packaged repository) and the LLM options from the ConfigMap in the "
           "same file."),
        "",
        "On a machine without a GPU, `kiln serve RECIPE --stack dynamo` runs the real Dynamo frontend in front of",
        "kiln's CPU reference runtime: a test and development vehicle, not this deployment.",
        "",
    ])


def write_dynamo_files(d: DynamoDeploy, llm_args: dict[str, Any], deploy_dir: Path) -> list[Path]:
    """``deploy/<recipe>/dynamo/``: launch.sh, llm_options.yaml, k8s/graph-*.yaml, README.md; validated (raises
    ``ValueError`` listing every problem before anything is left half-written by the caller's atomic directory)."""
    from kiln.triton.llmapi import container_llm_args, dump_yaml

    out = deploy_dir / DYNAMO_DIR
    (out / "k8s").mkdir(parents=True, exist_ok=True)
    # the draft checkpoint by its path in the worker's container (model.yaml names it relative to the version
    # directory, which only kiln's llmapi model.py resolves)
    options = {k: v for k, v in container_llm_args(llm_args, CONTAINER_REPO).items() if k != "model"}
    options_text = dump_yaml(options, f"# LLM options (dynamo.trtllm --extra-engine-args) of kiln recipe "
                                      f"{d.recipe_name!r}: tensorrt_llm/1/model.yaml's LLM arguments")
    written = []
    (out / OPTIONS_FILE).write_text(options_text, encoding="utf-8")
    written.append(out / OPTIONS_FILE)
    launch = out / "launch.sh"
    launch.write_text(render_launch_script(d), encoding="utf-8")
    launch.chmod(0o755)
    written.append(launch)
    header = (f"# Dynamo deployment of kiln recipe {d.recipe_name!r}: DynamoGraphDeployment "
              f"({dynamo_data()['graph_deployment']['apiVersion']}, Dynamo {DYNAMO_RELEASE}) and the ConfigMap of "
              "its LLM options. Written by kiln: change the recipe and package again.\n")
    for file_name, disagg in zip(GRAPH_FILES, (False, True)):
        path = out / "k8s" / file_name
        path.write_text(_dump_yaml([options_configmap(d, options_text), graph_deployment(d, disagg)], header),
                        encoding="utf-8")
        written.append(path)
    readme = out / "README.md"
    readme.write_text(render_readme(d), encoding="utf-8")
    written.append(readme)
    problems = validate_dynamo_manifests([p for p in written if p.suffix == ".yaml" and "k8s" in p.parts])
    if problems:
        raise ValueError("generated Dynamo manifests do not validate:\n  " + "\n  ".join(problems))
    return written


def dynamo_image(recipe: Recipe) -> str:
    """The recipe's Dynamo image: the container table's Dynamo runtime image pinning its TensorRT-LLM, else (1.2.1:
    no Dynamo release pins it) the newest Dynamo TensorRT-LLM image, whose own TensorRT-LLM loads the same unified
    checkpoint (the LLM options are then checked against that version's table too)."""
    from kiln.recipe.containers import CONTAINER_ROWS, ROLES, dynamo_image_for

    found = dynamo_image_for(recipe.engine_runtime.trtllm_version)
    if found:
        return found
    rows = [r for r in CONTAINER_ROWS if r.image.split("@", 1)[0].rsplit(":", 1)[0] in ROLES.dynamo and r.verified]
    return rows[-1].image


def image_stacks(image: str) -> tuple[str, ...]:
    """The serving stacks the table says ``image`` carries (empty when the table does not know it)."""
    row = row_for(image)
    return tuple(row.stacks) if row else ()
