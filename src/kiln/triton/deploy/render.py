"""Render the deployment files: ``launch.sh``, ``docker-compose.yml``, ``k8s/*.yaml`` and ``README.md``.

:func:`write_deploy_files` writes them all; the ``render_*`` functions and :func:`k8s_objects` give their
content. See :mod:`kiln.triton.deploy` for what each file does and where the facts come from.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from kiln.triton.deploy import openai_sidecar
from kiln.plan.host import PodSizing
from kiln.triton.deploy.info import (
    CONTAINER_REPO,
    INIT_MOUNT,
    REGISTRY_AUTH_MOUNT,
    RepoPull,
    LWS_API_VERSION,
    LWS_KIND,
    RUN_AS_UID,
    SHM_SIZE_GIB,
    SSH_PORT,
    WORKER_WAIT_S,
    DeployInfo,
    k8s_name,
)
from kiln.util.errors import InputError

#: Files kiln writes under ``k8s/``; any of them left from an earlier package run is removed.
K8S_FILES = ("deployment.yaml", "service.yaml", "leaderworkerset.yaml", "configmap.yaml")

_REFERENCE_NOTE = "# target: reference -- the CPU test and development vehicle, not a fast path; no GPU is reserved."
_REPO_MARK = "\x00KILN_MODEL_REPO\x00"  # stands for "${MODEL_REPO}" while argv lists are rendered to shell


# ------------------------------------------------------------------------------------------ the command


#: The Triton flags upstream's launch script adds in orchestrator mode (spawned processes allocate their own
#: pools): TensorRT-LLM triton_backend/scripts/launch_triton_server.py, --multi-model.
ORCHESTRATOR_ENV = ("TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1")


def launch_command(info: DeployInfo, repo: str) -> list[list[str]]:
    """The ``tritonserver`` argv of every rank, rank 0 first (one list when ``world_size == 1``).

    Every rank: ``--model-repository``, the three ports, ``--disable-auto-complete-config`` (kiln writes
    complete configs). With more than one rank, each also gets its own Python-backend shared-memory prefix,
    and ranks above 0 load only :attr:`DeployInfo.tensorrt_llm_model_names` and open no endpoints. Join
    them with :func:`mpirun_command`; :func:`server_command` gives the argv for one host.
    """
    ranks: list[list[str]] = []
    if info.orchestrator_gpus:  # one process: the orchestrator spawns each model's ranks on its own GPUs
        argv = ["tritonserver", f"--model-repository={repo}", f"--http-port={info.http_port}",
                f"--grpc-port={info.grpc_port}", f"--metrics-port={info.metrics_port}",
                "--disable-auto-complete-config", "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
        argv += [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(info.orchestrator_gpus)]
        return [argv]
    for rank in range(1 if info.llmapi else info.world_size):  # llmapi: the LLM API starts its own ranks
        argv = [
            "tritonserver",
            f"--model-repository={repo}",
            f"--http-port={info.http_port}",
            f"--grpc-port={info.grpc_port}",
            f"--metrics-port={info.metrics_port}",
            "--disable-auto-complete-config",
        ]
        if not info.gpu:
            argv.append("--allow-gpu-metrics=false")  # reference target: no GPU to read metrics from
        if info.world_size > 1 and not info.llmapi:
            argv.append(f"--backend-config=python,shm-region-prefix-name=prefix{rank}_")
        if rank > 0:
            argv.append("--model-control-mode=explicit")
            argv += [f"--load-model={name}" for name in info.tensorrt_llm_model_names]
            argv += ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
        ranks.append(argv)
    return ranks


def mpirun_command(info: DeployInfo, repo: str, *, mpirun_args: Sequence[str] = ()) -> list[str]:
    """``mpirun --allow-run-as-root [mpirun_args] -n 1 <rank 0> : -n 1 <rank 1> : ...`` (leader mode)."""
    argv = ["mpirun", "--allow-run-as-root", *mpirun_args]
    for rank, rank_argv in enumerate(launch_command(info, repo)):
        if rank:
            argv.append(":")
        argv += ["-n", "1", *rank_argv]
    return argv


def server_command(info: DeployInfo, repo: str) -> list[str]:
    """The argv that starts the server on one host: ``tritonserver ...`` for one rank, else ``mpirun ...``."""
    if info.orchestrator_gpus:
        return ["env", *ORCHESTRATOR_ENV, *launch_command(info, repo)[0]]
    if info.world_size == 1 or info.llmapi:
        return launch_command(info, repo)[0]
    return mpirun_command(info, repo)


def _sh(word: str) -> str:
    """Quote one argv word for bash; the repository marker becomes a quoted ``${MODEL_REPO}``."""
    if _REPO_MARK not in word:
        return shlex.quote(word)
    escaped = re.sub(r'([\\"$`])', r"\\\1", word)
    return '"' + escaped.replace(_REPO_MARK, "${MODEL_REPO}") + '"'


def render_launch_script(info: DeployInfo) -> str:
    """The text of ``launch.sh`` (see the module docstring)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# Start Triton Inference Server for kiln recipe {info.recipe_name!r}: {info.world_size} rank(s).",
        "# Written by kiln; change the recipe and package again rather than editing this file.",
    ]
    if not info.gpu:
        lines.append("# target: reference -- the CPU test and development vehicle, not a fast path; no GPU is used.")
    lines += [
        "#",
        "# Environment:",
        f"#   MODEL_REPO         the model repository (default {CONTAINER_REPO}, where docker-compose.yml and the",
        "#                      Kubernetes manifests mount it; set it to run on a host with tritonserver installed)",
    ]
    if info.world_size > 1 and not info.llmapi:
        lines += [
            "#   KILN_MPI_HOSTFILE  spread the ranks over several nodes: an Open MPI hostfile, this node first,",
            "#                      `<host> slots=<GPUs>` per line (k8s leader.sh writes it). Remote ranks start",
            "#                      over ssh (OMPI_MCA_plm_rsh_args); empty: every rank on this host.",
        ]
    lines += [
        "set -euo pipefail",
        "",
        f'MODEL_REPO="${{MODEL_REPO:-{CONTAINER_REPO}}}"',
        'if [[ ! -d "${MODEL_REPO}" ]]; then',
        '  echo "launch.sh: model repository ${MODEL_REPO} is not a directory; set MODEL_REPO" >&2',
        "  exit 2",
        "fi",
    ]
    if info.llmapi:
        lines += ["", "# Triton's llmapi model: TensorRT-LLM's PyTorch backend loads the unified checkpoint named in",
                  "# tensorrt_llm/1/model.yaml (relative to that directory) and starts its tp × pp ranks itself."]
    if info.gpu and not info.llmapi:
        lines += [
            "",
            "# The engine only loads with the TensorRT-LLM and TensorRT that built it (kiln.json records them):",
            "# refuse a mismatch now, with the command that rebuilds it for this container.",
            'python3 "${MODEL_REPO}/kiln_check_engine.py" "${MODEL_REPO}"',
            "",
            f"# The tensorrt_llm configs name their engines under {CONTAINER_REPO} (where compose and Kubernetes mount",
            "# the repository). Elsewhere, serve a shadow repository: the same models, linked, with those paths",
            "# pointing into MODEL_REPO.",
            f'if [[ "$(cd "${{MODEL_REPO}}" && pwd -P)" != "{CONTAINER_REPO}" ]]; then',
            '  shadow="$(mktemp -d "${TMPDIR:-/tmp}/kiln-repo.XXXXXX")"',
            "  python3 - \"${MODEL_REPO}\" \"${shadow}\" <<'PY'",
            "import os, sys",
            "src, dst = os.path.abspath(sys.argv[1]), sys.argv[2]",
            "for name in sorted(os.listdir(src)):",
            "    model = os.path.join(src, name)",
            "    if not os.path.isfile(os.path.join(model, 'config.pbtxt')):",
            "        continue",
            "    os.makedirs(os.path.join(dst, name))",
            "    for entry in os.listdir(model):",
            "        if entry != 'config.pbtxt':",
            "            os.symlink(os.path.join(model, entry), os.path.join(dst, name, entry))",
            "    with open(os.path.join(model, 'config.pbtxt')) as fh:",
            "        text = fh.read()",
            f"    text = text.replace('\"{CONTAINER_REPO}/' + name + '/1/engine\"', '\"' + os.path.join(model, '1', 'engine') + '\"')",
            "    with open(os.path.join(dst, name, 'config.pbtxt'), 'w') as fh:",
            "        fh.write(text)",
            "PY",
            '  MODEL_REPO="${shadow}"',
            "fi",
        ]
    lines.append("")
    ranks = launch_command(info, _REPO_MARK)
    if info.orchestrator_gpus:
        lines += ["# Draft+target with tp × pp > 1: TensorRT-LLM's orchestrator mode (upstream's --multi-model): one",
                  "# server process spawns each model's ranks on the GPUs its gpu_device_ids names."]
        lines += [f"export {kv}" for kv in ORCHESTRATOR_ENV]
        lines.append("exec " + " ".join(_sh(w) for w in ranks[0]))
        return "\n".join(lines) + "\n"
    if info.world_size == 1 or info.llmapi:
        lines.append("exec " + " ".join(_sh(w) for w in ranks[0]))
        return "\n".join(lines) + "\n"
    lines += [
        "mpi_args=(--allow-run-as-root)",
        'if [[ -n "${KILN_MPI_HOSTFILE:-}" ]]; then',
        "  # --prefix lets the remote side find Open MPI's daemon; -x forwards what the ranks need.",
        '  mpi_prefix="$(dirname "$(dirname "$(command -v mpirun)")")"',
        '  mpi_args+=(--hostfile "${KILN_MPI_HOSTFILE}" --prefix "${mpi_prefix}" -x PATH -x LD_LIBRARY_PATH -x HOME)',
        "fi",
        "",
        "# Rank 0 loads the whole repository and serves; ranks above 0 load only the TensorRT-LLM model(s).",
        'exec mpirun "${mpi_args[@]}" \\',
    ]
    for rank, argv in enumerate(ranks):
        prefix = "  " if rank == 0 else "  : "
        tail = " \\" if rank < len(ranks) - 1 else ""
        lines.append(prefix + "-n 1 " + " ".join(_sh(w) for w in argv) + tail)
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- compose


