"""Deployment files for a packaged Triton model repository: a launch script, Docker Compose, Kubernetes.

:func:`write_deploy_files` writes, into a deploy directory next to the model repository:

``launch.sh``
    Starts the server. One ``tritonserver`` when the engine has one rank; otherwise TensorRT-LLM's *leader
    mode*: ``mpirun`` starts one ``tritonserver`` per rank, rank 0 loads the whole repository and serves
    HTTP/gRPC/metrics, ranks above 0 load only the ``tensorrt_llm`` model(s)
    (``--model-control-mode=explicit --load-model=...``), and every rank gets its own Python-backend
    shared-memory prefix (``--backend-config=python,shm-region-prefix-name=prefix<rank>_``).
``docker-compose.yml``
    One service on one host: the serving image, ``world_size`` GPUs reserved, the repository mounted
    read-only at ``/models``, health check on ``/v2/health/ready``.
``k8s/*.yaml``
    ``world_size <= gpus_per_node``: a Deployment (one pod holding every rank) and a Service. Otherwise a
    LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``): groups of ``world_size / gpus_per_node`` pods, one per
    node, the leader running ``mpirun`` across the group over ssh (see :func:`k8s_objects`), a ConfigMap
    with the scripts, and a Service in front of the leader.
``README.md``
    How to run each of them.

Modules: :mod:`~kiln.triton.deploy.info` (:class:`DeployInfo`, names), :mod:`~kiln.triton.deploy.launch` (the
serving command, ``launch.sh``), :mod:`~kiln.triton.deploy.k8s` (the Kubernetes objects),
:mod:`~kiln.triton.deploy.render` (Compose, the README, the files written) and :mod:`~kiln.triton.deploy.validate`
(:func:`validate_manifests`). Their public names are importable from here.

:func:`validate_manifests` checks Kubernetes files offline: core kinds against the schemas bundled with
``kubernetes-validate`` in strict mode (unknown fields are errors); the LeaderWorkerSet, for which it has no
schema, by kiln's own checks of the LWS fields plus strict validation of its pod templates as core
``PodTemplate`` objects; and kiln's policy for every pod (probes, non-root, no secret values inline).

Sources (read with the search tools; nothing copied):

* Per-rank flags: ``triton-inference-server/tensorrtllm_backend`` @ c2e65b8 ``scripts/launch_triton_server.py``.
  kiln adds ``--allow-http=false --allow-grpc=false --allow-metrics=false`` on ranks above 0, as NVIDIA's
  multi-node example does (``kubernetes-sigs/lws`` ``docs/examples/tensorrt-llm/build/server.py``, adapted
  from ``triton-inference-server/tutorials`` EKS_Multinode_Triton_TRTLLM): every rank would otherwise be
  told to bind the same three ports.
* LeaderWorkerSet fields, enums, pod host names and injected variables (``LWS_LEADER_ADDRESS`` =
  ``<lws>-<group>.<subdomain>.<namespace>``, ``LWS_GROUP_SIZE``): ``kubernetes-sigs/lws``
  ``api/leaderworkerset/v1/leaderworkerset_types.go`` and ``pkg/utils/pod/pod_utils.go`` @ 060ab4da.
* The serving images have a user ``triton-server`` with uid/gid 1000 (``triton-inference-server/server``
  ``build.py``: "Make sure that this user is given ID 1000") and no ``sshd`` (``openssh-server`` is only
  installed for the retired FasterTransformer backend): multi-node pods run the derived image kiln's
  ``Dockerfile.multinode`` describes (the serving image plus OpenSSH), never the stock one.
* Draft+target decoding with tp × pp > 1 runs in TensorRT-LLM's orchestrator mode: ``TRTLLM_ORCHESTRATOR=1``
  and the Triton flags of upstream's ``launch_triton_server.py --multi-model`` (TensorRT-LLM
  ``triton_backend/scripts/launch_triton_server.py`` @ 0a2e2c1f; ``examples/draft_target_model/README.md``:
  "--multi-model is necessary if TP mode is used").
* Docker settings (``--shm-size``, ``--ulimit memlock=-1 --ulimit stack=67108864``): NVIDIA's container
  guidance for Triton / TensorRT-LLM.
"""

from kiln.triton.deploy.info import (
    CONTAINER_REPO,
    LWS_API_VERSION,
    LWS_KIND,
    NAME_MAX,
    RUN_AS_UID,
    SHM_SIZE_GIB,
    SSH_PORT,
    WORKER_WAIT_S,
    DeployInfo,
    k8s_name,
    multinode_image_name,
)
from kiln.triton.deploy.k8s import (
    container_security_context,
    k8s_objects,
    pod_security_context,
    pvc_name,
    render_leader_script,
    render_multinode_dockerfile,
    render_worker_script,
    service_name,
    ssh_secret_name,
)
from kiln.triton.deploy.launch import (
    ORCHESTRATOR_ENV,
    launch_command,
    mpirun_command,
    render_launch_script,
    server_command,
)
from kiln.triton.deploy.render import (
    K8S_FILES,
    compose_spec,
    render_readme,
    write_deploy_files,
)
from kiln.triton.deploy.validate import (
    MIN_KUBERNETES_VERSION,
    SECRETISH_ENV,
    default_kubernetes_versions,
    validate_manifests,
)

__all__ = [
    "CONTAINER_REPO",
    "K8S_FILES",
    "LWS_API_VERSION",
    "LWS_KIND",
    "MIN_KUBERNETES_VERSION",
    "NAME_MAX",
    "RUN_AS_UID",
    "SECRETISH_ENV",
    "SHM_SIZE_GIB",
    "SSH_PORT",
    "WORKER_WAIT_S",
    "DeployInfo",
    "compose_spec",
    "container_security_context",
    "default_kubernetes_versions",
    "k8s_name",
    "k8s_objects",
    "multinode_image_name",
    "ORCHESTRATOR_ENV",
    "render_multinode_dockerfile",
    "launch_command",
    "mpirun_command",
    "pod_security_context",
    "pvc_name",
    "render_launch_script",
    "render_leader_script",
    "render_readme",
    "render_worker_script",
    "server_command",
    "service_name",
    "ssh_secret_name",
    "validate_manifests",
    "write_deploy_files",
]
