"""kiln's OpenAI-compatible server as a sidecar of the deployed Triton server (``serving.openai_sidecar``).

The sidecar is the same app as ``kiln serve --openai`` (``python -m kiln.serve.openai``), next to Triton: a
second Compose service, a second container in the Kubernetes pod (the Deployment's, or the LeaderWorkerSet
leader's, where rank 0 serves). It reaches Triton's gRPC port (``triton:<port>`` in Compose, ``127.0.0.1`` in the
pod) and reads the model repository, mounted read-only at ``/models`` like Triton's, for the served name, chat
template and tokenizer. Its image is ``serving.openai_image``, or ``kiln-openai:<kiln version>`` built with the
``Dockerfile.openai`` written beside the deploy files: kiln without its build dependencies (torch, ModelOpt)
plus the server's (Starlette, uvicorn, tritonclient, tokenizers, Jinja2) on a slim Python image.

Triton's own OpenAI-compatible frontend (``/opt/tritonserver/python/openai`` in the NGC images) is the
alternative the README describes: it runs Triton in-process, single rank, so it fits one-GPU engines only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.util.errors import InputError

if TYPE_CHECKING:
    from kiln.triton.deploy.info import DeployInfo

#: The sidecar's base image (any Python 3.10+ with pip works).
SIDECAR_BASE_IMAGE = "python:3.11-slim"
#: What the sidecar image installs besides kiln itself (installed with --no-deps).
SIDECAR_PACKAGES = ("starlette>=0.40", "uvicorn>=0.30", "uvloop>=0.19", "httptools>=0.6", "jinja2>=3.1", "tokenizers>=0.20", "tritonclient[grpc]>=2.50",
                    "numpy>=1.24,<2", "protobuf>=4")


@dataclass(frozen=True)
class OpenAISidecar:
    """The sidecar's settings: image, port and the Triton model it calls."""

    image: str
    port: int
    triton_model: str = "ensemble"

    def __post_init__(self) -> None:
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise InputError(f"deploy: {self.image!r} is not a container image reference (serving.openai_image)")
        if not 1 <= self.port <= 65_535:
            raise InputError(f"deploy: serving.openai_port is {self.port}; use a port between 1 and 65535")


def default_image() -> str:
    from kiln import __version__

    return f"kiln-openai:{__version__}"


def sidecar_command(info: DeployInfo, triton_host: str) -> list[str]:
    assert info.openai is not None
    return ["python3", "-m", "kiln.serve.openai", "--triton-url", f"{triton_host}:{info.grpc_port}",
            "--triton-model", info.openai.triton_model, "--repo", "/models", "--host", "0.0.0.0",
            "--port", str(info.openai.port)]


def compose_service(info: DeployInfo, repo_source: str) -> dict[str, Any]:
    """The ``openai`` Compose service (started once Triton is healthy)."""
    from kiln.triton.deploy.info import CONTAINER_REPO, RUN_AS_UID

    assert info.openai is not None
    port = info.openai.port
    probe = f"import urllib.request; urllib.request.urlopen('http://localhost:{port}/health', timeout=4)"
    return {
        "image": info.openai.image,
        "command": sidecar_command(info, "triton"),
        "user": f"{RUN_AS_UID}:{RUN_AS_UID}",
        "init": True,
        "environment": ["HOME=/tmp"],
        "ports": [f"{port}:{port}"],
        "volumes": [{"type": "bind", "source": repo_source, "target": CONTAINER_REPO, "read_only": True}],
        "depends_on": {"triton": {"condition": "service_healthy"}},
        "healthcheck": {"test": ["CMD", "python3", "-c", probe], "interval": "15s", "timeout": "5s", "retries": 3},
    }