def compose_spec(info: DeployInfo, repo_source: str) -> dict[str, Any]:
    """The Docker Compose document: one ``triton`` service; ``repo_source`` is the repository's path as the
    compose file sees it (relative to its directory)."""
    service: dict[str, Any] = {
        "image": info.image,
        "command": server_command(info, CONTAINER_REPO),
        "user": f"{RUN_AS_UID}:{RUN_AS_UID}",
        "init": True,
        "environment": ["HOME=/tmp"] + (["HF_TOKEN"] if info.hub_token_secret else []),
        "ports": [f"{p}:{p}" for p in (info.http_port, info.grpc_port, info.metrics_port)],
        "shm_size": f"{_sizing(info).shm_gib}gb",
        "ulimits": {"memlock": -1, "stack": 67108864},
        "volumes": [{"type": "bind", "source": repo_source, "target": CONTAINER_REPO, "read_only": True}],
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", f"http://localhost:{info.http_port}/v2/health/ready"],
            "interval": "15s",
            "timeout": "5s",
            "retries": 3,
            "start_period": "30m",  # loading engines can take many minutes
        },
        "stop_grace_period": "60s",
    }
    if info.gpu:
        service["deploy"] = {
            "resources": {
                "reservations": {"devices": [{"driver": "nvidia", "count": info.world_size, "capabilities": ["gpu"]}]}
            }
        }
    services: dict[str, Any] = {}
    pull = info.repo_pull
    if pull is not None:
        # A one-shot service pulls the repository by digest into a named volume; Triton (and the sidecar) mount
        # the digest's folder of it once that service has completed.
        services["fetch-repo"] = {
            "image": pull.init_image,
            "command": pull.command(),
            "user": f"{RUN_AS_UID}:{RUN_AS_UID}",
            "environment": ["HOME=/tmp", "KILN_REGISTRY_USERNAME", "KILN_REGISTRY_PASSWORD"],
            "volumes": [{"type": "volume", "source": "model-repo", "target": INIT_MOUNT}],
            "restart": "no",
        }
        service["volumes"] = [_compose_repo_volume(pull)]
        service["depends_on"] = {"fetch-repo": {"condition": "service_completed_successfully"}}
    services["triton"] = service
    if info.openai is not None:
        services["openai"] = openai_sidecar.compose_service(info, repo_source)
        if pull is not None:
            services["openai"]["volumes"] = [_compose_repo_volume(pull)]
    spec: dict[str, Any] = {"name": k8s_name(info.recipe_name), "services": services}
    if pull is not None:
        spec["volumes"] = {"model-repo": {}}
    return spec


