"""Render the deployment files: ``launch.sh``, ``docker-compose.yml``, ``k8s/*.yaml`` and ``README.md``.

:func:`write_deploy_files` writes them all; the ``render_*`` functions give their content, the serving command and
``launch.sh`` come from :mod:`~kiln.triton.deploy.launch`, the Kubernetes objects from :mod:`~kiln.triton.deploy.k8s`. See :mod:`kiln.triton.deploy` for what each file does and where the facts come from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from kiln.triton.deploy import openai_sidecar

from kiln.triton.deploy.info import (
    CONTAINER_REPO,
    INIT_MOUNT,
    RUN_AS_UID,
    SSH_PORT,
    DeployInfo,
    k8s_name,
)

from kiln.triton.deploy.k8s import (
    k8s_objects,
    pod_sizing,
    pvc_name,
    render_multinode_dockerfile,
    service_name,
    ssh_secret_name,
)
from kiln.triton.deploy.launch import render_launch_script, server_command

#: Files kiln writes under ``k8s/``; any of them left from an earlier package run is removed.
K8S_FILES = ("deployment.yaml", "service.yaml", "leaderworkerset.yaml", "configmap.yaml")

_REFERENCE_NOTE = "# target: reference -- the CPU test and development vehicle, not a fast path; no GPU is reserved."

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
        "shm_size": f"{pod_sizing(info).shm_gib}gb",
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
    z = pod_sizing(info)
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