def k8s_container(info: DeployInfo, security: dict[str, Any]) -> dict[str, Any]:
    """The ``openai`` container of the serving pod: ready when Triton's model is (``/health``), alive when it
    listens (Triton may take many minutes to load)."""
    from kiln.triton.deploy.info import CONTAINER_REPO

    assert info.openai is not None

    def tcp(period: int, failures: int) -> dict[str, Any]:
        return {"tcpSocket": {"port": "openai"}, "periodSeconds": period, "timeoutSeconds": 5,
                "failureThreshold": failures}

    return {
        "name": "openai",
        "image": info.openai.image,
        "command": sidecar_command(info, "127.0.0.1"),
        "ports": [{"name": "openai", "containerPort": info.openai.port, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
        "startupProbe": tcp(5, 60),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "openai"}, "periodSeconds": 10,
                           "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": tcp(15, 4),
        "volumeMounts": [{"name": "model-repo", "mountPath": CONTAINER_REPO, "readOnly": True}],
        "securityContext": security,
    }


def service_port(info: DeployInfo) -> dict[str, Any]:
    assert info.openai is not None
    return {"name": "openai", "port": info.openai.port, "targetPort": "openai", "protocol": "TCP"}


def render_dockerfile(info: DeployInfo) -> str:
    """``Dockerfile.openai``: the sidecar image, built from a kiln source tree."""
    from kiln.triton.deploy.info import RUN_AS_UID

    assert info.openai is not None
    packages = " ".join(f'"{p}"' for p in SIDECAR_PACKAGES)
    return "\n".join([
        f"# kiln's OpenAI-compatible server, the sidecar of recipe {info.recipe_name!r}'s Triton server.",
        "# Build it from the root of a kiln source tree (then push it where your cluster pulls images):",
        f"#   docker build -f deploy/{info.recipe_name}/Dockerfile.openai -t {info.openai.image} .",
        f"FROM {SIDECAR_BASE_IMAGE}",
        "COPY pyproject.toml README.md /opt/kiln/",
        "COPY src /opt/kiln/src",
        f"RUN pip install --no-cache-dir {packages} \\",
        "    && pip install --no-cache-dir --no-deps /opt/kiln",
        f"USER {RUN_AS_UID}:{RUN_AS_UID}",
        f"EXPOSE {info.openai.port}",
        "",
    ])


def readme_section(info: DeployInfo) -> list[str]:
    """README.md lines: the sidecar, how to build its image, and Triton's own frontend as the alternative."""
    h = info.http_port
    if info.openai is None:
        lines = ["## OpenAI-compatible API", "",
                 "The sidecar is off (`serving.openai_sidecar: false`). Run `kiln openai --triton-url HOST:"
                 f"{info.grpc_port} --repo REPO` next to the server, or use Triton's own frontend (below).", ""]
    else:
        p = info.openai.port
        lines = [
            "## OpenAI-compatible API (sidecar)",
            "",
            f"kiln's OpenAI server runs beside Triton (Compose service `openai`, container `openai` in the pod) on port "
            f"{p}, calling the Triton model `{info.openai.triton_model}`. Build its image once from a kiln checkout:",
            "",
            "```sh",
            f"docker build -f deploy/{info.recipe_name}/Dockerfile.openai -t {info.openai.image} .",
            "```",
            "",
            "Then, once the server is ready:",
            "",
            "```sh",
            f"curl -s localhost:{p}/v1/models",
            f"curl -s localhost:{p}/v1/completions -H 'Content-Type: application/json' \\",
            f"  -d '{{\"model\": \"{info.recipe_name}\", \"prompt\": \"Hello\", \"max_tokens\": 32, \"temperature\": 0}}'",
            "```",
            "",
        ]
    lines += [
        "Alternative: Triton's own OpenAI-compatible frontend, in the serving image at `/opt/tritonserver/python/"
        "openai` (docs.nvidia.com, Triton user guide, client_guide/openai_readme). It starts Triton in-process from "
        "the model repository instead of `launch.sh` (`cd /opt/tritonserver/python/openai && python3 "
        "openai_frontend/main.py --model-repository /models --tokenizer /models/preprocessing/1/tokenizer`; port "
        f"9000) with one rank, so it fits engines of one GPU (tp × pp = 1); Triton's own HTTP endpoint (port {h}) "
        "is then not served unless enabled there.",
        "",
    ]
    return lines