def _compose_repo_volume(pull: Any) -> dict[str, Any]:
    return {"type": "volume", "source": "model-repo", "target": CONTAINER_REPO, "read_only": True,
            "volume": {"subpath": pull.folder}}


def _compose_header(info: DeployInfo) -> str:
    lines = [
        f"# Triton for kiln recipe {info.recipe_name!r} on one host: `docker compose up -d` (see README.md).",
        "# Written by kiln; change the recipe and package again rather than editing this file.",
    ]
    if not info.gpu:
        lines.append(_REFERENCE_NOTE)
    elif info.multi_node:
        lines.append(
            f"# {info.world_size} ranks > hardware.gpus_per_node ({info.gpus_per_node}): this needs one host with "
            f"{info.world_size} GPUs; across nodes use k8s/leaderworkerset.yaml."
        )
    if info.hub_token_secret:
        lines.append("# HF_TOKEN is passed through from the shell that runs `docker compose` (never stored here).")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- Kubernetes


def _labels(info: DeployInfo, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": k8s_name(info.recipe_name),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "kiln",
    }


def _selector(info: DeployInfo, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": k8s_name(info.recipe_name), "app.kubernetes.io/component": component}


def _prometheus(info: DeployInfo) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(info.metrics_port),
        "prometheus.io/path": "/metrics",
    }


def pvc_name(info: DeployInfo) -> str:
    """The PersistentVolumeClaim holding the model repository (created by the user, see README.md)."""
    return f"{k8s_name(info.recipe_name)}-model-repo"


def ssh_secret_name(info: DeployInfo) -> str:
    """The Secret with the ssh key pair ``mpirun`` uses between pods of a multi-node group."""
    return f"{k8s_name(info.recipe_name)}-mpi-ssh"


def _configmap_name(info: DeployInfo) -> str:
    return f"{k8s_name(info.recipe_name)}-scripts"


def _env(info: DeployInfo, *, hub_token: bool = True) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]  # uid 1000 has no home directory
    if hub_token and info.hub_token_secret:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": info.hub_token_secret, "key": "HF_TOKEN"}}}
        )
    return env


def container_security_context() -> dict[str, Any]:
    """Every kiln container's securityContext: non-root uid/gid 1000, no privilege escalation, no capabilities
    (also used by `kiln sweep --executor kubernetes`)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_UID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probes(info: DeployInfo) -> dict[str, Any]:
    def get(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": failures,
        }

    return {
        # Triton opens its endpoints only after loading every model: start-up gets the plan's time for it
        # (kiln.plan.host: base + safety × weights ÷ read rate).
        "startupProbe": get("/v2/health/ready", 10, -(-_sizing(info).startup_seconds // 10)),
        "readinessProbe": get("/v2/health/ready", 10, 3),
        "livenessProbe": get("/v2/health/live", 15, 4),
    }


def _tcp_probes(port: str) -> dict[str, Any]:
    def tcp(period: int, failures: int) -> dict[str, Any]:
        return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 5, "failureThreshold": failures}

    return {"startupProbe": tcp(5, 60), "readinessProbe": tcp(10, 3), "livenessProbe": tcp(15, 4)}


def _server_ports(info: DeployInfo) -> list[dict[str, Any]]:
    return [
        {"name": "http", "containerPort": info.http_port, "protocol": "TCP"},
        {"name": "grpc", "containerPort": info.grpc_port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": info.metrics_port, "protocol": "TCP"},
    ]


def _sizing(info: DeployInfo) -> PodSizing:
    """The pod's figures: the plan's (the package step passes them), else the same formulas with no weights
    counted (a caller that built a DeployInfo by hand)."""
    if info.sizing is not None:
        return info.sizing
    from kiln.plan.host import pod_sizing

    gpus = max(info.gpus_per_pod, 1)
    return pod_sizing(rank_weight_bytes=0, total_weight_bytes=0, ranks_on_pod=gpus, gpus_on_pod=gpus, vocab_size=0,
                      python_models=1 if info.llmapi else 3, tokenizer_loads=1 if info.llmapi else 2,
                      basis="no plan given: weights not counted")


def _resources(info: DeployInfo) -> dict[str, Any]:
    """The serving container's: host memory and CPU from the plan (kiln.plan.host), memory limit = request (the
    memory-backed /dev/shm counts against it), CPU limit twice the request; the pod's GPUs."""
    sizing = _sizing(info)
    memory = f"{sizing.memory_mib}Mi"
    requests: dict[str, Any] = {"cpu": str(sizing.cpu), "memory": memory}
    limits: dict[str, Any] = {"cpu": str(2 * sizing.cpu), "memory": memory}
    if info.gpu:  # reference target: CPU only, no GPU reserved
        limits["nvidia.com/gpu"] = info.gpus_per_pod
    return {"requests": requests, "limits": limits}


