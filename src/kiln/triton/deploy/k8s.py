"""The Kubernetes objects of the deploy files: a Deployment and Service, or a LeaderWorkerSet with its ConfigMap
when the ranks span nodes; pods hardened, sized from the plan and fed by the init step that pulls the packaged
repository. :func:`k8s_objects` gives them all. See :mod:`kiln.triton.deploy`."""

from __future__ import annotations

from typing import Any


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
    SSH_PORT,
    WORKER_WAIT_S,
    DeployInfo,
    k8s_name,
)
from kiln.triton.deploy.launch import render_launch_script, server_command
from kiln.util.errors import InputError


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
        "startupProbe": get("/v2/health/ready", 10, -(-pod_sizing(info).startup_seconds // 10)),
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


def pod_sizing(info: DeployInfo) -> PodSizing:
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
    sizing = pod_sizing(info)
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
    volumes = repo_volumes(info.repo_pull, pvc_name(info), pod_sizing(info).repo_bytes)
    return volumes[:1] + [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{pod_sizing(info).shm_gib}Gi"}}] + volumes[1:]


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