#: The init step streams layers to disk in 1 MiB chunks: small, fixed needs whatever the repository's size.
INIT_RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}


def repo_volumes(pull: RepoPull | None, pvc: str, repo_bytes: int) -> list[dict[str, Any]]:
    """The ``model-repo`` volume (and the registry Secret's): the user's PVC without a pull; with one, the cache PVC
    or an emptyDir with room for the repository (its bytes and a tenth more)."""
    if pull is None:
        return [{"name": "model-repo", "persistentVolumeClaim": {"claimName": pvc, "readOnly": True}}]
    if pull.cache_pvc:
        repo: dict[str, Any] = {"name": "model-repo", "persistentVolumeClaim": {"claimName": pull.cache_pvc}}
    else:
        repo = {"name": "model-repo", "emptyDir": {"sizeLimit": f"{-(-repo_bytes * 11 // 10 // (1 << 20)) + 64}Mi"}}
    return [repo, {"name": "registry-auth", "secret": {
        "secretName": pull.registry_secret, "optional": True, "defaultMode": 0o440,
        "items": [{"key": ".dockerconfigjson", "path": "config.json"}]}}]


def repo_mount(pull: RepoPull | None) -> dict[str, Any]:
    """Where a container reads the repository: ``/models``, the init step's folder for the digest when pulled."""
    mount = {"name": "model-repo", "mountPath": CONTAINER_REPO, "readOnly": True}
    if pull is not None:
        mount["subPath"] = pull.folder
    return mount


def _base_volumes(info: DeployInfo) -> list[dict[str, Any]]:
    volumes = repo_volumes(info.repo_pull, pvc_name(info), _sizing(info).repo_bytes)
    return volumes[:1] + [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{_sizing(info).shm_gib}Gi"}}] + volumes[1:]


def _repo_mount(info: DeployInfo) -> dict[str, Any]:
    return repo_mount(info.repo_pull)


def _base_mounts(info: DeployInfo) -> list[dict[str, Any]]:
    return [_repo_mount(info), {"name": "dshm", "mountPath": "/dev/shm"}]


def _init_container(info: DeployInfo) -> dict[str, Any]:
    assert info.repo_pull is not None
    return init_container(info.repo_pull)


def init_container(pull: RepoPull) -> dict[str, Any]:
    """Pull the packaged repository by digest into the pod's volume, every layer verified, its recorded versions
    checked against the serving image's (``python -m kiln.cache.fetch``)."""
    return {
        "name": "fetch-repo",
        "image": pull.init_image,
        "command": pull.command(),
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "DOCKER_CONFIG", "value": REGISTRY_AUTH_MOUNT}],
        "resources": {kind: dict(values) for kind, values in INIT_RESOURCES.items()},  # a copy per pod
        "volumeMounts": [{"name": "model-repo", "mountPath": INIT_MOUNT},
                         {"name": "registry-auth", "mountPath": REGISTRY_AUTH_MOUNT, "readOnly": True}],
        "securityContext": container_security_context(),
    }


def pod_security_context() -> dict[str, Any]:
    """Every kiln pod's securityContext: non-root uid/gid 1000 (the serving images' user), volumes owned by its
    group, the runtime's default seccomp profile (also used by `kiln sweep --executor kubernetes`)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_UID,
        "fsGroup": RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_spec(info: DeployInfo, container: dict[str, Any], volumes: list[dict[str, Any]],
              sidecar: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security_context(),
        "containers": [container] + ([{**openai_sidecar.k8s_container(info, container_security_context()),
                                       "volumeMounts": [_repo_mount(info)]}]
                                     if sidecar and info.openai is not None else []),
        "volumes": volumes,
    }
    if info.repo_pull is not None:
        spec["initContainers"] = [_init_container(info)]
    if info.gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _server_container(info: DeployInfo, command: list[str], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "triton",
        "image": info.image,
        "command": command,
        "ports": _server_ports(info),
        "env": _env(info),
        "resources": _resources(info),
        **_http_probes(info),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }


def service_name(info: DeployInfo) -> str:
    """The Service in front of the server: the recipe's name, or ``<name>-leader`` for a LeaderWorkerSet, whose
    controller creates a headless Service called like the LWS itself (for the pods' DNS names)."""
    base = k8s_name(info.recipe_name)
    return f"{base}-leader" if info.multi_node else base


def _service(info: DeployInfo, component: str) -> dict[str, Any]:
    name = service_name(info)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": _labels(info, component)},
        "spec": {
            "type": "ClusterIP",
            "selector": _selector(info, component),
            "ports": [
                {"name": "http", "port": info.http_port, "targetPort": "http", "protocol": "TCP"},
                {"name": "grpc", "port": info.grpc_port, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "metrics", "port": info.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ] + ([openai_sidecar.service_port(info)] if info.openai is not None else []),
        },
    }


def _deployment(info: DeployInfo) -> dict[str, Any]:
    container = _server_container(info, server_command(info, CONTAINER_REPO), _base_mounts(info))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": k8s_name(info.recipe_name), "labels": _labels(info, "server")},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _selector(info, "server")},
            # No surge: a second pod would need another world_size GPUs while the first still holds its own.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": _labels(info, "server"), "annotations": _prometheus(info)},
                "spec": _pod_spec(info, container, _base_volumes(info), sidecar=True),
            },
        },
    }


def render_leader_script(info: DeployInfo) -> str:
    """``leader.sh`` (multi-node): write the hostfile from the LWS variables, wait for the workers' sshd,
    then run ``launch.sh`` with ``KILN_MPI_HOSTFILE`` so that ``mpirun`` starts the remote ranks over ssh."""
    return f"""#!/usr/bin/env bash
# LeaderWorkerSet leader for kiln recipe {info.recipe_name!r}: runs rank 0 (and the ranks of this node), and
# starts the other nodes' ranks with mpirun over ssh. Pod host names come from LWS: the leader is
# <lws>-<group> and worker i is <lws>-<group>-<i>, in the subdomain of LWS_LEADER_ADDRESS.
set -euo pipefail
: "${{LWS_LEADER_ADDRESS:?not set: run this in a LeaderWorkerSet pod}}"
: "${{LWS_GROUP_SIZE:?not set: run this in a LeaderWorkerSet pod}}"
scripts="${{KILN_SCRIPTS_DIR:-/opt/kiln}}"   # the ConfigMap
keys="${{KILN_SSH_KEYS:-/etc/kiln-ssh}}"     # the Secret {ssh_secret_name(info)!r}
state="${{KILN_SSH_STATE:-/tmp/kiln-ssh}}"
wait_s="${{KILN_WORKER_WAIT_S:-{WORKER_WAIT_S}}}"
slots={info.gpus_per_node}
leader_host="${{LWS_LEADER_ADDRESS%%.*}}"
domain="${{LWS_LEADER_ADDRESS#*.}}"

mkdir -p "${{state}}"
install -m 600 "${{keys}}/id_ed25519" "${{state}}/id_ed25519"
export OMPI_MCA_plm_rsh_agent=ssh
# Host keys are made fresh by each worker at start: not checked (the group talks on the pod network only).
ssh_opts=(-p {SSH_PORT} -i "${{state}}/id_ed25519" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null)
export OMPI_MCA_plm_rsh_args="${{ssh_opts[*]}} -o LogLevel=ERROR"

hostfile="${{state}}/hostfile"
echo "$(hostname) slots=${{slots}}" > "${{hostfile}}"   # this node first: ranks 0..slots-1 run here
deadline=$((SECONDS + wait_s))
for ((i = 1; i < LWS_GROUP_SIZE; i++)); do
  worker="${{leader_host}}-${{i}}.${{domain}}"
  until (exec 3<>"/dev/tcp/${{worker}}/{SSH_PORT}") 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      echo "leader.sh: worker ${{worker}} has no sshd on port {SSH_PORT} after ${{wait_s}} s" >&2
      exit 1
    fi
    sleep 2
  done
  echo "${{worker}} slots=${{slots}}" >> "${{hostfile}}"
done
export KILN_MPI_HOSTFILE="${{hostfile}}"
exec bash "${{scripts}}/launch.sh"
"""


def render_worker_script(info: DeployInfo) -> str:
    """``worker.sh`` (multi-node): run ``sshd`` as uid 1000 on port 2222 so the leader's ``mpirun`` can start
    this node's ranks; the image must contain openssh-server (the stock NGC images do not)."""
    return f"""#!/usr/bin/env bash
# LeaderWorkerSet worker for kiln recipe {info.recipe_name!r}: an unprivileged sshd through which the leader's
# mpirun starts this node's ranks. It accepts only the key pair of Secret {ssh_secret_name(info)!r}.
set -euo pipefail
keys="${{KILN_SSH_KEYS:-/etc/kiln-ssh}}"
state="${{KILN_SSH_STATE:-/tmp/kiln-ssh}}"
sshd_bin="$(command -v sshd || echo /usr/sbin/sshd)"
if [[ ! -x "${{sshd_bin}}" ]]; then
  echo "worker.sh: no sshd in this image; multi-node serving needs openssh-server and openssh-client" \\
       "(README.md shows a two-line Dockerfile FROM the serving image)" >&2
  exit 1
fi
mkdir -p "${{state}}"
install -m 600 "${{keys}}/id_ed25519.pub" "${{state}}/authorized_keys"
rm -f "${{state}}/host_key" "${{state}}/host_key.pub"
ssh-keygen -q -t ed25519 -N '' -f "${{state}}/host_key"
exec "${{sshd_bin}}" -D -e -f /dev/null -p {SSH_PORT} -h "${{state}}/host_key" \\
  -o PidFile="${{state}}/sshd.pid" -o AuthorizedKeysFile="${{state}}/authorized_keys" \\
  -o StrictModes=no -o UsePAM=no -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no \\
  -o PermitRootLogin=no -o AllowTcpForwarding=no -o X11Forwarding=no
"""


def _multinode_image(info: DeployInfo) -> str:
    return info.multinode_image or info.image


def render_multinode_dockerfile(info: DeployInfo) -> str:
    """``Dockerfile.multinode``: the serving image plus the sshd the multi-node pods need (the stock NGC image
    has none); the LeaderWorkerSet's pods run this image, never the stock one."""
    return f"""# Multi-node serving image for kiln recipe {info.recipe_name!r}: the serving container plus OpenSSH, through
# which the leader's mpirun starts the other nodes' ranks (worker.sh runs an unprivileged sshd on port {SSH_PORT}).
# The stock NGC image has no sshd. Build and push it, then set serving.multinode_image to the pushed name:
#   docker build -f Dockerfile.multinode -t {_multinode_image(info)} .
#   docker tag {_multinode_image(info)} <registry>/<name>:<tag> && docker push <registry>/<name>:<tag>
ARG BASE_IMAGE={info.image}
FROM ${{BASE_IMAGE}}
USER root
RUN apt-get update \\
 && apt-get install -y --no-install-recommends openssh-server openssh-client \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /run/sshd
USER {RUN_AS_UID}
"""


def _leaderworkerset(info: DeployInfo) -> list[dict[str, Any]]:
    name = k8s_name(info.recipe_name)
    scripts_mount = {"name": "scripts", "mountPath": "/opt/kiln", "readOnly": True}
    ssh_mount = {"name": "mpi-ssh", "mountPath": "/etc/kiln-ssh", "readOnly": True}
    volumes = _base_volumes(info) + [
        {"name": "scripts", "configMap": {"name": _configmap_name(info), "defaultMode": 0o444}},
        # group-readable for fsGroup 1000; the scripts copy the key into a 0600 file before use
        {"name": "mpi-ssh", "secret": {"secretName": ssh_secret_name(info), "defaultMode": 0o440}},
    ]
    mounts = _base_mounts(info) + [scripts_mount, ssh_mount]
    leader = {**_server_container(info, ["bash", "/opt/kiln/leader.sh"], mounts), "image": _multinode_image(info)}
    worker = {
        "name": "worker",
        "image": _multinode_image(info),
        "command": ["bash", "/opt/kiln/worker.sh"],
        "ports": [{"name": "ssh", "containerPort": SSH_PORT, "protocol": "TCP"}],
        "env": _env(info, hub_token=False),  # its ranks load only the engine: no hub access
        "resources": _resources(info),
        # Worker pods serve no HTTP (ranks above 0 open no endpoints): their probes watch sshd.
        **_tcp_probes("ssh"),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    lws = {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {"name": name, "labels": _labels(info, "server")},
        "spec": {
            "replicas": 1,
            # Workers must start while the leader is not ready yet: the leader waits for their sshd.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": info.pods_per_group,
                # mpirun cannot survive a lost rank: restart the whole group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": _labels(info, "leader"), "annotations": _prometheus(info)},
                    "spec": _pod_spec(info, leader, volumes, sidecar=True),
                },
                "workerTemplate": {
                    "metadata": {"labels": _labels(info, "worker")},
                    "spec": _pod_spec(info, worker, volumes),
                },
            },
        },
    }
    return [lws]


def _configmap(info: DeployInfo) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": _configmap_name(info), "labels": _labels(info, "scripts")},
        "data": {
            "launch.sh": render_launch_script(info),
            "leader.sh": render_leader_script(info),
            "worker.sh": render_worker_script(info),
        },
    }


def k8s_objects(info: DeployInfo) -> dict[str, list[dict[str, Any]]]:
    """The Kubernetes objects, by file name under ``k8s/``.

    One node (``world_size <= gpus_per_node``): ``deployment.yaml`` + ``service.yaml``. Several nodes:
    ``leaderworkerset.yaml`` (one group of ``world_size / gpus_per_node`` pods, each reserving
    ``gpus_per_node`` GPUs), ``configmap.yaml`` (``launch.sh``, ``leader.sh``, ``worker.sh``) and
    ``service.yaml`` (:func:`service_name`, in front of the leader). Multi-node design, stated plainly:

    * the leader pod writes an Open MPI hostfile (itself, then ``<leader-host>-<i>.<subdomain>`` for each
      worker, from ``LWS_LEADER_ADDRESS`` and ``LWS_GROUP_SIZE``), waits for each worker's sshd, and runs
      ``launch.sh``; ``mpirun`` starts the remote ranks over ssh (port 2222, key pair from the Secret
      :func:`ssh_secret_name`, which the user creates: no key is ever written by kiln);
    * worker pods run an unprivileged ``sshd`` and nothing else until ``mpirun`` starts their ranks; this needs
      an image with ``openssh-server`` (not in the stock NGC image: README.md shows a two-line Dockerfile);
    * ``world_size`` must be a multiple of ``gpus_per_node`` (every pod is one full node: TensorRT-LLM maps a
      rank to GPU ``rank % gpus_per_node``).

    Raises :class:`InputError` when a multi-node world size does not divide into whole nodes.
    """
    if not info.multi_node:
        return {"deployment.yaml": [_deployment(info)], "service.yaml": [_service(info, "server")]}
    if info.world_size % info.gpus_per_node:
        raise InputError(
            f"deploy: parallelism.tp × parallelism.pp = {info.world_size} spans several nodes of "
            f"hardware.gpus_per_node = {info.gpus_per_node} GPUs but is not a multiple of it; make tp × pp a "
            "multiple of gpus_per_node (or set gpus_per_node to the GPUs each node really has)"
        )
    return {
        "leaderworkerset.yaml": _leaderworkerset(info),
        "configmap.yaml": [_configmap(info)],
        "service.yaml": [_service(info, "leader")],
    }


# ------------------------------------------------------------------------------------------- README


def render_readme(info: DeployInfo, repo_source: str) -> str:
    """``README.md``: how to run the files in the deploy directory."""
    h = info.http_port
    k8s_files = sorted(k8s_objects(info))
    lines = [
        f"# Deploying `{info.recipe_name}`",
        "",
        f"Image: `{info.image}`. Ranks: {info.world_size} (tp × pp); "
        + (f"{info.gpus_per_pod} GPU(s) per pod." if info.gpu else "CPU only."),
        "",
    ]
    if not info.gpu:
        lines += [
            "This is a `target: reference` build: the quantized model runs in PyTorch on the CPU inside a Triton",
            "Python model. It is a test and development vehicle, not a fast path; nothing here reserves a GPU.",
            "",
        ]
    lines += [
        "## One host: launch.sh",
        "",
        "Inside the serving image (or on a host with `tritonserver`"
        + (" and `mpirun`" if info.world_size > 1 and not info.llmapi else "")
        + "), with the repository mounted:",
        "",
        "```sh",
        f"MODEL_REPO={CONTAINER_REPO} ./launch.sh",
        "```",
        "",
        "## One host: Docker Compose",
        "",
        (f"The one-shot service `fetch-repo` pulls the repository from the remote cache by digest into the volume "
         "`model-repo` (export KILN_REGISTRY_USERNAME and KILN_REGISTRY_PASSWORD first unless the registry allows "
         "anonymous pulls); Triton starts once it has completed." if info.repo_pull is not None else
         f"The repository is mounted read-only from `{repo_source}` (relative to this directory)."),
        "",
        "```sh",
        "docker compose up -d" + ("   # export HF_TOKEN first" if info.hub_token_secret else ""),
        f"curl -fsS localhost:{h}/v2/health/ready && echo ready",
        (f"curl -s localhost:{h}/v2/models/tensorrt_llm/generate -d '{{\"text_input\": \"Hello\", "
         "\"sampling_param_max_tokens\": 32}'" if info.llmapi else
         f"curl -s localhost:{h}/v2/models/ensemble/generate -d '{{\"text_input\": \"Hello\", \"max_tokens\": 32}}'"),
        "```",
        "",
        "## Kubernetes",
        "",
        f"Files: {', '.join(f'`k8s/{f}`' for f in k8s_files)}. The pods run as uid 1000 (the image's "
        "`triton-server` user) without privileges.",
        "",
    ]
    lines += _readme_repository(info)
    if info.hub_token_secret:
        lines.append(
            f"1. Create the Secret: `kubectl create secret generic {info.hub_token_secret} --from-literal=HF_TOKEN=...`"
        )
    if info.multi_node:
        lines += [
            "1. Install the LeaderWorkerSet controller (https://lws.sigs.k8s.io) in the cluster.",
            "1. Build an image with ssh (the stock serving image has no `sshd`) and set it as `image:` in both",
            "   templates of `k8s/leaderworkerset.yaml`:",
            "",
            "   ```dockerfile",
            f"   FROM {info.image}",
            "   RUN apt-get update && apt-get install -y --no-install-recommends openssh-server openssh-client \\",
            "       && rm -rf /var/lib/apt/lists/*",
            "   ```",
            "",
            "1. Create the key pair `mpirun` uses between the pods (kiln never writes keys):",
            "",
            "   ```sh",
            "   ssh-keygen -t ed25519 -N '' -f mpi_ssh",
            f"   kubectl create secret generic {ssh_secret_name(info)} \\",
            "     --from-file=id_ed25519=mpi_ssh --from-file=id_ed25519.pub=mpi_ssh.pub",
            "   ```",
            "",
            f"   Each group has {info.pods_per_group} pods of {info.gpus_per_node} GPUs. The leader waits for every",
            f"   worker's sshd (port {SSH_PORT}), writes an Open MPI hostfile and runs `launch.sh`; rank 0 serves.",
            "   Pods of a group must reach each other on any TCP port (Open MPI and NCCL); set NCCL",
            "   interface variables for your network in the templates if needed.",
        ]
    lines += [
        "1. Apply and try it:",
        "",
        "   ```sh",
        "   kubectl apply -f k8s/",
        f"   kubectl port-forward svc/{service_name(info)} {h}:{h}",
        f"   curl -fsS localhost:{h}/v2/health/ready && echo ready",
        "   ```",
        "",
        f"Prometheus scrapes the {'leader ' if info.multi_node else ''}pod's metrics port {info.metrics_port} "
        "through the `prometheus.io/*` annotations.",
        "",
    ]
    lines += _readme_sizing(info)
    lines += openai_sidecar.readme_section(info)
    return "\n".join(lines)


def _readme_repository(info: DeployInfo) -> list[str]:
    """README steps that put the repository where the pods read it."""
    pull = info.repo_pull
    pvc = (f"a PersistentVolumeClaim `{pvc_name(info)}` holding the model repository at its root"
           + (" (`ReadOnlyMany` or `ReadWriteMany`: every pod of the group mounts it)" if info.multi_node else ""))
    if pull is None:
        return [f"1. The repository comes from a volume you fill (no `cache.remote` was set, e.g. an air-gapped "
                f"cluster): create {pvc}. With `kiln build --cache oci://…` the pods pull it themselves instead."]
    host = pull.cache.split("://", 1)[1].split("/", 1)[0]
    return [
        f"1. Create the registry Secret (the only object made by hand; skip it if `{host}` allows anonymous pulls):",
        "",
        "   ```sh",
        f"   kubectl create secret docker-registry {pull.registry_secret} --docker-server={host} \\",
        "     --docker-username=... --docker-password=...",
        "   ```",
        "",
        f"   Every pod's init container `fetch-repo` ({pull.init_image}) pulls the packaged repository `{pull.tag}`",
        f"   by its digest `{pull.digest}` from `{pull.cache}` into "
        + (f"the PersistentVolumeClaim `{pull.cache_pvc}` (one folder per digest, reused by later pods)"
           if pull.cache_pvc else "the pod's emptyDir")
        + ", verifies every layer and refuses a repository whose recorded versions disagree with the serving "
          "image's. The Secret is mounted as its Docker config, never copied into a file kiln writes.",
        "" if not info.repo_pull or pull.init_image.count("@") else
        f"   The init image is not pinned: build it with `docker build -f deploy/{info.recipe_name}/Dockerfile.init "
        f"-t {pull.init_image} .`, push it, and set `serving.init_image` to `name@sha256:…`.",
        "",
        f"   Option for air-gapped clusters: package without `cache.remote` and fill {pvc} by hand instead.",
        "",
    ]


def _readme_sizing(info: DeployInfo) -> list[str]:
    z = _sizing(info)
    gib = 1 << 30
    return [
        "## Sizing (from the plan: kiln.plan.host)",
        "",
        f"Serving container: {z.cpu} CPU requested ({2 * z.cpu} limit), {z.host_memory_bytes / gib:.1f} GiB memory "
        f"(request = limit), /dev/shm {z.shm_gib} GiB; start-up probe allows {z.startup_seconds} s. {z.basis}.",
        "",
        "- host memory = 2 GiB server base + weights staged on the way to the GPUs "
        f"({z.weights_bytes / gib:.2f} GiB: heaviest rank × ranks on the pod) + 512 MiB per Python model + "
        "vocabulary × 2 KiB per tokenizer + /dev/shm (memory-backed, counted against the limit)",
        "- /dev/shm = 1 GiB (Python-backend tensors) + 512 MiB per GPU when the pod has more than one (NCCL)",
        f"- load time = weights ÷ 500 MB/s = {z.load_seconds:.0f} s; start-up probe = 300 s + 3 × load time",
        f"- pull time (init step) = repository ÷ 100 MB/s = {z.pull_seconds:.0f} s "
        f"({z.repo_bytes / gib:.2f} GiB)",
        "- CPU = 2 + 2 per GPU; the OpenAI sidecar 0.5 (limit 1) CPU, 512 MiB; the init step 0.5 (limit 1) CPU, "
        "256 MiB (limit 512 MiB)",
        "",
    ]


#: What the init image installs besides kiln (with --no-deps): the third-party packages kiln.cache imports. The
#: OpenAI sidecar's list is no substitute: it lacks `requests`. A test keeps this equal to kiln.cache's imports.
INIT_PACKAGES = ("requests>=2.28",)
INIT_BASE_IMAGE = "python:3.11-slim"


def render_init_dockerfile(info: DeployInfo) -> str:
    """``Dockerfile.init``: the image of the init step (``python -m kiln.cache.fetch``), built from a kiln source
    tree: kiln without its dependencies, plus what :mod:`kiln.cache` imports."""
    assert info.repo_pull is not None
    packages = " ".join(f'"{p}"' for p in INIT_PACKAGES)
    return "\n".join([
        f"# The init step of recipe {info.recipe_name!r}'s deploy files: pulls the packaged repository from the remote",
        "# cache by digest and verifies it (python -m kiln.cache.fetch). Build it from the root of a kiln source tree,",
        "# push it, and pin it by digest in serving.init_image:",
        f"#   docker build -f deploy/{info.recipe_name}/Dockerfile.init -t {info.repo_pull.init_image} .",
        f"FROM {INIT_BASE_IMAGE}",
        "COPY pyproject.toml README.md /opt/kiln/",
        "COPY src /opt/kiln/src",
        f"RUN pip install --no-cache-dir {packages} \\",
        "    && pip install --no-cache-dir --no-deps /opt/kiln",
        f"USER {RUN_AS_UID}:{RUN_AS_UID}",
        "",
    ])


# -------------------------------------------------------------------------------------------- writing


class _Dumper(yaml.SafeDumper):
    """Block-style YAML without anchors/aliases (shared sub-objects are written out in full)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump_yaml(docs: Iterable[dict[str, Any]], header: str = "") -> str:
    body = yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return header + body


def _k8s_header(info: DeployInfo) -> str:
    lines = [f"# kiln recipe {info.recipe_name!r}. Written by kiln; change the recipe and package again, don't edit."]
    if not info.gpu:
        lines.append(_REFERENCE_NOTE)
    return "\n".join(lines) + "\n"


def _repo_source(out_dir: Path, info: DeployInfo, model_repo: Path | str | None) -> str:
    repo = Path(model_repo) if model_repo is not None else out_dir.parent.parent / "triton_repo" / info.recipe_name
    rel = os.path.relpath(repo.resolve(), out_dir.resolve())
    return rel if rel.startswith(("../", "/")) or rel == ".." else f"./{rel}"


def write_deploy_files(info: DeployInfo, out_dir: Path, *, model_repo: Path | str | None = None) -> list[Path]:
    """Write ``launch.sh`` (executable), ``docker-compose.yml``, ``k8s/*.yaml`` and ``README.md`` into
    ``out_dir``; return the paths written.

    ``model_repo`` is the model repository on this machine; compose mounts it by its path relative to
    ``out_dir``. Default: ``<out_dir>/../../triton_repo/<recipe>`` (``deploy/<recipe>`` beside
    ``triton_repo/<recipe>``). kiln's own ``k8s/`` files left from an earlier run are removed.
    """
    out_dir = Path(out_dir)
    k8s_dir = out_dir / "k8s"
    k8s_dir.mkdir(parents=True, exist_ok=True)
    repo_source = _repo_source(out_dir, info, model_repo)
    objects = k8s_objects(info)  # raises InputError before anything is written

    written: list[Path] = []
    launch = out_dir / "launch.sh"
    launch.write_text(render_launch_script(info), encoding="utf-8")
    launch.chmod(0o755)
    written.append(launch)

    compose = out_dir / "docker-compose.yml"
    compose.write_text(_dump_yaml([compose_spec(info, repo_source)], _compose_header(info)), encoding="utf-8")
    written.append(compose)

    for stale in K8S_FILES:
        if stale not in objects:
            (k8s_dir / stale).unlink(missing_ok=True)
    for file_name, docs in objects.items():
        path = k8s_dir / file_name
        path.write_text(_dump_yaml(docs, _k8s_header(info)), encoding="utf-8")
        written.append(path)

    for name, text in (("Dockerfile.multinode", render_multinode_dockerfile(info) if info.multi_node else None),
                       ("Dockerfile.init", render_init_dockerfile(info) if info.repo_pull is not None else None),
                       ("Dockerfile.openai", openai_sidecar.render_dockerfile(info) if info.openai is not None
                        else None)):
        dockerfile = out_dir / name
        if text is not None:
            dockerfile.write_text(text, encoding="utf-8")
            written.append(dockerfile)
        else:
            dockerfile.unlink(missing_ok=True)

    readme = out_dir / "README.md"
    readme.write_text(render_readme(info, repo_source), encoding="utf-8")
    written.append(readme)
    return written

